"""Round size sweep: EWTT and transfer time per round buffer size, on one pair of proc meshes.

    .venv/bin/python benchmarks/round_size.py                       # medium model, ~1-2 min
    .venv/bin/python benchmarks/round_size.py --sizes-kib 512 8192 --updates 3 --model tiny

What `weightbridge.config.DEFAULT_ROUND_BYTES` is weighed against: per-round fixed costs (a
control message per step, one pack and one assemble launch per worker) dominate small rounds;
bigger rounds cost round-buffer memory and, where links bound the transfer, a longer pipeline
fill and drain (a model smaller than two rounds per worker has no pipeline at all). Results
and what they do and do not support: docs/performance.md, "Round size".

One trainer and one rollout proc mesh on this host (``--trainer`` / ``--rollout``, default two
TP ranks -> two one-proc engines, so four procs fit a two-core machine). Every round size gets
its own `MeshTransfer` on those procs, all connected up front; then ``--warmup`` updates and
``--updates`` measured updates per size, interleaved (the order rotates each pass: a slow spell
of this shared machine hits every size alike). Each update is verified bit-exact (a mismatch
exits 1). Prints, per size, the median EWTT (the actors' own timestamps) and the median
transfer time (the controller's wall clock), each as a ratio to the best size's, and the bytes
moved over RDMA per update.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from controller.driver import MeshTransfer  # noqa: E402
from meshes.qwen3_moe import SIZES, checkpoint_spec  # noqa: E402
from weightbridge.specs import TrainerSpec  # noqa: E402
from weightbridge.specs import RolloutSpec
from weightbridge import TransferConfig  # noqa: E402
from weightbridge.config import ROUND_CONTROLS  # noqa: E402
from weightbridge.mesh.transport import configure_transport  # noqa: E402

SIZES_KIB = (256, 1024, 4096, 8192, 16384)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(SIZES), default="medium")
    parser.add_argument("--trainer", default="nodes=1,gpus=2,tp=2")
    parser.add_argument("--rollout", default="engines=2,nodes=1,gpus=1")
    parser.add_argument("--sizes-kib", type=int, nargs="+", default=list(SIZES_KIB),
                        help="round buffer sizes per worker, KiB")
    parser.add_argument("--depth", type=int, default=TransferConfig().depth,
                        help="round buffers per worker (default: TransferConfig's)")
    parser.add_argument("--round-control", nargs="+", choices=ROUND_CONTROLS,
                        default=[TransferConfig().round_control],
                        help="how the controller drives the rounds (TransferConfig."
                             "round_control); two: each size runs both, interleaved")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured updates per size")
    parser.add_argument("--updates", type=int, default=7, help="measured updates per size")
    args = parser.parse_args()
    tspec, rspec = TrainerSpec.parse(args.trainer), RolloutSpec.parse(args.rollout)
    try:
        configs = {(kib, how): TransferConfig(round_bytes=kib << 10, depth=args.depth,
                                              round_control=how)
                   for kib in args.sizes_kib for how in args.round_control}
        tspec.validate(SIZES[args.model])
        rspec.validate(SIZES[args.model])
        if args.updates < 1 or args.warmup < 0:
            raise ValueError("--updates must be >= 1 and --warmup >= 0")
    except ValueError as e:
        parser.error(str(e))
    spec = checkpoint_spec(SIZES[args.model])
    both = len(args.round_control) > 1
    width = 17 if both else 10
    print(f"model {args.model}: {spec.numel * 2 / 1e6:.1f} MB bf16; trainer [{args.trainer}] "
          f"-> rollout [{args.rollout}]; depth {args.depth}; {args.warmup} warm-up + "
          f"{args.updates} measured updates per size, interleaved", flush=True)
    from monarch.actor import this_host

    t_start = time.perf_counter()
    configure_transport()  # before spawning: children read the config at start-up
    meshes, runs = [], {}
    ewtt: dict[tuple, list[float]] = {key: [] for key in configs}
    wall: dict[tuple, list[float]] = {key: [] for key in configs}
    moved: dict[tuple, int] = {}
    try:
        host = this_host()
        meshes.append(host.spawn_procs(per_host={"worker": tspec.num_workers}, name="trainer"))
        meshes.append(host.spawn_procs(per_host={"worker": rspec.num_workers}, name="rollout"))
        for key, config in configs.items():
            t0 = time.perf_counter()
            mt = MeshTransfer(tspec, rspec, args.model, config=config, procs=tuple(meshes))
            runs[key] = mt.__enter__()
            plan = mt.connect()
            print(f"  {_label(key, both)}: connect {time.perf_counter() - t0:.1f}s, "
                  f"{plan.num_rounds} rounds", flush=True)
        sizes = list(configs)
        for n in range(args.warmup + args.updates):
            order = sizes[n % len(sizes):] + sizes[:n % len(sizes)]
            for key in order:
                report = runs[key].update(n + 1)
                if report.mismatched:
                    print(f"{_label(key, both)}: {report.line()}")
                    return 1
                if n >= args.warmup:
                    ewtt[key].append(report.timing.ewtt_s)
                    wall[key].append(report.transfer_s)
                    moved[key] = report.rdma_bytes
            print(f"  pass {n + 1}/{args.warmup + args.updates}"
                  f"{' (warm-up)' if n < args.warmup else ''} done", flush=True)
    finally:
        for mt in runs.values():
            mt.close()
        for mesh in meshes:
            mesh.stop().get(timeout=60)
    med_e = {key: statistics.median(xs) for key, xs in ewtt.items()}
    med_w = {key: statistics.median(xs) for key, xs in wall.items()}
    best_e, best_w = min(med_e.values()), min(med_w.values())
    print(f"median of {args.updates} updates per run (all bit-exact); ratios against the "
          f"best size")
    print(f"{'round size':>{width}}  {'EWTT':>8}  {'x best':>6}  {'transfer':>8}  {'x best':>6}  "
          f"{'RDMA bytes per update':>24}")
    for key in configs:
        print(f"{_label(key, both):>{width}}  {med_e[key]:7.3f}s  {med_e[key] / best_e:5.2f}x  "
              f"{med_w[key]:7.3f}s  {med_w[key] / best_w:5.2f}x  "
              f"{moved[key]:>13,} ({moved[key] / 1e6:6.2f} MB)", flush=True)
    print(f"total {time.perf_counter() - t_start:.0f}s")
    return 0


def _label(key: tuple[int, str], both: bool) -> str:
    """A run's name in the table: its round size, and how its rounds are driven when the
    run compares both ways."""
    kib, how = key
    size = f"{kib >> 10} MiB" if kib % 1024 == 0 else f"{kib} KiB"
    return f"{size} {how}" if both else size


if __name__ == "__main__":
    sys.exit(main())
