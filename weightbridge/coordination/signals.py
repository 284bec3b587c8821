"""Rounds whose stages hand over peer to peer (`TransferConfig.round_control` ``"rounds"``).

With ``"stages"`` the controller starts every stage of a round and hears it end: four trips
through it per round (send, two forwards, land). With ``"rounds"`` it sends each worker one
message per round (`PeerCall.ROUND`) and hears one answer; inside the round the writers tell
their readers directly::

    writer W, once its writes of (round r, stage s) into X landed
        post X: WRITTEN(update, r, s, W, the checksums of those writes)
    X, before writing a later stage of round r, and before landing r
        waits for WRITTEN from every writer the plan names for it in the stages before
    the controller, once a round failed anywhere
        post every worker: ABANDON(update, why)      (their waits end at once)

The controller still issues round r + depth only once round r landed on every worker, so a
round buffer is never written before its last round was assembled, as with ``"stages"``.

    round_parts(plan)   per round: who takes part, and who writes into whom in which stage
    RoundSignals        one worker's WRITTEN and ABANDON messages, and the waits on them
"""

from __future__ import annotations

import collections
import functools
import threading
import time
import types
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from weightbridge.types import Stage, WorkerId

STAGES = tuple(Stage)
"""The stages in round order; a stage's number is its position here."""
KEPT_UPDATES = 2
"""Updates whose messages a worker keeps: the newest, and the one before it (messages of an
abandoned update can still arrive after the next one started)."""


@dataclass(frozen=True, slots=True)
class RoundPart:
    """One round as the controller hands it to its workers (the same for all of them).

    Attributes:
        workers: Every worker that writes or is written in the round (it gets the message).
        writers: Flat records (reader rollout, stage number, writer side: 0 trainer or 1
            rollout, writer index), four ints each: flat ints pickle fast, and every
            worker of the round gets them.
    """

    workers: tuple[WorkerId, ...]
    writers: tuple[int, ...]

    def writers_of(self, reader: WorkerId) -> dict[Stage, tuple[WorkerId, ...]]:
        """The writers into ``reader`` in each stage of the round (stages without: absent)."""
        out: dict[Stage, list[WorkerId]] = {}
        if reader.side != "rollout":
            return {}
        w = self.writers
        for k in range(0, len(w), 4):
            if w[k] == reader.index:
                out.setdefault(STAGES[w[k + 1]], []).append(
                    WorkerId("rollout" if w[k + 2] else "trainer", w[k + 3]))
        return {s: tuple(ws) for s, ws in out.items()}


@functools.lru_cache(maxsize=1)
def round_parts(plan) -> Mapping[int, RoundPart]:
    """Round -> its `RoundPart`, for every round with a write (``plan``: a
    `weightbridge.planning.plan.TransferPlan`; pure, from its delivery tables). Kept for the
    newest plan (a plan is immutable and hashed by identity): every update of a plan in
    force asks for the same parts, which cost a sort of its tables (13 ms at 128 workers)."""
    t = plan.tables
    if len(t.stage) == 0:
        return {}
    trainers = len(plan.trainers)
    rounds = t.round.astype(np.int64)
    key = np.stack([rounds, t.dst.astype(np.int64), t.stage.astype(np.int64),
                    t.src.astype(np.int64)], axis=1)
    key = key[np.lexsort(key.T[::-1])]
    keep = np.ones(len(key), dtype=bool)
    keep[1:] = np.any(key[1:] != key[:-1], axis=1)
    key = key[keep]

    def worker(number: int) -> WorkerId:
        return (WorkerId("trainer", number) if number < trainers
                else WorkerId("rollout", number - trainers))

    out: dict[int, RoundPart] = {}
    cuts = np.flatnonzero(np.diff(key[:, 0])) + 1
    for rows in np.split(key, cuts):
        r = int(rows[0, 0])
        numbers = sorted(set(rows[:, 1].tolist()) | set(rows[:, 3].tolist()))
        flat = []
        for _, dst, stage, src in rows.tolist():
            flat += [dst - trainers, stage, int(src >= trainers),
                     src - trainers if src >= trainers else src]
        out[r] = RoundPart(tuple(worker(n) for n in numbers), tuple(flat))
    return types.MappingProxyType(out)


class Abandoned(RuntimeError):
    """The controller gave up on the update this worker's round belongs to (a step failed
    somewhere): its waits end, and nothing more of the round is written or landed."""


class RoundSignals:
    """One worker's WRITTEN and ABANDON messages, by update (the newest `KEPT_UPDATES`).

    Served beside the worker's round (on another thread): `written` and `abandon` only
    record and wake; the round's thread waits in `wait`.
    """

    def __init__(self):
        self._cond = threading.Condition()
        self._written: collections.OrderedDict = collections.OrderedDict()
        """update -> {(round, stage number): {writer: checksums}}."""
        self._abandoned: collections.OrderedDict = collections.OrderedDict()
        """update -> why the controller gave up on it."""

    def _of(self, table: collections.OrderedDict, update: int, make):
        entry = table.get(update)
        if entry is None:
            entry = table[update] = make()
            while len(table) > KEPT_UPDATES:
                table.popitem(last=False)
        return entry

    def written(self, update: int, r: int, stage: int, writer: WorkerId,
                sums: tuple[int, ...]) -> None:
        """``writer``'s writes of (round ``r``, ``stage``) into this worker landed."""
        with self._cond:
            self._of(self._written, update, dict).setdefault((r, stage), {})[writer] = sums
            self._cond.notify_all()

    def abandon(self, update: int, why: str) -> None:
        with self._cond:
            self._of(self._abandoned, update, lambda: why)
            self._cond.notify_all()

    def given_up(self, update: int) -> str | None:
        """Why the controller gave up on ``update`` (None: it has not, as far as this worker
        was told)."""
        with self._cond:
            return self._abandoned.get(update)

    def wait(self, who: WorkerId, update: int, r: int, writers: dict[Stage, tuple],
             stages: tuple[Stage, ...], timeout: float) -> tuple[int, ...]:
        """Wait until every writer of ``stages`` of round ``r`` (``writers``, from
        `RoundPart.writers_of`) said its writes into this worker landed; returns their
        checksums, and forgets them.

        Raises:
            TimeoutError: a writer did not say so within ``timeout`` (named).
            Abandoned: the controller gave up on ``update``.
        """
        wanted = [(STAGES.index(s), w) for s in stages for w in writers.get(s, ())]
        if not wanted:
            return ()
        end = time.monotonic() + timeout
        with self._cond:
            while True:
                why = self._abandoned.get(update)
                if why is not None:
                    raise Abandoned(f"{who}: round {r} was abandoned: {why}")
                got = self._written.get(update, {})
                missing = [(s, w) for s, w in wanted if w not in got.get((r, s), {})]
                if not missing:
                    break
                left = end - time.monotonic()
                if left <= 0:
                    names = ", ".join(f"{w} ({STAGES[s].value})" for s, w in missing[:4])
                    raise TimeoutError(
                        f"{who}: the writes of round {r} from {names}"
                        f"{' and more' if len(missing) > 4 else ''} did not land within "
                        f"{timeout:g}s (TransferConfig.peer_timeout_s): that worker died, "
                        f"stalled or its link did")
                self._cond.wait(left)
            sums: list[int] = []
            for s, w in wanted:
                sums += got[(r, s)].pop(w)
                if not got[(r, s)]:
                    del got[(r, s)]
            return tuple(sums)
