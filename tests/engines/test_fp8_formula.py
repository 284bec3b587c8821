"""`weightbridge.quant.block_quantize` is vLLM's own block quantization, bit for bit.

The FP8 rollouts' loaders (`meshes/fp8_rollout.py`) quantize with `block_quantize`, written
after vLLM's `per_block_cast_to_fp8`; here it is compared with vLLM's function itself on
several shapes and block sizes, an all-zero strip (the amax floor) and edge blocks.
"""

from __future__ import annotations

import pytest
import torch

from weightbridge.quant import block_quantize

pytestmark = pytest.mark.engines


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def test_block_quantize_is_vllms_per_block_cast_to_fp8():
    from vllm.utils import deep_gemm

    gen = torch.Generator().manual_seed(1)
    for shape, block in (((300, 200), (128, 128)), ((96, 64), (32, 32)), ((130, 7), (128, 128))):
        x = (torch.randn(shape, generator=gen) * torch.rand(shape, generator=gen) ** 6).bfloat16()
        x[:3] = 0  # an all-zero strip: the amax floor
        want_q, want_s = deep_gemm.per_block_cast_to_fp8(x, list(block))
        q, s = block_quantize(x, block)
        assert torch.equal(_bits(q), _bits(want_q)) and torch.equal(_bits(s), _bits(want_s))
