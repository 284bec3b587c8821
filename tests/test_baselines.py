"""The P2P baseline plan: WeightBridge's plan with every forward re-sourced from the trainer;
run in one process it still delivers every rollout parameter bit-exactly, only trainers send,
and a trainer packs a segment once however many rollouts it writes it to. On proc meshes, P2P
and Broadcast (gather to a head, broadcast, load_weights) update every rollout bit-exactly.
The torch.distributed baselines: their plan collects every needed element once and buckets
full tensors; on proc meshes, gloo broadcast, ring broadcast and bucketed P2P update every
rollout bit-exactly."""

import pytest
import torch

from controller.baselines import p2p_plan
from meshes.qwen3_moe import SIZES, RolloutShard, TrainerShard, checkpoint_spec
from weightbridge import (CpuCopyKernels, Placement, TransferConfig, extract_source_map,
                          plan_transfer, run_plan_locally)
from weightbridge.types import Stage, WorkerId


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
    from weightbridge.specs import RolloutSpec, TrainerSpec
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


def _dist_maps(tspec_text: str, rspec_text: str):
    from weightbridge.specs import RolloutSpec, TrainerSpec
    from meshes.workers import tiny

    ts, rs = TrainerSpec.parse(tspec_text), RolloutSpec.parse(rspec_text)
    tparts = [tiny("trainer", ts, i) for i in range(ts.num_workers)]
    rparts = [tiny("rollout", rs, j) for j in range(rs.num_workers)]
    smap = lambda p: extract_source_map(p.params, p.load_weights, p.spec)  # noqa: E731
    return [smap(p) for p in tparts], [smap(p).tensors() for p in rparts], tparts[0].spec


@pytest.mark.parametrize("broadcast", [True, False])
def test_dist_plan_collects_each_needed_element_once_and_buckets_full_tensors(broadcast):
    from controller.baselines.plans import plan_dist

    tmaps, needs, spec = _dist_maps("nodes=1,gpus=2,tp=2", "engines=3,nodes=1,gpus=1")
    plan = plan_dist(tmaps, needs, spec, bucket_bytes=64 << 10, broadcast=broadcast)
    owner = dict(plan.owner)
    assert set(owner) == set().union(*needs)
    if broadcast:
        assert set(owner.values()) == {0}
        assert all(b.dsts == (0, 1, 2) and b.src == 0 for b in plan.buckets)
    else:
        assert set(owner.values()) == {0, 1}  # TP2: both trainers own some full tensors
    # The owner's own regions plus the pieces sent to it cover each tensor exactly once.
    for name, o in owner.items():
        got = [p.region for p in plan.local[o] if p.region.tensor == name]
        got += [p.region for m in plan.messages if m.dst == o for p in m.pieces
                if p.region.tensor == name]
        assert len(got) == len(set(got))
        assert sum(r.numel for r in got) == spec[name].numel
    for j, need in enumerate(needs):
        sent = [n for b in plan.buckets_to(j) for n, _, _ in b.tensors]
        assert sorted(sent) == sorted(set(need))  # each full tensor it reads, once
    for b in plan.buckets:  # fixed size: only a tensor larger than a bucket travels alone
        assert b.nbytes <= 64 << 10 or len(b.tensors) == 1
        assert all(off % 8 == 0 for _, off, _ in b.tensors)


def test_dist_plan_refuses_bad_input_before_any_byte():
    from controller.baselines.plans import plan_dist

    tmaps, needs, spec = _dist_maps("nodes=1,gpus=2,tp=2", "engines=1,nodes=1,gpus=1")
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_dist(tmaps, needs, spec, bucket_bytes=0, broadcast=True)
    with pytest.raises(ValueError, match="broadcast=True"):
        plan_dist(tmaps, needs, spec, bucket_bytes=1 << 20, broadcast=False, ring=True)
    with pytest.raises(ValueError, match="do not hold all of it"):
        plan_dist(tmaps[:1], needs, spec, bucket_bytes=1 << 20, broadcast=False)


@pytest.mark.mesh
def test_gloo_baselines_update_every_rollout_bit_exactly_on_meshes():
    from controller.baselines import BucketedP2P, GlooBroadcast, RingBroadcast
    from weightbridge.specs import RolloutSpec, TrainerSpec
    from meshprocs import bootstrap_children, proc_pair

    tspec = TrainerSpec.parse("nodes=1,gpus=2,tp=2")
    rspec = RolloutSpec.parse("engines=2,nodes=1,gpus=1")
    before = bootstrap_children()
    with proc_pair(2, 2) as procs:
        for cls, stage in ((GlooBroadcast, "broadcast"), (RingBroadcast, "broadcast"),
                           (BucketedP2P, "send")):
            with cls(tspec, rspec, "tiny", procs=procs, bucket_bytes=64 << 10) as run:
                plan = run.plan
                for version in (1, 2):
                    report = run.update(version)
                    assert not report.mismatched, report.line()
                    assert report.num_params > 0
                    assert report.rdma_bytes == plan.delivered_bytes()
                    spans = report.timing.spans
                    assert stage in {s for s, *_ in spans[("trainer", 0)]}
                    for j in (0, 1):  # a load per bucket aimed at the rollout
                        loads = [r for s, r, *_ in spans[("rollout", j)] if s == "load"]
                        assert sorted(loads) == [b.index for b in plan.buckets_to(j)]
    assert bootstrap_children() - before == set()


def test_gloo_ranks_find_their_interface_and_the_controller_address(monkeypatch):
    from controller.baselines.dist import TRANSPORT_ENV, controller_address
    from controller.baselines.members import interface_of, local_ip

    assert local_ip("127.0.0.1") == "127.0.0.1"
    assert interface_of("127.0.0.1") == "lo"  # what GLOO_SOCKET_IFNAME gets on this host
    with pytest.raises(RuntimeError, match="no interface"):
        interface_of("192.0.2.1")  # TEST-NET-1: on no interface here
    monkeypatch.setenv(TRANSPORT_ENV, "tcp://10.77.0.1:0")
    assert controller_address() == "10.77.0.1"  # an emulated cluster's bridge
    monkeypatch.delenv(TRANSPORT_ENV)
    assert controller_address() == "127.0.0.1"
