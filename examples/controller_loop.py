"""An RL loop driven by the single controller: training, generation and transfer overlapped.

    python examples/controller_loop.py                     # all four modes, 4 versions each
    python examples/controller_loop.py --mode async --versions 6 --step-s 0.2

One controller script owns both meshes (`controller.MeshTransfer`: trainer TP2, two TP1
rollout engines of the tiny demo model) and runs, per version v::

    (rs, async) rollouts generate with what they hold   ----+
    update(v, train=False)      sync: rounds into the parameters (everyone waits)
                                ss, async: stage and return (the rounds stream)
                                rs: rounds into staging (the rollouts keep generating)
    trainers' next train step (v + 1)  ------------------------+ overlaps the rest
    poll_requests()             ss: wait for the stream; rs, async: install from staging
    (sync, ss) rollouts generate with v

A train or generation step is a stand-in of ``--step-s`` seconds of device work on every
worker (`busy`: reads every parameter). Printed per mode: the AGST (the trainers' stall in
`update` plus the rollouts' stall: the rounds in sync, the wait in `poll_requests` in SS, the
install in RS and async, averaged over every worker and version), the wall time per version,
and that every version each engine ran was bit-identical to its own load_weights.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from controller.driver import MeshTransfer  # noqa: E402
from weightbridge.specs import TrainerSpec  # noqa: E402
from weightbridge.specs import RolloutSpec
from weightbridge import TransferConfig  # noqa: E402
from weightbridge.config import Mode  # noqa: E402

TRAINER = TrainerSpec.parse("nodes=1,gpus=2,tp=2")
ROLLOUT = RolloutSpec.parse("engines=2,nodes=1,gpus=1")


def run_mode(mode: Mode, *, versions: int, step_s: float) -> str:
    """One loop of ``versions`` versions in ``mode``; returns its line."""
    # The tiny model's values: 256 KiB rounds, a 30 s bound per step (real models: keep the
    # default 8 MiB rounds and 60 s).
    config = TransferConfig(round_bytes=256 << 10, timeout_s=30,
                            sender_staging=mode.sender_staging,
                            receiver_staging=mode.receiver_staging)
    trainer_stall = rollout_stall = 0.0
    exact = True
    with MeshTransfer(TRAINER, ROLLOUT, "tiny", config=config) as mt:
        mt.connect()
        mt.trainers.train_step.call(1).get()
        t0 = time.perf_counter()
        for v in range(1, versions + 1):
            generating = None
            if mode.receiver_staging:  # the rollouts go on while v lands in their staging
                generating = mt.rollouts.busy.call(step_s)
            report = mt.update(v, train=False)
            trainer_stall += report.stall_s
            if not mode.sender_staging and not mode.receiver_staging:
                rollout_stall += report.stall_s  # (sync: the rounds wrote their parameters)
                exact &= not report.mismatched
            training = mt.trainers.busy.call(step_s)  # the next train step ...
            if generating is not None:
                generating.get()
            p0 = time.perf_counter()
            installed = mt.poll_requests()
            rollout_stall += time.perf_counter() - p0
            exact &= installed is None or not installed.mismatched
            if generating is None:  # (sync, SS) generate with v
                mt.rollouts.busy.call(step_s).get()
            training.get()
            mt.trainers.train_step.call(v + 1).get()  # ... ends with version v + 1
        wall = (time.perf_counter() - t0) / versions
        workers = TRAINER.num_workers + ROLLOUT.num_workers
    agst = (TRAINER.num_workers * trainer_stall
            + ROLLOUT.num_workers * rollout_stall) / workers / versions
    return (f"{mode.value:>5}: AGST {agst * 1e3:7.1f} ms/version  (trainers "
            f"{trainer_stall / versions * 1e3:6.1f} ms, rollouts "
            f"{rollout_stall / versions * 1e3:6.1f} ms)  wall {wall:.3f} s/version  "
            f"{'every install bit-exact' if exact else 'MISMATCH'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=[m.value for m in Mode] + ["all"], default="all")
    parser.add_argument("--versions", type=int, default=4)
    parser.add_argument("--step-s", type=float, default=0.1,
                        help="seconds of stand-in device work per train or generation step")
    args = parser.parse_args()
    for mode in (list(Mode) if args.mode == "all" else [Mode(args.mode)]):
        print(run_mode(mode, versions=args.versions, step_s=args.step_s), flush=True)


if __name__ == "__main__":
    main()
