"""Group runs into boxes and turn boxes into checkpoint `Piece`s.

4. `group_boxes`: consecutive runs of equal shape whose starts advance by constant steps in
   the parameter and in the checkpoint become one box with an extra outer dim (a column shard
   is one box of rows; a transposed copy one box of columns), repeated a few levels, over
   neighbours in parameter order and over items at the same place of consecutive rows.
5. `box_to_pieces`: a box in flat checkpoint coordinates becomes `Piece`s in each tensor's own
   N-d coordinates, split where it crosses tensors or cannot be one per-dim progression.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import torch

from weightbridge.discovery.codec import NO_SOURCE
from weightbridge.discovery.merge import Runs, claim
from weightbridge.types import Piece, Region, TensorSpec

MAX_BOX_RANK = 6
"""Levels of box grouping (a rotary interleave of heads needs 4)."""


@dataclass(frozen=True)
class Boxes:
    """Boxes of one parameter: box b covers param elements pos[b] + sum(i[d] * pstride[b, d])
    from global indices index[b] + sum(i[d] * cstride[b, d]), for i[d] < shape[b, d]."""

    pos: torch.Tensor  # [B]
    index: torch.Tensor  # [B]
    shape: torch.Tensor  # [B, D] outer dim first
    cstride: torch.Tensor  # [B, D] checkpoint index step
    pstride: torch.Tensor  # [B, D] parameter element step


def group_boxes(runs: Runs, shape: tuple[int, ...]) -> Boxes:
    """Group a parameter's sourced runs into boxes, adding an outer dim per level.

    Each level groups neighbours in parameter order, then neighbours in the order of each
    parameter row length (items at the same place of consecutive rows: the streams of a
    transposed fused weight, interleaved gate/up rows).
    """
    ok = runs.index != NO_SOURCE
    b = Boxes(runs.start[ok], runs.index[ok], runs.length[ok].unsqueeze(1),
              runs.stride[ok].unsqueeze(1), torch.ones_like(runs.start[ok]).unsqueeze(1))
    shape = tuple(d for d in shape if d > 1)  # unit dims carry no structure
    rows = [math.prod(shape[d:]) for d in range(len(shape) - 1, 0, -1)]
    for _ in range(MAX_BOX_RANK - 1):
        before = b.pos.numel()
        for period in rows + [None]:
            b = _group_level(b, period)
        if b.pos.numel() == before:
            break
    return b


def run_box(index: int, stride: int, numel: int, row: int) -> Boxes:
    """`group_boxes` of one run (`merge.one_run`) of a parameter's ``numel`` elements cut at
    rows of ``row``: one box of its rows (or of its one row), built directly."""
    def box(*dims: tuple[int, int, int]) -> Boxes:
        return Boxes(torch.tensor([0]), torch.tensor([index]),
                     torch.tensor([[n for n, _, _ in dims]]),
                     torch.tensor([[c for _, c, _ in dims]]),
                     torch.tensor([[p for _, _, p in dims]]))
    if numel <= row:
        return box((numel, stride, 1))
    return box((numel // row, stride * row, row), (row, stride, 1))


def _group_level(b: Boxes, period: int | None = None) -> Boxes:
    """One level of grouping, over neighbours in parameter order or, with ``period``, in the
    order (position mod period, position). Returns ``b`` itself when nothing groups."""
    num = b.pos.numel()
    if num < 2:
        return b
    if period is not None:
        order = torch.sort(b.pos % period, stable=True).indices
        b = Boxes(b.pos[order], b.index[order], b.shape[order], b.cstride[order],
                  b.pstride[order])
    keys = torch.cat([b.shape, b.cstride, b.pstride], 1)
    same = (keys[1:] == keys[:-1]).all(1)
    dpos, didx = b.pos[1:] - b.pos[:-1], b.index[1:] - b.index[:-1]
    # Relation r (between box r and r+1) equals its predecessor: same stretch.
    cont = torch.zeros(num - 1, dtype=torch.bool)
    cont[1:] = same[1:] & same[:-1] & (dpos[1:] == dpos[:-1]) & (didx[1:] == didx[:-1])
    s = torch.nonzero(~cont).squeeze(1) + 1  # stretch starts, as the later item's index
    length = torch.diff(s, append=torch.tensor([num]))
    start, end, k = (torch.from_numpy(x) for x in claim(s.numpy(), length.numpy(),
                                                        same[s - 1].numpy(), num))
    grouped = k >= 0
    first = torch.where(grouped, start, -start - 1)
    rel_at = (s[k.clamp(min=0)] - 1)
    # New boxes: grouped runs get an outer dim; single boxes get an outer dim of size 1.
    outer_n = torch.where(grouped, end - first, 1)
    outer_c = torch.where(grouped, didx[rel_at], 0)
    outer_p = torch.where(grouped, dpos[rel_at], 0)
    if first.numel() == num:
        return b if period is None else _sorted_by_pos(b)
    order = torch.argsort(b.pos[first])
    first = first[order]
    return Boxes(b.pos[first], b.index[first],
                 torch.cat([outer_n[order].unsqueeze(1), b.shape[first]], 1),
                 torch.cat([outer_c[order].unsqueeze(1), b.cstride[first]], 1),
                 torch.cat([outer_p[order].unsqueeze(1), b.pstride[first]], 1))


def _sorted_by_pos(b: Boxes) -> Boxes:
    order = torch.argsort(b.pos)
    return Boxes(b.pos[order], b.index[order], b.shape[order], b.cstride[order],
                 b.pstride[order])


# --------------------------------------------------------------------------------------------
# 5: pieces
# --------------------------------------------------------------------------------------------


class TensorIndex:
    """Global index <-> (checkpoint tensor, flat offset)."""

    def __init__(self, tensors: tuple[TensorSpec, ...]):
        self.tensors = tensors
        self.sizes = [t.numel for t in tensors]
        self.bases = [0]
        for size in self.sizes:
            self.bases.append(self.bases[-1] + size)

    @property
    def numel(self) -> int:
        return self.bases[-1]

    def locate(self, index: int) -> int:
        """Tensor holding a global index."""
        return bisect.bisect_right(self.bases, index) - 1


def box_to_pieces(param: str, pos: int, index: int, dims: list[tuple[int, int, int]],
                  tindex: TensorIndex) -> list[Piece]:
    """Pieces of one box; dims are (count, checkpoint stride, param stride), outer first."""
    # Normalize: drop unit dims; make checkpoint strides positive by walking dims backwards.
    norm = []
    for n, cs, ps in dims:
        if n == 1:
            continue
        if cs < 0:
            index, pos, cs, ps = index + cs * (n - 1), pos + ps * (n - 1), -cs, -ps
        norm.append((n, cs, ps))
    norm.sort(key=lambda d: -d[1])  # outermost (largest checkpoint stride) first
    last = index + sum((n - 1) * cs for n, cs, _ in norm)
    t = tindex.locate(index)
    if tindex.locate(last) != t:
        return _split_outer(param, pos, index, norm, tindex)
    spec, offset = tindex.tensors[t], index - tindex.bases[t]
    norm = _unwrap(norm, offset, spec.shape)
    piece = _as_piece(param, pos, offset, norm, spec)
    if piece is not None:
        return [piece]
    if len(norm) == 1 and norm[0][1] == 1:
        return _contiguous_to_pieces(param, pos, offset, norm[0][0], norm[0][2], spec)
    # Two box dims fall on one tensor dim (a rotary interleave, block-cyclic rows): split
    # along the smallest dim whose removal leaves one progression per tensor dim.
    for k in sorted(range(len(norm)), key=lambda k: norm[k][0]):
        n, cs, ps = norm[k]
        rest = norm[:k] + norm[k + 1:]
        pieces = [_as_piece(param, pos + i * ps, offset + i * cs, rest, spec) for i in range(n)]
        if all(p is not None for p in pieces):
            return pieces
    # Last resort: one sub-box per outer index (each is smaller, so this terminates).
    (n, cs, ps), inner = norm[0], norm[1:]
    return [piece for i in range(n)
            for piece in box_to_pieces(param, pos + i * ps, index + i * cs, inner, tindex)]


def _unwrap(dims: list[tuple[int, int, int]], offset: int, shape: tuple[int, ...]
            ) -> list[tuple[int, int, int]]:
    """Split box dims that wrap around a tensor dim at regular intervals into two dims.

    A run along the last dim that continues into the next row (a whole-row copy, every other
    column of every row) is one box dim in flat indices but two in tensor coordinates.
    """
    natural = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    coord = _unravel(offset, shape)
    out = list(dims)
    changed = True
    while changed:
        changed = False
        for i, (n, cs, ps) in enumerate(out):
            d = next((d for d, ns in enumerate(natural) if cs >= ns and cs % ns == 0), None)
            if d is None:
                continue
            k = cs // natural[d]
            if coord[d] + k * (n - 1) < shape[d] or shape[d] % k or coord[d] >= k:
                continue  # fits already, or does not wrap regularly
            m = shape[d] // k  # elements per wrap
            if n % m or m == n:
                continue
            out[i:i + 1] = [(n // m, cs * m, ps * m), (m, cs, ps)]
            changed = True
            break
    return sorted(out, key=lambda dim: -dim[1])


def _split_outer(param: str, pos: int, index: int, dims: list[tuple[int, int, int]],
                 tindex: TensorIndex) -> list[Piece]:
    """Split a box along its outer dim into sub-boxes that each fit one tensor if possible."""
    if not dims:  # a single element always fits
        t = tindex.locate(index)
        return [_as_piece(param, pos, index - tindex.bases[t], [], tindex.tensors[t])]
    (n, cs, ps), inner = dims[0], dims[1:]
    if not inner and cs == 1:  # a contiguous range across tensors: cut at tensor bases
        out, i = [], 0
        while i < n:
            t = tindex.locate(index + i)
            take = min(n - i, tindex.bases[t + 1] - (index + i))
            out += box_to_pieces(param, pos + i * ps, index + i, [(take, 1, ps)], tindex)
            i += take
        return out
    out, i = [], 0
    span = sum((m - 1) * c for m, c, _ in inner)
    while i < n:
        # Extend the sub-box while its outer elements stay in the same tensor.
        t = tindex.locate(index + i * cs)
        j = i + 1
        while j < n and index + j * cs + span < tindex.bases[t + 1]:
            j += 1
        if tindex.locate(index + i * cs + span) != t:  # one outer slice itself crosses
            out += box_to_pieces(param, pos + i * ps, index + i * cs, inner, tindex)
            i += 1
            continue
        out += box_to_pieces(param, pos + i * ps, index + i * cs,
                             [(j - i, cs, ps)] + inner, tindex) if j - i > 1 or inner else \
            box_to_pieces(param, pos + i * ps, index + i * cs, inner, tindex)
        i = j
    return out


def _as_piece(param: str, pos: int, offset: int, dims: list[tuple[int, int, int]],
              spec: TensorSpec) -> Piece | None:
    """One piece if every box dim maps to its own tensor dim as a progression, else None."""
    shape = spec.shape
    natural = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    coord = list(_unravel(offset, shape))
    count, step, strides = [1] * len(shape), [1] * len(shape), [0] * len(shape)
    used = set()
    for n, cs, ps in dims:
        for d, ns in enumerate(natural):
            if d in used or cs % ns or cs < ns:
                continue
            k = cs // ns
            if coord[d] + k * (n - 1) < shape[d]:
                used.add(d)
                count[d], step[d], strides[d] = n, k, ps
                break
        else:
            return None
    region = Region(spec.name, tuple(coord), tuple(count), tuple(step))
    return Piece(region, param, pos, tuple(strides))


def _contiguous_to_pieces(param: str, pos: int, offset: int, n: int, ps: int,
                          spec: TensorSpec) -> list[Piece]:
    """A contiguous range of a tensor as row-aligned boxes (at most 2*ndim - 1 pieces)."""
    out: list[Piece] = []
    shape = spec.shape
    inner = math.prod(shape[1:]) if shape else 1
    lo, hi = offset, offset + n
    head_end = min(hi, -(-lo // inner) * inner)
    if lo < head_end and (lo % inner or head_end - lo < inner):
        out += _row_part(param, pos, lo, head_end - lo, ps, spec)
        pos, lo = pos + (head_end - lo) * ps, head_end
    rows = (hi - lo) // inner
    if rows:
        natural = [math.prod(shape[d + 1:]) for d in range(1, len(shape))]
        dims = [(rows, inner, inner * ps)] + [(size, ns, ns * ps)
                                              for size, ns in zip(shape[1:], natural)]
        piece = _as_piece(param, pos, lo, [(m, c, p) for m, c, p in dims if m > 1], spec)
        assert piece is not None
        out.append(piece)
        pos, lo = pos + rows * inner * ps, lo + rows * inner
    if lo < hi:
        out += _row_part(param, pos, lo, hi - lo, ps, spec)
    return out


def _row_part(param: str, pos: int, offset: int, n: int, ps: int,
              spec: TensorSpec) -> list[Piece]:
    """A contiguous range inside one row (dim 0 index fixed): recurse on the row's dims."""
    row = offset // math.prod(spec.shape[1:])
    sub = TensorSpec(spec.name, spec.shape[1:], spec.dtype)
    pieces = _contiguous_to_pieces(param, pos, offset - row * math.prod(spec.shape[1:]), n, ps,
                                   sub) if len(spec.shape) > 1 else []
    return [Piece(Region(spec.name, (row,) + p.region.start, (1,) + p.region.count,
                         (1,) + p.region.step), param, p.offset, (0,) + p.strides)
            for p in pieces]


def _unravel(offset: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    coord = []
    for size in reversed(shape):
        coord.append(offset % size)
        offset //= size
    return tuple(reversed(coord))
