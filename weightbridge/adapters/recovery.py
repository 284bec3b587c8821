"""Trainer 0's failure policy: find the lost workers, plan them out, re-send, tell everyone.

`recover` runs on trainer 0's `weightbridge.adapters.rank0.GroupSequencer` when a call of
a transfer failed; the group's state changes only through its `GroupLeader` (``exclude``,
``replan``). See docs/failures.md, for the guarantees.
"""

from __future__ import annotations

from weightbridge.adapters.base import TransferFailed
from weightbridge.coordination.control import engine_workers, rollouts
from weightbridge.coordination.session import unanswered
from weightbridge.errors import describe, failure_kind


def recover(seq, version: int, error: Exception, moved: bool) -> None:
    """A session call failed: find the workers that are gone (rollouts and trainers),
    exclude the lost engines and trainers, re-plan over the others (a lost trainer's
    regions from its replicas), re-send ``version`` where the trainers still hold it, tell
    every trainer; raise `TransferFailed`. Anything else is raised as every trainer is told
    it (a failed step, a worker's bug: `TransferFailed`; bad input, a replica mismatch: its
    own kind), and the group is closed if bytes had moved: no engine's state is known."""
    mode = seq.config.mode
    gone, gone_t = find_lost(seq)
    cause = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if not gone and not gone_t:
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
    what = _exclude(seq, gone, gone_t, f"the transfer of version {version}", error)
    survivors = seq.leader.live_engines()
    if not survivors:
        seq.close(what + " No engine is left.")
        seq.tell_trainers(version, seq.broken)
        raise TransferFailed(seq.broken) from error
    try:
        seq.leader.replan()
        if not mode.sender_staging:  # the trainers' parameters still hold this version
            _rejoin(seq, moved)
            seq.session(version, [False], release=False)
            state = (f"Version {version} was re-sent to the surviving engines {survivors} "
                     f"over a new plan: they "
                     + ("install it at their next poll_requests()." if mode.receiver_staging
                        else "installed it."))
        else:
            _rejoin(seq, moved)
            state = (f"The surviving engines {survivors} never saw version {version}: "
                     + ("they keep the version they run and install the next one you send."
                        if mode.receiver_staging else
                        "their poll_requests() wait (no inference step runs on a partial "
                        "update) for the next version you send, within 3 x timeout_s."))
    except Exception as e2:  # noqa: BLE001
        _replan_failed(seq, what, e2, version)
    message = f"{what} {state} send_weights() goes on with the surviving workers."
    seq.tell_trainers(version, message)
    raise TransferFailed(message) from error


def exclude_lost(seq, during: str, error: Exception | None = None) -> str | None:
    """Between transfers (a membership change, ``during`` names it): find the live workers
    that do not answer a ping, exclude their engines and them, re-plan over the others;
    what was excluded (the message their workers were told), or None when every worker
    answers.

    Raises:
        TransferFailed: no engine is left, or the re-plan failed: the group is closed
            (every rollout's poll raises).
    """
    gone, gone_t = find_lost(seq)
    if not gone and not gone_t:
        return None
    what = _exclude(seq, gone, gone_t, during, error)
    if not seq.leader.live_engines():
        seq.close(what + " No engine is left; build a new group (new adapters, connect()).")
        raise TransferFailed(seq.broken) from error
    try:
        seq.leader.replan()
    except Exception as e2:  # noqa: BLE001
        _replan_failed(seq, what, e2)
    return what


def find_lost(seq) -> tuple[list[int], list[int]]:
    """(rollout, trainer) indices of the live workers that do not answer a ping (dead,
    stalled or cut off); trainer 0, which asks, is not asked."""
    control = seq.control
    asked = [w.index for e in list(seq.leader.asked_out)
             for w in engine_workers(control, e) if w in seq.live()]
    return (sorted(set(asked) | {w.index for w in unanswered(control, seq.live())}),
            [t.index for t in unanswered(control, seq.live_trainers()[1:])])


def _cause(error: Exception | None) -> str:
    if error is None:
        return "it did not answer a ping"
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


def _exclude(seq, gone: list[int], gone_t: list[int], during: str,
             error: Exception | None) -> str:
    """Exclude the engines of the rollouts ``gone`` and the trainers ``gone_t`` (their
    workers told why); the message that says what happened and what to do."""
    control = seq.control
    size = control.engine_size
    lost = sorted({j // size for j in gone})
    names = ([f"R{j} (engine {j // size})" for j in gone] + [f"T{i}" for i in gone_t])
    asked = {e: why for e, why in seq.leader.asked_out.items() if e in lost}
    causes = ([_cause(error)] if error is not None or not asked else []) + [
        f"engine {e} went out by itself: {why}" for e, why in asked.items()]
    what = (f"{'workers' if len(names) > 1 else 'worker'} {', '.join(names)} failed during "
            f"{during} ({'; '.join(causes)}).")
    if lost:
        what += (f" Engine{'s' if len(lost) > 1 else ''} {lost} "
                 f"{'are' if len(lost) > 1 else 'is'} excluded from this transfer group: "
                 f"nothing more is sent to it and its other workers' poll_requests() "
                 f"raise. To use it again, restart its workers on new procs and add them "
                 f"as a new engine (TransferGroup.add_engines, then add_engines() on every "
                 f"trainer).")
    if gone_t:
        what += (f" Trainer{'s' if len(gone_t) > 1 else ''} {gone_t} "
                 f"{'are' if len(gone_t) > 1 else 'is'} excluded: the trainers that hold "
                 f"the same regions (data-parallel replicas) send them from now on, and "
                 f"send_weights() is collective over the others.")
    seq.leader.exclude(lost, gone_t, why=what,
                       unreachable=[w for w in rollouts(control) if w.index in gone
                                    and w.index // size not in asked])
    return what


def _replan_failed(seq, what: str, error: Exception, version: int | None = None) -> None:
    """Re-planning without the lost workers failed: close the group (every trainer and
    rollout told); raise `TransferFailed`."""
    # No engine gets another version: each learns it at its next poll.
    seq.close(f"{what} Re-planning without it failed too ({type(error).__name__}: "
              f"{error}); build a new group (new adapters, connect()) to go on.")
    if version is not None:
        seq.tell_trainers(version, seq.broken)
    raise TransferFailed(seq.broken) from error


def _rejoin(seq, moved: bool) -> None:
    """RS off: the surviving rollouts that had joined the failed transfer still wait in
    poll_requests() for a version; count them in for the next transfer."""
    if seq.config.receiver_staging or not moved:
        return  # before the bytes moved, ``seq.joined`` still holds who joined
    live = set(seq.live())
    with seq.cond:
        seq.joined = seq.joined | (seq.session_joined & live)
