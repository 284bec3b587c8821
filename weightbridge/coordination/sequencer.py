"""The round sequencer: one update's rounds, every step issued the moment its inputs are done.

Used by every path: the controller (`controller.MeshTransfer`), the rank-0 sender of the
adapters, and the in-process `run_plan_locally`. What a step does is the `RoundSteps` it is
given; the order is decided here, and only here::

    send(r)         trainers pack round r into buffer r % depth and write its RECEIVE bytes;
                    issued once round r - depth has landed on every rollout (buffer free
                    again) and send(r - 1) was issued (a trainer serves its sends in order)
    forward(r, s)   rollouts write the EXTERNAL, then the INTERNAL bytes of round r, once the
                    stage before has landed
    land(r)         rollouts assemble round r into their parameters (or a staging slot)

Rounds overlap: round r's forwards run beside round r + 1's RECEIVE bytes, and with depth 3
round r + 2's writes need not wait for round r's hand-over. Every step that fails becomes one
`StepFailed` naming the round and the step; the other steps are cancelled.

Typical usage::

    asyncio.run(run_rounds(steps, active_steps(worker_plans), num_rounds, depth=2))
"""

from __future__ import annotations

import asyncio
from typing import Iterable, Protocol

from weightbridge.errors import StepFailed, describe
from weightbridge.types import Stage, WorkerPlan

FORWARD_STAGES = (Stage.EXTERNAL, Stage.INTERNAL)
LAND = "land"


class RoundSteps(Protocol):
    """What each step of a round runs, on every worker that has a part in it."""

    async def send(self, r: int) -> None: ...

    async def forward(self, r: int, stage: Stage) -> None: ...

    async def land(self, r: int) -> None: ...


def active_steps(plans: Iterable[WorkerPlan]) -> frozenset:
    """(round, stage) pairs with at least one write, and (round, "land") where any worker
    assembles: the steps worth a control message."""
    active = set()
    for p in plans:
        for r in p.rounds:
            active |= {(r.index, w.stage) for w in r.writes}
            if r.assemble:
                active.add((r.index, LAND))
    return frozenset(active)


async def run_rounds(steps: RoundSteps, active: frozenset, num_rounds: int, depth: int, *,
                     first: int = 0) -> None:
    """Run every round of one update from round ``first`` on (the rounds before it are
    skipped: a join's catch-up runs only the rounds it appended); returns once the last round
    has landed everywhere.

    Raises:
        StepFailed: a step raised (the first failure; the other steps are cancelled).
    """
    def send(r: int):
        return steps.send(r) if (r, Stage.RECEIVE) in active else None

    async def rest(r: int) -> None:
        for stage in FORWARD_STAGES:
            if (r, stage) in active:
                await _step(r, f"rollouts' {stage.value} forward", steps.forward(r, stage))
        if (r, LAND) in active:
            await _step(r, "rollouts' land", steps.land(r))

    await _pipelined(num_rounds, depth, first, send, "trainers' send", rest)


class WholeRounds(Protocol):
    """A round as one step on every worker taking part (`TransferConfig.round_control`
    "rounds": the stages hand over peer to peer, `weightbridge.coordination.signals`)."""

    async def round(self, r: int) -> None: ...


async def run_whole_rounds(steps: WholeRounds, active: frozenset[int], num_rounds: int,
                           depth: int, *, first: int = 0) -> None:
    """`run_rounds` with one step per round: round r (``active``: the rounds with a write)
    is issued once round r - depth ended on every worker and round r - 1 was issued.

    Raises:
        StepFailed: a round failed on some worker (the first failure; the others are
            cancelled here, and the caller abandons them on the workers).
    """
    def whole(r: int):
        return steps.round(r) if r in active else None

    async def nothing(r: int) -> None:
        return None

    await _pipelined(num_rounds, depth, first, whole, "send, forwards and land", nothing)


async def _step(r: int, what: str, coro) -> None:
    try:
        await coro
    except Exception as e:
        text = " ".join(describe(e).split())  # the worker's own error, not Monarch's wrapper
        raise StepFailed(f"round {r}, {what}: {text[:600]}") from e


async def _pipelined(num_rounds: int, depth: int, first: int, issue, what: str, rest) -> None:
    """The order both sequencers share: round r's first step (``issue(r)``: a coroutine, or
    None when the round has none) starts once round r - depth ended (its buffer is free) and
    round r - 1's first step was issued; ``rest(r)`` runs after it."""
    assert depth >= 2, depth  # TransferConfig validates it
    landed: list[asyncio.Future] = []
    issued: list[asyncio.Event] = [asyncio.Event() for _ in range(num_rounds)]

    async def run(r: int) -> None:
        if r < first:
            issued[r].set()
            return
        if r >= depth:
            await landed[r - depth]
        if r > 0:
            await issued[r - 1].wait()
        coro = issue(r)
        if coro is not None:
            started = asyncio.ensure_future(_step(r, what, coro))
            await asyncio.sleep(0)  # issued before the next round's
            issued[r].set()
            await started
        else:
            issued[r].set()
        await rest(r)

    landed.extend(asyncio.ensure_future(run(r)) for r in range(num_rounds))
    try:
        await asyncio.gather(*landed)
    finally:
        for task in landed:
            task.cancel()
