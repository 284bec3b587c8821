"""A trainer lost mid-transfer, in one process: its data-parallel replica sends for it.

Two trainers each hold the whole model (`tinygroup`: data-parallel replicas), two engines.
Trainer 1 dies (`LocalControl.kill`) as it is asked to send a round of version 2. Checked per
mode: trainer 0's `send_weights` (or `wait_idle`) raises a `TransferFailed` naming T1 and
saying it is excluded; version 2 is re-sent from trainer 0 alone and installed bit-exact (sync,
RS; with sender staging the engines never see it); version 3 then goes from trainer 0 alone
(send_weights is collective over the live trainers), bit-exact on both engines.
"""

import threading

import pytest
import tinygroup
from faults import DiesSendingVersion2
from tinygroup import MODES, build, connect, in_threads

from weightbridge import SenderAdapter, TransferConfig, TransferFailed


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.slow
def test_a_lost_trainer_replica_is_left_out_and_its_replica_sends_for_it(mode):
    ss, rs = MODES[mode]
    config = TransferConfig(timeout_s=5, sender_staging=ss, receiver_staging=rs)
    control, trainers, rollouts = build(config, sender_cls=lambda rank: (
        DiesSendingVersion2 if rank == 1 else SenderAdapter))
    connect(trainers)
    (m0, t0), (m1, t1) = trainers

    def send(v: int, *senders):
        return tinygroup.send(list(senders), v, ss=ss)

    def polls(v: int):
        return [lambda a=a: a.wait_for_version(v) for _, a in rollouts]

    assert in_threads(*send(1, *trainers), *polls(1))[2:] == [1, 1]
    if not ss:  # version 2 is re-sent from trainer 0 alone, and installed
        first, _, *installed = in_threads(*send(2, *trainers), *polls(2))
        assert installed == [2, 2] and all(m.holds(2) for m, _ in rollouts), installed
    else:  # the engines never see version 2; they poll on, and take version 3
        waits: list = []
        waiter = threading.Thread(target=lambda: waits.extend(in_threads(*polls(3))))
        waiter.start()
        first, _ = in_threads(*send(2, *trainers))
    assert isinstance(first, TransferFailed), first
    assert "T1 failed during the transfer of version 2" in str(first) and \
        "Trainer [1] is excluded" in str(first), first
    assert t0.failed_trainers == {1}
    if not ss:
        assert in_threads(*send(3, (m0, t0)), *polls(3))[1:] == [3, 3]
    else:
        assert in_threads(*send(3, (m0, t0))) == [None]
        waiter.join(timeout=60)
        assert waits == [3, 3], waits
    assert all(m.holds(3) for m, _ in rollouts)
