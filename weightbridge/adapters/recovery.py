"""Trainer 0's failure policy: find the lost workers, plan them out, re-send, tell everyone.

`recover` runs on trainer 0's `weightbridge.adapters.rank0.GroupSequencer` when a call of
a transfer failed; what a loss does to the group is `weightbridge.coordination.loss.lose`,
the routine the controller uses too. See docs/failures.md, for the guarantees.
"""

from __future__ import annotations

from weightbridge.adapters.sequencing import Sequencing
from weightbridge.coordination.control import engine_workers
from weightbridge.coordination.loss import Loss, lose, one_line
from weightbridge.coordination.session import unanswered
from weightbridge.errors import TransferFailed, describe, failure_kind, told


REJOIN = "TransferGroup.add_engines, then add_engines() on every trainer"
RESTART = "build a new group (new adapters, connect()) to go on"


def recover(seq: Sequencing, version: int, error: Exception, moved: bool) -> None:
    """A session call failed: find the workers that are gone (rollouts and trainers) and
    leave them out (`weightbridge.coordination.loss.lose`: excluded, the others planned
    again), re-send ``version`` where the trainers still hold it, tell every trainer; raise
    `WorkersLost`. Anything else is raised as every trainer is told it (a failed step, a
    worker's bug: `TransferFailed`; bad input, a replica mismatch: its own kind), and the
    group is closed if bytes had moved: no engine's state is known. A group closed
    meanwhile (`TransferGroup.close`: its calls fail as the agents stop) raises
    `TransferFailed` saying so: nobody is lost."""
    if seq.broken is not None:
        raise TransferFailed(seq.broken) from error
    gone, gone_t = find_lost(seq)
    if not gone and not gone_t:
        cause = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        # Every trainer waits in send_weights(version) (not SS): it fails the same way.
        kind = failure_kind(error)
        seq.tell_trainers(version, f"trainer 0: {type(error).__name__}: {cause}", kind)
        if moved:
            # No engine may run a step on what it holds now: every poll raises.
            seq.close(f"the transfer of version {version} failed after bytes moved "
                      f"({type(error).__name__}: {cause}) and every worker still answers, "
                      f"so no engine's weights are known; build a new group (new "
                      f"adapters, connect()) to go on")
        if kind == "transfer" and not isinstance(error, TransferFailed):
            # (as the other trainers are told it: `except TransferFailed` catches it)
            raise TransferFailed(f"{seq.worker}: {describe(error)}") from error
        raise error
    loss = _lose(seq, gone, gone_t, f"the transfer of version {version}", error, version)
    survivors = list(loss.survivors)
    try:
        seq.rejoin(moved)
        if loss.resend:  # the trainers' parameters still hold this version
            seq.session(version, [False], release=False)
    except Exception as e2:  # noqa: BLE001
        _group_ends(seq, f"{loss.what} Re-sending version {version} to the surviving engines "
                         f"{survivors} failed too ({describe(e2)}); {RESTART}.", e2, version)
    if loss.resend:
        state = (f"Version {version} was re-sent to the surviving engines {survivors} over a "
                 f"new plan: they " + ("install it at their next poll_requests()."
                                       if seq.config.mode.lands_in_staging else "installed it."))
    else:
        state = (f"The surviving engines {survivors} never saw version {version}: "
                 + ("they keep the version they run and install the next one you send."
                    if seq.config.mode.lands_in_staging else
                    "their poll_requests() wait (no inference step runs on a partial "
                    "update) for the next version you send, within 3 x timeout_s."))
    lost = loss.lost(f"{state} send_weights() goes on with the surviving workers.")
    kind, message, out = told(lost)
    seq.tell_trainers(version, message, kind, out)
    raise lost from error


def exclude_lost(seq: Sequencing, during: str, error: Exception | None = None
                 ) -> Loss | None:
    """Between transfers (a membership change, ``during`` names it): find the live workers
    that do not answer a ping and leave them out (`weightbridge.coordination.loss.lose`);
    the `Loss`, or None when every worker answers.

    Raises:
        TransferFailed: no engine is left, or the re-plan failed: the group is closed
            (every rollout's poll raises).
    """
    gone, gone_t = find_lost(seq)
    if not gone and not gone_t:
        return None
    return _lose(seq, gone, gone_t, during, error)


def find_lost(seq: Sequencing) -> tuple[list[int], list[int]]:
    """(rollout, trainer) indices of the live workers that do not answer a ping (dead,
    stalled or cut off); trainer 0, which asks, is not asked."""
    control = seq.control
    asked = [w.index for e in list(seq.leader.asked_out)
             for w in engine_workers(control, e) if w in seq.live()]
    return (sorted(set(asked) | {w.index for w in unanswered(control, seq.live())}),
            [t.index for t in unanswered(control, seq.live_trainers()[1:])])


def _lose(seq: Sequencing, gone: list[int], gone_t: list[int], during: str,
          error: Exception | None, version: int | None = None) -> Loss:
    """`lose` on trainer 0's leader; when the group cannot go on (no engine left, the re-plan
    failed) it is closed, every trainer told, and `TransferFailed` raised."""
    try:
        cause = None if error is None else one_line(describe(error))
        return lose(seq.leader, gone, gone_t, during=during, cause=cause, rejoin=REJOIN,
                    restart=RESTART)
    except TransferFailed as e:
        _group_ends(seq, str(e), error, version)


def _group_ends(seq: Sequencing, why: str, error: BaseException | None,
                version: int | None) -> None:
    """The group cannot go on: close it (every rollout told ``why``; no engine gets another
    version, each learns it at its next poll), tell the trainers waiting for ``version``;
    raise `TransferFailed`."""
    seq.close(why)
    if version is not None:
        seq.tell_trainers(version, seq.broken)
    raise TransferFailed(seq.broken) from error
