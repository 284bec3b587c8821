"""Discovery, planning and execution together, in one process, on the Qwen3-MoE shards.

Every worker's map comes from probing its own load_weights; after `run_plan_locally` each
rollout parameter must equal, bit for bit, what its own loader makes of the trainers' weights.
"""

import pytest
import torch

from meshes.qwen3_moe import SIZES, RolloutShard, TrainerShard, checkpoint_spec
from weightbridge import (CpuCopyKernels, Placement, correspond, extract_source_map,
                          plan_transfer, run_plan_locally)

CONFIG = SIZES["tiny"]


def _checkpoint(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {t.name: torch.randn(t.shape, generator=gen).bfloat16()
            for t in checkpoint_spec(CONFIG).tensors}


@pytest.mark.parametrize("trainer_layout,rollout_layout", [
    ((2, 2), (2, 1, 2)),  # trainer TP2 x EP2 -> two TP2 engines
    ((1, 4), (1, 2, 1)),  # trainer EP4 -> one TP1 x EP2 engine
    ((4, 1), (2, 1, 1)),  # trainer TP4 -> two TP1 engines, whole model each
], ids=["tp2ep2-to-2xtp2", "ep4-to-ep2", "tp4-to-2xtp1"])
@pytest.mark.parametrize("kernels", [None, CpuCopyKernels()], ids=["reference", "cpu"])
@pytest.mark.slow
def test_rollouts_match_their_own_loader_after_a_local_transfer(trainer_layout, rollout_layout,
                                                                kernels):
    spec = checkpoint_spec(CONFIG)
    tp, ep = trainer_layout
    trainers = [TrainerShard(CONFIG, tp, r % tp, ep, r // tp) for r in range(tp * ep)]
    engines, rtp, rep = rollout_layout
    rollouts = [RolloutShard(CONFIG, rtp, r % rtp, rep, r // rtp)
                for _ in range(engines) for r in range(rtp * rep)]
    trainer_maps = [extract_source_map(w.params, w.load_weights, spec) for w in trainers]
    rollout_maps = [extract_source_map(w.params, w.load_weights, spec) for w in rollouts]
    corr = correspond(trainer_maps, rollout_maps)
    assert corr.num_rollouts == len(rollouts)

    per_engine = rtp * rep
    plan = plan_transfer(
        [(m, Placement("t0")) for m in trainer_maps],
        [(m, Placement(f"r{i // per_engine}", engine=i // per_engine))
         for i, m in enumerate(rollout_maps)],
        round_bytes=64 << 10)
    # The rollouts start from an older version (their engine loaded it; padding rows are
    # zero), the trainers hold the new one.
    stale, weights = _checkpoint(seed=3), _checkpoint(seed=7)
    for w in rollouts:
        w.load_weights(stale.items())
    for w in trainers:
        w.load_weights(weights.items())
    received = [{n: p.clone() for n, p in w.params.items()} for w in rollouts]
    run_plan_locally(plan, [w.params for w in trainers], received, kernels=kernels)

    for w, got in zip(rollouts, received):
        for p in w.params.values():
            p.zero_()
        w.load_weights(weights.items())
        for name, want in w.params.items():
            assert torch.equal(got[name].view(torch.uint8), want.view(torch.uint8)), name
