"""Tiny model configs and their Hugging Face checkpoint layouts (names, shapes, dtypes).

Two families: a Llama / Qwen3-MoE decoder (``ModelConfig``) and a DeepSeek-V3-like decoder with
multi-head latent attention (``MlaConfig``). Only specs are built here; the zoo's loaders build
the runtime parameters their engine style would.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from weightbridge import CheckpointSpec, TensorSpec


@dataclass(frozen=True)
class ModelConfig:
    """A Llama (dense) or Qwen3-MoE (``num_experts > 0``) decoder."""

    vocab_size: int = 100
    hidden_size: int = 16
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 4
    intermediate_size: int = 24
    num_experts: int = 0
    moe_intermediate_size: int = 8
    qk_norm: bool = False
    attention_bias: bool = False
    attention_sinks: bool = False
    tie_word_embeddings: bool = False
    lm_head_in_checkpoint: bool = True
    """False for tied checkpoints that omit ``lm_head.weight``."""
    fp8_scales: bool = False
    """Per-tensor float8 checkpoints ship a 0-d float32 ``weight_scale`` next to each fp8 weight."""
    dtype: str = "bfloat16"
    dtypes: tuple[tuple[str, str], ...] = ()
    """Per-role dtype overrides, roles: embed, lm_head, norm, attn, mlp, expert, router, sinks."""

    def scaled(self, scale: int) -> "ModelConfig":
        return replace(self, hidden_size=self.hidden_size * scale, head_dim=self.head_dim * scale,
                       intermediate_size=self.intermediate_size * scale,
                       moe_intermediate_size=self.moe_intermediate_size * scale)

    def dtype_of(self, role: str) -> str:
        return dict(self.dtypes).get(role, self.dtype)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def hf_tensors(cfg: ModelConfig) -> list[TensorSpec]:
    """The HF checkpoint of ``cfg``, in the order HF writes it."""
    h, d = cfg.hidden_size, cfg.dtype_of
    out = [TensorSpec("model.embed_tokens.weight", (cfg.vocab_size, h), d("embed"))]

    def linear(name: str, shape: tuple[int, int], role: str) -> None:
        out.append(TensorSpec(name + ".weight", shape, d(role)))
        if cfg.fp8_scales and d(role) == "float8_e4m3fn":
            out.append(TensorSpec(name + ".weight_scale", (), "float32"))

    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        out.append(TensorSpec(f"{p}.input_layernorm.weight", (h,), d("norm")))
        for proj, rows in (("q", cfg.q_size), ("k", cfg.kv_size), ("v", cfg.kv_size)):
            linear(f"{p}.self_attn.{proj}_proj", (rows, h), "attn")
            if cfg.attention_bias:
                out.append(TensorSpec(f"{p}.self_attn.{proj}_proj.bias", (rows,), d("attn")))
        linear(f"{p}.self_attn.o_proj", (h, cfg.q_size), "attn")
        if cfg.qk_norm:
            out.append(TensorSpec(f"{p}.self_attn.q_norm.weight", (cfg.head_dim,), d("norm")))
            out.append(TensorSpec(f"{p}.self_attn.k_norm.weight", (cfg.head_dim,), d("norm")))
        if cfg.attention_sinks:
            out.append(TensorSpec(f"{p}.self_attn.sinks", (cfg.num_heads,), d("sinks")))
        out.append(TensorSpec(f"{p}.post_attention_layernorm.weight", (h,), d("norm")))
        if cfg.num_experts:
            out.append(TensorSpec(f"{p}.mlp.gate.weight", (cfg.num_experts, h), d("router")))
            im = cfg.moe_intermediate_size
            for e in range(cfg.num_experts):
                linear(f"{p}.mlp.experts.{e}.gate_proj", (im, h), "expert")
                linear(f"{p}.mlp.experts.{e}.up_proj", (im, h), "expert")
                linear(f"{p}.mlp.experts.{e}.down_proj", (h, im), "expert")
        else:
            im = cfg.intermediate_size
            linear(f"{p}.mlp.gate_proj", (im, h), "mlp")
            linear(f"{p}.mlp.up_proj", (im, h), "mlp")
            linear(f"{p}.mlp.down_proj", (h, im), "mlp")
    out.append(TensorSpec("model.norm.weight", (h,), d("norm")))
    if cfg.lm_head_in_checkpoint:
        out.append(TensorSpec("lm_head.weight", (cfg.vocab_size, h), d("lm_head")))
    return out


def hf_spec(cfg: ModelConfig, extra: tuple[TensorSpec, ...] = ()) -> CheckpointSpec:
    """`hf_tensors` plus ``extra`` tensors some checkpoints carry (inv_freq buffers, MTP layers)."""
    return CheckpointSpec(tuple(hf_tensors(cfg)) + tuple(extra))


@dataclass(frozen=True)
class MlaConfig:
    """A DeepSeek-V3-like decoder: MLA attention, dense first layer, MoE with a shared expert."""

    vocab_size: int = 96
    hidden_size: int = 16
    num_layers: int = 2
    first_k_dense: int = 1
    num_heads: int = 4
    q_lora_rank: int = 12
    kv_lora_rank: int = 8
    qk_nope_head_dim: int = 4
    qk_rope_head_dim: int = 4
    v_head_dim: int = 4
    intermediate_size: int = 24
    num_experts: int = 4
    moe_intermediate_size: int = 8
    num_nextn_predict_layers: int = 1
    """MTP layers stored after the decoder layers; the main model's loader skips them."""
    dtype: str = "bfloat16"

    def scaled(self, scale: int) -> "MlaConfig":
        return replace(self, hidden_size=self.hidden_size * scale,
                       q_lora_rank=self.q_lora_rank * scale, kv_lora_rank=self.kv_lora_rank * scale,
                       qk_nope_head_dim=self.qk_nope_head_dim * scale,
                       qk_rope_head_dim=self.qk_rope_head_dim * scale,
                       v_head_dim=self.v_head_dim * scale,
                       intermediate_size=self.intermediate_size * scale,
                       moe_intermediate_size=self.moe_intermediate_size * scale)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def mla_spec(cfg: MlaConfig) -> CheckpointSpec:
    h, dt = cfg.hidden_size, cfg.dtype
    out = [TensorSpec("model.embed_tokens.weight", (cfg.vocab_size, h), dt)]
    for i in range(cfg.num_layers + cfg.num_nextn_predict_layers):
        p = f"model.layers.{i}"
        if i >= cfg.num_layers:  # MTP layer: a few of its tensors are enough to be skipped
            out += [TensorSpec(f"{p}.enorm.weight", (h,), dt),
                    TensorSpec(f"{p}.hnorm.weight", (h,), dt),
                    TensorSpec(f"{p}.eh_proj.weight", (h, 2 * h), dt)]
            continue
        a = f"{p}.self_attn"
        out += [
            TensorSpec(f"{p}.input_layernorm.weight", (h,), dt),
            TensorSpec(f"{a}.q_a_proj.weight", (cfg.q_lora_rank, h), dt),
            TensorSpec(f"{a}.q_a_layernorm.weight", (cfg.q_lora_rank,), dt),
            TensorSpec(f"{a}.q_b_proj.weight",
                       (cfg.num_heads * cfg.qk_head_dim, cfg.q_lora_rank), dt),
            TensorSpec(f"{a}.kv_a_proj_with_mqa.weight",
                       (cfg.kv_lora_rank + cfg.qk_rope_head_dim, h), dt),
            TensorSpec(f"{a}.kv_a_layernorm.weight", (cfg.kv_lora_rank,), dt),
            TensorSpec(f"{a}.kv_b_proj.weight",
                       (cfg.num_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim),
                        cfg.kv_lora_rank), dt),
            TensorSpec(f"{a}.o_proj.weight", (h, cfg.num_heads * cfg.v_head_dim), dt),
            TensorSpec(f"{p}.post_attention_layernorm.weight", (h,), dt),
        ]
        if i < cfg.first_k_dense:
            im, mlps = cfg.intermediate_size, [f"{p}.mlp"]
        else:
            im = cfg.moe_intermediate_size
            mlps = [f"{p}.mlp.shared_experts"]
            mlps += [f"{p}.mlp.experts.{e}" for e in range(cfg.num_experts)]
            out += [TensorSpec(f"{p}.mlp.gate.weight", (cfg.num_experts, h), dt),
                    TensorSpec(f"{p}.mlp.gate.e_score_correction_bias", (cfg.num_experts,),
                               "float32")]
        for m in mlps:
            out += [TensorSpec(f"{m}.gate_proj.weight", (im, h), dt),
                    TensorSpec(f"{m}.up_proj.weight", (im, h), dt),
                    TensorSpec(f"{m}.down_proj.weight", (h, im), dt)]
    out += [TensorSpec("model.norm.weight", (h,), dt),
            TensorSpec("lm_head.weight", (cfg.vocab_size, h), dt)]
    return CheckpointSpec(tuple(out))
