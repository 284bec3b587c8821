"""Trainer workers: probed maps replay torchtitan's (and plain DCP's) HF load bit-exactly.

Each layout runs its 4 ranks in their own processes (`conftest.run_ranks`, gloo on CPU). Per rank:
build a `TitanWorker` (torchtitan's own model, parallelize_fn, FSDP2 / TP / EP) or a `DcpWorker`
(HF-named modules, ``parallelize_module`` x ``fully_shard``), probe it with `extract_source_map`
on all ranks at once (the loaders go through DCP and are collective), then load checkpoint
version 2 two ways and compare bits:

- *load*: the worker's own ``load_weights`` (torchtitan: safetensors -> ``to_hf`` ->
  ``dcp.load`` -> ``from_hf`` -> ``load_state_dict``), what the trainer holds after loading it;
- *replay*: the recovered map run on zeroed local shards, as a WeightBridge transfer reads them.

Across ranks the maps must cover every checkpoint element exactly as often as the DTensor
placements say (sharded mesh dims split, replicated ones copy). Also: ``params`` are views of
the model's storage, torchtitan's ``to_hf`` names and shapes equal `models.checkpoint_spec`,
and loads that would go silently wrong or fail deep inside DCP are refused up front.
"""

from __future__ import annotations

import functools
import math
import re

import pytest
import torch
from conftest import run_ranks
from zoo.oracle import piece_sources

from examples.engines import models
from weightbridge import SourceMap, extract_source_map
from weightbridge.discovery.replay import replay

pytestmark = pytest.mark.engines

VERSION = 2
LAYOUTS = {  # name: (worker, model, degrees); dp_shard x tp ranks, EP carved out of them
    "titan-qwen3_moe-fsdp2xtp2": ("titan", "qwen3_moe", {"dp_shard": 2, "tp": 2}),
    "titan-qwen3_moe-fsdp4xep2": ("titan", "qwen3_moe", {"dp_shard": 4, "ep": 2}),
    "titan-deepseek_v3-fsdp2xtp2xep2": ("titan", "deepseek_v3",
                                        {"dp_shard": 2, "tp": 2, "ep": 2}),
    "dcp-deepseek_v3-fsdp2xtp2": ("dcp", "deepseek_v3", {"dp_shard": 2, "tp": 2}),
    # 3 ranks: FSDP2 cuts 64 hidden rows 22 / 22 / 20 (torchtitan's HF loader would refuse
    # 4 experts over 3 shards)
    "dcp-qwen3_moe-fsdp3": ("dcp", "qwen3_moe", {"dp_shard": 3}),
}
TITAN = [name for name, (kind, _, _) in LAYOUTS.items() if kind == "titan"]


# --------------------------------------------------------------------------------------------
# Rank body (runs in spawned processes)
# --------------------------------------------------------------------------------------------


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(-1).view(torch.uint8)


def _snapshot(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in params.items()}


def _copies(worker) -> dict[str, int]:
    """Per param, on how many ranks each of its elements lives: the world size over the sizes
    of the mesh dims its DTensor placements shard (plain tensors live on every rank)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    tensors = dict(worker.model.named_parameters()) | dict(worker.model.named_buffers())
    out = {}
    for name in worker.params:
        t = tensors[name]
        shards = 1
        if isinstance(t, DTensor):  # FSDP2 over TP shards the TP shard: a _StridedShard
            shards = math.prod(t.device_mesh.size(i) for i, pl in enumerate(t.placements)
                               if pl.is_shard() or isinstance(pl, _StridedShard))
        out[name] = worker.world_size // shards
    return out


def _views_write_through(worker, rank: int) -> list[str]:
    """Names whose model tensor does not follow writes into ``worker.params`` (collective).

    Zero every local shard through ``params``: each full (gathered) tensor must be all zero;
    then write a non-zero mark: each full tensor must hold no zero left.
    """
    from torch.distributed.tensor import DTensor

    tensors = dict(worker.model.named_parameters()) | dict(worker.model.named_buffers())
    bad = []
    with torch.no_grad():
        for name, local in worker.params.items():
            t = tensors[name]
            full = (lambda: t.full_tensor()) if isinstance(t, DTensor) else (lambda: t)
            local.zero_()
            zeroed = bool((full() == 0).all())
            local.fill_(rank + 1)
            if not zeroed or not bool((full() != 0).all()):
                bad.append(name)
    return bad


def probe_and_compare(rank: int, world_size: int, port: int, kind: str, model: str,
                      degrees: dict) -> dict:
    from examples.engines.dcp_trainer import DcpWorker
    from examples.engines.titan_trainer import TitanWorker

    spec, ckpt = models.checkpoint_spec(model), models.checkpoint(model, VERSION)
    worker = {"titan": TitanWorker, "dcp": DcpWorker}[kind](
        model, rank=rank, world_size=world_size, master_port=port, **degrees)
    try:
        hf_differences = (worker.hf_spec().differences(spec, ("torchtitan to_hf", "models"))
                          if kind == "titan" else ())
        first = worker.params  # captured once, as an adapter does
        smap = extract_source_map(first, worker.load_weights, spec)
        worker.load_weights(ckpt.items())
        loaded = _snapshot(worker.params)
        with torch.no_grad():
            for p in worker.params.values():
                p.zero_()
        replay(smap, worker.params, ckpt)
        replayed = _snapshot(worker.params)
        refused = {}
        stable = all(first[n].data_ptr() == p.data_ptr() for n, p in worker.params.items())
        for case, weights in _bad_loads(kind, spec, ckpt).items():
            try:
                worker.load_weights(weights)
            except ValueError as e:  # raised on every rank before any collective
                refused[case] = str(e)
        return {"smap": smap, "hf_differences": hf_differences, "copies": _copies(worker),
                "replay_differs": sorted(n for n in loaded
                                         if not torch.equal(_bits(loaded[n]), _bits(replayed[n]))),
                "loaded_changed": sorted(n for n in loaded if bool(loaded[n].ne(0).any())),
                "views_bad": _views_write_through(worker, rank), "refused": refused,
                "params_stable": stable,
                "shapes": {n: tuple(p.shape) for n, p in worker.params.items()}}
    finally:
        worker.close()


def _bad_loads(kind: str, spec, ckpt: dict[str, torch.Tensor]) -> dict[str, list]:
    """Loads the worker must refuse: a wrong shape, and for torchtitan (which stacks experts)
    some experts of a layer alone."""
    embed = "model.embed_tokens.weight"
    out = {"wrong_shape": [(embed, ckpt[embed][:-1])]}
    if kind == "titan":
        expert = next(t.name for t in spec.tensors if ".experts.0.gate_proj" in t.name)
        out["partial_experts"] = [(expert, ckpt[expert])]
    return out


@functools.lru_cache(maxsize=None)
def _run(layout: str) -> tuple[dict, ...]:
    _, _, degrees = LAYOUTS[layout]
    world_size = degrees["dp_shard"] * degrees.get("tp", 1)
    return tuple(run_ranks(probe_and_compare, world_size, *LAYOUTS[layout], timeout_s=300))


# --------------------------------------------------------------------------------------------
# Per layout
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_map_replays_the_trainers_hf_load_bit_exactly(layout):
    for rank, got in enumerate(_run(layout)):
        smap: SourceMap = got["smap"]
        assert got["replay_differs"] == [], (rank, got["replay_differs"], smap.summary())
        # the comparison is not vacuous: the load filled every non-empty local shard
        assert got["loaded_changed"] == sorted(p.name for p in smap.params if math.prod(p.shape))
        # FSDP2's padding of uneven shards lies outside the local tensor: nothing is unsourced
        assert smap.unsourced == (), (rank, smap.unsourced)
        # loads copy into the same storage: tensors captured before the probe stay live
        assert got["params_stable"], rank


@pytest.mark.parametrize("layout", LAYOUTS)
def test_ranks_hold_each_checkpoint_element_as_often_as_the_placements_say(layout):
    _, model, _ = LAYOUTS[layout]
    spec = models.checkpoint_spec(model)
    runs = _run(layout)
    cover = {t.name: torch.zeros(t.numel, dtype=torch.int32) for t in spec.tensors}
    for got in runs:
        for piece in got["smap"].pieces:
            src = piece_sources(piece, spec[piece.region.tensor].shape)
            cover[piece.region.tensor].index_add_(0, src, torch.ones_like(src, dtype=torch.int32))
    missing = [n for n, c in cover.items() if not bool((c > 0).all())]
    assert missing == [], f"checkpoint elements no rank holds: {missing}"
    for rank, got in enumerate(runs):
        for piece in got["smap"].pieces:
            src = piece_sources(piece, spec[piece.region.tensor].shape)
            held = cover[piece.region.tensor][src]
            want = got["copies"][piece.param]
            assert bool((held == want).all()), (
                f"rank {rank}: {piece.region.tensor} (in {piece.param}) held "
                f"{sorted(set(held.tolist()))} times across ranks, placements say {want}")


@pytest.mark.parametrize("layout", [n for n, (_, _, d) in LAYOUTS.items() if d.get("ep", 1) > 1])
def test_expert_parallel_ranks_read_whole_experts(layout):
    _, model, _ = LAYOUTS[layout]
    spec = models.checkpoint_spec(model)
    for rank, got in enumerate(_run(layout)):
        experts = [p for p in got["smap"].pieces if ".experts." in p.region.tensor
                   and ".shared_experts." not in p.region.tensor]
        assert experts, rank
        partial = [p.region for p in experts if p.region.numel != spec[p.region.tensor].numel]
        assert partial == [], (rank, partial)
        # and only some of them: EP splits the experts between ranks
        assert len({p.region.tensor for p in experts}) < sum(
            ".experts." in t.name and ".shared_experts." not in t.name for t in spec.tensors)


def test_uneven_fsdp2_shards_are_unpadded_views_with_fewer_rows_on_the_last_rank():
    layout = "dcp-qwen3_moe-fsdp3"
    runs = _run(layout)
    spec = models.checkpoint_spec(LAYOUTS[layout][1])
    for name in ("model.norm.weight", "model.layers.0.mlp.gate.weight"):
        rows = [got["shapes"][name][0] for got in runs]
        assert sum(rows) == spec[name].shape[0], (name, rows)  # no padding rows in local tensors
        assert rows[0] == max(rows) > rows[-1], (name, rows)  # torch.chunk: short last ranks
    # 4 router rows over 3 ranks are 2 / 2 / 0: a rank may hold an empty shard
    assert min(got["shapes"]["model.layers.0.mlp.gate.weight"][0] for got in runs) == 0
    for rank, got in enumerate(runs):  # and the maps still replay the loader bit-exactly
        assert got["replay_differs"] == [] and got["smap"].unsourced == (), rank


@pytest.mark.parametrize("layout", LAYOUTS)
def test_params_are_live_views_of_the_models_shards(layout):
    for rank, got in enumerate(_run(layout)):
        assert got["views_bad"] == [], (rank, got["views_bad"])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_loads_that_would_fail_deep_in_dcp_or_be_skipped_are_refused_with_a_fix(layout):
    for rank, got in enumerate(_run(layout)):
        refused = got["refused"]
        assert "(119, 64)" in refused.get("wrong_shape", ""), (rank, refused)
        assert "(120, 64)" in refused["wrong_shape"]
        if layout in TITAN:
            assert "not [1, 2, 3]" in refused.get("partial_experts", ""), (rank, refused)
            assert "all 4 arrive in the same call" in refused["partial_experts"]


# --------------------------------------------------------------------------------------------
# Per model
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", models.MODELS)
def test_torchtitan_to_hf_names_and_shapes_equal_the_checkpoint_spec(model):
    layout = next(name for name in TITAN if LAYOUTS[name][1] == model)
    for rank, got in enumerate(_run(layout)):
        assert got["hf_differences"] == (), (rank, got["hf_differences"])


# --------------------------------------------------------------------------------------------
# Without processes
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,degrees,message", [
    ("titan", {"world_size": 4, "dp_shard": 3, "tp": 2}, "must equal world_size"),
    ("titan", {"world_size": 4, "dp_shard": 2, "tp": 2, "ep": 3}, "ep (3) must divide"),
    ("titan", {"world_size": 4, "dp_shard": 1, "tp": 4}, "tp (4) must divide num_key_value_heads"),
    ("titan", {"world_size": 4, "dp_shard": 4, "tp": 0}, "degrees must be >= 1"),
    ("titan", {"world_size": 3, "dp_shard": 3}, "cannot split evenly over 3 expert shards"),
    ("dcp", {"world_size": 4, "dp_shard": 3, "tp": 2}, "must equal world_size"),
    ("dcp", {"world_size": 3, "tp": 3}, "tp (3) must divide dim 0 of model.layers.0.self_attn"),
])
def test_bad_degrees_are_refused_before_any_process_group(kind, degrees, message):
    from examples.engines.dcp_trainer import DcpWorker
    from examples.engines.titan_trainer import TitanWorker

    worker = {"titan": TitanWorker, "dcp": DcpWorker}[kind]
    with pytest.raises(ValueError, match=re.escape(message)):
        worker("qwen3_moe", rank=0, master_port=1, **degrees)
