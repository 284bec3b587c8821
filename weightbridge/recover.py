"""Recover slice-copies from decoded index sequences: runs, then boxes, then checkpoint pieces.

Input, per parameter: its elements in logical flat order, each labelled with the global
checkpoint index it came from (known only per pass, as residues; see `codec`). Output: a few
`Piece`s. All of it is boundary analysis on second differences, vectorized in torch:

1. `scan_pass`: in one pass, a *stretch* is a maximal range of equal first differences; a
   new stretch starts wherever the second difference is non-zero (at most a handful of
   positions per slice-copy). Only the stretch starts are kept, never a dense index.
2. `claim_runs`: consecutive stretches share one element; a stretch of two or more equal
   differences is a real run and claims its elements greedily, lone jumps between runs vanish.
3. `merge_passes`: the union of the passes' run starts, with each pass's residue evaluated at
   every start, recombined by CRT into (position, length, index, stride) runs.
4. `group_boxes`: consecutive runs of equal shape whose starts advance by constant steps in
   the parameter and in the checkpoint become one box with an extra outer dim (a column shard
   is one box of rows; a transposed copy one box of columns), repeated a few levels.
5. `box_to_pieces`: a box in flat checkpoint coordinates becomes `Piece`s in each tensor's own
   N-d coordinates, split where it crosses tensors or cannot be one per-dim progression.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import torch

from weightbridge.codec import NO_SOURCE, Alphabet, crt, decode, raw_digits
from weightbridge.types import Piece, Region, TensorSpec

CHUNK = 1 << 20
"""Elements scanned at once: bounds the probe's temporaries to a few MB."""

MAX_BOX_RANK = 6
"""Levels of box grouping (a rotary interleave of heads needs 4)."""

_INVALID_TO_VALID, _VALID_TO_INVALID, _BOTH_INVALID = -3, -2, -1
"""Relation codes between neighbours that are not both sourced (digits are >= 0)."""


@dataclass(frozen=True)
class PassRuns:
    """One pass's runs of one parameter: affine sequences of residues."""

    start: torch.Tensor  # [R] first element of each run, increasing, start[0] == 0
    digit: torch.Tensor  # [R] residue at the run start (NO_SOURCE for unsourced runs)
    stride: torch.Tensor  # [R] residue step (0 for single elements)
    numel: int


@dataclass(frozen=True)
class Runs:
    """Runs of one parameter in global checkpoint indices (see `merge_passes`)."""

    start: torch.Tensor  # [R] first element
    length: torch.Tensor  # [R]
    index: torch.Tensor  # [R] global index of the first element; NO_SOURCE if unsourced
    stride: torch.Tensor  # [R] global index step


# --------------------------------------------------------------------------------------------
# 1-3: runs
# --------------------------------------------------------------------------------------------


def scan_pass(values: torch.Tensor, alpha: Alphabet, modulus: int) -> PassRuns:
    """Runs of one pass over a parameter's elements (1-d, logical order), chunk by chunk.

    Fast path on raw bits: digits are the raw patterns minus a constant, so a new stretch can
    only begin where the raw first difference changes or validity changes. Only at those few
    candidates are residues computed exactly (a wrap past the modulus changes the raw
    difference but not the residue step, and is dropped there).
    """
    n = values.numel()
    starts, rels, prev_digits, cur_digits = [], [], [], []
    for lo in range(1, n, CHUNK):
        hi = min(n, lo + CHUNK)
        # Two elements of overlap: relation lo needs element lo-1, and comparing it with
        # relation lo-1 needs element lo-2.
        base = max(lo - 2, 0)
        raw = raw_digits(values[base:hi], alpha)
        valid = (raw >= 0) & (raw < modulus)
        step = raw[1:] - raw[:-1]  # relation j: element base+j to base+j+1 (wrapping is fine)
        cand = torch.ones(step.numel(), dtype=torch.bool)
        cand[1:] = (step[1:] != step[:-1]) | (valid[2:] != valid[1:-1]) | \
            (valid[1:-1] != valid[:-2])
        if lo >= 2:
            cand[0] = False  # relation lo-1 was judged with the previous chunk
        j = torch.nonzero(cand).squeeze(1)
        x = _exact(raw, valid, j, modulus)  # digits at elements j-1, j, j+1 (local)
        rel_here = _relation(x[1], x[2], modulus)
        rel_before = _relation(x[0], x[1], modulus)
        new = (rel_here != rel_before) | (j == 0)
        starts.append(j[new] + base + 1)  # element index of the relation's later element
        rels.append(rel_here[new])
        prev_digits.append(x[1][new])
        cur_digits.append(x[2][new])
    if n <= 1:
        first = decode(values[:1], alpha, modulus)
        return PassRuns(torch.zeros(1, dtype=torch.int64), first,
                        torch.zeros(1, dtype=torch.int64), n)
    return claim_runs(torch.cat(starts), torch.cat(rels), torch.cat(prev_digits),
                      torch.cat(cur_digits), n)


def _exact(raw: torch.Tensor, valid: torch.Tensor, j: torch.Tensor, modulus: int
           ) -> list[torch.Tensor]:
    """Exact int64 digits (NO_SOURCE when invalid) at elements j-1, j and j+1."""
    out = []
    for at in (j - 1, j, j + 1):
        at = at.clamp(min=0)
        out.append(torch.where(valid[at], raw[at].to(torch.int64), NO_SOURCE))
    return out


def _relation(a: torch.Tensor, b: torch.Tensor, modulus: int) -> torch.Tensor:
    """Residue step from a to b, or a code when either is unsourced."""
    ok_a, ok_b = a != NO_SOURCE, b != NO_SOURCE
    rel = torch.remainder(b - a, modulus)
    rel = torch.where(ok_a & ok_b, rel, _BOTH_INVALID)
    rel = torch.where(ok_a & ~ok_b, _VALID_TO_INVALID, rel)
    return torch.where(~ok_a & ok_b, _INVALID_TO_VALID, rel)


def claim_runs(s: torch.Tensor, rel: torch.Tensor, x_prev: torch.Tensor, x_cur: torch.Tensor,
               n: int) -> PassRuns:
    """Greedy run claiming over stretches (relation starts ``s``, s[0] == 1).

    Stretch k covers elements s[k]-1 .. s[k]+len[k]-1. A stretch of >= 2 relations is a run
    (codes -2/-3 never repeat, so it is all sourced or all unsourced); it claims its elements,
    leaving the first to the previous run when they touch. Unclaimed elements stand alone.
    """
    length = torch.diff(s, append=torch.tensor([n], dtype=s.dtype))
    real = length >= 2
    prev_real = torch.zeros_like(real)
    prev_real[1:] = real[:-1]
    take_prev = real & ~prev_real  # the run starts at s-1, else at s
    run_start = torch.where(take_prev, s - 1, s)[real]
    run_end = (s + length)[real]  # exclusive
    run_digit = torch.where(take_prev, x_prev, x_cur)[real]
    run_stride = rel[real].clamp(min=0)
    # Lone elements: the elements of jump stretches that no run claimed.
    jump = ~real
    cand = torch.cat([s[jump] - 1, s[jump]])
    cand_digit = torch.cat([x_prev[jump], x_cur[jump]])
    if run_start.numel():
        j = (torch.searchsorted(run_start, cand, right=True) - 1).clamp(min=0)
        inside = (cand >= run_start[j]) & (cand < run_end[j])
        cand, cand_digit = cand[~inside], cand_digit[~inside]
    lone, first = torch.unique(cand, sorted=True, return_inverse=True)
    lone_digit = torch.empty_like(lone)
    lone_digit[first] = cand_digit  # duplicates carry the same digit
    starts = torch.cat([run_start, lone])
    order = torch.argsort(starts)
    return PassRuns(starts[order], torch.cat([run_digit, lone_digit])[order],
                    torch.cat([run_stride, torch.zeros_like(lone)])[order], n)


def merge_passes(passes: list[PassRuns], moduli: tuple[int, ...], num_indices: int) -> Runs:
    """Combine the passes' runs into runs of global indices (CRT at every run start).

    Runs that decode outside [0, num_indices) keep their index; the caller reports them.
    """
    n = passes[0].numel
    starts = torch.unique(torch.cat([p.start for p in passes]), sorted=True)
    length = torch.diff(starts, append=torch.tensor([n], dtype=starts.dtype))
    digits, strides, ok = [], [], torch.ones_like(starts, dtype=torch.bool)
    for p, m in zip(passes, moduli):
        j = torch.searchsorted(p.start, starts, right=True) - 1
        d0, st = p.digit[j], p.stride[j]
        ok &= d0 != NO_SOURCE
        digits.append(torch.remainder(d0 + (starts - p.start[j]) * st, m))
        strides.append(st)
    total = math.prod(moduli)
    index = crt(digits, moduli)
    stride = crt(strides, moduli)
    stride = torch.where(stride > total // 2, stride - total, stride)
    stride = torch.where(length > 1, stride, 0)
    index = torch.where(ok, index, NO_SOURCE)
    return _join_continued(Runs(starts, length, index, stride))


def _join_continued(r: Runs) -> Runs:
    """Join neighbouring runs that continue each other (chunk edges, lone jump elements)."""
    if r.start.numel() < 2:
        return r
    ok = r.index != NO_SOURCE
    end_index = r.index + r.stride * (r.length - 1)  # index of the last element
    multi = r.length >= 2
    pair_ok = ok[1:] & ok[:-1]
    # run i continues run i-1 with the same stride
    same = pair_ok & multi[1:] & multi[:-1] & (r.stride[1:] == r.stride[:-1]) & \
        (r.index[1:] == end_index[:-1] + r.stride[:-1])
    # a lone element i extends run i-1 as its tail
    tail = pair_ok & ~multi[1:] & multi[:-1] & (r.index[1:] == end_index[:-1] + r.stride[:-1])
    # a lone element i-1 (not a tail) starts run i
    head = pair_ok & ~multi[:-1] & multi[1:] & (r.index[1:] == r.index[:-1] + r.stride[1:])
    is_tail = torch.zeros_like(ok)
    is_tail[1:] = tail
    head &= ~is_tail[:-1]
    join = torch.zeros_like(ok)  # join[i]: run i belongs to the same run as i-1
    join[1:] = same | tail | head
    # both unsourced neighbours also join: one unsourced range
    join[1:] |= ~ok[1:] & ~ok[:-1]
    group = torch.cumsum(~join, 0) - 1
    num = int(group[-1]) + 1
    first = torch.nonzero(~join).squeeze(1)
    length = torch.zeros(num, dtype=r.length.dtype).index_add_(0, group, r.length)
    # Every multi-element member of a group has the same stride; lone members have none.
    stride_sum = torch.zeros(num, dtype=r.stride.dtype).index_add_(
        0, group, torch.where(multi, r.stride, 0))
    num_multi = torch.zeros(num, dtype=r.stride.dtype).index_add_(0, group, multi.long())
    stride = torch.where(length > 1, stride_sum // num_multi.clamp(min=1), 0)
    return Runs(r.start[first], length, r.index[first], stride)


# --------------------------------------------------------------------------------------------
# 4: boxes
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Boxes:
    """Boxes of one parameter: box b covers param elements pos[b] + sum(i[d] * pstride[b, d])
    from global indices index[b] + sum(i[d] * cstride[b, d]), for i[d] < shape[b, d]."""

    pos: torch.Tensor  # [B]
    index: torch.Tensor  # [B]
    shape: torch.Tensor  # [B, D] outer dim first
    cstride: torch.Tensor  # [B, D] checkpoint index step
    pstride: torch.Tensor  # [B, D] parameter element step


def group_boxes(runs: Runs) -> Boxes:
    """Group sourced runs into boxes, adding an outer dim per level while it helps."""
    ok = runs.index != NO_SOURCE
    b = Boxes(runs.start[ok], runs.index[ok], runs.length[ok].unsqueeze(1),
              runs.stride[ok].unsqueeze(1), torch.ones_like(runs.start[ok]).unsqueeze(1))
    for _ in range(MAX_BOX_RANK - 1):
        grouped = _group_level(b)
        if grouped.pos.numel() == b.pos.numel():
            break
        b = grouped
    return b


def _group_level(b: Boxes) -> Boxes:
    num = b.pos.numel()
    if num < 2:
        return b
    keys = torch.cat([b.shape, b.cstride, b.pstride], 1)
    same = (keys[1:] == keys[:-1]).all(1)
    dpos, didx = b.pos[1:] - b.pos[:-1], b.index[1:] - b.index[:-1]
    # Relation r (between box r and r+1) equals its predecessor: same stretch.
    cont = torch.zeros(num - 1, dtype=torch.bool)
    cont[1:] = same[1:] & same[:-1] & (dpos[1:] == dpos[:-1]) & (didx[1:] == didx[:-1])
    s = torch.nonzero(~cont).squeeze(1) + 1  # relation starts, as element indices
    length = torch.diff(s, append=torch.tensor([num]))
    real = (length >= 2) & same[s - 1]
    prev_real = torch.zeros_like(real)
    prev_real[1:] = real[:-1]
    start = torch.where(real & ~prev_real, s - 1, s)[real]
    end = (s + length)[real]
    rel_at = (s - 1)[real]
    claimed = torch.zeros(num + 1, dtype=torch.int64)
    claimed.index_add_(0, start, torch.ones_like(start))
    claimed.index_add_(0, end, -torch.ones_like(end))
    lone = torch.nonzero(torch.cumsum(claimed, 0)[:num] == 0).squeeze(1)
    # New boxes: grouped runs get an outer dim; lone boxes get an outer dim of size 1.
    outer_n = torch.cat([end - start, torch.ones_like(lone)])
    outer_c = torch.cat([didx[rel_at], torch.zeros_like(lone)])
    outer_p = torch.cat([dpos[rel_at], torch.zeros_like(lone)])
    first = torch.cat([start, lone])
    order = torch.argsort(first)
    first = first[order]
    return Boxes(b.pos[first], b.index[first],
                 torch.cat([outer_n[order].unsqueeze(1), b.shape[first]], 1),
                 torch.cat([outer_c[order].unsqueeze(1), b.cstride[first]], 1),
                 torch.cat([outer_p[order].unsqueeze(1), b.pstride[first]], 1))


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
    piece = _as_piece(param, pos, index - tindex.bases[t], norm, tindex.tensors[t])
    if piece is not None:
        return [piece]
    if len(norm) == 1 and norm[0][1] == 1:
        return _contiguous_to_pieces(param, pos, index - tindex.bases[t], norm[0][0],
                                     norm[0][2], tindex.tensors[t])
    # Two box dims fall on one tensor dim (a rotary interleave, block-cyclic rows): split
    # along the smallest dim whose removal leaves one progression per tensor dim.
    spec, offset = tindex.tensors[t], index - tindex.bases[t]
    for k in sorted(range(len(norm)), key=lambda k: norm[k][0]):
        n, cs, ps = norm[k]
        rest = norm[:k] + norm[k + 1:]
        pieces = [_as_piece(param, pos + i * ps, offset + i * cs, rest, spec) for i in range(n)]
        if all(p is not None for p in pieces):
            return pieces
    return _split_outer(param, pos, index, norm, tindex)


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
