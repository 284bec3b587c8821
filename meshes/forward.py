"""A rollout rank's forward pass over its own shard: the compute between two collectives.

A TP x EP engine runs each layer as local matmuls followed by an all-reduce; this computes one
rank's local part on its inference-layout parameters (fused qkv, stacked w13/w2 experts, padded
vocabulary shard) without the collectives, so a rollout actor can take a generation step with
the weights it just received and every parameter it holds is read.

Typical usage::

    logits = rank_forward(shard, torch.tensor([[1, 5, 9]]))   # [batch, tokens, local vocab]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from meshes.qwen3_moe import RolloutShard

TOP_K = 2
"""Experts per token."""


@torch.no_grad()
def rank_forward(shard: RolloutShard, tokens: torch.Tensor) -> torch.Tensor:
    """Logits over this rank's vocabulary shard for ``tokens`` [batch, seq] (float32)."""
    c, p = shard.c, {n: t.float() for n, t in shard.params.items()}
    embed = p["model.embed_tokens.weight"]
    lo = shard.tp_rank * embed.shape[0]
    local = tokens - lo
    inside = (local >= 0) & (local < embed.shape[0])
    h = embed[local.clamp(0, embed.shape[0] - 1)] * inside.unsqueeze(-1)
    q_size = c.heads * c.head_dim // shard.tp
    kv_size = c.kv_heads * c.head_dim // shard.tp
    for i in range(c.layers):
        pre = f"model.layers.{i}."
        x = _rms(h, p[pre + "input_layernorm.weight"])
        q, k, v = (x @ p[pre + "self_attn.qkv_proj.weight"].T).split([q_size, kv_size, kv_size], -1)
        q = _rms(_heads(q, c.head_dim), p[pre + "self_attn.q_norm.weight"])
        k = _rms(_heads(k, c.head_dim), p[pre + "self_attn.k_norm.weight"])
        v = _heads(v, c.head_dim)
        group = q.shape[1] // k.shape[1]
        attn = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1),
                                              v.repeat_interleave(group, 1), is_causal=True)
        h = h + attn.transpose(1, 2).flatten(2) @ p[pre + "self_attn.o_proj.weight"].T
        h = h + _local_experts(shard, p, pre, _rms(h, p[pre + "post_attention_layernorm.weight"]))
    return _rms(h, p["model.norm.weight"]) @ p["lm_head.weight"].T


def _local_experts(shard: RolloutShard, p: dict, pre: str, x: torch.Tensor) -> torch.Tensor:
    """This rank's share of the MoE layer: its local experts, its slice of each."""
    weights, chosen = torch.topk(torch.softmax(x @ p[pre + "mlp.gate.weight"].T, -1), TOP_K)
    w13, w2 = p[pre + "mlp.experts.w13_weight"], p[pre + "mlp.experts.w2_weight"]
    out = torch.zeros_like(x)
    for e in range(shard.local_experts):
        hit = chosen == e + shard.ep_rank * shard.local_experts  # [batch, seq, k]
        if not hit.any():
            continue
        gate, up = (x @ w13[e].T).chunk(2, -1)
        scale = (weights * hit).sum(-1, keepdim=True)
        out = out + scale * ((F.silu(gate) * up) @ w2[e].T)
    return out


def _heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[batch, seq, heads * dim] -> [batch, heads, seq, dim]."""
    return x.unflatten(-1, (-1, head_dim)).transpose(1, 2)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight
