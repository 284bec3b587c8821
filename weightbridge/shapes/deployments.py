"""Deployments of the paper (Table 2 and the section 4.3 sweeps) as planner inputs.

Typical usage::

    trainers, rollouts = workers(TABLE_2[1])      # (SourceMap, Placement) pairs
    plan = plan_transfer(trainers, rollouts, round_bytes=TABLE_2[1].round_bytes)
"""

from __future__ import annotations

from dataclasses import dataclass

from weightbridge.simulation.simulate import Cluster
from weightbridge.shapes.layouts import megatron_maps, sglang_maps
from weightbridge.shapes.models import (KIMI_K2, MOONLIGHT_16B_A3B, QWEN3_30B_A3B, QWEN3_235B_A22B,
                                        ModelConfig)
from weightbridge.types import Placement, SourceMap

PAPER_CLUSTER = Cluster(gpus_per_node=8, inter_node_bandwidth=400e9, intra_node_bandwidth=450e9)
"""8 H100 per node, 32 x 100 Gb/s NICs per node, NVLink about 450 GB/s per GPU per direction."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Deployment:
    """A trainer layout and a rollout layout of one model.

    Example: Table 2 (b): ``Deployment(name="b", model=QWEN3_30B_A3B, trainer_nodes=2,
    trainer_tp=4, trainer_ep=8, engines=2, engine_tp=8, engine_ep=8)``
    """

    name: str
    """Label in tables and plots."""
    model: ModelConfig
    """Model shapes."""
    trainer_nodes: int
    """Trainer nodes (8 GPUs each)."""
    trainer_tp: int = 1
    """Megatron tensor parallel degree."""
    trainer_pp: int = 1
    """Megatron pipeline parallel degree."""
    trainer_cp: int = 1
    """Megatron context parallel degree (replicates parameters)."""
    trainer_ep: int = 1
    """Megatron expert parallel degree."""
    engines: int = 1
    """Rollout engines (replicas)."""
    engine_tp: int = 8
    """GPUs per engine (SGLang TP size)."""
    engine_ep: int = 1
    """SGLang expert parallel degree."""
    round_bytes: int = 512 << 20
    """Round buffer size used for this deployment."""
    gpus_per_node: int = 8
    """GPUs per node, on both sides."""


TABLE_2 = (
    Deployment(name="a", model=MOONLIGHT_16B_A3B, trainer_nodes=1, trainer_tp=2, trainer_ep=8,
               engines=1, engine_tp=8, engine_ep=8),
    Deployment(name="b", model=QWEN3_30B_A3B, trainer_nodes=2, trainer_tp=4, trainer_ep=8,
               engines=2, engine_tp=8, engine_ep=8),
    Deployment(name="c", model=QWEN3_235B_A22B, trainer_nodes=8, trainer_tp=4, trainer_pp=4,
               trainer_cp=2, trainer_ep=16, engines=2, engine_tp=32, engine_ep=32),
    Deployment(name="d", model=KIMI_K2, trainer_nodes=32, trainer_tp=8, trainer_pp=8,
               trainer_cp=4, trainer_ep=32, engines=8, engine_tp=32, engine_ep=32,
               round_bytes=1 << 30),
)


def workers(dep: Deployment) -> tuple[list[tuple[SourceMap, Placement]],
                                      list[tuple[SourceMap, Placement]]]:
    """(trainers, rollouts) for `plan_transfer`; replicas share map objects."""
    g = dep.gpus_per_node
    tmaps = megatron_maps(dep.model, num_gpus=dep.trainer_nodes * g, tp=dep.trainer_tp,
                          pp=dep.trainer_pp, cp=dep.trainer_cp, ep=dep.trainer_ep)
    trainers = [(m, Placement(f"t{rank // g}")) for rank, m in enumerate(tmaps)]
    engine = sglang_maps(dep.model, tp=dep.engine_tp, ep=dep.engine_ep)
    rollouts = [(m, Placement(f"r{(e * dep.engine_tp + k) // g}", engine=e))
                for e in range(dep.engines) for k, m in enumerate(engine)]
    return trainers, rollouts
