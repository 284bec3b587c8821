"""Trainer-side loaders in the style of Megatron-Core models fed by an HF -> Megatron bridge.

Megatron names and fuses its own way: ``linear_qkv`` interleaves q, k and v per query group,
``linear_fc1`` stacks this TP shard's [gate; up], layer norms live inside the TE linear that
follows them (``layer_norm_weight``), the vocabulary is padded to a multiple of
``make_vocab_size_divisible_by * tp``. A pipeline stage numbers its layers from 0, an
expert-parallel rank its experts from 0, and the legacy GroupedMLP stores all local experts
transposed in two 2-d weights. The loader is a registry of name mappings, as bridge converters
are: each Megatron param resolves to the HF tensors it is built from and a conversion that returns
this rank's shard. Written from scratch in that style; no Megatron code is copied.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

import torch

from .common import Expect, Worker, make_worker, round_up, torch_dtype
from .models import ModelConfig, hf_spec


@dataclass(frozen=True)
class MegatronParallel:
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0
    """Expert tensor parallelism is 1: experts are never TP-sharded here."""
    make_vocab_size_divisible_by: int = 8
    legacy_grouped_gemm: bool = False
    """GroupedMLP (weight1 [H, E_local * 2I], weight2 [E_local * I, H]) instead of TE's
    per-expert linear_fc1.weight{j} / linear_fc2.weight{j}."""


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """[q heads of group 0, k of group 0, v of group 0, q heads of group 1, ...]."""
    h, groups = q.shape[-1], cfg.num_kv_heads
    q = q.view(groups, cfg.num_heads // groups * cfg.head_dim, h)
    k = k.view(groups, cfg.head_dim, h)
    v = v.view(groups, cfg.head_dim, h)
    return torch.cat([q, k, v], dim=1).reshape(-1, h)


class ParamMapping:
    """One Megatron param pattern and the HF tensors it is built from.

    Patterns use ``{layer}`` and ``{expert}``; Megatron's are local numbers, HF's global ones.
    """

    def __init__(self, megatron: str, *hf: str) -> None:
        self.megatron, self.hf = megatron, hf
        regex = re.escape(megatron).replace(r"\{layer\}", r"(?P<layer>\d+)")
        self.regex = re.compile(regex.replace(r"\{expert\}", r"(?P<expert>\d+)"))

    def convert(self, tensors: list[torch.Tensor], cfg: ModelConfig, par: MegatronParallel
                ) -> torch.Tensor:
        return tensors[0]

    def load(self, param: torch.Tensor, tensors: list[torch.Tensor], cfg: ModelConfig,
             par: MegatronParallel) -> None:
        param.data.copy_(self.convert(tensors, cfg, par))


class ReplicatedMapping(ParamMapping):
    pass


class ColumnParallelMapping(ParamMapping):
    def convert(self, tensors, cfg, par):
        return tensors[0].chunk(par.tp_size, dim=0)[par.tp_rank]


class RowParallelMapping(ParamMapping):
    def convert(self, tensors, cfg, par):
        return tensors[0].chunk(par.tp_size, dim=1)[par.tp_rank]


class VocabParallelMapping(ParamMapping):
    """Rows of the padded vocabulary; padding rows are left as initialized."""

    def load(self, param, tensors, cfg, par):
        rows = param.shape[0]
        start = par.tp_rank * rows
        shard = tensors[0][start:start + rows]
        param.data[:shard.shape[0]].copy_(shard)


class QKVMapping(ParamMapping):
    def convert(self, tensors, cfg, par):
        return merge_qkv(*tensors, cfg).chunk(par.tp_size, dim=0)[par.tp_rank]


class GatedMLPMapping(ParamMapping):
    def convert(self, tensors, cfg, par):
        gate, up = (t.chunk(par.tp_size, dim=0)[par.tp_rank] for t in tensors)
        return torch.cat([gate, up], dim=0)


class GroupedFc1Mapping(ParamMapping):
    """Legacy GroupedMLP weight1: [gate_j; up_j]^T of every local expert j, side by side."""

    def convert(self, tensors, cfg, par):
        pairs = zip(tensors[0::2], tensors[1::2])
        return torch.cat([torch.cat([gate, up], dim=0).t() for gate, up in pairs], dim=1)


class GroupedFc2Mapping(ParamMapping):
    """Legacy GroupedMLP weight2: down_j^T of every local expert j, stacked."""

    def convert(self, tensors, cfg, par):
        return torch.cat([down.t() for down in tensors], dim=0)


class ExpertGatedMapping(ParamMapping):
    """TE grouped linear_fc1 of one local expert: [gate; up], never TP-sharded (expert TP 1)."""

    def convert(self, tensors, cfg, par):
        return torch.cat(tensors, dim=0)


def mapping_registry(cfg: ModelConfig, par: MegatronParallel) -> list[ParamMapping]:
    dl, hl = "decoder.layers.{layer}", "model.layers.{layer}"
    maps = [
        VocabParallelMapping("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
        VocabParallelMapping("output_layer.weight", "lm_head.weight"),
        ReplicatedMapping("decoder.final_layernorm.weight", "model.norm.weight"),
        ReplicatedMapping(f"{dl}.self_attention.linear_qkv.layer_norm_weight",
                          f"{hl}.input_layernorm.weight"),
        QKVMapping(f"{dl}.self_attention.linear_qkv.weight", f"{hl}.self_attn.q_proj.weight",
                   f"{hl}.self_attn.k_proj.weight", f"{hl}.self_attn.v_proj.weight"),
        ReplicatedMapping(f"{dl}.self_attention.q_layernorm.weight",
                          f"{hl}.self_attn.q_norm.weight"),
        ReplicatedMapping(f"{dl}.self_attention.k_layernorm.weight",
                          f"{hl}.self_attn.k_norm.weight"),
        RowParallelMapping(f"{dl}.self_attention.linear_proj.weight",
                           f"{hl}.self_attn.o_proj.weight"),
        ReplicatedMapping(f"{dl}.mlp.linear_fc1.layer_norm_weight",
                          f"{hl}.post_attention_layernorm.weight"),
        GatedMLPMapping(f"{dl}.mlp.linear_fc1.weight", f"{hl}.mlp.gate_proj.weight",
                        f"{hl}.mlp.up_proj.weight"),
        RowParallelMapping(f"{dl}.mlp.linear_fc2.weight", f"{hl}.mlp.down_proj.weight"),
        ReplicatedMapping(f"{dl}.pre_mlp_layernorm.weight",
                          f"{hl}.post_attention_layernorm.weight"),
        ReplicatedMapping(f"{dl}.mlp.router.weight", f"{hl}.mlp.gate.weight"),
    ]
    he = f"{hl}.mlp.experts.{{expert}}"
    if par.legacy_grouped_gemm:
        maps += [GroupedFc1Mapping(f"{dl}.mlp.experts.weight1", f"{he}.gate_proj.weight",
                                   f"{he}.up_proj.weight"),
                 GroupedFc2Mapping(f"{dl}.mlp.experts.weight2", f"{he}.down_proj.weight")]
    else:
        maps += [ExpertGatedMapping(f"{dl}.mlp.experts.linear_fc1.weight{{expert}}",
                                    f"{he}.gate_proj.weight", f"{he}.up_proj.weight"),
                 ReplicatedMapping(f"{dl}.mlp.experts.linear_fc2.weight{{expert}}",
                                   f"{he}.down_proj.weight")]
    return maps


class MegatronBridge:
    """Resolves each local Megatron param to global HF names and loads this rank's shard."""

    def __init__(self, cfg: ModelConfig, par: MegatronParallel, params: dict[str, torch.Tensor]):
        self.cfg, self.par, self.params = cfg, par, params
        self.mappings = mapping_registry(cfg, par)
        self.layer_offset = par.pp_rank * (cfg.num_layers // par.pp_size)
        self.num_local_experts = cfg.num_experts // par.ep_size

    def resolve(self, name: str) -> tuple[ParamMapping, list[str]]:
        for mapping in self.mappings:
            m = mapping.regex.fullmatch(name)
            if m is None:
                continue
            fields = m.groupdict()
            layer = int(fields["layer"]) + self.layer_offset if "layer" in fields else None
            first = self.par.ep_rank * self.num_local_experts
            if "expert" in fields:  # one param per local expert
                experts = [first + int(fields["expert"])]
            elif any("{expert}" in hf for hf in mapping.hf):  # legacy grouped: all local experts
                experts = list(range(first, first + self.num_local_experts))
            else:
                experts = [None]
            names = [hf.format(layer=layer, expert=e) for e in experts for hf in mapping.hf]
            return mapping, list(dict.fromkeys(names))
        raise KeyError(f"no HF mapping for Megatron param {name!r}")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        hf = dict(weights)  # converters look tensors up by name, in their own order
        for name, param in self.params.items():
            mapping, names = self.resolve(name)
            mapping.load(param, [hf[n] for n in names], self.cfg, self.par)


def megatron_params(cfg: ModelConfig, par: MegatronParallel) -> dict[str, torch.Tensor]:
    """This rank's Megatron-Core GPT params (TE layer spec), local layer and expert numbers."""
    h, tp, d = cfg.hidden_size, par.tp_size, cfg.dtype_of
    vocab_rows = round_up(cfg.vocab_size, par.make_vocab_size_divisible_by * tp) // tp
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    if par.pp_rank == 0:
        out["embedding.word_embeddings.weight"] = (vocab_rows, h), d("embed")
    for i in range(cfg.num_layers // par.pp_size):
        p = f"decoder.layers.{i}"
        out[f"{p}.self_attention.linear_qkv.layer_norm_weight"] = (h,), d("norm")
        qkv_rows = (cfg.q_size + 2 * cfg.kv_size) // tp
        out[f"{p}.self_attention.linear_qkv.weight"] = (qkv_rows, h), d("attn")
        if cfg.qk_norm:
            out[f"{p}.self_attention.q_layernorm.weight"] = (cfg.head_dim,), d("norm")
            out[f"{p}.self_attention.k_layernorm.weight"] = (cfg.head_dim,), d("norm")
        out[f"{p}.self_attention.linear_proj.weight"] = (h, cfg.q_size // tp), d("attn")
        if not cfg.num_experts:
            im = cfg.intermediate_size
            out[f"{p}.mlp.linear_fc1.layer_norm_weight"] = (h,), d("norm")
            out[f"{p}.mlp.linear_fc1.weight"] = (2 * im // tp, h), d("mlp")
            out[f"{p}.mlp.linear_fc2.weight"] = (h, im // tp), d("mlp")
            continue
        im, num_local = cfg.moe_intermediate_size, cfg.num_experts // par.ep_size
        out[f"{p}.pre_mlp_layernorm.weight"] = (h,), d("norm")
        out[f"{p}.mlp.router.weight"] = (cfg.num_experts, h), d("router")
        if par.legacy_grouped_gemm:
            out[f"{p}.mlp.experts.weight1"] = (h, num_local * 2 * im), d("expert")
            out[f"{p}.mlp.experts.weight2"] = (num_local * im, h), d("expert")
        else:
            for j in range(num_local):
                out[f"{p}.mlp.experts.linear_fc1.weight{j}"] = (2 * im, h), d("expert")
                out[f"{p}.mlp.experts.linear_fc2.weight{j}"] = (h, im), d("expert")
    if par.pp_rank == par.pp_size - 1:
        out["decoder.final_layernorm.weight"] = (h,), d("norm")
        # With one stage and tied embeddings the output layer *is* the embedding param.
        if not (cfg.tie_word_embeddings and par.pp_size == 1):
            out["output_layer.weight"] = (vocab_rows, h), d("lm_head")
    return {n: torch.nn.Parameter(torch.empty(s, dtype=torch_dtype(dt)), requires_grad=False)
            for n, (s, dt) in out.items()}


def _build(cfg: ModelConfig, par: MegatronParallel, max_pieces: int) -> Worker:
    params = megatron_params(cfg, par)
    bridge = MegatronBridge(cfg, par, params)
    spec = hf_spec(cfg)
    used = {n for name in params for n in bridge.resolve(name)[1]}
    unsourced = {}
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if name in params:
            rows = params[name].shape[0]
            num_real = max(0, min(rows, cfg.vocab_size - par.tp_rank * rows))
            if rows > num_real:
                unsourced[name] = (rows - num_real) * cfg.hidden_size
    expect = Expect(max_pieces=max_pieces, unsourced=unsourced,
                    unused=frozenset(t.name for t in spec.tensors if t.name not in used))
    return make_worker(params, bridge.load_weights, spec, expect)


def megatron_tp2_dense(scale: int = 1, rank: int = 1) -> Worker:
    """Qwen3 dense under TP=2: qkv interleaved per kv group, [gate; up] per TP shard, column and
    row shards, layer norms folded into TE linears, vocab padded to 16 (padding untouched)."""
    cfg = ModelConfig(qk_norm=True).scaled(scale)
    par = MegatronParallel(tp_size=2, tp_rank=rank)
    num_local_groups = cfg.num_kv_heads // par.tp_size
    # per layer: 3 per local kv group, 4 norms, proj 1, fc1 2, fc2 1; plus embed, head, final norm
    per_layer = 3 * num_local_groups + 4 + 1 + 2 + 1
    return _build(cfg, par, 3 + cfg.num_layers * per_layer)


def megatron_moe_pp2_ep2_legacy(scale: int = 1, pp_rank: int = 1, ep_rank: int = 1) -> Worker:
    """Qwen3-MoE, 4 layers, PP=2 x EP=2, legacy GroupedMLP: stage 1 renumbers layers 2..3 as
    0..1, EP rank 1 renumbers experts 2..3 as 0..1 and stores them transposed side by side."""
    cfg = ModelConfig(num_layers=4, num_experts=4, qk_norm=True).scaled(scale)
    par = MegatronParallel(pp_size=2, pp_rank=pp_rank, ep_size=2, ep_rank=ep_rank,
                           legacy_grouped_gemm=True)
    num_local = cfg.num_experts // par.ep_size
    # per layer: qkv 3 per kv group, 3 norms + pre-mlp norm, proj 1, router 1, 3 per local expert
    per_layer = 3 * cfg.num_kv_heads + 4 + 1 + 1 + 3 * num_local
    edges = (1 if pp_rank == 0 else 0) + (2 if pp_rank == par.pp_size - 1 else 0)
    return _build(cfg, par, edges + cfg.num_layers // par.pp_size * per_layer)


def megatron_tp2_ep2_tied(scale: int = 1, tp_rank: int = 0, ep_rank: int = 1) -> Worker:
    """Qwen3-MoE, TP=2 x EP=2 with TE grouped experts (one param per local expert) and tied
    embeddings on a single stage: the output layer is the embedding param."""
    cfg = ModelConfig(num_experts=4, qk_norm=True, tie_word_embeddings=True,
                      lm_head_in_checkpoint=False).scaled(scale)
    par = MegatronParallel(tp_size=2, tp_rank=tp_rank, ep_size=2, ep_rank=ep_rank)
    num_local = cfg.num_experts // par.ep_size
    per_layer = 3 * (cfg.num_kv_heads // par.tp_size) + 4 + 1 + 1 + 3 * num_local
    return _build(cfg, par, 2 + cfg.num_layers * per_layer)


CASES = {
    "megatron_tp2_dense": megatron_tp2_dense,
    "megatron_moe_pp2_ep2_legacy": megatron_moe_pp2_ep2_legacy,
    "megatron_tp2_ep2_tied": megatron_tp2_ep2_tied,
}
