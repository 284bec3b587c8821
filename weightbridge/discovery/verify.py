"""The probe's last pass: load a pseudo-random checkpoint and check the map reproduces it.

The index passes only see where values go; this pass sees what happens to them. What its load
must show depends on what the parameters hold when it starts (`Before`):

- right after the index passes (`Before.INDEX_DIGITS`), every value is negative: the index
  passes wrote positive values only, so together they catch loaders that depend on the sign
  (``abs``, ``relu``, ``-abs``), and an element this load leaves alone still holds a positive
  digit, which no expected value equals (their sign bits differ): nothing is zeroed first;
- after a block-quantizing loader's sign passes (`Before.SIGN_PASSES`: values of +-448 of
  both signs), every parameter is zeroed first and the values have both signs;
- alone (`Before.ANYTHING`: `weightbridge.discovery.probe.reverify` of a kept map, the
  parameters as the caller left them), the values have both signs and are drawn afresh for
  each check, and only the unsourced elements are zeroed (all of them for a block-quantizing
  loader): an element the load leaves alone is missed only where its old value equals the
  new random one, one time in the alphabet's patterns of both signs (65,024 for bf16), the
  odds at which a wrongly mapped element goes unseen.

For a casting loader (a piece with ``cast_from``) the expected value is the checkpoint value
cast to the parameter's dtype, rounding to nearest even, as torch's ``copy_`` does and as the
trainer's pack reproduces; the random values of a cast source dtype are salted with exact
rounding ties and with values in the target dtype's subnormal range, so a loader that
truncates, rounds ties away from zero or flushes subnormals is refused here rather than
corrupting weights on the first update. A tensor a loader block-quantizes gets values whose
block maxima are known, salted with values that tell the engine's formula from its near misses
(`quantized.salted`).
"""

from __future__ import annotations

import enum
import math
import secrets
from typing import Callable, Iterable, Mapping, NamedTuple

import numpy as np
import torch

from weightbridge.discovery.codec import BITS_DTYPE, Alphabet, alphabet, signed_values
from weightbridge.discovery.quantized import expected_source, salted
from weightbridge.discovery.replay import first_mismatch
from weightbridge.types import CheckpointSpec, SourceMap, scaled_tensor

Params = Mapping[str, torch.Tensor]
LoadWeights = Callable[[Iterable[tuple[str, torch.Tensor]]], object]

_VERIFY_SEED = 0x5EED
RING_SPAN = 65_521
"""Random verification tensors are views into one random ring at offsets below this."""
_RANDOM_PERIOD = (1 << 20) + 7
"""The random ring's period, at most about this (`random_period`)."""
_SHORT_PERIOD = 1021
"""The random ring combines two short random rings of prime periods, this one and one near
P / 1021 (`_draw`)."""
_DRAW_CHUNK = 1 << 16
"""Elements a lookup (`look_up`) or a 32-bit alphabet's draw converts at once (their int64
temporaries: 512 KiB)."""
_TIE_EVERY, _SUBNORMAL_EVERY = 5, 35
"""In the ring of a cast source dtype: every 5th value is a rounding tie of each target dtype,
every 35th (never a tie) lies in its subnormal range."""


class Before(enum.Enum):
    """What the parameters hold when the verification load starts (module docstring)."""

    INDEX_DIGITS = "the probe's last index pass"
    SIGN_PASSES = "a block-quantizing probe's sign passes"
    ANYTHING = "whatever the caller left there (a kept map's check)"


MAX_HOLE_RANGES = 256
"""`Before.ANYTHING` zeroes a parameter's unsourced ranges one by one up to this many; a
parameter with more is zeroed whole."""


class Bad(NamedTuple):
    """A refused element and what the probe saw there."""

    param: str
    element: int
    """Logical flat index into the parameter."""
    seen: str
    """What is wrong at the element, as the probe saw it; `_refuse` adds the source and cause."""
    cast_from: str | None = None
    """The checkpoint tensor the probe decoded there, when its dtype differs from the param's."""


def random_checkpoint(spec: CheckpointSpec, dtypes: dict[str, torch.dtype],
                      casts: dict[torch.dtype, set[torch.dtype]] | None = None, *,
                      negative: bool = False, seed: int = _VERIFY_SEED,
                      buffers: dict[torch.dtype, torch.Tensor] | None = None
                      ) -> dict[str, torch.Tensor]:
    """Pseudo-random safe values of both signs (``negative``: negative ones only): views into
    one random ring per dtype at scattered offsets. ``casts`` maps a checkpoint dtype to the
    parameter dtypes a loader casts it to; their ties and subnormals are mixed into that
    dtype's ring (with the sign of the values they replace). ``buffers`` (the index passes'
    rings, by dtype): each ring is written into its dtype's buffer (`ring_buffer`)."""
    gen = torch.Generator().manual_seed(seed)
    buffers = {} if buffers is None else buffers
    rings: dict[torch.dtype, torch.Tensor] = {}
    out = {}
    for i, t in enumerate(spec.tensors):
        dtype = dtypes[t.name]
        if dtype not in rings:
            largest = max(s.numel for s in spec.tensors if dtypes[s.name] == dtype)
            ring = ring_buffer(buffers, dtype, largest, _ring_numel(largest))
            # One period drawn into the ring's start, then repeated: no memory of its own.
            period = _draw(ring[:random_period(largest)], alphabet(dtype), negative, gen)
            for k, target in enumerate(sorted((casts or {}).get(dtype, ()), key=str)):
                _salt(period, target, k, gen)
            rings[dtype] = repeat_period(ring, period.numel())
        start = (i * 40_503 + 17) % RING_SPAN
        out[t.name] = rings[dtype][start:start + t.numel].view(t.shape)
    return out


def ring_buffer(buffers: dict[torch.dtype, torch.Tensor], dtype: torch.dtype, largest: int,
                numel: int) -> torch.Tensor:
    """The first ``numel`` elements of ``buffers[dtype]``, the one buffer every ring of the
    probe's passes of that dtype is written into (fresh memory cost the probe of a small rank
    as much in page faults as a load). A new one, kept there, where it is too small: big
    enough for the verification pass's ring too, of a dtype whose largest tensor has
    ``largest`` elements."""
    buf = buffers.get(dtype)
    if buf is None or buf.numel() < numel:
        buf = buffers[dtype] = torch.empty(max(numel, _ring_numel(largest)), dtype=dtype)
    return buf[:numel]


def _ring_numel(largest: int) -> int:
    """Elements of the random ring of a dtype whose largest tensor has ``largest`` elements:
    a view of every tensor at its offset below `RING_SPAN`, and one whole period."""
    return max(random_period(largest), largest + RING_SPAN)


def random_period(largest: int) -> int:
    """The period of the random ring of a dtype whose largest tensor has ``largest``
    elements: `random_checkpoint`'s ring repeats every this many values from its start. The
    product of two odd primes (`_draw`), coprime to every modulus of an index pass."""
    # A small checkpoint needs no 1M-value period: one longer than twice the span (tensor
    # offsets, below the span, never coincide) and than its largest tensor (values never
    # repeat inside one) will do; odd, so rows of power-of-two tensors never line up with it.
    wanted = min(_RANDOM_PERIOD, max(2 * RING_SPAN + 1, largest | 1))
    return _SHORT_PERIOD * _prime_from(-(-wanted // _SHORT_PERIOD))


def _prime_from(n: int) -> int:
    """The least prime >= n other than `_SHORT_PERIOD`."""
    while n == _SHORT_PERIOD or any(n % d == 0 for d in range(2, math.isqrt(n) + 1)):
        n += 1
    return n


def repeat_period(ring: torch.Tensor, period: int) -> torch.Tensor:
    """``ring`` past its first ``period`` elements filled with them repeated, in place: memcpy
    of the part filled so far onto the next, doubling it each time."""
    done = period
    while done < ring.numel():
        n = min(done, ring.numel() - done)
        ring[done:done + n].copy_(ring[:n])
        done += n
    return ring


def look_up(table: np.ndarray, index: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out[i] = table[index[i]]`` for indices known to be in range, `_DRAW_CHUNK` at a
    time: ``np.take`` converts its indices to 64 bits, and a chunk's 512 KiB are reused where
    the whole 8 MiB of a 1M-element lookup would be fresh memory (2 ms against 4-5 for the
    first lookup in a process). ``mode="clip"`` skips the bounds check and a buffer."""
    for lo in range(0, index.size, _DRAW_CHUNK):
        np.take(table, index[lo:lo + _DRAW_CHUNK], out=out[lo:lo + _DRAW_CHUNK], mode="clip")
    return out


_TABLE_MAX = 1 << 16
"""Alphabets of at most this many values (the 8- and 16-bit dtypes') draw through a table."""


def _draw(out: torch.Tensor, alpha: Alphabet, negative: bool, gen: torch.Generator
          ) -> torch.Tensor:
    """``out``, one period (`random_period`) of the alphabet's dtype, filled with
    pseudo-random safe values of the alphabet (of both signs, or ``negative`` ones only).

    Value ``j`` of the period ``1021 * q`` comes from the word ``a[j mod 1021] ^ b[j mod
    q]`` of two short rings of uniform random words (16 bits for 8- and 16-bit alphabets, else
    32): each word is uniform, and a wrong offset that is no multiple of the period shows
    another word at an element but one time in 2^16. The word scales to a draw below ``D``,
    twice the alphabet's size (``word * D >> 16``: each draw from the floor or the ceiling of
    2^16 / D words; 30 of a 32-bit word's bits), and draws of the alphabet's size and above
    are negative: the same values as `signed_values` of the draws. (Some 2,000 words from
    torch's generator and two broadcasts, where a million int64 draws took 12-18 ms, most of
    a small rank's probe.)"""
    size = out.numel()
    q = size // _SHORT_PERIOD
    assert q * _SHORT_PERIOD == size and q != _SHORT_PERIOD, size
    wide = alpha.size > _TABLE_MAX
    word = np.uint32 if wide else np.uint16
    a, b = (torch.randint(0, 1 << (32 if wide else 16), (n,), generator=gen).numpy().astype(word)
            for n in (_SHORT_PERIOD, q))
    words = np.empty(size, dtype=word)
    words.reshape(q, _SHORT_PERIOD)[:] = a  # words[j] = a[j mod 1021]
    np.bitwise_xor(words.reshape(_SHORT_PERIOD, q), b, out=words.reshape(_SHORT_PERIOD, q))
    span = 2 * alpha.size
    if not wide:
        # Every word's value, tabled (in 32 bits: 0.5 MiB of temporaries for a 16-bit alphabet).
        positive = np.arange(alpha.first_normal, alpha.first_normal + alpha.size,
                             dtype=np.int32)
        signed = positive - (1 << (8 * alpha.dtype.itemsize - 1))  # the sign bit set
        bits = out.view(alpha.bits_dtype).numpy()
        values = np.concatenate([signed if negative else positive, signed]).astype(bits.dtype)
        table = values[(np.arange(1 << 16, dtype=np.uint32) * span) >> 16]
        look_up(table, words, bits)
        return out
    for lo in range(0, size, _DRAW_CHUNK):  # int64 temporaries stay small
        draws = (torch.from_numpy(words[lo:lo + _DRAW_CHUNK].astype(np.int64)) >> 2) * span >> 30
        upper = draws >= alpha.size
        out[lo:lo + draws.numel()] = signed_values(draws - upper * alpha.size,
                                                   upper.fill_(True) if negative else upper,
                                                   alpha)
    return out


def _salt(values: torch.Tensor, target: torch.dtype, k: int, gen: torch.Generator) -> None:
    """Turn some of ``values`` (in place) into rounding ties and subnormals of ``target``."""
    source = values.dtype
    drop = _mantissa(source) - _mantissa(target)
    bits = values.view(bits_dtype(source))
    if drop > 0:  # a narrowing cast: the dropped bits are exactly one half
        ties = bits[k % _TIE_EVERY::_TIE_EVERY]
        ties.copy_(ties & ~((1 << drop) - 1) | (1 << (drop - 1)))
    tiny = torch.finfo(target).tiny
    sub = values[1 + k:: _SUBNORMAL_EVERY]  # offsets 1 + k and k differ mod _TIE_EVERY
    magnitude = torch.rand(sub.numel(), generator=gen, dtype=torch.float64) * tiny
    negative = sub.view(BITS_DTYPE[source.itemsize]) < 0
    sub.copy_(torch.where(negative, -magnitude, magnitude).to(source))


def _mantissa(dtype: torch.dtype) -> int:
    return int(round(-torch.log2(torch.tensor(torch.finfo(dtype).eps)).item()))


def verify(smap: SourceMap, get: Callable[[], Params], load_weights: LoadWeights,
           spec: CheckpointSpec, dtypes: dict[str, torch.dtype],
           holes: dict[str, tuple[torch.Tensor, torch.Tensor]], before: Before, *,
           buffers: dict[torch.dtype, torch.Tensor] | None = None) -> Bad | None:
    """Load a pseudo-random checkpoint through load_weights; the map must reproduce it, and
    the unsourced elements (``holes``: per parameter, its (first element, count) ranges)
    must hold zero.

    ``before``: what the parameters hold now, which decides the values' signs and what is
    zeroed first (module docstring). After the index passes (`Before.INDEX_DIGITS`) they
    hold a positive digit in every element the map sources and zero in every other (or the
    loader's own non-value, which the holes check refuses), so nothing is zeroed: one write
    of the rank fewer. ``buffers``: the index passes' rings (`random_checkpoint`)."""
    negative = before is Before.INDEX_DIGITS
    casts: dict[torch.dtype, set[torch.dtype]] = {}
    for piece in smap.pieces:
        if piece.cast_from is not None:
            casts.setdefault(getattr(torch, piece.cast_from), set()).add(
                dict(get())[piece.param].dtype)
    # A kept map's check draws afresh: the parameters may still hold this seed's values from
    # an earlier check or probe in this process, which a skipped element would then match.
    seed = secrets.randbits(63) if before is Before.ANYTHING else _VERIFY_SEED
    checkpoint = random_checkpoint(spec, dtypes, casts, negative=negative, seed=seed,
                                   buffers=buffers)
    blocks = {p.region.tensor: p.block for p in smap.pieces
              if p.block and scaled_tensor(p.region.tensor) is None}
    for i, (name, block) in enumerate(sorted(blocks.items())):  # quantized: telling values
        gen = torch.Generator().manual_seed((seed + 1 + i) % (1 << 63))
        checkpoint[name] = salted(spec[name].shape, dtypes[name], block, gen)
    if before is Before.SIGN_PASSES or (before is Before.ANYTHING and blocks):
        # (float8 values of a quantized block hit +-448 at every block maximum, so old values
        # equal new ones far more often than one time in the alphabet: zero them all.)
        fill_zero(get())
    elif before is Before.ANYTHING:
        _zero_unsourced(get(), holes)
    load_weights(iter(checkpoint.items()))
    return check_loaded(smap, get(), checkpoint, holes, negative)


def check_loaded(smap: SourceMap, params: Params, checkpoint: Mapping[str, torch.Tensor],
                 holes: dict[str, tuple[torch.Tensor, torch.Tensor]], negative: bool
                 ) -> Bad | None:
    """The check of `verify`, once ``checkpoint`` (a `random_checkpoint`) is loaded: every
    piece of the map reproduces it, and the ``holes`` hold zero."""
    live = _HostCopies(params)  # compared on the host
    images: dict = {}
    for piece in smap.pieces:
        plain, source = expected_source(piece, checkpoint, images)
        bad = first_mismatch(plain, live[piece.param], source)
        if bad is not None:
            p = live[piece.param]
            cast = ("" if piece.cast_from is None and not piece.block else
                    f" block-quantized in {piece.block} blocks" if piece.block else
                    f" cast from {piece.cast_from} rounding to nearest even")
            # The tensor the index probe decoded here is not named: when values changed, it
            # can be any tensor (see `_refuse`).
            signs = "negative values" if negative else "values of both signs"
            return Bad(piece.param, bad,
                       f"parameter {piece.param!r} ({dtype_name(p.dtype)}): element {bad} "
                       f"(index {coords(bad, p.shape)}) does not hold the checkpoint value"
                       f"{cast} the probed map predicts after load_weights of a random "
                       f"checkpoint ({signs}"
                       f"{', rounding ties and subnormals' if cast else ''}).")
    for name, (start, length) in holes.items():
        flat = flat_view(live[name]).view(bits_dtype(live[name].dtype))
        for s, n in zip(start.tolist(), length.tolist()):
            nonzero = torch.nonzero(flat[s:s + n] & _magnitude_mask(live[name].dtype))
            if nonzero.numel():
                at = s + int(nonzero[0])
                return Bad(name, at,
                           f"parameter {name!r}: element {at} (index "
                           f"{coords(at, live[name].shape)}) takes no checkpoint value in the "
                           f"probe, but load_weights wrote a non-zero value there from a random "
                           f"checkpoint.")
    return None


# --------------------------------------------------------------------------------------------
# Small helpers (shared with the probe)
# --------------------------------------------------------------------------------------------


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class _HostCopies:
    """Parameters by name, read on the host one at a time: a GPU parameter is copied once
    while the pieces of it (consecutive in a map) are checked, so the host holds one copy."""

    def __init__(self, params: Params):
        self.params, self._last = dict(params), (None, None)

    def __getitem__(self, name: str) -> torch.Tensor:
        if self._last[0] != name:
            self._last = (None, None)  # drop the previous copy first
            self._last = (name, on_host(self.params[name]))
        return self._last[1]


def on_host(p: torch.Tensor) -> torch.Tensor:
    """``p``'s values on the host: ``p`` itself if it is there, else one device-to-host copy.
    The probe reads every pass back this way and decodes on the host, so it allocates no
    device memory of its own (what the loader allocates is the loader's)."""
    p = p.detach()
    return p if p.device.type == "cpu" else p.to("cpu")


def flat_view(p: torch.Tensor) -> torch.Tensor:
    """Elements in logical row-major order (a view when contiguous)."""
    return p.detach().reshape(-1)


def fill_zero(params: Params) -> None:
    for p in dict(params).values():
        p.detach().zero_()


def _zero_unsourced(params: Params, holes: dict[str, tuple[torch.Tensor, torch.Tensor]]
                    ) -> None:
    """Zero the unsourced ranges of each parameter (logical order); a parameter that is not
    contiguous, or has more than `MAX_HOLE_RANGES` of them, is zeroed whole."""
    params = dict(params)
    for name, (start, length) in holes.items():
        p = params[name].detach()
        if not p.is_contiguous() or start.numel() > MAX_HOLE_RANGES:
            p.zero_()
            continue
        flat = p.view(-1)
        for s, n in zip(start.tolist(), length.tolist()):
            flat[s:s + n].zero_()


def bits_dtype(dtype: torch.dtype) -> torch.dtype:
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32}[dtype.itemsize]


def _magnitude_mask(dtype: torch.dtype) -> int:
    """All bits but the sign: zero and negative zero both pass as 'no value written'."""
    return {1: 0x7F, 2: 0x7FFF, 4: 0x7FFFFFFF}[dtype.itemsize]


def coords(flat: int, shape: torch.Size) -> tuple[int, ...]:
    out = []
    for size in reversed(tuple(shape)):
        out.append(flat % size)
        flat //= size
    return tuple(reversed(out))
