"""Block-scaled FP8 rollouts updated from bf16 trainers, in one process.

The trainers hold (and write) a bf16 checkpoint; each rollout's own ``load_weights`` quantizes
its attention projections and experts into float8_e4m3fn values plus float32
``weight_scale_inv`` block scales (`meshes.fp8_rollout`, vLLM's formula). The probe recognizes
the quantization and its block shape, the plan sends float8 values and float32 scales (the
trainers' pack quantizes whole blocks), and after every update each rollout parameter, scales
included, must equal bit for bit what its own loader produces from the same checkpoint.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from meshes.fp8_rollout import Fp8RolloutShard, per_tensor_quantize
from meshes.qwen3_moe import SIZES, RolloutShard, TrainerShard, checkpoint_spec
from moegroup import replica_plan
from weightbridge import (CpuCopyKernels, LayoutError, extract_source_map,
                          run_plan_locally)
from weightbridge.discovery.replay import replay
from weightbridge.planning.ideal import eq1
from weightbridge.execution.boxcopy import TorchCopyKernels
from weightbridge.quant import block_grid, block_quantize
from weightbridge.types import BoxCopy, scaled_tensor

CONFIG = SIZES["tiny"]
SPEC = checkpoint_spec(CONFIG, "bfloat16")
WIDE_KV = dataclasses.replace(CONFIG, kv_heads=4)
"""The tiny model with 128 k and v rows: fused qkv shards on 128-row block boundaries."""


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _checkpoint(seed: int, spec=SPEC) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {t.name: (torch.randn(t.shape, generator=gen) * 3).bfloat16() for t in spec.tensors}


def _plan(trainers, rollouts, round_bytes, spec=SPEC):
    return replica_plan(trainers, rollouts, round_bytes, spec)


def _update_and_check(plan, trainers, rollouts, kernels, seeds, spec=SPEC) -> None:
    received = [{n: torch.zeros_like(p) for n, p in w.params.items()} for w in rollouts]
    for seed in seeds:  # several versions through the same plan and buffers
        weights = _checkpoint(seed, spec)
        for w in trainers:
            w.load_weights(weights.items())
        run_plan_locally(plan, [w.params for w in trainers], received, kernels=kernels)
        for w, got in zip(rollouts, received):
            w.load_weights(weights.items())  # the rollout's own quantization
            for name, want in w.params.items():
                assert torch.equal(_bits(got[name]), _bits(want)), (seed, name)


@pytest.mark.parametrize("kernels", [TorchCopyKernels(), CpuCopyKernels()],
                         ids=["reference", "cpu"])
def test_pack_quantizes_whole_blocks_of_a_strided_box(kernels):
    """A box of a transposed bf16 view with cut edge blocks: values and scales in one pack."""
    gen = torch.Generator().manual_seed(2)
    base = (torch.randn(200, 300, generator=gen) * 5).bfloat16()
    x = base.t()  # (300, 200), strides (1, 300)
    block = (128, 128)
    rows, cols = 300 - 128, 200  # the box: rows 128.. (two blocks, the second cut), all cols
    grid = block_grid((rows, cols), block)
    copies = [BoxCopy(0, 128 * 1, (rows, cols), (1, 300), 0, "float8_e4m3fn", block),
              BoxCopy(0, 128 * 1, (rows, cols), (1, 300), rows * cols + 4, "float32", block)]
    table = kernels.build_table(copies, [base])
    buf = torch.zeros(table.nbytes, dtype=torch.uint8)
    kernels.pack(table, buf)
    q, s = block_quantize(x[128:], block)
    assert torch.equal(buf[:rows * cols], _bits(q).view(-1))
    assert torch.equal(buf[rows * cols + 4:], _bits(s).view(-1))
    assert s.shape == grid


@pytest.mark.slow
def test_probe_maps_block_quantized_weights_and_their_scales():
    shard = Fp8RolloutShard(CONFIG, 2, 1, 1, 0, block=(32, 32))
    smap = extract_source_map(shard.params, shard.load_weights, SPEC)
    values = [p for p in smap.pieces if p.block and scaled_tensor(p.region.tensor) is None]
    scales = [p for p in smap.pieces if scaled_tensor(p.region.tensor) is not None]
    assert values and {(p.block, p.cast_from) for p in values} == {((32, 32), "bfloat16")}
    assert {p.param for p in values} == {n for n, t in shard.params.items()
                                         if t.dtype == torch.float8_e4m3fn}
    for name in {p.param for p in scales}:  # every scale element has a source
        assert sum(p.region.numel for p in scales if p.param == name) == \
            shard.params[name].numel()
    # The map replays the loader bit for bit, scales included.
    weights = _checkpoint(3)
    shard.load_weights(weights.items())
    replayed = {n: torch.zeros_like(p) for n, p in shard.params.items()}
    replay(smap, replayed, weights)
    for name, want in shard.params.items():
        assert torch.equal(_bits(replayed[name]), _bits(want)), name


@pytest.mark.slow
def test_probe_finds_the_block_shape():
    shard = Fp8RolloutShard(WIDE_KV, 1, 0, 1, 0, block=(128, 128))
    smap = extract_source_map(shard.params, shard.load_weights, checkpoint_spec(WIDE_KV))
    assert {p.block for p in smap.pieces if p.block} == {(128, 128)}


@pytest.mark.slow
def test_probe_refuses_a_quantizer_that_is_not_per_block():
    shard = Fp8RolloutShard(CONFIG, 1, 0, 1, 0, block=(32, 32), quantize=per_tensor_quantize)
    with pytest.raises(LayoutError, match="block scales, but not bit for bit"):
        extract_source_map(shard.params, shard.load_weights, SPEC)


def _dividing(x, block):
    """vLLM's formula but x / scale instead of x * (1 / scale): one float32 rounding apart."""
    q, scale = block_quantize(x, block)
    inverse = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return (x.float() / inverse[:x.shape[0], :x.shape[1]]).to(torch.float8_e4m3fn), scale


def _floored(x, block):
    """vLLM's formula with amax floored at 1e-12 instead of 1e-4."""
    bm, bk = block
    padded = torch.zeros(-(-x.shape[0] // bm) * bm, -(-x.shape[1] // bk) * bk, dtype=x.dtype)
    padded[:x.shape[0], :x.shape[1]] = x
    grid = (padded.shape[0] // bm, padded.shape[1] // bk)
    scale = padded.view(grid[0], bm, grid[1], bk).abs().float().amax(dim=(1, 3)).clamp(1e-12) / 448
    inverse = (1.0 / scale).repeat_interleave(bm, 0).repeat_interleave(bk, 1)
    return (x.float() * inverse[:x.shape[0], :x.shape[1]]).to(torch.float8_e4m3fn), scale


@pytest.mark.parametrize("quantize", [_dividing, _floored], ids=["divides", "floor-1e-12"])
@pytest.mark.slow
def test_probe_refuses_near_misses_of_the_formula(quantize):
    """Formulas that random values almost never tell apart from vLLM's: the verification values
    (telling values, a block under the amax floor) do."""
    shard = Fp8RolloutShard(CONFIG, 1, 0, 1, 0, block=(32, 32), quantize=quantize)
    with pytest.raises(LayoutError, match="block scales, but not bit for bit"):
        extract_source_map(shard.params, shard.load_weights, SPEC)


def test_probe_refuses_float8_weights_without_their_scales():
    shard = Fp8RolloutShard(CONFIG, 1, 0, 1, 0, block=(32, 32))
    params = {n: p for n, p in shard.params.items() if not n.endswith("_scale_inv")}
    with pytest.raises(LayoutError, match="weight_scale_inv"):
        extract_source_map(params, shard.load_weights, SPEC)


@pytest.mark.parametrize("kernels, round_bytes, seeds", [
    (None, 64 << 10, (4, 5, 6)), (CpuCopyKernels(), 64 << 10, (4, 5, 6)),
    (CpuCopyKernels(), 8 << 10, (4,)),
], ids=["reference", "cpu", "cpu-small-rounds"])
@pytest.mark.slow
def test_bf16_trainers_update_fp8_rollouts_bit_exactly(kernels, round_bytes, seeds):
    """TP2 x EP2 trainers, two TP2 engines quantizing in 32 x 32 blocks; small rounds cut the
    value overlaps often (always between whole block rows). Small rounds change where the
    plan cuts, not the values: one seed there (each takes 12 s), three for the values."""
    trainers = [TrainerShard(CONFIG, 2, r % 2, 2, r // 2) for r in range(4)]
    rollouts = [Fp8RolloutShard(CONFIG, 2, r, 1, 0, block=(32, 32))
                for _ in range(2) for r in range(2)]
    plan, _ = _plan(trainers, rollouts, round_bytes)
    kinds = {(o.dtype, o.source_dtype, o.block) for o in plan.correspondence.overlaps}
    assert kinds == {("float8_e4m3fn", "bfloat16", (32, 32)), ("float32", "bfloat16", (32, 32)),
                     ("bfloat16", None, ())}
    _update_and_check(plan, trainers, rollouts, kernels, seeds=seeds)


def test_deepseek_blocks_from_unsharded_attention_trainers():
    """128 x 128 blocks (DeepSeek-V3's): EP2 trainers with whole attention, one-rank engines."""
    spec = checkpoint_spec(WIDE_KV)
    trainers = [TrainerShard(WIDE_KV, 1, 0, 2, r) for r in range(2)]
    rollouts = [Fp8RolloutShard(WIDE_KV, 1, 0, 1, 0) for _ in range(2)]
    plan, _ = _plan(trainers, rollouts, 64 << 10, spec)
    assert {o.block for o in plan.correspondence.overlaps} == {(128, 128), ()}
    _update_and_check(plan, trainers, rollouts, CpuCopyKernels(), seeds=(7, 8), spec=spec)


def test_edge_blocks_cut_by_the_tensor_end():
    """96-column down_proj experts in 64 x 64 blocks: the last block column is 32 wide. The
    probe infers 64 from the 2 x 2 scale grids, and trainers holding whole experts quantize the
    cut blocks as the rollouts' loaders do."""
    config = dataclasses.replace(CONFIG, moe_intermediate=96)
    spec = checkpoint_spec(config)
    trainers = [TrainerShard(config, 1, 0, 2, r) for r in range(2)]
    rollouts = [Fp8RolloutShard(config, 1, 0, 1, 0, block=(64, 64),
                                quantized=("mlp.experts.w2_weight",)) for _ in range(2)]
    plan, (smap, *_) = _plan(trainers, rollouts, 64 << 10, spec)
    assert {p.block for p in smap.pieces if p.block} == {(64, 64)}
    scales = [o for o in plan.correspondence.overlaps if o.dtype == "float32"]
    assert scales and {o.region.count for o in scales} == {(2, 2)}
    _update_and_check(plan, trainers, rollouts, CpuCopyKernels(), seeds=(11, 12), spec=spec)


@pytest.mark.slow
def test_fp8_plan_moves_fewer_bytes_than_sending_bf16():
    """The same layout with bf16 rollouts needs 2 bytes per element; the fp8 plan 1 byte per
    quantized element plus 4 per block, so fewer bytes and no more rounds."""
    trainers = [TrainerShard(CONFIG, 2, r % 2, 2, r // 2) for r in range(4)]
    fp8, _ = _plan(trainers, [Fp8RolloutShard(CONFIG, 2, r, 1, 0, block=(32, 32))
                              for _ in range(2) for r in range(2)], 64 << 10)
    bf16, _ = _plan(trainers, [RolloutShard(CONFIG, 2, r, 1, 0)
                               for _ in range(2) for r in range(2)], 64 << 10)
    overlaps = fp8.correspondence.overlaps
    quantized = sum(o.region.numel for o in overlaps if o.dtype == "float8_e4m3fn")
    num_scales = sum(o.region.numel for o in overlaps if o.dtype == "float32")
    assert num_scales == sum(math.prod(block_grid(o.region.count, o.block)) for o in overlaps
                             if o.dtype == "float8_e4m3fn")  # one scale per block
    assert bf16.correspondence.nbytes - fp8.correspondence.nbytes == quantized - 4 * num_scales
    assert fp8.correspondence.nbytes < bf16.correspondence.nbytes
    assert fp8.num_rounds <= bf16.num_rounds
    rates = dict(trainer_node_bandwidth=1e9, rollout_node_bandwidth=1e9)  # Eq. (1) in bytes sent
    assert eq1(fp8, **rates) / eq1(bf16, **rates) == pytest.approx(
        fp8.correspondence.nbytes / bf16.correspondence.nbytes)


def test_trainer_shards_that_cut_blocks_are_refused_before_planning():
    """TP2 trainers split q_proj's 128 rows in two; 128 x 128 blocks cannot be quantized by
    one trainer (the bf16 fallback is not implemented): a LayoutError at plan time."""
    trainers = [TrainerShard(WIDE_KV, 2, r % 2, 2, r // 2) for r in range(4)]
    rollouts = [Fp8RolloutShard(WIDE_KV, 1, 0, 1, 0) for _ in range(2)]
    with pytest.raises(LayoutError, match=r"no single trainer holds some of their blocks whole: "
                                          r"'model\.layers\.0\.self_attn\.q_proj\.weight'"):
        _plan(trainers, rollouts, 64 << 10, checkpoint_spec(WIDE_KV))


def test_blocks_go_to_the_trainers_that_hold_them_whole():
    """TP2 trainers cut the 128 x 128 attention blocks, two more trainers hold attention
    unsharded: the plan quantizes every attention block on those two only, bit-exactly."""
    spec = checkpoint_spec(WIDE_KV)
    trainers = ([TrainerShard(WIDE_KV, 2, r % 2, 2, r // 2) for r in range(4)]
                + [TrainerShard(WIDE_KV, 1, 0, 2, r) for r in range(2)])
    rollouts = [Fp8RolloutShard(WIDE_KV, 1, 0, 1, 0) for _ in range(2)]
    plan, _ = _plan(trainers, rollouts, 64 << 10, spec)
    attention = [o for o in plan.correspondence.overlaps if ".self_attn." in o.region.tensor
                 and o.block]
    assert attention and all(set(o.holders) <= {4, 5} for o in attention)
    _update_and_check(plan, trainers, rollouts, CpuCopyKernels(), seeds=(9, 10), spec=spec)


# --------------------------------------------------------------------------------------------
# Refusals on hand-made maps and boxes (no probe)
# --------------------------------------------------------------------------------------------


def _maps(trainer_dtype="bfloat16", ckpt="bfloat16", blocks=((32, 32),), plain_rollout=False):
    """A (64, 64) checkpoint tensor "w": one trainer holding it, one rollout per block shape
    holding it quantized (and one loading it unquantized with ``plain_rollout``)."""
    from weightbridge.types import ParamSpec, Piece, Region, SourceMap, scale_tensor
    reg = Region("w", (0, 0), (64, 64), (1, 1))
    cast = None if trainer_dtype == ckpt else ckpt
    trainer = SourceMap((ParamSpec("w", (64, 64), trainer_dtype),),
                        (Piece(reg, "w", 0, (64, 1), cast_from=cast),))
    rollouts = []
    for b in blocks:
        grid = (64 // b[0], 64 // b[1])
        rollouts.append(SourceMap(
            (ParamSpec("w", (64, 64), "float8_e4m3fn"), ParamSpec("w_scale_inv", grid, "float32")),
            (Piece(reg, "w", 0, (64, 1), cast_from=ckpt, block=b),
             Piece(Region(scale_tensor("w"), (0, 0), grid, (1, 1)), "w_scale_inv", 0,
                   (grid[1], 1), block=b))))
    if plain_rollout:
        rollouts.append(SourceMap((ParamSpec("w", (64, 64), "bfloat16"),),
                                  (Piece(reg, "w", 0, (64, 1)),)))
    return [trainer], rollouts


@pytest.mark.parametrize("kwargs, message", [
    (dict(blocks=((32, 32), (64, 64))), r"quantize checkpoint tensor 'w' in blocks \(32, 32\) "
                                        r"and \(64, 64\)"),
    (dict(plain_rollout=True), r"'w' into both"),
    (dict(trainer_dtype="bfloat16", ckpt="float32"), r"trainers hold it as bfloat16 \(from a "
                                                     r"float32 checkpoint\)"),
], ids=["two-block-shapes", "quantized-and-plain", "rounded-trainer"])
def test_correspond_refuses_what_no_pack_can_quantize(kwargs, message):
    from weightbridge.discovery.correspond import correspond
    trainers, rollouts = _maps(**kwargs)
    with pytest.raises(LayoutError, match=message):
        correspond(trainers, rollouts)


@pytest.mark.parametrize("copy, message", [
    (BoxCopy(0, 0, (4, 4, 4), (16, 4, 1), 0, "float8_e4m3fn", (2, 2)), "2-d boxes"),
    (BoxCopy(0, 15, (4, 4), (-4, 1), 0, "float8_e4m3fn", (2, 2)), "negative stride"),
    (BoxCopy(0, 0, (4, 4), (4, 1), 0, "bfloat16", (2, 2)), "into float8_e4m3fn values"),
    (BoxCopy(0, 0, (4, 4), (4, 1), 2, "float32", (2, 2)), "align it to 4 bytes"),
], ids=["3-d", "negative-stride", "buffer-dtype", "unaligned-scales"])
@pytest.mark.parametrize("kernels", [TorchCopyKernels(), CpuCopyKernels()],
                         ids=["reference", "cpu"])
def test_bad_block_boxes_are_refused_when_the_table_is_built(kernels, copy, message):
    with pytest.raises(ValueError, match=message):
        kernels.build_table([copy], [torch.zeros(64, dtype=torch.bfloat16)])
