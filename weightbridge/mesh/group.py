"""`TransferGroup`: the picklable handle on one transfer group's agents.

The controller spawns the group (`TransferGroup.spawn`: a `TransferAgent` on every proc of the
trainer and rollout meshes), grows it (`add_engines`) and closes it (`close`); inside each
user actor the handle builds that rank's worker (`sender`, `receiver`, `worker`), which
registers it where the agent of its process serves it (`weightbridge.mesh.registry`).

    controller (your RL loop)                          each trainer / rollout proc
    -------------------------                          ---------------------------
    group = TransferGroup.spawn(tprocs, rprocs,        TransferAgent (the library's)
                                engine_size=2, config=...)
    trainers.setup.call(group)  --------------------->  self.wb = group.sender(params, load, spec)
    trainers.connect.call()     --------------------->  self.wb.connect()
    per step: trainers.step.call(v) ----------------->  ...; self.wb.send_weights(v)
    rollouts.generate.call()    --------------------->  self.wb.poll_requests(); ...
    group.close()

No mesh axis needs a particular name: the agents' meshes are flattened, and worker i is the
proc of flat rank i (engines added later with `add_engines` run on procs of their own: their
ranks go on after the group's, one more segment of the rollout side).

Typical usage: docs/integration.md; `tests/test_monarch_integration.py`.
"""

from __future__ import annotations

import dataclasses
import threading
import uuid
from dataclasses import dataclass

from monarch.actor import current_rank

from weightbridge.config import TransferConfig
from weightbridge.errors import GroupClosed
from weightbridge.mesh import monarch_api
from weightbridge.mesh.faults import disown_faults, own_faults
from weightbridge.mesh.agent import TransferAgent
from weightbridge.mesh.control import AXIS, MeshControl, mesh_size
from weightbridge.mesh.registry import register
from weightbridge.mesh.transport import MeshTransport
from weightbridge.types import Placement

CLOSE_TIMEOUT_S = 60.0
"""How long `TransferGroup.close` waits for each agent mesh to release and to stop."""


class _Lifecycle:
    """What every handle of one group shares in a process: the agent meshes spawned so far
    (`TransferGroup.add_engines` adds to them) and whether the group was closed, so that
    closing any handle, any number of times, stops each agent mesh once."""

    def __init__(self, spawned: tuple = ()):
        self.lock = threading.Lock()
        self.spawned = list(spawned)
        self.closed = False

    def __getstate__(self) -> dict:
        return {"spawned": self.spawned, "closed": self.closed}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["spawned"])
        self.closed = state["closed"]


@dataclass(frozen=True)
class TransferGroup:
    """A picklable handle on one transfer group's agents: pass it to your actors.

    Build it with `TransferGroup.spawn` in the controller; inside each actor, build that
    rank's worker with `sender` / `receiver` (adapters) or `worker` (controller-driven).
    """

    name: str
    trainer_agents: object
    rollout_agents: object
    num_trainers: int
    num_engines: int
    engine_size: int
    config: TransferConfig
    spawned: tuple = ()
    """The agent actor meshes of this handle as spawned (`close` stops those of every handle
    of the group)."""
    joined: tuple = ()
    """(first flat rollout rank, flattened agents) of each run of engines `add_engines`
    added, after ``rollout_agents``' ranks; the agents are None once `retire_engine` stopped
    them (the ranks stay taken)."""
    rollout_base: int = 0
    """Flat rollout rank of the first proc of the mesh this handle's rollout actors run on:
    the handle `add_engines` returns builds the joining engines' workers."""
    _life: _Lifecycle = dataclasses.field(default=None, compare=False, repr=False)
    """Shared by this handle and the ones `add_engines` made from it (`close`)."""

    def __post_init__(self):
        if self._life is None:
            object.__setattr__(self, "_life", _Lifecycle(self.spawned))

    @classmethod
    def spawn(cls, trainer_procs, rollout_procs, *, engine_size: int,
              config: TransferConfig = TransferConfig(), name: str | None = None
              ) -> "TransferGroup":
        """Spawn the agents on every proc of both meshes (any axis names: each mesh is taken
        in its flat rank order). Rollout proc j is rank ``j % engine_size`` of engine
        ``j // engine_size``.

        Raises:
            ValueError: an engine size that does not divide the rollout procs, or a config
                that is not a `TransferConfig`.
        """
        monarch_api.check()
        if not isinstance(config, TransferConfig):
            raise ValueError(f"config must be a weightbridge.TransferConfig, got "
                             f"{type(config).__name__}")
        num_rollouts = mesh_size(rollout_procs)
        if engine_size < 1 or num_rollouts % engine_size:
            raise ValueError(f"engine_size={engine_size} must divide the {num_rollouts} rollout "
                             f"procs (engines are consecutive runs of ranks)")
        name = name or f"wb-{uuid.uuid4().hex[:8]}"
        spawned = tuple(procs.spawn(f"{name}-{side}", TransferAgent) for side, procs in
                        (("trainer", trainer_procs), ("rollout", rollout_procs)))
        own_faults(*spawned)  # (a dead proc is the transfer's to report, not fatal: mesh.faults)
        return cls(name=name, trainer_agents=spawned[0].flatten(AXIS),
                   rollout_agents=spawned[1].flatten(AXIS), num_trainers=mesh_size(trainer_procs),
                   num_engines=num_rollouts // engine_size, engine_size=engine_size,
                   config=config, spawned=spawned)

    def add_engines(self, rollout_procs) -> "TransferGroup":
        """Spawn agents on ``rollout_procs`` (whole engines of ``engine_size`` procs, any axis
        names) and return the grown group: its rollout ranks go on after this group's, engine
        numbers after its engines. Pass the returned handle to the joining engines' actors
        (their workers take their ranks from it) and to whoever drives the group
        (`controller.MeshTransfer.add_engine` or the trainers' `SenderAdapter.add_engines`),
        which plans them in. This handle stays valid for the workers built from it.

        Raises:
            ValueError: ``engine_size`` does not divide the new procs.
            GroupClosed: the group was closed.
        """
        self._check_open("add engines to")
        count = mesh_size(rollout_procs)
        if count < 1 or count % self.engine_size:
            raise ValueError(f"add_engines got {count} rollout procs; give whole engines: a "
                             f"multiple of engine_size={self.engine_size}")
        first = self.num_engines * self.engine_size
        agents = rollout_procs.spawn(f"{self.name}-rollout-{first}", TransferAgent)
        own_faults(agents)
        with self._life.lock:
            self._life.spawned.append(agents)
        return dataclasses.replace(
            self, joined=self.joined + ((first, agents.flatten(AXIS)),),
            num_engines=self.num_engines + count // self.engine_size, rollout_base=first,
            spawned=self.spawned + (agents,))

    def undo_add_engines(self, grown: "TransferGroup", *, stop: bool = True
                         ) -> list[Exception]:
        """Undo `add_engines` (a join whose set-up failed, `controller.MeshTransfer
        .add_engine`): stop the agents ``grown`` (what it returned) added beyond this handle
        and forget them, so `close` neither releases nor stops them again; use this handle
        instead. ``stop=False``: forget them only, for a caller that stops their procs next
        (which ends them; Monarch 0.7 takes about 30 s to stop an actor mesh whose proc
        died). Returns what failed to stop (the agents of a proc that died); each one was
        tried."""
        added = [a for a in grown.spawned if all(a is not s for s in self.spawned)]
        with self._life.lock:
            self._life.spawned = [a for a in self._life.spawned
                                  if all(a is not b for b in added)]
        errors: list[Exception] = []
        for agents in added if stop else ():
            _collect(errors, lambda: agents.stop().get(timeout=CLOSE_TIMEOUT_S))
        disown_faults(*added)
        return errors

    def retire_engine(self, engine: int) -> tuple["TransferGroup", list[Exception]]:
        """An engine `add_engines` added on its own, out of the group for good
        (`controller.MeshTransfer.remove_engine`): release and stop its agents and forget
        them, so its procs may stop (their memory freed while the group goes on) and the
        handles made from now on, pickled to joining actors, no longer name them. Its ranks
        and engine number stay taken; nothing may call its workers afterwards. Returns (the
        handle to use instead, what failed to stop: the agents of a proc that died).

        Raises:
            ValueError: ``engine`` is not a segment of its own (the engines of the first
                rollout mesh, and engines added together, share one agent mesh), or it was
                retired already.
        """
        first = engine * self.engine_size
        at = [i for i, (f, agents) in enumerate(self.joined) if f == first and agents is not None]
        if not at or mesh_size(self.joined[at[0]][1]) != self.engine_size:
            raise ValueError(f"engine {engine} is not one add_engines() added on its own (or it "
                             f"was retired already): its agents share a mesh with other engines "
                             f"and stop with the group (close())")
        i = at[0]
        spawned = self.spawned[2 + i]  # (the trainers', the rollouts', then one per add)
        with self._life.lock:
            self._life.spawned = [a for a in self._life.spawned if a is not spawned]
        why = f"engine {engine} was retired from transfer group {self.name} (remove_engine)"
        errors: list[Exception] = []
        _collect(errors, lambda: spawned.release.call(self.name, why).get(
            timeout=CLOSE_TIMEOUT_S))
        _collect(errors, lambda: spawned.stop().get(timeout=CLOSE_TIMEOUT_S))
        disown_faults(spawned)
        joined = self.joined[:i] + ((first, None),) + self.joined[i + 1:]
        spawned_all = self.spawned[:2 + i] + (None,) + self.spawned[3 + i:]
        return dataclasses.replace(self, joined=joined, spawned=spawned_all), errors

    def close(self) -> None:
        """Release every worker of the group (RDMA buffers, references to parameters) and
        stop the agents, those of engines added later included. The procs and your actors
        stay. Safe on any handle of the group (from before or after `add_engines`), any
        number of times: the first call closes, later ones return.

        Rollouts waiting in ``poll_requests`` or ``wait_for_version``, and trainers waiting
        in ``send_weights``, return at once: their call, and every later one, raises
        `TransferFailed` saying the group was closed.

        Raises:
            Exception: an agent mesh that did not release or stop (its proc died); every
                other one was still released and stopped.
        """
        life = self._life
        with life.lock:
            if life.closed:
                return
            life.closed = True
            spawned = list(life.spawned)
        why = (f"transfer group {self.name} was closed (TransferGroup.close()); nothing more "
               f"reaches these parameters: spawn a new group to go on receiving versions")
        errors = []
        # Released first, everywhere (rollouts' waits end, buffers are dropped), then stopped:
        # no worker calls into an agent already stopped.
        released = [agents.release.call(self.name, why) for agents in spawned]
        for future in released:
            _collect(errors, lambda: future.get(timeout=CLOSE_TIMEOUT_S))
        for agents in spawned:
            _collect(errors, lambda: agents.stop().get(timeout=CLOSE_TIMEOUT_S))
        disown_faults(*spawned)
        if errors:
            raise errors[0]

    # -- inside an actor: this rank's worker ---------------------------------------------------

    def _check_open(self, what: str) -> None:
        if self._life.closed:
            raise GroupClosed(f"transfer group {self.name} was closed (TransferGroup.close()); "
                              f"spawn a new group to {what}")

    def _wiring(self) -> dict:
        return {"control": MeshControl(self),
                "transport": MeshTransport(self.config.peer_timeout_s,
                                           batched=self.config.rdma_writes == "batched"),
                "config": self.config}

    def sender(self, params, load_weights, spec, *, placement: Placement | None = None,
               kernels=None, cls=None):
        """This trainer rank's `SenderAdapter` (or ``cls``, a subclass); its rank is this
        actor's flat rank in its mesh."""
        from weightbridge.adapters.sender import SenderAdapter

        self._check_open("build workers in")

        worker = (cls or SenderAdapter)(params, load_weights, spec, rank=current_rank().rank,
                               placement=placement, kernels=kernels, **self._wiring())
        register(self.name, worker)
        return worker

    def receiver(self, params, load_weights, spec, *, placement: Placement | None = None,
                 before_update_hook=None, after_update_hook=None, kernels=None, cls=None):
        """This rollout rank's `ReceiverAdapter` (or ``cls``, a subclass); its engine and
        engine rank follow from its flat rank and ``engine_size``. The hooks run around each
        install (`ReceiverAdapter.poll_requests`)."""
        from weightbridge.adapters.receiver import ReceiverAdapter

        self._check_open("build workers in")

        rank = current_rank().rank + self.rollout_base
        worker = (cls or ReceiverAdapter)(params, load_weights, spec, rank=rank,
                                 engine=rank // self.engine_size,
                                 engine_rank=rank % self.engine_size,
                                 engine_size=self.engine_size, placement=placement,
                                 before_update_hook=before_update_hook,
                                 after_update_hook=after_update_hook, kernels=kernels,
                                 **self._wiring())
        register(self.name, worker)
        return worker

    def worker(self, side: str, params, load_weights, spec, *, placement: Placement,
               kernels=None, cls=None):
        """This rank's plain `TransferWorker` (or ``cls``, a subclass), for a group a
        controller drives (`controller.MeshTransfer`)."""
        from weightbridge.coordination.worker import TransferWorker

        self._check_open("build workers in")

        wiring = self._wiring()
        rank = current_rank().rank + (self.rollout_base if side == "rollout" else 0)
        worker = (cls or TransferWorker)(side, params, load_weights, spec,
                                         rank=rank, placement=placement,
                                         kernels=kernels, **wiring)
        register(self.name, worker)
        return worker


def _collect(errors: list, step) -> None:
    try:
        step()
    except Exception as e:  # noqa: BLE001  (raised once every agent mesh was handled)
        errors.append(e)
