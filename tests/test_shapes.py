"""Shape-only maps: real parameter counts, layouts that cover the checkpoint, paper-scale plans."""

from collections import Counter

import pytest

from weightbridge import correspond, plan_transfer, simulate
from weightbridge.shapes import (KIMI_K2, MOONLIGHT_16B_A3B, PAPER_CLUSTER, QWEN3_235B_A22B,
                                 QWEN3_30B_A3B, TABLE_2, ModelConfig, checkpoint, megatron_maps,
                                 sglang_maps, workers)


@pytest.mark.parametrize("cfg,params", [(MOONLIGHT_16B_A3B, 16.0e9), (QWEN3_30B_A3B, 30.5e9),
                                        (QWEN3_235B_A22B, 235.1e9), (KIMI_K2, 1.03e12)])
def test_models_match_table_2_parameter_counts_within_1_percent(cfg, params):
    assert abs(checkpoint(cfg).numel / params - 1) < 0.01


TINY_GQA = ModelConfig(name="tiny-gqa", hidden=16, num_layers=3, num_heads=8, num_kv_heads=2,
                       head_dim=4, vocab=100, num_experts=8, moe_intermediate=8)
TINY_MLA = ModelConfig(name="tiny-mla", hidden=16, num_layers=3, num_heads=8, vocab=96,
                       num_experts=8, moe_intermediate=8, num_dense_layers=1,
                       dense_intermediate=24, num_shared_experts=1, q_lora_rank=8,
                       kv_lora_rank=8, qk_nope_dim=4, qk_rope_dim=2, v_head_dim=4)


def _coverage(maps):
    count = Counter()
    for m in maps:
        for p in m.pieces:
            count[p.region.tensor] += p.region.numel
    return count


@pytest.mark.parametrize("cfg", [TINY_GQA, TINY_MLA])
@pytest.mark.parametrize("tp,pp,cp,ep", [(1, 1, 1, 1), (2, 3, 1, 2), (2, 1, 2, 4)])
def test_megatron_ranks_cover_every_element_with_the_right_replication(cfg, tp, pp, cp, ep):
    maps = megatron_maps(cfg, num_gpus=tp * pp * cp, tp=tp, pp=pp, cp=cp, ep=ep)
    got = _coverage(maps)
    for t in checkpoint(cfg).tensors:
        if "experts." in t.name and "shared" not in t.name:
            want = tp * cp // ep             # expert-data-parallel replicas
        elif len(t.shape) == 1 or t.name.endswith(("gate.weight", "kv_a_proj_with_mqa.weight",
                                                     "q_a_proj.weight")):
            want = tp * cp                   # replicated on every TP and CP rank
        else:
            want = cp                        # TP-sharded, replicated across CP
        assert got[t.name] == want * t.numel, t.name


@pytest.mark.parametrize("cfg", [TINY_GQA, TINY_MLA])
@pytest.mark.parametrize("tp,ep", [(1, 1), (4, 4), (4, 2), (8, 8)])
def test_sglang_engine_needs_every_checkpoint_element(cfg, tp, ep):
    maps = sglang_maps(cfg, tp=tp, ep=ep)
    got = _coverage(maps)
    assert set(got) == {t.name for t in checkpoint(cfg).tensors}
    assert all(got[t.name] >= t.numel for t in checkpoint(cfg).tensors)


def test_tiny_megatron_to_sglang_correspondence_covers_the_checkpoint():
    trainers = megatron_maps(TINY_MLA, num_gpus=8, tp=2, pp=2, ep=2)
    corr = correspond(trainers, sglang_maps(TINY_MLA, tp=4, ep=4))
    assert sum(o.region.numel for o in corr.overlaps) == checkpoint(TINY_MLA).numel


def test_bad_degrees_say_what_does_not_divide():
    with pytest.raises(ValueError, match="does not divide"):
        sglang_maps(TINY_GQA, tp=3)


def test_deployment_a_simulates_within_5_percent_of_ideal():
    dep = TABLE_2[0]
    trainers, rollouts = workers(dep)
    est = simulate(plan_transfer(trainers, rollouts, round_bytes=dep.round_bytes), PAPER_CLUSTER)
    assert est.ratio <= 1.05, est
    assert est.broadcast > est.ewtt and est.p2p > est.ewtt
