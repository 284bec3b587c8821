"""Issue 23, the adapters' side: a group's state has one owner and no seam tears an install.

`tinygroup` (two data-parallel trainers, an engine per rollout, one `LocalControl`). Each test
is a finding of issue 23 that used to tear or mislabel weights or wedge the group:

- bools and floats accepted as versions and engine ids; two send_weights of one trainer
  racing each other refused with a message naming one version twice (finding 7);
- an engine joining while a delta plan is in force re-planned under the same generation: the
  rollouts' staging slots were made anew (uninitialized) while rank 0 still recorded a landed
  version in them, and a lagging engine installed garbage under that version (finding 1);
- add_engines() called on trainer 0 only failed, yet the engines it was meant to add were
  offered versions and waited for: every later sync send timed out, every RS send raised
  IndexError (finding 4);
- a rank excluded while it stalled was never told (its polls returned None over torn
  parameters), and after a trainer loss that could not be re-routed, or the loss of trainer 0,
  no rollout was told (finding 2);
- a tensor replicated across trainers whose other tensors are sharded (a norm, bias or
  embedding on every tensor-parallel rank) was never compared: a diverged one was blended
  into the rollouts (finding 5);
- the delta contract was not checked: a trainer that changed "m" but passed changed=["w"]
  installed a stale "m" under the new label, and parameters changed during a send (an
  optimizer step overlapping it) installed a silent mix (finding 6);
- found on the way: a trainer whose thread had not yet left send_weights(v) when trainer 0
  asked for v + 1 was taken for a trainer sending another version (every trainer's
  send_weights raised "sending different versions"; seen once in test_adapters under load).
"""

import re
import threading

import torch

import pytest
from tinygroup import MODES, build, checkpoint, connect, in_threads, send

import weightbridge.coordination.staging as staging_module
from weightbridge import ReceiverAdapter, SenderAdapter, TransferConfig, TransferFailed
from weightbridge.coordination.local_control import LocalControl, WorkerGone
from tinygroup import SPEC, SHAPES, Model, PaddedModel


@pytest.mark.parametrize("bad", [True, 1.5, 2.0, "3", None, 0, -1])
def test_versions_that_are_not_positive_ints_are_refused_before_anything_moves(bad):
    control, trainers, rollouts = build(TransferConfig(timeout_s=2))
    connect(trainers)
    moved = control.transport.bytes_written
    for _, t in trainers:
        with pytest.raises(ValueError, match=r"version must be a positive int .*got " +
                           repr(bad).replace(".", r"\.")):
            t.send_weights(bad)
    for _, r in rollouts:
        with pytest.raises(ValueError, match=r"version must be a positive int"):
            r.wait_for_version(bad, timeout_s=0.1)
    assert control.transport.bytes_written == moved
    # The group goes on: nothing was recorded for the refused calls.
    got = in_threads(*send(trainers, 1, ss=False),
                     *[lambda a=a: a.wait_for_version(1) for _, a in rollouts])
    assert got == [None, None, 1, 1], got


@pytest.mark.parametrize("bad", [True, False, 1.0, 0.5])
def test_engine_ids_that_are_not_ints_are_refused(bad):
    control, trainers, rollouts = build(TransferConfig(timeout_s=2), num_engines=3)
    connect(trainers)
    out = in_threads(*[lambda a=a: a.remove_engine(bad) for _, a in trainers])
    assert isinstance(out[0], ValueError), out
    assert "engine must be an engine number" in str(out[0]) and repr(bad) in str(out[0])
    assert trainers[0][1].failed_engines == set()
    got = in_threads(*send(trainers, 1, ss=False),
                     *[lambda a=a: a.wait_for_version(1) for _, a in rollouts])
    assert got == [None, None, 1, 1, 1], got


@pytest.mark.parametrize("mode", list(MODES))
def test_a_second_send_weights_on_one_trainer_while_one_runs_is_refused(mode):
    ss, rs = MODES[mode]
    control, trainers, rollouts = build(TransferConfig(timeout_s=2, sender_staging=ss,
                                                       receiver_staging=rs))
    connect(trainers)
    (m0, t0), (m1, t1) = trainers
    inside, release = threading.Event(), threading.Event()
    real = t1.changes.check  # the first step of send_weights, before anything is recorded

    def held(changed):
        if not inside.is_set():
            inside.set()
            release.wait(30)
        return real(changed)
    t1.changes.check = held
    for m, _ in trainers:
        m.load_weights(checkpoint(1).items())
    first = threading.Thread(target=lambda: t1.send_weights(1), daemon=True)
    first.start()
    assert inside.wait(30)
    with pytest.raises(RuntimeError, match=r"send_weights\(2\) while send_weights\(1\) is "
                                           r"still running on this trainer"):
        t1.send_weights(2)
    release.set()
    t0_done = in_threads(lambda: t0.send_weights(1),
                         *[lambda a=a: a.wait_for_version(1) for _, a in rollouts])
    first.join(timeout=30)
    if ss:
        t0.wait_idle()
    assert t0_done == [None, 1, 1], t0_done
    assert all(m.holds(1) for m, _ in rollouts)



def _add_receiver(control, config, rank: int):
    m = Model()
    return m, control.add(ReceiverAdapter(
        m.params, m.load_weights, SPEC, rank=rank, engine=rank, engine_rank=0, engine_size=1,
        control=control, transport=control.transport, config=config))


def _holds(model, versions: dict) -> bool:
    """``model`` holds, per tensor, the bytes of the version ``versions`` names."""
    return all(torch.equal(model.params[n].view(torch.uint8),
                           checkpoint(v)[n].view(torch.uint8)) for n, v in versions.items())


def test_a_join_under_a_delta_plan_never_installs_a_fresh_staging_slot(monkeypatch):
    real = staging_module.host_buffer
    # Staging memory is uninitialized: make it visibly so (a NaN-ish pattern in every byte).
    monkeypatch.setattr(staging_module, "host_buffer",
                        lambda n, like: real(n, like).fill_(0xA5))
    config = TransferConfig(timeout_s=5, receiver_staging=True)
    control, trainers, rollouts = build(config)
    connect(trainers)
    (_, r0), (m1, r1) = rollouts

    def delta(v, changed):
        for m, _ in trainers:
            m.load_weights((n, checkpoint(v)[n]) for n in changed or SHAPES)
        assert in_threads(*[lambda a=a: a.send_weights(v, changed=changed)
                            for _, a in trainers]) == [None, None]

    delta(1, None)
    assert [a.wait_for_version(1) for _, a in rollouts] == [1, 1]
    delta(2, ["w"])  # landed in both engines' staging; only engine 0 installs it
    assert r0.wait_for_version(2) == 2
    rollouts.append(_add_receiver(control, config, 2))
    assert in_threads(*[a.add_engines for _, a in trainers]) == [None, None]
    # Engine 1 installs version 2 (it landed before the join) whole, or nothing newer than
    # what it holds; never the bytes of a slot made by the join.
    got = r1.wait_for_version(2, timeout_s=2)
    assert got == 2 and _holds(m1, {"w": 2, "v": 1, "m": 1}), m1.params
    delta(3, ["v"])
    want = {"w": 2, "v": 3, "m": 1}
    assert [a.wait_for_version(3) for _, a in rollouts] == [3, 3, 3]
    assert all(_holds(m, want) for m, _ in rollouts)


@pytest.mark.parametrize("mode", ["sync", "rs"])
def test_an_add_engines_called_on_trainer_0_only_leaves_the_group_as_before(mode):
    ss, rs = MODES[mode]
    config = TransferConfig(timeout_s=1, sender_staging=ss, receiver_staging=rs)
    control, trainers, rollouts = build(config)
    connect(trainers)
    (_, t0), (_, t1) = trainers

    def update(v, which):
        got = in_threads(*send(trainers, v, ss=ss),
                         *[lambda a=a: a.wait_for_version(v) for _, a in which])
        assert got == [None, None] + [v] * len(which), got
        assert all(m.holds(v) for m, _ in which)

    update(1, rollouts)
    new = _add_receiver(control, config, 2)
    with pytest.raises(TimeoutError, match=r"not every trainer called the same add_engines"):
        t0.add_engines()
    # Nothing changed: the engine that was to join is not waited for, nor offered anything.
    assert new[1].poll_requests() is None
    update(2, rollouts)
    assert new[1].poll_requests() is None and new[1].version == 0
    assert in_threads(t0.add_engines, t1.add_engines) == [None, None]
    update(3, rollouts + [new])


class StallsInVersion2(ReceiverAdapter):
    """A rollout that stops answering as the second transfer lands in it (a stall: it comes
    back once the test takes it off ``control.dead``)."""

    lands = 0

    def on_land(self, r, slots=None, expected=None):
        self.lands += 1
        if self.lands > self.executor.num_rounds:
            self.control.kill(self.worker)
            raise WorkerGone(f"{self.worker} stalled")
        return super().on_land(r, slots, expected)


@pytest.mark.parametrize("mode", ["sync", "rs"])
def test_a_rank_excluded_while_it_stalled_is_told_when_it_comes_back(mode):
    ss, rs = MODES[mode]
    config = TransferConfig(timeout_s=1, sender_staging=ss, receiver_staging=rs)
    control = LocalControl()
    trainers = [(m, control.add(SenderAdapter(m.params, m.load_weights, SPEC, rank=i,
                                              control=control, transport=control.transport,
                                              config=config)))
                for i, m in enumerate([Model(), Model()])]
    rollouts = []
    for j in range(2):
        m = Model()
        rollouts.append((m, control.add((StallsInVersion2 if j == 0 else ReceiverAdapter)(
            m.params, m.load_weights, SPEC, rank=j, engine=j, engine_rank=0, engine_size=1,
            control=control, transport=control.transport, config=config))))
    connect(trainers)
    (_, r0), (m1, r1) = rollouts
    assert in_threads(*send(trainers, 1, ss=ss),
                      *[lambda a=a: a.wait_for_version(1) for _, a in rollouts])[2:] == [1, 1]
    stalled: list = []
    if not rs:  # R0 waits inside its poll for version 2 when it stalls
        poll = threading.Thread(target=lambda: stalled.extend(in_threads(
            lambda: r0.wait_for_version(2, timeout_s=30))))
        poll.start()
    got = in_threads(*send(trainers, 2, ss=ss), lambda: r1.wait_for_version(2))
    assert isinstance(got[0], TransferFailed) and "Engine [0] is excluded" in str(got[0]), got
    assert got[2] == 2 and m1.holds(2)
    control.dead.discard(r0.worker)  # it comes back
    if not rs:
        poll.join(timeout=30)
        assert isinstance(stalled[0], TransferFailed), stalled
    else:  # told with the next transfer (it did not answer when it was excluded)
        got = in_threads(*send(trainers, 3, ss=ss), lambda: r1.wait_for_version(3))
        assert got == [None, None, 3], got
    for _ in range(2):  # every later poll says so, never None over what it holds
        with pytest.raises(TransferFailed, match=r"R0 \(engine 0\): .*failed during the "
                                                 r"transfer of version 2.*add them as a new"):
            r0.wait_for_version(2, timeout_s=5)


class Holds(Model):
    """A trainer that holds only some of the tensors (no replica holds the rest)."""

    def __init__(self, names):
        super().__init__()
        self.params = {n: p for n, p in self.params.items() if n in names}

    def load_weights(self, weights) -> None:
        super().load_weights((n, t) for n, t in weights if n in self.params)


class DiesAtVersion2(SenderAdapter):
    """A trainer whose process dies as it packs a round of the second transfer: its calls
    fail from then on, and the call it was serving never returns (until ``gone`` is set)."""

    gone = threading.Event()
    sends = 0

    def on_send_round(self, r):
        self.sends += 1
        if self.sends > self.executor.num_rounds:
            self.control.kill(self.worker)
            if self.worker.index == 0:  # trainer 0's own session hangs with it
                self.gone.wait(60)
            raise WorkerGone(f"{self.worker} died")
        return super().on_send_round(r)


def _split_group(config, dies: int, holds=({"w", "v", "m"}, {"w", "v", "m"})):
    control = LocalControl()
    trainers = []
    for i, names in enumerate(holds):
        m = Holds(names)
        cls = DiesAtVersion2 if i == dies else SenderAdapter
        trainers.append((m, control.add(cls(m.params, m.load_weights, SPEC, rank=i,
                                            control=control, transport=control.transport,
                                            config=config))))
    rollouts = [_add_receiver(control, config, j) for j in range(2)]
    return control, trainers, rollouts


@pytest.mark.parametrize("mode", ["sync", "rs"])
@pytest.mark.parametrize("lost", ["trainer 0", "a trainer no replica covers"])
def test_every_rollout_is_told_when_a_trainer_loss_ends_the_group(mode, lost):
    ss, rs = MODES[mode]
    config = TransferConfig(timeout_s=1, sender_staging=ss, receiver_staging=rs)
    DiesAtVersion2.gone = threading.Event()
    if lost == "trainer 0":  # T1 is its replica, but trainer 0 sequences the group
        control, trainers, rollouts = _split_group(config, dies=0)
    else:  # T1 alone holds "m"
        control, trainers, rollouts = _split_group(config, dies=1,
                                                   holds=({"w", "v"}, {"w", "v", "m"}))
    try:
        connect(trainers)
        assert in_threads(*send(trainers, 1, ss=ss),
                          *[lambda a=a: a.wait_for_version(1) for _, a in rollouts])[2:] == [1, 1]
        survivor = trainers[1 if lost == "trainer 0" else 0]
        calls = [lambda: survivor[1].send_weights(2)]
        if not rs:  # sync: the rollouts wait inside their polls for version 2
            calls += [lambda a=a: a.wait_for_version(2, timeout_s=30) for _, a in rollouts]
        dying = threading.Thread(target=lambda: trainers[0 if lost == "trainer 0" else 1][1]
                                 .send_weights(2), daemon=True)
        for m, _ in trainers:
            m.load_weights(checkpoint(2).items())
        dying.start()
        got = in_threads(*calls)
        assert isinstance(got[0], TransferFailed), got
        # In one process trainer 0's session outlives its death: the LocalControl bounds its
        # call to itself, so trainer 0 may fail the transfer and tell the rollouts before the
        # other trainers find it lost. Either way every rollout must be told.
        why = (r"trainer 0, which sequences this transfer group, is lost|(send_)?round to T0 "
               r"did not answer" if lost == "trainer 0" else "Re-planning without it failed too")
        assert re.search(why, str(got[0])), got[0]
        for _, a in rollouts:  # told: every poll raises, none returns over torn parameters
            for _ in range(2):
                with pytest.raises(TransferFailed, match=why):
                    a.wait_for_version(2, timeout_s=5)
    finally:
        DiesAtVersion2.gone.set()


@pytest.mark.parametrize("mode", ["sync", "rs"])
def test_a_diverged_tensor_replicated_across_sharded_trainers_fails_before_any_byte(mode):
    ss, rs = MODES[mode]
    config = TransferConfig(timeout_s=2, sender_staging=ss, receiver_staging=rs)
    # "v" on both trainers (as a norm on every TP rank), "w" and "m" on one each.
    control, trainers, rollouts = _split_group(config, dies=-1, holds=({"w", "v"}, {"v", "m"}))
    connect(trainers)
    # (checked by behaviour below)
    assert in_threads(*send(trainers, 1, ss=ss),
                      *[lambda a=a: a.wait_for_version(1) for _, a in rollouts])[2:] == [1, 1]
    moved = control.transport.bytes_written
    for m, _ in trainers:
        m.load_weights(checkpoint(2).items())
    trainers[1][0].params["v"][3] += 1  # its reduction went wrong on one TP rank
    errors = in_threads(*[lambda a=a: a.send_weights(2) for _, a in trainers])
    for e in errors:
        assert "trainers T0 and T1 hold the same layout of the checkpoint in 1 parameters" \
            in str(e) and "'v'" in str(e) and "Nothing of version 2 was sent" in str(e), errors
    assert control.transport.bytes_written == moved
    trainers[1][0].load_weights(checkpoint(3).items())
    trainers[0][0].load_weights(checkpoint(3).items())
    assert in_threads(*send(trainers, 3, ss=ss),
                      *[lambda a=a: a.wait_for_version(3) for _, a in rollouts])[2:] == [3, 3]
    assert all(m.holds(3) for m, _ in rollouts)


@pytest.mark.parametrize("trainer_model", [Model, PaddedModel], ids=["whole", "padded"])
@pytest.mark.parametrize("mode", ["sync", "rs"])
def test_a_changed_that_leaves_out_a_changed_tensor_is_refused_before_any_byte(mode,
                                                                              trainer_model):
    """Padded: the trainers' ``m`` has a padding row; the contract check skipped padded
    parameters, so the rollouts kept ``m`` at version 1 under the label 2 (issue 44, item 3)."""
    ss, rs = MODES[mode]
    config = TransferConfig(timeout_s=2, sender_staging=ss, receiver_staging=rs)
    control, trainers, rollouts = build(config, trainer_model=trainer_model)
    connect(trainers)
    assert in_threads(*send(trainers, 1, ss=ss),
                      *[lambda a=a: a.wait_for_version(1) for _, a in rollouts])[2:] == [1, 1]
    moved = control.transport.bytes_written
    for m, _ in trainers:
        m.load_weights((n, checkpoint(2)[n]) for n in ("w", "m"))  # "m" changed too
    errors = in_threads(*[lambda a=a: a.send_weights(2, changed=["w"]) for _, a in trainers])
    for e in errors:
        assert isinstance(e, ValueError), errors
        assert "leaves out parameters that changed since send_weights(1)" in str(e) \
            and "'m'" in str(e) and "Nothing was sent" in str(e) and "changed=" in str(e), e
    assert control.transport.bytes_written == moved
    assert [a.poll_requests() for _, a in rollouts] == [None, None]
    # Named in full, the next delta goes through, bit-exact.
    assert in_threads(*[lambda a=a: a.send_weights(3, changed=["w", "m"]) for _, a in trainers],
                      *[lambda a=a: a.wait_for_version(3) for _, a in rollouts])[2:] == [3, 3]
    want = {"w": 2, "m": 2, "v": 1}
    assert all(_holds(m, want) for m, _ in rollouts)


class StepsDuringVersion2(SenderAdapter):
    """Trainer 1: an optimizer step overlaps its second transfer (after its first round)."""

    sends = 0

    def on_send_round(self, r):
        out = super().on_send_round(r)
        self.sends += 1
        if self.sends == self.executor.num_rounds + 1:
            with torch.no_grad():
                self.params["m"].add_(1)
        return out


@pytest.mark.parametrize("mode", ["sync", "rs"])
def test_parameters_changed_during_a_send_fail_the_update_closed(mode):
    ss, rs = MODES[mode]
    config = TransferConfig(timeout_s=2, sender_staging=ss, receiver_staging=rs)
    control, trainers, rollouts = build(config, sender_cls=lambda rank: (
        StepsDuringVersion2 if rank == 1 else SenderAdapter))
    connect(trainers)
    assert in_threads(*send(trainers, 1, ss=ss),
                      *[lambda a=a: a.wait_for_version(1) for _, a in rollouts])[2:] == [1, 1]
    polls = [] if rs else [lambda a=a: a.wait_for_version(2, timeout_s=20) for _, a in rollouts]
    got = in_threads(*send(trainers, 2, ss=ss), *polls)
    for e in got[:2]:
        assert isinstance(e, ValueError), got
        assert "parameters changed while send_weights(2) was sending them (T1: ['m'])" \
            in str(e) and "Change no parameter until send_weights returns" in str(e), e
    if rs:  # never offered: the engines keep version 1, whole, and go on
        for m, a in rollouts:
            with pytest.raises(TimeoutError):
                a.wait_for_version(2, timeout_s=0.5)
            assert a.version == 1 and m.holds(1)
        assert in_threads(*send(trainers, 3, ss=ss),
                          *[lambda a=a: a.wait_for_version(3) for _, a in rollouts])[2:] == [3, 3]
        assert all(m.holds(3) for m, _ in rollouts)
    else:  # in the parameters already: no poll returns it
        for e in got[2:]:
            assert isinstance(e, TransferFailed) and "mixes two states" in str(e), got


class SlowToLeave(SenderAdapter):
    """Trainer 1: after its send_weights(1) finished, its thread leaves the call only once
    trainer 0 asked it (READY) for the next version (a thread the scheduler runs late)."""

    asked = threading.Event()

    def on_ready(self):
        answer = super().on_ready()
        if self.versions.sending == 1 and self.versions.done >= 1:
            self.asked.set()
        return answer

    def _await_rank0(self, predicate, what):
        super()._await_rank0(predicate, what)
        if self.versions.done == 1:
            self.asked.wait(30)


def test_a_trainer_still_leaving_the_last_send_is_not_taken_for_another_version():
    config = TransferConfig(timeout_s=5, receiver_staging=True)
    SlowToLeave.asked = threading.Event()
    control, trainers, rollouts = build(config, sender_cls=lambda rank: (
        SlowToLeave if rank == 1 else SenderAdapter))
    connect(trainers)
    got = in_threads(*[lambda m=m, a=a: [(m.load_weights(checkpoint(v).items()),
                                           a.send_weights(v)) for v in (1, 2)]
                       for m, a in trainers])
    assert all(isinstance(r, list) for r in got), got  # (before: "sending different versions")
    assert SlowToLeave.asked.is_set()
    assert [a.wait_for_version(2) for _, a in rollouts] == [2, 2]
    assert all(m.holds(2) for m, _ in rollouts)


def test_an_excluded_engine_is_given_no_staging_slot_of_a_newer_plan():
    """RS: engine 1 is excluded and the group re-planned (new slot numbers, which engine 1's
    workers never made); version 2 lands. The ledger must give engine 1 no slot of the new
    plan: a CLAIM of engine 1 that passed trainer 0's "is it out?" check just before the
    exclusion would otherwise be answered with a slot its rank 0 does not have (a KeyError
    in its poll) instead of its last slot or nothing."""
    config = TransferConfig(timeout_s=2, receiver_staging=True)
    control, trainers, rollouts = build(config, num_trainers=1)
    connect(trainers)
    assert in_threads(*send(trainers, 1, ss=False),
                      *[lambda a=a: a.wait_for_version(1) for _, a in rollouts])[1:] == [1, 1]
    leader = trainers[0][1].leader
    leader.exclude([1], why="engine 1 is out (test)")
    leader.replan()
    slots = leader.begin_landing(2)
    leader.landed(2)
    assert 1 not in slots and 0 in slots, slots
    got = leader.slots.claim(1)  # (the ledger itself, as the racing CLAIM reaches it)
    assert got is None or got[1] < 2 * leader.generation, got
    assert leader.claim(1) is None
    with pytest.raises(TransferFailed, match=r"engine 1 is out \(test\)"):
        rollouts[1][1].poll_requests()
