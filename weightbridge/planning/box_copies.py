"""The BoxCopies of a segment for a source map: per run of an overlap's elements, its row-major
sub-boxes, once per piece of the map holding it (`Copies.build`, used by `worker_plans`).

Also `segment_chunks` (every segment's overlap runs, as columns) and `instances` (frozen
dataclasses made column by column, for the millions of boxes of a paper-scale plan).
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections import deque
from itertools import repeat

import numpy as np

from weightbridge.types import Piece, Region, dtype_itemsize


class Copies:
    """Builds the BoxCopies of segments, one source map at a time, as field columns (so that
    `instances` makes them, and the copies shifted from them, in one pass)."""

    def __init__(self, plan, needed: np.ndarray | None = None):
        self.plan = plan
        self.overlaps = plan.correspondence.overlaps
        # The segments' chunks as columns: a segment's sender and receivers share them.
        self.cuts, self.overlap, self.first, self.count, self.rel = segment_chunks(plan, needed)
        self.boxes: dict[tuple, tuple] = {}
        """(shape, first, end) -> the sub-boxes (start, count, elements) of that flat run."""
        self.strides: dict[tuple, tuple[int, ...]] = {}
        """(piece steps, box count) -> the box's strides (0 where the count is 1)."""
        self.columns: tuple[list, ...] = ([], [], [], [], [], [])
        """The fields of every box built, in `BoxCopy` field order."""

    def build(self, smap, all_pieces: bool, segs, offsets) -> list[int]:
        """Append the copies of each segment of ``segs`` held at the byte of ``offsets`` in a
        buffer, for ``smap``: per run of an overlap's elements, its row-major sub-boxes, once
        per piece holding it. Returns each segment's number of boxes."""
        finder = PieceFinder(smap, all_pieces=all_pieces)
        known: dict[int, tuple] = {}
        """Overlap -> (itemsize, region shape, targets: param, base, steps, buffer dtype)."""
        boxes, strides = self.boxes, self.strides
        cuts, overlaps = self.cuts, self.overlaps
        chunk_overlap, chunk_first, chunk_count, chunk_rel = (self.overlap, self.first,
                                                              self.count, self.rel)
        columns = self.columns
        add_tensor, add_offset, add_shape, add_strides, add_at, add_dtype = (
            c.append for c in columns)
        sizes = []
        for seg, offset in zip(segs, offsets):
            before = len(columns[0])
            for j in range(cuts[seg], cuts[seg + 1]):
                overlap_index = chunk_overlap[j]
                hit = known.get(overlap_index)
                if hit is None:
                    overlap = overlaps[overlap_index]
                    # A box between a parameter of another dtype and the wire converts.
                    # (Only the targets' dtypes: a worker has hundreds of parameters.)
                    wire, dtypes = overlap.dtype, finder.dtypes
                    hit = known[overlap_index] = (
                        dtype_itemsize(wire), overlap.region.count,
                        [(p, base, steps, None if dtypes[p] == wire else wire)
                         for p, base, steps in finder.targets(overlap.region)])
                size, shape, targets = hit
                sub = offset + chunk_rel[j]
                first = chunk_first[j]
                span = (shape, first, first + chunk_count[j])
                sub_boxes = boxes.get(span)
                if sub_boxes is None:  # many runs cover a whole overlap of a common shape
                    sub_boxes = boxes[span] = tuple((start, count, math.prod(count))
                                                    for start, count in flat_boxes(*span))
                for start, count, numel in sub_boxes:
                    for param_index, base, steps, buffer_dtype in targets:
                        key = (steps, count)
                        box_strides = strides.get(key)
                        if box_strides is None:
                            box_strides = strides[key] = tuple(
                                m if c > 1 else 0 for m, c in zip(steps, count))
                        add_tensor(param_index)
                        add_offset(base + sum(map(operator.mul, start, steps)))
                        add_shape(count)
                        add_strides(box_strides)
                        add_at(sub)
                        add_dtype(buffer_dtype)
                    sub += numel * size
            sizes.append(len(columns[0]) - before)
        return sizes


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

    def _find(self, region: Region) -> list[tuple[int, Piece]]:
        hit = [(self.index[p.param], p) for p in self.by_tensor.get(region.tensor, ())
               if _contains(p.region, region)]
        assert hit, f"no piece of this worker contains {region}"
        return hit if self.all_pieces else hit[:1]  # a sender needs one copy of the bytes


def _contains(outer: Region, inner: Region) -> bool:
    for s, c, k, s2, c2, k2 in zip(outer.start, outer.count, outer.step,
                                   inner.start, inner.count, inner.step):
        last2 = s2 + k2 * (c2 - 1)
        if s2 < s or last2 > s + k * (c - 1) or (s2 - s) % k or (c2 > 1 and k2 % k):
            return False
    return True


def segment_chunks(plan, needed: np.ndarray | None = None
                   ) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
    """Every segment's `TransferPlan.placed_chunks` as columns, computed for all at once:
    [S + 1] cuts (segment ``s``'s chunks are rows ``cuts[s]:cuts[s + 1]``), then per chunk its
    overlap, first element, element count and byte offset from the segment's start. With
    ``needed`` ([S] bools), only those segments get their chunks (the others none)."""
    t = plan.tables
    overlaps = plan.correspondence.overlaps
    size = np.array([dtype_itemsize(o.dtype) for o in overlaps], dtype=np.int64)
    nbytes = size * np.array([o.region.numel for o in overlaps], dtype=np.int64)
    members = np.concatenate(t.group_overlaps).astype(np.int64)
    starts = np.concatenate(t.group_starts).astype(np.int64)
    group = np.repeat(np.arange(len(t.group_starts)), [len(g) for g in t.group_starts])
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
    return (cuts.tolist(), o.tolist(), (lo // size[o]).tolist(), ((hi - lo) // size[o]).tolist(),
            (starts[i] + lo - seg_start[seg]).tolist())


def instances(cls, n: int, columns) -> list:
    """``n`` instances of the frozen slots dataclass ``cls``, equal to ``cls(*values)`` for the
    values taken from ``columns`` (one iterable per field, in field order).

    Fields are set through their slot descriptors, column by column, in C loops: a frozen
    dataclass's ``__init__`` sets each field through ``object.__setattr__`` from Python, twice
    the time, which matters at the millions of boxes of a paper-scale plan."""
    fields = dataclasses.fields(cls)
    assert len(columns) == len(fields), (cls, len(columns))
    made = list(map(object.__new__, repeat(cls, n)))
    for field, column in zip(fields, columns):
        deque(map(getattr(cls, field.name).__set__, made, column), maxlen=0)
    return made
