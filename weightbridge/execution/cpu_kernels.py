"""Vectorized torch pack/assemble: the default `CopyKernels` where there is no GPU.

`build_table` sorts the boxes into two kinds, once per plan:

- Small boxes (up to `GATHER_MAX_BOX` elements, `GATHER_BUDGET` elements per table in all) go
  through one batched gather/scatter: their element indices are precomputed as int64 tensors, so
  a round costs one ``index_select`` per source tensor into a staging tensor plus one
  ``index_copy_`` into the buffer per element size (assemble runs the same in reverse). Per-box
  Python overhead would dominate these boxes; per-element indices are cheap for them.
- Large boxes are strided views made at build time and copied with a single
  ``torch._foreach_copy_`` (one dispatcher call for all of them; torch's own copy loop, so they
  run at memcpy speed and cost no index memory, whatever their size). Two kinds are copied one
  by one instead, in sub-boxes that bound their temporaries: boxes with a negative stride
  (through ``torch.flip``, `FLIP_CHUNK` elements at a time) and transposed 2-d boxes (through a
  scratch tensor of `TRANSPOSE_CHUNK` elements: rows copied contiguously, then torch's blocked
  transpose, about 8x faster than a plain strided copy, which misses the TLB on every element).

Every copy moves integer views of the tensors (bits, never floats), except a box with a
``buffer_dtype``, which `weightbridge.execution.convert` casts in the same call. A box whose buffer
offset is
not a multiple of its element size is moved as bytes (the tensor viewed as uint8 with one more
dim), so any alignment works. The buffer-side views of a table are cached for the last two buffer
objects it was used with (the depth-2 transfer buffers), keyed by object identity: pass the same
buffer tensor every round, not a fresh slice of it.

Typical usage::

    kernels = CpuCopyKernels()
    table = kernels.build_table(copies, tensors)   # once
    kernels.pack(table, send_buffer)               # per round
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from weightbridge.execution.boxcopy import (INT_DTYPES, check_buffer, check_packable, check_rank,
                                            copy_columns, flat_span, merge_dims)
from weightbridge.execution.convert import ConvertTable
from weightbridge.types import BoxCopy

GATHER_MAX_BOX = 512
"""Boxes of at most this many elements are batched into the precomputed gather."""
GATHER_BUDGET = 1 << 20
"""Most elements per table in the gather (16 bytes of int64 indices each); the smallest boxes go
first, the rest are copied directly."""
FLIP_CHUNK = 1 << 22
"""Most elements per sub-box of a box with a negative stride (bounds torch.flip's temporary)."""
TRANSPOSE_CHUNK = 1 << 20
"""Most elements per sub-box of a transposed box (the size of the table's scratch tensor)."""
_MIN_TRANSPOSE = 60 * 60
"""Smallest transposed box worth the scratch: torch's blocked transpose starts at 60 x 60."""


@dataclass(slots=True)
class _Gather:
    """The gathered boxes of one element size: staging, buffer positions, one group per tensor."""

    itemsize: int
    staging: torch.Tensor  # [n] int dtype of itemsize; the boxes' elements in buffer-index order
    positions: torch.Tensor  # [n] int64 element index in the buffer viewed as that int dtype
    groups: list[tuple[torch.Tensor, torch.Tensor, int, int]]  # (span view, src index, lo, hi)


@dataclass(slots=True)
class _Direct:
    """One box copied as a strided view: tensor side built once, buffer side per buffer."""

    view: torch.Tensor  # tensor side, int dtype, negative strides already flipped
    flip: tuple[int, ...]  # dims to flip when copying (those that had a negative stride)
    transposed: bool  # 2-d with stride 1 on dim 0: copied through scratch, rows contiguous
    itemsize: int
    shape: tuple[int, ...]
    position: int  # element index of the box in the buffer viewed as the int dtype


class CpuTable:
    """A validated table for `CpuCopyKernels`. Not safe to pack/assemble from two threads at once
    (the staging tensors are shared)."""

    __slots__ = ("nbytes", "buffer_overlap", "device", "num_launches", "_direct", "_special",
                 "_gathers", "_convert", "_scratch", "_cache")

    def __init__(self, nbytes: int, buffer_overlap: bool, device: torch.device | None,
                 direct: list[_Direct], special: list[_Direct], gathers: list[_Gather],
                 convert: ConvertTable) -> None:
        self.nbytes = nbytes
        """Buffer bytes the table needs."""
        self.buffer_overlap = buffer_overlap
        self.device = device
        self.num_launches = (bool(direct) + sum(1 + d.transposed for d in special)
                             + sum(len(g.groups) + 1 for g in gathers) + convert.num_launches)
        """torch calls per pack or assemble."""
        self._direct, self._special, self._gathers = direct, special, gathers
        self._convert = convert
        self._scratch: dict[int, torch.Tensor] = {}
        for d in special:  # one scratch per element size, as large as the largest sub-box
            have = self._scratch.get(d.itemsize)
            if d.transposed and (have is None or have.numel() < d.view.numel()):
                self._scratch[d.itemsize] = torch.empty(
                    d.view.numel(), dtype=INT_DTYPES[d.itemsize], device=d.view.device)
        self._cache: list[tuple[weakref.ref, dict[int, torch.Tensor], list, list]] = []

    def buffer_views(self, buffer: torch.Tensor
                     ) -> tuple[dict[int, torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """(int views of the buffer by itemsize, direct box views, special box views)."""
        for ref, *views in self._cache:
            if ref() is buffer:
                return tuple(views)
        ints = {n: buffer[:buffer.numel() // n * n].view(dtype) for n, dtype in INT_DTYPES.items()}
        box = lambda d: ints[d.itemsize].as_strided(  # noqa: E731
            d.shape, _row_major(d.shape), ints[d.itemsize].storage_offset() + d.position)
        views = (ints, [box(d) for d in self._direct], [box(d) for d in self._special])
        self._cache = [(weakref.ref(buffer), *views)] + self._cache[:1]
        return views


class CpuCopyKernels:
    """`CopyKernels` in vectorized torch; see the module docstring for how a round runs."""

    def build_table(self, copies: Sequence[BoxCopy], tensors: Sequence[torch.Tensor]) -> CpuTable:
        cols = copy_columns(copies, tensors)
        converting = cols.converting & (cols.numel > 0)
        convert = ConvertTable([copies[i] for i in converting.nonzero()[:, 0].tolist()], tensors)
        rows = ((cols.numel > 0) & ~converting).nonzero()[:, 0]
        shape, strides = merge_dims(cols.shape[rows], cols.strides[rows])
        check_rank(copies, rows, shape)
        tensor, offset, isz = cols.tensor[rows], cols.offset[rows], cols.itemsize[rows]
        boff = cols.buffer_offset[rows]
        # Unaligned boxes move as bytes: one more dim of itemsize bytes, stride 1.
        unaligned = boff % isz != 0
        shape = torch.cat([shape, torch.where(unaligned, isz, 1)[:, None]], dim=1)
        strides = torch.cat([strides * torch.where(unaligned, isz, 1)[:, None],
                             unaligned.to(torch.int64)[:, None]], dim=1)
        offset = torch.where(unaligned, offset * isz, offset)
        isz = torch.where(unaligned, 1, isz)
        shape, strides = merge_dims(shape, strides)
        numel = shape.prod(dim=1)

        gathered = _pick_gathered(numel)
        device = (tensors[int(tensor[0])].device if len(rows) else
                  tensors[int(cols.tensor[converting.nonzero()[0, 0]])].device if len(convert)
                  else None)
        spans: dict[tuple[int, int], torch.Tensor] = {}

        def span(t: int, n: int) -> torch.Tensor:
            if (t, n) not in spans:
                spans[t, n] = flat_span(tensors[t], n)
            return spans[t, n]

        direct, special = [], []
        idx = (~gathered).nonzero()[:, 0]
        for t, n, o, sh, st, p in zip(tensor[idx].tolist(), isz[idx].tolist(),
                                      offset[idx].tolist(), shape[idx].tolist(),
                                      strides[idx].tolist(), (boff[idx] // isz[idx]).tolist()):
            d = _direct(span(t, n), o, sh, st, p)
            (special if d.flip or d.transposed else direct).append(d)
        special = [s for d in special
                   for s in _split(d, TRANSPOSE_CHUNK if d.transposed else FLIP_CHUNK)]
        gathers = _gathers(gathered, tensor, offset, shape, strides, boff, isz, numel, span)
        return CpuTable(cols.nbytes, cols.buffer_overlap, device, direct, special, gathers,
                        convert)

    def pack(self, table: CpuTable, buffer: torch.Tensor) -> None:
        check_buffer(buffer, table.nbytes, table.device)
        check_packable(table.buffer_overlap)
        if buffer.storage_offset() % 4:  # int views need an aligned start: bounce (rare)
            bounce = buffer[:table.nbytes].clone()
            self.pack(table, bounce)
            buffer[:table.nbytes].copy_(bounce)
            return
        ints, direct, special = table.buffer_views(buffer)
        if direct:
            torch._foreach_copy_(direct, [d.view for d in table._direct])
        for d, b in zip(table._special, special):
            if d.transposed:  # rows of the tensor contiguously, then a blocked transpose
                rows = table._scratch[d.itemsize][:b.numel()].view(b.shape[1], b.shape[0])
                rows.copy_(d.view.t())
                b.copy_(rows.t())
            else:
                b.copy_(d.view.flip(d.flip))
        for g in table._gathers:
            for span, src, lo, hi in g.groups:
                torch.index_select(span, 0, src, out=g.staging[lo:hi])
            ints[g.itemsize].index_copy_(0, g.positions, g.staging)
        if len(table._convert):
            table._convert.pack(buffer)

    def assemble(self, table: CpuTable, buffer: torch.Tensor) -> None:
        check_buffer(buffer, table.nbytes, table.device)
        if buffer.storage_offset() % 4:
            buffer = buffer[:table.nbytes].clone()
        ints, direct, special = table.buffer_views(buffer)
        if direct:
            torch._foreach_copy_([d.view for d in table._direct], direct)
        for d, b in zip(table._special, special):
            if d.transposed:
                rows = table._scratch[d.itemsize][:b.numel()].view(b.shape[1], b.shape[0])
                rows.copy_(b.t())
                d.view.t().copy_(rows)
            else:
                d.view.copy_(b.flip(d.flip))
        for g in table._gathers:
            torch.index_select(ints[g.itemsize], 0, g.positions, out=g.staging)
            for span, src, lo, hi in g.groups:
                span.index_copy_(0, src, g.staging[lo:hi])
        if len(table._convert):
            table._convert.assemble(buffer)


def _row_major(shape: Sequence[int]) -> tuple[int, ...]:
    strides, n = [], 1
    for s in reversed(shape):
        strides.append(n)
        n *= s
    return tuple(reversed(strides))


def _pick_gathered(numel: torch.Tensor) -> torch.Tensor:
    """Mask of the boxes to gather: small ones, smallest first, within GATHER_BUDGET elements."""
    small = numel <= GATHER_MAX_BOX
    order = torch.argsort(torch.where(small, numel, numel.max() + 1 if len(numel) else 0),
                          stable=True)
    within = torch.cumsum(numel[order], 0) <= GATHER_BUDGET
    picked = torch.zeros_like(small)
    picked[order[within]] = True
    return picked & small


def _direct(span: torch.Tensor, offset: int, shape: list[int], strides: list[int],
            position: int) -> _Direct:
    """A box as a view of ``span`` (int dtype); dims of size 1 dropped, negative strides made
    positive by starting at the dim's far end (those dims are flipped when copying)."""
    keep = [d for d, n in enumerate(shape) if n > 1]
    shape, strides = [shape[d] for d in keep], [strides[d] for d in keep]
    flip = tuple(d for d, s in enumerate(strides) if s < 0)
    for d in flip:
        offset += strides[d] * (shape[d] - 1)
        strides[d] = -strides[d]
    view = span.as_strided(shape, strides, span.storage_offset() + offset)
    transposed = (len(shape) == 2 and not flip and strides[0] == 1
                  and shape[0] * shape[1] >= _MIN_TRANSPOSE)
    return _Direct(view, flip, transposed, span.element_size(), tuple(shape), position)


def _split(d: _Direct, limit: int) -> list[_Direct]:
    """Sub-boxes of at most ``limit`` elements along the outer dims (same bytes, same order)."""
    if d.view.numel() <= limit:
        return [d]
    n, inner = d.shape[0], math.prod(d.shape[1:])
    # A flipped dim 0 walks the tensor backwards: box rows r0.. are view rows n-r0-1 down.
    first = (lambda r0, r: n - r0 - r) if 0 in d.flip else (lambda r0, r: r0)  # noqa: E731
    if inner > limit:  # one row is still too big: drop dim 0 and split the rows
        inner_flip = tuple(f - 1 for f in d.flip if f)
        return [s for r0 in range(n) for s in _split(_Direct(
            d.view[first(r0, 1)], inner_flip, False, d.itemsize, d.shape[1:],
            d.position + r0 * inner), limit)]
    out = []
    for r0 in range(0, n, limit // inner):
        r = min(limit // inner, n - r0)
        a = first(r0, r)
        out.append(_Direct(d.view[a:a + r], d.flip, d.transposed, d.itemsize,
                           (r, *d.shape[1:]), d.position + r0 * inner))
    return out


def _gathers(picked: torch.Tensor, tensor: torch.Tensor, offset: torch.Tensor,
             shape: torch.Tensor, strides: torch.Tensor, boff: torch.Tensor, isz: torch.Tensor,
             numel: torch.Tensor, span: Callable[[int, int], torch.Tensor]) -> list[_Gather]:
    """Precompute the element indices of the gathered boxes, grouped by itemsize then tensor."""
    rows = picked.nonzero()[:, 0]
    if not len(rows):
        return []
    key = isz[rows] * (int(tensor.max()) + 1) + tensor[rows]
    order = torch.argsort(key, stable=True)
    rows, key = rows[order], key[order]
    n = numel[rows]
    box = torch.repeat_interleave(torch.arange(len(rows)), n)
    first = torch.cumsum(n, 0) - n
    local = torch.arange(int(n.sum())) - first[box]
    src, rem = offset[rows][box], local.clone()
    for d in range(shape.shape[1] - 1, -1, -1):
        size = shape[rows, d][box]
        src += rem % size * strides[rows, d][box]
        rem //= size
    pos = (boff[rows] // isz[rows])[box] + local
    runs = torch.unique_consecutive(key, return_counts=True)[1]
    b0 = 0
    group_lists: dict[int, list] = {}
    for count in runs.tolist():  # one group per (itemsize, tensor), in that order
        b1 = b0 + count
        lo, hi = int(first[b0]), int(first[b1 - 1] + n[b1 - 1])
        t, size = int(tensor[rows[b0]]), int(isz[rows[b0]])
        group_lists.setdefault(size, []).append((span(t, size), src[lo:hi].clone(), lo, hi))
        b0 = b1
    gathers = []
    for size, groups in group_lists.items():
        lo, hi = groups[0][2], groups[-1][3]
        staging = torch.empty(hi - lo, dtype=INT_DTYPES[size], device=groups[0][0].device)
        gathers.append(_Gather(size, staging, pos[lo:hi].clone().to(staging.device),
                               [(s, i.to(s.device), a - lo, b - lo) for s, i, a, b in groups]))
    return gathers
