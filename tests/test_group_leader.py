"""`GroupLeader` alone, over the tiny group's workers on `LocalControl` (no sequencer, no bytes).

The leader owns a connected group's state; each operation is checked for what it promises
(coordination/leader.py): connect at generation 0, a re-plan under a new generation, a delta
plan only when the set changes, exclusion told to the excluded engine's workers and never
undone, a leave refused when it would empty the group, the staging ledger open to live
engines only.
"""

import pytest
from tinygroup import build

from weightbridge import TransferConfig, TransferFailed
from weightbridge.coordination.control import PeerCall
from weightbridge.coordination.leader import GroupLeader
from weightbridge.types import WorkerId

CONFIG = TransferConfig(timeout_s=10, receiver_staging=True)


def _leader(num_engines: int = 2):
    control, trainers, rollouts = build(CONFIG, num_engines=num_engines)
    leader = GroupLeader(control, CONFIG)
    leader.connect()
    return leader, rollouts


def _moved(leader) -> set[str]:
    """The checkpoint tensors the plan in force moves."""
    return {o.region.tensor for o in leader.plan.correspondence.overlaps}


def test_connect_plans_every_worker_at_generation_0():
    leader, _ = _leader()
    assert leader.generation == 0 and leader.tensors is None
    assert leader.live_engines() == [0, 1]
    assert leader.live_rollouts() == [WorkerId("rollout", 0), WorkerId("rollout", 1)]
    assert leader.live_trainers() == [WorkerId("trainer", 0), WorkerId("trainer", 1)]
    assert _moved(leader) == {"w", "v", "m"}


def test_a_replan_takes_a_new_generation_and_a_delta_plan_only_when_the_set_changes():
    leader, _ = _leader()
    leader.replan()
    assert leader.generation == 1
    assert leader.restrict(None) is False and leader.generation == 1  # nothing to change
    assert leader.restrict(frozenset({"w"})) is True and leader.generation == 2
    assert _moved(leader) == {"w"}
    assert leader.restrict(frozenset({"w"})) is False
    assert leader.restrict(None) is True and _moved(leader) == {"w", "v", "m"}
    assert leader.generation == 3


def test_connect_sets_up_unbounded_and_every_replan_bounded():
    """A re-plan sets up workers that were set up before: `RESETUP`, bounded, which the
    meshes send through the mailboxes; connect's `SETUP` stays an endpoint call (unbounded),
    whose state Monarch keeps in the caller, so a delta update re-planning every update
    grew trainer 0 by about 1.5 KB per other worker per update
    (`bench_soak.py --modes sync-delta --round-kib 8192`)."""
    control, _, _ = build(CONFIG, num_engines=2)
    issued: list = []
    issue = control._issue

    def counting(peers, call, args, failed=None):
        issued.extend([call] * len(peers))
        return issue(peers, call, args, failed)

    control._issue = counting
    leader = GroupLeader(control, CONFIG)
    leader.connect()
    setups = {PeerCall.SETUP, PeerCall.RESETUP}
    assert [c for c in issued if c in setups] == [PeerCall.SETUP] * 4  # 2 rollouts, 2 trainers
    assert not PeerCall.RESETUP.unbounded and PeerCall.SETUP.unbounded
    for tensors in (frozenset({"w"}), frozenset({"v"}), None):
        issued.clear()
        assert leader.restrict(tensors)
        assert [c for c in issued if c in setups] == [PeerCall.RESETUP] * 4
    assert _moved(leader) == {"w", "v", "m"}


def test_an_excluded_engine_is_told_why_and_stays_out_across_replans():
    leader, rollouts = _leader()
    leader.exclude([1], why="engine 1 stopped answering")
    assert leader.live_engines() == [0] and leader.why_out(1) == "engine 1 stopped answering"
    assert leader.why_out(0) is None
    _, told = rollouts[1]
    with pytest.raises(TransferFailed, match="engine 1 stopped answering"):
        told.poll_requests()
    leader.replan()
    assert leader.live_engines() == [0]
    assert leader.live_rollouts() == [WorkerId("rollout", 0)]
    assert WorkerId("rollout", 1) not in leader.group.live_rollouts


def test_a_leave_is_refused_for_the_last_engine_and_for_one_already_out():
    leader, _ = _leader()
    leader.leave(0)
    assert leader.live_engines() == [1] and "remove_engine(0)" in leader.why_out(0)
    with pytest.raises(ValueError):
        leader.leave(0)
    with pytest.raises(ValueError):
        leader.leave(1)  # the last one
    assert leader.live_engines() == [1]


def test_the_staging_ledger_lands_and_claims_for_live_engines_only():
    leader, _ = _leader()
    leader.exclude([1], why="out")
    slots = leader.begin_landing(1)
    assert set(slots) == {0}
    assert leader.claim(0) is None  # nothing landed yet
    leader.landed(1)
    assert leader.claim(0) == (1, slots[0])
    assert leader.claim(1) is None  # out: nothing lands there
    assert leader.claimed() == {0: 1}


def test_an_engine_asking_out_is_recorded_only_while_it_is_live():
    leader, _ = _leader()
    leader.ask_out(1, "rank 1 unreachable")
    assert leader.asked_out == {1: "rank 1 unreachable"}
    leader.exclude([1], why="rank 1 unreachable")
    assert leader.asked_out == {}
    leader.ask_out(1, "again")
    assert leader.asked_out == {}
