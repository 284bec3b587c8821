"""Engines joining and leaving a running controller-driven group, on real Monarch meshes.

Every join probes only the new engine, extends the plan (the others keep their tables and
registered buffers) and catches it up to the version the others hold; every update after it
is verified bit-exact (by checksum, on each rollout, against its own load_weights) on every
live engine. Each test's meshes are stopped even when it fails (MeshTransfer is a context
manager; procs given to it are stopped by the test).
"""

from __future__ import annotations

import os
import threading
import time

import pytest
from monarch.actor import this_host

from controller.driver import MeshTransfer, WorkersLost
from controller.ranks import by_rank
from controller.report import mismatches
from meshprocs import bootstrap_children
from meshes.actors import RolloutActor
from weightbridge.specs import RolloutSpec, TrainerSpec
from weightbridge import CatchUpRefused, TransferConfig, TransferFailed
from weightbridge.driver import TransferWorker

pytestmark = pytest.mark.mesh

CONFIG = TransferConfig(round_bytes=64 << 10)


def _trainer_egress(plan) -> int:
    sent, _ = plan.stage_bytes()
    return int(sent[:len(plan.trainers), 0].sum())


def _gone(pids: set[int], within_s: float = 30) -> bool:
    """Every process of ``pids`` exited within ``within_s`` (a proc exits once stopped)."""
    end = time.monotonic() + within_s
    while bootstrap_children() & pids and time.monotonic() < end:
        time.sleep(0.1)
    return not bootstrap_children() & pids


def _transfer(rollout: str) -> MeshTransfer:
    """Trainer TP2 to the ``rollout`` spec's engines, tiny model, meshes spawned on enter."""
    return MeshTransfer(TrainerSpec.parse("nodes=1,gpus=2,tp=2"), RolloutSpec.parse(rollout),
                        "tiny", config=CONFIG)


def test_engines_join_and_leave_between_updates_and_every_install_is_bit_exact():
    with _transfer("engines=2,nodes=1,gpus=1") as mt:
        mt.connect()
        first = mt.update(1)
        with pytest.raises(ValueError, match="not one add_engines"):
            mt.group.retire_engine(0)  # (the first rollout mesh's agents serve engine 1 too)
        handles, rounds = mt.num_handles, mt.plan.num_rounds
        procs = bootstrap_children()
        joined = mt.add_engine()
        spawned = bootstrap_children() - procs
        assert len(spawned) == 1, spawned  # its proc (one worker per engine)
        assert joined.engine == 2 and not joined.mismatched, joined.line()
        assert joined.num_params * 2 == first.num_params  # its own parameters, verified
        # A replica: mirrored on engine 0, no round added; the catch-up is a whole update.
        assert joined.num_rounds == (rounds, rounds) == (mt.plan.num_rounds,) * 2
        assert joined.rdma_bytes * 2 == first.rdma_bytes * 3
        assert mt.num_handles > handles  # its ranges; the old ones are kept as they were
        three = mt.update(2)
        assert not three.mismatched and three.num_params * 2 == first.num_params * 3, three.line()
        mt.remove_engine(2)  # nothing depends on a mirrored engine: its rows just go
        assert mt.num_handles == handles
        # Its proc, spawned by add_engine, is stopped with it: a long-lived group that adds
        # and removes engines does not keep every retired engine's process (it did, to close).
        assert _gone(spawned), bootstrap_children() & spawned
        two = mt.update(3)
        assert not two.mismatched and two.num_params == first.num_params, two.line()
        assert two.rdma_bytes == first.rdma_bytes
        mt.remove_engine(0)  # engine 1 relied on engine 0's landings: planned again
        one = mt.update(4)
        assert not one.mismatched and one.num_params * 2 == first.num_params, one.line()
        again = mt.add_engine()
        assert again.engine == 3 and not again.mismatched, again.line()
        extended = mt.update(5)
        assert not extended.mismatched and extended.num_params == first.num_params
        # Mirrored joins already send each element out of the trainers once; replan()
        # rebalances the forwards over all engines.
        egress = _trainer_egress(mt.plan)
        plan = mt.replan()
        assert _trainer_egress(plan) == egress == first.rdma_bytes // 2
        folded = mt.update(6)
        assert not folded.mismatched and folded.num_params == first.num_params


def test_a_join_on_given_procs_before_the_first_update_gets_the_first_update():
    procs = this_host().spawn_procs(per_host={"worker": 2}, name="joining")
    odd = this_host().spawn_procs(per_host={"worker": 1}, name="odd")
    try:
        with _transfer("engines=1,nodes=1,gpus=2,tp=2") as mt:
            mt.connect()
            with pytest.raises(ValueError, match="an engine of this group has 2 workers"):
                mt.add_engine(odd)
            joined = mt.add_engine(procs)
            assert joined.catch_up_s == 0 and joined.num_params == 0  # nothing to catch up
            report = mt.update(1)
            assert not report.mismatched and report.num_params > 0, report.line()
            assert mt.rollout_spec.engines == 2
    finally:
        for p in (procs, odd):
            p.stop().get(timeout=60)


def test_a_join_while_a_delta_plan_is_in_force_gets_every_tensor_and_deltas_go_on():
    with _transfer("engines=1,nodes=1,gpus=1") as mt:
        mt.connect()
        full = mt.update(1)
        norm = ["model.norm.weight"]
        assert not mt.update(2, changed=norm).mismatched
        joined = mt.add_engine()  # the tensors of versions 1 and 2, each as the others hold it
        assert not joined.mismatched and joined.num_params == full.num_params, joined.line()
        after = mt.update(3, changed=norm)  # a delta again, to both engines
        assert not after.mismatched and after.num_params == 2 * full.num_params, after.line()
        assert 0 < after.rdma_bytes < full.rdma_bytes


@pytest.mark.parametrize("receiver_staging", [False, True], ids=["sync", "rs"])
def test_a_join_after_the_next_train_step_is_refused_and_the_engines_keep_their_version(
        receiver_staging):
    """Issue 44, item 1: in the documented loop the trainers train v + 1 right after
    update(v). Without sender staging a join's catch-up re-sends the trainers' parameters to
    every engine, so it wrote the unsent v + 1 into the old engines under the label v. It is
    refused now, before anything spawns or moves; after the next update a join works."""
    config = TransferConfig(round_bytes=64 << 10, receiver_staging=receiver_staging)
    with MeshTransfer(TrainerSpec.parse("nodes=1,gpus=1"),
                      RolloutSpec.parse("engines=1,nodes=1,gpus=1"), "tiny",
                      config=config) as mt:
        mt.connect()
        mt.update(1)
        mt.poll_requests()  # (RS: installs version 1)
        mt.trainers.train_step.call(2).get()  # the next train step, version 2 not sent
        with pytest.raises(CatchUpRefused, match="no longer hold version 1"):
            mt.add_engine()
        assert mt.rollout_spec.engines == 1  # nothing spawned
        count, bad = mismatches(by_rank(mt.rollouts.checksums.call(1).get()))
        assert count > 0 and not bad, bad  # engine 0 still holds version 1, every byte
        mt.update(2, train=False)
        mt.poll_requests()
        joined = mt.add_engine()  # the trainers hold what the engines hold again
        assert not joined.mismatched and joined.num_params == count, joined.line()
        # (RS: a poll after a join raised AssertionError: {0: (2, 0), 1: None}; item 9)
        assert mt.poll_requests() is None


@pytest.mark.parametrize("receiver_staging", [False, True], ids=["ss", "async"])
def test_with_sender_staging_a_join_after_a_replan_stages_the_held_version_again(
        receiver_staging):
    """Issue 44, item 8: with sender staging the catch-up sends the staged copy, which a
    re-plan drops (it was laid out for the old plan): any join after remove_engine() or
    replan() failed with ``TypeError: 'NoneType' object is not subscriptable``. The join now
    stages the version the engines hold again where the trainers still hold it, and refuses
    (`CatchUpRefused`, before anything spawns) where a train step ran since."""
    config = TransferConfig(round_bytes=64 << 10, sender_staging=True,
                            receiver_staging=receiver_staging)
    with MeshTransfer(TrainerSpec.parse("nodes=1,gpus=1"),
                      RolloutSpec.parse("engines=2,nodes=1,gpus=1"), "tiny",
                      config=config) as mt:
        mt.connect()
        mt.update(1)
        mt.poll_requests()
        mt.remove_engine(0)  # (engine 1 relied on engine 0's landings: planned again)
        joined = mt.add_engine()
        assert not joined.mismatched and joined.num_params > 0, joined.line()
        mt.replan()
        mt.trainers.train_step.call(2).get()  # the staged copy is gone, the trainers moved on
        with pytest.raises(CatchUpRefused, match="no longer hold version 1"):
            mt.add_engine()
        assert mt.rollout_spec.engines == 3  # nothing spawned
        count, bad = mismatches(by_rank(mt.meshes.rollout_meshes[-1][1].checksums.call(1)
                                        .get()))
        assert count > 0 and not bad, bad  # the joined engine still holds version 1


def test_a_membership_change_from_another_thread_waits_for_the_running_update():
    """Issue 44, item 6: remove_engine(1) from a second thread during update(2) re-planned
    mid-transfer (a bogus ChecksumMismatch, engine 0 torn). It now waits for the update, as
    the adapters' session lock makes it: the update ends whole on both engines, then the
    engine leaves and the next update goes to engine 0 alone."""
    with _transfer("engines=2,nodes=1,gpus=1") as mt:
        mt.connect()
        first = mt.update(1)
        moving, leaving = threading.Event(), threading.Event()
        order: list[str] = []
        move, leave = mt._move, mt.leader.leave

        def slow_move(version):  # (gives a concurrent leave 2 s to start: it must not)
            moving.set()
            leaving.wait(2)
            move(version)
            order.append("moved")

        def told_leave(engine):
            order.append("leave")
            leaving.set()
            return leave(engine)

        mt._move, mt.leader.leave = slow_move, told_leave
        result: list = []
        updating = threading.Thread(target=lambda: result.append(_outcome(mt.update, 2)))
        updating.start()
        assert moving.wait(60)
        mt.remove_engine(1)
        updating.join(timeout=120)
        assert order == ["moved", "leave"], order
        assert not result[0].mismatched and result[0].num_params == first.num_params, result
        mt._move = move
        after = mt.update(3)
        assert not after.mismatched and after.num_params * 2 == first.num_params, after.line()


def _outcome(call, *args):
    """What ``call(*args)`` returned, or the exception it raised."""
    try:
        return call(*args)
    except Exception as e:  # noqa: BLE001  (the test asserts on it)
        return e


class DiesInItsCatchUp(TransferWorker):
    """Rollout 2 (the first worker of a joining engine) exits in its catch-up's first land."""

    def on_land(self, r, slots=None, expected=None):
        if self.worker.index == 2:
            os._exit(3)
        super().on_land(r, slots, expected)


class DiesInItsCatchUpRollout(RolloutActor):
    worker_class = DiesInItsCatchUp


def test_a_joiner_lost_in_its_catch_up_is_left_out_and_the_group_goes_on():
    """Issue 44, item 8: a joining engine killed in its catch-up stayed in the group (the
    next update ran into it). It is left out now, `add_engine` says so, and the next update
    reaches the other engines whole."""
    with MeshTransfer(TrainerSpec.parse("nodes=1,gpus=1"),
                      RolloutSpec.parse("engines=2,nodes=1,gpus=1"), "tiny",
                      rollout_actor=DiesInItsCatchUpRollout,
                      config=TransferConfig(round_bytes=64 << 10, timeout_s=5)) as mt:
        mt.connect()
        first = mt.update(1)
        with pytest.raises(TransferFailed, match="it is out of the group again"):
            mt.add_engine()
        assert mt.lost_engines == {2}
        after = mt.update(2)
        assert not after.mismatched and after.num_params == first.num_params, after.line()


class DiesInItsSecondUpdate(TransferWorker):
    """Rollout 1's process exits in round 1 of the second update (an OOM kill, say)."""

    landed = 0

    def on_land(self, r, slots=None, expected=None):
        if self.worker.index == 1 and r == 1:
            self.landed += 1
            if self.landed == 2:
                os._exit(3)
        super().on_land(r, slots, expected)


class DiesInItsSecondUpdateRollout(RolloutActor):
    worker_class = DiesInItsSecondUpdate


def test_after_a_lost_engine_deltas_and_joins_verify_against_what_the_rollouts_hold():
    """Issue 23, finding 3: update 2 loses engine 1 (`WorkersLost`, version 2 re-sent to
    engine 0). The next delta must leave every other tensor at version 2 (the trainers used
    to reload version 1's, a mismatch in every parameter but the delta's), and a join must be
    verified against version 2's tensors too."""
    norm = ["model.norm.weight"]
    with MeshTransfer(TrainerSpec.parse("nodes=1,gpus=1"),
                      RolloutSpec.parse("engines=2,nodes=1,gpus=1"), "tiny",
                      rollout_actor=DiesInItsSecondUpdateRollout,
                      config=TransferConfig(round_bytes=64 << 10, timeout_s=5)) as mt:
        mt.connect()
        assert not mt.update(1).mismatched
        with pytest.raises(WorkersLost) as lost:
            mt.update(2)
        resent = mt.wait()  # (version 2, re-sent to engine 0 after the raise)
        assert lost.value.lost_engines == {1} and not resent.mismatched, resent.line()
        delta = mt.update(3, changed=norm)
        assert not delta.mismatched and delta.num_params > 0, delta.line()
        joined = mt.add_engine()
        assert not joined.mismatched and joined.num_params > 0, joined.line()
        after = mt.update(4, changed=norm)
        assert not after.mismatched and after.num_params == 2 * joined.num_params, after.line()


class DiesOnceInItsSetUp(TransferWorker):
    """A joining engine's process (rank 2) exits once, at the point of its set-up named by
    ``WB_TEST_DIE_AT`` (``attach``: building its worker; ``source_map``: the join's probe;
    ``setup``: its plan's set-up), unless the marker file ``WB_TEST_DIED`` exists (it is
    made first: the next joiner, rank 2 again, lives)."""

    def __init__(self, side, *args, rank, **kwargs):
        self._dies = side == "rollout" and rank == 2
        self._die("attach")
        super().__init__(side, *args, rank=rank, **kwargs)

    def _die(self, where: str) -> None:
        marker = os.environ.get("WB_TEST_DIED", "")
        if self._dies and os.environ.get("WB_TEST_DIE_AT") == where and marker \
                and not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(3)

    def on_source_map(self, how="probe"):
        self._die("source_map")
        return super().on_source_map(how)

    def on_setup(self, plan, ranges=(), generation=0):
        self._die("setup")
        return super().on_setup(plan, ranges, generation)


class DiesOnceInItsSetUpRollout(RolloutActor):
    worker_class = DiesOnceInItsSetUp


@pytest.mark.parametrize("where", ["attach", "source_map", "setup"])
def test_a_joiner_lost_in_its_set_up_is_rolled_back_and_the_group_goes_on(
        where, tmp_path, monkeypatch):
    """Issue 44, item 8 (the wedge): a joining engine killed while it was set up left every
    later update() and add_engine() failing at once (a SupervisionError from the dead
    actors), and close() raising. The join is rolled back now: add_engine raises
    TransferFailed naming the engine and what to do, the next update reaches the other
    engines whole, the next join works, and close() succeeds."""
    # (Children inherit the environment when spawned: the joiner's procs see these.)
    monkeypatch.setenv("WB_TEST_DIE_AT", where)
    monkeypatch.setenv("WB_TEST_DIED", str(tmp_path / "died"))
    mt = MeshTransfer(TrainerSpec.parse("nodes=1,gpus=1"),
                      RolloutSpec.parse("engines=2,nodes=1,gpus=1"), "tiny",
                      rollout_actor=DiesOnceInItsSetUpRollout,
                      config=TransferConfig(round_bytes=64 << 10, timeout_s=5))
    with mt:
        mt.connect()
        first = mt.update(1)
        with pytest.raises(TransferFailed, match="engine 2") as failed:
            mt.add_engine()
        assert (tmp_path / "died").exists()  # (it died where the test says, not elsewhere)
        assert "add_engine()" in str(failed.value), failed.value
        after = mt.update(2)
        assert not after.mismatched and after.num_params == first.num_params, after.line()
        joined = mt.add_engine()
        assert not joined.mismatched and joined.num_params * 2 == first.num_params, joined
        three = mt.update(3)
        assert not three.mismatched and three.num_params * 2 == first.num_params * 3, three
    assert mt.closed  # (close() ran on leaving the block and raised nothing)


@pytest.mark.parametrize("receiver_staging", [False, True], ids=["ss", "async"])
def test_with_sender_staging_a_join_under_a_delta_plan_after_a_train_step_is_refused(
        receiver_staging):
    """Found by the controller's fuzz (issue 44, item 1 under a delta plan): a join plans
    everything again when a delta plan is in force, which drops the staged copy (it held the
    delta's tensors only), so the catch-up staged the trainers' parameters again: after the
    next train step that wrote version 3's bytes into engine 0 under the label 2 (42 of 42
    parameters differ, silently; a MISMATCH named only the joiner). Refused now, before
    anything spawns, and engine 0 keeps what it holds."""
    config = TransferConfig(round_bytes=64 << 10, sender_staging=True,
                            receiver_staging=receiver_staging)
    norm = "model.norm.weight"
    with MeshTransfer(TrainerSpec.parse("nodes=1,gpus=1"),
                      RolloutSpec.parse("engines=1,nodes=1,gpus=1"), "tiny",
                      config=config) as mt:
        mt.connect()
        for version, changed in ((1, None), (2, [norm])):
            mt.update(version, changed)
            mt.wait()
            mt.poll_requests()
        holds = {**dict.fromkeys(mt.book.tensors, 1), norm: 2}
        mt.trainers.train_step.call(3).get()  # the next train step, version 3 not sent
        with pytest.raises(CatchUpRefused, match="no longer hold version 2"):
            mt.add_engine()
        assert mt.rollout_spec.engines == 1  # nothing spawned
        count, bad = mismatches(by_rank(mt.rollouts.checksums.call(holds).get()))
        assert count > 0 and not bad, bad
