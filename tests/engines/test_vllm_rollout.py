"""vLLM's own model classes and loaders as rollout workers: probed maps replay vLLM bit-exactly.

Each case runs every TP rank in its own process (the `spawn_ranks` fixture). Per rank: probe a
`VllmWorker` with `extract_source_map` (all ranks at once: vLLM's loaders are collective), then
load checkpoint version 3 three ways and compare bits:

- *first load*: a second engine that starts from version 3 the way vLLM's model loader does
  (``load_weights`` + the first ``process_weights_after_loading``): what vLLM serves;
- *reload*: the probed worker's own ``load_weights`` (vLLM's in-place reload), as an update does;
- *replay*: the recovered map run on zeroed parameters, as a WeightBridge transfer writes them.

Then the layout facts each map must show: fused qkv / gate_up, stacked w13 / w2 experts, the
padded vocabulary, TP slices, EP blocks of whole experts, MLA's fused_qkv_a_proj and its
W_UK_T / W_UV, views into kv_b_proj (left out of the map).
"""

from __future__ import annotations

import collections
import time

import pytest
import torch

from examples.engines import models
from weightbridge import SourceMap, extract_source_map
from weightbridge.discovery.replay import replay

pytestmark = pytest.mark.engines

VERSION = 3


# --------------------------------------------------------------------------------------------
# Rank bodies (run in spawned processes)
# --------------------------------------------------------------------------------------------


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(-1).view(torch.uint8)


def _differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors differ in shape, dtype or any bit."""
    return sorted(n for n in a if n not in b or a[n].dtype != b[n].dtype
                  or a[n].shape != b[n].shape or not torch.equal(_bits(a[n]), _bits(b[n])))


def _snapshot(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in params.items()}


def probe_and_compare(rank: int, world_size: int, port: int, model: str, ep: bool) -> dict:
    from examples.engines.vllm_rollout import VllmWorker

    spec, ckpt = models.checkpoint_spec(model), models.checkpoint(model, VERSION)
    start = time.perf_counter()
    worker = VllmWorker(model, rank=rank, world_size=world_size, master_port=port,
                        enable_expert_parallel=ep)
    first = VllmWorker(model, rank=rank, world_size=world_size, master_port=port,
                       enable_expert_parallel=ep, weights=ckpt.items())
    try:
        built = time.perf_counter()
        smap = extract_source_map(worker.params, worker.load_weights, spec)
        probed = time.perf_counter()
        worker.load_weights(ckpt.items())
        reloaded = _snapshot(worker.params)
        with torch.no_grad():
            for p in worker.params.values():
                p.zero_()
        replay(smap, worker.params, ckpt)
        replayed = _snapshot(worker.params)
        served = _snapshot(first.params)
        return {"smap": smap, "seconds": (built - start, probed - built),
                "reload_vs_first": _differ(reloaded, served),
                "replay_vs_first": _differ(replayed, served),
                "dtypes": {n: str(p.dtype) for n, p in worker.params.items()},
                "param_ids_stable": all(worker.params[n] is p for n, p in
                                        worker.model.named_parameters())}
    finally:
        first.close()
        worker.close()


# --------------------------------------------------------------------------------------------
# Map helpers
# --------------------------------------------------------------------------------------------


def _sources(smap: SourceMap, param_suffix: str) -> dict[str, set[str]]:
    """Per parameter ending in ``param_suffix``: the checkpoint tensors its pieces read."""
    out: dict[str, set[str]] = collections.defaultdict(set)
    for p in smap.pieces:
        if p.param.endswith(param_suffix):
            out[p.param].add(p.region.tensor)
    return out


def _rows(smap: SourceMap, tensor: str) -> set[int]:
    """Rows (dim 0) of a checkpoint tensor that the map reads."""
    rows: set[int] = set()
    for p in smap.pieces:
        if p.region.tensor == tensor:
            r = p.region
            rows.update(range(r.start[0], r.start[0] + r.step[0] * r.count[0], r.step[0]))
    return rows


def _unsourced(smap: SourceMap) -> dict[str, int]:
    return dict(smap.unsourced)


def _check_common(results: list[dict], model: str) -> None:
    cfg = models.hf_config(model)
    for rank, res in enumerate(results):
        print(f"{model} rank {rank}/{len(results)}: build {res['seconds'][0]:.1f} s (two "
              f"engines), probe {res['seconds'][1]:.2f} s; {res['smap'].summary()}")
        assert res["reload_vs_first"] == [], (
            f"rank {rank}: vLLM's reload differs from its first load in {res['reload_vs_first']}")
        assert res["replay_vs_first"] == [], (
            f"rank {rank}: the map's replay differs from vLLM's load in {res['replay_vs_first']}")
        assert res["param_ids_stable"], f"rank {rank}: vLLM replaced parameters after probing"
        assert set(res["dtypes"].values()) <= {"torch.bfloat16", "torch.float32"}
    # Vocabulary padded to 128 rows: the padding rows have no source on the rank(s) holding them.
    pad = (-cfg["vocab_size"]) % 64 * cfg["hidden_size"]
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert sum(_unsourced(r["smap"]).get(name, 0) for r in results) == pad, name
    # Every checkpoint element is read by some rank.
    spec = models.checkpoint_spec(model)
    read = set().union(*({p.region.tensor for p in r["smap"].pieces} for r in results))
    assert read == {t.name for t in spec.tensors}


# --------------------------------------------------------------------------------------------
# Qwen3-MoE
# --------------------------------------------------------------------------------------------


def test_qwen3_moe_tp1_map_replays_vllm_load_bit_exactly(spawn_ranks):
    (res,) = spawn_ranks(probe_and_compare, 1, "qwen3_moe", False)
    _check_common([res], "qwen3_moe")
    smap = res["smap"]
    assert _sources(smap, "qkv_proj.weight")["model.layers.0.self_attn.qkv_proj.weight"] == {
        f"model.layers.0.self_attn.{x}_proj.weight" for x in "qkv"}
    w13 = _sources(smap, "w13_weight")["model.layers.0.mlp.experts.routed_experts.w13_weight"]
    assert w13 == {f"model.layers.0.mlp.experts.{e}.{x}_proj.weight"
                   for e in range(4) for x in ("gate", "up")}
    w2 = _sources(smap, "w2_weight")["model.layers.0.mlp.experts.routed_experts.w2_weight"]
    assert w2 == {f"model.layers.0.mlp.experts.{e}.down_proj.weight" for e in range(4)}
    assert smap.unused == ()


def test_qwen3_moe_tp2_slices_heads_and_experts(spawn_ranks):
    results = spawn_ranks(probe_and_compare, 2, "qwen3_moe", False)
    _check_common(results, "qwen3_moe")
    hd = models.hf_config("qwen3_moe")["head_dim"]
    for rank, res in enumerate(results):
        smap = res["smap"]
        # q heads 2 per rank, kv heads 1 per rank (2 kv heads / TP2: sliced, not replicated)
        assert _rows(smap, "model.layers.0.self_attn.q_proj.weight") == set(
            range(2 * hd * rank, 2 * hd * (rank + 1)))
        assert _rows(smap, "model.layers.0.self_attn.k_proj.weight") == set(
            range(hd * rank, hd * (rank + 1)))
        # every expert on every rank, sliced along the intermediate dim
        assert _rows(smap, "model.layers.0.mlp.experts.3.gate_proj.weight") == set(
            range(16 * rank, 16 * rank + 16))
        assert _rows(smap, "model.layers.0.mlp.gate.weight") == set(range(4))  # replicated
        assert smap.unused == ()


def test_qwen3_moe_tp2_expert_parallel_holds_blocks_of_whole_experts(spawn_ranks):
    results = spawn_ranks(probe_and_compare, 2, "qwen3_moe", True)
    _check_common(results, "qwen3_moe")
    for rank, res in enumerate(results):
        smap = res["smap"]
        mine = {2 * rank, 2 * rank + 1}
        w13 = _sources(smap, "w13_weight")["model.layers.1.mlp.experts.routed_experts.w13_weight"]
        assert {int(t.split(".")[5]) for t in w13} == mine
        assert _rows(smap, f"model.layers.1.mlp.experts.{2 * rank}.up_proj.weight") == set(
            range(32))  # whole experts, not slices
        others = {f"model.layers.{i}.mlp.experts.{e}.{x}_proj.weight" for i in range(2)
                  for e in set(range(4)) - mine for x in ("gate", "up", "down")}
        assert set(smap.unused) == others


# --------------------------------------------------------------------------------------------
# DeepSeek-V3 (MLA)
# --------------------------------------------------------------------------------------------


def test_deepseek_v3_mla_tp2_map_replays_vllm_load_bit_exactly(spawn_ranks):
    results = spawn_ranks(probe_and_compare, 2, "deepseek_v3", False)
    _check_common(results, "deepseek_v3")
    for rank, res in enumerate(results):
        smap = res["smap"]
        attn = "model.layers.1.self_attn."
        assert _sources(smap, "fused_qkv_a_proj.weight")[attn + "fused_qkv_a_proj.weight"] == {
            attn + "q_a_proj.weight", attn + "kv_a_proj_with_mqa.weight"}
        # MLA's absorbed W_UK_T / W_UV are views into kv_b_proj.weight: written with it, so
        # the map leaves them out (each byte moves once)
        assert not _sources(smap, "W_UK_T") and not _sources(smap, "W_UV")
        assert _rows(smap, attn + "kv_b_proj.weight") == set(range(64 * rank, 64 * rank + 64))
        assert _sources(smap, "mlp.gate_up_proj.weight")["model.layers.0.mlp.gate_up_proj.weight"] \
            == {"model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"}
        shared = "model.layers.1.mlp.shared_experts."
        assert _sources(smap, "shared_experts.gate_up_proj.weight")[
            shared + "gate_up_proj.weight"] == {shared + "gate_proj.weight",
                                                shared + "up_proj.weight"}
        bias = "model.layers.1.mlp.gate.e_score_correction_bias"
        assert res["dtypes"][bias] == "torch.float32" and _rows(smap, bias) == set(range(4))


# --------------------------------------------------------------------------------------------
# An fp32 trainer updating a bf16 vLLM engine (its loaders cast the fp32 checkpoint)
# --------------------------------------------------------------------------------------------


def _fp32_checkpoint(model: str, version: int) -> dict[str, torch.Tensor]:
    """`models.checkpoint`'s values kept in float32 (full mantissas: the cast rounds them)."""
    out = {}
    for t in models.checkpoint_spec(model).tensors:
        gen = torch.Generator().manual_seed(version * 7919 + len(out))
        values = torch.randn(t.shape, generator=gen, dtype=torch.float32) * 0.05
        out[t.name] = values + 1.0 if t.name.endswith("norm.weight") else values
    return out


def update_from_fp32(rank: int, world_size: int, port: int, model: str) -> dict:
    """Probe the bf16 engine against the fp32 checkpoint an fp32 trainer writes, plan with a
    trainer that holds that checkpoint, and run two updates; compare with vLLM's own reload of
    each fp32 checkpoint."""
    from examples.engines.vllm_rollout import VllmWorker
    from weightbridge import (CheckpointSpec, CpuCopyKernels, Placement, TensorSpec,
                              plan_transfer, run_plan_locally)

    spec = CheckpointSpec(tuple(TensorSpec(t.name, t.shape, "float32")
                                for t in models.checkpoint_spec(model).tensors))
    worker = VllmWorker(model, rank=rank, world_size=world_size, master_port=port)
    try:
        smap = extract_source_map(worker.params, worker.load_weights, spec)
        trainer = {t.name: torch.zeros(t.shape) for t in spec.tensors}

        def trainer_load(weights):
            for name, w in weights:
                trainer[name].copy_(w)
        tmap = extract_source_map(trainer, trainer_load, spec)
        plan = plan_transfer([(tmap, Placement("t0"))], [(smap, Placement("r0", engine=0))],
                             round_bytes=1 << 20)
        differ = []
        for version in (1, 2):
            ckpt = _fp32_checkpoint(model, version)
            trainer_load(ckpt.items())
            run_plan_locally(plan, [trainer], [worker.params], kernels=CpuCopyKernels())
            got = _snapshot(worker.params)
            worker.load_weights(ckpt.items())  # vLLM's own cast of the same checkpoint
            differ.append(_differ(got, _snapshot(worker.params)))
        overlaps = plan.correspondence.overlaps
        return {"casts": {(p.param, p.cast_from) for p in smap.pieces}, "differ": differ,
                "wire": {(o.dtype, o.source_dtype) for o in overlaps},
                "nbytes": plan.correspondence.nbytes,
                "numel": sum(o.region.numel for o in overlaps),
                "dtypes": {n: str(p.dtype) for n, p in worker.params.items()}}
    finally:
        worker.close()


def test_qwen3_moe_bf16_engine_is_updated_bit_exactly_from_fp32_trainer_weights(spawn_ranks):
    """vLLM's loaders (fused qkv, stacked experts, padded vocabulary) ``copy_`` the fp32
    checkpoint into bf16 parameters: mapped as casts, sent as bf16, equal to vLLM's reload."""
    (res,) = spawn_ranks(update_from_fp32, 1, "qwen3_moe")
    assert res["differ"] == [[], []], res["differ"]
    bf16 = {n for n, d in res["dtypes"].items() if d == "torch.bfloat16"}
    assert bf16 and {p for p, c in res["casts"] if c == "float32"} == bf16
    assert res["wire"] == {("bfloat16", "float32")}
    assert res["nbytes"] == 2 * res["numel"]  # half of what sending fp32 would move
