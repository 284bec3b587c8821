"""The tiny models both real-engine workers build, and the HF checkpoints they exchange.

One source of truth for the vLLM rollout workers (`vllm_rollout`) and the torchtitan trainer
workers: per model name, the HF ``config.json`` dict, the HF checkpoint's tensor names, shapes
and dtypes (`checkpoint_spec`), and deterministic pseudo-random checkpoints per version
(`checkpoint`). Nothing is downloaded: configs are written from code.

Sizes are chosen to exercise the engines' layout transformations on 2 CPU cores: a vocabulary of
120 that vLLM pads to 128, 2 kv heads (replicated once TP exceeds 2), 4 routed experts (EP splits
them in blocks), DeepSeek-V3's MLA with a q LoRA rank (fused ``q_a_proj`` +
``kv_a_proj_with_mqa``), one shared expert and one dense first layer. The Qwen3 models have
head_dim 32, the smallest vLLM's CPU attention runs, so their engines generate
(`vllm_engine`); ``qwen3`` is the dense model the GRPO example trains (`examples/grpo`).

Typical usage::

    from examples.engines import models
    spec = models.checkpoint_spec("qwen3_moe")
    state = models.checkpoint("qwen3_moe", version=3)   # name -> tensor, spec order
    models.write_config("qwen3_moe", tmpdir)            # config.json for an engine
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch

from weightbridge import CheckpointSpec, TensorSpec

MODELS = ("qwen3_moe", "deepseek_v3")
"""The layout models every worker builds (torchtitan, DCP, `vllm_rollout.VllmWorker`)."""
GENERATING = ("qwen3", "qwen3_moe")
"""The models a generating `vllm_engine.VllmEngine` runs (vLLM's CPU attention takes their
head_dim); ``qwen3`` is also the GRPO example's policy (HF transformers)."""

_COMMON = {
    "vocab_size": 120,  # not a multiple of 64: vLLM pads the embedding and lm_head rows
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "hidden_act": "silu",
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 0,
    "eos_token_id": 1,
}

_QWEN3_ATTENTION = {
    "num_key_value_heads": 2,
    "head_dim": 32,  # vLLM's CPU attention refuses head_dim 16 (generation needs >= 32)
    "attention_bias": False,
    "rope_theta": 1_000_000.0,
}

_CONFIGS: dict[str, dict] = {
    "qwen3": {
        **_COMMON,
        **_QWEN3_ATTENTION,
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "intermediate_size": 128,
    },
    "qwen3_moe": {
        **_COMMON,
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        **_QWEN3_ATTENTION,
        "intermediate_size": 128,  # dense MLP size; unused while every layer is MoE
        "moe_intermediate_size": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
    },
    "deepseek_v3": {
        **_COMMON,
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "num_key_value_heads": 4,
        "q_lora_rank": 32,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "intermediate_size": 128,  # the dense first layer
        "moe_intermediate_size": 32,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "attention_bias": False,
        "rope_theta": 10_000.0,
        "rope_scaling": None,
    },
}


def hf_config(model: str) -> dict:
    """The HF ``config.json`` contents of a tiny model (a fresh copy)."""
    return json.loads(json.dumps(_config(model)))


def write_config(model: str, directory: str | Path) -> Path:
    """Write ``config.json`` into ``directory`` (created if missing); returns the directory."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(_config(model), indent=1))
    return out


def checkpoint_spec(model: str) -> CheckpointSpec:
    """Names, shapes and dtypes of the model's HF checkpoint, in a fixed order.

    Weights are bfloat16; DeepSeek-V3's ``e_score_correction_bias`` keeps its real float32.
    Experts are stored one tensor per expert and projection, as HF checkpoints are on disk.
    """
    cfg = _config(model)
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    out = [("model.embed_tokens.weight", (v, h))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
        out += [(p + "self_attn." + n, s) for n, s in _attention(cfg)]
        out += [(p + "mlp." + n, s) for n, s in _mlp(cfg, i)]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]
    return CheckpointSpec(tuple(
        TensorSpec(n, tuple(s), "float32" if n.endswith("e_score_correction_bias") else "bfloat16")
        for n, s in out))


def checkpoint(model: str, version: int) -> dict[str, torch.Tensor]:
    """A deterministic pseudo-random checkpoint of ``model`` for ``version``.

    Each tensor has its own generator seeded by (name, version), so any rank or process builds
    the same values, and any tensor can be rebuilt alone.
    """
    out = {}
    for t in checkpoint_spec(model).tensors:
        seed = zlib.crc32(f"{model}/{t.name}/{version}".encode())
        gen = torch.Generator().manual_seed(seed)
        values = torch.randn(t.shape, generator=gen, dtype=torch.float32) * 0.05
        if t.name.endswith("norm.weight"):
            values += 1.0
        out[t.name] = values.to(getattr(torch, t.dtype))
    return out


def write_checkpoint_dir(model: str, state: dict[str, torch.Tensor],
                         directory: str | Path) -> Path:
    """``config.json`` and ``model.safetensors`` of ``state``: what a vLLM engine loads from
    disk (`vllm_engine.VllmEngine`). Returns the directory."""
    write_config(model, directory)
    write_safetensors(state, directory)
    return Path(directory)


def write_safetensors(state: dict[str, torch.Tensor], directory: str | Path,
                      filename: str = "model.safetensors") -> Path:
    """Save ``state`` as one safetensors file in ``directory``; returns the file's path."""
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    path = out / filename
    save_file({n: t.contiguous() for n, t in state.items()}, str(path))
    return path


# --------------------------------------------------------------------------------------------


def _config(model: str) -> dict:
    if model not in _CONFIGS:
        raise ValueError(f"unknown model {model!r}; choose one of {', '.join(_CONFIGS)}")
    return _CONFIGS[model]


def _attention(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    h, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    if cfg["model_type"] in ("qwen3", "qwen3_moe"):
        hd, nkv = cfg["head_dim"], cfg["num_key_value_heads"]
        return [("q_proj.weight", (nh * hd, h)), ("k_proj.weight", (nkv * hd, h)),
                ("v_proj.weight", (nkv * hd, h)), ("o_proj.weight", (h, nh * hd)),
                ("q_norm.weight", (hd,)), ("k_norm.weight", (hd,))]
    q, kv = cfg["q_lora_rank"], cfg["kv_lora_rank"]
    nope, rope, vd = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    return [("q_a_proj.weight", (q, h)), ("q_a_layernorm.weight", (q,)),
            ("q_b_proj.weight", (nh * (nope + rope), q)),
            ("kv_a_proj_with_mqa.weight", (kv + rope, h)), ("kv_a_layernorm.weight", (kv,)),
            ("kv_b_proj.weight", (nh * (nope + vd), kv)), ("o_proj.weight", (h, nh * vd))]


def _mlp(cfg: dict, layer: int) -> list[tuple[str, tuple[int, ...]]]:
    h = cfg["hidden_size"]
    if cfg["model_type"] == "qwen3":
        return _ffn("", h, cfg["intermediate_size"])
    if cfg["model_type"] == "qwen3_moe":
        experts, shared, dense = cfg["num_experts"], 0, layer in cfg["mlp_only_layers"]
    else:
        experts, shared = cfg["n_routed_experts"], cfg["n_shared_experts"]
        dense = layer < cfg["first_k_dense_replace"]
    if dense:
        return _ffn("", h, cfg["intermediate_size"])
    i = cfg["moe_intermediate_size"]
    out = [("gate.weight", (experts, h))]
    if cfg["model_type"] == "deepseek_v3":
        out.append(("gate.e_score_correction_bias", (experts,)))
    for e in range(experts):
        out += _ffn(f"experts.{e}.", h, i)
    if shared:
        out += _ffn("shared_experts.", h, i * shared)
    return out


def _ffn(prefix: str, h: int, i: int) -> list[tuple[str, tuple[int, ...]]]:
    return [(prefix + "gate_proj.weight", (i, h)), (prefix + "up_proj.weight", (i, h)),
            (prefix + "down_proj.weight", (h, i))]
