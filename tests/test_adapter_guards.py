"""The adapters refuse what would tear or mislabel weights, in one process (issue 14).

A tiny model whose rounds are not multiples of 8 bytes (3 bf16, 5 fp32 and 4 x 6 bf16
elements), two data-parallel trainers, rollout engines on a `LocalControl`. Each test is a
misuse or a fault that used to tear weights or fail late:

- sender staging with rounds of an odd number of bytes (the staged copy was short of the
  8-byte-padded writes: every SS send failed);
- trainers calling send_weights with different versions (rollouts installed a mix of both);
- a rollout whose poll timed out, counted in by the next sync transfer (bytes entered its
  parameters outside any poll; it reported version 0 holding version 2);
- poll_requests from two threads of one rank;
- rollout workers that disagree on the engine size (caught only at the second update);
- a (name, tensor) list naming a parameter twice (the first tensor was never updated).
"""

import threading
import time

import pytest
import torch
from tinygroup import MODES, SPEC, build, checkpoint, connect, in_threads, send

from weightbridge import ReceiverAdapter, SenderAdapter, TransferConfig, TransferFailed
from weightbridge.coordination.local_control import LocalControl


@pytest.mark.parametrize("mode", list(MODES))
def test_rounds_of_odd_byte_counts_install_bit_exact_in_every_mode(mode):
    ss, rs = MODES[mode]
    _, trainers, rollouts = build(TransferConfig(sender_staging=ss, receiver_staging=rs,
                                                 timeout_s=10))
    connect(trainers)
    for v in (1, 2, 3):
        got = in_threads(*send(trainers, v, ss=ss),
                         *[lambda a=a: a.wait_for_version(v) for _, a in rollouts])
        assert got == [None] * len(trainers) + [v] * len(rollouts), got
        assert all(m.holds(v) for m, _ in rollouts)


@pytest.mark.parametrize("mode", ["sync", "rs"])
def test_trainers_sending_different_versions_fail_everywhere_before_any_byte(mode):
    ss, rs = MODES[mode]
    control, trainers, rollouts = build(TransferConfig(sender_staging=ss, receiver_staging=rs,
                                                       timeout_s=5))
    connect(trainers)
    for m, _ in rollouts:  # the probe left its values: no version yet
        m.mark()
    moved = control.transport.bytes_written
    (m0, t0), (m1, t1) = trainers
    got = in_threads(lambda: (m0.load_weights(checkpoint(1).items()), t0.send_weights(1)),
                     lambda: (m1.load_weights(checkpoint(2).items()), t1.send_weights(2)))
    for e in got:
        assert isinstance(e, ValueError), got
        assert "T0 send_weights(1), T1 send_weights(2)" in str(e) and "Nothing was sent" in str(e)
    assert control.transport.bytes_written == moved
    assert [a.poll_requests() for _, a in rollouts] == [None, None]
    assert all(m.unchanged() and a.version == 0 for m, a in rollouts)
    # One version on both: the group goes on.
    got = in_threads(*send(trainers, 3, ss=ss), *[lambda a=a: a.wait_for_version(3)
                                                  for _, a in rollouts])
    assert got == [None, None, 3, 3], got
    assert all(m.holds(3) for m, _ in rollouts)


def test_trainers_staging_different_versions_never_reach_a_rollout():
    control, trainers, rollouts = build(TransferConfig(sender_staging=True, timeout_s=1))
    connect(trainers)
    for m, _ in rollouts:  # the probe left its values: no version yet
        m.mark()
    moved = control.transport.bytes_written
    (m0, t0), (m1, t1) = trainers
    m0.load_weights(checkpoint(1).items())
    t0.send_weights(1)
    m1.load_weights(checkpoint(2).items())
    t1.send_weights(2)
    polls = in_threads(*[lambda a=a: a.wait_for_version(1, timeout_s=4) for _, a in rollouts])
    with pytest.raises(RuntimeError, match=r"T0 holds version 1, T1 holds version 2"):
        t0.wait_idle()
    assert all(isinstance(p, TimeoutError) for p in polls), polls
    assert control.transport.bytes_written == moved
    assert all(m.unchanged() and a.version == 0 for m, a in rollouts)


def test_a_timed_out_poll_takes_no_bytes_until_it_polls_again():
    _, trainers, rollouts = build(TransferConfig(timeout_s=0.5))
    connect(trainers)
    for m, _ in rollouts:  # the probe left its values: no version yet
        m.mark()
    (r0_model, r0), (r1_model, r1) = rollouts

    def r0_polls_late():  # after the trainers began to wait for the rollouts ("ready")
        end = time.monotonic() + 30
        while not all(any(e[1:] == ("ready", 1) for e in a.events) for _, a in trainers):
            assert time.monotonic() < end, "the trainers never entered send_weights(1)"
            time.sleep(0.001)
        return r0.wait_for_version(1)

    # Version 1: R0 polls, R1 does not. The trainers give up naming R1 only; R0's poll gives
    # up too, before any byte moved, and meets the version again at its next poll.
    got = in_threads(*send(trainers, 1, ss=False), r0_polls_late)
    assert all(isinstance(e, TimeoutError) for e in got), got
    assert "['R1'] did not poll_requests()" in str(got[0]), got[0]
    assert "nothing was written" in str(got[2]), got[2]
    assert r0.version == 0 and r0_model.unchanged()

    r1_joined = threading.Event()
    r1.before_update_hook = lambda version: r1_joined.set()

    def r0_polls_later():
        assert r1_joined.wait(30)  # R1 is in the transfer of version 2; R0 has not polled
        untouched = r0_model.unchanged() and r0.version == 0
        return untouched, r0.wait_for_version(2)

    # Version 2: R1 polls at once, R0 only later: no byte may enter R0's parameters before.
    got = in_threads(lambda: in_threads(*send(trainers, 2, ss=False),
                                        lambda: r1.wait_for_version(2)), r0_polls_later)
    assert got == [[None, None, 2], (True, 2)], got
    assert r0_model.holds(2) and r1_model.holds(2) and r0.version == r1.version == 2


def test_poll_requests_from_a_second_thread_is_refused():
    entered, release = threading.Event(), threading.Event()
    _, trainers, rollouts = build(TransferConfig(receiver_staging=True, timeout_s=5))
    (_, r0), (_, r1) = rollouts
    r0.before_update_hook = lambda v: (entered.set(), release.wait(30))
    connect(trainers)
    assert in_threads(*send(trainers, 1, ss=False)) == [None, None]
    first = threading.Thread(target=lambda: r0.wait_for_version(1))
    first.start()
    assert entered.wait(30)
    with pytest.raises(RuntimeError, match="already running on this rank in another thread"):
        r0.poll_requests()
    release.set()
    first.join(timeout=30)
    assert r0.version == 1 and r1.wait_for_version(1) == 1


@pytest.mark.parametrize("sizes, match", [
    ((2, 2, 2), r"3 rollout workers do not make whole engines of engine_size=2"),
    ((2, 2, 1, 1), r"R2 was built with engine_size=1, but its transfer group has engines of 2"),
])
def test_connect_refuses_rollouts_that_disagree_on_the_engine_size(sizes, match):
    control, trainers, _ = build(TransferConfig(timeout_s=5), sizes=sizes)
    got = in_threads(*[a.connect for _, a in trainers])
    assert isinstance(got[0], ValueError), got
    with pytest.raises(ValueError, match=match):
        raise got[0]
    assert control.transport.bytes_written == 0


@pytest.mark.parametrize("side", ["trainer", "rollout"])
def test_duplicate_parameter_names_are_refused_at_construction(side):
    """Issue 44, item 5: a (name, tensor) list naming one parameter twice kept only the last
    tensor (``dict`` of the pairs), so the first was never updated. Refused by name now."""
    control = LocalControl()
    first, second = torch.zeros(3, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.bfloat16)
    pairs = [("w", first), ("v", torch.zeros(5)), ("w", second)]
    kw = dict(rank=0, control=control, transport=control.transport, config=TransferConfig())
    cls = SenderAdapter
    if side == "rollout":
        cls, kw = ReceiverAdapter, dict(kw, engine=0, engine_rank=0, engine_size=1)
    with pytest.raises(ValueError, match=r"name parameter 'w' twice; give one tensor per name"):
        cls(pairs, lambda weights: None, SPEC, **kw)


def _fails_its_first_send(rank: int):
    """Trainer 1's adapter raises a bug of its own in its first round (every worker still
    answers: nobody is lost)."""
    class FailsItsFirstSend(SenderAdapter):
        def on_send_round(self, r):
            raise RuntimeError("a bug in trainer 1's pack")
    return FailsItsFirstSend if rank == 1 else SenderAdapter


def test_a_failed_step_reaches_every_trainer_as_transfer_failed():
    """Issue 44, item 10: `except TransferFailed` (the documented idiom) missed trainer 0's
    `StepFailed` when a step failed and every worker still answered; the other trainers got
    `TransferFailed`. Every trainer raises `TransferFailed` now, naming the step."""
    _, trainers, rollouts = build(TransferConfig(timeout_s=2), num_engines=1,
                                  sender_cls=_fails_its_first_send)
    connect(trainers)
    got = in_threads(*send(trainers, 1, ss=False),
                     lambda: rollouts[0][1].wait_for_version(1, timeout_s=6))
    for error in got[:2]:
        assert isinstance(error, TransferFailed), got
        assert "a bug in trainer 1's pack" in str(error), str(error)
