"""One index pass where every parameter is one box; the verification load tells the rest.

A probe makes as many index passes as the checkpoint's indices have digits: two for a bf16
checkpoint of up to about 2^28 elements, three beyond. Most loaders copy each parameter as one
slice of one checkpoint tensor: a row shard (one run of indices), a column shard (a run a
row), a whole or transposed weight. Such a parameter is one *box*: element (i_0, .., i_n)
comes from index g + sum(i_j * c_j). In the first pass its digits are then (g + sum(i_j * c_j))
mod p_0, which `guess` reads off a few elements and checks at `SAMPLES` more, without scanning
the parameter: g is known modulo p_0, each step c_j as its residue (taken signed). The
candidates for g are the checkpoint's indices of that residue, a few thousand
(`few_candidates` asks for few enough for the rank's size). The verification pass's
pseudo-random checkpoint, loaded next, tells them apart: its values repeat with the ring's
period, so the positions of the ring holding the parameter's first value and g's residue fix
g within each tensor (`_candidates`), and `decode` picks the candidate whose values at the
parameter's first `PROBE_ELEMENTS` elements are the ones it holds. The probe
then checks the map against every element, as it checks any map (`verify.check_loaded`), so a
guess the samples missed being wrong (a hole, a second tensor) is refused there: a parameter
that matches no candidate or more than one, or a check that fails, gives None, and the probe
takes its index passes. What this saves (an index load and the scans of every pass) is never
bought with a map checked less.

Typical usage (`probe._one_pass`)::

    if few_candidates(live, numel, alpha_of):
        boxes = guess(live, alpha_of)             # after the first index load, or None
        found = decode(live, boxes, alpha_of, tindex, checkpoint)  # checkpoint loaded already
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np
import torch

from weightbridge.discovery.boxes import Boxes, TensorIndex
from weightbridge.discovery.codec import Alphabet
from weightbridge.discovery.verify import (bits_dtype, flat_view, look_up, on_host,
                                           random_period)

PROBE_ELEMENTS = 4
"""Elements of a parameter compared with each candidate: 64 bits of pseudo-random values for a
16-bit dtype, against a few candidates a parameter (`_candidates`)."""
ELEMENTS_PER_CANDIDATE = 64
"""A parameter's residue candidates are the checkpoint's elements over the first modulus; the
odds that its true one shares its ring position with another (and so cannot be told apart:
the probe then takes its index passes, the two loads of the attempt lost) are about those
candidates over the ring's period. A rank with more than one candidate per this many of its
elements holds a small part of a large checkpoint in many parameters (an FSDP2 shard of a
30B model), where those odds add up: it takes its index passes at once."""
MIN_NUMEL = 4 * PROBE_ELEMENTS
"""A smaller parameter is not decoded this way: the check after it would repeat the elements
its candidate was chosen by, and so check nothing more."""
SAMPLES = 64
"""Elements of each parameter, besides its corners, at which `guess` checks its box: a
parameter that is not one box (a fused or stacked weight) is seen here, before the
verification load, at the cost of reading these elements."""
_GOLDEN = (5 ** 0.5 - 1) / 2


@dataclass(frozen=True)
class Box:
    """A parameter as one box of the first pass: the element at coordinates (i_j) over
    ``shape`` held digit ``(digit + sum(i_j * step_j)) mod p_0``.

    Example: rows 512..1023 of a 4096 x 1024 tensor starting at global index g0 is
    ``Box(digit=(g0 + 512 * 1024) % p_0, shape=(512, 1024), steps=(1024, 1))``."""

    digit: int
    shape: tuple[int, ...]
    """The parameter's logical shape."""
    steps: tuple[int, ...]
    """Per dim, the index step as the first pass's residue, signed (|step| <= p_0 / 2)."""

    def offsets(self, flat: np.ndarray) -> np.ndarray:
        """Index offsets from the box's first element of logical elements ``flat``."""
        coords = np.unravel_index(flat, self.shape)
        return sum((c * s for c, s in zip(coords, self.steps)), np.zeros_like(flat))

    def extent(self) -> tuple[int, int]:
        """The least and greatest index offset of the box's elements."""
        ends = [(n - 1) * s for n, s in zip(self.shape, self.steps)]
        return sum(min(0, e) for e in ends), sum(max(0, e) for e in ends)

    def boxes(self, index: int) -> Boxes:
        """The box from global index ``index``, as the probe's `Boxes`: the dims that continue
        each other in the parameter and the checkpoint merged, all but the last (a
        parameter's rows, as `boxes.run_box` gives for one run)."""
        dims = [(n, s, math.prod(self.shape[j + 1:]))
                for j, (n, s) in enumerate(zip(self.shape, self.steps)) if n > 1]
        merged = [dims[0]]
        for n, c, p in dims[1:-1]:
            outer, oc, op = merged[-1]
            if (oc, op) == (n * c, n * p):  # the outer dim continues this one
                merged[-1] = (outer * n, c, p)
            else:
                merged.append((n, c, p))
        if len(dims) > 1:
            merged.append(dims[-1])
        return Boxes(torch.tensor([0]), torch.tensor([index]),
                     torch.tensor([[n for n, _, _ in merged]]),
                     torch.tensor([[c for _, c, _ in merged]]),
                     torch.tensor([[p for _, _, p in merged]]))


def few_candidates(live: Mapping[str, torch.Tensor], numel: int,
                   alpha_of: Callable[[torch.dtype], Alphabet]) -> bool:
    """No parameter too small (`MIN_NUMEL`), empty parameters aside, and few enough
    candidates for the rank (`ELEMENTS_PER_CANDIDATE`) in a checkpoint of ``numel``
    elements: the probe may try one index pass."""
    candidates, elements = 0, 0
    for p in live.values():
        if not p.numel():
            continue
        if p.numel() < MIN_NUMEL:
            return False
        candidates += -(-numel // alpha_of(p.dtype).moduli[0])
        elements += p.numel()
    return candidates * ELEMENTS_PER_CANDIDATE <= elements


def guess(live: Mapping[str, torch.Tensor], alpha_of: Callable[[torch.dtype], Alphabet]
          ) -> dict[str, Box] | None:
    """Per non-empty parameter, holding the first index pass's digits, its `Box`: read at its
    first element and one step along each dim, checked at its corners, its last element and
    `SAMPLES` more spread over it. None when any parameter is not one box there (a digit
    missing, a zero step, a sample off the box): the probe then scans the pass. (In numpy: a
    few dozen elements a parameter, where torch's cost per operation was most of the time.)"""
    spread = (np.arange(1, SAMPLES + 1) * _GOLDEN) % 1.0  # a Weyl sequence over [0, 1)
    out = {}
    for name, p in live.items():
        n = p.numel()
        if not n:
            continue
        shape = tuple(p.shape)
        unit = [math.prod(shape[j + 1:]) if d > 1 else 0 for j, d in enumerate(shape)]
        at = np.concatenate([[0], unit, [(d - 1) * u for d, u in zip(shape, unit)], [n - 1],
                             (spread * n).astype(np.int64)]).astype(np.int64)
        alpha = alpha_of(p.dtype)
        modulus = alpha.moduli[0]
        digits = _bits(p, at).astype(np.int64) - alpha.first_normal
        if bool(((digits < 0) | (digits >= modulus)).any()):
            return None
        first = int(digits[0])
        steps = [(int(d) - first) % modulus for d in digits[1:1 + len(shape)]]
        if any(not s for s, d in zip(steps, shape) if d > 1):
            return None
        box = Box(first, shape, tuple(s - modulus if s > modulus // 2 else s for s in steps))
        if not np.array_equal((first + box.offsets(at)) % modulus, digits):
            return None
        out[name] = box
    return out


def decode(live: Mapping[str, torch.Tensor], boxes: Mapping[str, Box],
           alpha_of: Callable[[torch.dtype], Alphabet], tindex: TensorIndex,
           checkpoint: Mapping[str, torch.Tensor]) -> dict[str, int] | None:
    """Per parameter of ``boxes``, the global index of its box's first element, from the
    values ``checkpoint`` (loaded: the verification pass's `random_checkpoint`, views into one
    ring per dtype) left in it; None when a parameter matches no candidate or more than one.
    A box whose true steps differ from its signed residues matches nothing. The candidates of
    all parameters of a dtype are matched together (`_decode_group`)."""
    bases = torch.tensor(tindex.bases)
    names = [t.name for t in tindex.tensors]
    rings = _rings(names, checkpoint)
    out: dict[str, int] = {}
    by_dtype: dict[torch.dtype, list[str]] = {}
    for name in boxes:
        by_dtype.setdefault(live[name].dtype, []).append(name)
    for dtype, group in by_dtype.items():
        if dtype not in rings:
            return None
        found = _decode_group([live[n] for n in group], [boxes[n] for n in group],
                              alpha_of(dtype).moduli[0], bases, rings[dtype])
        if found is None:
            return None
        out.update(zip(group, found))
    return out


def _decode_group(params: list[torch.Tensor], boxes: list[Box], modulus: int,
                  bases: torch.Tensor, ring: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
                  ) -> list[int] | None:
    """`decode` of parameters of one dtype: each box's candidates (`_candidates`), those
    whose box fits in their tensor, then the one whose first `PROBE_ELEMENTS` values are the
    parameter's."""
    bits, offsets, same_dtype = ring
    seen = torch.stack([_first_bits(p) for p in params])
    digits = np.array([b.digit for b in boxes])
    if modulus >= int(bases[-1]):  # a residue is the index itself (a 32-bit dtype's)
        index = torch.from_numpy(digits)
        owner, t = torch.arange(len(boxes)), torch.searchsorted(bases, index, right=True) - 1
        off = index - bases[t]
    else:
        found = _candidates(bits, offsets, torch.nonzero(same_dtype).squeeze(1), bases,
                            modulus, seen[:, 0], digits)
        if found is None:
            return None
        owner, t, off = found
    lo, hi = (torch.tensor(e)[owner] for e in zip(*(b.extent() for b in boxes)))
    fits = (off + lo >= 0) & (off + hi < bases[t + 1] - bases[t])
    owner, t, off = owner[fits], t[fits], off[fits]
    window = torch.from_numpy(np.stack([b.offsets(np.arange(PROBE_ELEMENTS)) for b in boxes]))
    predicted = bits[((offsets[t] + off)[:, None] + window[owner]) % bits.numel()]
    match = (predicted == seen[owner]).all(dim=1)
    if not torch.equal(torch.bincount(owner[match], minlength=len(params)),
                       torch.ones(len(params), dtype=torch.int64)):
        return None
    order = torch.argsort(owner[match])
    return (bases[t[match]] + off[match])[order].tolist()


def _candidates(bits: torch.Tensor, offsets: torch.Tensor, tensors: torch.Tensor,
                bases: torch.Tensor, modulus: int, first: torch.Tensor, digits: np.ndarray
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(parameter, tensor, offset) of each candidate, from the ring's side: the positions of
    the ring's period that hold some parameter's first value (`_positions_of`), and for each
    such position, parameter and tensor, the offsets into the tensor at that position of the
    ring and of the parameter's residue: one in the product of the period and the modulus
    (coprime: the Chinese remainder theorem), far beyond a tensor's size, so about one
    candidate a parameter in all. None where that is not so (the period and the modulus
    share a factor, or `MAX_PAIRS`)."""
    period = bits.numel()
    if math.gcd(period, modulus) != 1 or modulus >= 1 << 16:
        return None
    positions, owner = _positions_of(bits, first)
    if positions.size * tensors.numel() > MAX_PAIRS:
        return None
    sizes = (bases[1:] - bases[:-1])[tensors].numpy()
    # The offset is ``a`` mod the period and ``r`` mod the modulus, so it is a + k * period
    # for the k below; it lies in the tensor only where k < (its size / the period): the
    # candidates. (In 32-bit numpy, every value below 2^31: the integer divisions were most
    # of the time in torch's int64.)
    a = positions.astype(np.int32)[:, None] - offsets[tensors].numpy().astype(np.int32)
    a += np.int32(period) * (a < 0)
    r = (digits[owner][:, None] - bases[tensors].numpy() % modulus).astype(np.int32)
    r -= a % np.int32(modulus)
    r += np.int32(modulus) * (r < 0)
    r += np.int32(modulus) * (r < 0)
    k = r * np.int32(pow(period, -1, modulus)) % np.int32(modulus)
    pair, col = np.nonzero(k < -(-sizes // period))
    off = a[pair, col].astype(np.int64) + period * k[pair, col].astype(np.int64)
    return (torch.from_numpy(owner[pair]), tensors[torch.from_numpy(col)],
            torch.from_numpy(off))


MAX_PAIRS = 1 << 22
"""(ring position, tensor) pairs `_candidates` solves at most (a few int32 temporaries of
this many); an 8-bit dtype's first value is at P / 120 positions of the ring, and a rank of
such parameters of a checkpoint of many tensors takes its index passes instead."""


def _positions_of(bits: torch.Tensor, first: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The positions of ``bits`` (one period of the ring) that hold a value of ``first``
    (each parameter's first value), each paired with every parameter of that value:
    (positions, parameter index), of equal length. (In numpy: its lookup of a 1M-value
    period took a third of torch's time here.)"""
    unsigned = np.dtype(f"u{bits.element_size()}")
    keys = first.numpy().view(unsigned)
    table = np.zeros(1 << (8 * unsigned.itemsize), dtype=bool)
    table[keys] = True
    ring = bits.numpy().view(unsigned)
    positions = np.flatnonzero(look_up(table, ring, np.empty(ring.size, dtype=bool)))
    order = np.argsort(keys, kind="stable")
    at = ring[positions]
    lo = np.searchsorted(keys[order], at, "left")
    count = np.searchsorted(keys[order], at, "right") - lo
    group = np.repeat(np.arange(positions.size), count)
    within = np.arange(group.size) - (np.cumsum(count) - count)[group]
    return positions[group], order[lo[group] + within]


def _bits(p: torch.Tensor, at: np.ndarray) -> np.ndarray:
    """The bit patterns (signed ints) of logical elements ``at`` of ``p``, read on its device
    and brought to the host (a few bytes)."""
    p = p.detach()
    if p.device.type == "cpu":  # (numpy reads a few elements in microseconds, torch in 0.1 ms)
        return p.view(bits_dtype(p.dtype)).numpy()[np.unravel_index(at, p.shape)]
    index = torch.from_numpy(at).to(p.device)
    values = p.reshape(-1)[index] if p.is_contiguous() else p[tuple(
        torch.from_numpy(c).to(p.device) for c in np.unravel_index(at, p.shape))]
    return values.to("cpu").view(bits_dtype(p.dtype)).numpy()


def _rings(names: list[str], checkpoint: Mapping[str, torch.Tensor]
           ) -> dict[torch.dtype, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per dtype: one period of its ring's bits (the storage the checkpoint's tensors of that
    dtype view, `verify.random_period`), each tensor's offset into the ring, and which
    tensors are of that dtype. (Read modulo the period, the decode's reads stay in 2 MiB:
    4x faster than across the ring's 8 MiB for tensors of 4M elements.)"""
    out = {}
    for dtype in {checkpoint[n].dtype for n in names}:
        views = [checkpoint[n] for n in names if checkpoint[n].dtype == dtype]
        storage = views[0].untyped_storage()
        assert all(v.untyped_storage().data_ptr() == storage.data_ptr() for v in views)
        period = random_period(max(v.numel() for v in views))  # (the ring holds one whole)
        assert storage.nbytes() >= period * dtype.itemsize
        ring = torch.as_strided(views[0], (period,), (1,), 0)
        same = torch.tensor([checkpoint[n].dtype == dtype for n in names])
        offsets = torch.tensor([checkpoint[n].storage_offset() for n in names])
        out[dtype] = (ring.view(bits_dtype(dtype)), offsets, same)
    return out


def _first_bits(p: torch.Tensor) -> torch.Tensor:
    """The bits of ``p``'s first `PROBE_ELEMENTS` elements in logical order, on the host (a
    contiguous parameter reads only those)."""
    p = p.detach()
    first = p.reshape(-1)[:PROBE_ELEMENTS] if p.is_contiguous() else flat_view(on_host(p))[
        :PROBE_ELEMENTS]
    return first.to("cpu", copy=True).view(bits_dtype(p.dtype))
