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
"""

from __future__ import annotations

from weightbridge.executor import Range
from weightbridge.types import WorkerId


class LocalControl:
    """Every adapter of one group, by side; plans for all of them at rank 0's connect."""

    def __init__(self):
        self._trainers: dict[int, object] = {}
        self._receivers: dict[int, object] = {}
        self.transport = LocalTransport(self)

    def add(self, adapter):
        side = self._trainers if adapter.worker.side == "trainer" else self._receivers
        if adapter.worker.index in side:
            raise ValueError(f"{adapter.worker} was added twice")
        side[adapter.worker.index] = adapter
        return adapter

    def trainers(self) -> list:
        return [self._trainers[i] for i in sorted(self._trainers)]

    def receivers(self) -> list:
        return [self._receivers[i] for i in sorted(self._receivers)]

    def by_id(self, worker: WorkerId):
        return (self._trainers if worker.side == "trainer" else self._receivers)[worker.index]

    def sequencer(self):
        return self._trainers[0]

    @property
    def num_engines(self) -> int:
        return 1 + max(r.engine for r in self._receivers.values())

    def engine(self, engine: int) -> list:
        """The receivers of one engine, by engine rank (rank 0 first)."""
        return sorted((r for r in self._receivers.values() if r.engine == engine),
                      key=lambda r: r.engine_rank)

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
        self.control.by_id(peer).executor.arenas[parity][offset:offset + nbytes].copy_(src)
        self.bytes_written += nbytes
        return None

    def wait(self, futures) -> None:
        pass

    def register(self, arenas, ranges) -> dict:
        return {}  # peers' arenas are reached directly

    def set_peers(self, handles: dict) -> None:
        pass
