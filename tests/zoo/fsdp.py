"""Trainer-side loaders in the style of FSDP1 flat parameters and torchtitan's FSDP2 x TP.

FSDP1 (``use_orig_params=True``): every wrapped unit owns one 1-d FlatParameter holding all of
its params flattened in module order, each start aligned to 16 bytes, the whole padded to a
multiple of the world size and cut into equal shards. A rank's shard starts and ends wherever the
cut falls, usually inside a tensor, and the last rank's shard ends in padding.

FSDP2 x TP (torchtitan): every param is a DTensor on a (dp_shard, tp) mesh; TP shards it
(colwise on dim 0, rowwise on dim 1), FSDP shards the TP-local tensor on dim 0, both with
torch.chunk's uneven split. The HF adapter renames tensors and undoes HF's rotary permutation of
wq / wk (torchtitan's attention rotates interleaved pairs). Written from scratch in that style.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import partial
from typing import Iterable

import torch

from .common import Expect, Worker, chunk_range, make_worker, round_up, torch_dtype
from .models import ModelConfig, hf_spec


class FlatParamHandle:
    """Layout of one FSDP1 FlatParameter and this rank's shard of it."""

    def __init__(self, fqns: list[str], shapes: list[tuple[int, ...]], dtype: str,
                 world_size: int, rank: int) -> None:
        dt = torch_dtype(dtype)
        align = 16 // dt.itemsize
        self.fqns, self.shapes, self.offsets = fqns, shapes, []
        pos = 0
        for shape in shapes:
            pos = round_up(pos, align)  # alignment padding between params
            self.offsets.append(pos)
            pos += math.prod(shape)
        self.numel = pos
        self.shard_numel = round_up(pos, world_size) // world_size  # padding at the end
        self.shard_start = rank * self.shard_numel
        self.index = {fqn: i for i, fqn in enumerate(fqns)}
        self.flat_param = torch.nn.Parameter(torch.empty(self.shard_numel, dtype=dt),
                                             requires_grad=False)

    def overlap(self, fqn: str) -> tuple[int, int] | None:
        """[start, stop) of tensor ``fqn``'s flat elements that fall in this rank's shard."""
        i = self.index[fqn]
        lo, hi = self.offsets[i], self.offsets[i] + math.prod(self.shapes[i])
        a, b = max(lo, self.shard_start), min(hi, self.shard_start + self.shard_numel)
        return (a - lo, b - lo) if a < b else None

    def load_full_param(self, fqn: str, tensor: torch.Tensor) -> None:
        """Copy the part of a full (unsharded) tensor that this rank's shard holds."""
        got = self.overlap(fqn)
        if got is None:
            return
        a, b = got
        start = self.offsets[self.index[fqn]] + a - self.shard_start
        self.flat_param.data[start:start + b - a].copy_(tensor.reshape(-1)[a:b])


def _fsdp1_units(cfg: ModelConfig) -> list[tuple[str, list[str]]]:
    """(FlatParameter FQN, HF FQNs it flattens in module order) per wrapped unit."""
    units = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        units.append((f"_fsdp_wrapped_module.{p}._fsdp_wrapped_module._flat_param", [
            f"{p}.self_attn.{x}_proj.weight" for x in "qkvo"] + [
            f"{p}.mlp.{x}_proj.weight" for x in ("gate", "up", "down")] + [
            f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight"]))
    units.append(("_fsdp_wrapped_module._flat_param",
                  ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]))
    return units


def fsdp1_flat_params(scale: int = 1, rank: int = 2, world_size: int = 3) -> Worker:
    """Dense Llama under FSDP1 on 3 ranks: one 1-d flat param per decoder layer plus the root's;
    shards cross tensor boundaries, alignment padding sits between tensors, and the last rank's
    shard ends in padding."""
    cfg = ModelConfig().scaled(scale)
    spec = hf_spec(cfg)
    handles = [FlatParamHandle(fqns, [spec[f].shape for f in fqns], cfg.dtype, world_size, rank)
               for _, fqns in _fsdp1_units(cfg)]
    params = {name: h.flat_param for (name, _), h in zip(_fsdp1_units(cfg), handles)}

    def load_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in weights:
            for handle in handles:
                if name in handle.index:
                    handle.load_full_param(name, tensor)

    max_pieces, unsourced, used = 0, {}, set()
    for name, handle in zip(params, handles):
        num_sourced = 0
        for fqn, shape in zip(handle.fqns, handle.shapes):
            got = handle.overlap(fqn)
            if got is None:
                continue
            used.add(fqn)
            num_sourced += got[1] - got[0]
            # a partial 2-d tensor: the tail of a row, whole rows, the head of a row
            max_pieces += 1 if len(shape) < 2 or got == (0, math.prod(shape)) else 3
        if handle.shard_numel > num_sourced:
            unsourced[name] = handle.shard_numel - num_sourced
    expect = Expect(max_pieces=max_pieces, unsourced=unsourced,
                    unused=frozenset(t.name for t in spec.tensors if t.name not in used),
                    scale_invariant=False)  # where the shard cuts fall moves with the sizes
    return make_worker(params, load_weights, spec, expect)


# --------------------------------------------------------------------------------------------
# torchtitan: FSDP2 x TP on a (dp_shard, tp) mesh
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mesh2d:
    dp_size: int = 2
    dp_rank: int = 0
    tp_size: int = 2
    tp_rank: int = 0


# torchtitan param -> TP shard dim (None: replicated over tp); FSDP always shards dim 0.
_TP_PLAN = {
    "tok_embeddings.weight": 0, "output.weight": 0, "norm.weight": None,
    "attention.wq.weight": 0, "attention.wk.weight": 0, "attention.wv.weight": 0,
    "attention.wo.weight": 1, "feed_forward.w1.weight": 0, "feed_forward.w3.weight": 0,
    "feed_forward.w2.weight": 1, "attention_norm.weight": None, "ffn_norm.weight": None,
}

_FROM_HF = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.layers.{}.self_attn.q_proj.weight": "layers.{}.attention.wq.weight",
    "model.layers.{}.self_attn.k_proj.weight": "layers.{}.attention.wk.weight",
    "model.layers.{}.self_attn.v_proj.weight": "layers.{}.attention.wv.weight",
    "model.layers.{}.self_attn.o_proj.weight": "layers.{}.attention.wo.weight",
    "model.layers.{}.mlp.gate_proj.weight": "layers.{}.feed_forward.w1.weight",
    "model.layers.{}.mlp.up_proj.weight": "layers.{}.feed_forward.w3.weight",
    "model.layers.{}.mlp.down_proj.weight": "layers.{}.feed_forward.w2.weight",
    "model.layers.{}.input_layernorm.weight": "layers.{}.attention_norm.weight",
    "model.layers.{}.post_attention_layernorm.weight": "layers.{}.ffn_norm.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}


def _reverse_permute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """HF's half-split rotary rows -> interleaved pairs, per head."""
    dim1, dim2 = w.shape
    return w.view(num_heads, 2, dim1 // num_heads // 2, dim2).transpose(1, 2).reshape(dim1, dim2)


class Llama3StateDictAdapter:
    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg = cfg

    def from_hf(self, hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        state_dict = {}
        for key, value in hf_state_dict.items():
            layer = re.search(r"layers\.(\d+)\.", key)
            abstract = re.sub(r"layers\.\d+\.", "layers.{}.", key, count=1)
            if abstract not in _FROM_HF:
                continue
            new_key = _FROM_HF[abstract].format(layer[1] if layer else None)
            if abstract.endswith("q_proj.weight"):
                value = _reverse_permute(value, self.cfg.num_heads)
            elif abstract.endswith("k_proj.weight"):
                value = _reverse_permute(value, self.cfg.num_kv_heads)
            state_dict[new_key] = value
        return state_dict


def _local_shard(full: torch.Tensor, tp_dim: int | None, mesh: Mesh2d) -> torch.Tensor:
    """This rank's DTensor local tensor: TP chunk, then the FSDP chunk of it on dim 0."""
    x = full
    if tp_dim is not None:
        a, b = chunk_range(x.shape[tp_dim], mesh.tp_size, mesh.tp_rank)
        x = x.narrow(tp_dim, a, b - a)
    a, b = chunk_range(x.shape[0], mesh.dp_size, mesh.dp_rank)
    return x.narrow(0, a, b - a)


def torchtitan_fsdp2_tp(scale: int = 1, dp_rank: int = 1, tp_rank: int = 1) -> Worker:
    """Llama3 (MHA) on a 2 x 2 (dp_shard, tp) mesh: uneven chunking of a 100-row vocabulary,
    colwise / rowwise TP under FSDP dim-0 shards, wq / wk rows un-permuted to interleaved rotary
    pairs (param rows step 2) before sharding; the loader reads the whole HF dict first."""
    cfg = ModelConfig(num_kv_heads=4).scaled(scale)  # a whole kv head per local shard
    mesh = Mesh2d(dp_rank=dp_rank, tp_rank=tp_rank)
    spec = hf_spec(cfg)
    adapter = Llama3StateDictAdapter(cfg)
    shapes = {k: spec[hf].shape for hf, k in (
        (hf.format(i), k.format(i)) for hf, k in _FROM_HF.items() for i in range(cfg.num_layers))}
    params = {}
    for name, shape in shapes.items():
        tp_dim = _TP_PLAN[re.sub(r"layers\.\d+\.", "", name)]
        local = _local_shard(torch.empty(shape, device="meta"), tp_dim, mesh)
        params[name] = torch.nn.Parameter(torch.empty(local.shape, dtype=torch_dtype(cfg.dtype)),
                                          requires_grad=False)

    def load_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        state_dict = adapter.from_hf(dict(weights))
        for name, param in params.items():
            tp_dim = _TP_PLAN[re.sub(r"layers\.\d+\.", "", name)]
            param.data.copy_(_local_shard(state_dict[name], tp_dim, mesh))

    # per layer: wq and wk one head each in two row-interleaved halves, five plain shards, norms
    expect = Expect(max_pieces=3 + cfg.num_layers * (2 + 2 + 5 + 2))
    return make_worker(params, load_weights, spec, expect)


CASES = {
    "fsdp1_flat_params_last_rank": partial(fsdp1_flat_params, rank=2),
    "fsdp1_flat_params_mid_rank": partial(fsdp1_flat_params, rank=1),
    "torchtitan_fsdp2_tp": torchtitan_fsdp2_tp,
}
