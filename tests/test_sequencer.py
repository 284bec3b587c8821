"""`run_rounds` alone: the order it issues a round's steps in, with steps that only log.

Each step logs when it starts and ends and sleeps a seeded random while (0-3 ms), so many
interleavings are tried; the checks are on the log's order (coordination/sequencer.py's
rules), never on wall-clock times.
"""

import asyncio
import random

import pytest

from weightbridge.coordination.sequencer import LAND, run_rounds, run_whole_rounds
from weightbridge.errors import StepFailed
from weightbridge.types import Stage

EXTERNAL, INTERNAL, RECEIVE = Stage.EXTERNAL, Stage.INTERNAL, Stage.RECEIVE


class LoggingSteps:
    """Every step appends ("start" | "end" | "cancelled", round, step) to ``log``."""

    def __init__(self, seed: int, fail: tuple | None = None):
        self.rng, self.fail, self.log = random.Random(seed), fail, []

    async def _run(self, r, what):
        self.log.append(("start", r, what))
        try:
            await asyncio.sleep(self.rng.random() * 0.003)
            if self.fail == (r, what):
                raise RuntimeError(f"step {what} of round {r} failed")
        except asyncio.CancelledError:
            self.log.append(("cancelled", r, what))
            raise
        self.log.append(("end", r, what))

    async def send(self, r):
        await self._run(r, RECEIVE)

    async def forward(self, r, stage):
        await self._run(r, stage)

    async def land(self, r):
        await self._run(r, LAND)

    def at(self, event, r, what) -> int:
        return self.log.index((event, r, what))


def _all_steps(num_rounds):
    return frozenset((r, s) for r in range(num_rounds) for s in (RECEIVE, EXTERNAL, INTERNAL, LAND))


@pytest.mark.parametrize("depth", [2, 3])
@pytest.mark.parametrize("seed", range(8))
def test_each_step_waits_for_what_it_needs_and_no_more(depth, seed):
    n = 7
    steps = LoggingSteps(seed)
    asyncio.run(run_rounds(steps, _all_steps(n), n, depth))
    started = [(r, s) for e, r, s in steps.log if e == "start"]
    assert len(started) == len(set(started)) and set(started) == _all_steps(n)
    assert all(e[0] != "cancelled" for e in steps.log)
    for r in range(n):
        # A round's stages in order: RECEIVE, then EXTERNAL, then INTERNAL, then land.
        assert steps.at("end", r, RECEIVE) < steps.at("start", r, EXTERNAL)
        assert steps.at("end", r, EXTERNAL) < steps.at("start", r, INTERNAL)
        assert steps.at("end", r, INTERNAL) < steps.at("start", r, LAND)
        if r > 0:  # a trainer serves its sends in order
            assert steps.at("start", r - 1, RECEIVE) < steps.at("start", r, RECEIVE)
        if r >= depth:  # buffer r % depth is free again only once round r - depth landed
            assert steps.at("end", r - depth, LAND) < steps.at("start", r, RECEIVE)


def test_rounds_overlap_up_to_the_depth():
    """With depth 3, round r + 1's send does not wait for round r to land: the pipeline is
    used (seen in at least one of the seeded interleavings, in every one for round 1)."""
    n, overlapped = 6, 0
    for seed in range(8):
        steps = LoggingSteps(seed)
        asyncio.run(run_rounds(steps, _all_steps(n), n, 3))
        assert steps.at("start", 1, RECEIVE) < steps.at("end", 0, LAND)
        overlapped += sum(steps.at("start", r + 1, RECEIVE) < steps.at("end", r, LAND)
                          for r in range(n - 1))
    assert overlapped > 8


def test_only_active_steps_run_and_rounds_before_first_are_skipped():
    n = 5
    active = frozenset({(r, RECEIVE) for r in range(n)} | {(r, LAND) for r in range(n)}
                       | {(3, EXTERNAL)})
    steps = LoggingSteps(0)
    asyncio.run(run_rounds(steps, active, n, 2, first=2))
    started = {(r, s) for e, r, s in steps.log if e == "start"}
    assert started == {(r, s) for r, s in active if r >= 2}


@pytest.mark.parametrize("what,name", [(RECEIVE, "trainers' send"),
                                       (EXTERNAL, "rollouts' external forward"),
                                       (LAND, "rollouts' land")])
def test_a_failed_step_is_one_step_failed_naming_it_and_the_others_are_cancelled(what, name):
    n = 6
    steps = LoggingSteps(1, fail=(2, what))
    with pytest.raises(StepFailed, match=f"round 2, {name}: RuntimeError: step .* of round 2"):
        asyncio.run(run_rounds(steps, _all_steps(n), n, 2))
    # Nothing of a later round that depends on the failed one is started.
    assert ("start", 4, RECEIVE) not in steps.log
    # Every step still running when it failed was cancelled, none left running.
    running = {(r, s) for e, r, s in steps.log if e == "start"} - {
        (r, s) for e, r, s in steps.log if e in ("end", "cancelled")}
    assert running == {(2, what)}, running


class LoggingRounds(LoggingSteps):
    """`run_whole_rounds`'s step: a whole round, logged as (event, r, "round")."""

    async def round(self, r):
        await self._run(r, "round")


@pytest.mark.parametrize("depth", [2, 3])
@pytest.mark.parametrize("seed", range(8))
def test_a_whole_round_starts_once_round_r_minus_depth_ended_and_in_order(depth, seed):
    n = 9
    steps = LoggingRounds(seed)
    asyncio.run(run_whole_rounds(steps, frozenset(range(n)), n, depth))
    started = [r for e, r, _ in steps.log if e == "start"]
    assert started == list(range(n))  # issued in order
    for r in range(depth, n):
        assert steps.at("end", r - depth, "round") < steps.at("start", r, "round")
    # ...and no later: round r starts as soon as round r - depth ended (or round r - 1 was
    # issued), so up to depth rounds are in flight at once.
    assert max(sum(1 for e, q, _ in steps.log[:i] if e == "start") -
               sum(1 for e, q, _ in steps.log[:i] if e == "end")
               for i in range(len(steps.log) + 1)) == depth


def test_rounds_without_a_write_are_skipped_and_the_first_failure_names_its_round():
    steps = LoggingRounds(0, fail=(3, "round"))
    with pytest.raises(StepFailed, match=r"round 3, send, forwards and land: RuntimeError: "
                                         r"step round of round 3 failed"):
        asyncio.run(run_whole_rounds(steps, frozenset({0, 1, 3, 4, 5}), 6, 2))
    started = [r for e, r, _ in steps.log if e == "start"]
    assert 2 not in started and started[:3] == [0, 1, 3]
