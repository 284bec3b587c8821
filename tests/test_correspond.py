"""correspond: a partition of the needed elements, each part naming its holders and needers."""

import dataclasses

import numpy as np
import pytest
import torch

from planning_layouts import SHAPES, Builder, fsdp_trainer, fused_rollout, tp_trainer
from weightbridge import LayoutError, SourceMap, correspond
from weightbridge.types import ParamSpec, Piece, Region


def _elements(region: Region) -> set[tuple[int, ...]]:
    axes = [range(s, s + k * c, k) for s, c, k in zip(region.start, region.count, region.step)]
    return {tuple(i) for i in np.array(np.meshgrid(*axes, indexing="ij")).reshape(
        len(axes), -1).T} if axes else {()}


def _covered(maps) -> dict[str, dict[tuple, set[int]]]:
    out: dict[str, dict[tuple, set[int]]] = {}
    for w, m in enumerate(maps):
        for p in m.pieces:
            for e in _elements(p.region):
                out.setdefault(p.region.tensor, {}).setdefault(e, set()).add(w)
    return out


@pytest.mark.parametrize("trainers,rollouts", [
    ([tp_trainer(r, 2) for r in range(2)] * 2, [fused_rollout(r, 3, ep=1) for r in range(3)]),
    ([fsdp_trainer(r, 5) for r in range(5)], [fused_rollout(r, 4, ep=4) for r in range(4)]),
    ([tp_trainer(r, 4) for r in range(4)], [fused_rollout(r, 2, ep=2) for r in range(2)] * 2),
])
def test_overlaps_partition_needed_elements_with_exact_holders_and_needers(trainers, rollouts):
    corr = correspond(trainers, rollouts)
    held, needed = _covered(trainers), _covered(rollouts)
    seen = set()
    for o in corr.overlaps:
        for e in _elements(o.region):
            key = (o.region.tensor, e)
            assert key not in seen  # no element in two overlaps
            seen.add(key)
            assert set(o.holders) == held[o.region.tensor][e]
            assert set(o.needers) == needed[o.region.tensor][e]
        assert o.dtype == SHAPES[o.region.tensor][1]
    assert seen == {(t, e) for t, es in needed.items() for e in es}
    assert corr.nbytes == sum(o.nbytes for o in corr.overlaps)


def _single(region, dtype="float32", shape=None):
    shape = shape or region.count
    return SourceMap((ParamSpec("p", shape, dtype),),
                     (Piece(region, "p", 0, tuple(_strides(region.count))),))


def _strides(count):
    out, acc = [], 1
    for c in reversed(count):
        out.append(acc)
        acc *= c
    return reversed(out)


def test_strided_regions_are_refined_exactly():
    # Trainers hold even / odd rows (a rotary-style interleave); the rollout needs rows 1..6.
    even = _single(Region("w", (0, 0), (4, 3), (2, 1)))
    odd = _single(Region("w", (1, 0), (4, 3), (2, 1)))
    want = _single(Region("w", (1, 0), (6, 3), (1, 1)))
    corr = correspond([even, odd], [want])
    rows = {}
    for o in corr.overlaps:
        for e in _elements(o.region):
            rows[e] = o.holders
    assert {e[0] for e in rows} == set(range(1, 7))
    assert all(rows[e] == ((0,) if e[0] % 2 == 0 else (1,)) for e in rows)


def test_partially_overlapping_trainer_regions_send_each_element_once():
    a = _single(Region("w", (0,), (6,), (1,)))
    b = _single(Region("w", (4,), (6,), (1,)))
    corr = correspond([a, b], [_single(Region("w", (0,), (10,), (1,)))])
    assert sum(o.region.numel for o in corr.overlaps) == 10
    assert {o.holders for o in corr.overlaps} == {(0,), (0, 1), (1,)}


def test_missing_elements_name_tensor_and_count():
    trainer = _single(Region("w", (0, 0), (2, 4), (1, 1)))
    rollout = _single(Region("w", (0, 0), (3, 4), (1, 1)))
    with pytest.raises(LayoutError, match=r"4 checkpoint elements.*'w' \(4 elements\)"):
        correspond([trainer], [rollout])


def test_dtype_mismatch_between_sides_without_a_cast_is_a_layout_error():
    """Neither map records a cast: they describe checkpoints of different dtypes."""
    r = Region("w", (0,), (4,), (1,))
    with pytest.raises(LayoutError, match="dtype.*different checkpoint specs"):
        correspond([_single(r, "float32")], [_single(r, "bfloat16")])


def _cast(smap: SourceMap, source: str) -> SourceMap:
    """The map with every piece recording a cast from ``source`` (what the probe records)."""
    return SourceMap(smap.params, tuple(dataclasses.replace(p, cast_from=source)
                                        for p in smap.pieces))


@pytest.mark.parametrize("trainer, rollout, wire, source, target", [
    # fp32 trainer, bf16 rollout casting the fp32 checkpoint: the trainers' pack converts
    (("float32", None), ("bfloat16", "float32"), "bfloat16", "float32", None),
    (("float32", None), ("float16", "float32"), "float16", "float32", None),
    # equal widths convert on the trainers
    (("bfloat16", None), ("float16", "bfloat16"), "float16", "bfloat16", None),
    # a widening rollout cast: bf16 on the wire, the rollouts' assemble widens
    (("bfloat16", None), ("float32", "bfloat16"), "bfloat16", None, "float32"),
    # trainers widened the bf16 checkpoint exactly (fp32 master copy): still bf16 on the wire
    (("float32", "bfloat16"), ("bfloat16", None), "bfloat16", "float32", None),
    # both sides cast the same way: plain bytes
    (("bfloat16", "float32"), ("bfloat16", "float32"), "bfloat16", None, None),
])
def test_casts_become_wire_conversions_in_the_narrower_dtype(trainer, rollout, wire, source,
                                                             target):
    r = Region("w", (0,), (6,), (1,))
    t_map, r_map = _single(r, trainer[0]), _single(r, rollout[0])
    t_map = _cast(t_map, trainer[1]) if trainer[1] else t_map
    r_map = _cast(r_map, rollout[1]) if rollout[1] else r_map
    (o,) = correspond([t_map], [r_map]).overlaps
    assert (o.dtype, o.source_dtype, o.target_dtype) == (wire, source, target)
    assert o.nbytes == 6 * torch.empty(0, dtype=getattr(torch, wire)).element_size()


def test_same_parameter_dtype_from_different_checkpoint_dtypes_is_refused():
    """bf16 on both sides, but one side casts it from an fp32 checkpoint: two specs."""
    r = Region("w", (0,), (4,), (1,))
    with pytest.raises(LayoutError, match="bfloat16 cast from float32.*different checkpoint"):
        correspond([_single(r, "bfloat16")], [_cast(_single(r, "bfloat16"), "float32")])


def test_trainer_holding_a_rounded_cast_is_refused():
    """bf16 trainer params cast from fp32 cannot give the fp32 values an fp32 rollout loads."""
    r = Region("w", (0,), (4,), (1,))
    with pytest.raises(LayoutError, match="rounded cast.*'w'"):
        correspond([_cast(_single(r, "bfloat16"), "float32")], [_single(r, "float32")])


def test_conversion_the_kernels_do_not_implement_is_refused():
    r = Region("w", (0,), (4,), (1,))
    with pytest.raises(LayoutError, match="convert only between.*'w'.*float8_e4m3fn"):
        correspond([_single(r, "bfloat16")], [_cast(_single(r, "float8_e4m3fn"), "bfloat16")])


def test_empty_sides_are_rejected():
    with pytest.raises(ValueError, match="at least one trainer"):
        correspond([], [_single(Region("w", (0,), (4,), (1,)))])


def test_piece_into_unlisted_param_is_a_layout_error():
    b = Builder()
    b.piece(Region("w", (0,), (4,), (1,)), "ghost", 0, (1,))
    with pytest.raises(LayoutError, match="ghost"):
        correspond([b.build()], [_single(Region("w", (0,), (4,), (1,)))])


# --------------------------------------------------------------------------------------------
# Rollout parameters that take nothing from the checkpoint (issue 14)
# --------------------------------------------------------------------------------------------


def _with_param(smap: SourceMap, name: str, shape=(3, 4), dtype="float32") -> SourceMap:
    return SourceMap(smap.params + (ParamSpec(name, shape, dtype),), smap.pieces)


W = Region("w", (0,), (4,), (1,))


def test_rollout_parameter_no_element_lands_in_is_refused_naming_it():
    """Its tensor is missing from the checkpoint spec: no piece, so no transfer updates it."""
    rollout = _with_param(_single(W), "model.norm.weight", (8,), "bfloat16")
    with pytest.raises(LayoutError) as err:
        correspond([_single(W)], [rollout, rollout])
    message = str(err.value)
    assert "'model.norm.weight' ((8,) bfloat16, workers 0, 1)" in message, message
    assert "no transfer would ever update it" in message, message
    assert "load_weights fills" in message and "add the checkpoint tensors" in message, message


def test_rollout_parameter_sourced_on_another_rollout_worker_is_accepted():
    """A TP shard of a padded vocabulary can lie wholly in the padding on the last rank: that
    rank's map has no piece for it, the other rank's has."""
    vocab = Region("embed", (0, 0), (6, 4), (1, 1))
    real_rows = _single(vocab)
    padding_only = SourceMap(real_rows.params, ())
    corr = correspond([_single(vocab)], [real_rows, padding_only])
    assert corr.nbytes == 6 * 4 * 4


def test_partly_sourced_rollout_parameter_is_accepted():
    """A vocabulary padded from 120 to 128 rows: rows 120..127 take no checkpoint element."""
    vocab = Region("embed", (0, 0), (120, 4), (1, 1))
    rollout = SourceMap((ParamSpec("embed", (128, 4), "bfloat16"),),
                        (Piece(vocab, "embed", 0, (4, 1)),))
    corr = correspond([_single(vocab, "bfloat16")], [rollout])
    assert sum(o.region.numel for o in corr.overlaps) == 120 * 4


def test_trainer_parameters_and_empty_rollout_parameters_need_no_source():
    """Trainers may hold parameters no rollout needs; a zero-element parameter has nothing to
    update."""
    trainer = _with_param(_single(W), "optimizer_side")
    rollout = _with_param(_single(W), "empty", (0, 4))
    assert correspond([trainer], [rollout]).nbytes == 16


def test_a_probed_rollout_whose_tensor_is_missing_from_the_spec_is_refused_by_correspond():
    """End to end: the spec lacks model.norm.weight, so the probe finds nothing for the
    rollout's norm, and correspond (hence connect) refuses before any byte moves."""
    from meshes.qwen3_moe import SIZES, RolloutShard, TrainerShard, checkpoint_spec
    from weightbridge import CheckpointSpec, extract_source_map

    config = SIZES["tiny"]
    full = checkpoint_spec(config)
    spec = CheckpointSpec(tuple(t for t in full.tensors if t.name != "model.norm.weight"))
    trainer = TrainerShard(config, 1, 0, 1, 0)
    rollout = RolloutShard(config, 1, 0, 1, 0)
    tmap = extract_source_map(trainer.params, trainer.load_weights, spec)
    rmap = extract_source_map(rollout.params, rollout.load_weights, spec)
    assert "model.norm.weight" not in {p.param for p in rmap.pieces}
    with pytest.raises(LayoutError, match=r"'model\.norm\.weight' \(\(128,\) bfloat16, worker 0\)"):
        correspond([tmap], [rmap])
