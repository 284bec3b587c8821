"""Who is in a controller-driven group: engines joining and leaving, recovery from losses.

A part of `controller.driver.MeshTransfer` (its ``membership``); every change of the group goes
through its `GroupLeader` (``mt.leader``: `join`, `leave`, `exclude`, `replan`), the one owner
of the group's state on every path. An engine joins with `add_engine`: only it is probed, the
plan in force is extended for it (`weightbridge.planning.extend`: a replica is mirrored on a
live engine, the trainers untouched; the other engines keep their buffers and registered
ranges), and it receives the version the others hold before `add_engine` returns. An engine is
out when it was lost mid-update (`WorkersLost`) or taken out with `remove_engine` (which just
drops a mirrored engine's rows); a trainer when it was lost (its replicas then send its
regions). Otherwise leaving and recovery re-plan the whole group from the kept source maps,
without probing, as `replan` does (one balanced plan over every live engine); the plan in force
only ever routes bytes between live workers.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from controller.report import JoinReport
# The package first: `from weightbridge import` waits for its __init__ when another thread of
# an actor process is running it; importing a submodule first would not, and a half-built
# package then fails the other thread's imports.
from weightbridge import CatchUpRefused, TransferFailed, TransferPlan
from weightbridge.driver import PeerCall, describe, lose, one_line

RESTART = "close this MeshTransfer and start again"
log = logging.getLogger(__name__)


class Membership:
    """`add_engine`, `remove_engine`, `replan` and the recovery after a loss of one
    `MeshTransfer` (``mt``, which calls them under its public calls' lock): they change its
    group, rollout spec and meshes, and ask its leader, books and transfers."""

    def __init__(self, mt):
        self.mt = mt

    def add_engine(self, procs=None) -> JoinReport:
        """`MeshTransfer.add_engine`."""
        if self.mt.plan is None:
            raise RuntimeError("call connect() before add_engine()")
        spec = self.mt.rollout_spec
        size, first, engine = spec.workers_per_engine, spec.num_workers, spec.engines
        if procs is not None and int(procs.size()) != size:
            raise ValueError(f"add_engine got {int(procs.size())} procs; an engine of this "
                             f"group has {size} workers (nodes x gpus of the rollout spec)")
        self.between_updates()  # every live engine holds the newest version sent
        self._check_catch_up_source(engine)
        t0 = time.perf_counter()
        before, old = self.mt.plan.num_rounds, self.mt.group
        grown = dataclasses.replace(spec, engines=engine + 1)
        joining = [procs, None, None]  # (procs, actors, grown group): what to roll back
        try:
            joining[:2] = self.mt.meshes.spawn_engine(procs, grown, first)
            joining[2] = group = self.mt.group.add_engines(joining[0])
            joining[1].attach.call(group).get()
            self.mt.group, self.mt.rollout_spec = group, grown
            self.mt.control.use(group)
            t1 = time.perf_counter()
            self.mt.leader.join(rolled_back=True)  # (a failure is rolled back here)
            self.mt._use()
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
        start = self.mt.leader.catch_up_from
        t2 = time.perf_counter()
        count, bad, moved = 0, (), 0
        holds = self.mt.book.holds
        if holds is not None:
            # Appended rounds carry the joining engine alone; a mirrored one is fed by the
            # other engines' forwards, so the whole update runs again (start 0): the bytes
            # they hold already.
            try:
                if self.mt.mode.sends_staged_copy and not self.staged_copy_kept():
                    # (checked above: the trainers' parameters hold it)
                    self.mt.control.call(self.mt.leader.live_trainers(), PeerCall.STAGE,
                                      self.mt.book.held_version)
                    self.mt.staged_generation = self.mt.leader.generation
                self.mt._transfer(self.mt.book.held_version, first_round=start)
            except Exception as e:  # noqa: BLE001  (the others' bytes are their version's)
                left = self._leave_out(engine)
                raise TransferFailed(f"engine {engine} joined the plan but moving the current "
                                     f"weights into it failed ({type(e).__name__}: {e}); {left}"
                                     f"; the other engines hold their version (the catch-up "
                                     f"writes them the same bytes): restart its workers and "
                                     f"add_engine() again") from e
            t = self.mt.plan.tables
            moved = int(t.real_bytes[t.round >= start].sum())
            count, bad = self.mt._verify([(first, actors)], holds)
            for _, mesh in self.mt._live("trainer") + self.mt._live("rollout"):
                mesh.timings.call().get()  # the catch-up's spans are not the next update's
        t3 = time.perf_counter() if holds is not None else t2  # (0: nothing to catch up)
        report = JoinReport(engine=engine, spawn_s=t1 - t0, plan_s=t2 - t1, catch_up_s=t3 - t2,
                            rdma_bytes=moved, num_params=count, mismatched=bad,
                            num_rounds=(before, self.mt.plan.num_rounds))
        if bad:
            raise TransferFailed(f"{report.line()}: {list(bad[:4])}")
        return report

    def _roll_back_join(self, engine: int, spec, group, procs, actors, grown) -> str:
        """A join whose set-up failed (a joiner killed while its actors were built, probed
        or set up): take it off the control plane, the leader's books and the meshes again,
        as before `add_engine` (its engine number is the next join's); says how that went.
        ``procs``, ``actors``, ``grown``: what was spawned for it so far (None: not yet)."""
        self.mt.leader.forget([engine])
        self.mt.group, self.mt.rollout_spec = group, spec
        self.mt.control.use(group)
        self.mt._use()  # (a failed join's re-plan over the others may have put a plan in force)
        # Procs spawned for the join are stopped by drop_engine, which ends its agents too.
        errors = [] if grown is None else group.undo_add_engines(
            grown, stop=not self.mt.meshes.owns(procs))
        if actors is not None:
            errors += self.mt.meshes.drop_engine(actors, procs)
        how = (f" (stopping its actors failed: {describe(errors[0])}; look for leftover "
               f"bootstrap_main processes with ps)" if errors else "")
        return (f"the join was rolled back{how}: the other engines keep their version and "
                f"plan, the next update() goes to them")

    def _leave_out(self, engine: int) -> str:
        """A join whose catch-up failed: take the engine out again (told why; its rows
        dropped, or the others planned again), so later updates do not run into it; says
        how that went."""
        try:
            self.mt.leader.leave(engine)
            self.mt._use()
        except Exception as e:  # noqa: BLE001  (said in the caller's error)
            return (f"taking it out of the group again failed too ({type(e).__name__}: {e}): "
                    f"remove_engine({engine})")
        return "it is out of the group again"

    def staged_copy_kept(self) -> bool:
        """Sender staging, no re-plan since the trainers' staged copies were taken (a re-plan
        drops them: they were laid out for the old plan), and no delta plan in force (a
        join then plans everything again, and the copies hold only the delta's tensors)."""
        mt = self.mt
        return (mt.mode.sends_staged_copy and mt.staged_generation == mt.leader.generation
                and mt.leader.tensors is None)

    def _check_catch_up_source(self, engine: int) -> None:
        """Without a staged copy (no sender staging, or a re-plan dropped it) the catch-up
        sends the trainers' parameters to every engine (a mirrored join runs the whole update
        again): they must still hold the version the engines hold, checked against the
        trainers' own load_weights of it.

        Raises:
            CatchUpRefused: a train step ran since (before anything spawns or moves).
        """
        holds = self.mt.book.holds
        if holds is None or self.staged_copy_kept():  # (the staged copy is sent)
            return
        _, bad = self.mt._verify(self.mt._live("trainer"), holds, side="trainer")
        if bad:
            version = self.mt.book.held_version
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

    def between_updates(self) -> None:
        """Before a membership change: the transfer streaming ended and (receiver staging)
        the newest version landed is installed, so every live engine holds the newest
        version sent, the one the trainers' parameters hold."""
        self.mt._streaming.join(self.mt._deadline())
        if self.mt.mode.lands_in_staging:
            self.mt.poll_requests()

    def replan(self) -> TransferPlan:
        """`MeshTransfer.replan`."""
        self.mt._connected("replan")
        self.between_updates()
        self.mt.leader.replan()
        self.mt._use()
        return self.mt.plan

    def remove_engine(self, engine: int) -> TransferPlan:
        """`MeshTransfer.remove_engine`."""
        self.mt._connected("remove_engine")
        self.between_updates()
        self.mt.leader.leave(engine)
        self.mt._use()
        first = engine * self.mt.rollout_spec.workers_per_engine
        if first in self.mt.meshes.joined:
            self.mt.group, errors = self.mt.group.retire_engine(engine)
            self.mt.control.use(self.mt.group)
            errors += self.mt.meshes.retire_engine(first)
            for error in errors:  # (the engine is out either way; only its processes linger)
                log.warning("remove_engine(%d): stopping its agents or procs failed (%s); look "
                            "for leftover bootstrap_main processes with ps", engine,
                            describe(error))
        return self.mt.plan

    def recover(self, version: int, lost: list, cause: str, train_step_s: float) -> None:
        """Leave the ``lost`` workers out (`weightbridge.coordination.loss.lose`: their
        engines and the lost trainers excluded, the others planned again from the source maps
        of connect, a lost trainer's regions from its replicas) and raise `WorkersLost` at
        once, within timeout_s of the loss. Where the trainers' parameters still hold
        ``version`` (`Mode.resends_after_loss`) it is re-sent afterwards, on the streaming
        thread (`_resend`): `wait` returns its report, and every later call waits for it
        first. If no engine is left or the re-plan fails (no trainer holds what a lost
        trainer held), raise `TransferFailed`."""
        loss = lose(self.mt.leader, [w.index for w in lost if w.side == "rollout"],
                    [w.index for w in lost if w.side == "trainer"],
                    during=f"the transfer of version {version}", cause=one_line(cause),
                    rejoin="add_engine()", restart=RESTART)
        self.mt._use()
        for _, mesh in self.mt._live("trainer") + self.mt._live("rollout"):
            mesh.timings.call().get()  # drop the failed attempt's spans
        survivors = list(loss.survivors)
        if not loss.resend:
            if not self.mt.mode.lands_in_staging:
                with self.mt._book_lock:
                    self.mt.book.torn()  # (survivors' parameters may hold part of it)
            state = ("they keep the version they hold; the next update() goes to them"
                     if self.mt.mode.lands_in_staging else
                     "their parameters may hold part of it: run no generation step on them "
                     "until the next update() reached them (it carries every tensor)")
            raise loss.lost(f"Version {version} was not re-sent to the surviving engines "
                            f"{survivors} (the staged copy was laid out for the old plan): "
                            f"{state}.")
        # The trainers' parameters still hold it: re-sent after this raise (every later call
        # joins it first; update() before its train step, which would change what it reads).
        self.mt._streaming.start(self._resend, version, train_step_s, loss.what, survivors)
        where = ("hold it whole" if not self.mt.mode.lands_in_staging else
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
            self.mt._move(version)
            report = self.mt._report(version, train_step_s, t1)
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
