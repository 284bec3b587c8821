"""Who is in a controller-driven group: live ranks, engines taken out, recovery from losses.

Mixed into `controller.driver.MeshTransfer` (it uses the transfer's specs, maps, control plane
and plan). An engine is out when it was lost mid-update (`WorkersLost`) or taken out with
`remove_engine`; a trainer when it was lost (its replicas then send its regions). Each change
re-plans from the source maps of connect, without probing; the plan in force only ever routes
bytes between live workers.
"""

from __future__ import annotations

import time

from controller.report import TransferError, WorkersLost
# The package first: `from weightbridge import` waits for its __init__ when another thread of
# an actor process is running it; importing a submodule first would not, and a half-built
# package then fails the other thread's imports.
from weightbridge import TransferPlan
from weightbridge.coordination.session import plan_group


class Membership:
    """`remove_engine`, the recovery after a loss, and the live ranks of each side."""

    def remove_engine(self, engine: int) -> TransferPlan:
        """Take rollout engine ``engine`` out of the group between updates (to restart or
        retire it): re-plan over the others from the source maps of connect (no probe); no
        byte is sent to or through it afterwards. Returns the new plan.

        Raises:
            ValueError: no such engine, it is already out, or it is the last one.
        """
        if self.plan is None:
            raise RuntimeError("call connect() before remove_engine()")
        engines = self.rollout_spec.engines
        if not isinstance(engine, int) or not 0 <= engine < engines:
            raise ValueError(f"engine must be an engine number in [0, {engines}), got {engine!r}")
        if engine in self.lost_engines:
            raise ValueError(f"engine {engine} is already out of this group "
                             f"(out: {sorted(self.lost_engines)})")
        if len(self.lost_engines) + 1 == engines:
            raise ValueError(f"engine {engine} is the last engine of this group; close the "
                             f"MeshTransfer instead")
        self.lost_engines.add(engine)
        self._replan()
        return self.plan

    def _replan(self) -> None:
        """Plan again from the source maps of connect without the engines and trainers that
        are out, and set every live worker up on it."""
        size = self.rollout_spec.workers_per_engine
        excluded = frozenset(j for j in range(self.rollout_spec.num_workers)
                             if j // size in self.lost_engines)
        self._generation += 1
        self._use(plan_group(self.control, self._maps, self.config, excluded=excluded,
                             excluded_trainers=frozenset(self.lost_trainers),
                             generation=self._generation, reroute=self._reroute,
                             tensors=self._tensors))

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
        """(first flat rank, actor mesh) of each run of consecutive live ranks of one side."""
        if side == "trainer":
            mesh, num, size, lost = (self.trainers, self.trainer_spec.num_workers, 1,
                                     self.lost_trainers)
        else:
            mesh, num = self.rollouts, self.rollout_spec.num_workers
            size, lost = self.rollout_spec.workers_per_engine, self.lost_engines
        runs: list[list[int]] = []
        for unit in range(num // size):  # an engine of rollouts, a trainer
            if unit in lost:
                continue
            if runs and runs[-1][1] == unit * size:
                runs[-1][1] += size
            else:
                runs.append([unit * size, (unit + 1) * size])
        if runs == [[0, num]]:
            return [(0, mesh)]
        flat = mesh.flatten("rank")
        return [(a, flat.slice(rank=slice(a, b))) for a, b in runs]


class Lost(Exception):
    """Internal: workers stopped answering during an update (`_recover` handles it)."""

    def __init__(self, workers: list, cause: str):
        super().__init__(cause)
        self.workers, self.cause = workers, cause
