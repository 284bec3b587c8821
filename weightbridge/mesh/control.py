"""Monarch integration: any actor gains weight transfer without being rewritten.

The library's peer calls never go through the user's actors. `TransferGroup.spawn` puts one
`TransferAgent` (an async actor with a single concurrent endpoint) on every proc of the
trainer and rollout proc meshes; the user's actor, sync or async, builds its worker through
the group handle, which registers it in its process, where the agent of that process serves
it. So a sync actor blocked in ``send_weights`` or ``poll_requests`` still serves its peers
(a sync actor handles one message at a time, and Monarch refuses an actor that mixes sync and
async endpoints, so the library could not add an endpoint to it), and no mesh axis needs a
particular name: the agents' meshes are flattened, and worker i is the proc of flat rank i
(engines added later with `TransferGroup.add_engines` run on procs of their own: their ranks
go on after the group's, one more segment of the rollout side).

    controller (your RL loop)                          each trainer / rollout proc
    -------------------------                          ---------------------------
    group = TransferGroup.spawn(tprocs, rprocs,        TransferAgent (the library's)
                                engine_size=2, config=...)
    trainers.setup.call(group)  --------------------->  self.wb = group.sender(params, load, spec)
    trainers.connect.call()     --------------------->  self.wb.connect()
    per step: trainers.step.call(v) ----------------->  ...; self.wb.send_weights(v)
    rollouts.generate.call()    --------------------->  self.wb.poll_requests(); ...
    group.close()

Typical usage: docs/integration.md; `tests/test_monarch_integration.py`.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

from monarch.actor import Actor, ActorError, current_rank, endpoint

from weightbridge.config import TransferConfig
from weightbridge.coordination.control import PeerCall, PeerFailed, gathered
from weightbridge.mesh.transport import drop_all, register_ranges, wait_all, write
from weightbridge.types import Placement, WorkerId

AXIS = "weightbridge_rank"
"""The one axis of the flattened agent meshes."""
REGISTER_WAIT_S = 600.0
"""How long an agent waits for its proc's worker to be built (a peer may probe first)."""

_registry: dict[str, object] = {}
_registered = threading.Condition()


def _register(group: str, worker) -> None:
    with _registered:
        if group in _registry:
            raise ValueError(f"this process already has a worker in transfer group {group!r}: "
                             f"build one worker per process and group (group.sender() or "
                             f"group.receiver() once per rank)")
        _registry[group] = worker
        _registered.notify_all()


def _lookup(group: str, timeout_s: float):
    with _registered:
        if not _registered.wait_for(lambda: group in _registry, timeout=timeout_s):
            raise TimeoutError(f"no worker of transfer group {group!r} was built in this "
                               f"process within {timeout_s:g}s: every rank must call "
                               f"group.sender(...) or group.receiver(...)")
        return _registry[group]


class MeshTransport:
    """Monarch RDMA behind the `weightbridge.coordination.control.Transport` calls."""

    def __init__(self, timeout_s: float):
        self.timeout_s = max(1, int(timeout_s))
        self.peers: dict = {}
        self.registered: dict = {}

    def register(self, arenas, ranges) -> dict:
        """Register this worker's incoming ranges; after a re-plan, deregister the old plan's
        (its arenas are no longer written: the failed transfer's writes ended or timed out)."""
        self.release()
        self.registered = register_ranges(arenas, ranges)
        return self.registered

    def release(self) -> None:
        if self.registered:
            drop_all(self.registered)
        self.registered = {}

    def set_peers(self, handles: dict) -> None:
        self.peers = handles

    def write(self, peer, key, src):
        return write(self.peers[(peer, key)], src, timeout_s=self.timeout_s)

    def wait(self, futures) -> None:
        wait_all(futures)


class TransferAgent(Actor):
    """Serves the `PeerCall`s of the workers built in its proc (one per transfer group).

    A sync actor whose endpoint hands each call to a thread and answers through the call's
    response port from there, so it serves many calls at once. Not an async actor: Monarch
    0.7 never closes a stopped async actor's event loop, and each stopped agent left 5 file
    descriptors (epoll, self-pipe, waker pipe) and its executor's threads in the process,
    once per session (docs/integration.md, "Memory over many updates").
    """

    def __init__(self):
        self._senders: dict[str, ThreadPoolExecutor] = {}
        self._pool: ThreadPoolExecutor | None = None

    @endpoint(explicit_response_port=True)
    def serve(self, port, group: str, call: PeerCall, *args) -> None:
        """Run ``call`` on this proc's worker of ``group``, in a thread: a worker serves its
        peers while its own thread is inside send_weights or poll_requests. A trainer's sends
        run one at a time in arrival order (one thread), so a queued send starts the moment
        the previous one's writes landed."""
        try:
            if call is PeerCall.SEND_ROUND:
                pool = self._senders.get(group)
                if pool is None:
                    pool = self._senders[group] = ThreadPoolExecutor(1, "weightbridge-send")
            else:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(thread_name_prefix="weightbridge-agent")
                pool = self._pool
            # The thread needs this actor's context (Monarch's current actor, in contextvars).
            context = contextvars.copy_context()
            future = pool.submit(context.run, _serve, group, call, args)
        except Exception as e:  # noqa: BLE001  (an explicit port's caller only hears the port)
            _fail(port, e, call)
            return
        future.add_done_callback(lambda f: _answer(port, f, call))

    @endpoint
    def release(self, group: str) -> None:
        """Forget this proc's worker of ``group``, deregister its RDMA buffers and end this
        agent's threads."""
        with _registered:
            worker = _registry.pop(group, None)
        release = getattr(getattr(worker, "transport", None), "release", None)
        if release is not None:
            release()
        self._shutdown()

    def _shutdown(self) -> None:
        pools = [self._pool, *self._senders.values()]
        self._pool, self._senders = None, {}
        for pool in pools:
            if pool is not None:
                pool.shutdown(wait=False)

    def __cleanup__(self, exc) -> None:
        self._shutdown()  # stopped without release (an actor that failed)


def _serve(group: str, call: PeerCall, args: tuple):
    return call.serve(_lookup(group, REGISTER_WAIT_S), *args)


def _answer(port, future, call: PeerCall) -> None:
    """Send a served call's result or error to its caller, as Monarch answers an endpoint."""
    try:
        # What Monarch does with a sync endpoint's result.
        port._resolve_and_send_blocking(future.result())
    except Exception as e:  # noqa: BLE001  (the caller's future raises it)
        _fail(port, e, call)


def _fail(port, error: Exception, call: PeerCall) -> None:
    port.exception(ActorError(error, f"Actor call TransferAgent.serve({call.value}) failed."))


class MeshControl:
    """A `weightbridge.coordination.control.ControlPlane` over the agents of one group."""

    poll_interval_s = 0.01
    """Waits on remote state poll it over endpoint calls: at most 100 calls a second."""

    def __init__(self, group: "TransferGroup"):
        self.engine_size = group.engine_size
        self._agents: dict = {}
        """Each peer's agent, sliced once: Monarch 0.7 keeps native state for every slice it
        sends through (about 10 KB each, never freed), so a slice per call grew every
        process by that much per peer call (docs/integration.md, "Memory over many
        updates")."""
        self._last_send: asyncio.Future | None = None
        """The newest `PeerCall.SEND_ROUND` in flight (`call_async`)."""
        self.use(group)

    def use(self, group: "TransferGroup") -> None:
        """Address ``group`` from now on: the same group grown by `TransferGroup.add_engines`
        (the agents sliced so far stay valid: old segments never change)."""
        self.group = group
        self.num_trainers, self.num_engines = group.num_trainers, group.num_engines
        self._segments = {"trainer": ((0, group.trainer_agents),),
                          "rollout": ((0, group.rollout_agents),) + group.joined}

    def _segment(self, peer: WorkerId) -> tuple[int, object]:
        """(first rank, agent mesh) of the segment of ``peer``'s side holding it."""
        for first, mesh in reversed(self._segments[peer.side]):
            if peer.index >= first:
                return first, mesh
        raise AssertionError(peer)

    def _agent(self, peer: WorkerId):
        agent = self._agents.get(peer)
        if agent is None:  # a race only slices twice; either slice serves
            first, mesh = self._segment(peer)
            agent = self._agents[peer] = mesh.slice(**{AXIS: peer.index - first})
        return agent

    def _run(self, peers: Sequence[WorkerId]):
        """The agents of ``peers`` as one mesh, when they are two or more consecutive ranks of
        one side in one segment (sliced once, as `_agent`); None otherwise."""
        if len(peers) < 2:
            return None
        side, first = peers[0].side, peers[0].index
        if any(p.side != side or p.index != first + i for i, p in enumerate(peers)):
            return None
        base, whole = self._segment(peers[0])
        if peers[-1].index >= base + _size(whole):
            return None
        key = (side, first, len(peers))
        mesh = self._agents.get(key)
        if mesh is None:
            lo = first - base
            mesh = self._agents[key] = (whole if lo == 0 and len(peers) == _size(whole) else
                                        whole.slice(**{AXIS: slice(lo, lo + len(peers))}))
        return mesh

    def _runs(self, peers: Sequence[WorkerId]) -> list[list[WorkerId]]:
        """``peers`` cut where ranks stop being consecutive or a segment ends: each piece
        takes one message (`_run`), or one per peer when it is a single peer."""
        runs: list[list[WorkerId]] = []
        for p in peers:
            last = runs[-1][-1] if runs else None
            if (last is not None and p.side == last.side and p.index == last.index + 1
                    and self._segment(p)[0] == self._segment(last)[0]):
                runs[-1].append(p)
            else:
                runs.append([p])
        return runs

    def _timeout(self, call: PeerCall) -> float | None:
        if call.unbounded:
            return None
        config = self.group.config
        return config.notice_timeout_s if call.notice else config.peer_timeout_s

    def _issue(self, peer: WorkerId, call: PeerCall, args: tuple):
        return self._agent(peer).serve.call_one(self.group.name, call, *args)

    def call_each(self, peers: Sequence[WorkerId], call: PeerCall, args: Sequence[tuple],
                  *, return_errors: bool = False) -> list:
        futures = [self._issue(p, call, a) for p, a in zip(peers, args)]
        out, timeout = [], self._timeout(call)
        for peer, f in zip(peers, futures):
            try:
                out.append(f.get(timeout=timeout))
            except TimeoutError:  # Monarch's says only "TimeoutError"
                out.append(PeerFailed(_timed_out(call, [peer], timeout)))
            except Exception as e:  # noqa: BLE001  (raised below, after every peer answered)
                out.append(PeerFailed(e))
        return gathered(out, return_errors)

    def call(self, peers: Sequence[WorkerId], call: PeerCall, *args,
             return_errors: bool = False) -> list:
        """`call_each` with the same arguments for every peer; one message for consecutive
        peers (as `call_async`), unless ``return_errors`` asks for each peer's own outcome.
        Then the first error is raised as soon as Monarch has it, not once every peer
        answered."""
        run = None if return_errors else self._run(peers)
        if run is None:
            return self.call_each(peers, call, [args] * len(peers), return_errors=return_errors)
        try:
            return list(run.serve.call(self.group.name, call, *args)
                        .get(timeout=self._timeout(call)).values())
        except TimeoutError:
            raise _timed_out(call, peers, self._timeout(call)) from None

    async def call_async(self, peers: Sequence[WorkerId], call: PeerCall, *args) -> list:
        """One message to the peers' agents when they are consecutive ranks (the rounds' steps
        go to every trainer or rollout): Monarch keeps about 1.5 KB per call that never goes
        away in the caller (docs/integration.md, "Memory over many updates"), so one call
        for all costs the sequencing trainer a few times less than one call per peer."""
        timeout = self._timeout(call)
        pieces = []  # all issued before any wait: one message per run of consecutive ranks
        for run in self._runs(peers):
            mesh = self._run(run)
            pieces.append(_values(mesh.serve.call(self.group.name, call, *args))
                          if mesh is not None else _one_value(self._issue(run[0], call, args)))
        answers = asyncio.ensure_future(_flattened(pieces))
        if call is PeerCall.SEND_ROUND:
            # A trainer serves its sends in order, so this one's clock starts once the one
            # before it answered (bounded itself): a stalled trainer surfaces within one peer
            # timeout of its stall, not depth of them.
            before, self._last_send = self._last_send, answers
            if before is not None and before.get_loop() is asyncio.get_running_loop():
                await asyncio.wait([before])
        try:
            return list(await asyncio.wait_for(answers, timeout))
        except asyncio.TimeoutError:
            raise _timed_out(call, peers, timeout) from None


def _timed_out(call: PeerCall, peers: Sequence[WorkerId], timeout: float) -> TimeoutError:
    names = ", ".join(str(p) for p in peers)
    return TimeoutError(f"{call.value} to {names} did not answer within {timeout:g}s "
                        f"(TransferConfig.timeout_s): a peer is stalled or its process died")


async def _one_value(future) -> list:
    return [await future]


async def _flattened(pieces) -> list:
    return [a for answers in await asyncio.gather(*pieces) for a in answers]


async def _values(future) -> list:
    """A mesh call's answers, in the order of its ranks."""
    return list((await future).values())


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
    """The agent actor meshes as spawned (what `close` stops)."""
    joined: tuple = ()
    """(first flat rollout rank, flattened agents) of each run of engines `add_engines`
    added, after ``rollout_agents``' ranks."""
    rollout_base: int = 0
    """Flat rollout rank of the first proc of the mesh this handle's rollout actors run on:
    the handle `add_engines` returns builds the joining engines' workers."""

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
        if not isinstance(config, TransferConfig):
            raise ValueError(f"config must be a weightbridge.TransferConfig, got "
                             f"{type(config).__name__}")
        num_rollouts = _size(rollout_procs)
        if engine_size < 1 or num_rollouts % engine_size:
            raise ValueError(f"engine_size={engine_size} must divide the {num_rollouts} rollout "
                             f"procs (engines are consecutive runs of ranks)")
        name = name or f"wb-{uuid.uuid4().hex[:8]}"
        spawned = tuple(procs.spawn(f"{name}-{side}", TransferAgent) for side, procs in
                        (("trainer", trainer_procs), ("rollout", rollout_procs)))
        return cls(name=name, trainer_agents=spawned[0].flatten(AXIS),
                   rollout_agents=spawned[1].flatten(AXIS), num_trainers=_size(trainer_procs),
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
        """
        count = _size(rollout_procs)
        if count < 1 or count % self.engine_size:
            raise ValueError(f"add_engines got {count} rollout procs; give whole engines: a "
                             f"multiple of engine_size={self.engine_size}")
        first = self.num_engines * self.engine_size
        agents = rollout_procs.spawn(f"{self.name}-rollout-{first}", TransferAgent)
        return dataclasses.replace(
            self, joined=self.joined + ((first, agents.flatten(AXIS)),),
            num_engines=self.num_engines + count // self.engine_size, rollout_base=first,
            spawned=self.spawned + (agents,))

    def close(self) -> None:
        """Release every worker of the group (RDMA buffers, references to parameters) and
        stop the agents. The procs and your actors stay."""
        for agents in self.spawned:
            agents.release.call(self.name).get(timeout=60)
            agents.stop().get(timeout=60)

    # -- inside an actor: this rank's worker ---------------------------------------------------

    def _wiring(self) -> dict:
        return {"control": MeshControl(self),
                "transport": MeshTransport(self.config.peer_timeout_s), "config": self.config}

    def sender(self, params, load_weights, spec, *, placement: Placement | None = None,
               kernels=None, cls=None):
        """This trainer rank's `SenderAdapter` (or ``cls``, a subclass); its rank is this
        actor's flat rank in its mesh."""
        from weightbridge.coordination.sender import SenderAdapter

        worker = (cls or SenderAdapter)(params, load_weights, spec, rank=current_rank().rank,
                               placement=placement, kernels=kernels, **self._wiring())
        _register(self.name, worker)
        return worker

    def receiver(self, params, load_weights, spec, *, placement: Placement | None = None,
                 before_update_hook=None, kernels=None, cls=None):
        """This rollout rank's `ReceiverAdapter` (or ``cls``, a subclass); its engine and
        engine rank follow from its flat rank and ``engine_size``."""
        from weightbridge.coordination.receiver import ReceiverAdapter

        rank = current_rank().rank + self.rollout_base
        worker = (cls or ReceiverAdapter)(params, load_weights, spec, rank=rank,
                                 engine=rank // self.engine_size,
                                 engine_rank=rank % self.engine_size,
                                 engine_size=self.engine_size, placement=placement,
                                 before_update_hook=before_update_hook, kernels=kernels,
                                 **self._wiring())
        _register(self.name, worker)
        return worker

    def worker(self, side: str, params, load_weights, spec, *, placement: Placement,
               kernels=None, cls=None):
        """This rank's plain `TransferWorker` (or ``cls``, a subclass), for a group a
        controller drives (`controller.MeshTransfer`)."""
        from weightbridge.coordination.worker import TransferWorker

        wiring = self._wiring()
        del wiring["control"]
        rank = current_rank().rank + (self.rollout_base if side == "rollout" else 0)
        worker = (cls or TransferWorker)(side, params, load_weights, spec,
                                         rank=rank, placement=placement,
                                         kernels=kernels, **wiring)
        _register(self.name, worker)
        return worker


def _size(mesh) -> int:
    return int(mesh.size())
