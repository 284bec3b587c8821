"""A Monarch RL loop on the adapters: trainers take steps, rollout engines generate continuously.

    python examples/rl_loop.py                  # all four modes, 3 versions each
    python examples/rl_loop.py --mode async --versions 5

The trainers (one mesh, TP2) and the rollout ranks are plain sync actors
(`meshes.adapter_actors`) that build their adapters through a `weightbridge.TransferGroup`
spawned over both proc meshes. The trainers run ``train_and_send(v)`` for v = 1..N: a stand-in
optimizer step, then ``send_weights(v)``. Each rollout engine (TP2; two engines) loops
``step()`` on a thread of its own: ``poll_requests()``, then a forward pass. Nothing else
synchronizes them: the adapters' own messages (rank-0 sender -> rank 0 of each engine -> its
ranks) decide when each engine installs what. Per mode it prints:

- AGST per update: the time the trainers spent in ``send_weights`` plus the time the rollouts
  spent in ``poll_requests`` (stalls), divided by the number of workers and of updates;
- staleness per generation step: the newest version the trainers had sent when the step began,
  minus the version the step ran with;
- that every install was bit-exact and every engine step ran one version on all its ranks.
"""

from __future__ import annotations

import argparse
import threading
import time
from collections import Counter
from dataclasses import dataclass

from monarch.actor import this_host

from meshes.adapter_actors import RLRollout, RLTrainer
from weightbridge import TransferConfig, TransferGroup
from weightbridge.mesh.transport import configure_transport

MODES = {"sync": (False, False), "ss": (True, False), "rs": (False, True), "async": (True, True)}
TRAINER_TP, ENGINES, ENGINE_TP = 2, 2, 2


@dataclass
class LoopReport:
    mode: str
    agst_s: float
    """Average GPU stall time per update (all workers)."""
    staleness: Counter
    """Versions behind -> number of generation steps (over all engines)."""
    mixed_steps: int
    """Engine steps whose ranks ran different versions (must be 0)."""
    installs: int
    inexact: int
    """Installs whose parameters differed from the rank's own load_weights (must be 0)."""
    final_versions: list[int]
    wall_s: float
    records: list[dict]
    """Every (engine rank, step): rank, step, version, installed, stall_s, exact, sent."""

    def line(self) -> str:
        stale = ", ".join(f"{k} behind: {v}" for k, v in sorted(self.staleness.items()))
        return (f"{self.mode:>5}: AGST {self.agst_s * 1e3:7.1f} ms/update  staleness "
                f"[{stale}]  installs {self.installs} (inexact {self.inexact})  mixed engine "
                f"steps {self.mixed_steps}  final versions {self.final_versions}  "
                f"({self.wall_s:.1f}s)")


def run_loop(mode: str, procs, *, num_versions: int = 3, model: str = "tiny",
             timeout_s: float = 30.0, round_bytes: int = 256 << 10,
             round_control: str = "stages",
             generate_after_training: bool = False) -> LoopReport:
    """One RL run in ``mode`` on (trainer procs, rollout procs): a fresh transfer group and
    fresh actors, closed and stopped after (the procs stay the caller's; any axis names).
    The 256 KiB rounds and 30 s timeout suit the tiny demo model (a few rounds per update); a
    real model keeps `TransferConfig`'s defaults (8 MiB rounds, 60 s).

    ``generate_after_training``: the engines start polling only once every send_weights has
    returned (a rollout that stops polling; sync mode then times out).
    """
    ss, rs = MODES[mode]
    config = TransferConfig(sender_staging=ss, receiver_staging=rs, timeout_s=timeout_s,
                            round_bytes=round_bytes, round_control=round_control)
    tp, rp = procs
    if tp.size() != TRAINER_TP or rp.size() != ENGINES * ENGINE_TP:
        raise ValueError(f"run_loop needs {TRAINER_TP} trainer procs and {ENGINES * ENGINE_TP} "
                         f"rollout procs ({ENGINES} engines of TP{ENGINE_TP}), got {tp.size()} "
                         f"and {rp.size()}")
    group = TransferGroup.spawn(tp, rp, engine_size=ENGINE_TP, config=config)
    trainers = rollouts = None
    try:
        trainers = tp.spawn(f"trainer_{mode}", RLTrainer, model, TRAINER_TP)
        rollouts = rp.spawn(f"rollout_{mode}", RLRollout, model, ENGINE_TP)
        return _run(mode, group, trainers, rollouts, config, num_versions,
                    generate_after_training)
    finally:
        try:
            group.close()
        finally:
            for mesh in (trainers, rollouts):
                if mesh is not None:
                    mesh.stop().get(timeout=60)


def _run(mode, group, trainers, rollouts, config, num_versions, generate_after_training
         ) -> LoopReport:
    t0 = time.monotonic()
    # On the whole meshes: each actor's rank in the group is its flat rank in its mesh.
    setups = [trainers.setup.call(group), rollouts.setup.call(group)]
    for f in setups:
        f.get()
    trainers.connect.call().get()
    # Flat views, whatever the procs' axes are called: engine e is ranks [e * TP, (e + 1) * TP).
    flat_rollouts = rollouts.flatten("rank")

    sent = [0]          # newest version whose send_weights returned on every trainer
    trainer_stall = [0.0]
    stop = threading.Event()
    records: list[dict] = []
    errors: list[BaseException] = []

    def train():
        try:
            for v in range(1, num_versions + 1):
                results = trainers.train_and_send.call(v).get()
                trainer_stall[0] += sum(stall for _, (_, stall) in results.items())
                sent[0] = v
        except BaseException as e:
            errors.append(e)

    def generate(engine: int):
        ranks = flat_rollouts.slice(rank=slice(engine * ENGINE_TP, (engine + 1) * ENGINE_TP))
        seed = 0
        try:
            while not stop.is_set():
                newest = sent[0]
                out = ranks.step.call(seed).get()
                seed += 1
                for _, r in out.items():
                    records.append(dict(r, engine=engine, sent=newest))
                if newest == num_versions and all(r["version"] == num_versions
                                                 for _, r in out.items()):
                    return
        except BaseException as e:
            errors.append(e)

    trainer_thread = threading.Thread(target=train)
    engine_threads = [threading.Thread(target=generate, args=(e,)) for e in range(ENGINES)]
    trainer_thread.start()
    if generate_after_training:
        trainer_thread.join(timeout=config.timeout_s * (num_versions + 2))
        if errors:
            raise errors[0]
        if config.sender_staging and config.receiver_staging:
            # Async: the versions go on landing in staging after send_weights returned; let
            # them all land first, so the engines find only the newest (SS alone needs their
            # polls to move a version at all).
            trainers.finish.call().get()
    for t in engine_threads:
        t.start()
    trainer_thread.join(timeout=config.timeout_s * (num_versions + 2))
    for t in engine_threads:
        t.join(timeout=config.timeout_s * 2)
    stop.set()
    if errors:
        raise errors[0]
    # SS: every staged version was transferred (raises an error of the background transfer).
    trainers.finish.call().get()
    if trainer_thread.is_alive() or any(t.is_alive() for t in engine_threads):
        raise TimeoutError(f"{mode}: the RL loop did not finish")

    by_step: dict[tuple[int, int], set[int]] = {}
    for r in records:
        by_step.setdefault((r["engine"], r["step"]), set()).add(r["version"])
    rollout_stall = sum(r["stall_s"] for r in records)
    num_workers = TRAINER_TP + ENGINES * ENGINE_TP
    final = {}
    for r in records:
        final[(r["engine"], r["step"])] = r["version"]
    last = [max((s, v) for (e, s), v in final.items() if e == eng)[1] for eng in range(ENGINES)]
    return LoopReport(
        mode=mode, agst_s=(trainer_stall[0] + rollout_stall) / num_workers / num_versions,
        staleness=Counter(max(0, r["sent"] - r["version"]) for r in records),
        mixed_steps=sum(len(v) > 1 for v in by_step.values()),
        installs=sum(r["installed"] is not None for r in records),
        inexact=sum(r["exact"] is False for r in records),
        final_versions=last, wall_s=time.monotonic() - t0, records=records)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=[*MODES, "all"], default="all")
    parser.add_argument("--versions", type=int, default=3)
    parser.add_argument("--round-control", choices=("stages", "rounds"), default="stages",
                        help="TransferConfig.round_control")
    args = parser.parse_args()
    configure_transport()  # before spawning: children read the config at start-up
    host = this_host()
    # Any axis names: the transfer group and the loop take each mesh in its flat rank order.
    tp = host.spawn_procs(per_host={"gpus": TRAINER_TP}, name="trainer")
    try:
        rp = host.spawn_procs(per_host={"replica": ENGINES, "gpus": ENGINE_TP}, name="rollout")
        try:
            for mode in (MODES if args.mode == "all" else [args.mode]):
                print(run_loop(mode, (tp, rp), num_versions=args.versions,
                               round_control=args.round_control).line(), flush=True)
        finally:
            rp.stop().get(timeout=60)
    finally:
        tp.stop().get(timeout=60)
    print("meshes stopped")


if __name__ == "__main__":
    main()
