"""Source maps (what a worker's ``load_weights`` copies where) and the data plane's box copies."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from operator import attrgetter
from typing import Iterable

from weightbridge.types.build import instances
from weightbridge.types.specs import ParamSpec


@dataclass(frozen=True, slots=True)


class Region:
    """A box of checkpoint elements: along each tensor dim an arithmetic progression.

    Element coordinates are ``start[d] + step[d] * i[d]`` for ``0 <= i[d] < count[d]``. Steps are
    >= 1 (a step of 1 is an ordinary slice; 2 picks every other row, as a rotary interleave does).
    A 0-d tensor is the region with empty tuples.

    Example: rows 0..767 and columns 1024..2047 of a (768, 2048) weight:
    ``Region("model.layers.0.mlp.gate_proj.weight", (0, 1024), (768, 1024), (1, 1))``
    """

    tensor: str
    """Checkpoint FQN."""
    start: tuple[int, ...]
    """First coordinate along each dim."""
    count: tuple[int, ...]
    """Number of coordinates along each dim (all >= 1)."""
    step: tuple[int, ...]
    """Distance between coordinates along each dim (all >= 1)."""

    @property
    def numel(self) -> int:
        return math.prod(self.count)

    @property
    def stop(self) -> tuple[int, ...]:
        """One past the last coordinate along each dim."""
        return tuple(s + k * (c - 1) + 1 for s, c, k in zip(self.start, self.count, self.step))

    def intersect(self, other: "Region") -> "Region | None":
        """The elements in both regions, or None when they share none."""
        if other.tensor != self.tensor:
            return None
        start, count, step = [], [], []
        for dim in zip(self.start, self.count, self.step, other.start, other.count, other.step):
            got = _intersect_progressions(*dim)
            if got is None:
                return None
            start.append(got[0]), count.append(got[1]), step.append(got[2])
        return Region(self.tensor, tuple(start), tuple(count), tuple(step))


def _intersect_progressions(s1: int, c1: int, k1: int, s2: int, c2: int, k2: int
                            ) -> tuple[int, int, int] | None:
    """Intersect {s1 + k1*i, i < c1} with {s2 + k2*j, j < c2}: (start, count, step) or None."""
    lo = max(s1, s2)
    hi = min(s1 + k1 * (c1 - 1), s2 + k2 * (c2 - 1))
    if lo > hi:
        return None
    if k1 == 1 and k2 == 1:  # the common case: plain slices
        return lo, hi - lo + 1, 1
    # Solve x = s1 (mod k1), x = s2 (mod k2) by CRT; solutions form a progression of step lcm.
    g = math.gcd(k1, k2)
    if (s2 - s1) % g:
        return None
    lcm = k1 // g * k2
    m = (s2 - s1) // g * pow(k1 // g, -1, k2 // g) % (k2 // g) if k2 // g > 1 else 0
    x0 = s1 + k1 * m  # one solution; shift it to the first one >= lo
    first = x0 + (lo - x0 + lcm - 1) // lcm * lcm
    if first > hi:
        return None
    count = (hi - first) // lcm + 1
    return first, count, (lcm if count > 1 else 1)


@dataclass(frozen=True, slots=True)


class Piece:
    """One slice-copy that ``load_weights`` performed: a checkpoint region into a parameter.

    The element at region index ``i`` (one index per region dim) lands at logical flat index
    ``offset + sum(i[d] * strides[d])`` of the parameter. Strides may be any integers: a
    transposed copy has its strides swapped, a reversed copy a negative stride.

    Example: the k rows of a fused qkv weight on TP rank 1 of 2, from a (512, 2048) k_proj:
    ``Piece(Region("...k_proj.weight", (256, 0), (256, 2048), (1, 1)),
    "...qkv_proj.weight", offset=2048 * 2048, strides=(2048, 1))``
    """

    region: Region
    """Which checkpoint elements."""
    param: str
    """Runtime parameter FQN on this worker."""
    offset: int
    """Logical flat index in the parameter of the region's first element."""
    strides: tuple[int, ...]
    """Parameter flat-index step per region dim."""
    cast_from: str | None = None
    """The checkpoint tensor's dtype when the loader casts it into a parameter of another dtype
    (round to nearest even, as ``param.copy_(tensor)`` does); None for a plain copy."""
    block: tuple[int, ...] = ()
    """Block shape (rows, columns) when the loader block-quantizes to float8 (`weightbridge.quant`):
    a piece of a real checkpoint tensor (``cast_from`` set) holds its quantized values, a piece of
    `scale_tensor` of it holds one float32 scale per block. Empty for a copy or a plain cast."""

    @property
    def transposed(self) -> bool:
        """True when the copy does not preserve the checkpoint's row-major element order."""
        dims = [d for d, c in enumerate(self.region.count) if c > 1]
        return any(abs(self.strides[a]) < abs(self.strides[b]) for a, b in zip(dims, dims[1:]))


@dataclass(frozen=True, slots=True)


class SourceMap:
    """Which checkpoint element each parameter element of one worker comes from.

    The output of `extract_source_map`; its meaning is `weightbridge.replay`: replaying the pieces
    fills the parameters exactly as the worker's own ``load_weights`` does.
    """

    params: tuple[ParamSpec, ...]
    """The worker's parameters (logical shapes and dtypes)."""
    pieces: tuple[Piece, ...]
    """Every slice-copy, sorted by (param, offset)."""
    unsourced: tuple[tuple[str, int], ...] = ()
    """(param, number of elements no checkpoint element lands in), for params with any."""
    unused: tuple[str, ...] = ()
    """Checkpoint tensors the loader never copied from (not an error)."""

    @property
    def num_elements(self) -> int:
        """Number of parameter elements with a source."""
        return sum(p.region.numel for p in self.pieces)

    def tensors(self) -> tuple[str, ...]:
        """Checkpoint tensors this worker reads, in first-use order (a block scale's virtual
        tensor counts as its tensor: it is computed from it)."""
        return tuple(dict.fromkeys(scaled_tensor(p.region.tensor) or p.region.tensor
                                   for p in self.pieces))

    def __reduce__(self):
        # Pickled as plain tuples: every map crosses the control plane at connect, and the
        # default (one dict of slots per Piece and per Region) took 11 s to unpickle on the
        # controller for the 512 maps of the paper's largest deployment, 1.3 s this way.
        return (_source_map, (self.params, tuple(map(_piece_fields, self.pieces)),
                              self.unsourced, self.unused))

    def summary(self) -> str:
        """A few readable lines: params, pieces, transposed pieces, unsourced, unused."""
        num_transposed = sum(p.transposed for p in self.pieces)
        num_unsourced = sum(n for _, n in self.unsourced)
        return (f"SourceMap: {len(self.params)} params, {len(self.pieces)} pieces "
                f"({num_transposed} transposed), {self.num_elements:,} sourced elements, "
                f"{num_unsourced:,} unsourced, {len(self.tensors())} checkpoint tensors read, "
                f"{len(self.unused)} unused")


_REGION_FIELDS = tuple(f.name for f in dataclasses.fields(Region))
assert dataclasses.fields(Piece)[0].name == "region"  # (`_source_map` rebuilds it first)
_piece_fields = attrgetter(*(f"region.{name}" for name in _REGION_FIELDS),
                           *(f.name for f in dataclasses.fields(Piece)[1:]))
"""A piece's pickled form: its region's fields, then its own, in declaration order."""


def _source_map(params, pieces, unsourced, unused) -> SourceMap:
    """A `SourceMap` from its pickled form (`SourceMap.__reduce__`)."""
    if not pieces:
        return SourceMap(params, (), unsourced, unused)
    columns, k = tuple(zip(*pieces)), len(_REGION_FIELDS)
    regions = instances(Region, len(pieces), columns[:k])
    return SourceMap(params, tuple(instances(Piece, len(pieces), (regions, *columns[k:]))),
                     unsourced, unused)


SCALE_SUFFIX = "::block_scale_inv"
"""Suffix of the virtual checkpoint tensor of a block-quantized tensor's scales: it exists in no
checkpoint, its element (i, j) is the scale of block (i, j), computed from the tensor's values."""


def scale_tensor(tensor: str) -> str:
    """Name of the virtual scale tensor of checkpoint tensor ``tensor``."""
    return tensor + SCALE_SUFFIX


def scaled_tensor(name: str) -> str | None:
    """The checkpoint tensor whose scales ``name`` names, or None for a real tensor name."""
    return name[:-len(SCALE_SUFFIX)] if name.endswith(SCALE_SUFFIX) else None


def pieces_by_param(pieces: Iterable[Piece]) -> dict[str, list[Piece]]:
    """Group pieces by parameter name, keeping order."""
    out: dict[str, list[Piece]] = {}
    for p in pieces:
        out.setdefault(p.param, []).append(p)
    return out


# --------------------------------------------------------------------------------------------
# Data plane descriptors
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)


class BoxCopy:
    """Copy one strided box of elements between a tensor and a contiguous byte buffer.

    The box's elements are laid out in the buffer row-major over ``shape``, starting at byte
    ``buffer_offset``. In the tensor, box index ``i`` is the element at storage offset
    ``offset + sum(i[d] * strides[d])`` (strides in elements; any sign). Packing reads the tensor
    and writes the buffer; assembling does the reverse. Copying bytes between two buffers is a
    1-d box over a ``uint8`` view.

    Example: rows 512..767 of a contiguous (1024, 2048) parameter, written to the buffer
    transposed (column by column) at byte 4096:
    ``BoxCopy(tensor=3, offset=512 * 2048, shape=(2048, 256), strides=(1, 2048),
    buffer_offset=4096)``
    """

    tensor: int
    """Index into the list of tensors the table is built over."""
    offset: int
    """Storage offset, in elements, of the box's first element."""
    shape: tuple[int, ...]
    """Box shape (row-major order of the bytes in the buffer)."""
    strides: tuple[int, ...]
    """Storage stride, in elements, of each box dim."""
    buffer_offset: int
    """Byte offset of the box in the buffer."""
    buffer_dtype: str | None = None
    """Dtype of the box's elements in the buffer when it differs from the tensor's: packing
    converts tensor -> buffer and assembling buffer -> tensor, rounding to nearest even (see
    `weightbridge.types.CONVERTIBLE_DTYPES`). None: the bits move unchanged."""
    block: tuple[int, ...] = ()
    """Block shape of a block-quantizing box (pack only; `weightbridge.quant`): the box is whole
    quantization blocks tiled from its first element (the last ones cut by the box's end), and
    packing writes, for ``buffer_dtype`` float8_e4m3fn, the quantized values row-major over
    ``shape``, for float32 one scale per block row-major over the block grid. Empty otherwise."""
