"""`trainer_shard`: a trainer worker's shard of the demo model, from its side's mesh spec
(`weightbridge.specs.TrainerSpec`).

    TrainerSpec.parse("nodes=2,gpus=2,tp=2,ep=2")         # 4 workers: TP2 x EP2 (x DP1)
    trainer_shard(TrainerSpec.parse("gpus=4,tp=2,ep=2"), SIZES["tiny"], worker=3)
"""

from __future__ import annotations

import torch

from meshes.qwen3_moe import FsdpTrainerShard, MoEConfig, TrainerShard
from weightbridge.specs import TrainerSpec

__all__ = ["trainer_shard"]


def trainer_shard(spec: TrainerSpec, model: MoEConfig, worker: int, *,
                  dtype: torch.dtype | None = None,
                  device: torch.device | str = "cpu") -> TrainerShard | FsdpTrainerShard:
    """Worker ``worker``'s shard of ``spec``: FSDP rank ``worker``, or its TP/EP/PP ranks'
    Megatron-like shard (DP replicas build the same shard), with parameters of ``dtype``
    (default bfloat16) on ``device``."""
    dtype = torch.bfloat16 if dtype is None else dtype
    if spec.fsdp:
        return FsdpTrainerShard(model, spec.num_workers, worker, dtype=dtype, device=device)
    c = spec.coords(worker)
    return TrainerShard(model, spec.tp, c["tp"], spec.ep, c["ep"], pp=spec.pp, pp_rank=c["pp"],
                        dtype=dtype, device=device)
