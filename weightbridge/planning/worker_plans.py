"""One worker's view of a plan: copy descriptors and writes per round, built once per plan.

Inside buffers, bytes are in canonical checkpoint order: a run of an overlap's elements,
row-major, in the overlap's wire dtype; a box between a parameter of another dtype and the
buffer carries ``buffer_dtype``, so that worker's single pack (or assemble) launch converts. A sender packs with its own pieces' strides and a receiver assembles with its own, so
transposes, fusions, padding and reversals on either side are just strides of a `BoxCopy`.

Typical usage (an executor at connect)::

    wplan = plan.for_worker(WorkerId("trainer", 3))
    tables = [kernels.build_table(r.pack, params) for r in wplan.rounds]
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from weightbridge.planning.route import RECEIVE, STAGES
from weightbridge.types import (BoxCopy, BufferWrite, Piece, Region, WorkerId, WorkerPlan,
                                WorkerRound, dtype_itemsize)


def worker_plan(plan, worker: WorkerId) -> WorkerPlan:
    """Build `WorkerPlan` for one worker of ``plan`` (a `TransferPlan`)."""
    t = plan.tables
    me = plan.number(worker)
    smap = (plan.trainer_maps if worker.side == "trainer" else plan.rollout_maps)[worker.index]
    finder = _PieceFinder(smap, all_pieces=worker.side == "rollout")
    overlaps = plan.correspondence.overlaps
    rnd = t.round
    pack = [[] for _ in range(plan.num_rounds)]
    assemble = [[] for _ in range(plan.num_rounds)]
    writes = [[] for _ in range(plan.num_rounds)]
    mine = np.flatnonzero((t.src == me) | (t.dst == me))
    mine = mine[np.lexsort((t.dst_offset[mine], t.dst[mine], t.stage[mine], rnd[mine]))]
    nbytes = t.nbytes
    workers = plan.workers
    for d in mine.tolist():
        r, seg = int(rnd[d]), int(t.seg[d])
        if t.src[d] == me:
            _add_write(writes[r], STAGES[int(t.stage[d])], workers[int(t.dst[d])],
                       int(t.src_offset[d]), int(t.dst_offset[d]), int(nbytes[d]))
            if t.stage[d] == RECEIVE:
                _add_copies(pack[r], plan.placed_chunks(seg), int(t.src_offset[d]), overlaps,
                            finder)
        if t.dst[d] == me:
            _add_copies(assemble[r], plan.placed_chunks(seg), int(t.dst_offset[d]), overlaps,
                        finder)
    send = t.send_bytes[me]
    recv = t.recv_bytes[me]
    # A segment written to several receivers in one round (a P2P plan: no forwarding) is packed
    # once; a no-op for WeightBridge's plans, where each segment has one RECEIVE write.
    rounds = tuple(WorkerRound(index=r, pack=tuple(dict.fromkeys(pack[r])),
                               writes=tuple(writes[r]), assemble=tuple(assemble[r]),
                               send_bytes=int(send[r]), recv_bytes=int(recv[r]))
                   for r in range(plan.num_rounds))
    return WorkerPlan(worker=worker, placement=plan.placement(worker), params=smap.params,
                      buffer_bytes=int(max(send.max(initial=0), recv.max(initial=0))),
                      rounds=rounds)


def _add_write(writes: list, stage, peer, offset: int, peer_offset: int, nbytes: int) -> None:
    """Append a write, merging it into the previous one when both ranges continue it."""
    if writes:
        last = writes[-1]
        if (last.stage is stage and last.peer == peer and last.offset + last.nbytes == offset
                and last.peer_offset + last.nbytes == peer_offset):
            writes[-1] = BufferWrite(stage=stage, peer=peer, offset=last.offset,
                                     peer_offset=last.peer_offset, nbytes=last.nbytes + nbytes)
            return
    writes.append(BufferWrite(stage=stage, peer=peer, offset=offset, peer_offset=peer_offset,
                              nbytes=nbytes))


def _add_copies(out: list, chunks, buffer_offset: int, overlaps, finder: "_PieceFinder") -> None:
    """BoxCopies between the buffer (a segment placed at ``buffer_offset``) and params."""
    for chunk, rel in chunks:
        overlap = overlaps[chunk.overlap]
        size = dtype_itemsize(overlap.dtype)
        targets = finder.find(overlap.region)
        sub = buffer_offset + rel
        for start, count in _flat_boxes(overlap.region.count, chunk.start,
                                        chunk.start + chunk.count):
            for param_index, piece in targets:
                box = _box(param_index, piece, overlap.region, start, count, sub)
                if finder.dtypes[param_index] != overlap.dtype:  # pack or assemble converts
                    box = dataclasses.replace(box, buffer_dtype=overlap.dtype)
                out.append(box)
            sub += math.prod(count) * size


def _box(param_index: int, piece: Piece, region: Region, start: tuple[int, ...],
         count: tuple[int, ...], buffer_offset: int) -> BoxCopy:
    """The parameter side of a sub-box (``start``, ``count`` in ``region`` index space)."""
    offset, strides = piece.offset, []
    src = piece.region
    for d, stride in enumerate(piece.strides):
        coord = region.start[d] + region.step[d] * start[d]
        offset += (coord - src.start[d]) // src.step[d] * stride
        strides.append(region.step[d] // src.step[d] * stride if count[d] > 1 else 0)
    return BoxCopy(tensor=param_index, offset=offset, shape=tuple(count), strides=tuple(strides),
                   buffer_offset=buffer_offset)


def _flat_boxes(shape: tuple[int, ...], lo: int, hi: int
                ) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Sub-boxes (start, count) covering flat row-major indices [lo, hi) of a box, in order."""
    if lo >= hi:
        return []
    if len(shape) <= 1:
        return [((lo,), (hi - lo,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    rest = len(shape) - 1
    out = []
    row = lo // inner
    if lo % inner:  # a partial first row
        end = min(hi, (row + 1) * inner)
        out += [((row,) + s, (1,) + c)
                for s, c in _flat_boxes(shape[1:], lo - row * inner, end - row * inner)]
        lo, row = end, row + 1
    last = hi // inner
    if last > row:  # whole rows
        out.append(((row,) + (0,) * rest, (last - row,) + tuple(shape[1:])))
    if hi > max(lo, last * inner):  # a partial last row
        out += [((last,) + s, (1,) + c) for s, c in _flat_boxes(shape[1:], 0, hi - last * inner)]
    return out


class _PieceFinder:
    """Which of a worker's pieces contain a given overlap region (cached by region)."""

    def __init__(self, smap, *, all_pieces: bool):
        self.index = {p.name: i for i, p in enumerate(smap.params)}
        self.dtypes = [p.dtype for p in smap.params]
        self.by_tensor: dict[str, list[Piece]] = {}
        for piece in smap.pieces:
            self.by_tensor.setdefault(piece.region.tensor, []).append(piece)
        self.all_pieces = all_pieces
        self.cache: dict[Region, list[tuple[int, Piece]]] = {}

    def find(self, region: Region) -> list[tuple[int, Piece]]:
        hit = self.cache.get(region)
        if hit is None:
            hit = [(self.index[p.param], p) for p in self.by_tensor.get(region.tensor, ())
                   if _contains(p.region, region)]
            assert hit, f"no piece of this worker contains {region}"
            if not self.all_pieces:
                hit = hit[:1]  # a sender needs one copy of the bytes
            self.cache[region] = hit
        return hit


def _contains(outer: Region, inner: Region) -> bool:
    for s, c, k, s2, c2, k2 in zip(outer.start, outer.count, outer.step,
                                   inner.start, inner.count, inner.step):
        last2 = s2 + k2 * (c2 - 1)
        if s2 < s or last2 > s + k * (c - 1) or (s2 - s) % k or (c2 > 1 and k2 % k):
            return False
    return True
