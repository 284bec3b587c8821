"""The one-worker-at-a-time `WorkerPlan` builder that `worker_plans` replaced: the reference
the shared, all-workers builder must reproduce exactly (tests/test_worker_plans.py)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from weightbridge.planning.box_copies import PieceFinder, flat_boxes, quantizing
from weightbridge.planning.route import RECEIVE, STAGES
from weightbridge.types import (BoxCopy, BufferWrite, Piece, Region, WorkerId, WorkerPlan,
                                WorkerRound, dtype_itemsize)


def reference_worker_plan(plan, worker: WorkerId) -> WorkerPlan:
    """Build `WorkerPlan` for one worker of ``plan`` (a `TransferPlan`)."""
    t = plan.tables
    me = plan.number(worker)
    smap = (plan.trainer_maps if worker.side == "trainer" else plan.rollout_maps)[worker.index]
    finder = PieceFinder(smap, all_pieces=worker.side == "rollout")
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


def _add_copies(out: list, chunks, buffer_offset: int, overlaps, finder: "PieceFinder") -> None:
    """BoxCopies between the buffer (a segment placed at ``buffer_offset``) and params; a
    sender's of a block-quantized overlap are `quantizing`'s."""
    for chunk, rel in chunks:
        overlap = overlaps[chunk.overlap]
        sub = buffer_offset + rel
        if overlap.block and not finder.all_pieces:
            out += quantizing(overlap, chunk.start, chunk.start + chunk.count, sub, finder)
            continue
        size = dtype_itemsize(overlap.dtype)
        targets = finder.find(overlap.region)
        for start, count in flat_boxes(overlap.region.count, chunk.start,
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
