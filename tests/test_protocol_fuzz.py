"""The protocol fuzz (`tests/fuzz_adapters.py`) on a few seeds, and a minimal reproduction of
each kind of violation it found (issue 23).

The seeds here ran clean (three runs each) on the code they were picked on: a violation is a
regression. Kills and stalls are left to the benchmark (the threads' timing decides whether a
seed meets one); each reproduction below failed before its fix. `benchmarks/fuzz_protocol.py
--seeds 500` runs the fuzz at length.
"""

import time

import pytest
import tinygroup
import torch
from faults import STALLED, stalling_group
from tinygroup import build, checkpoint, connect, in_threads

from weightbridge import ReceiverAdapter, SenderAdapter, TransferConfig, TransferFailed
from weightbridge.coordination.local_control import WorkerGone
from fuzz_adapters import run_seed
from fuzz_plan import scenario_of
from weightbridge.types import WorkerId

FAULTLESS_SEEDS = [0, 1, 6, 27]
"""Updates, deltas, joins and leaves only (``faults=False``), one seed per mode (seed % 4:
sync, SS, RS, async); the RS and async ones without a join (issue 23 finding 1)."""
PAUSE_SEEDS = [4, 5, 26, 7]
"""The same, with engines that stop polling for a while (``faults=("pause",)``)."""


@pytest.mark.parametrize("seed", FAULTLESS_SEEDS)
def test_a_fuzz_seed_without_faults_finds_no_violation(seed):
    result = run_seed(seed, faults=False)
    assert not result.violations, (result.scenario.describe(), result.violations,
                                   result.trainer_errors)


@pytest.mark.parametrize("seed", PAUSE_SEEDS)
def test_a_fuzz_seed_with_pauses_finds_no_violation(seed):
    result = run_seed(seed, faults=("pause",))
    assert not result.violations, (result.scenario.describe(), result.violations,
                                   result.trainer_errors)


def test_the_scenario_of_a_seed_is_the_same_every_time():
    assert scenario_of(11) == scenario_of(11) and scenario_of(11) != scenario_of(12)
    assert [scenario_of(s).mode for s in range(4)] == ["sync", "ss", "rs", "async"]
    assert {op.kind for op in scenario_of(26, faults=("pause",)).ops} <= {
        "update", "join", "leave", "pause"}
    with pytest.raises(ValueError, match="faults must be"):
        scenario_of(1, faults=("nap",))


def _join_engine(control, config, engine: int):
    """A one-rank engine added to the control plane (joined by the next add_engines)."""
    m = tinygroup.Model()
    return control.add(ReceiverAdapter(
        m.params, m.load_weights, tinygroup.SPEC, rank=engine, engine=engine, engine_rank=0,
        engine_size=1, control=control, transport=control.transport, config=config))


def _polls(which, v):
    return [lambda a=a: a.wait_for_version(v) for _, a in which]


def _holds(model, versions: dict[str, int]) -> bool:
    return all(torch.equal(model.params[n].view(torch.uint8),
                           checkpoint(v)[n].view(torch.uint8)) for n, v in versions.items())


def test_a_landed_delta_installed_after_a_join_is_the_version_it_claims():
    """RS, two trainers, engines 0 and 1: version 2 (a delta of w) lands in both engines'
    staging, engine 0 installs it, engine 1 has not polled yet; an engine joins; engine 1
    then installs version 2. The join re-made every staging slot under the same number, so
    engine 1 installed uninitialized memory under version 2."""
    config = TransferConfig(timeout_s=5, receiver_staging=True)
    control, trainers, rollouts = build(config)
    connect(trainers)
    assert in_threads(*tinygroup.send(trainers, 1, ss=False), *_polls(rollouts, 1))[2:] == [1, 1]

    def delta(model, adapter):
        model.load_weights([("w", checkpoint(2)["w"])])
        adapter.send_weights(2, changed=["w"])
    assert in_threads(*[lambda m=m, a=a: delta(m, a) for m, a in trainers],
                      *_polls(rollouts[:1], 2)) == [None, None, 2]
    m = tinygroup.Model()
    control.add(ReceiverAdapter(m.params, m.load_weights, tinygroup.SPEC, rank=2, engine=2,
                                engine_rank=0, engine_size=1, control=control,
                                transport=control.transport, config=config))
    assert in_threads(*[a.add_engines for _, a in trainers]) == [None, None]
    assert rollouts[1][1].wait_for_version(2) == 2
    assert _holds(rollouts[1][0], {"w": 2, "v": 1, "m": 1})


@pytest.mark.parametrize("mode", ["sync", "ss"])
def test_a_rollout_excluded_while_stopped_is_told_once_it_goes_on(mode):
    """R1 stops as the first round lands in it and is excluded (the trainers'
    send_weights raise TransferFailed naming it); once it goes on, its polls must raise
    TransferFailed, and none returns with parameters that are not the version it holds. They
    raised TimeoutError once, then returned None for ever, its parameters holding part of
    version 1 (the fuzz's "torn" and "outside" in SS: seeds 253, 341, 389)."""
    config = TransferConfig(timeout_s=1, sender_staging=mode == "ss")
    control, trainers, rollouts = stalling_group(config)
    connect(trainers)
    (_, r0), (m1, r1) = rollouts
    polled = []

    def r1_polls():
        end = time.monotonic() + 8 * config.timeout_s
        while time.monotonic() < end:
            try:
                polled.append(r1.poll_requests())
                # (Version 0: the values connect's probe left, docs/integration.md.)
                assert r1.version == 0 or m1.holds(r1.version), \
                    "R1 returned holding part of a version"
            except (TimeoutError, TransferFailed) as e:
                polled.append(e)
                control.resume(STALLED)  # it goes on (its poll had been waiting meanwhile)
                if isinstance(e, TransferFailed):
                    return
            time.sleep(0.01)
    out = in_threads(*tinygroup.send(trainers, 1, ss=mode == "ss"),
                     lambda: r0.wait_for_version(1), r1_polls)
    control.resume(STALLED)
    assert any(isinstance(e, TransferFailed) for e in out[:2]), out
    assert out[3] is None, out[3]  # (no poll returned holding part of a version)
    assert isinstance(polled[-1], TransferFailed), polled[-3:]


def test_every_rollout_is_told_when_trainer_0_is_lost():
    """Trainer 0 sequences every transfer: once it is gone no version can come, and every
    rollout's poll must raise TransferFailed (they returned None for ever)."""
    config = TransferConfig(timeout_s=1)
    control, trainers, rollouts = build(config)
    connect(trainers)
    assert in_threads(*tinygroup.send(trainers, 1, ss=False), *_polls(rollouts, 1))[2:] == [1, 1]
    control.kill(WorkerId("trainer", 0))

    def polls(adapter):
        end = time.monotonic() + 6 * config.timeout_s
        while time.monotonic() < end:
            try:
                adapter.poll_requests()
            except TransferFailed as e:
                return e
            except TimeoutError:
                pass
            time.sleep(0.01)
        return None
    told = in_threads(*[lambda a=a: polls(a) for _, a in rollouts])
    assert all(isinstance(e, TransferFailed) for e in told), told


def test_a_rank_whose_engine_lost_a_worker_is_told_not_handed_the_peer_error():
    """Engine 0's R1 dies between updates; at the next update R0's poll relays the version to
    its engine and meets the dead R1. It must raise `TransferFailed` (its engine is out), not
    the control plane's `WorkerGone`."""
    config = TransferConfig(timeout_s=1)
    control, trainers, rollouts = build(config, sizes=(2, 2, 2, 2))
    connect(trainers)
    assert in_threads(*tinygroup.send(trainers, 1, ss=False), *_polls(rollouts, 1))[2:] == [1] * 4
    control.kill(WorkerId("rollout", 1))
    r0 = rollouts[0][1]

    def r0_polls():
        errors = []
        end = time.monotonic() + 6 * config.timeout_s
        while time.monotonic() < end:
            try:
                r0.poll_requests()
            except Exception as e:  # noqa: BLE001  (checked below)
                errors.append(e)
                if isinstance(e, TransferFailed):
                    break
            time.sleep(0.01)
        return errors
    out = in_threads(*tinygroup.send(trainers, 2, ss=False), r0_polls,
                     *_polls(rollouts[2:], 2))
    assert out[3:] == [2, 2], out
    assert out[2] and all(isinstance(e, (TransferFailed, TimeoutError)) for e in out[2]), out[2]
    assert isinstance(out[2][-1], TransferFailed), out[2]


def test_a_join_with_a_dead_rollout_in_the_group_fails_as_documented_or_goes_on():
    """R1 (engine 1) died between updates; a third engine joins. add_engines must either go
    on or raise a documented error (`TransferFailed` naming R1), not the control plane's
    `WorkerGone`; then version 2 reaches engines 0 and 2."""
    config = TransferConfig(timeout_s=1)
    control, trainers, rollouts = build(config)
    connect(trainers)
    assert in_threads(*tinygroup.send(trainers, 1, ss=False), *_polls(rollouts, 1))[2:] == [1, 1]
    control.kill(WorkerId("rollout", 1))
    joined = _join_engine(control, config, 2)
    out = in_threads(*[a.add_engines for _, a in trainers])
    assert out[0] is None or isinstance(out[0], TransferFailed), out
    sent = in_threads(*tinygroup.send(trainers, 2, ss=False),
                      lambda: rollouts[0][1].wait_for_version(2),
                      lambda: joined.wait_for_version(2))
    assert sent[2:] == [2, 2], sent


def _sends_until_installed(trainers, rollouts, first: int, config) -> tuple[list, int]:
    """SS: every trainer sends first, first + 1, ... while the rollouts poll (between steps,
    for up to 3 x timeout_s or until they hold that version), until they hold one of them (or
    8 x timeout_s passed); (what the trainers raised, the version held)."""
    raised, v = [], first
    end = time.monotonic() + 8 * config.timeout_s
    while time.monotonic() < end and min(a.version for _, a in rollouts) < first:
        def poll(a, v=v):
            until = time.monotonic() + 3 * config.timeout_s
            while a.version < v and time.monotonic() < until:
                try:
                    a.poll_requests()
                except TimeoutError:
                    pass
                time.sleep(0.005)
        for out in in_threads(*tinygroup.send(trainers, v, ss=True),
                              *[lambda a=a: poll(a) for _, a in rollouts]):
            if isinstance(out, BaseException):
                raised.append(out)
        v += 1
    return raised, min(a.version for _, a in rollouts)


def test_sender_staging_goes_on_after_a_rollout_dies_between_transfers():
    """SS: engine 1's only worker dies between transfers. The background transfer's offer to
    it failed outside the recovery (or, once offered, it waited for it to poll for ever: no
    deadline with sender staging), so nothing more reached engine 0 either: every
    send_weights raised "a background transfer failed: R1 is gone" or a TimeoutError."""
    config = TransferConfig(timeout_s=1, sender_staging=True)
    control, trainers, rollouts = build(config, num_trainers=1)
    connect(trainers)
    assert in_threads(*tinygroup.send(trainers, 1, ss=True), *_polls(rollouts, 1))[1:] == [1, 1]
    control.kill(WorkerId("rollout", 1))
    raised, held = _sends_until_installed(trainers, rollouts[:1], 2, config)
    assert held >= 2 and all(isinstance(e, TransferFailed) for e in raised), (held, raised)


def test_sender_staging_goes_on_after_a_trainer_replica_dies_between_transfers():
    """SS, two data-parallel trainers: trainer 1 dies between transfers. Its replica holds
    everything, so the group must go on from trainer 0; the background transfer's first call
    on trainer 1 failed outside the recovery, and every send_weights raised it for ever."""
    config = TransferConfig(timeout_s=1, sender_staging=True)
    control, trainers, rollouts = build(config, num_engines=1)
    connect(trainers)
    assert in_threads(*tinygroup.send(trainers, 1, ss=True), *_polls(rollouts, 1))[2:] == [1]
    control.kill(WorkerId("trainer", 1))
    raised, held = _sends_until_installed(trainers[:1], rollouts, 2, config)
    assert held >= 2 and all(isinstance(e, TransferFailed) for e in raised), (held, raised)


def test_a_leave_with_a_dead_rollout_in_the_group_goes_on_without_it():
    """R1 (engine 1 of three) died between updates; engine 0 is removed. remove_engine must
    not hand the control plane's `WorkerGone` to the trainers (fuzz seed 2): the dead
    engine is excluded (its death found by a ping), engine 0 leaves, version 2 reaches
    engine 2, and engine 0's poll says it was removed."""
    config = TransferConfig(timeout_s=1)
    control, trainers, rollouts = build(config, num_engines=3)
    connect(trainers)
    assert in_threads(*tinygroup.send(trainers, 1, ss=False), *_polls(rollouts, 1))[2:] == [1] * 3
    control.kill(WorkerId("rollout", 1))
    assert in_threads(*[lambda a=a: a.remove_engine(0) for _, a in trainers]) == [None, None]
    assert trainers[0][1].failed_engines == {0, 1}
    sent = in_threads(*tinygroup.send(trainers, 2, ss=False),
                      lambda: rollouts[2][1].wait_for_version(2))
    assert sent == [None, None, 2] and _holds(rollouts[2][0], dict.fromkeys("wvm", 2)), sent
    with pytest.raises(TransferFailed, match="removed"):
        rollouts[0][1].poll_requests()


class _DiesWhenToldOf2(SenderAdapter):
    """Trainer 1 dies as trainer 0 tells it that version 2 was transferred (after the
    rollouts installed it and left their polls)."""

    def on_transferred(self, version):
        if self.worker.index == 1 and version == 2:
            self.control.kill(self.worker)
            raise WorkerGone(f"{self.worker} is gone (test)")
        super().on_transferred(version)


@pytest.mark.parametrize("mode", ["sync", "ss"])
def test_a_trainer_lost_after_the_rollouts_installed_a_version_writes_nothing_outside_a_poll(
        mode):
    """Trainer 1 dies once the rollouts installed version 2 and left their polls (fuzz seed
    45). The recovery counted them in the next transfer as if they still waited in their
    polls: SS wrote version 3 into their parameters while they ran inference steps; sync
    re-sent version 2 to rollouts that were not polling, and closed the group when that
    timed out. The group must go on from trainer 0, writing only inside polls."""
    ss = mode == "ss"
    config = TransferConfig(timeout_s=1, sender_staging=ss)
    control, trainers, rollouts = build(config, num_engines=1,
                                        sender_cls=lambda i: _DiesWhenToldOf2)
    connect(trainers)
    (model, r0), = rollouts
    for v in (1, 2):
        out = in_threads(*tinygroup.send(trainers, v, ss=ss), lambda v=v: r0.wait_for_version(v))
        assert out[2] == v and model.holds(v), out
    t0 = trainers[0][1]
    trainers[0][0].load_weights(checkpoint(3).items())
    if ss:  # staged; the rollout does not poll for a while
        model.mark()
        assert in_threads(lambda: t0.send_weights(3)) == [None]
        time.sleep(2 * config.timeout_s)
        assert model.unchanged(), "version 3 was written outside a poll"
        # (The drain meets the lost trainer once the rollout polls: the re-plan drops what
        # was staged for the old plan, and the survivors take a version staged after it.)
        raised, held = _sends_until_installed(trainers[:1], rollouts, 4, config)
        assert held >= 4 and model.holds(held), (held, raised)
        assert all(isinstance(e, TransferFailed) for e in raised), raised
        return
    out = in_threads(lambda: t0.send_weights(3), lambda: r0.wait_for_version(3))
    assert out[0] is None or isinstance(out[0], TransferFailed), out
    assert out[1] == 3 and model.holds(3), out


def test_an_engine_added_but_not_joined_is_told_when_the_group_ends():
    """The only engine's worker dies; a second engine is added and add_engines() finds no
    engine left (fuzz seed 24). The group ends: every trainer's call raises TransferFailed
    and the added engine, never set up, must be told too (its polls returned None for
    ever)."""
    config = TransferConfig(timeout_s=1)
    control, trainers, rollouts = build(config, num_trainers=1, num_engines=1)
    connect(trainers)
    assert in_threads(*tinygroup.send(trainers, 1, ss=False), *_polls(rollouts, 1))[1:] == [1]
    control.kill(WorkerId("rollout", 0))
    joined = _join_engine(control, config, 1)
    with pytest.raises(TransferFailed, match="No engine is left"):
        trainers[0][1].add_engines()
    with pytest.raises(TransferFailed, match="No engine is left"):
        joined.poll_requests()
    with pytest.raises(TransferFailed, match="No engine is left"):
        trainers[0][1].send_weights(2)


def test_a_relay_that_misses_a_stalled_rank_takes_the_engine_out_in_step():
    """RS, two engines of two ranks: R1 is stalled as its rank 0 relays version 2 (fuzz
    seed 162). Rank 0 went on to install it at the next step while R1, served the relay
    once it went on, installed it steps later: the engine ran steps on two versions. The
    engine must be out instead (no rank can be sure the others install at its step): every
    poll of its ranks raises TransferFailed, R1 installs nothing alone, and trainer 0
    leaves it out of the next transfer, which reaches the other engine."""
    config = TransferConfig(timeout_s=1, receiver_staging=True)
    control, trainers, rollouts = build(config, num_trainers=1, sizes=(2, 2, 2, 2))
    connect(trainers)
    assert in_threads(*tinygroup.send(trainers, 1, ss=False),
                      *_polls(rollouts, 1))[1:] == [1] * 4
    assert in_threads(*tinygroup.send(trainers, 2, ss=False)) == [None]  # landed
    r0, r1 = rollouts[0][1], rollouts[1][1]
    control.stall(r1.worker)
    try:
        with pytest.raises(TransferFailed, match="relay of version 2"):
            r0.poll_requests()
    finally:
        control.resume(r1.worker)
    control.settle(r1.worker)  # (R1 is served what waited for it)
    with pytest.raises(TransferFailed):
        r1.poll_requests()
    assert r1.version == 1 and r0.version == 1
    out = in_threads(*tinygroup.send(trainers, 3, ss=False), *_polls(rollouts[2:], 3))
    assert out == [None, 3, 3], out
    assert trainers[0][1].failed_engines == {0}


def test_a_rank_stalled_when_its_engine_was_excluded_is_told_through_its_rank_0():
    """RS, a 2-rank engine, the only one: R1 is stalled as version 2 lands, so the engine is
    excluded and the group ends (fuzz seeds 258, 290). Trainer 0 told R0 only (R1 did not
    answer) and sends nothing more, so R1 never heard: once it went on, its polls returned
    None for ever. R0 passes what it was told on to the others of its engine."""
    config = TransferConfig(timeout_s=1, receiver_staging=True)
    control, trainers, rollouts = build(config, num_trainers=1, sizes=(2, 2))
    connect(trainers)
    assert in_threads(*tinygroup.send(trainers, 1, ss=False), *_polls(rollouts, 1))[1:] == [1] * 2
    r0, r1 = rollouts[0][1], rollouts[1][1]
    control.stall(r1.worker)
    try:
        out = in_threads(*tinygroup.send(trainers, 2, ss=False))
        assert isinstance(out[0], TransferFailed) and "No engine is left" in str(out[0]), out
    finally:
        control.resume(r1.worker)
    with pytest.raises(TransferFailed, match="Engine .0. is excluded"):
        r0.poll_requests()
    control.settle(r1.worker)  # (R1 is served what waited for it)
    with pytest.raises(TransferFailed, match="Engine .0. is excluded"):
        r1.poll_requests()
    assert r1.version == 1


def test_a_transfer_that_starts_after_the_group_ended_moves_nothing():
    """Async (fuzz seed 311): the only engine was excluded during the transfer of version 5,
    ending the group, while trainer 0's send_weights(6) waited to stage; it staged once the
    buffer was released and started a new background transfer, which ran with no engine in
    (an empty slot table) and assembled version 6 into the rollouts' parameters between
    their polls. A transfer run once the group ended must raise and move nothing (the race
    is reproduced here by running one directly)."""
    config = TransferConfig(timeout_s=1, sender_staging=True, receiver_staging=True)
    control, trainers, rollouts = build(config, num_trainers=1, num_engines=1)
    connect(trainers)
    assert in_threads(*tinygroup.send(trainers, 1, ss=True), *_polls(rollouts, 1))[1:] == [1]
    seq = trainers[0][1].rank0
    seq.close("the group ended (test)")
    moved = control.transport.bytes_written
    trainers[0][0].load_weights(checkpoint(2).items())
    with pytest.raises(TransferFailed, match=r"the group ended \(test\)"):
        seq.run(2)
    assert control.transport.bytes_written == moved and rollouts[0][0].holds(1)


def test_an_engine_added_after_the_group_ended_is_told_at_add_engines():
    """Fuzz seed 307: the group ended (its only engine lost during a transfer); then an engine
    is added and add_engines() called. The call raises TransferFailed, and the added engine,
    never set up, must be told too (its polls returned None for ever)."""
    config = TransferConfig(timeout_s=1)
    control, trainers, rollouts = build(config, num_trainers=1, num_engines=1)
    connect(trainers)
    assert in_threads(*tinygroup.send(trainers, 1, ss=False), *_polls(rollouts, 1))[1:] == [1]
    control.kill(WorkerId("rollout", 0))
    out = in_threads(*tinygroup.send(trainers, 2, ss=False))
    assert isinstance(out[0], TransferFailed) and "No engine is left" in str(out[0]), out
    joined = _join_engine(control, config, 1)
    with pytest.raises(TransferFailed, match="No engine is left"):
        trainers[0][1].add_engines()
    with pytest.raises(TransferFailed, match="No engine is left"):
        joined.poll_requests()


def test_a_rank_stalled_when_the_group_ended_is_told_once_it_goes_on():
    """RS, one 2-rank engine: R0 (its rank 0) dies and R1 is stalled as version 2 lands, so
    the engine is excluded and the group ends (fuzz seed 290). R1 did not answer the notice
    and its rank 0 is dead; with no transfer to come nothing told it again, and once it went
    on its polls returned None for ever."""
    config = TransferConfig(timeout_s=1, receiver_staging=True)
    control, trainers, rollouts = build(config, num_trainers=1, sizes=(2, 2))
    connect(trainers)
    assert in_threads(*tinygroup.send(trainers, 1, ss=False), *_polls(rollouts, 1))[1:] == [1] * 2
    r1 = rollouts[1][1]
    control.kill(WorkerId("rollout", 0))
    control.stall(r1.worker)
    try:
        out = in_threads(*tinygroup.send(trainers, 2, ss=False))
        assert isinstance(out[0], TransferFailed) and "No engine is left" in str(out[0]), out
    finally:
        control.resume(r1.worker)
    control.settle(r1.worker)  # (R1 is served what waited for it)
    with pytest.raises(TransferFailed, match="Engine .0. is excluded"):
        r1.poll_requests()
