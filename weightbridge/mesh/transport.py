"""Monarch RDMA for round buffers (`MeshTransport`, a worker's `Transport` on a mesh).

Monarch 0.7.0's `RDMABuffer` is 1-D and has no offset writes (``write_from`` fills the prefix of
the remote buffer), so a receiver registers one buffer per byte range that some peer writes into,
each over a view of one of its ``depth`` round arenas (`TransferConfig.depth`), once, at
connect. A writer then sends a slice of
its own arena into the handle of exactly that range. Handles are small picklable objects: they
travel through endpoint arguments (control plane); bytes move only through RDMA writes (data
plane): one ``write_from`` per range, all in flight at once, or one `monarch.rdma.RDMAAction`
of a step's ranges (`TransferConfig.rdma_writes`).

Typical usage::

    configure_transport()                                   # controller, before spawning procs
    handles = register_ranges(arenas, [(0, 4096, 65536)])   # receiver, once, at connect
    futures = [write(handles[key], arena[off:off + n]) for ...]   # writer, per stage
    wait_all(futures)                                       # or: write_batch([...]).get()
"""

from __future__ import annotations

import os
import warnings
from typing import Iterable, Mapping, Sequence

import monarch
import torch
from monarch.rdma import RDMAAction, RDMABuffer, RDMATcpFallbackWarning, get_rdma_backend

from weightbridge.mesh.registry import calls
from weightbridge.types import Range

DEFAULT_CHUNK_MB = 8
"""TCP-fallback chunk size: 4-16 MB chunks move about 2x the bytes of the 64 MB default here."""


MMAP_THRESHOLD = 128 << 10
"""glibc's ``MALLOC_MMAP_THRESHOLD_`` for the procs spawned after `configure_transport`."""


def configure_transport(chunk_mb: int = DEFAULT_CHUNK_MB) -> None:
    """Set the RDMA chunk size and the procs' allocator threshold; call in the controller
    before spawning (children inherit both).

    Host buffers of `MMAP_THRESHOLD` bytes and more (round arenas, staging slots, copy
    tables) are then mapped on their own and returned to the system when freed. glibc's
    default raises the threshold to the size of the last mapped buffer freed, so buffers made
    anew at every re-plan (delta updates with changing ``changed`` sets) came from the heap
    and their freed memory stayed resident: rollouts under receiver staging grew 80-115 KB
    per update (benchmarks/bench_soak.py --modes). An ``MALLOC_MMAP_THRESHOLD_`` already set
    is kept."""
    monarch.configure(rdma_max_chunk_size_mb=int(chunk_mb))
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(MMAP_THRESHOLD))


def backend() -> str:
    """The RDMA backend of this process: "ibverbs", or "tcp" (the fallback, no RDMA NIC)."""
    return str(get_rdma_backend())


def register_ranges(arenas: Sequence[torch.Tensor], ranges: Iterable[Range]
                    ) -> dict[Range, RDMABuffer]:
    """Register one RDMA buffer per distinct range of the arenas (1-D contiguous uint8 tensors).

    The buffers alias the arenas: bytes a peer writes land in the arena in place.

    Raises:
        ValueError: an arena that is not 1-D contiguous uint8, or a range outside its arena.
    """
    for i, a in enumerate(arenas):
        if a.dtype != torch.uint8 or a.dim() != 1 or not a.is_contiguous():
            raise ValueError(f"arena {i} is {a.dtype} {tuple(a.shape)}; RDMA arenas must be 1-D "
                             f"contiguous uint8 tensors (allocate with torch.empty(n, "
                             f"dtype=torch.uint8))")
    handles: dict[Range, RDMABuffer] = {}
    with warnings.catch_warnings():
        # Every receiving process would warn once about the TCP fallback; the controller
        # reports the backend once instead (`backend`).
        warnings.simplefilter("ignore", RDMATcpFallbackWarning)
        for index, offset, nbytes in sorted(set(ranges)):
            arena = arenas[index]
            if nbytes < 1 or offset < 0 or offset + nbytes > arena.numel():
                raise ValueError(f"range [{offset}, {offset + nbytes}) of arena {index} lies "
                                 f"outside its {arena.numel()} bytes; the plan and the arena "
                                 f"size disagree")
            handles[(index, offset, nbytes)] = RDMABuffer(arena[offset:offset + nbytes])
    return handles


def write(handle: RDMABuffer, src: torch.Tensor, *, timeout_s: int = 60):
    """Start writing ``src`` (a 1-D contiguous byte view) into the whole registered range.

    Returns a Monarch future; the write is sent eagerly. A receiver whose process is gone makes
    the write hang until ``timeout_s`` on the TCP fallback, so keep the timeout finite.
    """
    _check_covers(handle, src)
    return handle.write_from(src, timeout=timeout_s)


def _check_covers(handle: RDMABuffer, src: torch.Tensor) -> None:
    if src.numel() != handle.size():
        raise ValueError(f"writing {src.numel()} bytes into a registered range of "
                         f"{handle.size()} bytes; writes must cover exactly one registered range")


def write_batch(pairs: Sequence[tuple[RDMABuffer, torch.Tensor]], *, timeout_s: int = 60):
    """Start writing every ``(handle, src)`` pair as one `RDMAAction`: one future for the batch,
    resolved once every range landed or failing with the first failed one's error; the whole
    batch is bounded by ``timeout_s``. On the TCP fallback Monarch sends the ranges one after
    another, where each `write` is a submission of its own (`benchmarks/rdma_batch.py`)."""
    action = RDMAAction()
    for handle, src in pairs:
        _check_covers(handle, src)  # before anything is submitted
        action.write_remote(handle, src)
    return action.submit(timeout=timeout_s)


def wait_all(futures: Sequence) -> None:
    """Block until every write has landed (sync code: scripts and sync endpoints)."""
    for f in futures:
        f.get()


def drop_all(handles: Mapping[object, RDMABuffer]) -> None:
    """Deregister buffers (the arenas stay pinned until then)."""
    wait_all([h.drop() for h in handles.values()])


class MeshTransport:
    """Monarch RDMA behind the `weightbridge.coordination.control.Transport` calls: a step's
    writes go out as one `write` per range, or as one `write_batch` when ``batched``."""

    def __init__(self, timeout_s: float, *, batched: bool = False):
        self.timeout_s = max(1, int(timeout_s))
        self.batched = batched
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

    def write(self, writes) -> list:
        """Start a step's writes, ``(peer, key, src)`` each: one future per range, or one for
        them all when batched; (the peers a future writes into, the future) each."""
        if not writes:
            return []
        # (the receiver keeps state for each RDMA submission: registry.calls)
        if not self.batched:
            out = []
            for peer, key, src in writes:
                calls["write", peer.side] += 1
                out.append(((peer,), write(self.peers[(peer, key)], src,
                                           timeout_s=self.timeout_s)))
            return out
        peers = tuple(dict.fromkeys(peer for peer, _, _ in writes))
        calls["write", peers[0].side] += 1
        return [(peers, write_batch([(self.peers[(peer, key)], src) for peer, key, src in writes],
                                    timeout_s=self.timeout_s))]

    def wait(self, futures) -> None:
        wait_all(futures)
