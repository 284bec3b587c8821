"""The row path of a scan: chunks made of equal rows, each a slice-copy of its own.

A row-parallel shard (``param.copy_(tensor[:, lo:hi])``: vLLM's ``o_proj`` and stacked
``w2_weight``, Megatron's row-parallel layers) is one short slice-copy per row: its digits
advance by a step s inside a row and by the same jump at every row start. The 1-d ring
comparison (`runs.Rings.constant_step`) fails on every chunk of it, and the exact path costs
several times a comparison per element. Here the exact path reads only a prefix of the
chunk; when its stretches end in at least `MIN_ROWS` rows of one pattern (`find_rows`), the
rest of the chunk is compared at once with the pattern's digits, gathered row by row from the
ring of step s (`expected_bits`), and its stretches are written down without reading it again
(`row_stretches`): exactly those the exact path would find.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

MIN_ROWS = 3
"""Row starts the exact prefix must show, one pattern apart, before the rest is assumed."""


@dataclass(frozen=True)
class RowPattern:
    """Rows of ``length`` elements from element ``start`` on: inside a row each digit is the
    one before plus ``step``; from a row's last element to the next row's first, plus
    ``jump`` (all mod ``modulus``)."""

    start: int
    """Element index of a row start."""
    length: int
    step: int
    jump: int
    digit: int
    """Digit of element ``start``."""
    modulus: int

    @property
    def advance(self) -> int:
        """Digit difference from one row start to the next."""
        return (self.jump + (self.length - 1) * self.step) % self.modulus

    def row_digits(self, rows: np.ndarray) -> np.ndarray:
        """Digits of the starts of rows ``rows`` (0: the row at ``start``), int64."""
        return (self.digit + rows.astype(np.int64) * self.advance) % self.modulus


def find_rows(starts: torch.Tensor, rels: torch.Tensor, digits: torch.Tensor,
              modulus: int) -> RowPattern | None:
    """The pattern the stretches of a chunk's exact prefix end in (``starts``: relation
    indices, ``rels``: their residue steps or codes, ``digits``: digit of the element after
    each), or None: the last 2 * `MIN_ROWS` stretches alternate between a row's jump (at its
    first element) and its step (at its second), the row starts equally far apart."""
    k = 2 * MIN_ROWS
    if starts.numel() < k:
        return None
    s, rel, dig = (x[-k:].tolist() for x in (starts, rels, digits))
    jump, step = rel[0], rel[1]
    length = s[2] - s[0]
    if (jump < 0 or step <= 0 or jump == step or length < 2
            or rel[0::2] != [jump] * MIN_ROWS or rel[1::2] != [step] * MIN_ROWS
            or any(s[i + 1] - s[i] != 1 for i in range(0, k, 2))
            or any(s[i + 2] - s[i] != length for i in range(0, k - 2, 2))):
        return None
    return RowPattern(s[-2], length, step, jump, dig[-2], modulus)


def expected_bits(pattern: RowPattern, ring: np.ndarray, offset: int, count: int
                  ) -> np.ndarray:
    """Raw bits of the ``count`` elements from ``start + offset`` on under ``pattern``,
    gathered row by row from ``ring`` (raw bits of digits 0, s, 2s, ... of the pattern's step
    s, at least modulus + length long)."""
    length = pattern.length
    first, last = offset // length, (offset + count - 1) // length
    at = pattern.row_digits(np.arange(first, last + 1)) * pow(pattern.step, -1, pattern.modulus)
    rows = np.lib.stride_tricks.sliding_window_view(ring, length)[at % pattern.modulus]
    skip = offset - first * length
    return rows.reshape(-1)[skip:skip + count]


def row_stretches(pattern: RowPattern, lo: int, hi: int) -> tuple[torch.Tensor, ...]:
    """The stretches that start at relations ``lo .. hi - 1`` under ``pattern``: at each row
    start (its jump) and at the element after it (its step), as the exact path reports them
    (relation, residue step, digit before, digit after)."""
    p, length = pattern.modulus, pattern.length
    first = max(0, -(-(lo - 1 - pattern.start) // length))  # first row with start + 1 >= lo
    last = (hi - 1 - pattern.start) // length  # last row starting at or before hi - 1
    rows = np.arange(first, last + 1, dtype=np.int64)
    d = pattern.row_digits(rows)
    # Two stretches a row, interleaved (in numpy: a probe calls this once per run of rows,
    # thousands of times for stacked experts, where torch's fixed cost per operation was
    # most of each call).
    relation = np.repeat(pattern.start + rows * length, 2)
    relation[1::2] += 1
    rel = np.empty(2 * rows.size, dtype=np.int64)
    rel[0::2], rel[1::2] = pattern.jump, pattern.step
    before, after = np.repeat(d, 2), np.repeat(d, 2)
    before[0::2] = (d - pattern.jump) % p
    after[1::2] = (d + pattern.step) % p
    keep = (relation >= lo) & (relation < hi)
    return tuple(torch.from_numpy(a[keep]) for a in (relation, rel, before, after))
