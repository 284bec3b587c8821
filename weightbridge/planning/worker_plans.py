"""One worker's view of a plan: copy descriptors and writes per round, built once per plan.

Inside buffers, bytes are in canonical checkpoint order: a run of an overlap's elements,
row-major, in the overlap's wire dtype; a box between a parameter of another dtype and the
buffer carries ``buffer_dtype``, so that worker's single pack (or assemble) launch converts;
a sender's box of a block-quantized overlap is whole blocks and carries its ``block`` (its pack
quantizes). A sender packs with its own pieces' strides and a receiver assembles with its own,
so transposes, fusions, padding and reversals on either side are just strides of a `BoxCopy`.

Typical usage (an executor at connect)::

    wplan = plan.for_worker(WorkerId("trainer", 3))
    tables = [kernels.build_table(r.pack, params) for r in wplan.rounds]
"""

from __future__ import annotations

import gc
import math
import operator
from itertools import chain

import numpy as np

from weightbridge.planning.route import RECEIVE, STAGES
from weightbridge.types import (BoxCopy, BufferWrite, Chunk, Overlap, Piece, Region, WorkerId,
                                WorkerPlan, WorkerRound, dtype_itemsize, scaled_tensor)


def worker_plan(plan, worker: WorkerId) -> WorkerPlan:
    """Build `WorkerPlan` for one worker of ``plan`` (a `TransferPlan`)."""
    return worker_plans(plan, [worker])[worker]


def worker_plans(plan, workers=None) -> dict[WorkerId, WorkerPlan]:
    """The `WorkerPlan` of every worker of ``plan`` (or of ``workers``), built together.

    The work is shared: the plan's columns are sorted once per side (rows a worker writes,
    rows written into it), contiguous writes are merged for all workers at once, and the
    copies of a segment are built once per source map, then shifted to each distinct buffer
    offset a worker of that map holds it at (replicas share theirs). Same result as one
    `worker_plan` per worker.
    """
    t = plan.tables
    workers = list(plan.workers if workers is None else workers)
    numbers = [plan.number(w) for w in workers]
    rnd = t.round
    num_workers = len(plan.workers)
    rows = np.arange(len(t.seg))
    if len(numbers) < num_workers:  # only the rows these workers write or receive
        mine = np.zeros(num_workers, dtype=bool)
        mine[numbers] = True
        rows = np.flatnonzero(mine[t.src] | mine[t.dst])
    # Rows each worker writes, in its order: round, stage, peer, peer offset (then row); the
    # first four folded into one key (fewer, faster sort passes).
    src, dst = t.src[rows], t.dst[rows]
    step = (rnd[rows] * len(STAGES) + t.stage[rows]).astype(np.int64)
    by_src = rows[np.lexsort((t.dst_offset[rows],
                              (src.astype(np.int64) * plan.num_rounds * len(STAGES) + step)
                              * num_workers + dst))]
    # Rows written into each worker, in the same order (the peer is the worker itself).
    by_dst = rows[np.lexsort((t.dst_offset[rows],
                              dst.astype(np.int64) * plan.num_rounds * len(STAGES) + step))]
    packed = by_src[t.stage[by_src] == RECEIVE]
    cuts = {name: np.searchsorted(side[rows], np.arange(num_workers + 1))
            for name, side, rows in (("out", t.src, by_src), ("pack", t.src, packed),
                                     ("in", t.dst, by_dst))}
    merged = _merged_writes(t, by_src, rnd, t.nbytes)
    # Millions of small acyclic objects: generational collection would rescan the growing
    # result again and again (half the time at Kimi-K2's scale) and can free nothing.
    collecting = gc.isenabled()
    gc.disable()
    try:
        boxes, pack_ids, assemble_ids = _all_copies(plan, packed, by_dst)
        out = {}
        for worker, me in zip(workers, numbers):
            smap = (plan.trainer_maps if worker.side == "trainer" else plan.rollout_maps)[
                worker.index]
            pk = slice(cuts["pack"][me], cuts["pack"][me + 1])
            asm = slice(cuts["in"][me], cuts["in"][me + 1])
            out[worker] = _one_plan(
                plan, worker, me, smap, by_src[cuts["out"][me]:cuts["out"][me + 1]],
                cuts["out"][me], merged, rnd,
                _per_round(rnd[packed[pk]], pack_ids[pk], boxes, plan.num_rounds),
                _per_round(rnd[by_dst[asm]], assemble_ids[asm], boxes, plan.num_rounds),
                repeated=_repeated_rounds(rnd[packed[pk]], t.seg[packed[pk]],
                                          len(t.seg_bytes)))
    finally:
        if collecting:
            gc.enable()
    return out


def _all_copies(plan, packed: np.ndarray, by_dst: np.ndarray):
    """(box lists, [P] list id of each packed row, [A] list id of each row written into its
    receiver): one list per distinct (source map, segment, buffer offset)."""
    t = plan.tables
    sides = list(plan.trainer_maps) + list(plan.rollout_maps)
    ids: dict[int, int] = {}
    maps = []
    for smap in sides:
        if id(smap) not in ids:
            ids[id(smap)] = len(maps)
            maps.append(smap)
    # A trainer's and a rollout's copies differ (one piece, or all) even for one map object.
    num_trainers = len(plan.trainers)
    worker_map = np.array([ids[id(m)] * 2 + (k >= num_trainers) for k, m in enumerate(sides)],
                          dtype=np.int64)
    m = np.concatenate([worker_map[t.src[packed]], worker_map[t.dst[by_dst]]])
    seg = np.concatenate([t.seg[packed], t.seg[by_dst]])
    off = np.concatenate([t.src_offset[packed], t.dst_offset[by_dst]])
    keys = np.stack([m, seg, off])
    order = np.lexsort(keys[::-1])
    new = np.ones(len(order), dtype=bool)
    if len(order) > 1:
        new[1:] = (np.diff(keys[:, order], axis=1) != 0).any(0)
    list_of = np.empty(len(order), dtype=np.int64)
    list_of[order] = np.cumsum(new) - 1
    firsts = order[new]
    copies = _Copies(plan)
    boxes = []
    last = None
    for mk, sg, o in zip(m[firsts].tolist(), seg[firsts].tolist(), off[firsts].tolist()):
        if last is not None and last[0] == mk and last[1] == sg:
            shift = o - last[2]
            boxes.append([BoxCopy(b.tensor, b.offset, b.shape, b.strides,
                                  b.buffer_offset + shift, b.buffer_dtype, b.block)
                          for b in last[3]])
        else:
            built = copies.build(maps[mk // 2], bool(mk % 2), sg, o)
            boxes.append(built)
            last = (mk, sg, o, built)
    return boxes, list_of[:len(packed)], list_of[len(packed):]


def _per_round(rounds: np.ndarray, list_ids: np.ndarray, boxes: list, num_rounds: int
               ) -> list[list]:
    """Per round, the boxes of the rows (sorted by round) in row order."""
    out = [[] for _ in range(num_rounds)]
    if not len(rounds):
        return out
    cuts = np.searchsorted(rounds, np.arange(num_rounds + 1))
    ids = list_ids.tolist()
    for r in np.flatnonzero(np.diff(cuts)).tolist():
        out[r] = list(chain.from_iterable(map(boxes.__getitem__, ids[cuts[r]:cuts[r + 1]])))
    return out


def _repeated_rounds(rounds: np.ndarray, segs: np.ndarray, num_segments: int) -> set[int]:
    """Rounds in which a worker writes one segment more than once (a P2P plan)."""
    if not len(rounds):
        return set()
    uniq, counts = np.unique(rounds * num_segments + segs, return_counts=True)
    return set((uniq[counts > 1] // num_segments).tolist())


def _merged_writes(t, by_src: np.ndarray, rnd: np.ndarray, nbytes: np.ndarray):
    """[B] first row (in ``by_src`` order) of each merged write and its bytes: consecutive rows
    of one writer, round, stage and peer whose ranges continue each other on both sides."""
    src, dst, stage = t.src[by_src], t.dst[by_src], t.stage[by_src]
    r, so, do, nb = rnd[by_src], t.src_offset[by_src], t.dst_offset[by_src], nbytes[by_src]
    cont = ((src[1:] == src[:-1]) & (r[1:] == r[:-1]) & (stage[1:] == stage[:-1])
            & (dst[1:] == dst[:-1]) & (so[1:] == so[:-1] + nb[:-1])
            & (do[1:] == do[:-1] + nb[:-1]))
    starts = np.flatnonzero(np.concatenate([[True], ~cont])) if len(src) else np.zeros(0, int)
    sums = np.add.reduceat(nb, starts) if len(starts) else np.zeros(0, np.int64)
    return starts, sums


def _one_plan(plan, worker, me, smap, rows_out, first_out, merged, rnd, pack, assemble, *,
              repeated: set[int]) -> WorkerPlan:
    t = plan.tables
    num_rounds = plan.num_rounds
    writes = [[] for _ in range(num_rounds)]
    workers = plan.workers
    starts, sums = merged
    lo = np.searchsorted(starts, first_out)
    hi = np.searchsorted(starts, first_out + len(rows_out))
    if hi > lo:
        firsts = rows_out[starts[lo:hi] - first_out]
        for r, stage, dst, so, do, n in zip(
                rnd[firsts].tolist(), t.stage[firsts].tolist(), t.dst[firsts].tolist(),
                t.src_offset[firsts].tolist(), t.dst_offset[firsts].tolist(),
                sums[lo:hi].tolist()):
            writes[r].append(BufferWrite(stage=STAGES[stage], peer=workers[dst], offset=so,
                                         peer_offset=do, nbytes=n))
    send = t.send_bytes[me]
    recv = t.recv_bytes[me]
    # A segment written to several receivers in one round (a P2P plan: no forwarding) is packed
    # once; WeightBridge's plans write each segment once (nothing to drop).
    rounds = tuple(WorkerRound(index=r, pack=tuple(dict.fromkeys(pack[r]) if r in repeated
                                                   else pack[r]),
                               writes=tuple(writes[r]), assemble=tuple(assemble[r]),
                               send_bytes=int(send[r]), recv_bytes=int(recv[r]))
                   for r in range(num_rounds))
    return WorkerPlan(worker=worker, placement=plan.placement(worker), params=smap.params,
                      buffer_bytes=int(max(send.max(initial=0), recv.max(initial=0))),
                      rounds=rounds)


class _Copies:
    """Builds the BoxCopies of a segment for a source map (its piece finder kept per map)."""

    def __init__(self, plan):
        self.plan = plan
        self.overlaps = plan.correspondence.overlaps
        self.finders: dict[tuple[int, bool], _PieceFinder] = {}
        self.chunks: dict[int, tuple] = {}
        self.per_overlap: dict[tuple[int, bool], dict[int, tuple]] = {}
        """Per finder: overlap -> (itemsize, region shape, targets in this map)."""
        self.boxes: dict[tuple, tuple] = {}
        """(shape, first, end) -> the sub-boxes (start, count, elements) of that flat run."""
        self.strides: dict[tuple, tuple[int, ...]] = {}
        """(piece steps, box count) -> the box's strides (0 where the count is 1)."""

    def build(self, smap, all_pieces: bool, seg: int, offset: int) -> list[BoxCopy]:
        """The copies of segment ``seg`` held at byte ``offset`` of a buffer, for ``smap``:
        per run of an overlap's elements, its row-major sub-boxes, once per piece holding it."""
        key = (id(smap), all_pieces)
        finder = self.finders.get(key)
        if finder is None:
            finder = self.finders[key] = _PieceFinder(smap, all_pieces=all_pieces)
            self.per_overlap[key] = {}
        known = self.per_overlap[key]
        chunks = self.chunks.get(seg)
        if chunks is None:  # a segment's sender and receivers share its chunks
            chunks = self.chunks[seg] = self.plan.placed_chunks(seg)
        out: list[BoxCopy] = []
        boxes, strides = self.boxes, self.strides
        for chunk, rel in chunks:
            if not all_pieces and self.overlaps[chunk.overlap].block:
                out += _quantizing(self.overlaps[chunk.overlap], chunk, offset + rel, finder)
                continue
            hit = known.get(chunk.overlap)
            if hit is None:
                overlap = self.overlaps[chunk.overlap]
                # A box between a parameter of another dtype and the wire converts.
                hit = known[chunk.overlap] = (dtype_itemsize(overlap.dtype),
                                              overlap.region.count,
                                              finder.targets(overlap.region),
                                              [None if d == overlap.dtype else overlap.dtype
                                               for d in finder.dtypes])
            size, shape, targets, buffer_dtype = hit
            sub = offset + rel
            span = (shape, chunk.start, chunk.start + chunk.count)
            sub_boxes = boxes.get(span)
            if sub_boxes is None:  # many runs cover a whole overlap of a common shape
                sub_boxes = boxes[span] = tuple((start, count, math.prod(count))
                                                for start, count in _flat_boxes(*span))
            for start, count, numel in sub_boxes:
                for param_index, base, steps in targets:
                    key = (steps, count)
                    box_strides = strides.get(key)
                    if box_strides is None:
                        box_strides = strides[key] = tuple(m if c > 1 else 0
                                                           for m, c in zip(steps, count))
                    out.append(BoxCopy(param_index, base + sum(map(operator.mul, start, steps)),
                                       count, box_strides, sub, buffer_dtype[param_index]))
                sub += numel * size
        return out


def _quantizing(overlap: Overlap, chunk: Chunk, sub: int, finder: "_PieceFinder"
                ) -> list[BoxCopy]:
    """A sender's copies of a run of a block-quantized overlap: boxes of whole blocks of its
    parameter, each writing float8 values (an overlap of the tensor) or float32 scales (an
    overlap of its `scale_tensor`: a grid box is the box of its blocks' elements, cut at the
    end of the trainer's piece, which the correspondence keeps at the tensor's end)."""
    region, block = overlap.region, overlap.block
    tensor = scaled_tensor(region.tensor)
    out = []
    for start, count in _flat_boxes(region.count, chunk.start, chunk.start + chunk.count):
        first = tuple(s + i for s, i in zip(region.start, start))
        if tensor is None:
            elements = Region(region.tensor, first, count, (1,) * len(count))
            assert all(f % b == 0 and (c % b == 0 or f + c == e) for f, c, b, e in zip(
                first, count, block, region.stop)), f"{elements} cuts a {block} block"
        else:
            lo = tuple(f * b for f, b in zip(first, block))
            # Of the pieces holding the first element, the one reaching furthest: the
            # correspondence made this sender a holder only if one holds the blocks whole (to
            # the tensor's end for its last blocks).
            one = (1,) * len(lo)
            hi = max((tuple(min((f + c) * b, e) for f, c, b, e in zip(first, count, block,
                                                                        p.region.stop))
                      for p in finder.candidates(Region(tensor, lo, one, one))),
                     key=lambda h: math.prod(e - s for e, s in zip(h, lo)))
            elements = Region(tensor, lo, tuple(h - low for h, low in zip(hi, lo)),
                              (1,) * len(lo))
        (param_index, base, steps), = finder.targets(elements)
        strides = tuple(m if c > 1 else 0 for m, c in zip(steps, elements.count))
        out.append(BoxCopy(param_index, base, elements.count, strides, sub,
                           overlap.dtype, block))
        sub += math.prod(count) * dtype_itemsize(overlap.dtype)
    return out


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
        self.placed: dict[Region, list[tuple[int, int, tuple[int, ...]]]] = {}

    def targets(self, region: Region) -> list[tuple[int, int, tuple[int, ...]]]:
        """(param index, storage offset of the region's first element, storage step per
        index of each region dim) of every piece holding ``region``: a sub-box at ``start``
        begins at ``offset + sum(start * step)``. Exact: a containing piece's step divides
        the region's start offset and, where the region has more than one index, its step."""
        hit = self.placed.get(region)
        if hit is None:
            hit = self.placed[region] = []
            for param_index, piece in self.find(region):
                src, base, steps = piece.region, piece.offset, []
                for d, stride in enumerate(piece.strides):
                    base += (region.start[d] - src.start[d]) // src.step[d] * stride
                    steps.append(region.step[d] // src.step[d] * stride)
                hit.append((param_index, base, tuple(steps)))
        return hit

    def candidates(self, region: Region) -> list[Piece]:
        """Every piece of this worker containing ``region`` (not cached)."""
        return [p for p in self.by_tensor.get(region.tensor, ()) if _contains(p.region, region)]

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
