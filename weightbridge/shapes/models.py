"""Real model shapes, as checkpoint tensor specs with Hugging Face names (no tensors).

Typical usage::

    spec = checkpoint(QWEN3_30B_A3B)        # CheckpointSpec, 30.5 B parameters
"""

from __future__ import annotations

from dataclasses import dataclass

from weightbridge.types import CheckpointSpec, TensorSpec


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
    """The dims that decide tensor shapes of a Qwen3-MoE or DeepSeek-V3 style checkpoint.

    Example: ``QWEN3_30B_A3B`` below.
    """

    name: str
    """Display name."""
    hidden: int
    """Model width."""
    num_layers: int
    """Decoder layers."""
    num_heads: int
    """Query heads."""
    vocab: int
    """Vocabulary rows of the embedding and the LM head (untied)."""
    num_experts: int
    """Routed experts per MoE layer."""
    moe_intermediate: int
    """Intermediate size of one routed expert."""
    num_dense_layers: int = 0
    """Leading layers with a dense MLP instead of experts."""
    dense_intermediate: int = 0
    """Intermediate size of the dense MLP."""
    num_shared_experts: int = 0
    """Shared experts, stored as one MLP of ``num_shared_experts * moe_intermediate``."""
    num_kv_heads: int = 0
    """GQA key/value heads (Qwen3); 0 for MLA."""
    head_dim: int = 0
    """GQA head dim (Qwen3)."""
    q_lora_rank: int = 0
    """MLA query low-rank dim; 0 for a plain q_proj."""
    kv_lora_rank: int = 0
    """MLA key/value low-rank dim; 0 for GQA."""
    qk_nope_dim: int = 0
    """MLA per-head non-rotary query/key dim."""
    qk_rope_dim: int = 0
    """MLA per-head rotary dim."""
    v_head_dim: int = 0
    """MLA per-head value dim."""

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0


MOONLIGHT_16B_A3B = ModelConfig(
    name="Moonlight-16B-A3B", hidden=2048, num_layers=27, num_heads=16, vocab=163840,
    num_experts=64, moe_intermediate=1408, num_dense_layers=1, dense_intermediate=11264,
    num_shared_experts=2, kv_lora_rank=512, qk_nope_dim=128, qk_rope_dim=64, v_head_dim=128)
QWEN3_30B_A3B = ModelConfig(
    name="Qwen3-30B-A3B", hidden=2048, num_layers=48, num_heads=32, num_kv_heads=4,
    head_dim=128, vocab=151936, num_experts=128, moe_intermediate=768)
QWEN3_235B_A22B = ModelConfig(
    name="Qwen3-235B-A22B", hidden=4096, num_layers=94, num_heads=64, num_kv_heads=4,
    head_dim=128, vocab=151936, num_experts=128, moe_intermediate=1536)
KIMI_K2 = ModelConfig(
    name="Kimi-K2", hidden=7168, num_layers=61, num_heads=64, vocab=163840, num_experts=384,
    moe_intermediate=2048, num_dense_layers=1, dense_intermediate=18432, num_shared_experts=1,
    q_lora_rank=1536, kv_lora_rank=512, qk_nope_dim=128, qk_rope_dim=64, v_head_dim=128)


def checkpoint(cfg: ModelConfig, dtype: str = "bfloat16") -> CheckpointSpec:
    """Every tensor of the model's HF checkpoint, in file order."""
    H = cfg.hidden
    t = [TensorSpec("model.embed_tokens.weight", (cfg.vocab, H), dtype)]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        t.append(TensorSpec(p + "input_layernorm.weight", (H,), dtype))
        t += [TensorSpec(p + "self_attn." + n, s, dtype) for n, s in _attention(cfg)]
        t.append(TensorSpec(p + "post_attention_layernorm.weight", (H,), dtype))
        if i < cfg.num_dense_layers:
            t += _mlp(p + "mlp.", H, cfg.dense_intermediate, dtype)
            continue
        t.append(TensorSpec(p + "mlp.gate.weight", (cfg.num_experts, H), dtype))
        for e in range(cfg.num_experts):
            t += _mlp(f"{p}mlp.experts.{e}.", H, cfg.moe_intermediate, dtype)
        if cfg.num_shared_experts:
            t += _mlp(p + "mlp.shared_experts.", H,
                      cfg.num_shared_experts * cfg.moe_intermediate, dtype)
    t.append(TensorSpec("model.norm.weight", (H,), dtype))
    t.append(TensorSpec("lm_head.weight", (cfg.vocab, H), dtype))
    return CheckpointSpec(tuple(t))


def _attention(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    H, nh = cfg.hidden, cfg.num_heads
    if not cfg.mla:
        hd, kv = cfg.head_dim, cfg.num_kv_heads
        return [("q_proj.weight", (nh * hd, H)), ("k_proj.weight", (kv * hd, H)),
                ("v_proj.weight", (kv * hd, H)), ("o_proj.weight", (H, nh * hd)),
                ("q_norm.weight", (hd,)), ("k_norm.weight", (hd,))]
    qk = cfg.qk_nope_dim + cfg.qk_rope_dim
    out = []
    if cfg.q_lora_rank:
        out += [("q_a_proj.weight", (cfg.q_lora_rank, H)),
                ("q_a_layernorm.weight", (cfg.q_lora_rank,)),
                ("q_b_proj.weight", (nh * qk, cfg.q_lora_rank))]
    else:
        out.append(("q_proj.weight", (nh * qk, H)))
    return out + [("kv_a_proj_with_mqa.weight", (cfg.kv_lora_rank + cfg.qk_rope_dim, H)),
                  ("kv_a_layernorm.weight", (cfg.kv_lora_rank,)),
                  ("kv_b_proj.weight", (nh * (cfg.qk_nope_dim + cfg.v_head_dim),
                                        cfg.kv_lora_rank)),
                  ("o_proj.weight", (H, nh * cfg.v_head_dim))]


def _mlp(prefix: str, hidden: int, inter: int, dtype: str) -> list[TensorSpec]:
    return [TensorSpec(prefix + "gate_proj.weight", (inter, hidden), dtype),
            TensorSpec(prefix + "up_proj.weight", (inter, hidden), dtype),
            TensorSpec(prefix + "down_proj.weight", (hidden, inter), dtype)]
