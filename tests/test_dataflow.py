"""Data-flow schedules and the notification inbox (no meshes): who waits for whom, per round,
and every wait bounded."""

import threading
import time

import pytest

from meshes.dataflow import Inbox, StepTimeout, UpdateAborted, schedules
from meshes.qwen3_moe import SIZES, RolloutShard, TrainerShard, checkpoint_spec
from weightbridge import Placement, Stage, WorkerId, extract_source_map, plan_transfer

STAGE_ORDER = {s: i for i, s in enumerate(Stage)}
T0, T1, R0, R1 = (WorkerId("trainer", 0), WorkerId("trainer", 1), WorkerId("rollout", 0),
                  WorkerId("rollout", 1))


@pytest.fixture(scope="module")
def plans():
    """TP2 trainers -> two nodes of two full-model rollouts: all three stages, many rounds."""
    config = SIZES["tiny"]
    spec = checkpoint_spec(config)
    trainers = [TrainerShard(config, 2, t, 1, 0) for t in range(2)]
    tmaps = [extract_source_map(w.params, w.load_weights, spec) for w in trainers]
    rollout = RolloutShard(config, 1, 0, 1, 0)
    rmap = extract_source_map(rollout.params, rollout.load_weights, spec)
    plan = plan_transfer([(m, Placement("t")) for m in tmaps],
                         [(rmap, Placement(f"r{i // 2}", engine=i // 2)) for i in range(4)],
                         round_bytes=64 << 10)
    return [plan.for_worker(w) for w in plan.workers]


@pytest.mark.parametrize("depth", [2, 3])
def test_every_write_is_an_expected_input_and_frees_go_to_the_writers_depth_rounds_later(
        plans, depth):
    scheds = schedules(plans, depth)
    writes = {(p.worker, r.index, w.stage, w.peer) for p in plans for r in p.rounds
              for w in r.writes}
    assert {s for _, _, s, _ in writes} == set(Stage)  # receive, external and internal
    got_in = {(w, r, st, s.worker) for s in scheds.values()
              for (r, st), ws in s.inputs.items() for w in ws}
    got_out = {(s.worker, r, st, p) for s in scheds.values()
               for (r, st), ps in s.outputs.items() for p in ps}
    assert got_in == writes == got_out
    num_rounds = max(len(p.rounds) for p in plans)
    assert num_rounds > depth + 2
    for s in scheds.values():
        assert s.depth == depth and s.num_rounds == num_rounds
        for r in range(num_rounds - depth):
            want = {src for (src, rr, _, dst) in writes if rr == r + depth and dst == s.worker}
            assert s.frees.get(r, frozenset()) == want
        assert all(r < num_rounds - depth for r in s.frees)
    assert scheds[T0].inputs == {} and scheds[T0].frees == {}  # nobody writes into trainers
    forwarded = 0
    for p in plans:  # each forwarding write waits for exactly the writes it forwards
        s = scheds[p.worker]
        for r in p.rounds:
            for stage in (Stage.EXTERNAL, Stage.INTERNAL):
                n = sum(w.stage is stage for w in r.writes)
                needs = s.needs.get((r.index, stage), ())
                assert len(needs) == n
                for deps in needs:
                    assert deps and all(STAGE_ORDER[st] < STAGE_ORDER[stage] and
                                        w in s.inputs[(r.index, st)] for w, st in deps)
                forwarded += n
    assert forwarded > 0


def test_depth_below_two_is_refused(plans):
    with pytest.raises(ValueError, match="depth must be >= 2"):
        schedules(plans, 1)


def test_a_wait_returns_once_every_expected_writer_reported():
    inbox = Inbox(R0)
    inbox.start(1)
    threading.Timer(0.05, inbox.landed, (1, 0, Stage.RECEIVE, T1)).start()
    inbox.landed(1, 0, Stage.RECEIVE, T0)
    t0 = time.monotonic()
    inbox.wait_landed(1, 0, Stage.RECEIVE, {T0, T1}, timeout_s=5)
    assert 0.03 < time.monotonic() - t0 < 2
    inbox.wait_landed(1, 0, Stage.EXTERNAL, (), timeout_s=0)  # nothing expected: no wait


def test_a_missing_writer_times_out_naming_it():
    inbox = Inbox(R0)
    inbox.start(3)
    inbox.landed(3, 2, Stage.EXTERNAL, R1)
    with pytest.raises(StepTimeout, match=r"rollout 0 waited 0.1s in update 3 for the external "
                       r"writes of round 2 from trainer 1; that worker died"):
        inbox.wait_landed(3, 2, Stage.EXTERNAL, {R1, T1}, timeout_s=0.1)
    with pytest.raises(StepTimeout, match=r"for rollout 1 to finish round 0"):
        inbox.wait_freed(3, 0, {R1}, timeout_s=0.05)


def test_an_abort_stops_a_waiter_at_once_with_the_failed_workers_reason():
    inbox = Inbox(T0)
    inbox.start(1)
    threading.Timer(0.05, inbox.abort, (1, "rollout 1 failed: OSError: disk")).start()
    t0 = time.monotonic()
    with pytest.raises(UpdateAborted, match="update 1 was aborted: rollout 1 failed: OSError"):
        inbox.wait_freed(1, 0, {R1}, timeout_s=30)
    assert time.monotonic() - t0 < 5


def test_stragglers_of_an_earlier_update_are_dropped_and_early_ones_of_the_next_kept():
    inbox = Inbox(R0)
    inbox.start(1)
    inbox.landed(2, 0, Stage.RECEIVE, T0)   # the next update's trainer is already writing
    inbox.start(2)
    inbox.landed(1, 0, Stage.RECEIVE, T1)   # late message of update 1
    inbox.abort(1, "old failure")
    inbox.wait_landed(2, 0, Stage.RECEIVE, {T0}, timeout_s=1)
    with pytest.raises(StepTimeout):
        inbox.wait_landed(2, 0, Stage.RECEIVE, {T1}, timeout_s=0.05)
