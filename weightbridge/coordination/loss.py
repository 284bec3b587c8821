"""A loss: workers that stopped answering, left out of the group. One routine for every driver.

`lose` runs where the group is sequenced (trainer 0 of the adapters, the controller) once
workers were found lost (dead, stalled or cut off) or engines went out by themselves. Through
the group's `GroupLeader` it excludes their engines and the lost trainers (their workers told
why), re-plans the others from the kept source maps (no probe; a lost trainer's regions then
come from its data-parallel replicas) and returns the `Loss`: who is out, who goes on, what
happened in words, and whether the version is re-sent (`Mode.resends_after_loss`). Each
driver re-sends it its own way (the adapters before they raise, the controller on its
streaming thread after) and raises `Loss.lost`: one `WorkersLost` on every path.

Typical usage::

    loss = lose(leader, rollouts=[1], trainers=[], during="the transfer of version 3",
                cause="TimeoutError: ...", rejoin="add_engine()", restart="close this ...")
    if loss.resend:
        ...                                   # version 3 again, over the new plan
    raise loss.lost("the next update() goes to them")
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection

from weightbridge.coordination.control import rollouts as rollout_workers
from weightbridge.coordination.leader import GroupLeader
from weightbridge.errors import TransferFailed, WorkersLost, describe


@dataclass(frozen=True)
class Loss:
    """What `lose` did to the group."""

    engines: tuple[int, ...]
    """The engines excluded now (their rollout workers were lost, or they went out)."""
    trainers: tuple[int, ...]
    """The trainers excluded now."""
    survivors: tuple[int, ...]
    """The live engines, planned again without the lost workers."""
    what: str
    """Who failed during what and why, what is excluded and how to bring an engine back."""
    resend: bool
    """The trainers' parameters still hold the version (no sender staging): re-send it to the
    survivors over the new plan."""
    out_engines: frozenset[int]
    """Every engine out of the group so far."""
    out_trainers: frozenset[int]
    """Every trainer out so far."""

    def lost(self, state: str) -> WorkersLost:
        """The error to raise: `what`, then ``state`` (what the survivors hold, what next)."""
        return WorkersLost(f"{self.what} {state}", self.out_engines, self.out_trainers)


def lose(leader: GroupLeader, rollouts: Collection[int], trainers: Collection[int], *,
         during: str, cause: str | None, rejoin: str, restart: str) -> Loss:
    """Leave out the engines of the lost rollout workers ``rollouts`` (indices), the engines
    that went out by themselves (``leader.asked_out``) and the lost ``trainers``, re-plan the
    others; the `Loss`. ``during`` names what was running, ``cause`` what failed in one line
    (`one_line`; None: the workers did not answer a ping), ``rejoin`` the call that adds an
    engine again, ``restart`` what to do when the group cannot go on.

    Raises:
        TransferFailed: no engine is left, or planning the others failed (no trainer holds
            what a lost trainer held, say); its message says what happened and ``restart``.
    """
    size = leader.control.engine_size
    asked = dict(leader.asked_out)
    engines = sorted({j // size for j in rollouts} | set(asked))
    trainers = sorted(trainers)
    names = [f"R{j} (engine {j // size})" for j in sorted(rollouts)] + [f"T{i}" for i in trainers]
    causes = ([cause or "it did not answer a ping"] if cause is not None or not asked
              else []) + [
        f"engine {e} went out by itself: {why}" for e, why in asked.items()]
    who = f"{'workers' if len(names) > 1 else 'worker'} {', '.join(names)}" if names else (
        f"engine{'s' if len(asked) > 1 else ''} {sorted(asked)}")
    what = f"{who} failed during {during} ({'; '.join(causes)})."
    if engines:
        what += (f" {_many('Engine', engines)} excluded from this transfer group: nothing "
                 f"more is sent to it and its workers are told why (their polls raise). To use "
                 f"it again, restart its workers on new procs and add them as a new engine "
                 f"({rejoin}).")
    if trainers:
        what += (f" {_many('Trainer', trainers)} excluded: the trainers that hold the same "
                 f"regions (data-parallel replicas) send them from now on.")
    unreachable = [w for w in rollout_workers(leader.control) if w.index in set(rollouts)
                   and w.index // size not in asked]
    leader.exclude(engines, trainers, why=what, unreachable=unreachable)
    survivors = tuple(leader.live_engines())
    if not survivors:
        raise TransferFailed(f"{what} No engine is left: {restart}.")
    try:
        leader.replan()
    except Exception as e:  # noqa: BLE001  (a second failure: say both)
        raise TransferFailed(f"{what} Re-planning without {'them' if len(names) > 1 else 'it'} "
                             f"failed too ({describe(e)}): {restart}.") from e
    return Loss(engines=tuple(engines), trainers=tuple(trainers), survivors=survivors,
                what=what, resend=leader.config.mode.resends_after_loss,
                out_engines=frozenset(leader.out_engines),
                out_trainers=frozenset(leader.out_trainers))


def _many(noun: str, ids: list[int]) -> str:
    return f"{noun}{'s' if len(ids) > 1 else ''} {ids} {'are' if len(ids) > 1 else 'is'}"


def one_line(text: str) -> str:
    """``text`` (an error's message, a cause) in one line: its lines joined."""
    return "; ".join(line.strip() for line in text.strip().splitlines() if line.strip())
