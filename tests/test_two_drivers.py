"""One loss, two drivers: the adapters (in one process, on `LocalControl`) and the
controller's `MeshTransfer` (on local meshes) leave a lost rollout engine out through one
routine (`weightbridge.coordination.loss.lose`), and must agree, in every mode, on what a user
sees: the error (`WorkersLost`, naming the same engines, with the same first words), whether
the version that lost the engine is re-sent to the survivors (`Mode.resends_after_loss`), and
the next version reaching them whole.

The loss: rollout 1 (engine 1 of two one-rank engines) stops answering as version 1's rounds
land in it (the adapters: it stops in its first landing, `faults.stalling_group`; the
controller: its process exits in round 1, `faults.DiesInRound1Rollout`).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import tinygroup
from faults import STALLED, DiesInRound1Rollout, stalling_group
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
