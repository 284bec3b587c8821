"""The BoxCopies of a segment for a source map: per run of an overlap's elements, its row-major
sub-boxes, once per piece of the map holding it (`Copies.build`, used by `worker_plans`); a
sender's run of a block-quantized overlap, boxes of whole blocks (`quantizing`).

Also `segment_chunks` (every segment's overlap runs, as columns).
"""

from __future__ import annotations

import dataclasses
import math
from itertools import chain, repeat
from operator import attrgetter

import numpy as np

from weightbridge.types import (BoxCopy, Overlap, Piece, Region, dtype_itemsize,
                                scaled_tensor)

BOX_FIELDS = tuple(f.name for f in dataclasses.fields(BoxCopy))
"""`BoxCopy`'s fields, in order: the columns of each part of `Copies.parts`."""


class Copies:
    """Builds the BoxCopies of segments, one source map at a time, as field columns (numpy
    arrays, so that `worker_plans` makes them, and the copies shifted from them, in one pass).

    Vectorized over a map's (segment, chunk, sub-box, piece) products: only the pieces holding
    each overlap (`PieceFinder.targets`) and the sub-boxes of each distinct (overlap shape,
    element range) are found in Python. A sender's block-quantized overlaps are the exception:
    their boxes are whole blocks, not sub-boxes of the run, and `quantizing` builds them chunk
    by chunk (their tensors are few, and only the trainers' pack quantizes)."""

    def __init__(self, plan, needed: np.ndarray | None = None):
        self.overlaps = plan.correspondence.overlaps
        # The segments' chunks as columns: a segment's sender and receivers share them.
        self.cuts, self.overlap, self.first, self.count, self.rel = segment_chunks(plan, needed)
        self.dims = max([len(o.region.count) for o in self.overlaps] + [1])
        self._sub = self._sub_boxes()
        self.parts: list[tuple[np.ndarray, ...]] = []
        """Per `build`: the fields of its boxes, in `BoxCopy` field order."""

    def _sub_boxes(self):
        """Per chunk, the row-major sub-boxes of its run: [C + 1] cuts, then per sub-box its
        start and count ([B, dims], padded with 0 and 1), count tuple, number of dims and
        element offset from its chunk's first element."""
        pad, overlaps = self.dims, self.overlaps
        cache: dict[tuple, tuple] = {}
        starts, counts, shapes, per_chunk = [], [], [], []
        for o, first, count in zip(self.overlap.tolist(), self.first.tolist(),
                                   self.count.tolist()):
            span = (overlaps[o].region.count, first, first + count)
            hit = cache.get(span)
            if hit is None:  # many runs cover a whole overlap of a common shape
                boxes = flat_boxes(*span)
                hit = cache[span] = (
                    [b + (0,) * (pad - len(b)) for b, _ in boxes],
                    [c + (1,) * (pad - len(c)) for _, c in boxes], [c for _, c in boxes])
            starts += hit[0]
            counts += hit[1]
            shapes += hit[2]
            per_chunk.append(len(hit[2]))
        n = np.array(per_chunk, dtype=np.int64)
        counts = np.array(counts, dtype=np.int64).reshape(-1, pad)
        elems = counts.prod(1)
        before = np.cumsum(elems) - elems
        cuts = np.concatenate(([0], np.cumsum(n)))
        before -= np.repeat(before[cuts[:-1]], n) if len(n) else 0
        return (cuts, np.array(starts, dtype=np.int64).reshape(-1, pad), counts,
                np.fromiter(shapes, dtype=object, count=len(shapes)),
                np.fromiter(map(len, shapes), dtype=np.int64, count=len(shapes)), before)

    def build(self, smap, all_pieces: bool, segs: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """Append the copies of each segment of ``segs`` held at the byte of ``offsets`` in a
        buffer, for ``smap``: per run of an overlap's elements, its row-major sub-boxes, once
        per piece holding it (for a sender, a block-quantized run's `quantizing` boxes instead).
        Returns each segment's number of boxes."""
        finder = PieceFinder(smap, all_pieces=all_pieces)
        n = self.cuts[segs + 1] - self.cuts[segs]
        chunk = concat_ranges(self.cuts[segs], n)  # [U] the chunks of each segment, in order
        seg_of = np.repeat(np.arange(len(segs)), n)
        used, which = np.unique(self.overlap[chunk], return_inverse=True)
        # The pieces holding each overlap used, and the itemsize of each.
        pad, dtypes = self.dims, finder.dtypes
        t_n, tp, tb, ts, tdt, size = [], [], [], [], [], []
        quantized = np.zeros(len(used), dtype=bool)
        for i, o in enumerate(used.tolist()):
            overlap = self.overlaps[o]
            wire = overlap.dtype
            size.append(dtype_itemsize(wire))
            if overlap.block and not all_pieces:  # no sub-box per piece: left to quantizing
                quantized[i] = True
                t_n.append(0)
                continue
            targets = finder.targets(overlap.region)
            t_n.append(len(targets))
            for p, base, steps in targets:
                tp.append(p)
                tb.append(base)
                ts.append(steps + (0,) * (pad - len(steps)))
                # A box between a parameter of another dtype and the wire converts.
                tdt.append(None if dtypes[p] == wire else wire)
        t_n = np.array(t_n, dtype=np.int64)
        t_first = np.cumsum(t_n) - t_n
        ts = np.array(ts, dtype=np.int64).reshape(-1, pad)
        # One box per (chunk, sub-box, piece), sub-boxes outer, pieces inner.
        cuts, starts, counts, shapes, ndims, before = self._sub
        k_s, k_t = cuts[chunk + 1] - cuts[chunk], t_n[which]
        m = k_s * k_t
        use = np.repeat(np.arange(len(chunk)), m)
        local = np.arange(int(m.sum())) - np.repeat(np.cumsum(m) - m, m)
        sub = cuts[chunk][use] + local // k_t[use]
        tg = t_first[which][use] + local % k_t[use]
        steps = ts[tg]
        offset = np.array(tb, dtype=np.int64)[tg] + (starts[sub] * steps).sum(1)
        chunk_at = np.repeat(offsets, n) + self.rel[chunk]  # [U] each chunk's buffer byte
        at = chunk_at[use] + before[sub] * np.array(size, dtype=np.int64)[which[use]]
        strides = _strides(np.where(counts[sub] > 1, steps, 0), ndims[sub])
        columns = [np.array(tp, dtype=np.int64)[tg], offset, shapes[sub], strides, at,
                   np.fromiter(tdt, dtype=object, count=len(tdt))[tg],
                   np.fromiter(repeat((), len(tg)), dtype=object, count=len(tg))]  # block
        if quantized.any():
            use, columns = self._with_quantizing(finder, chunk, np.flatnonzero(
                quantized[which]), chunk_at, use, columns)
        self.parts.append(tuple(columns))
        return np.bincount(seg_of[use], minlength=len(segs)) if len(use) else np.zeros(
            len(segs), dtype=np.int64)

    def _with_quantizing(self, finder, chunk, q, chunk_at, use, columns):
        """``use`` (each box's chunk, of ``chunk``) and ``columns`` with the `quantizing` boxes
        of the chunks ``q`` (indices into ``chunk``) put in, in chunk order."""
        made = [quantizing(self.overlaps[o], first, first + count, at, finder)
                for o, first, count, at in zip(self.overlap[chunk[q]].tolist(),
                                               self.first[chunk[q]].tolist(),
                                               self.count[chunk[q]].tolist(),
                                               chunk_at[q].tolist())]
        boxes = list(chain.from_iterable(made))
        use = np.concatenate([use, np.repeat(q, [len(b) for b in made])])
        order = np.argsort(use, kind="stable")  # a quantized chunk has no other boxes
        columns = [np.concatenate([c, np.fromiter(map(attrgetter(f), boxes), dtype=c.dtype,
                                                  count=len(boxes))])[order]
                   for f, c in zip(BOX_FIELDS, columns)]
        return use[order], columns


def quantizing(overlap: Overlap, lo: int, hi: int, at: int, finder: "PieceFinder"
               ) -> list[BoxCopy]:
    """A sender's copies of elements [lo, hi) (row-major) of a block-quantized overlap, held
    from byte ``at`` of a buffer: boxes of whole blocks of its parameter, each writing float8
    values (an overlap of the tensor) or float32 scales (an overlap of its `scale_tensor`: a
    grid box is the box of its blocks' elements, cut at the end of the trainer's piece, which
    the correspondence keeps at the tensor's end)."""
    region, block = overlap.region, overlap.block
    tensor = scaled_tensor(region.tensor)
    out = []
    for start, count in flat_boxes(region.count, lo, hi):
        first = tuple(s + i for s, i in zip(region.start, start))
        if tensor is None:
            elements = Region(region.tensor, first, count, (1,) * len(count))
            assert all(f % b == 0 and (c % b == 0 or f + c == e) for f, c, b, e in zip(
                first, count, block, region.stop)), f"{elements} cuts a {block} block"
        else:
            low = tuple(f * b for f, b in zip(first, block))
            # Of the pieces holding the first element, the one reaching furthest: the
            # correspondence made this sender a holder only if one holds the blocks whole (to
            # the tensor's end for its last blocks).
            one = (1,) * len(low)
            high = max((tuple(min((f + c) * b, e) for f, c, b, e in zip(first, count, block,
                                                                          p.region.stop))
                        for p in finder.candidates(Region(tensor, low, one, one))),
                       key=lambda h: math.prod(e - s for e, s in zip(h, low)))
            elements = Region(tensor, low, tuple(h - s for h, s in zip(high, low)),
                              (1,) * len(low))
        (param_index, base, steps), = finder.targets(elements)
        strides = tuple(m if c > 1 else 0 for m, c in zip(steps, elements.count))
        out.append(BoxCopy(param_index, base, elements.count, strides, at, overlap.dtype,
                           block))
        at += math.prod(count) * dtype_itemsize(overlap.dtype)
    return out


def _strides(masked: np.ndarray, ndims: np.ndarray) -> np.ndarray:
    """[B] stride tuples (object array) of the rows of ``masked`` ([B, dims]) cut to their
    number of dims: one tuple per distinct row, shared."""
    out = np.empty(len(masked), dtype=object)
    for d in np.unique(ndims).tolist():
        rows = np.flatnonzero(ndims == d)
        if not d:  # 0-d tensors
            out[rows] = np.fromiter([()] * len(rows), dtype=object, count=len(rows))
            continue
        uniq, inverse = np.unique(masked[rows, :d], axis=0, return_inverse=True)
        made = np.fromiter(map(tuple, uniq.tolist()), dtype=object, count=len(uniq))
        out[rows] = made[inverse.reshape(-1)]
    return out


def concat_ranges(at: np.ndarray, n: np.ndarray) -> np.ndarray:
    """``at[i] .. at[i] + n[i] - 1`` for every ``i``, concatenated."""
    ends = np.cumsum(n)
    return np.repeat(at - ends + n, n) + np.arange(int(ends[-1]) if len(n) else 0)


def flat_boxes(shape: tuple[int, ...], lo: int, hi: int
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
                for s, c in flat_boxes(shape[1:], lo - row * inner, end - row * inner)]
        lo, row = end, row + 1
    last = hi // inner
    if last > row:  # whole rows
        out.append(((row,) + (0,) * rest, (last - row,) + tuple(shape[1:])))
    if hi > max(lo, last * inner):  # a partial last row
        out += [((last,) + s, (1,) + c) for s, c in flat_boxes(shape[1:], 0, hi - last * inner)]
    return out


class PieceFinder:
    """Which of a worker's pieces contain a given overlap region (cached by region)."""

    def __init__(self, smap, *, all_pieces: bool):
        self.index = {p.name: i for i, p in enumerate(smap.params)}
        self.dtypes = [p.dtype for p in smap.params]
        self.by_tensor: dict[str, list[Piece]] = {}
        for piece in smap.pieces:
            self.by_tensor.setdefault(piece.region.tensor, []).append(piece)
        self.all_pieces = all_pieces
        self.cache: dict[Region, list[tuple[int, Piece]]] = {}

    def targets(self, region: Region) -> list[tuple[int, int, tuple[int, ...]]]:
        """(param index, storage offset of the region's first element, storage step per
        index of each region dim) of every piece holding ``region``: a sub-box at ``start``
        begins at ``offset + sum(start * step)``. Exact: a containing piece's step divides
        the region's start offset and, where the region has more than one index, its step.
        Not cached (`Copies` keeps the answer per overlap)."""
        out = []
        for param_index, piece in self._find(region):
            src, base, steps = piece.region, piece.offset, []
            for d, stride in enumerate(piece.strides):
                base += (region.start[d] - src.start[d]) // src.step[d] * stride
                steps.append(region.step[d] // src.step[d] * stride)
            out.append((param_index, base, tuple(steps)))
        return out

    def find(self, region: Region) -> list[tuple[int, Piece]]:
        """(param index, piece) of the pieces holding ``region`` (cached by region)."""
        hit = self.cache.get(region)
        if hit is None:
            hit = self.cache[region] = self._find(region)
        return hit

    def candidates(self, region: Region) -> list[Piece]:
        """Every piece of this worker containing ``region`` (a sender's too; not cached)."""
        return [p for p in self.by_tensor.get(region.tensor, ()) if _contains(p.region, region)]

    def _find(self, region: Region) -> list[tuple[int, Piece]]:
        hit = [(self.index[p.param], p) for p in self.candidates(region)]
        assert hit, f"no piece of this worker contains {region}"
        return hit if self.all_pieces else hit[:1]  # a sender needs one copy of the bytes


def _contains(outer: Region, inner: Region) -> bool:
    for s, c, k, s2, c2, k2 in zip(outer.start, outer.count, outer.step,
                                   inner.start, inner.count, inner.step):
        last2 = s2 + k2 * (c2 - 1)
        if s2 < s or last2 > s + k * (c - 1) or (s2 - s) % k or (c2 > 1 and k2 % k):
            return False
    return True


def segment_chunks(plan, needed: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
    """Every segment's `TransferPlan.placed_chunks` as columns, computed for all at once:
    [S + 1] cuts (segment ``s``'s chunks are rows ``cuts[s]:cuts[s + 1]``), then per chunk its
    overlap, first element, element count and byte offset from the segment's start. With
    ``needed`` ([S] bools), only those segments get their chunks (the others none)."""
    t = plan.tables
    overlaps = plan.correspondence.overlaps
    size = np.array([dtype_itemsize(o.dtype) for o in overlaps], dtype=np.int64)
    nbytes = size * np.array([o.region.numel for o in overlaps], dtype=np.int64)
    none = np.zeros(0, dtype=np.int64)  # a plan that moves nothing has no groups
    members = np.concatenate((none, *t.group_overlaps)).astype(np.int64)
    starts = np.concatenate((none, *t.group_starts)).astype(np.int64)
    group = np.repeat(np.arange(len(t.group_starts)),
                      np.array([len(g) for g in t.group_starts], dtype=np.int64))
    seg_group = t.seg_group.astype(np.int64)
    seg_start = t.seg_start.astype(np.int64)
    seg_stop = seg_start + t.seg_bytes
    # One sorted key over all groups: each group's stream offsets lifted past the previous
    # group's (and past every segment end in it), so one searchsorted finds every segment's
    # overlaps within its own group.
    span = np.zeros(len(t.group_starts), dtype=np.int64)
    np.maximum.at(span, group, starts)
    np.maximum.at(span, seg_group, seg_stop)
    lift = np.concatenate(([0], np.cumsum(span + 1)[:-1]))
    keys = starts + lift[group]
    first = np.searchsorted(keys, seg_start + lift[seg_group], side="right") - 1
    stop = np.searchsorted(keys, seg_stop + lift[seg_group], side="left")
    n = stop - first
    if needed is not None:
        n = np.where(needed, n, 0)
    seg = np.repeat(np.arange(len(seg_start)), n)
    i = np.repeat(first - np.cumsum(n) + n, n) + np.arange(int(n.sum()))
    o = members[i]
    lo = np.maximum(seg_start[seg] - starts[i], 0)
    hi = np.minimum(seg_stop[seg] - starts[i], nbytes[o])
    keep = hi > lo  # a range can hold only an overlap's ALIGN padding
    seg, i, o, lo, hi = seg[keep], i[keep], o[keep], lo[keep], hi[keep]
    cuts = np.searchsorted(seg, np.arange(len(seg_start) + 1))
    return cuts, o, lo // size[o], (hi - lo) // size[o], starts[i] + lo - seg_start[seg]

