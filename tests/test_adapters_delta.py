"""Delta updates through the adapters (``send_weights(v, changed=...)``), in one process.

Two groups of the tiny MoE model (trainer TP2 -> two TP2 engines, `moegroup.group`) get
the same trainer weights every version: group "delta" sends only what changed, group "full"
sends everything. After every version each delta rollout must hold exactly the bytes of its
full twin (``torch.equal`` on uint8 views), and the delta group must move fewer bytes.
Checked in sync and RS modes (with SS and async every tensor moves), with a tenth of the tensors
changing, a set that changes, an empty set, ``changed="auto"``, an engine that skips versions
(RS), every refusal before any byte moves, and a rollout or a trainer replica lost in the
middle of a delta (the re-plan keeps the delta's tensors; the survivors stay bit-exact).
"""

import re
import threading
import time

import pytest
import tinygroup
import torch
from moegroup import CHECKPOINTS, CONFIG, ENGINE_TP, ENGINES, MODES, SPEC, group

from faults import DiesSendingVersion2

from meshes.qwen3_moe import RolloutShard
from weightbridge import ReceiverAdapter, SenderAdapter, TransferConfig, TransferFailed
from weightbridge.coordination.delta import DeltaLog
from weightbridge.coordination.local_control import WorkerGone

NAMES = [t.name for t in SPEC.tensors]
SHARE = NAMES[1::10]
"""A tenth of the checkpoint tensors, spread over the layers."""
OTHER = NAMES[4::10]
"""Another tenth (a set that changes: a re-plan)."""


def _config(mode: str) -> TransferConfig:
    ss, rs = MODES[mode]
    return TransferConfig(sender_staging=ss, receiver_staging=rs, round_bytes=96 << 10,
                          timeout_s=10)


def _connect(trainers) -> None:
    threads = [threading.Thread(target=a.connect) for _, a in trainers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)


def _calls(*calls) -> list:
    """Run each call in a thread; results, an exception in place of a result."""
    out: list = [None] * len(calls)

    def run(i, call):
        try:
            out[i] = call()
        except BaseException as e:  # noqa: BLE001  (returned to the test)
            out[i] = e

    threads = [threading.Thread(target=run, args=(i, c), daemon=True)
               for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a call did not return"
    return out


def _poll(rollouts, version: int, engines=range(ENGINES)):
    """The ranks of ``engines`` poll in lockstep (a barrier per step, as an engine's
    collectives) until each engine runs ``version``; one call per rank."""
    group = [(s, a) for s, a in rollouts if a.engine in engines]
    done = {e: False for e in engines}
    barriers = {e: threading.Barrier(ENGINE_TP, action=lambda e=e: done.__setitem__(
        e, all(a.version >= version for _, a in group if a.engine == e))) for e in engines}
    end = time.monotonic() + 30

    def loop(adapter):
        while time.monotonic() < end:
            adapter.poll_requests()
            barriers[adapter.engine].wait(timeout=30)
            if done[adapter.engine]:
                return adapter.version
        raise TimeoutError(f"{adapter.worker} did not reach version {version}")
    return [lambda a=a: loop(a) for _, a in group]


class Twins:
    """The delta group and the full group, fed the same trainer weights."""

    def __init__(self, mode: str):
        self.rs = MODES[mode][1]
        self.delta = group(_config(mode))
        self.full = group(_config(mode))
        for _, trainers, _ in (self.delta, self.full):
            _connect(trainers)
        self.held = dict.fromkeys(NAMES, 0)
        """Per tensor, the version whose values the trainers hold."""

    def step(self, version: int, changed) -> None:
        """The trainers' optimizer step: ``changed`` (None: every tensor) take their values of
        ``version`` (by name: "auto" stands for the tensors of SHARE)."""
        names = NAMES if changed is None else SHARE if changed == "auto" else changed
        for n in names:
            self.held[n] = version
        for _, trainers, _ in (self.delta, self.full):
            for shard, _ in trainers:
                with torch.no_grad():
                    shard.load_weights((n, CHECKPOINTS[self.held[n]][n]) for n in NAMES)

    def send(self, group, version: int, changed=None, engines=range(ENGINES)) -> list:
        """send_weights(version, changed) on every trainer of ``group`` while ``engines``
        poll (after it returned, with RS); the trainers' results."""
        control, trainers, rollouts = group
        sends = [lambda a=a: a.send_weights(version, changed=changed) for _, a in trainers]
        if self.rs:
            out = _calls(*sends)
            if all(r is None for r in out):
                assert all(isinstance(v, int) for v in _calls(*_poll(rollouts, version, engines)))
            return out
        return _calls(*sends, *_poll(rollouts, version, engines))[:len(trainers)]

    def update(self, version: int, changed, engines=range(ENGINES)) -> tuple[int, int]:
        """One version through both groups; (bytes the delta group moved, the full group's)."""
        self.step(version, changed)
        before = [g[0].transport.bytes_written for g in (self.delta, self.full)]
        assert self.send(self.delta, version, changed, engines) == [None, None]
        assert self.send(self.full, version, None, engines) == [None, None]
        self.check(engines)
        return tuple(g[0].transport.bytes_written - b
                     for g, b in zip((self.delta, self.full), before))

    def check(self, engines=range(ENGINES)) -> None:
        """Every delta rollout of ``engines`` holds its full twin's bytes."""
        for (ds, da), (fs, fa) in zip(self.delta[2], self.full[2]):
            if da.engine not in engines:
                continue
            assert da.version == fa.version
            for n, p in fs.params.items():
                assert torch.equal(ds.params[n].view(torch.uint8), p.view(torch.uint8)), \
                    f"{da.worker} {n} differs from a full update of version {da.version}"


@pytest.mark.parametrize("mode", ["sync", "rs"])
@pytest.mark.slow
def test_delta_updates_move_only_what_changed_bit_identical_to_full_updates(mode):
    twins = Twins(mode)
    moved, full = twins.update(1, None)
    assert moved == full > 0
    sender = twins.delta[1][0][1]
    first, full = twins.update(2, SHARE)
    plan = sender.plan
    again, _ = twins.update(3, SHARE)  # the same set: the plan in force is kept
    assert sender.plan is plan
    # The bar: a tenth of the tensors changed moves at most 15% of a full update.
    assert 0 < first == again <= 0.15 * full, (first, again, full)
    other, _ = twins.update(4, OTHER)  # another set: a re-plan
    assert sender.plan is not plan and 0 < other < full
    nothing, _ = twins.update(5, [])  # no byte moves, the version still advances
    assert nothing == 0 and all(a.version == 5 for _, a in twins.delta[2])
    last, full = twins.update(6, None)
    assert last == full


@pytest.mark.parametrize("mode", ["sync", "rs"])
def test_changed_auto_finds_the_changed_parameters_by_checksum(mode):
    twins = Twins(mode)
    first, full = twins.update(1, "auto")  # no checksums of a previous call: full
    assert first == full
    auto, full = twins.update(2, "auto")
    assert 0 < auto < full
    # The same change, named: no more bytes than "auto" found (a changed parameter sends every
    # tensor that loads into it).
    named, _ = twins.update(3, SHARE)
    assert 0 < named <= auto


def test_an_engine_that_skips_a_delta_version_gets_its_changes_with_the_next_rs():
    twins = Twins("rs")
    twins.update(1, None)
    twins.update(2, SHARE, engines=[0])  # engine 1 does not poll: it never installs 2
    twins.update(3, OTHER)  # engine 1 installs 3 over 1: SHARE's changes must come along
    twins.update(4, OTHER)  # both claimed 3: OTHER alone
    assert twins.delta[2][-1][1].version == 4


@pytest.mark.parametrize("mode", ["ss", "async"])
def test_with_sender_staging_changed_is_checked_and_every_tensor_moves(mode):
    """Before: ``changed`` was refused with sender staging, while the controller's `update`
    took it. Now both take it; here a staged copy packed for the plan in force moves every
    tensor, and the rollouts end bit-identical to the full twin's."""
    twins = Twins(mode)
    _, full = twins.update(1, None)
    named, full2 = twins.update(2, SHARE)
    auto, full3 = twins.update(3, "auto")
    nothing, full4 = twins.update(4, [])
    assert full > 0 and (named, auto, nothing) == (full2, full3, full4) == (full, full, full)


@pytest.mark.parametrize("changed, match", [
    (SHARE, "the first send_weights must be full"),
    (SHARE[0], r"got '.+'; pass \['"),
    (["nope"] + SHARE, r"not in the checkpoint: \['nope'\]"),
    (7, "must be None, \"auto\" or a collection"),
])
@pytest.mark.parametrize("mode", ["sync", "ss"])
def test_a_bad_changed_is_refused_on_every_trainer_before_anything_moves(mode, changed, match):
    control, trainers, _ = group(_config(mode))
    _connect(trainers)
    for shard, _ in trainers:
        with torch.no_grad():
            shard.load_weights(CHECKPOINTS[1].items())
    out = _calls(*[lambda a=a: a.send_weights(1, changed=changed) for _, a in trainers])
    assert all(isinstance(e, ValueError) and re.search(match, str(e))
               for e in out), out
    assert control.transport.bytes_written == 0


@pytest.mark.parametrize("mode", ["sync", "rs"])
def test_trainers_that_disagree_on_changed_all_fail_and_nothing_moves(mode):
    twins = Twins(mode)
    twins.update(1, None)
    control, trainers, rollouts = twins.delta
    before = control.transport.bytes_written
    twins.step(2, SHARE)
    out = _calls(*[lambda a=a, c=c: a.send_weights(2, changed=c)
                   for (_, a), c in zip(trainers, (SHARE, OTHER))])
    assert all(isinstance(e, ValueError) and "different changed=" in str(e) for e in out), out
    assert control.transport.bytes_written == before
    assert all(a.version == 1 for _, a in rollouts)
    # The next delta cannot know version 2's changes for sure: it moves everything, exactly.
    twins.step(3, SHARE)
    assert twins.send(twins.delta, 3, SHARE) == [None, None]
    assert twins.send(twins.full, 3) == [None, None]
    twins.check()


def test_delta_log_carries_skipped_versions_and_unrecorded_ones_count_as_full():
    log = DeltaLog(["a", "b", "c"])
    assert log.needed(0) is None  # nothing recorded: everything must go
    log.record(1, [0, 0], None)
    log.record(2, [1, 1], {"a"})
    assert log.needed(1) == {"a"} and log.needed(0) is None
    assert log.record(2, [1, 1], {"b"}) == {"a"}  # the same version again: the first record
    log.record(3, [2, 2], {"b"})
    assert log.needed(1) == {"a", "b"} and log.needed(2) == {"b"} and log.needed(3) == set()
    assert log.record(5, [4, 3], {"c"}) is None  # version 4 never reached the log
    assert log.needed(4) is None


class DiesLandingADelta(ReceiverAdapter):
    """Rollout R1 (engine 0): its process dies landing the first round of version 2."""

    died = False

    def on_land(self, r, slots=None, expected=None):
        if self.version >= 1 and not self.died:
            self.died = True
            self.control.kill(self.worker)
            self.on_fail("killed")  # its own threads end with the process
            raise WorkerGone(f"{self.worker} died")
        return super().on_land(r, slots, expected)


@pytest.mark.parametrize("mode", ["sync", "rs"])
def test_a_rollout_lost_in_a_delta_leaves_the_survivors_bit_exact(mode):
    control, trainers, rollouts = group(_config(mode), receiver_cls=lambda rank: (
        DiesLandingADelta if rank == 1 else ReceiverAdapter))
    _connect(trainers)
    held = dict.fromkeys(NAMES, 0)

    def send(version, changed, engines):
        for n in NAMES if changed is None else changed:
            held[n] = version
        for shard, _ in trainers:
            with torch.no_grad():
                shard.load_weights((n, CHECKPOINTS[held[n]][n]) for n in NAMES)
        sends = [lambda a=a: a.send_weights(version, changed=changed) for _, a in trainers]
        lost = [lambda a=a: a.wait_for_version(version) for _, a in rollouts
                if a.engine not in engines]  # engine 0, once its rank died: they raise
        if MODES[mode][1]:  # RS: lands first, then the engines install
            return _calls(*sends), _calls(*_poll(rollouts, version, engines), *lost)
        out = _calls(*sends, *_poll(rollouts, version, engines), *lost)
        return out[:2], out[2:]

    assert send(1, None, [0, 1]) == ([None, None], [1] * 4)
    sent, polled = send(2, SHARE, [1])
    assert all(isinstance(e, TransferFailed) and "re-sent to the surviving engines [1]" in str(e)
               for e in sent), sent
    assert polled[:2] == [2, 2] and all(isinstance(e, TransferFailed) for e in polled[2:])
    assert send(3, SHARE, [1])[0] == [None, None]
    assert trainers[0][1].plan.num_rounds > 0 and trainers[0][1].failed_engines == {0}
    for shard, a in rollouts[2:]:  # engine 1: what its own loader makes of the trainers' weights
        ref = RolloutShard(CONFIG, ENGINE_TP, a.engine_rank, 1, 0)
        ref.load_weights((n, CHECKPOINTS[held[n]][n]) for n in NAMES)
        assert a.version == 3 and all(torch.equal(shard.params[n].view(torch.uint8),
                                                  p.view(torch.uint8))
                                      for n, p in ref.params.items())


@pytest.mark.slow
def test_a_trainer_lost_in_a_delta_is_planned_out_and_its_replica_sends_the_delta():
    # Data-parallel replicas (`tinygroup`): trainer 1 dies sending a round of version 2 (sync
    # mode: finding the lost trainer takes timeout_s; RS re-plans the same way).
    config = TransferConfig(timeout_s=5)
    control, trainers, rollouts = tinygroup.build(config, sender_cls=lambda rank: (
        DiesSendingVersion2 if rank == 1 else SenderAdapter))
    tinygroup.connect(trainers)
    held = dict.fromkeys(tinygroup.SHAPES, 0)

    def send(version, changed, senders):
        for n in tinygroup.SHAPES if changed is None else changed:
            held[n] = version
        for m, _ in senders:
            m.load_weights((n, tinygroup.checkpoint(held[n])[n]) for n in held)
        return tinygroup.in_threads(
            *[lambda a=a: a.send_weights(version, changed=changed) for _, a in senders],
            *[lambda a=a: a.wait_for_version(version) for _, a in rollouts])

    assert send(1, None, trainers) == [None, None, 1, 1]
    first, *rest = send(2, ["m"], trainers)
    assert isinstance(first, TransferFailed) and "Trainer [1] is excluded" in str(first), first
    assert rest[1:] == [2, 2]
    assert send(3, ["w"], trainers[:1]) == [None, 3, 3]
    for m, a in rollouts:
        for n, p in m.params.items():
            want = tinygroup.checkpoint(held[n])[n]
            assert torch.equal(p.view(torch.uint8), want.view(torch.uint8)), (a.worker, n)
