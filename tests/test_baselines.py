"""The P2P baseline plan: WeightBridge's plan with every forward re-sourced from the trainer;
run in one process it still delivers every rollout parameter bit-exactly, only trainers send,
and a trainer packs a segment once however many rollouts it writes it to. On proc meshes, P2P
and Broadcast (gather to a head, broadcast, load_weights) update every rollout bit-exactly."""

import pytest
import torch

from controller.baselines import p2p_plan
from meshes.qwen3_moe import SIZES, RolloutShard, TrainerShard, checkpoint_spec
from weightbridge import (CpuCopyKernels, Placement, Stage, TransferConfig, WorkerId,
                          extract_source_map, plan_transfer, run_plan_locally)


def _plan(num_rollouts: int = 3):
    config = SIZES["tiny"]
    spec = checkpoint_spec(config)
    trainers = [TrainerShard(config, 2, t, 1, 0) for t in range(2)]
    rollouts = [RolloutShard(config, 1, 0, 1, 0) for _ in range(num_rollouts)]  # one-rank engines
    tmaps = [extract_source_map(w.params, w.load_weights, spec) for w in trainers]
    rmaps = [extract_source_map(w.params, w.load_weights, spec) for w in rollouts]
    plan = plan_transfer([(m, Placement("t")) for m in tmaps],
                         [(m, Placement(f"r{i}", engine=i)) for i, m in enumerate(rmaps)],
                         round_bytes=128 << 10)
    return config, spec, trainers, rollouts, plan


def test_p2p_plan_sends_only_from_trainers_and_is_bit_exact():
    config, spec, trainers, rollouts, plan = _plan()
    p2p = p2p_plan(plan)
    assert type(p2p) is type(plan)
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


def test_a_trainer_packs_each_box_of_a_round_once():
    *_, plan = _plan()
    p2p = p2p_plan(plan)
    for t in [w for w in plan.workers if w.side == "trainer"]:
        for mine, ours in zip(p2p.for_worker(t).rounds, plan.for_worker(t).rounds):
            assert len(set(mine.pack)) == len(mine.pack)
            # The same segments, written to three rollouts instead of one: the same boxes.
            assert set(mine.pack) == set(ours.pack)
            assert len(mine.writes) >= len(ours.writes)


@pytest.mark.mesh
def test_p2p_and_broadcast_update_every_rollout_bit_exactly_on_meshes():
    from controller.baselines import Broadcast
    from controller.driver import MeshTransfer
    from meshes.spec import RolloutSpec, TrainerSpec
    from meshprocs import bootstrap_children, proc_pair

    tspec = TrainerSpec.parse("nodes=1,gpus=2,tp=2")
    rspec = RolloutSpec.parse("engines=2,nodes=1,gpus=1")
    config = TransferConfig(round_bytes=64 << 10)
    checkpoint = checkpoint_spec(SIZES["tiny"]).numel * 2
    before = bootstrap_children()
    with proc_pair(2, 2) as procs:
        with MeshTransfer(tspec, rspec, "tiny", config=config, procs=procs,
                          reroute=p2p_plan) as mt:
            mt.connect()
            for version in (1, 2):
                report = mt.update(version)
                assert not report.mismatched, report.line()
        with Broadcast(tspec, rspec, "tiny", procs=procs, config=config) as bc:
            for version in (1, 2):
                report = bc.update(version)
                assert not report.mismatched, report.line()
                assert report.num_params > 0
                # The gather moves the checkpoint once, the broadcast once per rollout.
                assert report.rdma_bytes == 3 * checkpoint
                spans = report.timing.spans
                assert {s for s, *_ in spans[("trainer", 0)]} >= {"assemble", "broadcast"}
                assert all([s for s, *_ in spans[("rollout", j)]] == ["load"] for j in (0, 1))
    assert bootstrap_children() - before == set()
