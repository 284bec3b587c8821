"""One policy, two drivers: the adapters (in one process, on `LocalControl`) and the
controller's `MeshTransfer` (on local meshes) must agree, in every mode, on what a user sees.

- A loss: both leave a lost rollout engine out through one routine
  (`weightbridge.coordination.loss.lose`): the same error (`WorkersLost`, naming the same
  engines, with the same first words), whether the version that lost the engine is re-sent to
  the survivors (`Mode.resends_after_loss`), and the next version reaching them whole.
- Deltas (`DELTAS`): the same ``changed=`` refusals (`delta.check_changed`), and after every
  accepted update each rollout holds, bit for bit, what the trainers hold.

The loss: rollout 1 (engine 1 of two one-rank engines) stops answering as version 1's rounds
land in it (the adapters: it stops in its first landing, `faults.stalling_group`; the
controller: its process exits in round 1, `faults.DiesInRound1Rollout`).
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass

import pytest
import tinygroup
import torch
from faults import STALLED, DiesInRound1Rollout, stalling_group
from meshprocs import proc_pair
from tinygroup import MODES, connect, in_threads

from controller.driver import MeshTransfer
from weightbridge import TransferConfig, WeightBridgeError
from weightbridge.config import Mode
from weightbridge.specs import RolloutSpec, TrainerSpec

FIRST_WORDS = "worker R1 (engine 1) failed during the transfer of version 1 ("


@dataclass(frozen=True)
class Outcome:
    """What a user of either driver sees when engine 1 is lost in version 1."""

    errors: tuple[str, ...]
    """The class of every error the update raised (one per trainer that raised)."""
    lost_engines: frozenset[int]
    first_words: bool
    """Every message starts with `FIRST_WORDS`."""
    resent: bool
    """The driver put version 1 into engine 0 after the loss, under its label (adapters: its
    wait for version 1 returned 1; controller: `wait()` returned the re-send's report), and
    engine 0 holds it bit-exact."""
    next_whole: bool
    """Engine 0 holds version 2 after the next update."""


def _adapters(mode: str) -> Outcome:
    ss, rs = MODES[mode]
    control, trainers, rollouts = stalling_group(
        TransferConfig(timeout_s=1, sender_staging=ss, receiver_staging=rs))
    try:
        connect(trainers)
        (m0, r0), (_, r1) = rollouts
        # Both engines poll (sync, SS: the rounds start once every rollout joined). SS, async:
        # engine 0 never sees version 1, its wait ends at its own bound.
        out = in_threads(*tinygroup.send(trainers, 1, ss=ss),
                         lambda: r0.wait_for_version(1, timeout_s=8),
                         lambda: r1.wait_for_version(1))
        sent, got0 = out[:len(trainers)], out[len(trainers)]
        errors = [e for e in sent if isinstance(e, WeightBridgeError)]
        assert all(e is None or isinstance(e, WeightBridgeError) for e in sent), sent
        resent = got0 == 1 and m0.holds(1)
        in_threads(*tinygroup.send(trainers, 2, ss=ss), lambda: r0.wait_for_version(2))
        return _outcome(errors, resent, m0.holds(2))
    finally:
        control.resume(STALLED)


def _controller(mode: str) -> Outcome:
    m = Mode(mode)
    mt = MeshTransfer(TrainerSpec.parse("nodes=1,gpus=1"),
                      RolloutSpec.parse("engines=2,nodes=1,gpus=1"), "tiny",
                      rollout_actor=DiesInRound1Rollout,
                      config=TransferConfig(round_bytes=64 << 10, timeout_s=5,
                                            sender_staging=m.sender_staging,
                                            receiver_staging=m.receiver_staging))
    errors = []
    with mt:
        mt.connect()
        try:
            mt.update(1)
            mt.wait()  # (SS, async: the rounds streamed; the loss is raised here)
        except WeightBridgeError as e:
            errors.append(e)
        report = mt.wait()  # sync, RS: the re-send's report; SS, async: None (not re-sent)
        if report is not None and m.receiver_staging:
            mt.poll_requests()
        resent = report is not None and _engine0_holds(mt, 1)
        mt.update(2)
        mt.wait()
        mt.poll_requests()
        return _outcome(errors, resent, _engine0_holds(mt, 2))


def _engine0_holds(mt: MeshTransfer, version: int) -> bool:
    count, bad = mt._verify(mt._live("rollout"), version)
    return count > 0 and not bad


def _outcome(errors: list, resent: bool, next_whole: bool) -> Outcome:
    assert errors, "the update that lost engine 1 raised nothing"
    engines = {frozenset(e.lost_engines) for e in errors if hasattr(e, "lost_engines")}
    return Outcome(errors=tuple(type(e).__name__ for e in errors[:1]),
                   lost_engines=engines.pop() if len(engines) == 1 else frozenset({-1}),
                   first_words=all(str(e).startswith(FIRST_WORDS) for e in errors),
                   resent=resent, next_whole=next_whole)


@pytest.mark.mesh
@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_lost_engine_gives_one_outcome_on_both_drivers(mode):
    """Before: the adapters raised `TransferFailed`, the controller `WorkersLost`, with two
    texts ("worker R1 (engine 1) failed during ..." against "... engine [1] excluded")."""
    adapters, controller = _adapters(mode), _controller(mode)
    assert adapters == controller, (adapters, controller)
    assert adapters.errors == ("WorkersLost",) and adapters.lost_engines == {1}, adapters
    assert adapters.first_words and adapters.next_whole, adapters
    assert adapters.resent is Mode(mode).resends_after_loss, adapters


# -- deltas ---------------------------------------------------------------------------------

ONE, TWO, ALL = "one", "two", "all"
"""Two checkpoint tensors, by role (each driver's model names its own), and every tensor."""
DELTAS = (
    # (version, changed, what the train step changes)
    (1, [ONE], ()),  # refused: the first update must be full
    (1, None, ALL),
    (2, [ONE], (ONE,)),
    (3, [], ()),  # nothing moves; the version advances
    (4, "auto", ALL),  # the controller's first "auto" is full (its books say all is new)
    (5, "auto", (TWO,)),  # found by checksum
    (6, ["nope"], ()),  # refused: not a checkpoint tensor
    (6, ONE, ()),  # refused: a string (the tensor's name), not a list
    (6, None, ALL),
)
REFUSED = ["ValueError: the first CALL must be full (changed=None)", None, None, None, None, None,
           "ValueError: changed names 1 tensors that are not in the checkpoint",
           'ValueError: changed must be None, "auto" or a collection of checkpoint tensor names,',
           None]
"""What each step of `DELTAS` raises on both drivers (`_said`; None: nothing)."""


def _said(e: BaseException | None) -> str | None:
    """An error as both drivers word it: its class and its words before the first colon or
    the argument quoted, with the call (send_weights, update) named alike."""
    if e is None:
        return None
    words = re.split(r":| got ", str(e))[0]
    return f"{type(e).__name__}: {re.sub(r'send_weights|update', 'CALL', words)}"


def _named(changed, names: dict):
    """``changed`` of `DELTAS` in one driver's tensor names."""
    if changed is None or changed == "auto":
        return changed
    if isinstance(changed, str):
        return names[changed]
    return [names.get(c, c) for c in changed]


def _trained(held: dict, version: int, trained, names: dict) -> dict:
    """Per tensor, the version the trainers hold after a train step changes ``trained``."""
    if trained == ALL:
        return dict.fromkeys(held, version)
    return {**held, **{names[r]: version for r in trained}}


def _adapters_deltas(mode: str) -> list:
    """`DELTAS` through the adapters: per step (`_said` of the error, every rollout holds
    what the trainers hold)."""
    ss, rs = MODES[mode]
    control, trainers, rollouts = tinygroup.build(
        TransferConfig(timeout_s=5, sender_staging=ss, receiver_staging=rs))
    names = {ONE: "m", TWO: "w"}
    held = dict.fromkeys(tinygroup.SHAPES, 0)
    out = []
    connect(trainers)
    for version, changed, trained in DELTAS:
        step = _trained(held, version, trained, names)
        for m, _ in trainers:
            m.load_weights((n, tinygroup.checkpoint(v)[n]) for n, v in step.items())
        error = _adapters_step(trainers, rollouts, version, _named(changed, names), ss)
        held = step if error is None else held
        out.append((_said(error), error is None and all(
            torch.equal(m.params[n].view(torch.uint8),
                        tinygroup.checkpoint(v)[n].view(torch.uint8))
            for m, _ in rollouts for n, v in held.items())))
    return out


def _adapters_step(trainers, rollouts, version: int, changed, ss: bool):
    """send_weights(version, changed) on every trainer while every rollout polls until it
    runs ``version`` or the calls failed; the first error a call raised (None: none)."""
    sent, done = [], threading.Event()

    def send_all():
        try:
            sent.extend(in_threads(*[lambda a=a: _send(a, version, changed, ss)
                                     for _, a in trainers]))
        finally:
            done.set()

    def poll(r):
        end = time.monotonic() + 30
        while r.version < version and time.monotonic() < end:
            if done.is_set() and any(isinstance(e, BaseException) for e in sent):
                return
            if r.poll_requests() is None:
                time.sleep(0.005)

    in_threads(send_all, *[lambda r=r: poll(r) for _, r in rollouts])
    return next((e for e in sent if isinstance(e, BaseException)), None)


def _send(adapter, version: int, changed, ss: bool):
    adapter.send_weights(version, changed=changed)
    if ss and adapter.worker.index == 0:
        adapter.wait_idle()


@pytest.fixture(scope="module")
def procs():
    with proc_pair(1, 2) as meshes:
        yield meshes


def _controller_deltas(mode: str, procs) -> list:
    """`DELTAS` through `MeshTransfer` (its actors on ``procs``), as `_adapters_deltas`."""
    m = Mode(mode)
    mt = MeshTransfer(TrainerSpec.parse("nodes=1,gpus=1"),
                      RolloutSpec.parse("engines=2,nodes=1,gpus=1"), "tiny", procs=procs,
                      config=TransferConfig(round_bytes=64 << 10, timeout_s=5,
                                            sender_staging=m.sender_staging,
                                            receiver_staging=m.receiver_staging))
    names = {ONE: "model.norm.weight", TWO: "model.embed_tokens.weight"}
    out = []
    with mt:
        mt.connect()
        held = dict.fromkeys(mt.book.tensors, 0)
        for version, changed, trained in DELTAS:
            step = _trained(held, version, trained, names)
            error = None
            try:
                if changed == "auto":  # a train step of the caller's own
                    for _, mesh in mt._live("trainer"):
                        mesh.train_step.call(step).get()
                    mt.update(version, changed, train=False)
                else:
                    mt.update(version, _named(changed, names))
                mt.wait()
                mt.poll_requests()
            except (WeightBridgeError, ValueError) as e:
                error = e
            held = step if error is None else held
            count, bad = mt._verify(mt._live("rollout"), held) if error is None else (0, ())
            out.append((_said(error), error is None and count > 0 and not bad))
    return out


@pytest.mark.mesh
@pytest.mark.parametrize("mode", sorted(MODES))
def test_deltas_give_one_outcome_on_both_drivers(mode, procs):
    """Before: the adapters refused changed= with sender staging and took "auto"; the
    controller took changed= with sender staging and refused "auto" (a string)."""
    adapters, controller = _adapters_deltas(mode), _controller_deltas(mode, procs)
    assert adapters == controller, list(zip(DELTAS, adapters, controller))
    assert [said for said, _ in adapters] == REFUSED, adapters
    assert all(whole for said, whole in adapters if said is None), adapters
