"""Who is in a controller-driven group: engines joining and leaving, recovery from losses.

Mixed into `controller.driver.MeshTransfer` (it uses the transfer's specs, maps, control plane
and plan). An engine joins with `add_engine`: only it is probed, the plan in force is extended
for it (`weightbridge.planning.extend`: a replica is mirrored on a live engine, the trainers
untouched; the other engines keep their buffers and registered ranges), and it receives the
version the others hold before `add_engine` returns. An engine is out when it was lost
mid-update (`WorkersLost`) or taken out with `remove_engine` (which just drops a mirrored
engine's rows); a trainer when it was lost (its replicas then send its regions). Otherwise
leaving and recovery re-plan the whole group from the kept source maps, without probing, as
`replan` does (one balanced plan over every live engine); the plan in force only ever routes
bytes between live workers.
"""

from __future__ import annotations

import dataclasses
import time

from controller.report import JoinReport, TransferError, WorkersLost
# The package first: `from weightbridge import` waits for its __init__ when another thread of
# an actor process is running it; importing a submodule first would not, and a half-built
# package then fails the other thread's imports.
from weightbridge import LayoutError, TransferPlan, WorkerId
from weightbridge.coordination.elastic import check_removable, join_group, leave_group
from weightbridge.coordination.session import plan_group, run_update


class Membership:
    """`add_engine`, `remove_engine`, `replan`, the recovery after a loss, and the live ranks
    of each side."""

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
            LayoutError: the engine loads another checkpoint or needs what no trainer holds
                (before any of its buffers exist).
            TransferError: the catch-up transfer failed or did not verify.
        """
        if self.plan is None:
            raise RuntimeError("call connect() before add_engine()")
        spec = self.rollout_spec
        size, first, engine = spec.workers_per_engine, spec.num_workers, spec.engines
        if procs is not None and int(procs.size()) != size:
            raise ValueError(f"add_engine got {int(procs.size())} procs; an engine of this "
                             f"group has {size} workers (nodes x gpus of the rollout spec)")
        t0 = time.perf_counter()
        grown = dataclasses.replace(spec, engines=engine + 1)
        procs, actors = self._spawn_engine(procs, grown, first)
        group = self.group.add_engines(procs)
        actors.attach.call(group).get()
        self.group, self.rollout_spec = group, grown
        self.control.use(group)
        t1 = time.perf_counter()
        before = self.plan.num_rounds
        try:
            self._maps, connected, start = join_group(
                self.control, self._maps, self.connected, self.config,
                generation=self._generation, restricted=self._tensors is not None,
                excluded=self._excluded(), excluded_trainers=frozenset(self.lost_trainers))
        except Exception as e:
            self.lost_engines.add(engine)  # the group goes on without it
            if not isinstance(e, (LayoutError, ValueError)):  # set-up may have begun
                self._replan()
            raise
        self._tensors = None  # (a delta plan in force was replaced by a full one)
        self._use(connected)
        t2 = time.perf_counter()
        count, bad, moved = 0, (), 0
        if self._held is not None:
            # Appended rounds carry the joining engine alone; a mirrored one is fed by the
            # other engines' forwards, so the whole update runs again (start 0).
            deadline = self.config.timeout_s * (self.plan.num_rounds - start + 2)
            try:
                run_update(self.control, self.connected, first_round=start,
                           deadline_s=deadline)
            except Exception as e:  # noqa: BLE001  (the others' bytes are their version's)
                raise TransferError(f"engine {engine} joined the plan but moving the current "
                                    f"weights into it failed ({type(e).__name__}: {e}); the "
                                    f"other engines hold their version (the catch-up writes "
                                    f"them the same bytes): remove_engine({engine}) and try "
                                    f"again") from e
            t = self.plan.tables
            moved = int(t.real_bytes[t.round >= start].sum())
            count, bad = self._verify([(first, actors)], self._held)
            for _, mesh in self._live("trainer") + self._live("rollout"):
                mesh.timings.call().get()  # the catch-up's spans are not the next update's
        t3 = time.perf_counter() if self._held is not None else t2  # (0: nothing to catch up)
        report = JoinReport(engine=engine, spawn_s=t1 - t0, plan_s=t2 - t1, catch_up_s=t3 - t2,
                            rdma_bytes=moved, num_params=count, mismatched=bad,
                            num_rounds=(before, self.plan.num_rounds))
        if bad:
            raise TransferError(f"{report.line()}: {list(bad[:4])}")
        return report

    def replan(self) -> TransferPlan:
        """Plan the whole group again from the source maps of connect and joins (no probe):
        one non-redundant plan over every live engine, where joins had appended theirs. Every
        live worker is set up again. Returns the new plan."""
        if self.plan is None:
            raise RuntimeError("call connect() before replan()")
        self._replan()
        return self.plan

    def remove_engine(self, engine: int) -> TransferPlan:
        """Take rollout engine ``engine`` out of the group between updates (to restart or
        retire it); no byte is sent to or through it afterwards. An engine nothing depends on
        (one mirrored in by `add_engine`) just loses its rows: only the rollouts that
        forwarded to it take new writes. Otherwise the others are planned again from the
        source maps of connect (no probe). Returns the plan in force.

        Raises:
            ValueError: no such engine, it is already out, or it is the last one.
        """
        if self.plan is None:
            raise RuntimeError("call connect() before remove_engine()")
        check_removable(engine, self.rollout_spec.engines, self.lost_engines)
        self.lost_engines.add(engine)
        size = self.rollout_spec.workers_per_engine
        shrunk = leave_group(self.control, self.connected, self.config,
                             [WorkerId("rollout", j) for j in range(engine * size,
                                                                    (engine + 1) * size)])
        if shrunk is None:  # others depend on it: plan again
            self._replan()
        else:
            self._use(shrunk)
        return self.plan

    def _replan(self) -> None:
        """Plan again from the source maps of connect without the engines and trainers that
        are out, and set every live worker up on it."""
        self._generation += 1
        self._use(plan_group(self.control, self._maps, self.config, excluded=self._excluded(),
                             excluded_trainers=frozenset(self.lost_trainers),
                             generation=self._generation, reroute=self._reroute,
                             tensors=self._tensors))

    def _excluded(self) -> frozenset[int]:
        """The rollout workers of the engines that are out."""
        size = self.rollout_spec.workers_per_engine
        return frozenset(j for j in range(self.rollout_spec.num_workers)
                         if j // size in self.lost_engines)

    def _recover(self, version: int, lost: list, cause: str, train_step_s: float,
                 versions=None) -> None:
        """Leave the ``lost`` trainers and the engines of the lost rollout workers out,
        re-plan over the others from the source maps of connect (no probe; a lost trainer's
        regions then come from its replicas), re-send ``version`` (the trainers still hold
        it), verify, raise `WorkersLost`. If no trainer holds what the rollouts need, no
        engine is left, or the re-send fails too, raise `TransferError`."""
        size = self.rollout_spec.workers_per_engine
        self.lost_engines |= {w.index // size for w in lost if w.side == "rollout"}
        self.lost_trainers |= {w.index for w in lost if w.side == "trainer"}
        survivors = sorted(set(range(self.rollout_spec.engines)) - self.lost_engines)
        what = cause + "".join(
            f"\n{name}{'s' if len(ids) > 1 else ''} {sorted(ids)} excluded"
            for name, ids in (("trainer", self.lost_trainers), ("engine", self.lost_engines))
            if ids)
        if not survivors:
            raise TransferError(f"{what}; no engine is left: close this MeshTransfer")
        for _, mesh in self._live("trainer") + self._live("rollout"):
            mesh.timings.call().get()  # drop the failed attempt's spans
        t1 = time.perf_counter()
        try:
            self._replan()
            self._transfer(version)
        except Exception as e:  # noqa: BLE001  (a second failure: give up, say both)
            raise TransferError(f"{what}; re-sending version {version} to the surviving "
                                f"engines {survivors} failed too ({type(e).__name__}: {e}): "
                                f"close this MeshTransfer and start again") from e
        report = self._report(version if versions is None else versions, train_step_s, t1)
        raise WorkersLost(f"{what}; version {version} was re-sent over a new plan to the "
                          f"surviving engines {survivors}, which hold it whole "
                          f"({report.line().splitlines()[0]}); the next update() goes to "
                          f"them", frozenset(self.lost_engines), frozenset(self.lost_trainers),
                          report)

    def _live(self, side: str) -> list[tuple[int, object]]:
        """(first flat rank, actor mesh) of each run of consecutive live ranks of one side,
        within each actor mesh (the first one and each joined engine's)."""
        if side == "trainer":
            meshes, size, lost = [(0, self.trainers)], 1, self.lost_trainers
        else:
            meshes = self._rollout_meshes
            size, lost = self.rollout_spec.workers_per_engine, self.lost_engines
        out = []
        for first, mesh in meshes:
            num = int(mesh.size())
            runs: list[list[int]] = []
            for unit in range(first // size, (first + num) // size):  # an engine, a trainer
                if unit in lost:
                    continue
                if runs and runs[-1][1] == unit * size:
                    runs[-1][1] += size
                else:
                    runs.append([unit * size, (unit + 1) * size])
            if runs == [[first, first + num]]:
                out.append((first, mesh))
                continue
            flat = mesh.flatten("rank")
            out += [(a, flat.slice(rank=slice(a - first, b - first))) for a, b in runs]
        return out


class Lost(Exception):
    """Internal: workers stopped answering during an update (`_recover` handles it)."""

    def __init__(self, workers: list, cause: str):
        super().__init__(cause)
        self.workers, self.cause = workers, cause
