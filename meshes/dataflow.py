"""Data-flow rounds: the actors sequence an update's rounds themselves, peer to peer.

The controller starts an update with one ``run_update`` call per actor; from then on every step
of every round starts when its inputs have landed, told by the peer that wrote them:

    trainer t                          rollout j                           rollout k
    ---------                          ---------                           ---------
    pack r (arena r%2)
    [free(r-2) from j?]  RDMA RECEIVE ====> arena r%2
    landed(r, receive, t) -----------> all RECEIVE(r) writers landed?
                                       [free(r-2) from k?] EXTERNAL =====> arena r%2
                                       landed(r, external, j) ----------> ... INTERNAL ...
                                       all stages of r landed: assemble r
    <------------ free(r) -------------  (to everyone who writes into j in round r+2)

- ``landed(u, r, stage, writer)``: the writer's RDMA writes of (round r, stage) into this
  worker have completed (a write's future resolves once its bytes are in the peer's memory).
  A worker knows from its `Schedule` which writers to expect for each (round, stage), and for
  each of its forwarding writes whose bytes it forwards: a write goes as soon as those landed
  (two trainers sharing a host link finish a round at different times; the faster one's bytes
  are forwarded without waiting for the slower one's).
- ``free(u, r, reader)``: the reader has forwarded and assembled round r, so its arena r % 2 may
  take round r + 2 (two round arenas, the paper's depth 2: the back-pressure that keeps a fast
  writer from overwriting a round a slow reader still uses). With ``depth`` arenas (an option,
  see `Schedule.depth`) round r + depth waits for free(r) instead.
- ``abort(u, reason)``: a worker failed; every waiting peer stops with that reason instead of
  waiting out its timeout.

All three are one-way endpoint calls (control plane); bytes move only through RDMA writes.
Every wait is bounded (`Inbox` raises `StepTimeout` naming the peers that never reported), so a
dead peer surfaces at the controller as an error, never a hang. Notifications carry the update
number: a late one of an earlier update is ignored, an early one of the next update is kept.

Pure pieces (`Schedule`, `schedules`) and the notification state (`Inbox`, thread-safe: the
actor's event loop fills it while the round loop runs in a thread) live here; the round loops
are in `meshes/actors.py`.

Typical usage (controller, then each actor)::

    sched = schedules(worker_plans)[worker]      # controller, once per plan
    inbox.wait_landed(u, r, Stage.RECEIVE, sched.inputs.get((r, Stage.RECEIVE), ()), 60)
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Iterable, Mapping

from weightbridge import Stage, WorkerId, WorkerPlan

STAGES = (Stage.RECEIVE, Stage.EXTERNAL, Stage.INTERNAL)


class StepTimeout(TimeoutError):
    """A worker waited longer than its timeout for a peer's notification."""


class UpdateAborted(RuntimeError):
    """Another worker failed during this update; the message names it and says why."""


@dataclass(frozen=True, slots=True)
class Schedule:
    """What one worker waits for and whom it tells, per round: its part of the data flow.

    Example: rollout 1 of a trainer -> 2 rollouts plan in 3 rounds, depth 2, fed by trainer 0
    and forwarding to rollout 0: ``inputs={(0, RECEIVE): {T0}, (0, EXTERNAL): {R0}, ...}``,
    ``outputs={(0, EXTERNAL): {R0}, ...}``, ``frees={0: {T0, R0}}`` (round 2's writers),
    ``needs={(0, EXTERNAL): ({(T0, RECEIVE)},), ...}`` (its one external write forwards what
    trainer 0 wrote).
    """

    worker: WorkerId
    num_rounds: int
    depth: int
    """Round arenas per worker: round r uses arena r % depth (2 in the paper)."""
    inputs: Mapping[tuple[int, Stage], frozenset[WorkerId]]
    """(round, stage) -> the writers whose ``landed`` must arrive before the next step."""
    outputs: Mapping[tuple[int, Stage], frozenset[WorkerId]]
    """(round, stage) -> the peers this worker writes into (and then tells ``landed``); for
    round r >= depth each must have sent ``free(r - depth)`` first."""
    frees: Mapping[int, frozenset[WorkerId]]
    """round r -> the writers into this worker in round r + depth: told ``free(r)`` once this
    worker has forwarded and assembled round r."""
    needs: Mapping[tuple[int, Stage], tuple[frozenset[tuple[WorkerId, Stage]], ...]]
    """(round, forwarding stage) -> per outgoing write of that stage (in plan order), the
    (writer, stage) whose bytes it forwards: it is issued as soon as those landed, not after
    the whole earlier stage."""

    def peers(self) -> frozenset[WorkerId]:
        """Every worker this one sends notifications to."""
        out = set()
        for group in (*self.outputs.values(), *self.frees.values()):
            out |= group
        return frozenset(out)


def schedules(plans: Iterable[WorkerPlan], depth: int = 2) -> dict[WorkerId, Schedule]:
    """Every worker's `Schedule`, from all `WorkerPlan`s of one plan (who writes to whom)."""
    if depth < 2:
        raise ValueError(f"depth must be >= 2 round arenas (one filling while one drains), "
                         f"got {depth}")
    plans = list(plans)
    num_rounds = max((len(p.rounds) for p in plans), default=0)
    inputs: dict[WorkerId, dict] = {p.worker: {} for p in plans}
    outputs: dict[WorkerId, dict] = {p.worker: {} for p in plans}
    for p in plans:
        for rnd in p.rounds:
            for w in rnd.writes:
                if w.peer not in inputs:
                    raise ValueError(f"{p.worker} writes into {w.peer}, which has no plan; "
                                     f"pass the plans of every worker of the transfer")
                outputs[p.worker].setdefault((rnd.index, w.stage), set()).add(w.peer)
                inputs[w.peer].setdefault((rnd.index, w.stage), set()).add(p.worker)
    needs = _forward_needs(plans)
    out = {}
    for worker in inputs:
        ins = {k: frozenset(v) for k, v in inputs[worker].items()}
        frees = {}
        for r in range(num_rounds - depth):
            writers = frozenset().union(*(ins.get((r + depth, s), ()) for s in STAGES))
            if writers:
                frees[r] = writers
        out[worker] = Schedule(worker=worker, num_rounds=num_rounds, depth=depth, inputs=ins,
                               outputs={k: frozenset(v) for k, v in outputs[worker].items()},
                               frees=frees, needs=needs.get(worker, {}))
    return out


def _forward_needs(plans: list[WorkerPlan]) -> dict[WorkerId, dict]:
    """Per worker, (round, stage) -> per forwarding write, the (writer, stage) of the incoming
    writes that overlap the arena bytes it reads."""
    incoming: dict[tuple[WorkerId, int], list[tuple[int, int, WorkerId, Stage]]] = {}
    for p in plans:
        for rnd in p.rounds:
            for w in rnd.writes:
                incoming.setdefault((w.peer, rnd.index), []).append(
                    (w.peer_offset, w.peer_offset + w.nbytes, p.worker, w.stage))
    out: dict[WorkerId, dict] = {}
    for p in plans:
        for rnd in p.rounds:
            for stage in (Stage.EXTERNAL, Stage.INTERNAL):
                writes = [w for w in rnd.writes if w.stage is stage]
                if not writes:
                    continue
                arrived = incoming.get((p.worker, rnd.index), [])
                per_write = []
                for w in writes:
                    lo, hi = w.offset, w.offset + w.nbytes
                    deps = frozenset((src, s) for a, b, src, s in arrived if a < hi and lo < b)
                    if not deps or any(STAGES.index(s) >= STAGES.index(stage) for _, s in deps):
                        raise ValueError(
                            f"{p.worker} forwards arena bytes [{lo}, {hi}) of round "
                            f"{rnd.index} in the {stage.value} stage that no earlier stage "
                            f"brought in; the plan is not a three-stage WeightBridge plan")
                    per_write.append(deps)
                out.setdefault(p.worker, {})[(rnd.index, stage)] = tuple(per_write)
    return out


def describe(worker: WorkerId) -> str:
    return f"{worker.side} {worker.index}"


class Inbox:
    """The notifications one worker has received, by update; waits on them with a deadline.

    Filled on the actor's event loop (``landed``, ``freed``, ``abort``), waited on by the round
    loop in another thread.
    """

    def __init__(self, me: WorkerId):
        self.me = me
        self._cv = threading.Condition()
        self._landed: dict[tuple[int, int, Stage], set[WorkerId]] = {}
        self._freed: dict[tuple[int, int], set[WorkerId]] = {}
        self._aborted: dict[int, str] = {}
        self._current = -1

    def start(self, update: int) -> None:
        """Forget everything of earlier updates (notifications of ``update`` may be here)."""
        with self._cv:
            self._current = update
            for store in (self._landed, self._freed, self._aborted):
                for key in [k for k in store if (k if isinstance(k, int) else k[0]) < update]:
                    del store[key]

    def landed(self, update: int, r: int, stage: Stage, writer: WorkerId) -> None:
        self._add(self._landed, (update, r, stage), writer)

    def freed(self, update: int, r: int, reader: WorkerId) -> None:
        self._add(self._freed, (update, r), reader)

    def abort(self, update: int, reason: str) -> None:
        with self._cv:
            if update >= self._current:
                self._aborted.setdefault(update, reason)
                self._cv.notify_all()

    def _add(self, store: dict, key: tuple, who: WorkerId) -> None:
        with self._cv:
            if key[0] >= self._current:  # a straggler of an earlier update is dropped
                store.setdefault(key, set()).add(who)
                self._cv.notify_all()

    def wait_landed(self, update: int, r: int, stage: Stage, writers: Iterable[WorkerId],
                    timeout_s: float) -> None:
        """Block until every writer reported (round r, stage) landed here."""
        self._wait(self._landed, (update, r, stage), frozenset(writers), timeout_s,
                   lambda missing: f"the {stage.value} writes of round {r} from {missing}")

    def wait_freed(self, update: int, r: int, readers: Iterable[WorkerId],
                   timeout_s: float) -> None:
        """Block until every reader reported round r done (its arena r % 2 is free again)."""
        self._wait(self._freed, (update, r), frozenset(readers), timeout_s,
                   lambda missing: f"{missing} to finish round {r} (free that round's arena)")

    def wait_ready(self, update: int, r: int, needs: Mapping[int, frozenset],
                   timeout_s: float) -> set[int]:
        """Block until at least one of ``needs`` (id -> {(writer, stage)}) has all its
        (round r) writes landed here; returns the ids of all that have."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while True:
                self._check_aborted(update)
                ready = {i for i, deps in needs.items()
                         if all(w in self._landed.get((update, r, s), ()) for w, s in deps)}
                if ready:
                    return ready
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted({(s.value, describe(w)) for deps in needs.values()
                                      for w, s in deps
                                      if w not in self._landed.get((update, r, s), ())})
                    raise StepTimeout(
                        f"{describe(self.me)} waited {timeout_s:g}s in update {update} for "
                        f"the writes of round {r} it forwards ({missing}); those workers died, "
                        f"failed or stalled (see their own errors), or their links are slower "
                        f"than the timeout allows (raise MeshTransfer(timeout_s=...))")
                self._cv.wait(left)

    def _check_aborted(self, update: int) -> None:
        if update in self._aborted:
            raise UpdateAborted(f"{describe(self.me)} stopped: update {update} was "
                                f"aborted: {self._aborted[update]}")

    def _wait(self, store: dict, key: tuple, want: frozenset, timeout_s: float, what) -> None:
        if not want:
            return
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while True:
                self._check_aborted(key[0])
                missing = want - store.get(key, set())
                if not missing:
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    names = ", ".join(describe(w) for w in sorted(missing,
                                                                  key=lambda w: (w.side, w.index)))
                    raise StepTimeout(
                        f"{describe(self.me)} waited {timeout_s:g}s in update {key[0]} for "
                        f"{what(names)}; that worker died, failed or stalled (see its own "
                        f"error), or its link is slower than the timeout allows (raise "
                        f"MeshTransfer(timeout_s=...))")
                self._cv.wait(left)


class Notifier:
    """Sends one worker's notifications: endpoint calls on single-actor slices of the two actor
    meshes, made once. Messages from one sender to one actor arrive in order."""

    def __init__(self, me: WorkerId, trainers, rollouts, peers: Iterable[WorkerId]):
        self.me = me
        self._meshes = {"trainer": trainers, "rollout": rollouts}
        self._refs = {w: self._meshes[w.side].slice(worker=w.index) for w in peers}

    def landed(self, peer: WorkerId, update: int, r: int, stage: Stage):
        """Returns the call's future (a trainer waits for it before its next writes)."""
        return self._refs[peer].landed.call_one(update, r, stage, self.me)

    def freed(self, peer: WorkerId, update: int, r: int) -> None:
        self._refs[peer].freed.broadcast(update, r, self.me)

    def abort_all(self, update: int, reason: str) -> None:
        """Tell every worker of both meshes to stop waiting (best effort: a peer that misses
        it still stops at its own timeout)."""
        for mesh in self._meshes.values():
            try:
                mesh.abort.broadcast(update, reason)
            except Exception:  # noqa: BLE001 - the original failure is what gets reported
                pass

