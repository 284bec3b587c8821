"""Restart connect time with the source map cache, through `TransferGroup` and the controller.

`bench_probe.py --restart` runs it: two sessions of `controller.MeshTransfer` one after the
other (procs, `TransferGroup` and actors spawned afresh each time, as a restarted job would),
both with ``TransferConfig(source_map_cache=<a new temporary directory>, plan_cache=<one in
it>)``. The first connect finds the directories empty, probes every worker and plans; the
second finds every worker's map, runs the verification pass alone and reads the plan back
(`weightbridge.coordination.plan_cache`). Each session then moves one version and checks every
rollout parameter against its own ``load_weights`` (bit for bit, by checksum), so a reused map
is shown to move the right bytes. ``connect`` is timed from the controller (probe, plan, round
buffers, handles; the link probe is skipped: a fixed link rate is given); spawning is not in it.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from weightbridge import TransferConfig
from weightbridge.driver import RolloutSpec, TrainerSpec

TRAINER, ROLLOUT = "nodes=1,gpus=2,tp=2", "engines=1,nodes=1,gpus=2,tp=2"
TARGET = 0.3
"""Issue 41: restart connect <= 0.3x the first connect."""


def _entries(directory: Path, pattern: str = "*.json") -> dict[str, int]:
    """Entry name -> inode: an entry written again is a new file renamed over the old one (a
    read of a plan entry touches its mtime, so the mtime would not tell)."""
    return {p.name: p.stat().st_ino for p in directory.glob(pattern)}


def session(model: str, config: TransferConfig) -> tuple[float, bool, str]:
    """(connect seconds, every rollout parameter matched after one update, connect's steps)."""
    from controller.driver import MeshTransfer  # imports monarch

    with MeshTransfer(TrainerSpec.parse(TRAINER), RolloutSpec.parse(ROLLOUT), model,
                      config=config, link_rate=1e9) as mt:
        t0 = time.perf_counter()
        mt.connect()
        connect_s = time.perf_counter() - t0
        steps = str(mt.connect_steps)
        report = mt.update(1)
    return connect_s, not report.mismatched, steps


def run_restart(model: str, trainer_restore: str = TransferConfig().trainer_restore
                ) -> list[str]:
    """Two sessions on one new cache directory; the lines to print."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with tempfile.TemporaryDirectory(prefix="wb-maps-") as directory:
        plans = Path(directory) / "plans"
        config = TransferConfig(source_map_cache=directory, plan_cache=str(plans),
                                trainer_restore=trainer_restore)
        first_s, first_ok, first_steps = session(model, config)
        kept, kept_plans = _entries(Path(directory)), _entries(plans, "*.plan")
        again_s, again_ok, again_steps = session(model, config)
        rewritten = sum(_entries(Path(directory)).get(k) != t for k, t in kept.items())
        replanned = _entries(plans, "*.plan") != kept_plans
    ratio = again_s / first_s
    return [f"model {model}: trainer [{TRAINER}], rollout [{ROLLOUT}], source map entries "
            f"{len(kept)}, plan entries {len(kept_plans)}, trainer_restore={trainer_restore!r}",
            f"first connect (probe every worker, plan, buffers): {first_s:.2f} s; one update "
            f"{'bit-exact' if first_ok else 'MISMATCHED'}",
            f"  {first_steps}",
            f"restart connect (kept maps verified, kept plan read, buffers): {again_s:.2f} s; "
            f"map entries rewritten {rewritten}, planned again {'yes' if replanned else 'no'}; "
            f"one update {'bit-exact' if again_ok else 'MISMATCHED'}",
            f"  {again_steps}",
            f"restart / first = {ratio:.2f} (target <= {TARGET})"]
