"""Block-scaled FP8: the quantization formula rollout loaders apply, as the torch reference.

DeepSeek-V3 / Kimi-K2 style weights: a 2-d tensor is cut into blocks (128 x 128 usually,
anchored at element (0, 0); blocks at the far edges are cut short), and each block becomes
float8_e4m3fn values plus one float32 scale (``weight_scale_inv``: value ~= q * scale). The
formula is vLLM's own ``per_block_cast_to_fp8`` (``vllm/utils/deep_gemm.py``), step for step:

    amax  = max |x| over the block, in float32, clamped below at 1e-4
    scale = amax / 448                          (float32 division)
    q     = float8_e4m3fn(float32(x) * (1 / scale))   (float32 reciprocal, product, RNE cast)

Every step is a correctly rounded float32 operation, so the trainer's pack (this module on the
torch and CPU paths) reproduces a rollout loader's bits exactly; the probe checks that on its
pseudo-random pass and refuses a loader that rounds otherwise.

Typical usage::

    q, scale = block_quantize(weight_bf16, (128, 128))
"""

from __future__ import annotations

import torch

from weightbridge.types import QUANT_DTYPE, SCALE_DTYPE

__all__ = ["AMAX_FLOOR", "FP8_MAX", "QUANT_DTYPE", "SCALE_DTYPE", "block_grid", "block_quantize",
           "block_scales", "quantize_with"]
FP8_MAX = 448.0
"""Largest finite float8_e4m3fn value."""
AMAX_FLOOR = 1e-4
"""Smallest amax a block's scale is computed from (an all-zero block gets a finite scale)."""


def block_quantize(x: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn values of ``x``'s shape, float32 scales of the block grid's shape).

    ``x`` is a 2-d float tensor (any strides); blocks are anchored at its element (0, 0).
    """
    scale = block_scales(x, block)
    return quantize_with(x, scale, block), scale


def block_scales(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The float32 scale of every block of ``x`` (shape ``ceil(rows / bm), ceil(cols / bk)``)."""
    bm, bk = block
    rows, cols = x.shape
    grid = (-(-rows // bm), -(-cols // bk))
    padded = x.new_zeros(grid[0] * bm, grid[1] * bk)  # zeros never raise a block's amax
    padded[:rows, :cols] = x
    amax = padded.view(grid[0], bm, grid[1], bk).abs().float().amax(dim=(1, 3))
    return amax.clamp(AMAX_FLOOR) / FP8_MAX


def quantize_with(x: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float8_e4m3fn values of ``x`` given its blocks' scales."""
    bm, bk = block
    rows, cols = x.shape
    inverse = (1.0 / scale).repeat_interleave(bm, 0).repeat_interleave(bk, 1)[:rows, :cols]
    return (x.float() * inverse).to(torch.float8_e4m3fn)


def block_grid(shape: tuple[int, ...], block: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of the scale grid of a tensor of ``shape``."""
    return tuple(-(-n // b) for n, b in zip(shape, block))
