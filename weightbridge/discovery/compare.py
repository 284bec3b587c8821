"""`same_bits`: whether two host arrays hold the same bytes, at the speed of one read of each.

The probe's scans and its verification compare every parameter element with what it should
hold, a few times per probe, so the comparison is a fixed share of the probe's time. numpy's
``array_equal`` writes a boolean per element and reads it back; C's ``memcmp`` reads the two
arrays once (about 1.3x faster on one core here, `docs/notes/probe-speed.md`). An array that is
not C-contiguous is copied to one first (the caller compares slabs of a few MB at a time).
"""

from __future__ import annotations

import ctypes
import ctypes.util

import numpy as np


def _load_memcmp():
    """libc's ``memcmp``, or None where no C library can be loaded."""
    name = ctypes.util.find_library("c")
    try:
        fn = ctypes.CDLL(name).memcmp
    except (OSError, AttributeError, TypeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    return fn


_MEMCMP = _load_memcmp()


def same_bits(x: np.ndarray, y: np.ndarray) -> bool:
    """True when ``x`` and ``y`` have one shape and dtype and the same bytes (bit for bit:
    for float arrays, NaN equals the same NaN, and 0.0 differs from -0.0)."""
    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    if _MEMCMP is None:
        return bool(np.array_equal(x.view(_int_of(x.dtype)), y.view(_int_of(y.dtype))))
    # A strided array (a column shard's checkpoint rows) is copied to a contiguous one
    # first: a copy and memcmp took 0.6x the time of array_equal's boolean per element.
    x, y = np.ascontiguousarray(x), np.ascontiguousarray(y)
    return x.nbytes == 0 or _MEMCMP(x.ctypes.data, y.ctypes.data, x.nbytes) == 0


def _int_of(dtype: np.dtype) -> np.dtype:
    """An integer dtype of ``dtype``'s width (compares bits, not float values)."""
    return np.dtype(f"i{dtype.itemsize}") if dtype.kind in "fiub" else dtype


SEARCH_MIN = 1 << 12
"""`first_difference` narrows down with `same_bits` to this many elements, then looks."""


def first_difference(x: np.ndarray, y: np.ndarray) -> int | None:
    """Index of the first element where two equal-shaped 1-d arrays differ (bit for bit), or
    None: halving with `same_bits` (about two reads of the part before it), then numpy on the
    last few thousand elements."""
    if same_bits(x, y):
        return None
    lo, hi = 0, x.size  # x[:lo] == y[:lo]; x[lo:hi] != y[lo:hi]
    while hi - lo > SEARCH_MIN:
        mid = (lo + hi) // 2
        if same_bits(x[lo:mid], y[lo:mid]):
            lo = mid
        else:
            hi = mid
    a, b = x[lo:hi], y[lo:hi]
    return lo + int(np.flatnonzero(a.view(_int_of(a.dtype)) != b.view(_int_of(b.dtype)))[0])
