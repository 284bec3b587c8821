"""Stalls in one process are bounded by `TransferConfig.timeout_s`, as on meshes.

`LocalControl.stall(worker)` stands in for a stopped process (SIGSTOP): calls to it wait and
are answered once it is resumed, writes into it wait and are lost. A worker that stops
answering in the middle of a transfer must surface as it does on a mesh (docs/failures.md,
"A rollout worker lost mid-transfer"): the trainers' `send_weights` raises `TransferFailed`
naming it, and the other engine holds the version whole (a stopped trainer replica: its
replica sends what it held); nothing waits forever.
"""

import pytest
import tinygroup
from faults import STALLED, stalling_group
from tinygroup import MODES, build, checkpoint, connect, in_threads

from weightbridge import SenderAdapter, TransferConfig, TransferFailed
from weightbridge.coordination.control import PeerCall
from weightbridge.types import WorkerId

@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.slow
def test_a_rollout_that_stops_mid_transfer_is_found_and_the_other_engine_holds_the_version(
        mode):
    ss, rs = MODES[mode]
    config = TransferConfig(timeout_s=1, sender_staging=ss, receiver_staging=rs)
    control, trainers, rollouts = stalling_group(config)
    try:
        connect(trainers)
        (m0, r0), (_, r1) = rollouts
        out = in_threads(*tinygroup.send(trainers, 1, ss=ss),
                         lambda: r0.wait_for_version(1), lambda: r1.wait_for_version(1))
        sent, got0 = out[:2], out[2]
        failed = [e for e in sent if isinstance(e, TransferFailed)]
        # Sync and RS: every trainer is told; SS and async: rank 0, at the end of its run.
        assert failed and all(e is None or isinstance(e, TransferFailed) for e in sent), out
        assert "R1 (engine 1)" in str(failed[0]) and "version 1" in str(failed[0]), failed[0]
        assert trainers[0][1].failed_engines == {1}
        if ss:  # SS: engine 0 never saw version 1; it takes the next one
            got0 = in_threads(*tinygroup.send(trainers, 2, ss=ss),
                              lambda: r0.wait_for_version(2))[2]
        assert got0 in (1, 2) and m0.holds(got0) and r0.version == got0, out
    finally:
        control.resume(STALLED)


def test_a_call_to_a_worker_that_never_answers_fails_after_the_peer_timeout():
    config = TransferConfig(timeout_s=1)
    control, trainers, rollouts = build(config, num_engines=1)
    control.stall(WorkerId("rollout", 0))
    try:
        got = control.call([WorkerId("rollout", 0), WorkerId("trainer", 1)], PeerCall.PING,
                           return_errors=True)
        assert isinstance(got[0], TimeoutError) and "did not answer" in str(got[0]), got
        assert got[1] is True  # the others answer as usual
        with pytest.raises(TimeoutError, match="ping to R0 did not answer"):
            control.call([WorkerId("rollout", 0)], PeerCall.PING)
    finally:
        control.resume(WorkerId("rollout", 0))
    # Once it goes on, the calls that waited are answered (their callers gave up) and new
    # ones are too.
    assert control.call([WorkerId("rollout", 0)], PeerCall.PING) == [True]
    assert checkpoint(0)  # (the group is untouched)


class TrainerStopsAtItsFirstSend(SenderAdapter):
    """Trainer 1's process stops as it is asked to send its first round (never continued)."""

    def on_send_round(self, r):
        if self.worker.index == 1:
            self.control.stall(self.worker)
            self.control._gate(self.worker)
        return super().on_send_round(r)


@pytest.mark.parametrize("mode", ["sync", "rs"])
def test_a_trainer_replica_that_stops_mid_transfer_is_found_and_its_replica_sends(mode):
    ss, rs = MODES[mode]
    config = TransferConfig(timeout_s=1, sender_staging=ss, receiver_staging=rs)
    control, trainers, rollouts = build(config, sender_cls=lambda i: (
        TrainerStopsAtItsFirstSend if i == 1 else SenderAdapter))
    try:
        connect(trainers)
        out = in_threads(*tinygroup.send(trainers, 1, ss=ss),
                         *[lambda a=a: a.wait_for_version(1) for _, a in rollouts])
        assert isinstance(out[0], TransferFailed) and "T1" in str(out[0]), out
        assert trainers[0][1].failed_trainers == {1}
        assert out[2:] == [1, 1] and all(m.holds(1) for m, _ in rollouts), out
    finally:
        control.resume(WorkerId("trainer", 1))
