"""The pure coordination state machines: ordering, supersession, engine-consistent installs,
and which side blocks in each mode. No torch, no meshes, no threads."""

import random

import pytest

from weightbridge.config import Mode
from weightbridge.adapters.protocol import (EngineCoordinator, Relay, SenderStage,
                                            TrainerVersions, WorkerVersions)
from weightbridge.coordination.slots import StagingSlots

# -- modes ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("ss,rs,mode,trainer_waits,rollout_blocks", [
    (False, False, Mode.SYNC, "installed", True),
    (True, False, Mode.SS, "staged", True),
    (False, True, Mode.RS, "landed", False),
    (True, True, Mode.ASYNC, "staged", False),
])
def test_each_mode_says_which_side_blocks(ss, rs, mode, trainer_waits, rollout_blocks):
    m = Mode.from_flags(sender_staging=ss, receiver_staging=rs)
    assert m is mode
    assert (m.sender_staging, m.receiver_staging) == (ss, rs)
    assert m.trainer_returns_when == trainer_waits
    assert m.rollout_blocks_for_transfer is rollout_blocks


# -- one worker ----------------------------------------------------------------------------------

def test_a_relay_is_installed_at_its_step_not_before():
    w = WorkerVersions()
    w.relay(Relay(1, at_step=5))
    assert w.due(4) is None
    r = w.due(5)
    assert r == Relay(1, 5)
    w.done(r)
    assert w.installed == 1 and w.due(6) is None


def test_relays_out_of_order_are_refused():
    w = WorkerVersions()
    w.relay(Relay(2, at_step=1))
    with pytest.raises(ValueError, match="increasing order"):
        w.relay(Relay(2, at_step=2))
    with pytest.raises(ValueError, match="increasing order"):
        w.relay(Relay(1, at_step=2))


def test_a_newer_due_relay_supersedes_an_older_one_not_yet_installed():
    w = WorkerVersions()
    w.relay(Relay(1, at_step=3))
    w.relay(Relay(2, at_step=4))
    w.relay(Relay(3, at_step=9))
    r = w.due(6)  # the worker did not poll at steps 3..5
    assert r.version == 2
    w.done(r)
    assert w.due(8) is None and w.due(9).version == 3


# -- rank 0 of an engine -------------------------------------------------------------------------

def test_rank0_decides_for_the_next_step_and_waits_for_every_rank_before_the_next_decision():
    c = EngineCoordinator(num_ranks=2)
    assert c.decide(0) is None
    c.offer(1)
    assert c.decide(7) == Relay(1, 8)
    c.offer(2)
    assert c.decide(8) is None        # rank 1 has not installed version 1 yet
    c.installed(0, 1)
    assert c.decide(8) is None
    c.installed(1, 1)
    assert c.decide(9) == Relay(2, 10)


def test_offers_supersede_older_offers_not_yet_decided():
    c = EngineCoordinator(num_ranks=1)
    for v in (1, 2, 3):
        c.offer(v)
    c.offer(2)  # late, older: ignored
    assert c.decide(0).version == 3


def test_a_claim_gives_the_version_actually_staged():
    c = EngineCoordinator(num_ranks=1)
    c.offer(1)
    assert c.decide(0, claim=lambda: None) is None       # overwritten meanwhile
    assert c.decide(1, claim=lambda: (2, 1)) == Relay(2, 2, slot=1)


# -- staging slots -------------------------------------------------------------------------------

def test_a_new_transfer_never_writes_the_pinned_slot_and_overwrites_an_unclaimed_one():
    s = StagingSlots(num_engines=2)
    a = s.begin(1)
    s.complete(1)
    assert s.claim(0) == (1, a[0])            # engine 0 pins version 1; engine 1 does not poll
    b = s.begin(2)
    assert b[0] != a[0]
    s.complete(2)
    c = s.begin(3)                          # engine 0 still pinned on version 1
    assert c[0] == b[0] and c[0] != a[0]
    assert s.landed(0, b[0]) is None        # version 2 superseded while 3 lands
    assert s.claim(0) is None or s.claim(0)[0] == 1
    s.complete(3)
    assert s.claim(0) == (3, c[0])
    assert s.claim(1)[0] == 3               # the engine that never polled jumps to the newest


def test_fewer_than_two_slots_is_refused():
    with pytest.raises(ValueError, match="at least two"):
        StagingSlots(num_engines=1, num_slots=1)


# -- sender staging ------------------------------------------------------------------------------

def test_sender_staging_supersedes_an_unsent_version_and_waits_for_a_running_transfer():
    st = SenderStage()
    st.stage(1)
    st.stage(2)                                 # version 1 never left: superseded
    assert st.pending == 2 and st.start() == 2
    with pytest.raises(RuntimeError, match="wait for the transfer"):
        st.stage(3)
    st.finish()
    assert st.pending is None
    with pytest.raises(ValueError, match="must increase"):
        st.stage(2)
    st.stage(3)
    assert st.pending == 3


# -- the whole protocol, randomized --------------------------------------------------------------

@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
def test_no_engine_ever_runs_a_step_with_mixed_versions(seed, staged):
    """Two engines of three ranks; the sender lands versions at random moments (possibly
    mid-step), ranks poll in random order within a step, one engine sometimes stops polling.
    Invariants: an engine's ranks agree at every step; versions only increase; a rank installs
    only bytes of the version it was told (the staging slot was not overwritten under it)."""
    rng = random.Random(seed)
    num_engines, num_ranks = 2, 3
    slots = StagingSlots(num_engines)
    coords = [EngineCoordinator(num_ranks) for _ in range(num_engines)]
    workers = [[WorkerVersions() for _ in range(num_ranks)] for _ in range(num_engines)]
    # What the bytes in each (engine, slot) are, per rank: the landing writes them.
    contents: dict[tuple[int, int, int], int] = {}
    version, in_flight = 0, None
    seen = [[0] for _ in range(num_engines)]
    for step in range(200):
        for e in range(num_engines):
            if rng.random() < 0.3:
                # The sender makes progress between the polls of the engines.
                if in_flight is None and rng.random() < 0.5:
                    version += 1
                    in_flight = (version, slots.begin(version))
                    for ee, sl in in_flight[1].items():
                        for r in range(num_ranks):
                            contents[(ee, sl, r)] = -1  # being overwritten
                elif in_flight is not None:
                    v, where = in_flight
                    for ee, sl in where.items():
                        for r in range(num_ranks):
                            contents[(ee, sl, r)] = v
                    slots.complete(v)
                    for c in coords:
                        c.offer(v)
                    in_flight = None
            if e == 1 and 50 <= step < 120:
                continue  # engine 1 stalls (does not poll) for a while
            for r in rng.sample(range(num_ranks), num_ranks):
                if r == 0:
                    relay = coords[e].decide(step, claim=(lambda e=e: slots.claim(e))
                                             if staged else None)
                    if relay is not None:
                        for w in workers[e]:
                            w.relay(relay)  # acked before rank 0 goes on
                due = workers[e][r].due(step)
                if due is not None:
                    if staged:
                        assert contents[(e, due.slot, r)] == due.version, "slot overwritten"
                    workers[e][r].done(due)
                    coords[e].installed(r, due.version)
            installed = {w.installed for w in workers[e]}
            assert len(installed) == 1, f"engine {e} step {step}: mixed versions {installed}"
            (now,) = installed
            assert now >= seen[e][-1]
            seen[e].append(now)
    assert all(s[-1] > 0 for s in seen), "every engine installed something"


def test_a_cancelled_start_leaves_the_staged_version_pending():
    st = SenderStage()
    st.stage(1)
    st.start()
    st.cancel()
    assert st.pending == 1


def test_slots_of_a_replan_are_new_numbers_so_an_install_under_way_keeps_its_own():
    old = StagingSlots(num_engines=1)
    old.begin(1)
    old.complete(1)
    assert old.claim(0) == (1, 0)  # engine 0 installs version 1 from slot 0 ...
    new = StagingSlots(num_engines=1, first_slot=2)  # ... while a re-plan starts new slots
    assert new.claim(0) is None  # nothing landed under the new plan yet
    assert new.begin(2) == {0: 2}
    new.complete(2)
    assert new.claim(0) == (2, 2) and new.begin(3) == {0: 3}


def test_a_version_landed_before_a_replan_stays_claimable_and_one_landing_never_completes():
    slots = StagingSlots(num_engines=2)
    slots.begin(1)
    slots.complete(1)
    assert slots.claim(0) == (1, 0) and slots.claim(1) == (1, 0)
    slots.begin(2)
    slots.complete(2)  # version 2 in slot 1 of both engines; engine 1 has not claimed it
    assert slots.claim(0) == (2, 1)
    slots.replanned(first_slot=2)
    assert slots.claim(1) == (2, 1)  # the landed version, in the slot it landed in
    with pytest.raises(ValueError, match="a re-plan's slots are new numbers"):
        slots.replanned(first_slot=2)  # a slot made anew would hold no landed bytes
    assert slots.begin(3) == {0: 2, 1: 2}
    slots.complete(3)
    assert slots.claim(1) == (3, 2) and slots.landed(1, 1) is None  # superseded: forgotten
    slots.begin(4)  # landing when the group is planned again: it never completes
    slots.replanned(first_slot=4)
    slots.complete(4)
    assert slots.claim(0) == (3, 2) and slots.claim(1) == (3, 2)


# -- a trainer's live versions (sync, RS) --------------------------------------------------------

def test_a_trainer_waits_for_its_version_and_hears_how_it_went():
    tv = TrainerVersions()
    tv.enter(1)
    assert tv.waiting() == 1 and tv.outcome(1) is None
    tv.transferred(1)
    assert tv.outcome(1) == ("done", "", None) and tv.waiting() is None  # (not offered again)
    tv.leave()
    with pytest.raises(ValueError, match="after version 1: versions must increase"):
        tv.enter(1)
    tv.enter(3)
    tv.failed(3, "transfer", "rollout 2 lost")
    assert tv.outcome(3) == ("transfer", "rollout 2 lost", None) and tv.waiting() is None
    tv.leave()
    assert tv.outcome(3) is None and tv.done == 1  # failed: not done, and forgotten


def test_a_failure_no_call_waits_for_is_not_kept():
    # Staged modes: trainer 0 reports every failed transfer to every trainer, whose
    # send_weights returned long ago. SenderAdapter kept each such report in a dict nothing
    # read (one entry per failed update, for the life of the group).
    tv = TrainerVersions()
    for v in range(1, 1001):
        tv.failed(v, "transfer", "lost")
    assert tv._failure is None
    tv.enter(1001)
    tv.failed(1000, "transfer", "an older version's report, late")
    assert tv.outcome(1001) is None and tv.waiting() == 1001
