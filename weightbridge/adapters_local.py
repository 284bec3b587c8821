"""In-process control plane and transport for the adapters: tests and single-process demos.

`LocalControl` holds every adapter of one transfer group and turns an adapter's call on a peer
into a direct method call (on a mesh, each becomes an actor endpoint call); `LocalTransport`
moves a write by copying into the peer's round arena (on a mesh, an RDMA write).

Typical usage::

    control = LocalControl(); transport = control.transport
    t = control.add(SenderAdapter(params, load_weights, spec, rank=0, control=control,
                                  transport=transport, options=opts))
    r = control.add(ReceiverAdapter(..., rank=0, engine=0, engine_rank=0, engine_size=1, ...))
    t.connect(); t.send_weights(1)    # with rollout threads calling r.poll_requests()

Peers are reached through `_Peer` handles that only forward ``_wb_`` calls, like actor
endpoints; `LocalControl.kill(worker)` makes a worker's calls and writes fail as a dead
process's would (the fail-closed tests).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from weightbridge.adapter_base import PeerFailed, gathered
from weightbridge.executor import Range
from weightbridge.types import WorkerId


class WorkerGone(ConnectionError):
    """A call or write to a worker that `LocalControl.kill` marked dead."""


class _Peer:
    """Another adapter as its peers see it: ``_wb_`` calls only, failing once it is killed."""

    def __init__(self, control: "LocalControl", adapter):
        self._control, self._adapter = control, adapter

    def __getattr__(self, name: str):
        if not name.startswith("_wb_"):
            raise AttributeError(name)
        worker = self._adapter.worker
        if worker in self._control.dead:
            raise WorkerGone(f"{worker} is gone (its process was killed)")
        return getattr(self._adapter, name)


class LocalControl:
    """Every adapter of one group, by side; plans for all of them at rank 0's connect."""

    def __init__(self):
        self._trainers: dict[int, object] = {}
        self._receivers: dict[int, object] = {}
        self.transport = LocalTransport(self)
        self.dead: set[WorkerId] = set()
        """Workers `kill` stopped: their calls and the writes into them raise `WorkerGone`."""

    def kill(self, worker: WorkerId) -> None:
        """Stand-in for a process that died: every later call or write to it fails."""
        self.dead.add(worker)

    def add(self, adapter):
        side = self._trainers if adapter.worker.side == "trainer" else self._receivers
        if adapter.worker.index in side:
            raise ValueError(f"{adapter.worker} was added twice")
        side[adapter.worker.index] = adapter
        return adapter

    def trainers(self) -> list:
        return [_Peer(self, self._trainers[i]) for i in sorted(self._trainers)]

    def receivers(self) -> list:
        return [_Peer(self, self._receivers[i]) for i in sorted(self._receivers)]

    def by_id(self, worker: WorkerId):
        return (self._trainers if worker.side == "trainer" else self._receivers)[worker.index]

    def sequencer(self):
        return _Peer(self, self._trainers[0])

    @property
    def num_engines(self) -> int:
        return 1 + max(r.engine for r in self._receivers.values())

    def engine(self, engine: int) -> list:
        """The receivers of one engine, by engine rank (rank 0 first)."""
        return [_Peer(self, r) for r in sorted(
            (r for r in self._receivers.values() if r.engine == engine),
            key=lambda r: r.engine_rank)]

    def gather(self, peers: list, name: str, *args, return_errors: bool = False) -> list:
        """The call on every peer at once (one thread each), then every result, in order.

        Raises the first peer's error once all have ended; ``return_errors``: the errors
        are returned in place of results instead.
        """
        def call(p):
            try:
                return getattr(p, name)(*args)
            except Exception as e:  # noqa: BLE001  (handed to the caller below)
                return PeerFailed(e)

        with ThreadPoolExecutor(max_workers=max(1, len(peers))) as pool:
            out = list(pool.map(call, peers))
        return gathered(out, return_errors)

    def call_all(self, peers: list, name: str, *args) -> None:
        for p in peers:
            getattr(p, name)(*args)

    def engine_rank0s(self) -> list:
        return [self.engine(e)[0] for e in range(self.num_engines)]



class LocalTransport:
    """Writes are copies into the peer's arena; needs the control to find the peer."""

    def __init__(self, control: LocalControl):
        self.control = control
        self.bytes_written = 0

    def write(self, peer: WorkerId, key: Range, src):
        parity, offset, nbytes = key
        if peer in self.control.dead:
            raise WorkerGone(f"writing {nbytes} bytes into {peer}: it is gone (killed)")
        self.control.by_id(peer).executor.arenas[parity][offset:offset + nbytes].copy_(src)
        self.bytes_written += nbytes
        return None

    def wait(self, futures) -> None:
        pass

    def register(self, arenas, ranges) -> dict:
        return {}  # peers' arenas are reached directly

    def set_peers(self, handles: dict) -> None:
        pass
