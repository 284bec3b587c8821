"""`GroupLeader`: the one owner of a connected group's state, where the group is sequenced.

A group's state is what connect found and what changed since: the source maps, the plan in
force and its generation, the engines and trainers that are out, the receivers' staging-slot
ledger (receiver staging), the tensors a delta plan moves and the delta log. Every change of
it goes through one of the leader's operations, so the policies exist once::

    connect()             probe every worker, plan, set everyone up       generation 0
    replan()              plan again from the kept maps (no probe)        generation + 1
    restrict(tensors)     a delta plan of ``tensors`` (None: all)         replan() if it differs
    exclude(engines, trainers, why)
                          out for good; every worker of an excluded engine is told why
                          (its next poll raises `TransferFailed`)
    join()                probe the engines added since, extend the plan (or, under a delta
                          plan, plan everything again); a join that fails excludes them
    forget(engines)       undo that exclusion (the controller takes them off the control
                          plane again: a failed join rolled back)
    leave(engine)         exclude it; drop its rows, or replan()

Why the generation strictly increases: it numbers the receivers' staging slots
(``2 * generation`` and the next). A re-plan sets every receiver up again, and a slot number
made anew would hold uninitialized memory where the ledger still records a landed version;
new numbers keep the old slots (and the versions landed in them) intact until an install
from a newer slot retires them (`StagingSlots.replanned`).

The leader runs on the adapters' rank-0 sender (`SenderAdapter.leader`); its callers hold
the sender's session lock around every operation but the ledger's, which engines call while
a transfer runs (`claim`) and which has a lock of its own.

Typical usage::

    leader = GroupLeader(control, config)
    leader.connect()
    run_update(control, leader.group, slots=leader.begin_landing(v)); leader.landed(v)
"""

from __future__ import annotations

import contextvars
import threading
from typing import Collection

from weightbridge.config import TransferConfig
from weightbridge.coordination.control import (ControlPlane, PeerCall, WorkerId, engine_workers,
                                               rollouts, trainers)
from weightbridge.coordination.delta import DeltaLog
from weightbridge.coordination.elastic import check_removable, join_group, leave_group
from weightbridge.coordination.slots import StagingSlots
from weightbridge.coordination.session import (ConnectedGroup, GroupMaps, connect_group,
                                               plan_group, unjoined)
from weightbridge.errors import LayoutError


class GroupLeader:
    """The state of one connected group and the operations that change it (module doc)."""

    def __init__(self, control: ControlPlane, config: TransferConfig):
        self.control, self.config = control, config
        self.maps: GroupMaps | None = None
        """What probing found (kept: a re-plan does not probe again)."""
        self.group: ConnectedGroup | None = None
        """The plan in force and what the sequencer needs of it."""
        self.generation = 0
        """Numbers the plans put in force since connect; strictly increasing."""
        self.out_engines: set[int] = set()
        """Engines out of the group (lost, removed, or refused at a join)."""
        self.out_trainers: set[int] = set()
        """Trainers lost: their data-parallel replicas send what they held."""
        self.out_why: dict[int, str] = {}
        """Engine out -> why (what its workers are told, again when one asks later)."""
        self.tensors: frozenset[str] | None = None
        """The checkpoint tensors the plan in force moves (None: all; a delta plan: some)."""
        self.slots: StagingSlots | None = None
        """The receivers' staging slots (receiver staging): what landed where."""
        self.delta_log: DeltaLog | None = None
        """Per tensor, the version it last changed in (delta updates)."""
        self.claims: dict[int, int] = {}
        """Engine -> the newest version it claimed (kept across re-plans; delta bases)."""
        self.joined_at: int | None = None
        """The newest finished version when engines last joined (they hold nothing older)."""
        self.asked_out: dict[int, str] = {}
        """Engine -> why it went out by itself (a worker of it said so, `ask_out`), until
        it is excluded (the sequencer does it before its next transfer)."""
        self.untold: dict[WorkerId, str] = {}
        """Workers of excluded engines that did not answer when told why (`retell`)."""
        self._unplanned = False
        """A re-plan did not finish: workers may hold different plans; plan again."""
        self.reroute = None
        """Applied to every plan before it is handed out (set at connect; the P2P ablation)."""
        self.catch_up_from = 0
        """The first round the engines of the last `join` take part in (0: every round, a
        mirrored join; later: the rounds appended for them alone)."""
        self._ledger = threading.Lock()
        self._retelling = False
        self._tensors_of: tuple = (None, {})
        """(the maps it was built from, trainer -> parameter -> tensors): `tensors_of`."""

    @property
    def plan(self):
        return None if self.group is None else self.group.plan

    # -- who is in ------------------------------------------------------------------------------

    def live_engines(self) -> list[int]:
        """The engines in the group and not out. In the group: probed at connect or at a
        join; an engine the control plane has beyond them (added, `join` not run or failed)
        is neither offered a version nor waited for."""
        joined = (self.control.num_engines if self.maps is None
                  else len(self.maps.rollouts) // self.control.engine_size)
        return [e for e in range(joined) if e not in self.out_engines]

    def live_rollouts(self) -> list[WorkerId]:
        """Every rollout worker of a live engine."""
        return [w for e in self.live_engines() for w in engine_workers(self.control, e)]

    def live_trainers(self) -> list[WorkerId]:
        """Every trainer not out (trainer 0 first)."""
        return [t for t in trainers(self.control) if t.index not in self.out_trainers]

    def live_rank0s(self) -> list[WorkerId]:
        """The rank-0 receiver of every live engine."""
        return [engine_workers(self.control, e)[0] for e in self.live_engines()]

    def _excluded_rollouts(self) -> frozenset[int]:
        size = self.control.engine_size
        return frozenset(w.index for w in rollouts(self.control)
                         if w.index // size in self.out_engines)

    # -- the plan ------------------------------------------------------------------------------

    def connect(self, reroute=None) -> None:
        """Probe every worker, plan, set everyone up (`session.connect_group`)."""
        self.reroute = reroute
        self.maps, self.group = connect_group(self.control, self.config, reroute=reroute)
        with self._ledger:
            self.slots = StagingSlots(self.control.num_engines)

    def replan(self) -> None:
        """Plan again from the kept maps, without the engines and trainers that are out and
        restricted to `tensors`; set every live worker up on it, under a new generation."""
        self.generation += 1
        with self._ledger:
            self.slots.replanned(first_slot=2 * self.generation)
        self._unplanned = True  # until every worker holds the new plan
        self.group = plan_group(self.control, self.maps, self.config,
                                excluded=self._excluded_rollouts(),
                                excluded_trainers=frozenset(self.out_trainers),
                                generation=self.generation, tensors=self.tensors,
                                reroute=self.reroute, replan=True)
        self._unplanned = False

    def restrict(self, tensors: frozenset[str] | None) -> bool:
        """Put in force a plan of ``tensors`` (None: every tensor); True if it re-planned. A
        re-plan that failed part-way is done again even for the same set."""
        if tensors == self.tensors and not self._unplanned:
            return False
        self.tensors = tensors
        self.replan()
        return True

    # -- membership -----------------------------------------------------------------------------

    def exclude(self, engines: Collection[int] = (), trainers_: Collection[int] = (), *,
                why: str | None = None, unreachable: Collection[WorkerId] = ()) -> None:
        """Put ``engines`` and trainers ``trainers_`` out for good; tell every worker of the
        excluded engines ``why`` (their polls raise `TransferFailed` with it), except the
        ``unreachable`` ones (dead or stalled: asking them would only wait). One of those
        that comes back is told when it next asks trainer 0 anything (`why_out`)."""
        with self._ledger:  # (a claim is answered either before this or not at all)
            self.out_engines.update(engines)
            for e in engines:
                self.asked_out.pop(e, None)
        self.out_trainers.update(trainers_)
        for e in engines:
            self.out_why.setdefault(e, why or f"engine {e} is out of this transfer group")
        if why is not None and engines:
            skip = set(unreachable)
            told = [w for e in sorted(engines) for w in engine_workers(self.control, e)
                    if w not in skip]
            answers = self.control.call(told, PeerCall.FAIL, why, return_errors=True)
            with self._ledger:
                self.untold.update({w: why for w, a in zip(told, answers) if a is not None})
                self.untold.update({w: why for e in engines
                                    for w in engine_workers(self.control, e) if w in skip})

    def retell(self) -> None:
        """Tell the `untold` workers again why their engine is out, on a thread of its own
        (a dead one would hold the caller up to the plane's timeout): a worker that stalled
        and came back learns it, and its next poll raises. Called before each transfer."""
        with self._ledger:
            if not self.untold or self._retelling:
                return
            self._retelling, who = True, dict(self.untold)
        # In a copy of this context: an actor's messaging context lives in contextvars.
        ctx = contextvars.copy_context()
        threading.Thread(target=ctx.run, args=(self._retell, who), daemon=True,
                         name="weightbridge-retell").start()

    def _retell(self, who: dict[WorkerId, str]) -> None:
        try:
            workers = list(who)
            answers = self.control.call_each(workers, PeerCall.FAIL,
                                             [(who[w],) for w in workers], return_errors=True)
            with self._ledger:
                for w, a in zip(workers, answers):
                    if a is None:
                        self.untold.pop(w, None)
        finally:
            with self._ledger:
                self._retelling = False

    def join(self, *, rolled_back: bool = False) -> range:
        """Plan in the engines the control plane has beyond the maps (probing only them);
        returns their engine numbers. Under a delta plan every worker is planned again for
        every tensor (a joining engine needs them all).

        Raises:
            ValueError, LayoutError: as `elastic.join_group`; the joining engines are out
                (told why) and the group goes on as before. Anything else: they are out
                and the group is re-planned (their set-up may have begun). Either way,
                unless ``rolled_back`` (the caller takes them off the control plane again
                and `forget`s them: the controller), their places stay taken (`unjoined`):
                they stay on the control plane, out for good, and a later join's engines
                come after them instead of probing them again.
        """
        size = self.control.engine_size
        joining = range(len(self.maps.rollouts) // size, self.control.num_engines)
        restricted = self.tensors is not None
        if restricted:  # every live worker is set up again, under a new generation
            self.generation += 1
            with self._ledger:
                self.slots.replanned(first_slot=2 * self.generation)
            self._unplanned = True
        try:
            maps, group, start = join_group(
                self.control, self.maps, self.group, self.config, generation=self.generation,
                restricted=restricted, excluded=self._excluded_rollouts(),
                excluded_trainers=frozenset(self.out_trainers))
        except Exception as e:
            self.exclude(joining, why=f"engines {list(joining)} could not join this transfer "
                                      f"group ({type(e).__name__}: {e})")
            if not rolled_back and joining:
                self.maps = unjoined(self.maps, len(joining) * size, size)
                self.replan()  # (the plan in force then counts their places too)
            elif not isinstance(e, (LayoutError, ValueError)):  # set-up may have begun
                self.replan()
            raise
        self.maps, self.group, self.tensors, self._unplanned = maps, group, None, False
        self.catch_up_from = start
        with self._ledger:
            self.slots.grow(self.control.num_engines)
        return joining

    def forget(self, engines: Collection[int]) -> None:
        """Undo a failed `join`'s exclusion of ``engines`` when the caller takes them off the
        control plane again (the controller rolls a failed join back: a later join gets
        their numbers and ranks, and must not find them out)."""
        size = self.control.engine_size
        with self._ledger:
            self.out_engines.difference_update(engines)
            for e in engines:
                self.asked_out.pop(e, None)
            for w in [w for w in self.untold if w.side == "rollout" and w.index // size
                      in engines]:
                del self.untold[w]
        for e in engines:
            self.out_why.pop(e, None)

    def ask_out(self, engine: int, why: str) -> None:
        """A worker of ``engine`` says its engine can run no more steps (a rank it could not
        reach): recorded for the sequencer, which excludes it (and re-plans) before its
        next transfer (`recovery.exclude_lost`)."""
        with self._ledger:
            if engine in self.live_engines():
                self.asked_out.setdefault(engine, why)

    def why_out(self, engine: int) -> str | None:
        """Why ``engine`` is out (None: it is not)."""
        return self.out_why.get(engine) if engine in self.out_engines else None

    def leave(self, engine: int) -> None:
        """Take ``engine`` out (told why): drop its rows when nothing depends on it, else
        re-plan the others.

        Raises:
            ValueError: no such engine, it is out already, or it is the last one.
        """
        check_removable(engine, self.control.num_engines, self.out_engines)
        self.exclude([engine], why=f"engine {engine} was removed from this transfer group "
                                   f"(remove_engine({engine})): nothing more is sent to it; to "
                                   f"use it again, restart its workers and add them with "
                                   f"add_engines()")
        shrunk = leave_group(self.control, self.group, self.config,
                             engine_workers(self.control, engine))
        if shrunk is None:  # others depend on it: plan again
            self.replan()
        else:
            self.group = shrunk

    # -- delta updates --------------------------------------------------------------------------

    def record_delta(self, version: int, prevs: list[int], changed: frozenset[str] | None
                     ) -> None:
        """The trainers agreed that ``changed`` (None: everything) changed in ``version``
        since their previous versions ``prevs`` (`DeltaLog.record`; the log is made at the
        first record, over every tensor some worker reads)."""
        if self.delta_log is None:
            self.delta_log = DeltaLog(p.region.tensor for m, _ in
                                      self.maps.trainers + self.maps.rollouts for p in m.pieces)
        self.delta_log.record(version, prevs, changed)

    def tensors_of(self, trainer: int) -> dict[str, frozenset[str]]:
        """Per parameter of ``trainer``, the checkpoint tensors it loads (its source map;
        built once per maps: ``changed="auto"`` asks at every update)."""
        if self._tensors_of[0] is not self.maps:
            self._tensors_of = (self.maps, {})
        by_trainer = self._tensors_of[1]
        if trainer not in by_trainer:
            by_param: dict[str, set[str]] = {}
            for p in self.maps.trainers[trainer][0].pieces:
                by_param.setdefault(p.param, set()).add(p.region.tensor)
            by_trainer[trainer] = {n: frozenset(s) for n, s in by_param.items()}
        return by_trainer[trainer]

    # -- the staging-slot ledger (receiver staging) ---------------------------------------------

    def begin_landing(self, version: int) -> dict[int, int]:
        """Live engine -> the slot ``version`` lands in (`StagingSlots.begin`)."""
        with self._ledger:
            return self.slots.begin(version, set(self.live_engines()))

    def landed(self, version: int) -> None:
        with self._ledger:
            self.slots.complete(version)

    def claim(self, engine: int) -> tuple[int, int] | None:
        """An engine's rank 0 pins the newest version landed for it: (version, slot)."""
        with self._ledger:  # a slot being filled holds no landed version: never claimed
            if engine not in self.live_engines():  # (out, or not joined: nothing lands there)
                return None
            return self.slots.claim(engine)

    def claimed(self) -> dict[int, int]:
        """Live engine -> the newest version it claimed so far (0: none): its parameters
        hold it, or will before they install anything newer."""
        with self._ledger:
            for e in self.live_engines():
                self.claims[e] = max(self.claims.get(e, 0), self.slots.claimed(e) or 0)
        return {e: self.claims.get(e, 0) for e in self.live_engines()}
