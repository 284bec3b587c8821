"""Who is in a controller-driven group: engines joining and leaving, recovery from losses.

Mixed into `controller.driver.MeshTransfer`; every change of the group goes through its
`GroupLeader` (``self.leader``: `join`, `leave`, `exclude`, `replan`), the one owner of the
group's state on every path. An engine joins with `add_engine`: only it is probed, the plan in
force is extended for it (`weightbridge.planning.extend`: a replica is mirrored on a live
engine, the trainers untouched; the other engines keep their buffers and registered ranges),
and it receives the version the others hold before `add_engine` returns. An engine is out when
it was lost mid-update (`WorkersLost`) or taken out with `remove_engine` (which just drops a
mirrored engine's rows); a trainer when it was lost (its replicas then send its regions).
Otherwise leaving and recovery re-plan the whole group from the kept source maps, without
probing, as `replan` does (one balanced plan over every live engine); the plan in force only
ever routes bytes between live workers.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time

from controller.report import JoinReport
# The package first: `from weightbridge import` waits for its __init__ when another thread of
# an actor process is running it; importing a submodule first would not, and a half-built
# package then fails the other thread's imports.
from weightbridge import (CatchUpRefused, GroupClosed, TransferFailed, TransferPlan,
                          WeightBridgeError)
from weightbridge.driver import PeerCall, describe, library_error, lose, one_line, surfaced

RESTART = "close this MeshTransfer and start again"
log = logging.getLogger(__name__)


def serialized(method):
    """One public call of a `MeshTransfer` at a time (its ``calls`` lock, reentrant): a
    membership change or a poll from another thread waits for the update running, as the
    adapters' session lock makes it, instead of re-planning under its rounds. After `close`
    every call raises `GroupClosed`; a call that `close` (from another thread) ended raises
    it too. Whatever else escapes is raised as the library's own error (`documented`)."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        name = method.__name__
        with self.calls:
            if self.closed:
                raise GroupClosed(f"{name}() on a MeshTransfer that was closed: this "
                                  f"MeshTransfer was closed (close(), or the end of its with "
                                  f"block) and its actors are stopped; build a new MeshTransfer "
                                  f"to go on")
            try:
                return method(self, *args, **kwargs)
            except BaseException as e:  # noqa: BLE001  (raised again, as the library's)
                error = documented(e, name, self.closed)
                if error is e:
                    raise
                raise error from e
    return run


def documented(error: BaseException, call: str, closed: bool) -> BaseException:
    """What a public call of a `MeshTransfer` raises for ``error``: `GroupClosed` when the
    object was ``closed`` while the call ran (Monarch's ``CancelledError``, a stopped actor),
    the library's error inside a Monarch wrapper (`library_error`), a ``ValueError`` or a
    `WeightBridgeError` as it is; anything else (a plain ``TimeoutError``, a dead process's
    ``SupervisionError``, an ``AssertionError``) as a `TransferFailed` naming it. A
    ``KeyboardInterrupt`` or ``SystemExit`` stays what it is, and so does the plain
    ``RuntimeError`` of a call made before `connect`."""
    if isinstance(error, (KeyboardInterrupt, SystemExit, GeneratorExit)):
        return error
    if closed and not isinstance(error, GroupClosed):
        return GroupClosed(f"{call}() was ended by close() (from another thread): this "
                           f"MeshTransfer was closed while it ran ({describe(error)}) and its "
                           f"actors are stopped; build a new MeshTransfer to go on")
    inner = library_error(error)
    if isinstance(inner, (WeightBridgeError, ValueError)) or type(inner) is RuntimeError:
        return inner
    return TransferFailed(f"{call}() failed: {describe(inner)}; what the rollouts hold is not "
                          f"known: close this MeshTransfer and start again (if a process died, "
                          f"see why first)")


class Membership:
    """`add_engine`, `remove_engine`, `replan`, the recovery after a loss, and the live ranks
    of each side."""

    @surfaced()  # (a worker's library error reaches the caller as itself)
    @serialized
    def add_engine(self, procs=None) -> JoinReport:
        """Add a rollout engine to the running group, between updates, without a new group.

        Spawns its procs on this host (or uses ``procs``: one engine's worth, e.g. on hosts
        attached later), its actors and the transfer agents; probes only its workers; extends
        the plan in force (`weightbridge.planning.extend`: a replica of a live engine is
        mirrored on it, the trainers untouched and the rollouts that land segments forwarding
        one more copy; another layout gets rounds of its own appended); sets up only it and
        the workers whose part changed; then moves the version the other engines hold into
        it and verifies it, so it holds a whole version before this returns (a mirrored join
        re-sends that version to every engine: their bytes do not change). Its engine number
        is the next one; later updates include it.

        Raises:
            ValueError: ``procs`` of another size than an engine.
            CatchUpRefused: without sender staging, the trainers' parameters no longer hold
                the version the engines hold (a train step ran since it was sent); before
                anything spawns.
            LayoutError: the engine loads another checkpoint or needs what no trainer holds
                (before any of its buffers exist).
            TransferFailed: setting the engine up failed (its process died, say: the join
                is rolled back, its engine number is the next join's), the catch-up transfer
                failed (the engine is taken out again) or did not verify.
        """
        if self.plan is None:
            raise RuntimeError("call connect() before add_engine()")
        spec = self.rollout_spec
        size, first, engine = spec.workers_per_engine, spec.num_workers, spec.engines
        if procs is not None and int(procs.size()) != size:
            raise ValueError(f"add_engine got {int(procs.size())} procs; an engine of this "
                             f"group has {size} workers (nodes x gpus of the rollout spec)")
        self._between_updates()  # every live engine holds the newest version sent
        self._check_catch_up_source(engine)
        t0 = time.perf_counter()
        before, old = self.plan.num_rounds, self.group
        grown = dataclasses.replace(spec, engines=engine + 1)
        joining = [procs, None, None]  # (procs, actors, grown group): what to roll back
        try:
            joining[:2] = self.meshes.spawn_engine(procs, grown, first)
            joining[2] = group = self.group.add_engines(joining[0])
            joining[1].attach.call(group).get()
            self.group, self.rollout_spec = group, grown
            self.control.use(group)
            t1 = time.perf_counter()
            self.leader.join(rolled_back=True)  # (a failure is rolled back here)
            self._use()
        except Exception as e:  # noqa: BLE001  (rolled back, then raised as what it is)
            undone = self._roll_back_join(engine, spec, old, *joining)
            if isinstance(e, ValueError):  # (a LayoutError too: it does not fit)
                e.add_note(undone)
                raise
            raise TransferFailed(
                f"engine {engine} could not join: setting it up failed ({describe(e)}); "
                f"{undone}: find why (a process that died, say), then add_engine() again"
            ) from e
        actors = joining[1]
        start = self.leader.catch_up_from
        t2 = time.perf_counter()
        count, bad, moved = 0, (), 0
        holds = self.book.holds
        if holds is not None:
            # Appended rounds carry the joining engine alone; a mirrored one is fed by the
            # other engines' forwards, so the whole update runs again (start 0): the bytes
            # they hold already.
            try:
                if self.mode.sends_staged_copy and not self._staged_copy_kept():
                    # (checked above: the trainers' parameters hold it)
                    self.control.call(self.leader.live_trainers(), PeerCall.STAGE,
                                      self.book.held_version)
                    self.staged_generation = self.leader.generation
                self._transfer(self.book.held_version, first_round=start)
            except Exception as e:  # noqa: BLE001  (the others' bytes are their version's)
                left = self._leave_out(engine)
                raise TransferFailed(f"engine {engine} joined the plan but moving the current "
                                     f"weights into it failed ({type(e).__name__}: {e}); {left}"
                                     f"; the other engines hold their version (the catch-up "
                                     f"writes them the same bytes): restart its workers and "
                                     f"add_engine() again") from e
            t = self.plan.tables
            moved = int(t.real_bytes[t.round >= start].sum())
            count, bad = self._verify([(first, actors)], holds)
            for _, mesh in self._live("trainer") + self._live("rollout"):
                mesh.timings.call().get()  # the catch-up's spans are not the next update's
        t3 = time.perf_counter() if holds is not None else t2  # (0: nothing to catch up)
        report = JoinReport(engine=engine, spawn_s=t1 - t0, plan_s=t2 - t1, catch_up_s=t3 - t2,
                            rdma_bytes=moved, num_params=count, mismatched=bad,
                            num_rounds=(before, self.plan.num_rounds))
        if bad:
            raise TransferFailed(f"{report.line()}: {list(bad[:4])}")
        return report

    def _roll_back_join(self, engine: int, spec, group, procs, actors, grown) -> str:
        """A join whose set-up failed (a joiner killed while its actors were built, probed
        or set up): take it off the control plane, the leader's books and the meshes again,
        as before `add_engine` (its engine number is the next join's); says how that went.
        ``procs``, ``actors``, ``grown``: what was spawned for it so far (None: not yet)."""
        self.leader.forget([engine])
        self.group, self.rollout_spec = group, spec
        self.control.use(group)
        self._use()  # (a failed join's re-plan over the others may have put a plan in force)
        errors = [] if grown is None else group.undo_add_engines(grown)
        if actors is not None:
            errors += self.meshes.drop_engine(actors, procs)
        how = (f" (stopping its actors failed: {describe(errors[0])}; look for leftover "
               f"bootstrap_main processes with ps)" if errors else "")
        return (f"the join was rolled back{how}: the other engines keep their version and "
                f"plan, the next update() goes to them")

    def _leave_out(self, engine: int) -> str:
        """A join whose catch-up failed: take the engine out again (told why; its rows
        dropped, or the others planned again), so later updates do not run into it; says
        how that went."""
        try:
            self.leader.leave(engine)
            self._use()
        except Exception as e:  # noqa: BLE001  (said in the caller's error)
            return (f"taking it out of the group again failed too ({type(e).__name__}: {e}): "
                    f"remove_engine({engine})")
        return "it is out of the group again"

    def _staged_copy_kept(self) -> bool:
        """Sender staging, no re-plan since the trainers' staged copies were taken (a re-plan
        drops them: they were laid out for the old plan), and no delta plan in force (a
        join then plans everything again, and the copies hold only the delta's tensors)."""
        return (self.mode.sends_staged_copy and self.staged_generation == self.leader.generation
                and self.leader.tensors is None)

    def _check_catch_up_source(self, engine: int) -> None:
        """Without a staged copy (no sender staging, or a re-plan dropped it) the catch-up
        sends the trainers' parameters to every engine (a mirrored join runs the whole update
        again): they must still hold the version the engines hold, checked against the
        trainers' own load_weights of it.

        Raises:
            CatchUpRefused: a train step ran since (before anything spawns or moves).
        """
        holds = self.book.holds
        if holds is None or self._staged_copy_kept():  # (the staged copy is sent)
            return
        _, bad = self._verify(self._live("trainer"), holds, side="trainer")
        if bad:
            version = self.book.held_version
            raise CatchUpRefused(
                f"add_engine() for engine {engine} refused: the trainers' parameters no longer "
                f"hold version {version}, the version the engines hold ({len(bad)} parameters "
                f"differ, e.g. {list(bad[:3])}): a train step ran since update({version}). "
                f"Without a staged copy the catch-up re-sends the trainers' parameters to "
                f"every engine, so it would write those bytes into the engines under version "
                f"{version}. Nothing was spawned or sent: call add_engine() after update() "
                f"(and poll_requests()) and before the next train step, or use sender staging "
                f"(ss, async modes), whose catch-up sends the staged copy (while no "
                f"remove_engine() or replan() dropped it since)")

    def _between_updates(self) -> None:
        """Before a membership change: the transfer streaming ended and (receiver staging)
        the newest version landed is installed, so every live engine holds the newest
        version sent, the one the trainers' parameters hold."""
        self._streaming.join(self._deadline())
        if self.mode.lands_in_staging:
            self.poll_requests()

    @surfaced()  # (a worker's library error reaches the caller as itself)
    @serialized
    def replan(self) -> TransferPlan:
        """Plan the whole group again from the source maps of connect and joins (no probe):
        one non-redundant plan over every live engine, where joins had appended theirs. Every
        live worker is set up again. Returns the new plan."""
        self._connected("replan")
        self._between_updates()
        self.leader.replan()
        self._use()
        return self.plan

    @surfaced()  # (a worker's library error reaches the caller as itself)
    @serialized
    def remove_engine(self, engine: int) -> TransferPlan:
        """Take rollout engine ``engine`` out of the group between updates (to restart or
        retire it); no byte is sent to or through it afterwards. An engine nothing depends on
        (one mirrored in by `add_engine`) just loses its rows: only the rollouts that
        forwarded to it take new writes. Otherwise the others are planned again from the
        source maps of connect (no probe). Returns the plan in force.

        An engine `add_engine` added is retired with it: its transfer agents and actors are
        stopped, and its procs if `add_engine` spawned them, so a long-lived group that adds
        and removes engines does not keep their processes and memory. An engine of the first
        rollout mesh shares its procs with the others: they run until `close`.

        Raises:
            ValueError: no such engine, it is already out, or it is the last one.
        """
        self._connected("remove_engine")
        self._between_updates()
        self.leader.leave(engine)
        self._use()
        first = engine * self.rollout_spec.workers_per_engine
        if first in self.meshes.joined:
            self.group, errors = self.group.retire_engine(engine)
            self.control.use(self.group)
            errors += self.meshes.retire_engine(first)
            for error in errors:  # (the engine is out either way; only its processes linger)
                log.warning("remove_engine(%d): stopping its agents or procs failed (%s); look "
                            "for leftover bootstrap_main processes with ps", engine,
                            describe(error))
        return self.plan

    def _recover(self, version: int, lost: list, cause: str, train_step_s: float) -> None:
        """Leave the ``lost`` workers out (`weightbridge.coordination.loss.lose`: their
        engines and the lost trainers excluded, the others planned again from the source maps
        of connect, a lost trainer's regions from its replicas) and raise `WorkersLost` at
        once, within timeout_s of the loss. Where the trainers' parameters still hold
        ``version`` (`Mode.resends_after_loss`) it is re-sent afterwards, on the streaming
        thread (`_resend`): `wait` returns its report, and every later call waits for it
        first. If no engine is left or the re-plan fails (no trainer holds what a lost
        trainer held), raise `TransferFailed`."""
        loss = lose(self.leader, [w.index for w in lost if w.side == "rollout"],
                    [w.index for w in lost if w.side == "trainer"],
                    during=f"the transfer of version {version}", cause=one_line(cause),
                    rejoin="add_engine()", restart=RESTART)
        self._use()
        for _, mesh in self._live("trainer") + self._live("rollout"):
            mesh.timings.call().get()  # drop the failed attempt's spans
        survivors = list(loss.survivors)
        if not loss.resend:
            if not self.mode.lands_in_staging:
                with self._book_lock:
                    self.book.torn()  # (survivors' parameters may hold part of it)
            state = ("they keep the version they hold; the next update() goes to them"
                     if self.mode.lands_in_staging else
                     "their parameters may hold part of it: run no generation step on them "
                     "until the next update() reached them (it carries every tensor)")
            raise loss.lost(f"Version {version} was not re-sent to the surviving engines "
                            f"{survivors} (the staged copy was laid out for the old plan): "
                            f"{state}.")
        # The trainers' parameters still hold it: re-sent after this raise (every later call
        # joins it first; update() before its train step, which would change what it reads).
        self._streaming.start(self._resend, version, train_step_s, loss.what, survivors)
        where = ("hold it whole" if not self.mode.lands_in_staging else
                 "have it in staging (the next poll_requests() installs it)")
        raise loss.lost(f"Version {version} is being re-sent over a new plan to the surviving "
                        f"engines {survivors}, which then {where}: wait() returns its verified "
                        f"report; every later call waits for it first (run no train step of "
                        f"your own on the trainers before wait() returned); the next update() "
                        f"goes to them.")

    def _resend(self, version: int, train_step_s: float, what: str, survivors: list[int]):
        """`_recover`'s re-send of ``version`` over the new plan, on the streaming thread;
        its report, verified (RS: landed in staging, verified at its install).

        Raises:
            TransferFailed: the re-send failed or did not verify."""
        t1 = time.perf_counter()
        try:
            self._move(version)
            report = self._report(version, train_step_s, t1)
        except Exception as e:  # noqa: BLE001  (a second failure: give up, say both)
            raise TransferFailed(f"{what}; re-sending version {version} to the surviving "
                                 f"engines {survivors} failed too ({describe(e)}): close this "
                                 f"MeshTransfer and start again") from e
        if report.mismatched:
            raise TransferFailed(f"{what}; version {version} re-sent to the surviving engines "
                                 f"{survivors} did not verify ({report.line()}: "
                                 f"{list(report.mismatched[:4])}): did a train step run before "
                                 f"wait() returned? call update() with the next version")
        return report


class Lost(Exception):
    """Internal: workers stopped answering during an update (`_recover` handles it)."""

    def __init__(self, workers: list, cause: str):
        super().__init__(cause)
        self.workers, self.cause = workers, cause
