"""The two protocols a transfer group runs on: the control plane and the transport.

    ControlPlane  one worker's (or the controller's) calls on other workers: `PeerCall`s,
                  issued to many workers at once and awaited together (small messages)
    Transport     one worker's one-sided writes of round-buffer bytes into registered
                  ranges of a peer's round buffers (bulk bytes)

Every call a worker makes on another is a `PeerCall`, a declared enum; the worker object that
serves it implements the handler ``on_<value>`` (`weightbridge.coordination.worker.TransferWorker`
and the adapters). Implementations: `weightbridge.coordination.local_control` (direct calls and
copies in one process: tests, demos) and `weightbridge.mesh.control` (actor endpoints and Monarch
RDMA).

Typical usage (inside the library)::

    maps = control.call(workers(control), PeerCall.SOURCE_MAP)        # all at once
    await control.call_async(trainers(control), PeerCall.SEND_ROUND, r)
"""

from __future__ import annotations

import enum
from typing import Any, Mapping, Protocol, Sequence

from weightbridge.errors import library_error
from weightbridge.types import Range, WorkerId


class PeerCall(enum.Enum):
    """Every call one worker of a group makes on another; served by ``on_<value>``."""

    # Any worker (`TransferWorker`): connect, the rounds of an update, staging (STAGE on
    # trainers, INSTALL on rollouts), and FAIL (a rollout's engine is out of the group).
    CONFIG = "config"
    SOURCE_MAP = "source_map"
    PING = "ping"
    DIGEST = "digest"
    SETUP = "setup"
    RESETUP = "resetup"
    SET_PEERS = "set_peers"
    SEND_ROUND = "send_round"
    FORWARD = "forward"
    LAND = "land"
    ROUND = "round"
    WRITTEN = "written"
    ABANDON = "abandon"
    DRAIN = "drain"
    STAGE = "stage"
    INSTALL = "install"
    FAIL = "fail"
    # The sequencing trainer (rank 0) and the other trainers (`SenderAdapter`).
    PLANNING = "planning"
    CONNECT_FAILED = "connect_failed"
    READY = "ready"
    DELTA = "delta"
    UNCHANGED = "unchanged"
    PENDING = "pending"
    STAGE_START = "stage_start"
    STAGE_CANCEL = "stage_cancel"
    STAGE_FINISH = "stage_finish"
    FAILED = "failed"
    TRANSFERRED = "transferred"
    JOIN = "join"
    LEAVE = "leave"
    CLAIM = "claim"
    STATUS = "status"
    CHANGING = "changing"
    CHANGED = "changed"
    # Rollout workers (`ReceiverAdapter`).
    OFFER = "offer"
    RELAY = "relay"
    INSTALLED = "installed"
    SESSION_DONE = "session_done"

    @property
    def unbounded(self) -> bool:
        """Calls that may take longer than a peer timeout: probing and building tables grow
        with the model. (A re-plan of a connected group sets its workers up with `RESETUP`,
        the same work bounded by the peer timeout: on meshes an unbounded call is an
        endpoint call, whose state Monarch keeps in the caller for good, and delta updates
        whose tensors change may re-plan every update.)"""
        return self in (PeerCall.SOURCE_MAP, PeerCall.SETUP)

    @property
    def ordered(self) -> bool:
        """Calls a worker serves one at a time, in the order they arrive (on one thread): a
        trainer's sends, and every worker's rounds; and DRAIN, so that it is served after
        every send and round issued before it. (Rollouts serving their rounds side by
        side measured slower on the emulated cluster: round r + 1's forwards then share the
        rollout links with round r's, and round r lands later;
        docs/notes/emulated-cluster.md.)"""
        return self in (PeerCall.SEND_ROUND, PeerCall.ROUND, PeerCall.DRAIN)

    @property
    def posted(self) -> bool:
        """One-way messages (`ControlPlane.post`): nothing answers them, and the receiver
        serves them at once, beside its other calls. A lost one is noticed by whoever
        waits for what it said (bounded by the peer timeout)."""
        return self in (PeerCall.WRITTEN, PeerCall.ABANDON)

    @property
    def notice(self) -> bool:
        """Calls of the failure path, answered at once by a live worker (DRAIN once its
        steps of a failed update ended): bounded by `TransferConfig.notice_timeout_s`, not
        the peer timeout."""
        return self in (PeerCall.PING, PeerCall.FAIL, PeerCall.FAILED, PeerCall.STATUS,
                        PeerCall.DRAIN)

    def serve(self, target: Any, *args) -> Any:
        """Run this call on the worker object ``target`` (its ``on_<value>`` handler)."""
        handler = getattr(target, _HANDLERS[self], None)
        if handler is None:
            raise TypeError(f"{type(target).__name__} does not serve {self}: a transfer group "
                            f"mixes worker kinds (trainer calls sent to a rollout, or a "
                            f"controller worker in an adapter group)")
        return handler(*args)


_HANDLERS = {call: f"on_{call.value}" for call in PeerCall}
"""Each call's handler name, made once: CPython 3.11's method cache keeps a reference to the
name of each attribute it looks up (4,096 slots, chosen by the name object's address), so a
name made anew for every call can leave a string behind in one slot after another until
all hold one (a bounded cost, about 0.2 MB; measured on the meshes with the span and event
logs, not alone: a plain loop here left 3.5 B per call)."""


class ControlPlane(Protocol):
    """Where the workers of one group are, and how to call them.

    Trainer i is ``WorkerId("trainer", i)``; rollout worker j is ``WorkerId("rollout", j)``,
    rank ``j % engine_size`` of engine ``j // engine_size``.
    """

    num_trainers: int
    num_engines: int
    engine_size: int

    def call_each(self, peers: Sequence[WorkerId], call: PeerCall, args: Sequence[tuple],
                  *, return_errors: bool = False) -> list:
        """Issue ``call`` with ``args[i]`` on ``peers[i]``, all at once, wait for all, return
        the results in order.

        Raises the first peer's error once all have answered; with ``return_errors`` the errors
        are returned in place of results instead. Calls other than `PeerCall.unbounded` ones
        are bounded by the plane's peer timeout (`PeerCall.notice` ones by the shorter
        notice timeout).
        """
        ...

    def call(self, peers: Sequence[WorkerId], call: PeerCall, *args,
             return_errors: bool = False) -> list:
        """`call_each` with the same arguments for every peer."""
        ...

    async def call_async(self, peers: Sequence[WorkerId], call: PeerCall, *args) -> list:
        """`call`, awaited (the round sequencer issues many steps at once); the first peer's
        error is raised as soon as it comes, not once every peer answered."""
        ...

    def post(self, peers: Sequence[WorkerId], call: PeerCall, *args) -> None:
        """Send ``call`` (a `PeerCall.posted` one) to each of ``peers`` and return at once:
        no answer (a peer that is gone drops it). Raises, once every peer was tried, if a
        message could not be sent."""
        ...

    def addresses(self, peers: Sequence[WorkerId]) -> Mapping[WorkerId, Any]:
        """Where ``peers`` take messages, as another worker's plane can use them (`learn`):
        picklable; empty where every plane reaches every worker by itself."""
        ...

    def learn(self, addresses: Mapping[WorkerId, Any]) -> None:
        """Reach these peers at these `addresses` from now on (peers that joined the group
        after this plane was built)."""
        ...


class Transport(Protocol):
    """One worker's data plane: register its incoming ranges, write into its peers' ones."""

    def register(self, arenas: Sequence, ranges: Sequence[Range]) -> Mapping[Range, Any]:
        """Expose ``ranges`` of this worker's round buffers to writers; returns a picklable
        handle per range (replaces the ranges of an earlier plan)."""
        ...

    def set_peers(self, handles: Mapping[tuple[WorkerId, Range], Any]) -> None:
        """The handles of every peer range this worker writes into."""
        ...

    def write(self, writes: Sequence[tuple[WorkerId, Range, Any]]
              ) -> list[tuple[tuple[WorkerId, ...], Any]]:
        """Start writing one step's ``(peer, peer's range, source bytes)`` triples; returns
        (the peers it writes into, a future) for each batch of them that lands together."""
        ...

    def wait(self, futures: Sequence) -> None:
        """Block until every write landed (raises a failed write's error)."""
        ...


def trainers(control: ControlPlane) -> list[WorkerId]:
    return [WorkerId("trainer", i) for i in range(control.num_trainers)]


def rollouts(control: ControlPlane) -> list[WorkerId]:
    return [WorkerId("rollout", j) for j in range(control.num_engines * control.engine_size)]


def engine_workers(control: ControlPlane, engine: int) -> list[WorkerId]:
    """The rollout workers of one engine, engine rank 0 first."""
    size = control.engine_size
    return [WorkerId("rollout", j) for j in range(engine * size, (engine + 1) * size)]


class PeerFailed:
    """A peer call's error, held among a `call`'s results until every peer has answered."""

    def __init__(self, error: BaseException):
        self.error = error


def gathered(out: list, return_errors: bool) -> list:
    """`ControlPlane.call`'s results in peer order: raise the first peer's error, or, with
    ``return_errors``, return the errors in place of results. A peer's error is its
    `library_error` (the library's own exception out of a Monarch ``ActorError``), chained
    to what the control plane caught."""
    if not return_errors:
        for r in out:
            if isinstance(r, PeerFailed):
                inner = library_error(r.error)
                if inner is r.error:
                    raise inner
                raise inner from r.error
    return [library_error(r.error) if isinstance(r, PeerFailed) else r for r in out]
