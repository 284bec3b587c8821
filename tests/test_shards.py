"""The mesh model's trainer shards without meshes: PP stages and FSDP flat shards.

Every rank's map is extracted from its own load_weights; the union over a layout's ranks must
hold each checkpoint element the expected number of times, and a plan from FSDP flat shards run
in one process must leave TP2 rollouts bit-identical to their own load_weights.
"""

from __future__ import annotations

import functools

import pytest
import torch

from meshes.actors import checksums
from meshes.workers import checkpoint
from meshes.qwen3_moe import SIZES, FsdpTrainerShard, RolloutShard, checkpoint_spec
from meshes.spec import trainer_shard
from weightbridge.specs import RolloutSpec, TrainerSpec
from weightbridge import (CheckpointSpec, Placement, extract_source_map, plan_transfer,
                          run_plan_locally)
from zoo.oracle import piece_sources

MODEL = SIZES["tiny"]
SPEC = checkpoint_spec(MODEL)


@functools.lru_cache(maxsize=None)
def _maps(trainer: str) -> tuple:
    spec = TrainerSpec.parse(trainer)
    spec.validate(MODEL)
    maps = []
    for w in range(spec.num_workers):
        shard = trainer_shard(spec, MODEL, w)
        maps.append(extract_source_map(shard.params, shard.load_weights, SPEC))
    return tuple(maps)


def _coverage(maps) -> dict[str, torch.Tensor]:
    """How many (worker, param element) pairs hold each checkpoint element."""
    cover = {t.name: torch.zeros(t.numel, dtype=torch.int32) for t in SPEC.tensors}
    for smap in maps:
        for piece in smap.pieces:
            src = piece_sources(piece, SPEC[piece.region.tensor].shape)
            cover[piece.region.tensor].index_add_(0, src, torch.ones_like(src, dtype=torch.int32))
    return cover


def _rollout_shard(spec: RolloutSpec, worker: int) -> RolloutShard:
    c = spec.coords(worker)
    return RolloutShard(MODEL, spec.tp, c["tp"], spec.ep, c["ep"])


def _tp_split(name: str) -> bool:
    return name.endswith(("embed_tokens.weight", "lm_head.weight", "q_proj.weight",
                          "k_proj.weight", "v_proj.weight", "o_proj.weight"))


@pytest.mark.parametrize("trainer,copies", [
    ("gpus=2,pp=2", lambda name: 1),
    ("gpus=4,pp=2", lambda name: 2),  # two DP replicas of each stage
    ("gpus=4,tp=2,pp=2", lambda name: 1 if _tp_split(name) else 2),  # TP replicates the rest
    ("gpus=4,pp=2,ep=2", lambda name: 2 if ".experts." not in name else 1),
    ("gpus=5,fsdp=1", lambda name: 1),  # padded: 5 does not divide the elements
    ("gpus=4,fsdp=1", lambda name: 1),
])
def test_union_over_ranks_holds_each_checkpoint_element_as_often_as_the_layout_says(
        trainer, copies):
    for name, count in _coverage(_maps(trainer)).items():
        want = copies(name)
        assert bool((count == want).all()), (
            f"{trainer}: {name} held {sorted(set(count.tolist()))} times, expected {want}")


def test_pipeline_stages_renumber_layers_and_split_embedding_from_head():
    spec = TrainerSpec.parse("gpus=2,pp=2")
    first, last = (trainer_shard(spec, MODEL, w) for w in (0, 1))
    assert "embedding.word_embeddings.weight" in first.params
    assert "output_layer.weight" not in first.params
    assert {"output_layer.weight", "decoder.final_layernorm.weight"} <= set(last.params)
    assert "embedding.word_embeddings.weight" not in last.params
    last_map = _maps("gpus=2,pp=2")[1]
    # stage 1 of 2 holds checkpoint layer 1 as its local layer 0
    q = [p for p in last_map.pieces if p.param == "decoder.layers.0.self_attention.q.weight"]
    assert {p.region.tensor for p in q} == {"model.layers.1.self_attn.q_proj.weight"}


def test_fsdp_shards_cross_tensor_boundaries_and_pad_the_last_rank():
    world = 5  # does not divide the checkpoint's elements: the last rank ends in padding
    maps = _maps(f"gpus={world},fsdp=1")
    shard_numel = FsdpTrainerShard(MODEL, world, 0).shard_numel
    assert shard_numel * world >= SPEC.numel > shard_numel * (world - 1)
    assert all(len(m.tensors()) > 1 for m in maps)
    assert maps[0].unsourced == () and maps[-1].unsourced == (
        ("flat_param", shard_numel * world - SPEC.numel),)


def test_fsdp_trainer_to_tp2_rollouts_run_locally_is_bit_exact():
    trainer = TrainerSpec.parse("gpus=4,fsdp=1")
    rollout = RolloutSpec.parse("engines=2,gpus=2,tp=2")
    tshards = [trainer_shard(trainer, MODEL, w) for w in range(trainer.num_workers)]
    rshards = [_rollout_shard(rollout, w) for w in range(rollout.num_workers)]
    # Engines are replicas: probe one engine's ranks and reuse the maps for the other.
    rmaps = [extract_source_map(s.params, s.load_weights, SPEC)
             for s in rshards[:rollout.workers_per_engine]] * rollout.engines
    plan = plan_transfer(
        [(m, Placement("trainer")) for m in _maps("gpus=4,fsdp=1")],
        [(m, Placement(f"rollout-e{i // 2}", engine=i // 2)) for i, m in enumerate(rmaps)],
        round_bytes=64 << 10)
    with torch.no_grad():
        for s in tshards:
            s.load_weights(checkpoint(MODEL, 1))
        for s in rshards:
            s.load_weights(checkpoint(MODEL, 0))  # stale weights the plan must overwrite
    run_plan_locally(plan, [s.params for s in tshards], [s.params for s in rshards])
    for i, shard in enumerate(rshards):
        fresh = _rollout_shard(rollout, i)
        with torch.no_grad():
            fresh.load_weights(checkpoint(MODEL, 1))
        assert checksums(shard.params) == checksums(fresh.params), f"rollout {i}"


def test_checkpoint_differences_name_each_tensor_and_side():
    a = CheckpointSpec.from_tensors({"x": torch.zeros(2, 3), "y": torch.zeros(4)})
    b = CheckpointSpec.from_tensors({"x": torch.zeros(2, 4), "z": torch.zeros(1)})
    assert a.differences(a) == ()
    assert a.differences(b, ("trainer", "rollout")) == (
        "'x': trainer (2, 3) float32, rollout (2, 4) float32", "'y': only in trainer",
        "'z': only in rollout")
