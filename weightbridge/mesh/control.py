"""`MeshControl`: the `weightbridge.coordination.control.ControlPlane` of a transfer group's
workers, over the group's agent meshes (`weightbridge.mesh.agent.TransferAgent`).

Every bounded `PeerCall` a worker makes is one message to the mailbox of the peer's proc
(`weightbridge.mesh.mailbox`: ports opened once, answers through the caller's own); probing
and setup, which may take unbounded time, are calls of the ``serve`` endpoint of the peer's
agent (to a run of consecutive ranks, one message); a worker's calls on itself run in its
process without a message. Monarch keeps state for every reply port it opens
(docs/failures.md, "Memory over many updates").

A worker sends every message as its process's agent (`Mailbox.as_owner`): one that cannot be
delivered (a peer's agent that stopped) comes back to the agent, which drops it, not to the
user's actor, which Monarch would fail.

The Monarch integration's modules, by job:

    registry    the workers of this process, by group (what an agent serves)
    agent       `TransferAgent`, the actor serving the peer calls
    mailbox     `Mailbox`, the ports a process's bounded calls go through
    control     `MeshControl`, the control plane over the agents (this module)
    group       `TransferGroup`, the handle: spawn, add_engines, close, build a rank's worker
    transport   Monarch RDMA (`MeshTransport`)
    monarch_api the private Monarch calls, checked against the installed version
    faults      the faults of the library's meshes, reported by the transfer, not fatal
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from typing import Sequence

from monarch.actor import ActorError

from weightbridge.coordination.control import PeerCall, PeerFailed, gathered
from weightbridge.errors import describe, surfaced
from weightbridge.mesh import registry
from weightbridge.mesh.mailbox import Mailbox, Pending
from weightbridge.mesh.registry import calls
from weightbridge.types import WorkerId

__all__ = ["AXIS", "MeshControl", "mesh_size"]

AXIS = "weightbridge_rank"
"""The one axis of the flattened agent meshes."""


class MeshControl:
    """A `weightbridge.coordination.control.ControlPlane` over the agents of one group (a
    `weightbridge.mesh.group.TransferGroup`, which builds it: this module does not import it)."""

    poll_interval_s = 0.01
    """Waits on remote state poll it over endpoint calls: at most 100 calls a second."""

    def __init__(self, group):
        self.engine_size = group.engine_size
        self._agents: dict = {}
        """Each peer's agent, sliced once: Monarch 0.7 keeps native state for every slice it
        sends through (about 10 KB each, never freed), so a slice per call grew every
        process by that much per peer call (docs/failures.md, "Memory over many
        updates")."""
        self._last_ordered: dict[PeerCall, asyncio.Future] = {}
        """`PeerCall.ordered` call -> the newest one issued (`call_async`)."""
        self._box: Mailbox | None = None
        self._own_box = False
        self._inboxes: dict[WorkerId, object] = {}
        """Each peer's mailbox inbox port, asked for once (`_inbox`)."""
        self.use(group)

    def use(self, group) -> None:
        """Address ``group`` from now on: the same group grown by `TransferGroup.add_engines`
        (the agents sliced so far stay valid: old segments never change)."""
        self.group = group
        self.num_trainers, self.num_engines = group.num_trainers, group.num_engines
        # A group shrunk back (a join rolled back, `TransferGroup.undo_add_engines`): the
        # agents cached for ranks beyond it are gone; a later join's ranks are others'.
        # An engine retired (`TransferGroup.retire_engine`): its agents are stopped.
        end = group.num_engines * group.engine_size
        retired = [(first, first + group.engine_size) for first, agents in group.joined
                   if agents is None]
        for cache in (self._agents, self._inboxes):
            for key in [k for k in cache if _rank_of(k) >= end or
                        any(a <= _rank_of(k) < b for a, b in retired)]:
                del cache[key]
        self._segments = {"trainer": ((0, group.trainer_agents),),
                          "rollout": ((0, group.rollout_agents),) + group.joined}

    def _segment(self, peer: WorkerId) -> tuple[int, object]:
        """(first rank, agent mesh) of the segment of ``peer``'s side holding it."""
        for first, mesh in reversed(self._segments[peer.side]):
            if peer.index >= first:
                assert mesh is not None, f"{peer}: its engine was retired (nothing calls it)"
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
        if peers[-1].index >= base + mesh_size(whole):
            return None
        key = (side, first, len(peers))
        mesh = self._agents.get(key)
        if mesh is None:
            lo = first - base
            mesh = self._agents[key] = (whole if lo == 0 and len(peers) == mesh_size(whole) else
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

    def _me(self, peers: Sequence[WorkerId]) -> WorkerId | None:
        """This process's worker of the group when it is among ``peers`` (its calls on itself
        run here, on the group's threads, as the agent would run them: no message)."""
        worker = registry.local(self.group.name)
        me = getattr(worker, "worker", None)
        return me if me in peers else None

    def _local(self, call: PeerCall, args: tuple):
        """Run ``call`` on this process's worker as its agent would (`registry.submit`)."""
        calls["local", call.value] += 1
        context = contextvars.copy_context()
        return _Local(registry.submit(self.group.name, call, context.run, _serve_local,
                                      self.group.name, call, args))

    def _issue(self, peer: WorkerId, call: PeerCall, args: tuple):
        """``call`` to ``peer``: through the mailboxes when bounded (`mailed`), else an
        endpoint call (a peer that dies while probing or setting up fails it)."""
        if mailed(call):
            try:
                return self._mailbox().send(self._inbox(peer), call, args)
            except TimeoutError:  # (asking for its inbox; Monarch's says only "TimeoutError")
                return Pending.failed(_timed_out(call, [peer], self.group.config
                                                 .peer_timeout_s), call)
            except Exception as e:  # noqa: BLE001  (raised where its answer would be)
                return Pending.failed(e, call)
        calls["sent", call.value] += 1
        return self._mailbox().as_owner(self._agent(peer).serve.call_one, self.group.name,
                                        call, *args)

    def _mailbox(self) -> Mailbox:
        """This process's mailbox of the group: its agent's (asked for once; the calls it
        answers come back to it), or, in a process without one (the controller), this
        object's own, answers only."""
        if self._box is None:
            name = self.group.name
            box = registry.mailbox(name)
            if box is None:
                me = getattr(registry.local(name), "worker", None)
                if me is not None:
                    self._agent(me).inbox.call_one(name).get(timeout=self.group.config
                                                             .peer_timeout_s)
                    box = registry.mailbox(name)
                else:
                    box, self._own_box = Mailbox(name, serve=False), True
            self._box = box
        return self._box

    def _inbox(self, peer: WorkerId):
        port = self._inboxes.get(peer)
        if port is None:  # a race only asks twice; either port serves
            calls["sent", "inbox"] += 1
            port = self._mailbox().as_owner(self._ask_inbox, peer)
            port.return_undeliverable = False  # (module docstring of weightbridge.mesh.mailbox)
            self._inboxes[peer] = port
        return port

    def _ask_inbox(self, peer: WorkerId):
        return self._mailbox().wait(self._agent(peer).inbox.call_one(self.group.name),
                                    self.group.config.peer_timeout_s)

    def post(self, peers: Sequence[WorkerId], call: PeerCall, *args) -> None:
        """``call`` to each of ``peers``' mailboxes, one message each, no answer (a peer
        whose process stopped drops it). A message that could not be sent (its peer's inbox
        not found within the peer timeout) raises, once every peer was tried."""
        me = self._me(peers)
        failed: list[tuple[WorkerId, Exception]] = []
        for peer in peers:
            try:
                if peer == me:
                    call.serve(registry.lookup(self.group.name), *args)
                else:
                    self._mailbox().post(self._inbox(peer), call, args)
            except Exception as e:  # noqa: BLE001  (the others are still told; raised below)
                failed.append((peer, e))
        if failed:
            peer, error = failed[0]
            raise RuntimeError(f"{call.value} could not be sent to {peer}"
                               f"{f' and {len(failed) - 1} more' if len(failed) > 1 else ''}: "
                               f"{describe(error)}") from error

    def addresses(self, peers: Sequence[WorkerId]) -> dict:
        """Each peer's mailbox inbox port (asked for once): a worker's `learn` takes them."""
        return {p: self._inbox(p) for p in peers}

    def learn(self, addresses) -> None:
        """Take these peers' inbox ports (`addresses`): posts reach them without slicing
        their agents, which a worker built before they joined cannot."""
        for port in addresses.values():  # (as `_inbox` does; a port is rebuilt on arrival)
            port.return_undeliverable = False
        self._inboxes.update(addresses)

    def close(self) -> None:
        """End the threads of this object's own mailbox (a controller's); a worker's is its
        agent's, closed with the group."""
        if self._own_box and self._box is not None:
            self._box.close("the controller closed it")
            self._box = None

    def _issue_run(self, mesh, call: PeerCall, args: tuple):
        """``call`` to every agent of ``mesh`` (`_run`), one message."""
        calls["sent", call.value] += 1
        return self._mailbox().as_owner(mesh.serve.call, self.group.name, call, *args)

    def call_each(self, peers: Sequence[WorkerId], call: PeerCall, args: Sequence[tuple],
                  *, return_errors: bool = False) -> list:
        me = self._me(peers)
        futures = [self._local(call, a) if p == me else self._issue(p, call, a)
                   for p, a in zip(peers, args)]
        out, timeout = [], self._timeout(call)
        deadline = None if timeout is None else time.monotonic() + timeout
        for peer, f in zip(peers, futures):
            try:  # (one deadline for all: peers that died cost one timeout, not one each)
                out.append(f.get(timeout=None if deadline is None else
                                 max(0.0, deadline - time.monotonic())))
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
        with surfaced():  # (a peer's library error reaches the caller as itself)
            return self._call(peers, call, args, return_errors)

    def _call(self, peers: Sequence[WorkerId], call: PeerCall, args: tuple,
              return_errors: bool) -> list:
        me = None if return_errors else self._me(peers)
        if me is not None:  # this worker here, the others as below
            mine = self._local(call, args)
            rest = [p for p in peers if p != me]
            out = self._call(rest, call, args, False) if rest else []
            try:
                out.insert(list(peers).index(me), mine.get(timeout=self._timeout(call)))
            except TimeoutError:
                raise _timed_out(call, [me], self._timeout(call)) from None
            return out
        run = None if return_errors or mailed(call) else self._run(peers)
        if run is None:
            return self.call_each(peers, call, [args] * len(peers), return_errors=return_errors)
        try:
            return list(self._issue_run(run, call, args).get(timeout=self._timeout(call))
                        .values())
        except TimeoutError:
            raise _timed_out(call, peers, self._timeout(call)) from None

    async def call_async(self, peers: Sequence[WorkerId], call: PeerCall, *args) -> list:
        """One message to the peers' agents when they are consecutive ranks (the rounds' steps
        go to every trainer or rollout): Monarch keeps about 1.5 KB per call that never goes
        away in the caller (docs/failures.md, "Memory over many updates"), so one call
        for all costs the sequencing trainer a few times less than one call per peer."""
        timeout = self._timeout(call)
        me = self._me(peers)
        pieces = []  # all issued before any wait: one message per run of consecutive ranks
        if me is not None:  # (its answer goes back to its place below)
            pieces.append(_one_value(asyncio.wrap_future(self._local(call, args).future)))
        rest = [p for p in peers if p != me]
        for run in ([[p] for p in rest] if mailed(call) else self._runs(rest)):
            mesh = self._run(run)
            pieces.append(_values(self._issue_run(mesh, call, args)) if mesh is not None else
                          _one_value(_awaitable(self._issue(run[0], call, args))))
        answers = asyncio.ensure_future(_surfaced(_flattened(pieces, None if me is None else
                                                             list(peers).index(me))))
        if call.ordered:
            # A worker serves its sends (its rounds) in order, so this one's clock starts once
            # the one issued before it answered (bounded itself): a stalled worker surfaces
            # within one peer timeout of its stall, not depth of them. (Keyed by the call
            # alone: consecutive rounds may reach different workers that share some.)
            before, self._last_ordered[call] = self._last_ordered.get(call), answers
            if before is not None and before.get_loop() is asyncio.get_running_loop():
                await asyncio.wait([before])
        try:
            return list(await asyncio.wait_for(answers, timeout))
        except asyncio.TimeoutError:
            raise _timed_out(call, peers, timeout) from None


async def _surfaced(answers):
    with surfaced():
        return await answers


def _timed_out(call: PeerCall, peers: Sequence[WorkerId], timeout: float) -> TimeoutError:
    names = ", ".join(str(p) for p in peers)
    return TimeoutError(f"{call.value} to {names} did not answer within {timeout:g}s "
                        f"(TransferConfig.timeout_s): a peer is stalled or its process died")


def _rank_of(key) -> int:
    """The first rollout rank a cache key of `MeshControl` addresses (a worker, or a run:
    (side, first rank, length)); -1 for a trainer's."""
    side, first = (key.side, key.index) if isinstance(key, WorkerId) else key[:2]
    return first if side == "rollout" else -1


def mailed(call: PeerCall) -> bool:
    """Whether ``call`` goes through the mailboxes (`weightbridge.mesh.mailbox`): every call
    bounded by a timeout. Probing and setup stay endpoint calls."""
    return not call.unbounded


def _awaitable(future):
    """A `Pending` (mailbox) as an asyncio future; a Monarch future as it is."""
    return asyncio.wrap_future(future.future) if isinstance(future, Pending) else future


async def _one_value(future) -> list:
    return [await future]


async def _flattened(pieces, local_at: int | None = None) -> list:
    """The answers of ``pieces`` in order; with ``local_at``, the first piece is the local
    worker's answer, which goes at that index."""
    out = [a for answers in await asyncio.gather(*pieces) for a in answers]
    if local_at is not None:
        out.insert(local_at, out.pop(0))
    return out


class _Local:
    """A local call's future with a Monarch future's ``get``."""

    def __init__(self, future):
        self.future = future

    def get(self, timeout: float | None = None):
        return self.future.result(timeout)


def _serve_local(group: str, call: PeerCall, args: tuple):
    """Run ``call`` on this process's worker; its error as a served call's (`ActorError`)."""
    try:
        return call.serve(registry.lookup(group, 0), *args)
    except Exception as e:  # noqa: BLE001  (the same error a call through the agent raises)
        raise ActorError(e, f"Actor call TransferAgent.serve({call.value}) failed.") from e


async def _values(future) -> list:
    """A mesh call's answers, in the order of its ranks."""
    return list((await future).values())


def mesh_size(mesh) -> int:
    """How many procs (or actors) ``mesh`` holds."""
    return int(mesh.size())
