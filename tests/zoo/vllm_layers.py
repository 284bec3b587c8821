"""Parallel layers in the style of vLLM / SGLang, with their weight loaders.

Every layer owns its parameters and hangs a ``weight_loader`` on each, which narrow()s the
checkpoint tensor to this rank's shard and copies it into the right rows of a fused parameter
(qkv_proj, gate_up_proj, stacked experts). Written from scratch in that style; no engine code
is copied.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .common import round_up, torch_dtype

FP8 = "float8_e4m3fn"


@dataclass(frozen=True)
class Parallel:
    """This rank's place in the engine. Expert parallelism reuses the TP group, as vLLM does."""

    tp_size: int = 1
    tp_rank: int = 0
    enable_expert_parallel: bool = False


def make_param(*shape: int, dtype: str, loader=None) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, dtype=torch_dtype(dtype)), requires_grad=False)
    if loader is not None:
        p.weight_loader = loader
    return p


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    if param.shape != loaded_weight.shape:
        raise ValueError(f"param {tuple(param.shape)} != checkpoint {tuple(loaded_weight.shape)}")
    param.data.copy_(loaded_weight)


def narrow_dim0_loader(param: torch.Tensor, loaded_weight: torch.Tensor, tp_rank: int) -> None:
    size = param.shape[0]
    param.data.copy_(loaded_weight.narrow(0, tp_rank * size, size))


def _scale_slot_loader(param: torch.Tensor, loaded_weight: torch.Tensor, shard_id) -> None:
    """Per-tensor fp8 scales of a fused layer: one 0-d checkpoint scale per logical shard."""
    slot = {"q": 0, "k": 1, "v": 2}.get(shard_id, shard_id)
    param.data[slot].copy_(loaded_weight)


# --------------------------------------------------------------------------------------------
# Layers
# --------------------------------------------------------------------------------------------


class ReplicatedLinear(nn.Module):
    def __init__(self, input_size: int, output_size: int, *, dtype: str) -> None:
        super().__init__()
        self.weight = make_param(output_size, input_size, dtype=dtype, loader=default_weight_loader)


class MergedReplicatedLinear(nn.Module):
    """Several replicated projections stacked on the output dim (DeepSeek's fused_qkv_a_proj)."""

    def __init__(self, input_size: int, output_sizes: list[int], *, dtype: str) -> None:
        super().__init__()
        self.output_sizes = output_sizes
        self.weight = make_param(sum(output_sizes), input_size, dtype=dtype,
                                 loader=self.weight_loader)

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor,
                      shard_id: int) -> None:
        offset = sum(self.output_sizes[:shard_id])
        param.data.narrow(0, offset, self.output_sizes[shard_id]).copy_(loaded_weight)


class ColumnParallelLinear(nn.Module):
    def __init__(self, input_size: int, output_size: int, *, dtype: str, par: Parallel,
                 bias: bool = False) -> None:
        super().__init__()
        self.tp_rank = par.tp_rank
        out = output_size // par.tp_size
        self.weight = make_param(out, input_size, dtype=dtype, loader=self.weight_loader)
        if bias:
            self.bias = make_param(out, dtype=dtype, loader=self.weight_loader)

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
        shard_size = param.shape[0]  # output_dim = 0 for weights and biases alike
        param.data.copy_(loaded_weight.narrow(0, self.tp_rank * shard_size, shard_size))


class MergedColumnParallelLinear(nn.Module):
    """gate_up_proj: [gate shard; up shard] of this rank."""

    def __init__(self, input_size: int, output_sizes: list[int], *, dtype: str, par: Parallel,
                 fp8_scales: bool = False) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = par.tp_rank, par.tp_size
        self.output_sizes = output_sizes
        self.weight = make_param(sum(output_sizes) // par.tp_size, input_size, dtype=dtype,
                             loader=self.weight_loader)
        if fp8_scales and dtype == FP8:
            self.weight_scale = make_param(len(output_sizes), dtype="float32",
                                           loader=_scale_slot_loader)

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor,
                      shard_id: int) -> None:
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        shard = loaded_weight.narrow(0, self.tp_rank * size, size)
        param.data.narrow(0, offset, size).copy_(shard)


class QKVParallelLinear(nn.Module):
    """qkv_proj: this rank's q heads, then its k and v heads. With more TP ranks than kv heads,
    each kv head is replicated on ``tp_size // num_kv_heads`` consecutive ranks."""

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: int, *, dtype: str, par: Parallel, bias: bool = False,
                 fp8_scales: bool = False) -> None:
        super().__init__()
        self.tp_rank = par.tp_rank
        self.num_heads = total_num_heads // par.tp_size
        if par.tp_size >= total_num_kv_heads:
            self.num_kv_heads, self.num_kv_head_replicas = 1, par.tp_size // total_num_kv_heads
        else:
            self.num_kv_heads, self.num_kv_head_replicas = total_num_kv_heads // par.tp_size, 1
        self.head_size = head_size
        out = (self.num_heads + 2 * self.num_kv_heads) * head_size
        self.weight = make_param(out, hidden_size, dtype=dtype, loader=self.weight_loader)
        if bias:
            self.bias = make_param(out, dtype=dtype, loader=self.weight_loader)
        if fp8_scales and dtype == FP8:
            self.weight_scale = make_param(3, dtype="float32", loader=_scale_slot_loader)

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor,
                      shard_id: str) -> None:
        q, kv = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        offset, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]
        shard_rank = self.tp_rank if shard_id == "q" else self.tp_rank // self.num_kv_head_replicas
        shard = loaded_weight.narrow(0, shard_rank * size, size)
        param.data.narrow(0, offset, size).copy_(shard)


class RowParallelLinear(nn.Module):
    def __init__(self, input_size: int, output_size: int, *, dtype: str, par: Parallel,
                 fp8_scales: bool = False) -> None:
        super().__init__()
        self.tp_rank = par.tp_rank
        self.weight = make_param(output_size, input_size // par.tp_size, dtype=dtype,
                             loader=self.weight_loader)
        if fp8_scales and dtype == FP8:
            self.weight_scale = make_param(dtype="float32", loader=default_weight_loader)  # 0-d

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
        shard_size = param.shape[1]  # input_dim = 1
        param.data.copy_(loaded_weight.narrow(1, self.tp_rank * shard_size, shard_size))


class VocabParallelEmbedding(nn.Module):
    """Vocab rows padded to a multiple of ``padding_size``, then split evenly across TP ranks.

    vLLM zero-fills this rank's padding rows on every load; ``zero_fill=False`` leaves them as
    they are (SGLang-style heads that never read them).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, dtype: str, par: Parallel,
                 padding_size: int = 64, zero_fill: bool = True) -> None:
        super().__init__()
        per_rank = round_up(num_embeddings, padding_size) // par.tp_size
        self.vocab_start_index = min(par.tp_rank * per_rank, num_embeddings)
        self.vocab_end_index = min(par.tp_rank * per_rank + per_rank, num_embeddings)
        self.zero_fill = zero_fill
        self.weight = make_param(per_rank, embedding_dim, dtype=dtype, loader=self.weight_loader)

    @property
    def num_padding_rows(self) -> int:
        return self.weight.shape[0] - (self.vocab_end_index - self.vocab_start_index)

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
        shard = loaded_weight[self.vocab_start_index:self.vocab_end_index]
        param.data[:shard.shape[0]].copy_(shard)
        if self.zero_fill:
            param.data[shard.shape[0]:].fill_(0)


class ParallelLMHead(VocabParallelEmbedding):
    pass


class RMSNorm(nn.Module):
    def __init__(self, size: int, *, dtype: str) -> None:
        super().__init__()
        self.weight = make_param(size, dtype=dtype, loader=default_weight_loader)


class FusedMoE(nn.Module):
    """Experts stacked into ``w13_weight [E_local, 2 * I, H]`` and ``w2_weight [E_local, H, I]``.

    Without expert parallelism every rank holds all experts, TP-sharded on I. With it, the TP
    group becomes the EP group: a rank holds a contiguous block of whole experts, renumbered
    from 0, and skips the others.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, dtype: str,
                 par: Parallel, fp8_scales: bool = False) -> None:
        super().__init__()
        ep_size, ep_rank = (par.tp_size, par.tp_rank) if par.enable_expert_parallel else (1, 0)
        if par.enable_expert_parallel:
            self.tp_size, self.tp_rank = 1, 0
        else:
            self.tp_size, self.tp_rank = par.tp_size, par.tp_rank
        num_local = num_experts // ep_size
        self.expert_map = [-1] * num_experts
        for local in range(num_local):
            self.expert_map[ep_rank * num_local + local] = local
        i_shard = intermediate_size // self.tp_size
        self.w13_weight = make_param(num_local, 2 * i_shard, hidden_size, dtype=dtype,
                                 loader=self.weight_loader)
        self.w2_weight = make_param(num_local, hidden_size, i_shard, dtype=dtype,
                                loader=self.weight_loader)
        if fp8_scales and dtype == FP8:
            self.w13_weight_scale = make_param(num_local, 2, dtype="float32",
                                               loader=self.weight_loader)
            self.w2_weight_scale = make_param(num_local, dtype="float32", loader=self.weight_loader)

    @staticmethod
    def make_expert_params_mapping(num_experts: int) -> list[tuple[str, str, int, str]]:
        """(param prefix, checkpoint infix, expert id, shard id) for every expert tensor."""
        return [("experts.w2_" if shard == "w2" else "experts.w13_", f"experts.{e}.{proj}.", e,
                 shard)
                for e in range(num_experts)
                for shard, proj in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj"))]

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor, weight_name: str,
                      shard_id: str, expert_id: int) -> bool:
        local = self.expert_map[expert_id]
        if local < 0:
            return False  # another EP rank's expert
        expert = param.data[local]
        if weight_name.endswith("weight_scale"):  # per-tensor fp8 scale, 0-d in the checkpoint
            slot = expert if shard_id == "w2" else expert[0 if shard_id == "w1" else 1]
            slot.copy_(loaded_weight)
            return True
        if shard_id == "w2":
            size = expert.shape[1]
            expert.copy_(loaded_weight.narrow(1, self.tp_rank * size, size))
        else:
            size = expert.shape[0] // 2
            shard = loaded_weight.narrow(0, self.tp_rank * size, size)
            expert.narrow(0, 0 if shard_id == "w1" else size, size).copy_(shard)
        return True
