"""A Qwen3-MoE-shaped model family and its shards, in trainer and rollout layouts.

Pure torch (no Monarch): the meshes' actors, the benchmarks and the controller's demo build on
it. `checkpoint_spec` gives the HF checkpoint names and shapes; `RolloutShard` holds one rank's
parameters in the inference layout (fused qkv, fused gate_up as 3-d stacked experts, TP inside,
experts by expert-parallel rank, vocabulary padded to a multiple of 64) with a vLLM-style
``load_weights``; `TrainerShard` holds one rank in a Megatron-like layout (separate q/k/v sharded
by heads, row-parallel o_proj, experts by expert-parallel rank, unpadded vocabulary shards, a
pipeline stage's contiguous block of layers numbered from 0); `FsdpTrainerShard` holds one rank's
piece of an FSDP flat parameter (the whole checkpoint flattened, padded and cut in equal shards).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from weightbridge import CheckpointSpec, TensorSpec


@dataclass(frozen=True)
class MoEConfig:
    """Dimensions of a Qwen3-MoE-shaped model (HF checkpoint names)."""

    hidden: int = 1024
    layers: int = 6
    heads: int = 16
    kv_heads: int = 4
    head_dim: int = 64
    experts: int = 16
    moe_intermediate: int = 512
    vocab: int = 16384


SIZES = {
    "tiny": MoEConfig(hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32, experts=8,
                      moe_intermediate=128, vocab=1000),
    "medium": MoEConfig(hidden=256, layers=4, heads=8, kv_heads=2, head_dim=32, experts=8,
                        moe_intermediate=256, vocab=4000),
    "small": MoEConfig(),
}
"""Named sizes: "tiny" (~1.3M elements, for tests), "medium" (~9M, for the emulated cluster),
"small" (~200M, for benchmarks).

Every shard takes ``device`` (default "cpu"): where its parameters live (a proc's bound GPU,
`meshes.device.bind_local_device`); its ``load_weights`` reads checkpoint tensors on any device."""


def checkpoint_spec(c: MoEConfig, dtype: str = "bfloat16") -> CheckpointSpec:
    """HF names and shapes of a Qwen3-MoE checkpoint, every tensor of ``dtype``."""
    t = [("model.embed_tokens.weight", (c.vocab, c.hidden))]
    for i in range(c.layers):
        p = f"model.layers.{i}."
        t += [(p + "input_layernorm.weight", (c.hidden,)),
              (p + "post_attention_layernorm.weight", (c.hidden,)),
              (p + "self_attn.q_proj.weight", (c.heads * c.head_dim, c.hidden)),
              (p + "self_attn.k_proj.weight", (c.kv_heads * c.head_dim, c.hidden)),
              (p + "self_attn.v_proj.weight", (c.kv_heads * c.head_dim, c.hidden)),
              (p + "self_attn.o_proj.weight", (c.hidden, c.heads * c.head_dim)),
              (p + "self_attn.q_norm.weight", (c.head_dim,)),
              (p + "self_attn.k_norm.weight", (c.head_dim,)),
              (p + "mlp.gate.weight", (c.experts, c.hidden))]
        for e in range(c.experts):
            q = f"{p}mlp.experts.{e}."
            t += [(q + "gate_proj.weight", (c.moe_intermediate, c.hidden)),
                  (q + "up_proj.weight", (c.moe_intermediate, c.hidden)),
                  (q + "down_proj.weight", (c.hidden, c.moe_intermediate))]
    t += [("model.norm.weight", (c.hidden,)), ("lm_head.weight", (c.vocab, c.hidden))]
    return CheckpointSpec(tuple(TensorSpec(n, s, dtype) for n, s in t))


class RolloutShard:
    """One rank of a TP x EP rollout engine, parameters in the inference layout (of ``dtype``:
    its loader's ``copy_`` casts a checkpoint of another dtype, as vLLM's loaders do)."""

    def __init__(self, c: MoEConfig, tp: int, tp_rank: int, ep: int, ep_rank: int, *,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu"):
        self.c, self.tp, self.tp_rank, self.ep_rank = c, tp, tp_rank, ep_rank
        self.local_experts = c.experts // ep
        vocab_padded = -(-c.vocab // (64 * tp)) * 64 * tp
        q, kv, inter = c.heads * c.head_dim // tp, c.kv_heads * c.head_dim // tp, \
            c.moe_intermediate // tp
        shapes = {"model.embed_tokens.weight": (vocab_padded // tp, c.hidden),
                  "lm_head.weight": (vocab_padded // tp, c.hidden),
                  "model.norm.weight": (c.hidden,)}
        for i in range(c.layers):
            p = f"model.layers.{i}."
            shapes |= {p + "input_layernorm.weight": (c.hidden,),
                       p + "post_attention_layernorm.weight": (c.hidden,),
                       p + "self_attn.qkv_proj.weight": (q + 2 * kv, c.hidden),
                       p + "self_attn.o_proj.weight": (c.hidden, q),
                       p + "self_attn.q_norm.weight": (c.head_dim,),
                       p + "self_attn.k_norm.weight": (c.head_dim,),
                       p + "mlp.gate.weight": (c.experts, c.hidden),
                       p + "mlp.experts.w13_weight": (self.local_experts, 2 * inter, c.hidden),
                       p + "mlp.experts.w2_weight": (self.local_experts, c.hidden, inter)}
        self.params = {n: torch.zeros(s, dtype=dtype, device=device) for n, s in shapes.items()}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        c, tp, r = self.c, self.tp, self.tp_rank
        for name, w in weights:
            if ".experts." in name:
                layer, rest = name.split(".mlp.experts.")
                expert, proj = int(rest.split(".")[0]), rest.split(".")[1]
                local = expert - self.ep_rank * self.local_experts
                if not 0 <= local < self.local_experts:
                    continue
                inter = c.moe_intermediate // tp
                if proj == "down_proj":
                    dst = self.params[f"{layer}.mlp.experts.w2_weight"][local]
                    dst.copy_(w.narrow(1, r * inter, inter))
                else:
                    half = 0 if proj == "gate_proj" else 1
                    dst = self.params[f"{layer}.mlp.experts.w13_weight"][local]
                    dst[half * inter:(half + 1) * inter].copy_(w.narrow(0, r * inter, inter))
            elif name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
                q, kv = c.heads * c.head_dim // tp, c.kv_heads * c.head_dim // tp
                kind = name.split(".")[-2][0]
                offset, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[kind]
                dst = self.params[name.rsplit(".", 2)[0] + ".qkv_proj.weight"]
                dst[offset:offset + size].copy_(w.narrow(0, r * size, size))
            elif name.endswith("o_proj.weight"):
                size = c.heads * c.head_dim // tp
                self.params[name].copy_(w.narrow(1, r * size, size))
            elif name in ("model.embed_tokens.weight", "lm_head.weight"):
                dst = self.params[name]
                rows = dst.shape[0]
                lo, hi = r * rows, min((r + 1) * rows, c.vocab)
                dst[:hi - lo].copy_(w[lo:hi])
                dst[hi - lo:].zero_()
            else:
                self.params[name].copy_(w)


class TrainerShard:
    """One rank of a Megatron-like trainer: attention TP by heads, experts by EP rank, layers by
    pipeline stage.

    Stage ``pp_rank`` of ``pp`` holds layers ``[pp_rank * L, (pp_rank + 1) * L)`` with
    ``L = layers // pp``, renumbered from 0 as Megatron does (stage 1's ``decoder.layers.0`` is
    checkpoint layer L); the embedding lives on the first stage, the final norm and the output
    layer on the last. Parameters are of ``dtype`` (float32: a trainer keeping fp32 weights).
    """

    def __init__(self, c: MoEConfig, tp: int, tp_rank: int, ep: int, ep_rank: int, *,
                 pp: int = 1, pp_rank: int = 0, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cpu"):
        if c.layers % pp or not 0 <= pp_rank < pp:
            raise ValueError(f"pp={pp}, pp_rank={pp_rank}: pp must divide the model's "
                             f"{c.layers} layers and 0 <= pp_rank < pp")
        self.c, self.tp, self.tp_rank, self.ep_rank = c, tp, tp_rank, ep_rank
        self.local_experts = c.experts // ep
        self.num_local_layers = c.layers // pp
        self.first_layer = pp_rank * self.num_local_layers
        self.is_first_stage, self.is_last_stage = pp_rank == 0, pp_rank == pp - 1
        q, kv = c.heads * c.head_dim // tp, c.kv_heads * c.head_dim // tp
        shapes = {}
        if self.is_first_stage:
            shapes["embedding.word_embeddings.weight"] = (c.vocab // tp, c.hidden)
        if self.is_last_stage:
            shapes |= {"output_layer.weight": (c.vocab // tp, c.hidden),
                       "decoder.final_layernorm.weight": (c.hidden,)}
        for i in range(self.num_local_layers):
            p = f"decoder.layers.{i}."
            shapes |= {p + "input_layernorm.weight": (c.hidden,),
                       p + "pre_mlp_layernorm.weight": (c.hidden,),
                       p + "self_attention.q.weight": (q, c.hidden),
                       p + "self_attention.k.weight": (kv, c.hidden),
                       p + "self_attention.v.weight": (kv, c.hidden),
                       p + "self_attention.proj.weight": (c.hidden, q),
                       p + "self_attention.q_layernorm.weight": (c.head_dim,),
                       p + "self_attention.k_layernorm.weight": (c.head_dim,),
                       p + "mlp.router.weight": (c.experts, c.hidden)}
            for e in range(self.local_experts):
                shapes |= {f"{p}mlp.experts.local_experts.{e}.linear_fc1.weight":
                           (2 * c.moe_intermediate, c.hidden),
                           f"{p}mlp.experts.local_experts.{e}.linear_fc2.weight":
                           (c.hidden, c.moe_intermediate)}
        self.params = {n: torch.zeros(s, dtype=dtype, device=device) for n, s in shapes.items()}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        c, r = self.c, self.tp_rank
        for name, w in weights:
            parts = name.split(".")
            if name.startswith("model.layers."):
                layer, rest = int(parts[2]) - self.first_layer, ".".join(parts[3:])
                if not 0 <= layer < self.num_local_layers:
                    continue  # another pipeline stage's layer
                p = f"decoder.layers.{layer}."
                if ".experts." in rest:
                    expert = int(parts[5]) - self.ep_rank * self.local_experts
                    if not 0 <= expert < self.local_experts:
                        continue
                    q = f"{p}mlp.experts.local_experts.{expert}."
                    proj = parts[6]
                    if proj == "down_proj":
                        self.params[q + "linear_fc2.weight"].copy_(w)
                    else:
                        half = 0 if proj == "gate_proj" else 1
                        fc1 = self.params[q + "linear_fc1.weight"]
                        fc1[half * c.moe_intermediate:(half + 1) * c.moe_intermediate].copy_(w)
                    continue
                dst = p + _TRAINER_NAMES[rest]
                if rest.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
                    rows = self.params[dst].shape[0]
                    self.params[dst].copy_(w.narrow(0, r * rows, rows))
                elif rest.endswith("o_proj.weight"):
                    cols = self.params[dst].shape[1]
                    self.params[dst].copy_(w.narrow(1, r * cols, cols))
                else:
                    self.params[dst].copy_(w)
            elif _TRAINER_NAMES[name] not in self.params:
                continue  # embedding off the first stage, final norm / lm_head off the last
            elif name in ("model.embed_tokens.weight", "lm_head.weight"):
                dst = self.params[_TRAINER_NAMES[name]]
                dst.copy_(w.narrow(0, r * dst.shape[0], dst.shape[0]))
            else:
                self.params[_TRAINER_NAMES[name]].copy_(w)


class FsdpTrainerShard:
    """One rank of an FSDP trainer with a single flat parameter (FSDP1 style, one unit).

    Every checkpoint tensor, in `checkpoint_spec` order, is flattened and concatenated; the whole
    is zero-padded to a multiple of ``world`` and cut into ``world`` equal contiguous shards.
    Rank r holds shard r as the 1-d bf16 parameter ``flat_param``; a shard starts and ends
    wherever the cut falls, usually inside a tensor, and the last one ends in padding.
    """

    def __init__(self, c: MoEConfig, world: int, rank: int, *, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cpu"):
        if not 0 <= rank < world:
            raise ValueError(f"FSDP rank {rank} is not in [0, world={world})")
        self.c, self.world, self.rank = c, world, rank
        self.offsets: dict[str, tuple[int, int]] = {}
        """Checkpoint tensor -> [start, stop) in the unsharded flat parameter."""
        pos = 0
        for t in checkpoint_spec(c).tensors:
            self.offsets[t.name] = (pos, pos + t.numel)
            pos += t.numel
        self.shard_numel = -(-pos // world)
        self.shard_start = rank * self.shard_numel
        self.params = {"flat_param": torch.zeros(self.shard_numel, dtype=dtype, device=device)}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        flat, lo = self.params["flat_param"], self.shard_start
        hi = lo + self.shard_numel
        for name, w in weights:
            start, stop = self.offsets[name]
            a, b = max(start, lo), min(stop, hi)
            if a < b:  # the part of this tensor that falls in this rank's shard
                flat[a - lo:b - lo].copy_(w.reshape(-1)[a - start:b - start])


_TRAINER_NAMES = {
    "model.embed_tokens.weight": "embedding.word_embeddings.weight",
    "lm_head.weight": "output_layer.weight",
    "model.norm.weight": "decoder.final_layernorm.weight",
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "self_attn.q_proj.weight": "self_attention.q.weight",
    "self_attn.k_proj.weight": "self_attention.k.weight",
    "self_attn.v_proj.weight": "self_attention.v.weight",
    "self_attn.o_proj.weight": "self_attention.proj.weight",
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
    "mlp.gate.weight": "mlp.router.weight",
}
"""HF checkpoint name (suffix within a layer) -> Megatron-like parameter name."""
