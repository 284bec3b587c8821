"""Scan a parameter's decoded index sequence, pass by pass: step 1 of layout discovery's
boundary analysis (steps 2 and 3, from stretches to runs: `merge`).

Input, per parameter and pass: its elements in logical flat order, each holding the digit
(residue) of the global checkpoint index it came from (see `codec`). Output: its *stretches*,
maximal ranges of equal first differences; a new stretch starts wherever the second
difference is non-zero (at most a handful of positions per slice-copy). Only the stretch
starts are kept, never a dense index, and `merge.claim_runs` turns them into the pass's runs.
"""

from __future__ import annotations

import numpy as np
import torch

from weightbridge.discovery.codec import NO_SOURCE, Alphabet, decode
from weightbridge.discovery import rows
from weightbridge.discovery.compare import first_difference, same_bits
from weightbridge.discovery.merge import (BOTH_INVALID, INVALID_TO_VALID, VALID_TO_INVALID,
                                          PassRuns, claim_runs)

CHUNK = 1 << 20
"""Elements scanned at once: bounds the probe's temporaries to a few MB."""


def scan_pass(values: torch.Tensor, alpha: Alphabet, modulus: int,
              rings: Rings | None = None) -> PassRuns:
    """Runs of one pass over a parameter's elements (1-d, logical order), chunk by chunk.

    ``values`` may live on a device and be of another float dtype than the alphabet's (a
    casting loader's parameter): each chunk is copied to the host and converted on its own,
    so the scan holds a few chunks of host memory whatever the parameter's size.

    Fast path (`Rings`): a chunk whose digits all advance by one step, as inside any long
    slice-copy, equals a slice of that step's precomputed ring of digits; one comparison
    proves it, and it adds no stretch. A long chunk that fails it goes on from the first
    element out of its step (`Rings.steady_prefix`), so that only `FAST_MIN` elements from
    each copy boundary on take the exact path. That path works on raw bits: digits
    are the raw patterns minus a constant, so a new stretch can only begin where the raw first
    difference changes or validity changes. Only at those few candidates are residues
    computed exactly (a wrap past the modulus changes the raw difference but not the residue
    step, and is dropped there). A chunk whose boundaries come close together (short rows of
    a row-parallel shard) tries the row path first (`_rows`): the exact path over a prefix,
    then one comparison with the rows it shows.
    """
    n = values.numel()
    starts, rels, prev_digits, cur_digits = [], [], [], []
    uniform = True  # every chunk took the fast path (with one step: chunks overlap)
    # (first relation, end, whether the row path may try it: not in the rest of a chunk it
    # found no rows in, its host bits when already read: the rest of a chunk, pushed last
    # and so popped next, before another chunk is read into the scan's host buffer)
    chunks = [(lo, min(n, lo + CHUNK), True, None) for lo in range(1, n, CHUNK)][::-1]

    def add(found: tuple[torch.Tensor, ...]) -> None:
        for out, x in zip((starts, rels, prev_digits, cur_digits), found):
            out.append(x)

    while chunks:  # a stack, in element order: the first chunk on top
        lo, hi, try_rows, bits = chunks.pop()
        # Two elements of overlap: relation lo needs element lo-1, and comparing it with
        # relation lo-1 needs element lo-2.
        base = max(lo - 2, 0)
        if bits is None:
            bits = _host_chunk(values, base, hi, alpha, rings)
        even = rings.constant_step(bits, alpha, modulus) if rings is not None else None
        if even is not None:
            if lo < 2:  # the first chunk: its one stretch starts at relation 1
                add(_first_stretch(bits, alpha, modulus))
            continue
        found = None
        if (rings is not None and try_rows and bits.numel() >= 2 * ROW_PREFIX
                and modulus <= MAX_RING_MODULUS and rings.breaks_early(bits, alpha, modulus)):
            found, end = _rows(bits, base, lo < 2, alpha, modulus, rings)
            try_rows = found is not None  # (no rows at its start: none in its rest either)
            if found is not None and end < hi:  # the rows end there: go on from it
                chunks.append((end, hi, True, bits[end - 2 - base:]))
        if (found is None and rings is not None and hi - lo >= 2 * FAST_MIN
                and modulus <= MAX_RING_MODULUS):
            # A copy boundary somewhere inside: no stretch starts before the first element
            # out of the step the chunk starts with. The exact path takes FAST_MIN elements
            # from there on (from the chunk's start when that is near), and the rest is a
            # chunk of its own (overlapping as chunks do).
            start = base + rings.steady_prefix(bits, alpha, modulus)
            if start < lo + FAST_MIN:
                start = lo
            elif lo < 2:  # the first stretch, at relation 1, is in the part skipped
                add(_first_stretch(bits, alpha, modulus))
            end = min(hi, start + FAST_MIN)
            if end < hi:
                chunks.append((end, hi, try_rows, bits[end - 2 - base:]))
            skip = max(start - 2, 0) - base
            bits, base, lo = bits[skip:end - base], base + skip, start
        uniform = False
        add(found if found is not None else exact_stretches(bits, base, lo < 2, alpha, modulus))
    if n <= 1:
        first = decode(_host_chunk(values, 0, 1, alpha).view(alpha.dtype), alpha, modulus)
        return PassRuns(torch.zeros(1, dtype=torch.int64), first,
                        torch.zeros(1, dtype=torch.int64), n)
    if uniform or (sum(x.numel() for x in starts) == 1 and int(rels[0][0]) >= 0):
        # One stretch, of sourced elements (the first chunk's, at relation 1): one run of the
        # whole parameter, what `claim_runs` makes of it (at a fixed cost of a few tenths of a
        # millisecond, most of a small parameter's scan).
        return PassRuns(torch.zeros(1, dtype=torch.int64), prev_digits[0][:1], rels[0][:1], n)
    return claim_runs(torch.cat(starts), torch.cat(rels), torch.cat(prev_digits),
                      torch.cat(cur_digits), n)


def _first_stretch(bits: torch.Tensor, alpha: Alphabet, modulus: int
                   ) -> tuple[torch.Tensor, ...]:
    """The stretch a parameter's first elements (``bits``, raw, from element 0; the first
    two sourced) begin: at relation 1, as `exact_stretches` reports stretches."""
    d0, d1 = (int(b) - alpha.first_normal for b in bits[:2].tolist())
    return tuple(torch.tensor([x]) for x in (1, (d1 - d0) % modulus, d0, d1))


def _host_chunk(values: torch.Tensor, lo: int, hi: int, alpha: Alphabet,
                rings: Rings | None = None) -> torch.Tensor:
    """Elements lo..hi-1 as the alphabet's raw bits, on the host: a view where they are,
    else copied (and converted) into the scan's one host buffer (``rings.scratch``), so the
    host memory the scan holds stays one chunk whatever the allocator does with freed ones."""
    chunk = values[lo:hi]
    if chunk.device.type == "cpu" and chunk.dtype == alpha.dtype:
        return chunk.view(alpha.bits_dtype)
    if rings is None:
        return chunk.to("cpu").to(alpha.dtype).view(alpha.bits_dtype)
    return rings.scratch(alpha.dtype, hi - lo).copy_(chunk).view(alpha.bits_dtype)


def _first_step(raw: np.ndarray, alpha: Alphabet, modulus: int) -> int | None:
    """The digit step from the first to the second element of ``raw`` (raw bits), or None
    when either is unsourced."""
    d0, d1 = int(raw[0]) - alpha.first_normal, int(raw[1]) - alpha.first_normal
    if not (0 <= d0 < modulus and 0 <= d1 < modulus):
        return None
    return (d1 - d0) % modulus


class Rings:
    """What the scans of one probe share: host scratch for chunks read from a device or
    converted (`scratch`), and per step s the ring of raw bits of digits 0, s, 2s, ... (mod
    the modulus): the first period of a chunk of a slice-copy of step s is one slice of it,
    and the rest repeats that period. Rings are built on
    first use, at most `MAX_RINGS` kept (the steps of one probe are few: 1 in row-major
    copies, a row length in transposed ones); only for moduli up to `MAX_RING_MODULUS` (8-
    and 16-bit alphabets) and chunks of at least `FAST_MIN` elements (below that the exact
    path is as quick)."""

    def __init__(self):
        self._rings: dict[tuple, np.ndarray] = {}
        self._scratch: dict[torch.dtype, torch.Tensor] = {}

    def scratch(self, dtype: torch.dtype, num: int) -> torch.Tensor:
        """A host buffer of ``num`` elements (at most a chunk and its overlap), one per
        dtype, reused by every chunk the scan copies to the host."""
        buf = self._scratch.get(dtype)
        if buf is None or buf.numel() < num:
            buf = self._scratch[dtype] = torch.empty(max(num, min(CHUNK + 2, 2 * num)),
                                                     dtype=dtype)
        return buf[:num]

    def constant_step(self, bits: torch.Tensor, alpha: Alphabet, modulus: int) -> int | None:
        """The digit step s if every element of ``bits`` (raw, on the host) is the digit of
        its predecessor plus s (mod the modulus), all of them sourced; else None."""
        if bits.numel() < FAST_MIN or modulus > MAX_RING_MODULUS:
            return None
        return self._step(bits.numpy(), alpha, modulus)

    def steady_prefix(self, bits: torch.Tensor, alpha: Alphabet, modulus: int) -> int:
        """How many leading elements of ``bits`` (raw, on the host) are sourced and advance by
        the digit step of the first two (0 when those are not both sourced): the first one
        after them may start a stretch. Two reads of that prefix (`first_difference`), which
        the failed `constant_step` has just brought into the cache."""
        raw = bits.numpy()
        s = _first_step(raw, alpha, modulus)
        if s is None:
            return 0
        head = self._first_period(raw, alpha, modulus, s)
        wrong = first_difference(raw[:head.size], head)
        if wrong is None and raw.size > modulus:
            wrong = first_difference(raw[modulus:], raw[:-modulus])
            wrong = None if wrong is None else modulus + wrong
        return raw.size if wrong is None else wrong

    def breaks_early(self, bits: torch.Tensor, alpha: Alphabet, modulus: int) -> bool:
        """Whether neither of the first two runs of `ROW_GATE` elements of ``bits`` is one
        slice-copy: copy boundaries come close together there (not one boundary near the
        start of a long copy), and the row path may pay."""
        return all(self._step(bits[k * ROW_GATE:(k + 1) * ROW_GATE].numpy(), alpha,
                              modulus) is None for k in range(2))

    def _step(self, raw: np.ndarray, alpha: Alphabet, modulus: int) -> int | None:
        """`constant_step` of raw bits of any length."""
        s = _first_step(raw, alpha, modulus)
        if s is None or (int(raw[-1]) - int(raw[-2]) - s) % modulus:
            return None  # its last step differs: not one copy (no ring built for it)
        head = self._first_period(raw, alpha, modulus, s)
        if not same_bits(raw[:head.size], head):
            return None
        # The digits of one step repeat with the modulus: past the first period, the chunk
        # must equal itself one period earlier, which was just read (a cache hit: one read
        # from memory per element instead of two; 1.5x faster on 128 MiB here).
        return s if raw.size <= modulus or same_bits(raw[modulus:], raw[:-modulus]) else None

    def _first_period(self, raw: np.ndarray, alpha: Alphabet, modulus: int, s: int
                      ) -> np.ndarray:
        """The raw bits the first period of ``raw`` (at most the modulus) holds if it advances
        by step s from its first digit: a slice of the ring of s."""
        head = min(raw.size, modulus)
        if s == 0:
            return np.full(head, raw[0], dtype=raw.dtype)
        d0 = int(raw[0]) - alpha.first_normal
        ring = self._ring(alpha, modulus, s, head)
        at = d0 * pow(s, -1, modulus) % modulus  # ring[at] holds digit d0
        return ring[at:at + head]

    def _ring(self, alpha: Alphabet, modulus: int, s: int, size: int) -> np.ndarray:
        """At least modulus + size values (a power of two more, at most a chunk's)."""
        key = (alpha.dtype, alpha.first_normal, modulus, s)
        ring = self._rings.pop(key, None)
        if ring is None or ring.size < modulus + size:
            length = modulus + min(1 << (size - 1).bit_length(), CHUNK + 2)
            # One period, then tiled: the ring repeats with the modulus. int32 is exact: both
            # factors are below the modulus, and MAX_RING_MODULUS**2 < 2**31.
            digits = np.arange(modulus, dtype=np.int32) * s % modulus
            ring = np.resize((digits + alpha.first_normal).astype(
                torch.empty(0, dtype=alpha.bits_dtype).numpy().dtype), length)
        if len(self._rings) >= MAX_RINGS:
            self._rings.pop(next(iter(self._rings)))
        self._rings[key] = ring  # (re-inserted: the oldest used goes first)
        return ring


FAST_MIN = 1 << 16
"""Chunks shorter than this take the exact path (`Rings`); in longer ones that fail the ring
comparison, this many elements from each copy boundary on do."""
ROW_PREFIX = 1 << 14
"""Elements of a chunk the row path reads with the exact path before assuming rows (rows of
up to a few thousand elements show `rows.MIN_ROWS` times in it)."""
ROW_GATE = 1 << 12
"""The row path tries a chunk only if neither of its first two runs of this many elements
is one slice-copy."""
MAX_RINGS = 4
"""Rings kept at once: each is the modulus and up to one more period (a scan's) or row (the
row path's) of raw values, at most 128 KiB for bf16."""
MAX_RING_MODULUS = 46_340
"""Larger moduli (float32's) have no ring: their chunks take the exact path. (The 8- and
16-bit alphabets' moduli are below it; its square fits an int32.)"""


def _rows(bits: torch.Tensor, base: int, first: bool, alpha: Alphabet, modulus: int,
          rings: Rings) -> tuple[tuple[torch.Tensor, ...] | None, int]:
    """The row path (`weightbridge.discovery.rows`) over one chunk whose copy boundaries
    come close together: the exact path over its first `ROW_PREFIX` elements, then, if those
    end in rows of one pattern, one comparison of the rest with the pattern. Returns the
    stretches (as `exact_stretches`) of the chunk's relations up to ``end`` (exclusive: the
    first element that breaks the pattern, or the chunk's end), and ``end``; (None, 0) when
    the prefix shows no rows or they break inside it."""
    prefix = exact_stretches(bits[:ROW_PREFIX], base, first, alpha, modulus)
    pattern = rows.find_rows(prefix[0], prefix[1], prefix[3], modulus)
    if pattern is None:
        return None, 0
    ring = rings._ring(alpha, modulus, pattern.step, pattern.length)
    raw, offset, block = bits.numpy()[pattern.start - base:], 0, 4 * ROW_PREFIX
    while offset < raw.size:  # in growing blocks: the rows may end long before the chunk
        count = min(block, raw.size - offset)
        wrong = first_difference(raw[offset:offset + count],
                                 rows.expected_bits(pattern, ring, offset, count))
        if wrong is not None:
            offset += wrong
            break
        offset, block = offset + count, 2 * block
    end = pattern.start + offset
    if end <= base + ROW_PREFIX:  # (the pattern the prefix ends in breaks inside it)
        return None, 0
    rest = rows.row_stretches(pattern, base + ROW_PREFIX, end)
    return tuple(torch.cat([a, b]) for a, b in zip(prefix, rest)), end


def exact_stretches(bits: torch.Tensor, base: int, first: bool, alpha: Alphabet,
                    modulus: int) -> tuple[torch.Tensor, ...]:
    """The exact path over one chunk (``bits``: elements base, base + 1, ...): the stretches
    that start among its relations, as (relation, its residue step or code, digit of the
    element before, digit of the element after). Relation base + 1 is the previous chunk's
    (judged there, with the element before it) unless ``first``.

    Raw-bit differences equal digit differences (the constant offset cancels; wrapping is
    fine), so the digits themselves are needed only at the candidates. In numpy: a probe
    calls this thousands of times on chunks of 64K elements, where torch's fixed cost per
    operation was half of each call's time."""
    raw = bits.numpy()
    step = raw[1:] - raw[:-1]  # relation j: element base+j to base+j+1 (wrapping)
    cand = np.empty(step.size, dtype=bool)
    cand[0] = True
    np.not_equal(step[1:], step[:-1], out=cand[1:])
    first_normal = alpha.first_normal
    valid = None  # a chunk that is all sourced (the common case) skips the validity pass
    if not (int(raw.min()) >= first_normal and int(raw.max()) < first_normal + modulus):
        digits = raw - raw.dtype.type(first_normal)  # wraps as `raw_digits` does
        valid = (digits >= 0) & (digits < modulus)
        cand[1:] |= (valid[2:] != valid[1:-1]) | (valid[1:-1] != valid[:-2])
    if not first:
        cand[0] = False  # relation base+1 was judged with the previous chunk
    j = np.flatnonzero(cand)
    x = [_digits_at(raw, valid, at, first_normal, modulus)  # at elements j-1, j, j+1
         for at in (np.maximum(j - 1, 0), j, j + 1)]
    rel_here = _relation(x[1], x[2], modulus)
    rel_before = _relation(x[0], x[1], modulus)
    new = (rel_here != rel_before) | (j == 0)
    # (the relation's index is the element index of its later element)
    return tuple(torch.from_numpy(a) for a in (j[new] + base + 1, rel_here[new], x[1][new],
                                               x[2][new]))


def _digits_at(raw: np.ndarray, valid: np.ndarray | None, at: np.ndarray, first_normal: int,
               modulus: int) -> np.ndarray:
    """Exact int64 digits (NO_SOURCE when invalid) at elements ``at``."""
    digit = raw[at].astype(np.int64) - first_normal
    ok = (digit >= 0) & (digit < modulus) if valid is None else valid[at]
    return np.where(ok, digit, NO_SOURCE)


def _relation(a: np.ndarray, b: np.ndarray, modulus: int) -> np.ndarray:
    """Residue step from a to b, or a code when either is unsourced."""
    ok_a, ok_b = a != NO_SOURCE, b != NO_SOURCE
    rel = np.where(ok_a & ok_b, np.remainder(b - a, modulus), BOTH_INVALID)
    rel = np.where(ok_a & ~ok_b, VALID_TO_INVALID, rel)
    return np.where(~ok_a & ok_b, INVALID_TO_VALID, rel)
