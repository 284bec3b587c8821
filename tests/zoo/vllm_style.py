"""Rollout-side loaders in the style of vLLM and SGLang model files (Llama, Qwen2, Qwen3-MoE).

The model's ``load_weights`` walks the checkpoint once, renames HF tensors onto fused parameters
through ``stacked_params_mapping`` (q/k/v -> qkv_proj, gate/up -> gate_up_proj) and
``expert_params_mapping`` (experts.E.* -> experts.w13_ / w2_), and lets each parameter's
``weight_loader`` (`vllm_layers`) take this rank's shard. Written from scratch in that style.
"""

from __future__ import annotations

from functools import partial
from typing import Iterable

import torch
from torch import nn

from .common import Expect, Worker, make_worker
from .models import ModelConfig, hf_spec
from .vllm_layers import (FP8, FusedMoE, MergedColumnParallelLinear, Parallel, ParallelLMHead,
                          QKVParallelLinear, ReplicatedLinear, RMSNorm, RowParallelLinear,
                          VocabParallelEmbedding, narrow_dim0_loader, make_param,
                          default_weight_loader)

# --------------------------------------------------------------------------------------------
# Llama / Qwen2 / Qwen3-MoE
# --------------------------------------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, par: Parallel) -> None:
        super().__init__()
        dt, fp8 = cfg.dtype_of("attn"), cfg.fp8_scales
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads,
                                          cfg.num_kv_heads, dtype=dt, par=par,
                                          bias=cfg.attention_bias, fp8_scales=fp8)
        self.o_proj = RowParallelLinear(cfg.q_size, cfg.hidden_size, dtype=dt, par=par,
                                        fp8_scales=fp8)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, dtype=cfg.dtype_of("norm"))
            self.k_norm = RMSNorm(cfg.head_dim, dtype=cfg.dtype_of("norm"))
        if cfg.attention_sinks:  # gpt-oss style: one learned logit per head, split like q heads
            self.sinks = make_param(cfg.num_heads // par.tp_size, dtype=cfg.dtype_of("sinks"),
                                loader=partial(narrow_dim0_loader, tp_rank=par.tp_rank))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, par: Parallel) -> None:
        super().__init__()
        dt, im = cfg.dtype_of("mlp"), cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [im, im], dtype=dt, par=par,
                                                       fp8_scales=cfg.fp8_scales)
        self.down_proj = RowParallelLinear(im, cfg.hidden_size, dtype=dt, par=par,
                                           fp8_scales=cfg.fp8_scales)


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, par: Parallel) -> None:
        super().__init__()
        self.gate = ReplicatedLinear(cfg.hidden_size, cfg.num_experts, dtype=cfg.dtype_of("router"))
        self.experts = FusedMoE(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                                dtype=cfg.dtype_of("expert"), par=par, fp8_scales=cfg.fp8_scales)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, par: Parallel) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, dtype=cfg.dtype_of("norm"))
        self.self_attn = Attention(cfg, par)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, dtype=cfg.dtype_of("norm"))
        self.mlp = SparseMoeBlock(cfg, par) if cfg.num_experts else MLP(cfg, par)


class Model(nn.Module):
    def __init__(self, cfg: ModelConfig, par: Parallel, *, zero_fill: bool) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size,
                                                   dtype=cfg.dtype_of("embed"), par=par,
                                                   zero_fill=zero_fill)
        self.layers = nn.ModuleList(DecoderLayer(cfg, par) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, dtype=cfg.dtype_of("norm"))


class ForCausalLM(nn.Module):
    """LlamaForCausalLM / Qwen2ForCausalLM / Qwen3MoeForCausalLM in one class."""

    stacked_params_mapping = [
        # (param_name, shard_name, shard_id)
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    ]

    def __init__(self, cfg: ModelConfig, par: Parallel, *, embed_zero_fill: bool = True,
                 lm_head_zero_fill: bool = True) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Model(cfg, par, zero_fill=embed_zero_fill)
        if cfg.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size,
                                          dtype=cfg.dtype_of("lm_head"), par=par,
                                          zero_fill=lm_head_zero_fill)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        expert_params_mapping = FusedMoE.make_expert_params_mapping(self.cfg.num_experts)
        params_dict = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, loaded_weight in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if self.cfg.tie_word_embeddings and name == "lm_head.weight":
                continue
            for param_name, weight_name, shard_id in self.stacked_params_mapping:
                if weight_name not in name or "mlp.experts" in name:
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
                    if not param.weight_loader(param, loaded_weight, name, shard_id=shard_id,
                                               expert_id=expert_id):
                        name = None  # not this rank's expert
                    break
                else:
                    param = params_dict[name]
                    getattr(param, "weight_loader", default_weight_loader)(param, loaded_weight)
            if name is not None:
                loaded.add(name)
        return loaded


def _vocab_expect(model: ForCausalLM) -> tuple[dict[str, int], set[str]]:
    """Unsourced padding rows of the embedding and (untied) head, and which ones get zeros."""
    unsourced, zeroed = {}, set()
    heads = [("model.embed_tokens.weight", model.model.embed_tokens)]
    if not model.cfg.tie_word_embeddings:
        heads.append(("lm_head.weight", model.lm_head))
    for name, layer in heads:
        if layer.num_padding_rows:
            unsourced[name] = layer.num_padding_rows * layer.weight.shape[1]
            if layer.zero_fill:
                zeroed.add(name)
    return unsourced, zeroed


def _build_causal_lm(cfg: ModelConfig, par: Parallel, pieces_per_layer: int, *,
                     unused: frozenset[str] = frozenset(), **kwargs) -> Worker:
    model = ForCausalLM(cfg, par, **kwargs)
    unsourced, zeroed = _vocab_expect(model)
    num_heads_params = 1 if cfg.tie_word_embeddings else 2
    expect = Expect(max_pieces=num_heads_params + 1 + cfg.num_layers * pieces_per_layer,
                    unsourced=unsourced, unused=unused, filled=frozenset(zeroed))
    return make_worker(dict(model.named_parameters()), model.load_weights, hf_spec(cfg), expect)


def vllm_llama_tp2(scale: int = 1, rank: int = 1) -> Worker:
    """Dense Llama, TP=2: fused qkv and gate_up, vocab padded to 64 (embedding zero-filled,
    lm_head padding left untouched)."""
    cfg = ModelConfig().scaled(scale)
    # per layer: qkv 3, o 1, gate_up 2, down 1, two norms
    return _build_causal_lm(cfg, Parallel(tp_size=2, tp_rank=rank), 9,
                            embed_zero_fill=True, lm_head_zero_fill=False)


def vllm_qwen3_moe_tp4(scale: int = 1, rank: int = 3) -> Worker:
    """Qwen3-MoE, TP=4 > 2 kv heads (each kv head replicated on two ranks), experts TP-sharded
    into stacked w13/w2, q_norm/k_norm."""
    cfg = ModelConfig(num_experts=4, qk_norm=True).scaled(scale)
    # per layer: qkv 3, o 1, 4 norms, router 1, w13 2 per expert, w2 1 per expert
    return _build_causal_lm(cfg, Parallel(tp_size=4, tp_rank=rank), 9 + 3 * cfg.num_experts)


def vllm_qwen3_moe_ep2(scale: int = 1, rank: int = 1) -> Worker:
    """Qwen3-MoE, TP=2 attention with expert parallelism: this rank holds experts 2..3 only,
    renumbered 0..1; the other experts' tensors are unused."""
    cfg = ModelConfig(num_experts=4, qk_norm=True).scaled(scale)
    num_local = cfg.num_experts // 2
    unused = frozenset(f"model.layers.{i}.mlp.experts.{e}.{proj}.weight"
                       for i in range(cfg.num_layers)
                       for e in range(cfg.num_experts) if e // num_local != rank
                       for proj in ("gate_proj", "up_proj", "down_proj"))
    return _build_causal_lm(cfg, Parallel(tp_size=2, tp_rank=rank, enable_expert_parallel=True),
                            9 + 3 * num_local, unused=unused)


def sglang_qwen3_moe_fp8_mixed(scale: int = 1, rank: int = 1) -> Worker:
    """Qwen3-MoE in five dtypes: float8_e4m3fn attention and experts with 0-d float32
    per-tensor scales landing in per-shard scale vectors (and one 0-d scale param), fp32
    norms, bf16 embedding and router, fp16 lm_head; padded vocab rows left untouched."""
    cfg = ModelConfig(num_experts=4, qk_norm=True, fp8_scales=True,
                      dtypes=(("embed", "bfloat16"), ("lm_head", "float16"), ("norm", "float32"),
                              ("attn", FP8), ("expert", FP8), ("router", "bfloat16"))).scaled(scale)
    # per layer: qkv 3 + 3 scales, o 1 + 1 scale, 4 norms, router 1, per expert 3 + 3 scales
    return _build_causal_lm(cfg, Parallel(tp_size=2, tp_rank=rank), 13 + 6 * cfg.num_experts,
                            embed_zero_fill=False, lm_head_zero_fill=False)


def vllm_qwen2_bias_sinks_tied(scale: int = 1, rank: int = 0) -> Worker:
    """Dense, TP=2, fused 1-d qkv bias, per-head fp32 attention sinks split by TP, and tied
    embeddings (the checkpoint has no lm_head; the head is the embedding module)."""
    cfg = ModelConfig(attention_bias=True, attention_sinks=True, tie_word_embeddings=True,
                      lm_head_in_checkpoint=False, dtypes=(("sinks", "float32"),)).scaled(scale)
    # per layer: qkv weight 3 + bias 3, o 1, sinks 1, two norms, gate_up 2, down 1
    return _build_causal_lm(cfg, Parallel(tp_size=2, tp_rank=rank), 13)


CASES = {
    "vllm_llama_tp2": vllm_llama_tp2,
    "vllm_qwen3_moe_tp4": vllm_qwen3_moe_tp4,
    "vllm_qwen3_moe_ep2": vllm_qwen3_moe_ep2,
    "vllm_qwen2_bias_sinks_tied": vllm_qwen2_bias_sinks_tied,
    "sglang_qwen3_moe_fp8_mixed": sglang_qwen3_moe_fp8_mixed,
}
