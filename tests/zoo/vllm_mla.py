"""A DeepSeek-V3-like MLA model loaded in the style of vLLM, post-load kernel shuffles included.

``fused_qkv_a_proj`` stacks q_a_proj and kv_a_proj_with_mqa; after loading, the rope rows of
q_b_proj and of the fused projection are de-interleaved for the rope kernel, and the absorbed
MLA weights W_UK_T / W_UV are derived from kv_b_proj (one checkpoint tensor in three params).
The loader contract makes these shuffles part of ``load_weights``. Written from scratch.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from .common import Expect, Worker, make_worker
from .models import MlaConfig, mla_spec
from .vllm_layers import (ColumnParallelLinear, FusedMoE, MergedColumnParallelLinear,
                          MergedReplicatedLinear, Parallel, ParallelLMHead, ReplicatedLinear,
                          RMSNorm, RowParallelLinear, VocabParallelEmbedding, make_param,
                          default_weight_loader)

# --------------------------------------------------------------------------------------------
# DeepSeek-V3-like MLA
# --------------------------------------------------------------------------------------------


def _deinterleave_rope_(rows: torch.Tensor, dim: int) -> None:
    """Rope dims stored as interleaved pairs (DeepSeek checkpoints) -> the half-split order
    [0 2 4 .. | 1 3 5 ..] the fused rope kernel reads. In place along ``dim``."""
    lead = (slice(None),) * dim
    rows.copy_(torch.cat([rows[lead + (slice(0, None, 2),)], rows[lead + (slice(1, None, 2),)]],
                         dim=dim))


class MLAAttention(nn.Module):
    def __init__(self, cfg: MlaConfig, par: Parallel) -> None:
        super().__init__()
        dt, h = cfg.dtype, cfg.hidden_size
        self.cfg, self.num_local_heads = cfg, cfg.num_heads // par.tp_size
        self.fused_qkv_a_proj = MergedReplicatedLinear(
            h, [cfg.q_lora_rank, cfg.kv_lora_rank + cfg.qk_rope_head_dim], dtype=dt)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, dtype=dt)
        self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, cfg.num_heads * cfg.qk_head_dim,
                                             dtype=dt, par=par)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, dtype=dt)
        self.kv_b_proj = ColumnParallelLinear(
            cfg.kv_lora_rank, cfg.num_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), dtype=dt,
            par=par)
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.v_head_dim, h, dtype=dt, par=par)
        # Absorbed MLA weights the decode kernel reads, derived from kv_b_proj after loading.
        n = self.num_local_heads
        self.W_UK_T = make_param(n, cfg.qk_nope_head_dim, cfg.kv_lora_rank, dtype=dt)
        self.W_UV = make_param(n, cfg.kv_lora_rank, cfg.v_head_dim, dtype=dt)

    @torch.no_grad()
    def process_weights_after_loading(self) -> None:
        cfg, n = self.cfg, self.num_local_heads
        q_b = self.q_b_proj.weight.data.view(n, cfg.qk_head_dim, cfg.q_lora_rank)
        _deinterleave_rope_(q_b[:, cfg.qk_nope_head_dim:], dim=1)
        _deinterleave_rope_(self.fused_qkv_a_proj.weight.data[-cfg.qk_rope_head_dim:], dim=0)
        kv_b = self.kv_b_proj.weight.data.T.view(cfg.kv_lora_rank, n,
                                                 cfg.qk_nope_head_dim + cfg.v_head_dim)
        w_uk, w_uv = kv_b.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
        self.W_UV.data.copy_(w_uv.transpose(0, 1))  # [n, kv_lora, v]
        self.W_UK_T.data.copy_(w_uk.permute(1, 2, 0))  # [n, nope, kv_lora]


class DeepseekMoE(nn.Module):
    def __init__(self, cfg: MlaConfig, par: Parallel) -> None:
        super().__init__()
        self.gate = ReplicatedLinear(cfg.hidden_size, cfg.num_experts, dtype=cfg.dtype)
        self.gate.e_score_correction_bias = make_param(cfg.num_experts, dtype="float32",
                                                   loader=default_weight_loader)
        im = cfg.moe_intermediate_size
        self.shared_experts = nn.Module()
        self.shared_experts.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [im, im],
                                                                      dtype=cfg.dtype, par=par)
        self.shared_experts.down_proj = RowParallelLinear(im, cfg.hidden_size, dtype=cfg.dtype,
                                                          par=par)
        self.experts = FusedMoE(cfg.num_experts, cfg.hidden_size, im, dtype=cfg.dtype, par=par)


class DeepseekForCausalLM(nn.Module):
    stacked_params_mapping = [
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
        ("fused_qkv_a_proj", "q_a_proj", 0),
        ("fused_qkv_a_proj", "kv_a_proj_with_mqa", 1),
    ]

    def __init__(self, cfg: MlaConfig, par: Parallel) -> None:
        super().__init__()
        self.cfg = cfg
        dt, h = cfg.dtype, cfg.hidden_size
        self.model = nn.Module()
        self.model.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, h, dtype=dt, par=par)
        self.model.layers = nn.ModuleList()
        for i in range(cfg.num_layers):
            layer = nn.Module()
            layer.input_layernorm = RMSNorm(h, dtype=dt)
            layer.self_attn = MLAAttention(cfg, par)
            layer.post_attention_layernorm = RMSNorm(h, dtype=dt)
            if i < cfg.first_k_dense:
                layer.mlp = nn.Module()
                layer.mlp.gate_up_proj = MergedColumnParallelLinear(
                    h, [cfg.intermediate_size] * 2, dtype=dt, par=par)
                layer.mlp.down_proj = RowParallelLinear(cfg.intermediate_size, h, dtype=dt, par=par)
            else:
                layer.mlp = DeepseekMoE(cfg, par)
            self.model.layers.append(layer)
        self.model.norm = RMSNorm(h, dtype=dt)
        self.lm_head = ParallelLMHead(cfg.vocab_size, h, dtype=dt, par=par)

    def _is_mtp_layer(self, name: str) -> bool:
        parts = name.split(".")
        return parts[1] == "layers" and int(parts[2]) >= self.cfg.num_layers

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        expert_params_mapping = FusedMoE.make_expert_params_mapping(self.cfg.num_experts)
        params_dict = dict(self.named_parameters())
        for name, loaded_weight in weights:
            if self._is_mtp_layer(name):
                continue  # the MTP draft layer is a separate model
            for param_name, weight_name, shard_id in self.stacked_params_mapping:
                if weight_name not in name or "mlp.experts." in name:
                    continue
                name = name.replace(weight_name, param_name)
                param = params_dict[name]
                param.weight_loader(param, loaded_weight, shard_id)
                break
            else:
                for param_name, weight_name, expert_id, shard_id in expert_params_mapping:
                    if weight_name not in name:
                        continue
                    name = name.replace(weight_name, param_name)
                    param = params_dict[name]
                    param.weight_loader(param, loaded_weight, name, shard_id=shard_id,
                                        expert_id=expert_id)
                    break
                else:
                    param = params_dict[name]
                    getattr(param, "weight_loader", default_weight_loader)(param, loaded_weight)
        for layer in self.model.layers:
            layer.self_attn.process_weights_after_loading()


def vllm_deepseek_mla_tp2(scale: int = 1, rank: int = 1) -> Worker:
    """DeepSeek-V3-like MLA, TP=2: fused_qkv_a_proj, rope rows de-interleaved for the kernel
    (step-2 row selections), absorbed W_UK_T / W_UV derived from kv_b_proj (one checkpoint
    tensor in three params, per-head transposed), shared + routed experts, fp32 router bias,
    skipped MTP layer, zero-filled vocab padding."""
    cfg = MlaConfig().scaled(scale)
    par = Parallel(tp_size=2, tp_rank=rank)
    model = DeepseekForCausalLM(cfg, par)
    n = cfg.num_heads // par.tp_size
    # fused_qkv_a 4 (q_a, kv_a latent, two rope halves), two norms, q_b 3 per head, kv_b 1,
    # W_UK_T and W_UV 1 per head each, o 1, two layer norms
    attn = 4 + 2 + 3 * n + 1 + 2 * n + 1 + 2
    dense_mlp = 3
    moe = 2 + 3 + 3 * cfg.num_experts
    num_moe = cfg.num_layers - cfg.first_k_dense
    max_pieces = 3 + cfg.num_layers * attn + cfg.first_k_dense * dense_mlp + num_moe * moe
    embed, head = model.model.embed_tokens, model.lm_head
    unsourced = {"model.embed_tokens.weight": embed.num_padding_rows * cfg.hidden_size,
                 "lm_head.weight": head.num_padding_rows * cfg.hidden_size}
    mtp = frozenset(t.name for t in mla_spec(cfg).tensors
                    if t.name.startswith(f"model.layers.{cfg.num_layers}."))
    expect = Expect(max_pieces=max_pieces, unsourced={k: v for k, v in unsourced.items() if v},
                    unused=mtp, filled=frozenset(unsourced))
    return make_worker(dict(model.named_parameters()), model.load_weights, mla_spec(cfg), expect)


CASES = {"vllm_deepseek_mla_tp2": vllm_deepseek_mla_tp2}
