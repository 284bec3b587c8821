"""A block-scaled FP8 rollout of the demo model: vLLM's block-FP8 linear layout, loaded from bf16.

Serving engines hold DeepSeek-V3 style weights: each attention projection a float8_e4m3fn weight
plus a float32 ``weight_scale_inv`` of one scale per (128 x 128 by default) block. vLLM-CPU
builds such layers only from checkpoints already in float8 (its online FP8 quantization is
per tensor), so this loader, in the style of vLLM's ``load_weights``, quantizes each TP shard of
the bf16 checkpoint with vLLM's own ``per_block_cast_to_fp8`` formula (`weightbridge.quant`,
tested against vLLM's function) and writes values and scales into the fused qkv / o_proj
parameters. The rest of the model (norms, embeddings, experts) stays bf16, as in `RolloutShard`.

Typical usage::

    shard = Fp8RolloutShard(SIZES["tiny"], tp=2, tp_rank=0, ep=1, ep_rank=0, block=(32, 32))
    shard.load_weights(checkpoint.items())
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from meshes.qwen3_moe import MoEConfig, RolloutShard
from weightbridge.quant import block_grid, block_quantize

Quantizer = Callable[[torch.Tensor, tuple[int, int]], tuple[torch.Tensor, torch.Tensor]]

_QUANTIZED = ("self_attn.qkv_proj.weight", "self_attn.o_proj.weight")


class Fp8RolloutShard(RolloutShard):
    """One rank of a TP x EP rollout engine whose attention projections are block-scaled FP8."""

    def __init__(self, c: MoEConfig, tp: int, tp_rank: int, ep: int, ep_rank: int, *,
                 block: tuple[int, int] = (128, 128), quantize: Quantizer = block_quantize):
        super().__init__(c, tp, tp_rank, ep, ep_rank)
        self.block, self.quantize = block, quantize
        for name in [n for n in self.params if n.endswith(_QUANTIZED)]:
            shape = self.params[name].shape
            self.params[name] = torch.zeros(shape, dtype=torch.float8_e4m3fn)
            self.params[name + "_scale_inv"] = torch.zeros(block_grid(tuple(shape), block),
                                                           dtype=torch.float32)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        plain = []
        for name, w in weights:
            if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
                c, tp, r = self.c, self.tp, self.tp_rank
                q, kv = c.heads * c.head_dim // tp, c.kv_heads * c.head_dim // tp
                offset, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[name.split(".")[-2][0]]
                self._store(name.rsplit(".", 2)[0] + ".qkv_proj.weight", offset,
                            w.narrow(0, r * size, size))
            elif name.endswith("o_proj.weight"):
                size = self.c.heads * self.c.head_dim // self.tp
                self._store(name, 0, w.narrow(1, self.tp_rank * size, size))
            else:
                plain.append((name, w))
        super().load_weights(plain)

    def _store(self, param: str, row: int, shard: torch.Tensor) -> None:
        """Quantize one TP shard and write its values at ``row`` and its scales at the matching
        block row (vLLM's block-FP8 loaders require shard offsets on block boundaries)."""
        bm = self.block[0]
        if row % bm:
            raise ValueError(f"{param}: shard at row {row} is not on a {bm}-row block boundary")
        q, scale = self.quantize(shard, self.block)
        self.params[param][row:row + shard.shape[0]].copy_(q)
        self.params[param + "_scale_inv"][row // bm:row // bm + scale.shape[0]].copy_(scale)


def per_tensor_quantize(x: torch.Tensor, block: tuple[int, int]
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """A quantizer that is *not* block-scaled (one scale for the whole shard, written into every
    block's slot): what the probe must refuse, since no per-block formula reproduces it."""
    amax = x.abs().float().amax().clamp(1e-4)
    scale = amax / 448.0
    grid = block_grid(tuple(x.shape), block)
    return (x.float() * (1.0 / scale)).to(torch.float8_e4m3fn), scale.expand(grid).clone()
