"""Probing a loader that block-quantizes to float8: sign passes, scale pairing, quantized images.

Index-valued checkpoints do not survive quantization (each block is rescaled by its own amax).
Values of one magnitude do: a checkpoint whose every element is +448 or -448 gives every block,
whatever its shape, amax 448, so its scale is exactly 1 and every float8 value is exactly the
checkpoint value (and bf16 / fp16 / fp32 parameters copy it exactly too). Only the sign carries
information, so pass (k, b) stores bit b of the digit ``g mod p_k`` (`codec`) of each element's
global index g in its sign; ``ceil(log2 p_k)`` sign passes give the digits of one ordinary
float8 pass, which the ordinary boundary analysis (`runs`) then reads. The scales (they hold 1.0
where the checkpoint holds +-448) pair by name: float8 parameter ``N`` with the float32
parameter ``N_scale_inv`` (or ``N_scale``); the block shape follows from the two shapes
(the smallest power of two per dim that gives the scale's shape), and the scale pieces follow
from the value pieces. The probe's pseudo-random pass then checks every value and every scale
bit for bit against `weightbridge.quant` (vLLM's formula) applied to whole checkpoint tensors,
blocks anchored at the tensor's origin, and refuses anything else.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Iterator, Mapping

import torch

from weightbridge.discovery.boxes import TensorIndex
from weightbridge.discovery.codec import Alphabet, alphabet, digits_to_values
from weightbridge.errors import LayoutError
from weightbridge.quant import FP8_MAX, QUANT_DTYPE, block_quantize
from weightbridge.types import CheckpointSpec, Piece, Region, scale_tensor, scaled_tensor

FP8 = getattr(torch, QUANT_DTYPE)
ALPHABET: Alphabet = alphabet(FP8)
"""The digits of a quantizing probe are those of an ordinary float8 pass."""
SCALE_SUFFIXES = ("_scale_inv", "_scale")


def quantizing(params: Mapping[str, torch.Tensor], ckpt_dtypes: Mapping[str, torch.dtype]
               ) -> bool:
    """True when some float8 parameter has a scale parameter and no checkpoint tensor is
    float8: a block-quantizing loader."""
    return bool(scale_params(params)) and not any(d == FP8 for d in ckpt_dtypes.values())


def scale_params(params: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """float8 parameter -> its float32 scale parameter (``<name>_scale_inv`` or
    ``<name>_scale``), for the float8 parameters that have one. A float8 parameter without is
    probed as a plain cast (refused unless the loader casts with ``copy_``)."""
    out = {}
    for name, p in params.items():
        if p.dtype != FP8:
            continue
        scale = next((name + s for s in SCALE_SUFFIXES if name + s in params), None)
        if scale is not None and params[scale].dtype == torch.float32:
            out[name] = scale
    return out


def sign_bits(modulus: int) -> int:
    """Sign passes that carry one digit mod ``modulus``."""
    return max(1, math.ceil(math.log2(modulus)))


def sign_checkpoint(spec: CheckpointSpec, tindex: TensorIndex, dtypes: dict[str, torch.dtype],
                    modulus: int, bit: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Element g holds -448 where bit ``bit`` of ``g mod modulus`` is set, else +448. The signs
    repeat with period ``modulus``: every tensor is a view into one ring per dtype."""
    largest = max(t.numel for t in spec.tensors)
    digits = torch.arange(modulus, dtype=torch.int64)
    period = torch.where((digits >> bit) & 1 == 1, -FP8_MAX, FP8_MAX)
    ring = period.repeat(-(-(modulus + largest) // modulus))
    rings: dict[torch.dtype, torch.Tensor] = {}
    for t, base in zip(spec.tensors, tindex.bases):
        dtype = dtypes[t.name]
        if dtype not in rings:
            rings[dtype] = ring.to(dtype)
        start = base % modulus
        yield t.name, rings[dtype][start:start + t.numel].view(t.shape)


class SignDecoder:
    """Accumulates one modulus's sign passes for one parameter into float8 digit values."""

    def __init__(self, numel: int):
        self.digits = torch.zeros(numel, dtype=torch.int64)
        self.written = torch.zeros(numel, dtype=torch.bool)
        self.bad: int | None = None
        """First element that held neither +-448 nor 0 (a value-changing loader)."""

    def add(self, flat: torch.Tensor, bit: int) -> None:
        v = flat.float()
        negative, positive = v == -FP8_MAX, v == FP8_MAX
        self.digits |= negative.to(torch.int64) << bit
        self.written |= negative | positive
        odd = ~(negative | positive | (v == 0))
        if self.bad is None and bool(odd.any()):
            self.bad = int(odd.nonzero()[0, 0])

    def values(self, modulus: int) -> torch.Tensor:
        """The pass as float8 digit values (0, i.e. no source, where nothing was written)."""
        if self.bad is None:
            over = self.written & (self.digits >= modulus)
            if bool(over.any()):
                self.bad = int(over.nonzero()[0, 0])
        out = digits_to_values(self.digits.clamp(max=modulus - 1), ALPHABET)
        return torch.where(self.written, out, torch.zeros((), dtype=FP8))


def block_pieces(pieces: list[Piece], live: Mapping[str, torch.Tensor], spec: CheckpointSpec,
                 scales: dict[str, str]) -> list[Piece]:
    """The value pieces of float8 parameters marked with their block, plus the scale pieces
    (regions of `scale_tensor`) of their scale parameters. LayoutError where a piece cuts a
    block or is not a plain row-major 2-d box."""
    out, blocks = [], {}
    for name, scale in scales.items():
        blocks[name] = _block_shape(name, tuple(live[name].shape), scale,
                                    tuple(live[scale].shape))
    for piece in pieces:
        if piece.param not in scales:
            out.append(piece)
            continue
        block = blocks[piece.param]
        value = replace(piece, block=block)
        out += [value, _scale_piece(value, tuple(live[piece.param].shape), scales[piece.param],
                                    tuple(live[scales[piece.param]].shape),
                                    spec[piece.region.tensor].shape)]
    return out


def _block_shape(name: str, shape: tuple[int, ...], scale: str, scale_shape: tuple[int, ...]
                 ) -> tuple[int, int]:
    if len(shape) < 2 or len(scale_shape) != len(shape) or shape[:-2] != scale_shape[:-2]:
        raise LayoutError(f"parameter {name!r} {shape} with scales {scale!r} {scale_shape}: block "
                          f"quantization needs a weight of 2 or more dims (stacked experts: "
                          f"[E, N, K]) and scales of the same leading dims, one per block of "
                          f"its last two ([E, ceil(N / bm), ceil(K / bk)])")
    block = []
    for n, g in zip(shape[-2:], scale_shape[-2:]):
        b = next((1 << e for e in range(31) if -(-n // (1 << e)) == g), None)
        if b is None:
            raise LayoutError(f"parameter {name!r} {shape} has scales {scale!r} {scale_shape}, "
                              f"which no power-of-two block shape gives (scales of shape "
                              f"ceil(rows / bm), ceil(cols / bk)); check the scale parameter")
        block.append(b)
    return tuple(block)


def _scale_piece(value: Piece, shape: tuple[int, ...], scale: str, scale_shape: tuple[int, ...],
                 tensor_shape: tuple[int, ...]) -> Piece:
    region, block = value.region, value.block
    rows, cols = shape[-2:]
    lead, within = divmod(value.offset, rows * cols)  # a stacked expert's index, then (row, col)
    pr, pc = divmod(within, cols)
    steps_ok = region.step == (1, 1) and all(
        c == 1 or s == want for c, s, want in zip(region.count, value.strides, (cols, 1)))
    aligned = all(
        start % b == 0 and at % b == 0
        and (count % b == 0 or (start + count == full and at + count == local))
        for start, at, count, b, full, local in zip(region.start, (pr, pc), region.count, block,
                                                    tensor_shape, (rows, cols)))
    if len(region.count) != 2 or not steps_ok or not aligned or pr + region.count[0] > rows:
        raise LayoutError(
            f"parameter {value.param!r} holds checkpoint tensor {region.tensor!r} rows "
            f"{region.start[0]}..+{region.count[0]}, columns {region.start[-1]}..+"
            f"{region.count[-1]} at parameter element {value.offset}, quantized in {block} "
            f"blocks; the rollout's blocks must be whole checkpoint blocks (anchored at the "
            f"tensor's origin) copied without transpose or stride. Shard the rollout so that "
            f"every shard boundary is a multiple of the block")
    grid = tuple(-(-c // b) for c, b in zip(region.count, block))
    return Piece(Region(scale_tensor(region.tensor), (region.start[0] // block[0],
                                                      region.start[1] // block[1]), grid,
                        (1, 1)),
                 scale, lead * scale_shape[-2] * scale_shape[-1]
                 + (pr // block[0]) * scale_shape[-1] + pc // block[1], (scale_shape[-1], 1),
                 block=block)


def expected_source(piece: Piece, checkpoint: Mapping[str, torch.Tensor],
                    images: dict[tuple[str, tuple[int, ...]], tuple[torch.Tensor, torch.Tensor]]
                    ) -> tuple[Piece, torch.Tensor]:
    """(the piece as a plain copy, the tensor it copies from) for a block piece: the quantized
    image or the scales of its whole checkpoint tensor (cached in ``images``). Other pieces are
    returned unchanged with their checkpoint tensor."""
    if not piece.block:
        return piece, checkpoint[piece.region.tensor]
    tensor = scaled_tensor(piece.region.tensor) or piece.region.tensor
    key = (tensor, piece.block)
    if key not in images:
        images[key] = block_quantize(checkpoint[tensor], piece.block)
    q, s = images[key]
    return replace(piece, cast_from=None), (s if piece.region.tensor != tensor else q)


# --------------------------------------------------------------------------------------------
# The verification values of a quantized tensor
# --------------------------------------------------------------------------------------------

_ANCHORS = 4
"""Distinct block maxima: every block's amax is one of these, so the telling values (below) are
searched for a few scales only."""


def salted(shape: tuple[int, ...], dtype: torch.dtype, block: tuple[int, int],
           gen: torch.Generator) -> torch.Tensor:
    """Verification values for a tensor rollouts quantize in ``block`` blocks: random values of
    both signs whose block maxima are known, salted with values that tell vLLM's formula from
    its near misses (x / scale instead of x * (1 / scale), another rounding of ties: values the
    two round differently, and products that are exact float8 ties), with values in float8's
    subnormal range, one all-zero block and one block of amax below the 1e-4 floor."""
    rows, cols = shape
    bm, bk = block
    grid = (-(-rows // bm), -(-cols // bk))
    # Two random block maxima, and two of 448 * 2**-k: their scales are powers of two, so many
    # products x * (1 / scale) are exact float8 ties (a rounding other than to even shows).
    anchors = torch.cat([torch.rand(_ANCHORS - 2, generator=gen, dtype=torch.float64) * 7.5
                         + 0.5, torch.tensor([FP8_MAX / 128, FP8_MAX / 64],
                                             dtype=torch.float64)]).to(dtype)
    which = torch.arange(grid[0] * grid[1]).view(grid) % _ANCHORS
    amax = anchors[which].repeat_interleave(bm, 0).repeat_interleave(bk, 1)[:rows, :cols]
    x = (torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 1) * amax.double()
    small = torch.rand(shape, generator=gen) < 0.2  # float8 subnormals after scaling
    x = torch.where(small, x * 2.0 ** -torch.randint(8, 16, shape, generator=gen), x)
    x = x.to(dtype)
    for k in range(_ANCHORS):
        telling = _telling(anchors[k], dtype)
        if telling.numel():
            pick = telling[torch.randint(telling.numel(), shape, generator=gen)]
            sign = torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0).to(dtype)
            use = (amax == anchors[k]) & (torch.rand(shape, generator=gen) < 0.3)
            x = torch.where(use, pick * sign, x)
    x = torch.minimum(torch.maximum(x, -amax), amax)
    first = x[::bm, ::bk]
    first.copy_(anchors[which])  # each block's amax, exactly
    if grid[0] * grid[1] > 1:
        x[-1 - (rows - 1) % bm:, -1 - (cols - 1) % bk:].zero_()  # the last block: all zero
    if grid[0] * grid[1] > 2:
        x[:bm, -1 - (cols - 1) % bk:].mul_(2.0 ** -20)  # a block below the amax floor
    return x


def _telling(anchor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Positive values <= ``anchor`` of ``dtype`` that a near-miss formula quantizes otherwise,
    in a block of amax ``anchor``."""
    if dtype.itemsize == 2:
        bits = torch.arange(1, 0x7F80, dtype=torch.int32).to(torch.int16)
        values = bits.view(dtype)
    else:
        values = torch.rand(1 << 20, generator=torch.Generator().manual_seed(7)).to(dtype)
    values = values[values.float() <= float(anchor)]
    scale = torch.tensor(float(anchor), dtype=torch.float32).clamp(1e-4) / FP8_MAX
    product = values.float() * (1.0 / scale)
    q = product.to(FP8)
    divided = (values.float() / scale).to(FP8)
    up = (q.view(torch.uint8) + 1).clamp(max=0x7E).view(FP8).float()
    tie = (product - q.float()).abs() * 2 == (up - q.float()).abs()
    down = (q.view(torch.uint8).to(torch.int16) - 1).clamp(min=0).to(torch.uint8).view(FP8)
    tie |= (product - q.float()).abs() * 2 == (q.float() - down.float()).abs()
    return values[(divided.view(torch.uint8) != q.view(torch.uint8)) | (tie & (product > 0))]
