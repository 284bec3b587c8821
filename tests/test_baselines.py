"""The P2P baseline plan: WeightBridge's plan with every forward re-sourced from the trainer;
run in one process it still delivers every rollout parameter bit-exactly, and only trainers
send."""

import torch

from controller.baselines import p2p_plan
from meshes.qwen3_moe import SIZES, RolloutShard, TrainerShard, checkpoint_spec
from weightbridge import (CpuCopyKernels, Placement, Stage, WorkerId, extract_source_map,
                          plan_transfer, run_plan_locally)


def test_p2p_plan_sends_only_from_trainers_and_is_bit_exact():
    config = SIZES["tiny"]
    spec = checkpoint_spec(config)
    trainers = [TrainerShard(config, 2, t, 1, 0) for t in range(2)]
    rollouts = [RolloutShard(config, 1, 0, 1, 0) for _ in range(3)]  # three one-rank engines
    tmaps = [extract_source_map(w.params, w.load_weights, spec) for w in trainers]
    rmaps = [extract_source_map(w.params, w.load_weights, spec) for w in rollouts]
    plan = plan_transfer([(m, Placement("t")) for m in tmaps],
                         [(m, Placement(f"r{i}", engine=i)) for i, m in enumerate(rmaps)],
                         round_bytes=128 << 10)
    p2p = p2p_plan(plan)
    sent, _ = p2p.stage_bytes()
    assert sent[2:].sum() == 0 and sent[:, 1:].sum() == 0  # rollouts forward nothing
    assert sent.sum() == 3 * plan.stage_bytes()[0][:2, 0].sum()  # a copy per rollout
    assert p2p.received_bytes(WorkerId("rollout", 1), Stage.RECEIVE) == \
        plan.received_bytes(WorkerId("rollout", 1))

    gen = torch.Generator().manual_seed(0)
    weights = {t.name: torch.randn(t.shape, generator=gen).bfloat16() for t in spec.tensors}
    for t in trainers:
        t.load_weights(weights.items())
    received = [{n: torch.zeros_like(p) for n, p in w.params.items()} for w in rollouts]
    run_plan_locally(p2p, [t.params for t in trainers], received, kernels=CpuCopyKernels())
    want = RolloutShard(config, 1, 0, 1, 0)
    want.load_weights(weights.items())
    for got in received:
        for n, p in want.params.items():
            assert torch.equal(got[n].view(torch.uint8), p.view(torch.uint8)), n
