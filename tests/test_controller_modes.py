"""The single controller in the staging modes, on real Monarch meshes (CPU, TCP RDMA fallback).

`MeshTransfer.update` returns once the trainers may go on (SS, async: staged; RS: landed),
`poll_requests` puts the newest version into every engine at one step, and no byte enters a
rollout's parameters before that: every check compares the rollouts' parameters bit for bit
(checksums of their raw bytes, on the rollouts) with their own load_weights of the versions
they must hold, known here independently of the controller's books.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

import torch

from controller.driver import MeshTransfer, WorkersLost
from meshprocs import proc_pair
from faults import DiesInRound1Rollout
from meshes.actors import RolloutActor, TrainerActor
from weightbridge.specs import RolloutSpec, TrainerSpec
from weightbridge import GroupClosed, ParameterRebound, TransferConfig, TransferFailed
from weightbridge.driver import TransferWorker
from weightbridge.config import Mode

pytestmark = pytest.mark.mesh

TRAINER, ROLLOUT = TrainerSpec.parse("nodes=1,gpus=2,tp=2"), RolloutSpec.parse(
    "engines=2,nodes=1,gpus=1")


def _config(mode: str, **kw) -> TransferConfig:
    m = Mode(mode)
    return TransferConfig(round_bytes=64 << 10, timeout_s=kw.pop("timeout_s", 30),
                          sender_staging=m.sender_staging, receiver_staging=m.receiver_staging)


@pytest.fixture(scope="module")
def procs():
    with proc_pair(2, 2) as meshes:
        yield meshes


def _holds(mt: MeshTransfer, versions) -> tuple[int, tuple[str, ...]]:
    """(parameters compared, mismatches) of every live rollout against ``versions``."""
    return mt._verify(mt._live("rollout"), versions)


@pytest.mark.parametrize("mode", ["ss", "rs", "async"])
def test_each_version_enters_the_parameters_only_at_poll_requests_and_bit_exact(procs, mode):
    m = Mode(mode)
    with MeshTransfer(TRAINER, ROLLOUT, "tiny", config=_config(mode), procs=procs) as mt:
        mt.connect()
        for v in (1, 2, 3):
            report = mt.update(v)
            assert report.state == ("staged" if m.sender_staging else "landed"), report.line()
            if m.sender_staging:
                streamed = mt.wait()
                assert streamed.version == v and streamed.rdma_bytes > 0
                assert streamed.state == ("landed" if m.receiver_staging else "installed")
                assert not streamed.mismatched, streamed.line()
            if m.receiver_staging and v > 1:
                # Landed, not installed: the parameters still hold the version before.
                count, bad = _holds(mt, v - 1)
                assert count > 0 and not bad, bad[:4]
            installed = mt.poll_requests()
            if m.receiver_staging:
                assert installed.version == v and not installed.mismatched
            assert mt.poll_requests() is None  # nothing newer
            count, bad = _holds(mt, v)
            assert count > 0 and not bad, bad[:4]


def test_receiver_staging_carries_the_deltas_of_a_version_never_installed(procs):
    """v2 changes the norm and lands; v3 changes the embedding and lands over it; the one
    install (v3) must bring both changes: the delta plan of v3 carries what the rollouts lack,
    not only what changed in v3."""
    with MeshTransfer(TRAINER, ROLLOUT, "tiny", config=_config("rs"), procs=procs) as mt:
        mt.connect()
        mt.update(1)
        mt.poll_requests()
        tensors = mt.book.tensors
        norm, embed = "model.norm.weight", "model.embed_tokens.weight"
        assert {norm, embed} <= set(tensors)
        two = mt.update(2, changed=[norm])
        three = mt.update(3, changed=[embed])
        assert 0 < two.rdma_bytes < three.rdma_bytes  # (v3 carries both)
        installed = mt.poll_requests()
        want = {t: 3 if t == embed else 2 if t == norm else 1 for t in tensors}
        count, bad = _holds(mt, want)
    assert installed.version == 3 and not installed.mismatched, installed.line()
    assert count > 0 and not bad, bad[:4]


def test_async_a_landed_version_overwritten_before_any_install_is_never_installed(procs):
    """Async: v2 lands and is never installed; v3's rounds overwrite its slot (the slot the
    engines installed v1 from stays pinned). A poll while v3 streams installs nothing (v2 is
    gone, v1 is held: it once asserted on v2), the next one installs v3, bit-exact."""
    with MeshTransfer(TRAINER, ROLLOUT, "tiny", config=_config("async"), procs=procs) as mt:
        mt.connect()
        mt.update(1)
        mt.wait()
        assert mt.poll_requests().version == 1
        mt.update(2)
        mt.wait()  # landed, not installed
        mt.update(3)  # staged; its rounds stream into v2's slot
        during = mt.poll_requests()
        mt.wait()
        last = mt.poll_requests()
        count, bad = _holds(mt, 3)
    assert during is None or during.version == 3, during
    assert (last or during).version == 3 and not (last or during).mismatched
    assert count > 0 and not bad, bad[:4]


@pytest.mark.parametrize("mode", ["ss", "async"])
def test_a_rollout_lost_while_a_version_streams_is_raised_once_and_the_group_goes_on(mode):
    """R1 (engine 1) dies while version 1 streams: the next call that joins the stream
    raises `WorkersLost` (engine 1 out; nothing re-sent: the staged copy was laid out for the
    old plan), and version 2 reaches engine 0 whole. SS: engine 0's parameters may hold part
    of version 1, so every poll raises until version 2 reached it (they returned None)."""
    mt = MeshTransfer(TrainerSpec.parse("nodes=1,gpus=1"), ROLLOUT, "tiny",
                      rollout_actor=DiesInRound1Rollout, config=_config(mode, timeout_s=5))
    with mt:
        mt.connect()
        assert mt.update(1).state == "staged"
        with pytest.raises(WorkersLost) as lost:
            mt.wait()
        assert mt.wait() is None  # raised once
        if mode == "ss":  # engine 0 may hold part of version 1: fenced (issue 44, item 7)
            for _ in range(2):
                with pytest.raises(TransferFailed, match="hold part of version 1"):
                    mt.poll_requests()
        else:
            assert mt.poll_requests() is None  # (async: engine 0 keeps what it runs)
        mt.update(2)
        mt.wait()
        mt.poll_requests()
        count, bad = _holds(mt, 2)
    assert lost.value.lost_engines == {1}
    assert "was not re-sent" in str(lost.value), str(lost.value)
    assert count > 0 and not bad, bad[:4]


def test_receiver_staging_re_sends_a_version_whose_rounds_lost_a_rollout():
    """RS: the trainers' parameters still hold version 1 when R1 dies in its rounds, so it is
    re-sent over a new plan into engine 0's staging (after `WorkersLost` is raised), and the
    next poll installs it, bit-exact."""
    mt = MeshTransfer(TrainerSpec.parse("nodes=1,gpus=1"), ROLLOUT, "tiny",
                      rollout_actor=DiesInRound1Rollout, config=_config("rs", timeout_s=5))
    with mt:
        mt.connect()
        with pytest.raises(WorkersLost) as lost:
            mt.update(1)
        installed = mt.poll_requests()
        count, bad = _holds(mt, 1)
    assert lost.value.lost_engines == {1}
    assert "poll_requests() installs it" in str(lost.value), str(lost.value)
    assert installed.version == 1 and not installed.mismatched
    assert count > 0 and not bad, bad[:4]


class ForgetfulTrainer(TrainerActor):
    """Its train step of version 1 writes nothing: the parameters keep what connect's probe
    left (the default ``trainer_restore="none"`` keeps no copy)."""

    def _train_step(self, version):
        if version >= 2:
            super()._train_step(version)


@pytest.mark.parametrize("mode", ["sync", "ss"])
def test_an_update_of_weights_not_loaded_after_connect_is_refused_before_any_byte_moves(
        procs, mode):
    """The trainers' first send after a probe that kept no copy checks the weights were
    loaded since (the probe leaves NaN in each parameter's first elements): the controller's
    update raises the ``ValueError`` naming them, nothing moves, and the next update, of
    loaded weights, goes bit-exact."""
    with MeshTransfer(TRAINER, ROLLOUT, "tiny", config=_config(mode), procs=procs,
                      trainer_actor=ForgetfulTrainer) as mt:
        mt.connect()
        with pytest.raises(ValueError, match="were not loaded after connect"):
            mt.update(1)
        assert mt.wait() is None  # (SS: nothing streams)
        assert mt.poll_requests() is None
        mt.update(2)
        mt.poll_requests()
        count, bad = _holds(mt, 2)
        assert count > 0 and not bad, bad[:4]


class RebindingTrainer(TrainerActor):
    """Its train step of version 2 and later rebinds every parameter's storage
    (``p.data = new``, as ``load_state_dict(assign=True)`` does), then loads the version."""

    def _train_step(self, version):
        if version >= 2:
            for p in self.parts.params.values():
                p.data = torch.empty_like(p)
        super()._train_step(version)


@pytest.mark.parametrize("mode", ["sync", "ss"])
def test_a_trainer_step_that_rebinds_storage_is_refused_before_any_byte_moves(procs, mode):
    """Issue 44, item 4: the copy tables read the storage registered at connect, so a
    rebound parameter shipped its connect-time bytes under every later label (checksums on).
    The controller's update now raises `ParameterRebound` naming it (sync: before the rounds;
    SS: before the staged copy is taken), and the rollouts keep version 1."""
    with MeshTransfer(TRAINER, ROLLOUT, "tiny", config=_config(mode), procs=procs,
                      trainer_actor=RebindingTrainer) as mt:
        mt.connect()
        mt.update(1)
        mt.poll_requests()
        with pytest.raises(ParameterRebound, match="no longer uses the storage"):
            mt.update(2)
        assert mt.wait() is None  # (SS: nothing streams)
        count, bad = _holds(mt, 1)
        assert count > 0 and not bad, bad[:4]


class StepsRightAfterStaging(TransferWorker):
    """Trainer 1 starts its next train step the moment its staged copy is taken: its
    parameters change while the staged version streams (as in the documented loop)."""

    def on_stage(self, version):
        super().on_stage(version)
        if self.worker.index == 1:
            with torch.no_grad():
                for p in self.params.values():
                    p.add_(1)


class StepsRightAfterStagingTrainer(TrainerActor):
    worker_class = StepsRightAfterStaging


@pytest.mark.parametrize("mode", ["ss", "async"])
def test_the_replica_check_compares_the_staged_copies_that_are_sent(procs, mode):
    """Issue 44, item 9: with sender staging the replica check ran on the controller's
    streaming thread and hashed the trainers' live parameters, so a train step that overlaps
    the stream gave a false `ReplicaMismatch` (and a real divergence of the staged copies
    would pass). Two data-parallel trainers; trainer 1 steps at once after staging: every
    version still arrives whole, from the staged copies."""
    with MeshTransfer(TrainerSpec.parse("nodes=1,gpus=2"), ROLLOUT, "tiny",
                      config=_config(mode), procs=procs,
                      trainer_actor=StepsRightAfterStagingTrainer) as mt:
        mt.connect()
        for v in (1, 2):
            mt.update(v)
            streamed = mt.wait()
            assert streamed.version == v and not streamed.mismatched, streamed.line()
            mt.poll_requests()
            count, bad = _holds(mt, v)
            assert count > 0 and not bad, bad[:4]


def test_a_closed_mesh_transfer_refuses_every_call_with_one_error(procs):
    """Issue 44, item 10: calls on a closed `MeshTransfer` gave SupervisionError,
    AttributeError or a KeyboardInterrupt; each now raises `GroupClosed` saying what to do."""
    with MeshTransfer(TRAINER, ROLLOUT, "tiny", config=_config("sync"), procs=procs) as mt:
        mt.connect()
        mt.update(1)
    for call, args in ((mt.update, (2,)), (mt.poll_requests, ()), (mt.wait, ()),
                       (mt.add_engine, ()), (mt.remove_engine, (1,)), (mt.replan, ()),
                       (mt.connect, ())):
        with pytest.raises(GroupClosed, match="this MeshTransfer was closed"):
            call(*args)
    mt.close()  # (safe twice)


class StallsInItsFirstInstall(TransferWorker):
    """Rollout 1 (engine 1) stops for 8 s in its first install (a SIGSTOP, a long GC)."""

    def on_install(self, slot, version):
        if self.worker.index == 1 and version == 1:
            time.sleep(8)
        super().on_install(slot, version)


class StallsInItsFirstInstallRollout(RolloutActor):
    worker_class = StallsInItsFirstInstall


def test_a_rank_stalled_at_install_is_fenced_within_timeout_and_the_others_go_on():
    """Issue 44, item 7: RS, a rollout stalled in poll_requests' install gave a plain
    TimeoutError after the peer timeout, its engine stayed in and ran two versions. Now the
    engine is left out and told, the poll raises `WorkersLost` naming it without waiting for
    the stalled rank, and engine 0, which installed version 1, goes on with version 2."""
    mt = MeshTransfer(TrainerSpec.parse("nodes=1,gpus=1"), ROLLOUT, "tiny",
                      rollout_actor=StallsInItsFirstInstallRollout,
                      config=_config("rs", timeout_s=3))
    with mt:
        mt.connect()
        mt.update(1)
        t0 = time.monotonic()
        with pytest.raises(WorkersLost, match="did not install version 1") as lost:
            mt.poll_requests()
        # Named at the peer timeout (2.4 s), then the others verified: not the 8 s stall.
        assert time.monotonic() - t0 < 8, time.monotonic() - t0
        assert lost.value.lost_engines == {1}
        count, bad = _holds(mt, 1)
        assert count > 0 and not bad, bad[:4]
        mt.update(2)
        installed = mt.poll_requests()
        assert installed.version == 2 and not installed.mismatched, installed.line()


def test_close_from_another_thread_ends_a_running_update_with_group_closed():
    """Issue 44, item 10: update() running while another thread called close() raised
    Monarch's ``asyncio.CancelledError`` (or a dead actor's error); it raises `GroupClosed`
    now, and so does every later call."""
    mt = MeshTransfer(TrainerSpec.parse("nodes=1,gpus=1"), ROLLOUT, "tiny",
                      config=_config("sync", timeout_s=10))
    with mt:
        mt.connect()
        mt.update(1)
        moving, closed = threading.Event(), threading.Event()
        move = mt._move

        def held_move(version):  # (the rounds start once close() stopped the meshes)
            moving.set()
            closed.wait(60)
            move(version)

        mt._move = held_move
        outcome: list = []
        updating = threading.Thread(target=lambda: outcome.append(_raised(mt.update, 2)))
        updating.start()
        assert moving.wait(60)
        mt.close()
        closed.set()
        updating.join(timeout=120)
    assert isinstance(outcome[0], GroupClosed), repr(outcome[0])
    assert "ended by close()" in str(outcome[0]), str(outcome[0])
    with pytest.raises(GroupClosed):
        mt.update(3)


def _raised(call, *args):
    """What ``call(*args)`` raised (None: it returned)."""
    try:
        call(*args)
    except BaseException as e:  # noqa: BLE001  (the test asserts on it)
        return e
    return None


class DiesThenSlowsTheReSend(TransferWorker):
    """Rollout 1 (engine 1) notes the time in ``WB_TEST_DIED_AT`` and exits in round 1 of
    version 1; rollout 0 then takes 1 s for each of its next `SLOW_LANDS` lands (the re-send
    of a large model takes seconds: the loss must not wait for it; each land stays within
    the peer timeout)."""

    SLOW_LANDS = 8
    """Up to 8 s (some lands may come before the loss is named): a loss raised only after the
    re-send would be late by more than the test's 2 s of spare time."""

    slowed = 0

    def on_land(self, r, slots=None, expected=None):
        marker = os.environ["WB_TEST_DIED_AT"]
        if self.worker.index == 1 and r == 1:
            with open(marker, "w") as f:
                f.write(repr(time.time()))
            os._exit(3)
        if self.worker.index == 0 and os.path.exists(marker) and self.slowed < self.SLOW_LANDS:
            self.slowed += 1
            time.sleep(1)
        super().on_land(r, slots, expected)


class DiesThenSlowsTheReSendRollout(RolloutActor):
    worker_class = DiesThenSlowsTheReSend


@pytest.mark.parametrize("mode", ["sync", "rs"])
def test_a_loss_is_raised_within_timeout_of_it_and_the_re_send_follows(mode, tmp_path,
                                                                       monkeypatch):
    """Issue 44, item 10: a loss was raised only after the version was re-sent to the
    survivors (11.1-12.3 s at timeout_s=10, named at 9.05 s). It is raised once named now,
    within timeout_s of the loss (bound here with 2 s to spare: the machine is shared), and
    the re-send runs after it: wait() returns its verified report, the next update() waits
    for it before its train step."""
    timeout_s = 5
    died = tmp_path / "died"
    monkeypatch.setenv("WB_TEST_DIED_AT", str(died))  # (the children inherit it)
    mt = MeshTransfer(TrainerSpec.parse("nodes=1,gpus=1"), ROLLOUT, "tiny",
                      rollout_actor=DiesThenSlowsTheReSendRollout,
                      config=_config(mode, timeout_s=timeout_s))
    with mt:
        mt.connect()
        with pytest.raises(WorkersLost, match="being re-sent") as lost:
            mt.update(1)
        raised = time.time()
        late = raised - float(died.read_text())
        print(f"WorkersLost {late:.2f}s after the loss (timeout_s={timeout_s}, {mode})")
        assert late <= timeout_s + 2, late
        resent = mt.wait()
        # (the test's premise: a loss raised only once re-sent would miss the bound above)
        assert late + time.time() - raised > timeout_s + 2, "the re-send was too quick"
        assert resent.version == 1 and not resent.mismatched, resent.line()
        assert resent.state == ("landed" if mode == "rs" else "installed")
        if mode == "rs":
            installed = mt.poll_requests()
            assert installed.version == 1 and not installed.mismatched, installed.line()
        count, bad = _holds(mt, 1)
        assert count > 0 and not bad, bad[:4]
        after = mt.update(2)
        mt.poll_requests()
        count2, bad = _holds(mt, 2)
    assert lost.value.lost_engines == {1}
    assert count2 == count and not bad and not after.mismatched, bad[:4]



@pytest.mark.parametrize("mode", ["sync", "ss", "rs", "async"])
def test_an_update_refused_for_a_rebound_storage_leaves_no_copy_table_on_it(procs, mode):
    """Issue 44, what the controller fuzz's async seeds 51 and 91 found: update(3) re-plans
    (a delta plan was in force) while every trainer parameter is rebound, and is refused with
    `ParameterRebound`; the storage is put back (it holds step 3's values) and update(4) goes
    out with no re-plan. The re-plan had built the trainers' copy tables on the rebound
    storage, which the storage check does not look at, so update(4) shipped step 3's bytes
    under the label 4 (async: a MISMATCH in every parameter at its install). The copy tables
    read the registered storage, whatever a re-plan finds: update(4) arrives bit-exact."""
    from fuzz_controller import RebindingTrainer as Rebinds

    with MeshTransfer(TRAINER, ROLLOUT, "tiny", config=_config(mode), procs=procs,
                      trainer_actor=Rebinds) as mt:
        mt.connect()
        for v, changed in ((1, None), (2, ["model.norm.weight"])):  # a delta plan in force
            mt.update(v, changed)
            mt.wait()
            mt.poll_requests()
        mt.trainers.rebind.call(False).get()  # p.data = a copy, on every trainer
        with pytest.raises(ParameterRebound, match="no longer uses the storage"):
            mt.update(3)  # (re-plans for every tensor first)
        mt.trainers.rebind.call(True).get()  # the registered storage again, with step 3's values
        mt.update(4)
        streamed = mt.wait()
        installed = mt.poll_requests()
        for report in (streamed, installed):
            assert report is None or not report.mismatched, report.line()
        count, bad = _holds(mt, 4)
        assert count > 0 and not bad, bad[:4]
