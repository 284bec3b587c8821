"""Layout discovery against the loader zoo: every map replays its loader bit for bit.

For each zoo case (``tests/zoo``): extract the source map from one build of the worker, load a
pseudo-random checkpoint through the loader into a second build, replay the map into a third,
and compare bytes (`zoo.oracle`). Then the case's own expectations: exact unsourced counts
(padded vocab, FSDP padding), exact unused names (EP, PP, skipped tensors), and compactness: the
number of pieces is bounded by the loader's slice-copies and does not grow with tensor sizes.
Cross-rank tests build every rank of a layout and check how often each checkpoint element is held.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import pickle

import pytest
import torch

from weightbridge import SourceMap, extract_source_map
from zoo import CASES
from zoo.oracle import (check_params_listed, check_replay, check_unsourced_report,
                        check_well_formed, piece_sources)


@functools.lru_cache(maxsize=None)
def _extract(case: str, scale: int = 1, **rank) -> SourceMap:
    worker = CASES[case](scale=scale, **rank)
    return extract_source_map(worker.params, worker.load_weights, worker.spec)


def _coverage(maps: list[SourceMap], spec) -> dict[str, torch.Tensor]:
    """How many (worker, param element) pairs hold each checkpoint element."""
    cover = {t.name: torch.zeros(t.numel, dtype=torch.int32) for t in spec.tensors}
    for smap in maps:
        for piece in smap.pieces:
            src = piece_sources(piece, spec[piece.region.tensor].shape)
            cover[piece.region.tensor].index_add_(0, src, torch.ones_like(src, dtype=torch.int32))
    return cover


# --------------------------------------------------------------------------------------------
# Every case
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_map_replays_loader_bit_exactly(case):
    check_replay(CASES[case], _extract(case))


@pytest.mark.parametrize("case", CASES)
def test_map_lists_params_and_reports_unsourced_and_unused_exactly(case):
    smap = _extract(case)
    worker = CASES[case]()
    if callable(worker.params):
        worker.load_weights(iter(worker.checkpoint(0).items()))
    live = worker.live()
    check_params_listed(smap, live)
    cover = check_well_formed(smap, worker.spec, live)
    assert check_unsourced_report(smap, cover) == dict(worker.expect.unsourced)
    assert set(smap.unused) == set(worker.expect.unused)
    assert len(smap.unused) == len(set(smap.unused))
    assert pickle.loads(pickle.dumps(smap)) == smap  # it travels to the controller as is


@pytest.mark.parametrize("case", CASES)
def test_map_pieces_are_grouped_by_param_in_offset_order(case):
    smap = _extract(case)
    keys = [(p.param, p.offset) for p in smap.pieces]
    params = [k[0] for k in keys]
    assert len(set(params)) == len(list(itertools.groupby(params))), "a param's pieces are split"
    assert all(a[1] < b[1] for a, b in zip(keys, keys[1:]) if a[0] == b[0])


@pytest.mark.parametrize("case", CASES)
def test_map_size_is_within_the_loaders_copy_count(case):
    smap, expect = _extract(case), CASES[case]().expect
    assert len(smap.pieces) <= expect.max_pieces, smap.summary()


@pytest.mark.parametrize("case", [c for c in CASES if CASES[c]().expect.scale_invariant])
@pytest.mark.slow
def test_map_size_does_not_grow_with_tensor_sizes(case):
    """Same layout, every hidden / intermediate / head size doubled: the same number of pieces.

    Compared at scales 2 and 4: at scale 1 some blocks are only two rows long (rope halves of
    MLA), and where two blocks happen to continue each other in the checkpoint the probe may
    cut them one piece differently; the count must still not grow with the sizes.
    """
    smap, bigger = _extract(case, scale=2), _extract(case, scale=4)
    assert bigger.num_elements > smap.num_elements
    assert len(bigger.pieces) == len(smap.pieces), (smap.summary(), bigger.summary())


def test_oracle_rejects_a_map_with_a_missing_or_shifted_piece():
    """The oracle is not vacuous: small corruptions of a correct map fail it."""
    smap = _extract("vllm_llama_tp2")
    i = next(i for i, p in enumerate(smap.pieces) if p.param.endswith("o_proj.weight"))
    dropped = dataclasses.replace(smap, pieces=smap.pieces[:i] + smap.pieces[i + 1:])
    with pytest.raises(AssertionError, match="the loader wrote an element the map calls unsourced"):
        check_replay(CASES["vllm_llama_tp2"], dropped)
    i, p = next((i, p) for i, p in enumerate(smap.pieces) if p.region.start[0] > 0)
    region = dataclasses.replace(p.region, start=(p.region.start[0] - 1,) + p.region.start[1:])
    shifted = smap.pieces[:i] + (dataclasses.replace(p, region=region),) + smap.pieces[i + 1:]
    with pytest.raises(AssertionError, match="disagree"):
        check_replay(CASES["vllm_llama_tp2"], dataclasses.replace(smap, pieces=shifted))


# --------------------------------------------------------------------------------------------
# Across the ranks of one layout
# --------------------------------------------------------------------------------------------


def _held(case: str, ranks: list[dict]) -> dict[str, torch.Tensor]:
    """Per checkpoint element, how often the given ranks of a case hold it."""
    return _coverage([_extract(case, **r) for r in ranks], CASES[case]().spec)


def _assert_copies(cover: dict[str, torch.Tensor], copies) -> None:
    for name, c in cover.items():
        want = copies(name)
        assert bool((c == want).all()), (
            f"{name}: held {sorted(set(c.tolist()))} times across ranks, expected {want}")


def test_fsdp1_ranks_partition_the_checkpoint():
    cover = _held("fsdp1_flat_params_last_rank", [{}, {"rank": 0}, {"rank": 1}])
    # the case builder's default rank is 2; the two others are given explicitly
    _assert_copies(cover, lambda name: 1)


def test_fsdp1_shard_crosses_tensor_boundaries():
    smap = _extract("fsdp1_flat_params_mid_rank")
    spec = CASES["fsdp1_flat_params_mid_rank"]().spec
    by_param = {}
    for p in smap.pieces:
        by_param.setdefault(p.param, set()).add(p.region.tensor)
    assert max(len(t) for t in by_param.values()) >= 2
    partial = {p.region.tensor for p in smap.pieces} - {
        p.region.tensor for p in smap.pieces if p.region.numel == spec[p.region.tensor].numel}
    assert partial, "some tensor must be split between this rank and a neighbour"


def test_torchtitan_mesh_holds_norms_on_each_tp_rank_and_the_rest_once():
    ranks = [{"dp_rank": d, "tp_rank": t} for d, t in itertools.product(range(2), range(2))]
    cover = _held("torchtitan_fsdp2_tp", ranks)
    _assert_copies(cover, lambda name: 2 if "norm" in name else 1)


def test_vllm_tp4_replicates_each_kv_head_on_two_ranks():
    cover = _held("vllm_qwen3_moe_tp4", [{"rank": r} for r in range(4)])

    def copies(name: str) -> int:
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            return 2  # 2 kv heads over 4 TP ranks
        if "norm" in name or name.endswith("mlp.gate.weight"):
            return 4  # replicated
        return 1  # q / o / expert shards and vocab rows
    _assert_copies(cover, copies)


def test_vllm_expert_parallel_ranks_hold_disjoint_experts_renumbered_from_zero():
    cover = _held("vllm_qwen3_moe_ep2", [{"rank": 0}, {"rank": 1}])
    _assert_copies(cover, lambda name: 2 if "norm" in name or name.endswith("gate.weight") else 1)
    smap = _extract("vllm_qwen3_moe_ep2")  # rank 1: experts 2, 3
    w13 = [p for p in smap.pieces if p.param == "model.layers.0.mlp.experts.w13_weight"]
    first = min(w13, key=lambda p: p.offset)
    assert first.offset == 0
    assert first.region.tensor == "model.layers.0.mlp.experts.2.gate_proj.weight"
    assert {p.region.tensor.split(".")[5] for p in w13} == {"2", "3"}


def test_megatron_pp_and_ep_ranks_renumber_layers_and_experts():
    ranks = [{"pp_rank": p, "ep_rank": e} for p, e in itertools.product(range(2), range(2))]
    cover = _held("megatron_moe_pp2_ep2_legacy", ranks)
    _assert_copies(cover, lambda name: 1 if ".experts." in name else 2)
    smap = _extract("megatron_moe_pp2_ep2_legacy")  # stage 1, EP rank 1
    sources = {p.region.tensor for p in smap.pieces if p.param.startswith("decoder.layers.0.")}
    assert sources and all(s.startswith("model.layers.2.") for s in sources)
    weight1 = [p for p in smap.pieces if p.param == "decoder.layers.0.mlp.experts.weight1"]
    assert {p.region.tensor.split(".")[5] for p in weight1} == {"2", "3"}
    assert all(p.transposed for p in weight1)


# --------------------------------------------------------------------------------------------
# One worker: several destinations, strided and transposed sources, dtypes
# --------------------------------------------------------------------------------------------


def test_tied_embedding_and_repeated_kv_heads_land_in_several_places():
    smap = _extract("unordered_tied_kv_repeat")
    spec = CASES["unordered_tied_kv_repeat"]().spec
    embed = {p.param for p in smap.pieces if p.region.tensor == "model.embed_tokens.weight"}
    assert embed == {"tok_embeddings", "output"}
    cover = _coverage([smap], spec)
    assert bool((cover["model.layers.0.self_attn.k_proj.weight"] == 2).all())  # 4 heads / 2 kv
    assert bool((cover["model.embed_tokens.weight"] == 2).all())


def test_mla_kv_b_proj_feeds_three_params_with_per_head_transposes():
    smap = _extract("vllm_deepseek_mla_tp2")
    kv_b_name = "model.layers.0.self_attn.kv_b_proj.weight"
    kv_b = [p for p in smap.pieces if p.region.tensor == kv_b_name]
    assert {p.param.rsplit(".", 1)[-1] for p in kv_b} >= {"W_UK_T", "W_UV"}
    assert any(p.transposed for p in kv_b if p.param.endswith("W_UV"))
    # De-interleaved rope rows are strided row sets: a few pieces per head (nope block and the
    # two rope halves; which rows pair up into a piece is the probe's choice), never per row.
    q_b = [p for p in smap.pieces if p.param == "model.layers.0.self_attn.q_b_proj.weight"]
    local_heads = 2  # 4 heads over TP2
    assert len(q_b) <= 3 * local_heads, [p.region for p in q_b]


def test_kernel_layouts_are_transposed_and_strided_pieces():
    smap = _extract("kernel_layouts")
    qkv = [p for p in smap.pieces if p.param == "blk.0.wqkv_t"]
    assert qkv and all(p.transposed for p in qkv if p.region.numel > 1)
    # rope halves: at most two pieces per q and k head (strided rows), v one piece
    by_tensor = {}
    for p in qkv:
        by_tensor.setdefault(p.region.tensor.rsplit(".", 2)[-2], []).append(p)
    assert len(by_tensor["q_proj"]) <= 2 * 4 and len(by_tensor["v_proj"]) == 1, by_tensor
    w13 = [p for p in smap.pieces if p.param == "blk.0.w13_interleaved"]
    assert len(w13) == 2 and all(p.strides[0] == 2 * p.region.count[1] for p in w13)


def test_block_cyclic_vocab_rows_are_one_strided_piece():
    smap = _extract("block_cyclic_rows")
    embed = [p for p in smap.pieces if p.param == "model.embed_tokens.weight"]
    assert len(embed) == 1 and embed[0].region.step[0] == 2


def test_mixed_dtype_model_keeps_every_dtype():
    smap = _extract("sglang_qwen3_moe_fp8_mixed")
    assert {p.dtype for p in smap.params} == {"bfloat16", "float16", "float32", "float8_e4m3fn"}
    scales = [p for p in smap.pieces if p.param.endswith("qkv_proj.weight_scale")]
    assert all(p.region.count == () for p in scales) and len(scales) == 2 * 3
