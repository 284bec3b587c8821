"""Index codec: write checkpoint element indices into tensors of any float dtype, read them back.

Every checkpoint element gets a global index ``g`` (tensors concatenated in `CheckpointSpec`
order). One probe pass cannot store ``g`` in a 16- or 8-bit value, so pass ``k`` stores the
residue ``g mod p_k`` as a *digit*, for pairwise coprime moduli ``p_0 > p_1 > ...`` (primes), and
the Chinese remainder theorem recombines the passes. Residues have the property layout discovery
needs: along a slice-copy of stride ``s`` the digits of every pass advance by ``s mod p_k``, so each
pass alone already shows where slice-copies begin and end (its second differences are zero inside
a copy), and no pass ever needs an int64 index for the whole model.

A digit is stored as a bit pattern of the tensor's own dtype that a plain copy cannot alter: the
positive normal numbers, which form one contiguous range of bit patterns in every float format
(no NaN payloads, no subnormals a flush-to-zero path could touch, no zero: zero is what loaders
write into padding, and it decodes as "no source"). Digit d is the pattern ``first_normal + d``,
so decoding is one integer subtraction on the raw bits and, inside a slice-copy, the raw bits
themselves advance by a constant: the probe finds copy boundaries without decoding every element.

A loader that casts (``param.copy_(fp32_tensor)`` into a bf16 parameter) keeps the *value* of a
digit only if the value exists in both dtypes. `cast_alphabet` is the alphabet for that case:
the normal numbers of the least precise dtype involved that are normal and finite in all of them
(one contiguous range of its bit patterns). Checkpoint tensors hold those values converted to
their own dtype (exact), and parameters are read back converted to the alphabet's dtype (exact
again), so a cast is a copy of digits.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

SUPPORTED_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float16,
                    torch.float32)

BITS_DTYPE = {1: torch.int8, 2: torch.int16, 4: torch.int32}
"""Signed integer dtype that carries each element size as raw bits."""

NO_SOURCE = -1
"""Decoded digit of a bit pattern that is not in the alphabet (untouched, zero or changed)."""


@dataclass(frozen=True)
class Alphabet:
    """The safe bit patterns of one dtype and the moduli of its passes."""

    dtype: torch.dtype
    first_normal: int
    """Bit pattern of digit 0: the smallest positive normal number."""
    size: int
    """Number of safe patterns (positive normals); every modulus is below it."""
    moduli: tuple[int, ...]
    """p_0 > p_1 > ...: distinct primes, so pairwise coprime."""

    @property
    def bits_dtype(self) -> torch.dtype:
        return BITS_DTYPE[self.dtype.itemsize]

    def num_passes(self, num_elements: int) -> int:
        """Passes needed so that every index and every stride (|s| < num_elements) decodes.

        The product of the moduli must exceed 4 * num_elements: 2x for signed strides, 2x so a
        change of stride between two copies can never look like zero in every pass.
        """
        need, prod = 4 * max(num_elements, 1), 1
        for k, p in enumerate(self.moduli):
            prod *= p
            if prod > need:
                return k + 1
        raise ValueError(f"checkpoint of {num_elements:,} elements is too large to index with "
                         f"{self.dtype} values in {len(self.moduli)} passes")


@functools.cache
def alphabet(dtype: torch.dtype) -> Alphabet:
    """The alphabet of a supported dtype (cached)."""
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"layout discovery supports {', '.join(map(str, SUPPORTED_DTYPES))}; "
                         f"got {dtype}. Pass only floating-point weight tensors.")
    finfo = torch.finfo(dtype)
    first = _float_bits(finfo.tiny, dtype)
    size = _float_bits(finfo.max, dtype) - first + 1
    # Enough moduli for any checkpoint: 8-bit alphabets (~120 symbols) need the most passes.
    return Alphabet(dtype, first, size, _primes_below(size - 1, 10))


@functools.cache
def cast_alphabet(dtypes: tuple[torch.dtype, ...]) -> Alphabet:
    """The alphabet whose values every dtype of ``dtypes`` holds exactly, as normal numbers.

    Its dtype is the one with the fewest mantissa bits (every other then holds each of its
    values exactly, inside the common exponent range); its patterns run from the largest
    smallest-normal of the dtypes to the largest value finite in all of them.
    """
    for dt in dtypes:
        alphabet(dt)  # refuses unsupported dtypes
    narrow = min(dtypes, key=lambda dt: (_mantissa_bits(dt), torch.finfo(dt).bits))
    tiny = max(torch.finfo(dt).tiny for dt in dtypes)
    top = min(torch.finfo(dt).max for dt in dtypes)
    first = _float_bits(tiny, narrow)
    last = _float_bits(top, narrow)
    if float(torch.tensor(last, dtype=BITS_DTYPE[narrow.itemsize]).view(narrow)) > top:
        last -= 1  # the conversion rounded up past the common maximum
    size = last - first + 1
    return Alphabet(narrow, first, size, _primes_below(size - 1, 10))


def _mantissa_bits(dtype: torch.dtype) -> int:
    return round(-math.log2(torch.finfo(dtype).eps))


def encode(start: int, num: int, alpha: Alphabet, modulus: int) -> torch.Tensor:
    """Tensor of ``num`` elements holding the digits of indices ``start, start+1, ...``."""
    digits = torch.arange(start, start + num, dtype=torch.int64) % modulus
    return digits_to_values(digits, alpha)


def digits_to_values(digits: torch.Tensor, alpha: Alphabet) -> torch.Tensor:
    """Map int64 digits (< alphabet size) to elements of the alphabet's dtype."""
    return (digits + alpha.first_normal).to(alpha.bits_dtype).view(alpha.dtype)


def signed_values(digits: torch.Tensor, negative: torch.Tensor, alpha: Alphabet) -> torch.Tensor:
    """`digits_to_values`, negated where ``negative`` (bool): only the sign bit differs, so every
    value is still a finite normal number that a copy keeps bit for bit.

    The verification checkpoint is negative after the index passes (whose digits are
    positive) and of both signs alone (`weightbridge.discovery.verify`): a loader whose result
    depends on the sign (``abs``, ``clamp(min=0)``, ``relu``) copies positive values
    unchanged and would pass a checkpoint of positive values only.
    """
    sign = negative.to(torch.int64) << (8 * alpha.dtype.itemsize - 1)
    return (digits + alpha.first_normal - sign).to(alpha.bits_dtype).view(alpha.dtype)


def raw_digits(values: torch.Tensor, alpha: Alphabet) -> torch.Tensor:
    """Digits in the narrow signed bits dtype; valid digits are 0 <= d < modulus.

    The subtraction wraps for negative patterns, but lands at or above the alphabet size, so
    the range check still rejects them.
    """
    return values.view(alpha.bits_dtype) - alpha.first_normal


def decode(values: torch.Tensor, alpha: Alphabet, modulus: int) -> torch.Tensor:
    """Digits (int64) of a 1-d tensor of the alphabet's dtype; NO_SOURCE where unsafe."""
    digits = raw_digits(values, alpha).to(torch.int64)
    return torch.where((digits >= 0) & (digits < modulus), digits, NO_SOURCE)


def crt(residues: list, moduli: tuple[int, ...]):
    """Recombine residues (int64 tensors or numpy arrays) mod pairwise coprime moduli into
    values in [0, prod(moduli)), of the residues' kind.

    Garner's mixed-radix form keeps every intermediate below max(p)^2, so int64 never overflows
    for moduli below 2^31.
    """
    coeffs: list[torch.Tensor] = []
    for k, (r, p) in enumerate(zip(residues, moduli)):
        c = r % p
        for j, prev in enumerate(coeffs):
            c = (c - prev) * pow(moduli[j], -1, p) % p
        coeffs.append(c)
    value = coeffs[-1]
    for c, p in zip(reversed(coeffs[:-1]), reversed(moduli[:len(coeffs) - 1])):
        value = value * p + c
    return value


def _float_bits(x: float, dtype: torch.dtype) -> int:
    return int(torch.tensor(x, dtype=dtype).view(BITS_DTYPE[dtype.itemsize]).item())


def _primes_below(limit: int, count: int) -> tuple[int, ...]:
    """The ``count`` largest primes <= limit, largest first."""
    out: list[int] = []
    n = limit
    while len(out) < count and n >= 2:
        if _is_prime(n):
            out.append(n)
        n -= 1
    return tuple(out)


def _is_prime(n: int) -> bool:
    if n < 4:
        return n >= 2
    if n % 2 == 0:
        return False
    # Miller-Rabin with these bases is deterministic for n < 3.3e24.
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41):
        if a % n == 0:
            continue
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True
