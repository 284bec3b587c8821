"""Rounds whose stages hand over peer to peer (`TransferConfig.round_control` "rounds"): the
table each round's message carries, a worker's waits on its writers, and whole transfers,
bit-exact, against the controller-driven stages."""

import threading
import time

import pytest
from planning_layouts import (checkpoint, fused_rollout, loaded, params_of, same_bytes,
                              tp_trainer)

from weightbridge import Placement, TransferConfig, plan_transfer, run_plan_locally
from weightbridge.config import ROUND_CONTROLS
from weightbridge.coordination.control import PeerCall
from weightbridge.coordination.local_control import LocalControl
from weightbridge.coordination.sequencer import active_steps
from weightbridge.coordination.session import ConnectedGroup, run_update, set_peers
from weightbridge.coordination.signals import Abandoned, RoundSignals, round_parts
from weightbridge.coordination.worker import TransferWorker
from weightbridge.errors import StepFailed
from weightbridge.execution.executor import incoming_ranges, outgoing_ranges
from weightbridge.types import Stage, WorkerId

T0, T1 = WorkerId("trainer", 0), WorkerId("trainer", 1)
R0, R1 = WorkerId("rollout", 0), WorkerId("rollout", 1)


def _multi_node_plan(round_bytes=160):
    """Two TP2 trainers -> two EP2 engines of two ranks each, two workers per node and one
    node per engine: rounds with RECEIVE, EXTERNAL and INTERNAL writes."""
    trainers = [(tp_trainer(r, 2), Placement("t0")) for r in range(2)]
    rollouts = [(fused_rollout(r, 2, ep=2), Placement(f"r{e}", engine=e))
                for e in range(2) for r in range(2)]
    return trainers, rollouts, plan_transfer(trainers, rollouts, round_bytes=round_bytes)


def test_a_rounds_part_names_every_writer_of_each_reader_by_stage_as_the_plan_routes_it():
    _, _, plan = _multi_node_plan()
    parts = round_parts(plan)
    stages_seen = set()
    for r in range(plan.num_rounds):
        transfers = plan.rounds[r].transfers
        if r not in parts:
            assert not transfers
            continue
        part = parts[r]
        want: dict = {}
        for t in transfers:
            want.setdefault(t.dst, {}).setdefault(t.stage, set()).add(t.src)
            stages_seen.add(t.stage)
        assert set(part.workers) == {t.src for t in transfers} | {t.dst for t in transfers}
        for reader in set(part.workers):
            got = {s: set(ws) for s, ws in part.writers_of(reader).items()}
            assert got == want.get(reader, {}), (r, reader)
    assert stages_seen == set(Stage)  # the layout exercises every stage


def test_a_wait_returns_each_writers_checksums_once_all_said_their_bytes_landed():
    sig = RoundSignals()
    writers = {Stage.RECEIVE: (T0, T1), Stage.EXTERNAL: (R1,)}
    sig.written(7, 3, 0, T1, (0, 1, 2, 3, 4))
    threading.Timer(0.05, sig.written, (7, 3, 0, T0, (0, 5, 6, 7, 8))).start()
    assert sig.wait(R0, 7, 3, writers, (Stage.RECEIVE,), 5.0) == (0, 5, 6, 7, 8, 0, 1, 2, 3, 4)
    sig.written(7, 3, 1, R1, ())
    assert sig.wait(R0, 7, 3, writers, (Stage.EXTERNAL, Stage.INTERNAL), 5.0) == ()


def test_a_writer_that_never_says_so_is_named_after_the_peer_timeout():
    sig = RoundSignals()
    sig.written(7, 0, 0, T0, ())
    sig.written(6, 0, 0, T1, ())  # another update's message does not count
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"R0: the writes of round 0 from T1 \(receive\) "
                                           r"did not land within 0.2s"):
        sig.wait(R0, 7, 0, {Stage.RECEIVE: (T0, T1)}, (Stage.RECEIVE,), 0.2)
    assert 0.2 <= time.monotonic() - start < 2.0


def test_an_abandoned_update_ends_its_waits_at_once():
    sig = RoundSignals()
    threading.Timer(0.05, sig.abandon, (7, "round 2 failed on T1")).start()
    start = time.monotonic()
    with pytest.raises(Abandoned, match="R0: round 4 was abandoned: round 2 failed on T1"):
        sig.wait(R0, 7, 4, {Stage.RECEIVE: (T0,)}, (Stage.RECEIVE,), 30.0)
    assert time.monotonic() - start < 5.0


def test_a_worker_keeps_the_messages_of_two_updates_at_most():
    sig = RoundSignals()
    for update in range(5):
        sig.written(update, 0, 0, T0, ())
        sig.abandon(update, "gone")
    assert list(sig._written) == [3, 4] and list(sig._abandoned) == [3, 4]


class Recorder:
    """A worker that logs the rounds it serves (each takes 0-20 ms)."""

    def __init__(self, worker: WorkerId):
        self.worker, self.side, self.served = worker, worker.side, []

    def on_round(self, update, r, slots, part):
        time.sleep(0.01 * (r % 3))
        self.served.append(r)


def _serve_rounds(worker: WorkerId, n: int) -> list[int]:
    import asyncio

    control = LocalControl()
    target = control.add(Recorder(worker))

    async def issue_all():
        await asyncio.gather(*[control.call_async([worker], PeerCall.ROUND, 1, r, {}, None)
                               for r in range(n)])

    asyncio.run(issue_all())
    return target.served


def test_a_worker_serves_its_rounds_in_the_order_issued():
    """A worker serves its rounds one at a time in the order the controller issued them, as
    a mesh agent does; `LocalControl.call_async` used to start each on a thread of its own,
    so a later round could start first (and wait forever on peers serving the earlier)."""
    assert _serve_rounds(T0, 12) == list(range(12))
    assert _serve_rounds(R0, 12) == list(range(12))


@pytest.mark.parametrize("how", ROUND_CONTROLS)
@pytest.mark.parametrize("round_bytes,depth", [(160, 2), (96, 3), (1 << 20, 2)])
def test_a_multi_node_transfer_is_bit_exact_either_way(how, round_bytes, depth):
    trainers, rollouts, plan = _multi_node_plan(round_bytes)
    ckpt = checkpoint(seed=11)
    tparams = [loaded(m, ckpt) for m, _ in trainers]
    rparams = [params_of(m, fill=7.0) for m, _ in rollouts]
    run_plan_locally(plan, tparams, rparams, depth=depth, round_control=how)
    for (m, _), got in zip(rollouts, rparams):
        want = loaded(m, ckpt, fill=7.0)
        for name in want:
            assert same_bytes(got[name], want[name]), name


class FailsRound(TransferWorker):
    """A trainer whose send of one round raises (``fail_at``; None: it sends)."""

    fail_at: int | None = None

    def on_send_round(self, r):
        if r == self.fail_at:
            raise RuntimeError(f"{self.worker}: injected failure in round {r}")
        return super().on_send_round(r)


class SlowFirstSend(TransferWorker):
    """A trainer whose next send first sleeps ``delay`` seconds; ``ended``: when it ended."""

    delay: float = 0.0
    ended: float | None = None

    def on_send_round(self, r):
        if not self.delay:
            return super().on_send_round(r)
        time.sleep(self.delay)
        self.delay = 0.0
        try:
            return super().on_send_round(r)
        finally:
            self.ended = time.monotonic()


def _local_group(plan, trainers, rollouts, config):
    """Every worker of ``plan`` on one `LocalControl`, set up as connect would (no probe):
    the trainers loaded with checkpoint 5, trainer 0 a `SlowFirstSend`, trainer 1 a
    `FailsRound`; the rollouts' parameters filled with 7.0. Returns (control, group, the
    rollouts' parameters)."""
    tparams = [loaded(m, checkpoint(seed=5)) for m, _ in trainers]
    rparams = [params_of(m, fill=7.0) for m, _ in rollouts]
    control = LocalControl()
    for w, params in zip(plan.workers, [*tparams, *rparams]):
        cls = {T0: SlowFirstSend, T1: FailsRound}.get(w, TransferWorker)
        control.add(cls(w.side, params, None, None, rank=w.index, placement=Placement(w.side),
                        transport=control.transport, config=config, control=control))
    plans = plan.worker_plans()
    ranges = incoming_ranges(plans.values(), config.depth)
    for w in plan.workers:
        control.call([w], PeerCall.SETUP, plans[w], sorted(ranges.get(w, ())))
        control.call([w], PeerCall.SET_PEERS,
                      dict.fromkeys(outgoing_ranges(plans[w], config.depth)))
    group = ConnectedGroup(plan=plan, active=active_steps(plans.values()),
                           live_rollouts=tuple(w for w in plan.workers if w.side == "rollout"),
                           num_handles=0, depth=config.depth,
                           round_control=config.round_control)
    return control, group, rparams


def _assert_hold_checkpoint(rollouts, rparams) -> None:
    """Every rollout parameter holds checkpoint 5 as its own loader puts it, bit for bit."""
    for (m, _), got in zip(rollouts, rparams):
        want = loaded(m, checkpoint(seed=5), fill=7.0)
        for name in want:
            assert same_bytes(got[name], want[name]), name


def test_a_failed_round_fails_the_update_at_once_and_frees_the_waiting_workers():
    """A trainer's round fails: the update fails at once naming it, and the rollouts that
    wait for its bytes are told the update was abandoned instead of waiting out their peer
    timeout, so the next update is not queued behind their waits."""
    trainers, rollouts, plan = _multi_node_plan(160)
    assert plan.num_rounds >= 3
    config = TransferConfig(round_bytes=160, timeout_s=60, round_control="rounds")
    control, group, rparams = _local_group(plan, trainers, rollouts, config)
    control.target(T1).fail_at = 1
    start = time.monotonic()
    with pytest.raises(StepFailed, match="round 1, send, forwards and land: .*T1: injected "
                                         "failure in round 1"):
        run_update(control, group)
    assert time.monotonic() - start < 10  # not the 48 s peer timeout of the waits
    control.target(T1).fail_at = None
    start = time.monotonic()
    run_update(control, group)
    assert time.monotonic() - start < 10
    _assert_hold_checkpoint(rollouts, rparams)


@pytest.mark.parametrize("round_control", ROUND_CONTROLS)
def test_a_failed_update_returns_only_once_no_worker_runs_a_step_of_it(round_control):
    """The bug: a step issued before another failed went on after `run_update` raised, and a
    late write of it met the next update's in a round buffer (the next update failed its
    checksum: `ChecksumMismatch` in round 0, seen once in CI). `run_update` now waits for
    such steps (`PeerCall.DRAIN`) before it raises."""
    trainers, rollouts, plan = _multi_node_plan(160)
    config = TransferConfig(round_bytes=160, timeout_s=60, round_control=round_control)
    control, group, rparams = _local_group(plan, trainers, rollouts, config)
    slow = control.target(T0)
    slow.delay = 0.5  # T0's send of round 0 still runs when T1's round 1 fails
    control.target(T1).fail_at = 1
    with pytest.raises(StepFailed, match="T1: injected failure in round 1"):
        run_update(control, group)
    raised = time.monotonic()
    assert slow.ended is not None and slow.ended <= raised
    control.target(T1).fail_at = None
    run_update(control, group)
    _assert_hold_checkpoint(rollouts, rparams)


def test_the_controller_sends_one_message_per_worker_per_round_and_none_per_stage():
    trainers, rollouts, plan = _multi_node_plan(160)
    config = TransferConfig(round_bytes=160, round_control="rounds")
    control, group, rparams = _local_group(plan, trainers, rollouts, config)
    counts: dict = {}
    issue = control._issue

    def counting(peers, call, args, failed=None):
        counts[call] = counts.get(call, 0) + len(peers)
        return issue(peers, call, args, failed)

    control._issue = counting
    run_update(control, group)
    parts = round_parts(plan)
    assert counts == {PeerCall.ROUND: sum(len(p.workers) for p in parts.values())}
    assert sum(len(p.workers) for p in parts.values()) < 2 * len(plan.workers) * len(parts)


@pytest.mark.parametrize("how", ROUND_CONTROLS)
def test_writers_are_given_their_readers_addresses_only_for_whole_rounds(how):
    """Only whole rounds post (`WRITTEN`): with stages, connect does not ask the control
    plane where each reader takes messages."""
    trainers, rollouts, plan = _multi_node_plan(160)
    config = TransferConfig(round_bytes=160, round_control=how)
    control, _, _ = _local_group(plan, trainers, rollouts, config)
    asked: list = []
    control.addresses = lambda peers: asked.append(list(peers)) or {}
    plans = plan.worker_plans()
    outgoing = {w: outgoing_ranges(plans[w], config.depth) for w in plan.workers}
    handles = {k: None for keys in outgoing.values() for k in keys}
    set_peers(control, outgoing, handles, config)
    readers = sorted({k[0] for k in handles}, key=lambda w: (w.side, w.index))
    assert asked == ([readers] if how == "rounds" else [])
    assert readers
