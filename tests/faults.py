"""Workers that fail on cue, shared by the fault tests (no test module imports another).

In process (`LocalControl`): `DiesSendingVersion2`, a trainer that dies at its first send of
the second transfer; `StopsAtItsFirstLanding` and `stalling_group`, a rollout that stops as a
stopped process would. On meshes: `DiesInRound1Rollout`, a rollout actor whose process exits in
round 1.
"""

import os

import tinygroup
from tinygroup import build

from meshes.actors import RolloutActor
from weightbridge import ReceiverAdapter, SenderAdapter
from weightbridge.coordination.local_control import WorkerGone
from weightbridge.driver import TransferWorker
from weightbridge.types import WorkerId


class DiesSendingVersion2(SenderAdapter):
    """Trainer 1: its process dies at its first send of a round of the second transfer."""

    sends = 0

    def on_send_round(self, r):
        self.sends += 1
        if self.sends > self.executor.num_rounds:
            self.control.kill(self.worker)
            raise WorkerGone(f"{self.worker} died")
        return super().on_send_round(r)


STALLED = WorkerId("rollout", 1)  # engine 1 of two one-rank engines


class StopsAtItsFirstLanding(ReceiverAdapter):
    """Its process stops as the first round lands in it (and is never continued)."""

    def on_land(self, r, slots=None, expected=None):
        if self.worker == STALLED:
            self.control.stall(self.worker)
            self.control._gate(self.worker)  # this very call waits too, as a stopped process
        return super().on_land(r, slots, expected)


def stalling_group(config):
    """`tinygroup.build`, with rollout 1 (engine 1 of two one-rank engines) a
    `StopsAtItsFirstLanding`."""
    control, trainers, rollouts = build(config)
    m, _ = rollouts[1]
    del control._workers[STALLED]
    rollouts[1] = (m, control.add(StopsAtItsFirstLanding(
        m.params, m.load_weights, tinygroup.SPEC, rank=1, engine=1, engine_rank=0,
        engine_size=1, control=control, transport=control.transport, config=config)))
    return control, trainers, rollouts


class DiesInRound1(TransferWorker):
    """Rollout 1's process exits in round 1 (an OOM kill, say)."""

    def on_land(self, r, slots=None, expected=None):
        if self.worker.index == 1 and r == 1:
            os._exit(3)
        super().on_land(r, slots, expected)


class DiesInRound1Rollout(RolloutActor):
    worker_class = DiesInRound1
