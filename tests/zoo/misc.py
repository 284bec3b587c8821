"""Loaders that stress the probe's assumptions rather than follow one engine.

Kernel layouts (transposed copies, interleaved gate/up rows, rotary row permutations), block-cyclic
and cyclic row distributions, a loader that replaces parameter tensors instead of copying into
them, non-contiguous parameters (views into shared storage, transposed and strided views, a 0-d
view), and a loader that reads names in its own order, reads a tensor twice, ignores names and
repeats kv heads for an MHA-only kernel.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from weightbridge import TensorSpec

from .common import Expect, Worker, make_worker, torch_dtype
from .models import ModelConfig, hf_spec


def _hf(cfg: ModelConfig, i: int, short: str) -> str:
    """HF name of a layer tensor from a short name: q k v o gate up down ln1 ln2."""
    p = f"model.layers.{i}"
    if short in "qkvo":
        return f"{p}.self_attn.{short}_proj.weight"
    if short in ("gate", "up", "down"):
        return f"{p}.mlp.{short}_proj.weight"
    return f"{p}.{'input' if short == 'ln1' else 'post_attention'}_layernorm.weight"


def _empty_like_spec(spec, name: str) -> torch.Tensor:
    t = spec[name]
    return torch.empty(t.shape, dtype=torch_dtype(t.dtype))


# --------------------------------------------------------------------------------------------
# Kernel layouts
# --------------------------------------------------------------------------------------------


def _rope_halves(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Per head, interleaved rotary pairs -> half-split rows: [0 2 4 .. | 1 3 5 ..]."""
    rows, cols = w.shape
    return w.view(num_heads, rows // num_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def kernel_layouts(scale: int = 1) -> Worker:
    """One worker of an engine with its own kernels: a K-major (transposed) fused qkv whose q and
    k rows are first permuted per head from interleaved rotary pairs to half-split order (strided
    selections inside a transposed copy), K-major o_proj and down_proj, and gate/up rows
    interleaved one by one ([g0 u0 g1 u1 ..]) for a fused SiLU-and-mul kernel."""
    cfg = ModelConfig().scaled(scale)
    spec = hf_spec(cfg)
    h = cfg.hidden_size
    dt = torch_dtype(cfg.dtype)
    params = {"embed": _empty_like_spec(spec, "model.embed_tokens.weight"),
              "head": _empty_like_spec(spec, "lm_head.weight"),
              "final_norm": _empty_like_spec(spec, "model.norm.weight")}
    for i in range(cfg.num_layers):
        params[f"blk.{i}.wqkv_t"] = torch.empty(h, cfg.q_size + 2 * cfg.kv_size, dtype=dt)
        params[f"blk.{i}.wo_t"] = torch.empty(cfg.q_size, h, dtype=dt)
        params[f"blk.{i}.w13_interleaved"] = torch.empty(2 * cfg.intermediate_size, h, dtype=dt)
        params[f"blk.{i}.w2_t"] = torch.empty(cfg.intermediate_size, h, dtype=dt)
        params[f"blk.{i}.ln1"] = _empty_like_spec(spec, _hf(cfg, i, "ln1"))
        params[f"blk.{i}.ln2"] = _empty_like_spec(spec, _hf(cfg, i, "ln2"))

    @torch.no_grad()
    def load_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        sd = dict(weights)
        params["embed"].copy_(sd["model.embed_tokens.weight"])
        params["head"].copy_(sd["lm_head.weight"])
        params["final_norm"].copy_(sd["model.norm.weight"])
        for i in range(cfg.num_layers):
            w = {s: sd[_hf(cfg, i, s)]
                 for s in ("q", "k", "v", "o", "gate", "up", "down", "ln1", "ln2")}
            qkv = torch.cat([_rope_halves(w["q"], cfg.num_heads),
                             _rope_halves(w["k"], cfg.num_kv_heads), w["v"]])
            params[f"blk.{i}.wqkv_t"].copy_(qkv.t())
            params[f"blk.{i}.wo_t"].copy_(w["o"].t())
            gate_up = torch.stack([w["gate"], w["up"]], dim=1).flatten(0, 1)  # g0 u0 g1 u1 ..
            params[f"blk.{i}.w13_interleaved"].copy_(gate_up)
            params[f"blk.{i}.w2_t"].copy_(w["down"].t())
            params[f"blk.{i}.ln1"].copy_(w["ln1"])
            params[f"blk.{i}.ln2"].copy_(w["ln2"])

    # per layer: two strided halves per q head and per k head, v 1, o 1, gate/up 2, down 1, norms 2
    per_layer = 2 * cfg.num_heads + 2 * cfg.num_kv_heads + 1 + 1 + 2 + 1 + 2
    expect = Expect(max_pieces=3 + cfg.num_layers * per_layer)
    return make_worker(params, load_weights, spec, expect)


def block_cyclic_rows(scale: int = 1, rank: int = 1, world_size: int = 2,
                      blocks_per_rank: int = 2) -> Worker:
    """A block-cyclic tensor-parallel engine: column-parallel weights hold row blocks rank,
    rank + P, rank + 2P, .. (a fixed number of blocks, so the map does not grow with the rows);
    row-parallel weights hold every P-th column; embedding and head every P-th vocab row."""
    cfg = ModelConfig().scaled(scale)
    spec = hf_spec(cfg)
    num_blocks = world_size * blocks_per_rank

    def blocks(w: torch.Tensor) -> torch.Tensor:
        size = w.shape[0] // num_blocks
        return w.view(num_blocks, size, -1)[rank::world_size].flatten(0, 1)

    def cyclic_rows(w: torch.Tensor) -> torch.Tensor:
        return w[rank::world_size]

    def cyclic_cols(w: torch.Tensor) -> torch.Tensor:
        return w[:, rank::world_size]

    def replicated(w: torch.Tensor) -> torch.Tensor:
        return w

    layout = {"model.embed_tokens.weight": cyclic_rows, "lm_head.weight": cyclic_rows,
              "model.norm.weight": replicated}
    for i in range(cfg.num_layers):
        layout.update({_hf(cfg, i, s): blocks for s in ("q", "k", "v", "gate", "up")})
        layout.update({_hf(cfg, i, s): cyclic_cols for s in ("o", "down")})
        layout.update({_hf(cfg, i, s): replicated for s in ("ln1", "ln2")})
    params = {name: torch.empty(fn(_empty_like_spec(spec, name)).shape,
                                dtype=torch_dtype(spec[name].dtype)) for name, fn in layout.items()}

    @torch.no_grad()
    def load_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            params[name].copy_(layout[name](w))

    per_layer = 5 * blocks_per_rank + 2 + 2
    expect = Expect(max_pieces=3 + cfg.num_layers * per_layer)
    return make_worker(params, load_weights, spec, expect)


# --------------------------------------------------------------------------------------------
# Replacing loaders and non-contiguous params
# --------------------------------------------------------------------------------------------


def _module_tree(tensors: dict[str, torch.Tensor]) -> nn.Module:
    """An nn.Module whose named_parameters() are ``tensors`` under their dotted names."""
    root = nn.Module()
    for name, t in tensors.items():
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if part not in mod._modules:
                mod.add_module(part, nn.Module())
            mod = mod._modules[part]
        mod.register_parameter(leaf, nn.Parameter(t, requires_grad=False))
    return root


def hf_assign_replace(scale: int = 1) -> Worker:
    """HF ``load_state_dict(assign=True)`` style: every param is *replaced* by the checkpoint
    tensor itself (no copy), o_proj by a column-major copy for a kernel (a non-contiguous
    replacement), then the head is re-tied to the embedding. Params are a callable."""
    cfg = ModelConfig(tie_word_embeddings=True, lm_head_in_checkpoint=False,
                      dtypes=(("norm", "float32"),)).scaled(scale)
    spec = hf_spec(cfg)
    model = _module_tree({t.name: _empty_like_spec(spec, t.name) for t in spec.tensors})
    model.add_module("lm_head", nn.Module())
    model.lm_head.weight = model.model.embed_tokens.weight  # tied

    def params() -> dict[str, torch.Tensor]:
        return dict(model.named_parameters())  # the tied head is listed once, as the embedding

    def load_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in weights:
            module_name, _, leaf = name.rpartition(".")
            if name.endswith("o_proj.weight"):
                tensor = tensor.t().contiguous().t()
            module = model.get_submodule(module_name)
            module._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
        model.lm_head.weight = model.model.embed_tokens.weight  # tie_weights()

    expect = Expect(max_pieces=len(spec.tensors))
    return make_worker(params, load_weights, spec, expect)


def noncontiguous_views(scale: int = 1) -> Worker:
    """Params that are views: q/k/v slices of one fused buffer (nonzero storage offsets),
    o_proj a transposed view, gate/up transposed column halves of one buffer, down_proj a
    column window of a wider buffer, norms every other element of a buffer, and a 0-d param
    viewing one element of a scalar buffer. The loader copies through the views."""
    cfg = ModelConfig(dtypes=(("norm", "float16"),)).scaled(scale)
    logit_scale = TensorSpec("model.logit_scale", (), "float32")
    spec = hf_spec(cfg, extra=(logit_scale,))
    h, im, dt = cfg.hidden_size, cfg.intermediate_size, torch_dtype(cfg.dtype)
    norm_dt = torch_dtype(cfg.dtype_of("norm"))
    params = {"model.embed_tokens.weight": _empty_like_spec(spec, "model.embed_tokens.weight"),
              "lm_head.weight": _empty_like_spec(spec, "lm_head.weight"),
              "model.norm.weight": torch.empty(2 * h, dtype=norm_dt)[1::2],
              "model.logit_scale": torch.empty(3, dtype=torch.float32)[1]}
    for i in range(cfg.num_layers):
        qkv = torch.empty(cfg.q_size + 2 * cfg.kv_size, h, dtype=dt)
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size])
        gate_up_t = torch.empty(h, 2 * im, dtype=dt)
        norms = torch.empty(2, 2 * h, dtype=norm_dt)
        params.update({
            _hf(cfg, i, "q"): q, _hf(cfg, i, "k"): k, _hf(cfg, i, "v"): v,
            _hf(cfg, i, "o"): torch.empty(cfg.q_size, h, dtype=dt).t(),
            _hf(cfg, i, "gate"): gate_up_t[:, :im].t(),
            _hf(cfg, i, "up"): gate_up_t[:, im:].t(),
            _hf(cfg, i, "down"): torch.empty(h, im + 3, dtype=dt)[:, 1:im + 1],
            _hf(cfg, i, "ln1"): norms[0, ::2], _hf(cfg, i, "ln2"): norms[1, 1::2],
        })

    @torch.no_grad()
    def load_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            params[name].copy_(w)

    return make_worker(params, load_weights, spec, Expect(max_pieces=len(spec.tensors)))


# --------------------------------------------------------------------------------------------
# Reading order, repeated reads, ignored names, kv repeated for an MHA kernel
# --------------------------------------------------------------------------------------------


def unordered_tied_kv_repeat(scale: int = 1) -> Worker:
    """A loader that buffers the whole checkpoint, then works through it in its own (reverse
    sorted) order; reads the embedding twice to fill an untied copy for the head (tied model
    whose checkpoint also ships a stale lm_head, ignored); ignores rotary inv_freq buffers; and
    repeats every kv head for each query head of its group (an MHA-only kernel), so one
    checkpoint element lands in several places of one param."""
    cfg = ModelConfig(tie_word_embeddings=True, lm_head_in_checkpoint=True).scaled(scale)
    inv_freq = tuple(TensorSpec(f"model.layers.{i}.self_attn.rotary_emb.inv_freq",
                                (cfg.head_dim // 2,), "float32") for i in range(cfg.num_layers))
    spec = hf_spec(cfg, extra=inv_freq)
    h, hd, dt = cfg.hidden_size, cfg.head_dim, torch_dtype(cfg.dtype)
    group = cfg.num_heads // cfg.num_kv_heads
    params = {"tok_embeddings": _empty_like_spec(spec, "model.embed_tokens.weight"),
              "output": _empty_like_spec(spec, "model.embed_tokens.weight"),
              "norm": _empty_like_spec(spec, "model.norm.weight")}
    sources = {"tok_embeddings": "model.embed_tokens.weight", "output": "model.embed_tokens.weight",
               "norm": "model.norm.weight"}
    for i in range(cfg.num_layers):
        params.update({f"layers.{i}.wq": torch.empty(cfg.q_size, h, dtype=dt),
                       f"layers.{i}.wk": torch.empty(cfg.q_size, h, dtype=dt),
                       f"layers.{i}.wv": torch.empty(cfg.q_size, h, dtype=dt),
                       f"layers.{i}.wo": _empty_like_spec(spec, _hf(cfg, i, "o")),
                       f"layers.{i}.w_gate_up": torch.empty(2 * cfg.intermediate_size, h, dtype=dt),
                       f"layers.{i}.w_down": _empty_like_spec(spec, _hf(cfg, i, "down")),
                       f"layers.{i}.ln1": _empty_like_spec(spec, _hf(cfg, i, "ln1")),
                       f"layers.{i}.ln2": _empty_like_spec(spec, _hf(cfg, i, "ln2"))})
        sources.update({f"layers.{i}.{p}": _hf(cfg, i, s) for p, s in (
            ("wq", "q"), ("wk", "k"), ("wv", "v"), ("wo", "o"), ("w_down", "down"),
            ("ln1", "ln1"), ("ln2", "ln2"))})

    def repeat_kv(w: torch.Tensor) -> torch.Tensor:
        return w.view(cfg.num_kv_heads, hd, h).repeat_interleave(group, dim=0).reshape(-1, h)

    @torch.no_grad()
    def load_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        sd = dict(weights)
        by_source: dict[str, list[str]] = {}
        for param, src in sources.items():
            by_source.setdefault(src, []).append(param)
        for name in sorted(sd, reverse=True):
            if "rotary_emb.inv_freq" in name or name == "lm_head.weight":
                continue
            if name.endswith("mlp.up_proj.weight"):
                continue  # consumed with gate_proj below
            if name.endswith("mlp.gate_proj.weight"):
                layer = name.split(".")[2]
                up = sd[name.replace("gate_proj", "up_proj")]
                params[f"layers.{layer}.w_gate_up"].copy_(torch.cat([sd[name], up]))
                continue
            for param in by_source[name]:  # the embedding is read once per destination
                fix = repeat_kv if name.endswith(("k_proj.weight", "v_proj.weight")) else None
                params[param].copy_(fix(sd[name]) if fix else sd[name])

    unused = frozenset({"lm_head.weight"} | {t.name for t in inv_freq})
    # per layer: q 1, k and v one box per query head, o 1, gate/up 2, down 1, norms 2
    per_layer = 1 + 2 * cfg.num_heads + 1 + 2 + 1 + 2
    return make_worker(params, load_weights, spec,
                       Expect(max_pieces=3 + cfg.num_layers * per_layer, unused=unused))


CASES = {
    "kernel_layouts": kernel_layouts,
    "block_cyclic_rows": block_cyclic_rows,
    "hf_assign_replace": hf_assign_replace,
    "noncontiguous_views": noncontiguous_views,
    "unordered_tied_kv_repeat": unordered_tied_kv_repeat,
}
