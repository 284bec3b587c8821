"""From a scan's stretches to runs of global checkpoint indices: steps 2 and 3 of the boundary
analysis (step 1, the scan, is `runs`).

2. `claim_runs`: consecutive stretches share one element; a stretch of two or more equal
   differences is a run and claims its elements greedily; the elements left between runs
   pair up (period-2 patterns) or stand alone.
3. `merge_passes`: the union of the passes' run starts, with each pass's residue evaluated at
   every start, recombined by CRT into runs of global indices, cut at checkpoint tensors and
   parameter rows, and joined where neighbours continue each other. `one_run` is its
   shortcut for a parameter that is one slice-copy.

In numpy inside: a row-parallel parameter has a run (two stretches) a row, and torch's fixed
cost per operation on arrays of a few thousand elements was most of each call. `PassRuns`
and `Runs` hold torch tensors, as the probe and `boxes` use them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from weightbridge.discovery.codec import NO_SOURCE, crt

INVALID_TO_VALID, VALID_TO_INVALID, BOTH_INVALID = -3, -2, -1
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


def claim_runs(s: torch.Tensor, rel: torch.Tensor, x_prev: torch.Tensor, x_cur: torch.Tensor,
               n: int) -> PassRuns:
    """Runs of one pass from its stretches (relation starts ``s``, s[0] == 1); see `claim`."""
    s, rel, x_prev, x_cur = (t.numpy() for t in (s, rel, x_prev, x_cur))
    length = np.diff(s, append=np.int64(n))
    start, _, k = claim(s, length, (rel >= 0) | (rel == BOTH_INVALID), n)
    k = np.maximum(k, 0)
    # Digit at each run start: the start is the earlier (s-1) or later (s) element of stretch
    # k's first relation; single elements are looked up from the stretch that touches them.
    single = np.flatnonzero(start < 0)
    start = np.abs(start) - (start < 0)  # undo the single-element marking of `claim`
    digit = np.where(start == s[k] - 1, x_prev[k], x_cur[k])
    stride = np.where(rel[k] >= 0, rel[k], 0)
    if single.size:
        u = start[single]
        after = np.minimum(np.searchsorted(s, u + 1), s.size - 1)
        before = np.maximum(np.searchsorted(s, u, side="right") - 1, 0)
        digit[single] = np.where(s[after] == u + 1, x_prev[after], x_cur[before])
        stride[single] = 0
    return PassRuns(*(torch.from_numpy(np.ascontiguousarray(x, dtype=np.int64))
                      for x in (start, digit, stride)), n)


def claim(s: np.ndarray, length: np.ndarray, ok: np.ndarray, n: int
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cut n items into runs of equal steps, given the stretches of equal relations.

    Stretch k (relations s[k] .. s[k]+length[k]-1, relation j linking items j-1 and j) covers
    items s[k]-1 .. s[k]+length[k]-1; ``ok[k]`` says its items may share a run. A stretch of
    >= 2 relations claims its items, leaving the first to the previous run when they touch.
    The unclaimed items between such runs (period-2 patterns: a 2-column shard, interleaved
    rows) pair up, and what is left stands alone.

    Returns (start, end, k) per run in item order: ``k`` is the stretch whose relation is the
    run's step; single items have start encoded as ``-(start + 1)`` and k = -1.
    """
    real = (length >= 2) & ok
    prev_real = np.zeros_like(real)
    prev_real[1:] = real[:-1]
    take_prev = real & ~prev_real
    run_start = np.where(take_prev, s - 1, s)[real]
    run_end = (s + length)[real]
    run_k = np.flatnonzero(real)
    # Gaps between real runs, as [lo, hi) item ranges.
    lo = np.concatenate([np.zeros(1, dtype=s.dtype), run_end])
    hi = np.concatenate([run_start, np.array([n], dtype=s.dtype)])
    keep = hi > lo
    if not keep.any():  # the runs cover every item (row-parallel shards): nothing to pair
        return run_start, run_end, run_k
    lo, hi = lo[keep], hi[keep]
    sizes = hi - lo
    u = np.repeat(lo, sizes) + _offsets_within(sizes)  # every unclaimed item
    offset = u - np.repeat(lo, sizes)
    gap_end = np.repeat(hi, sizes)
    # Pair u with u+1 when u sits at an even offset in its gap and u+1 is in the same gap.
    cand = (offset % 2 == 0) & (u + 1 < gap_end)
    k_pair = np.minimum(np.searchsorted(s, u + 1), max(s.size - 1, 0))
    pair = cand & (s[k_pair] == u + 1) & ok[k_pair] if s.size else cand & False
    partner = np.zeros_like(pair)
    partner[1:] = pair[:-1]
    single = ~pair & ~partner
    start = np.concatenate([run_start, u[pair], -(u[single] + 1)])
    end = np.concatenate([run_end, u[pair] + 2, u[single] + 1])
    k = np.concatenate([run_k, k_pair[pair], np.full(int(single.sum()), -1, dtype=np.int64)])
    order = np.argsort(np.where(start < 0, -start - 1, start), kind="stable")
    return start[order], end[order], k[order]


def _offsets_within(sizes: np.ndarray) -> np.ndarray:
    """[0..sizes[0]), [0..sizes[1]), ... concatenated."""
    total = int(sizes.sum())
    if not total:
        return np.zeros(0, dtype=sizes.dtype)
    firsts = np.cumsum(sizes) - sizes
    return np.arange(total, dtype=sizes.dtype) - np.repeat(firsts, sizes)


def merge_passes(passes: list[PassRuns], moduli: tuple[int, ...], bases: torch.Tensor,
                 row: int) -> Runs:
    """Combine the passes' runs into runs of global indices (CRT at every run start).

    ``bases`` are the tensors' first global indices and the total (`TensorIndex.bases`).
    Runs are cut where they cross from one checkpoint tensor into the next (a coincidence of
    the concatenated index space, except in flat shards, which become one piece per tensor
    anyway), then neighbours that continue each other inside one tensor are joined. Runs that
    decode outside the checkpoint keep their index; the caller reports them. Runs are also cut
    at parameter rows of ``row`` elements: a run that happens to continue from one row into the
    next (the last row of one head and the first of the next) would hide the rows' own
    pattern, and box grouping joins whole rows again anyway.
    """
    n = passes[0].numel
    starts = np.sort(np.concatenate([p.start.numpy() for p in passes]))
    # (deduplicated by hand: numpy's first `unique` imports numpy.ma, 70 ms of a first probe)
    starts = starts[np.concatenate([[True], starts[1:] != starts[:-1]])]
    length = np.diff(starts, append=np.int64(n))
    digits, strides, ok = [], [], np.ones(starts.size, dtype=bool)
    for p, m in zip(passes, moduli):
        start, digit, stride = p.start.numpy(), p.digit.numpy(), p.stride.numpy()
        j = np.searchsorted(start, starts, side="right") - 1
        d0, st = digit[j], stride[j]
        ok &= d0 != NO_SOURCE
        digits.append(np.remainder(d0 + (starts - start[j]) * st, m))
        strides.append(st)
    total = math.prod(moduli)
    index = crt(digits, moduli)
    stride = crt(strides, moduli)
    stride = np.where(stride > total // 2, stride - total, stride)
    stride = np.where(length > 1, stride, 0)
    index = np.where(ok, index, NO_SOURCE)
    edges = bases.numpy()
    found = _join_continued(_cut_at_rows(_split_at_tensors((starts, length, index, stride),
                                                           edges), row), edges, row)
    return Runs(*(torch.from_numpy(np.ascontiguousarray(x, dtype=np.int64)) for x in found))


def one_run(passes: list[PassRuns], moduli: tuple[int, ...], bases: torch.Tensor
            ) -> tuple[int, int] | None:
    """(first index, index step) of a parameter that is one slice-copy from inside one
    checkpoint tensor: every pass one sourced run of a non-zero step (a row-sharded or whole
    weight, every chunk of it on the scan's fast path). None otherwise: `merge_passes` then
    decodes it, and refuses what is outside the checkpoint. What `merge_passes` would find for
    such a parameter, without its per-row runs (`boxes.run_box` is what grouping them
    gives)."""
    n = passes[0].numel
    if n < 2 or any(p.start.numel() != 1 for p in passes):
        return None
    digits = [int(p.digit[0]) for p in passes]
    if NO_SOURCE in digits:
        return None
    total = math.prod(moduli)
    index = int(crt([torch.tensor([d]) for d in digits], moduli)[0])
    stride = int(crt([p.stride[:1] for p in passes], moduli)[0])
    stride = stride - total if stride > total // 2 else stride
    last = index + stride * (n - 1)
    end = int(bases[-1])
    if not stride or not (0 <= index < end and 0 <= last < end):
        return None
    tensor = torch.searchsorted(bases, torch.tensor([index, last]), right=True)
    return (index, stride) if int(tensor[0]) == int(tensor[1]) else None


_Arrays = tuple  # (start, length, index, stride) of runs, int64 numpy arrays, as `Runs`


def _cut_at_rows(r: _Arrays, row: int) -> _Arrays:
    """Cut runs at multiples of ``row`` elements (parameter row boundaries)."""
    start, length, index, stride = r
    first_row = start // row
    num = (start + length - 1) // row - first_row + 1
    if bool((num == 1).all()):
        return r
    run = np.repeat(np.arange(num.size), num)
    k = _offsets_within(num)
    lo = np.maximum(start[run], (first_row[run] + k) * row)
    hi = np.minimum(start[run] + length[run], (first_row[run] + k + 1) * row)
    step = stride[run]
    index = np.where(index[run] >= 0, index[run] + step * (lo - start[run]), NO_SOURCE)
    return lo, hi - lo, index, np.where(hi - lo > 1, step, 0)


def _split_at_tensors(r: _Arrays, bases: np.ndarray) -> _Arrays:
    """Cut every run whose indices cross a tensor boundary at that boundary."""
    start, length, index, stride = r
    last = index + stride * (length - 1)
    inside = (index >= 0) & (index < bases[-1]) & (last >= 0) & (last < bases[-1])
    first_t = np.searchsorted(bases, index, side="right")
    last_t = np.searchsorted(bases, last, side="right")
    cross = np.flatnonzero(inside & (first_t != last_t)).tolist()
    if not cross:
        return r
    new: list[list[int]] = [[], [], [], []]
    for i in cross:
        pos, n, g, st = (int(start[i]), int(length[i]), int(index[i]), int(stride[i]))
        cut = [0]
        for b in bases.tolist():  # boundaries strictly inside the run's index range
            j = -(-(b - g) // st) if st > 0 else -(-(g - b + 1) // -st)
            if 0 < j < n and j not in cut:
                cut.append(j)
        cut = sorted(cut) + [n]
        for a, e in zip(cut, cut[1:]):
            for out, v in zip(new, (pos + a, e - a, g + st * a, st if e - a > 1 else 0)):
                out.append(v)
    keep = np.ones(start.size, dtype=bool)
    keep[cross] = False
    joined = [np.concatenate([x[keep], np.array(v, dtype=np.int64)]) for x, v in zip(r, new)]
    order = np.argsort(joined[0], kind="stable")
    return tuple(x[order] for x in joined)


def _join_continued(r: _Arrays, bases: np.ndarray, row: int) -> _Arrays:
    """Join neighbouring runs that continue each other inside one tensor and one parameter
    row (chunk edges, lone jump elements), and pair up neighbouring lone elements."""
    start, length, index, stride = r
    if start.size < 2:
        return r
    ok = index != NO_SOURCE
    end_index = index + stride * (length - 1)  # index of the last element
    multi = length >= 2
    tensor_first = np.searchsorted(bases, index, side="right")
    tensor_last = np.searchsorted(bases, end_index, side="right")
    same_row = start[1:] // row == (start[:-1] + length[:-1] - 1) // row
    pair_ok = ok[1:] & ok[:-1] & (tensor_first[1:] == tensor_last[:-1]) & same_row
    # run i continues run i-1 with the same stride
    same = pair_ok & multi[1:] & multi[:-1] & (stride[1:] == stride[:-1]) & \
        (index[1:] == end_index[:-1] + stride[:-1])
    # a lone element i extends run i-1 as its tail
    tail = pair_ok & ~multi[1:] & multi[:-1] & (index[1:] == end_index[:-1] + stride[:-1])
    # a lone element i-1 (not a tail) starts run i
    head = pair_ok & ~multi[:-1] & multi[1:] & (index[1:] == index[:-1] + stride[1:])
    is_tail = np.zeros_like(ok)
    is_tail[1:] = tail
    head &= ~is_tail[:-1]
    # two lone elements pair up (alternately along a streak of lone elements)
    is_head = np.zeros_like(ok)
    is_head[:-1] = head
    lone = pair_ok & ~multi[1:] & ~multi[:-1] & ~is_tail[1:] & ~is_tail[:-1] & \
        ~is_head[1:] & ~is_head[:-1]
    at = np.arange(lone.size)
    prev_lone = np.zeros_like(lone)
    prev_lone[1:] = lone[:-1]
    streak_start = np.maximum.accumulate(np.where(lone & ~prev_lone, at, 0))
    pair = lone & ((at - streak_start) % 2 == 0)
    join = np.zeros_like(ok)  # join[i]: run i belongs to the same run as i-1
    join[1:] = same | tail | head | pair
    # both unsourced neighbours also join: one unsourced range
    join[1:] |= ~ok[1:] & ~ok[:-1]
    first = np.flatnonzero(~join)  # each joined run's first member (members are neighbours)
    group = np.cumsum(~join) - 1
    total = np.add.reduceat(length, first)
    # Every multi-element member of a group has the same stride; lone members have none.
    stride_sum = np.add.reduceat(np.where(multi, stride, 0), first)
    num_multi = np.add.reduceat(multi.astype(np.int64), first)
    joined_stride = np.where(total > 1, stride_sum // np.maximum(num_multi, 1), 0)
    # a pair of lone elements takes its step from its two indices
    paired = np.flatnonzero(pair) + 1
    joined_stride[group[paired]] = index[paired] - index[paired - 1]
    return start[first], total, index[first], joined_stride
