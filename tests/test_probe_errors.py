"""Loaders the probe must refuse, errors it must pass through, and what is not an error.

Value-changing loaders (scaling, rounding / quantizing, casting that does not round to nearest
even, casting and scaling) get a `LayoutError` that names the parameter (and, where one element is
bad, its index). Exceptions
from the loader itself propagate unchanged, whichever probe pass raises them. Checkpoint names a
loader never reads are reported on ``SourceMap.unused``.
"""

from __future__ import annotations

import re

import pytest
import torch

from weightbridge import CheckpointSpec, LayoutError, TensorSpec, extract_source_map
from weightbridge.discovery.replay import replay


def _spec(w_dtype: str = "bfloat16", extra: tuple[TensorSpec, ...] = ()) -> CheckpointSpec:
    """An (8, 6) weight of ``w_dtype`` and a bf16 norm, plus ``extra`` tensors."""
    return CheckpointSpec((TensorSpec("layers.0.mlp.w", (8, 6), w_dtype),
                           TensorSpec("layers.0.norm", (6,), "bfloat16")) + extra)


# checkpoint name -> param name; params are named apart so a message naming the param is not
# satisfied by the checkpoint tensor's name
RENAME = {"layers.0.mlp.w": "blk0.w13", "layers.0.norm": "blk0.norm"}


def _copy_loader(params: dict[str, torch.Tensor], fix=lambda name, w: w):
    """vLLM-style loader: copy each checkpoint tensor into the param it is renamed to."""

    @torch.no_grad()
    def load_weights(weights) -> None:
        for name, w in weights:
            if name in RENAME:
                params[RENAME[name]].copy_(fix(name, w))
    return load_weights


SPEC = _spec()


def _params(dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    return {"blk0.w13": torch.zeros(8, 6, dtype=dtype),
            "blk0.norm": torch.zeros(6, dtype=torch.bfloat16)}


# --------------------------------------------------------------------------------------------
# Value-changing loaders
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("factor", [2.0, -1.0, 0.5])
def test_scaling_loader_is_refused_naming_the_param(factor):
    params = _params()
    fix = lambda name, w: w * factor if name.endswith("mlp.w") else w  # noqa: E731
    with pytest.raises(LayoutError, match=r"'blk0\.w13'"):
        extract_source_map(params, _copy_loader(params, fix), SPEC)


def test_loader_changing_one_element_is_refused_at_that_index():
    params = _params()

    def fix(name, w):
        if name.endswith("mlp.w"):
            w = w.clone()
            w[3, 5] = w[3, 5] * 2 + 1
        return w
    with pytest.raises(LayoutError, match=r"'blk0\.w13'.*\(3, 5\)"):
        extract_source_map(params, _copy_loader(params, fix), SPEC)


@pytest.mark.parametrize("ckpt_dtype, param_dtype", [
    ("bfloat16", torch.float32), ("float32", torch.bfloat16), ("float16", torch.bfloat16),
    ("bfloat16", torch.float16), ("float32", torch.float16), ("float8_e4m3fn", torch.bfloat16),
])
def test_casting_loader_is_mapped_with_the_cast_on_its_pieces(ckpt_dtype, param_dtype):
    """``copy_`` between float dtypes (refused until casts were planned) is a mapped cast: the
    pieces record the checkpoint dtype, and the map replays the loader bit for bit."""
    spec = _spec(ckpt_dtype)
    params = _params(dtype=param_dtype)
    load = _copy_loader(params)
    smap = extract_source_map(params, load, spec)
    casts = {p.param: p.cast_from for p in smap.pieces}
    assert casts == {"blk0.w13": ckpt_dtype, "blk0.norm": None}
    gen = torch.Generator().manual_seed(3)
    checkpoint = {t.name: (torch.randn(t.shape, generator=gen) * 4).to(getattr(torch, t.dtype))
                  for t in spec.tensors}
    load(checkpoint.items())
    want = {n: p.clone() for n, p in params.items()}
    got = {n: torch.full_like(p, 7) for n, p in params.items()}
    replay(smap, got, checkpoint)
    for name in want:
        assert torch.equal(got[name].view(torch.uint8), want[name].view(torch.uint8)), name


def _bits_loader(params, to_bf16):
    """Loads the fp32 weight into the bf16 param through ``to_bf16`` (fp32 bits -> bf16 bits)."""
    @torch.no_grad()
    def load_weights(weights) -> None:
        for name, w in weights:
            if name == "layers.0.mlp.w":
                params["blk0.w13"].view(torch.int16).copy_(to_bf16(w.contiguous().view(torch.int32)))
            elif name in RENAME:
                params[RENAME[name]].copy_(w)
    return load_weights


@pytest.mark.parametrize("to_bf16", [
    pytest.param(lambda u: (u >> 16).to(torch.int16), id="truncate"),
    pytest.param(lambda u: ((u + 0x8000) >> 16).to(torch.int16), id="ties-away"),
    pytest.param(lambda u: torch.where((u & 0x7F800000) == 0, u & -0x80000000,
                                       u + 0x7FFF + ((u >> 16) & 1)).__rshift__(16)
                 .to(torch.int16), id="flush-subnormals"),
])
def test_cast_rounding_other_than_nearest_even_is_refused_naming_both_dtypes(to_bf16):
    """The verification pass salts fp32 values with bf16 ties and subnormals: a loader that
    rounds another way than ``copy_`` is refused with the cast message."""
    params = _params()
    with pytest.raises(LayoutError) as err:
        extract_source_map(params, _bits_loader(params, to_bf16), _spec("float32"))
    message = str(err.value)
    for needle in ("'blk0.w13'", "'layers.0.mlp.w'", "float32", "bfloat16", "nearest-even"):
        assert needle in message, message


def test_nearest_even_by_bits_is_mapped_as_the_cast():
    """The same bit loader with torch's rounding (bias 0x7FFF plus the kept lowest bit) is the
    cast: the refusals above are about rounding, not about how the loader computes it."""
    params = _params()
    nearest_even = lambda u: ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).to(torch.int16)  # noqa: E731
    smap = extract_source_map(params, _bits_loader(params, nearest_even), _spec("float32"))
    assert {p.cast_from for p in smap.pieces} == {"float32", None}


@pytest.mark.parametrize("ckpt_dtype, param_dtype", [
    ("bfloat16", torch.float32), ("float16", torch.bfloat16), ("float32", torch.bfloat16),
])
def test_cast_with_scaling_is_refused_naming_tensor_param_and_both_dtypes(ckpt_dtype, param_dtype):
    """A cast that also scales is its own clear error, not the generic 'values changed' one."""
    spec = _spec(ckpt_dtype)
    params = _params(dtype=param_dtype)
    fix = lambda name, w: w * 2 if name.endswith("mlp.w") else w  # noqa: E731
    with pytest.raises(LayoutError) as err:
        extract_source_map(params, _copy_loader(params, fix), spec)
    message = str(err.value)
    param_dtype_name = str(param_dtype).removeprefix("torch.")
    for needle in ("'blk0.w13'", "'layers.0.mlp.w'"):
        assert needle in message, message
    for dtype in (ckpt_dtype, param_dtype_name):
        assert re.search(rf"(?<![a-z]){dtype}\b", message), f"{dtype!r} not named: {message}"


def test_block_scaled_fp8_loader_of_another_formula_is_refused_naming_the_formula():
    """DeepSeek-V3 style: 128 x 128 blocks of a bf16 weight quantized to float8_e4m3fn with a
    per-block scale (amax / 448) in weight_scale_inv, but dividing by the scale (and flooring
    amax at 1e-12) instead of vLLM's multiply by its reciprocal (floor 1e-4): the verification
    pass's telling values catch the difference, which random values almost never show."""
    spec = CheckpointSpec((TensorSpec("layers.0.mlp.w", (256, 256), "bfloat16"),))
    params = {"blk0.w": torch.zeros(256, 256, dtype=torch.float8_e4m3fn),
              "blk0.w_scale_inv": torch.zeros(2, 2)}

    @torch.no_grad()
    def load_weights(weights) -> None:
        for _, w in weights:
            blocks = w.float().view(2, 128, 2, 128)
            scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
            q = (blocks / scale[:, None, :, None]).view(256, 256)
            params["blk0.w"].copy_(q.to(torch.float8_e4m3fn))
            params["blk0.w_scale_inv"].copy_(scale)
    with pytest.raises(LayoutError, match=r"'blk0\.w'.*float8_e4m3fn with block scales, but "
                                          r"not bit for bit.*per_block_cast_to_fp8"):
        extract_source_map(params, load_weights, spec)


@pytest.mark.parametrize("quantize", [
    pytest.param(lambda w: w.to(torch.float8_e4m3fn).to(w.dtype), id="fp8-roundtrip"),
    pytest.param(lambda w: w.round(), id="round"),
    pytest.param(lambda w: w.float().to(torch.float16).to(w.dtype), id="fp16-roundtrip"),
])
def test_quantizing_loader_is_refused_naming_the_param(quantize):
    params = _params()
    fix = lambda name, w: quantize(w) if name.endswith("mlp.w") else w  # noqa: E731
    with pytest.raises(LayoutError, match=r"'blk0\.w13'"):
        extract_source_map(params, _copy_loader(params, fix), SPEC)


# --------------------------------------------------------------------------------------------
# Exceptions from the loader, and what is not an error
# --------------------------------------------------------------------------------------------


class LoaderFailure(RuntimeError):
    pass


def test_loader_exception_propagates_from_every_pass():
    """Probe passes and the verification load alike: the loader's own exception comes out."""
    params, calls = _params(), []
    copy = _copy_loader(params)

    def counting(weights):
        calls.append(1)
        copy(weights)
    extract_source_map(params, counting, SPEC)
    num_calls = len(calls)
    assert num_calls >= 2  # at least one probe pass and the verification load
    for fail_on_call in range(1, num_calls + 1):
        calls.clear()

        def load_weights(weights):
            calls.append(1)
            if len(calls) == fail_on_call:
                raise LoaderFailure(f"rank 3 lost its communicator on call {fail_on_call}")
            copy(weights)
        with pytest.raises(LoaderFailure, match=f"on call {fail_on_call}"):
            extract_source_map(params, load_weights, SPEC)


def test_loader_key_error_for_an_unknown_name_propagates():
    params = {"blk0.w13": torch.zeros(8, 6, dtype=torch.bfloat16)}

    def load_weights(weights):
        for name, w in weights:
            params[RENAME[name]].copy_(w)  # KeyError: no param for blk0.norm
    with pytest.raises(KeyError, match="blk0.norm"):
        extract_source_map(params, load_weights, SPEC)


def test_checkpoint_names_the_loader_never_reads_are_reported_not_raised():
    spec = _spec(extra=(TensorSpec("layers.0.rotary_emb.inv_freq", (3,), "float32"),
                        TensorSpec("mtp.w", (4, 4), "bfloat16")))
    params = _params()
    smap = extract_source_map(params, _copy_loader(params), spec)
    assert set(smap.unused) == {"layers.0.rotary_emb.inv_freq", "mtp.w"}
    assert {p.region.tensor for p in smap.pieces} == {"layers.0.mlp.w", "layers.0.norm"}


def test_loader_that_reads_nothing_leaves_everything_unsourced():
    params = _params()
    smap = extract_source_map(params, lambda weights: None, SPEC)
    assert smap.pieces == ()
    assert dict(smap.unsourced) == {"blk0.w13": 48, "blk0.norm": 6}
    assert set(smap.unused) == {"layers.0.mlp.w", "layers.0.norm"}


def test_a_transposed_view_parameter_is_mapped_and_written_in_memory_order():
    """Engines keep derived weights as transposed views (vLLM's MLA W_UV): the probe maps them
    in memory order, and replay and the executor write the same memory in place."""
    from weightbridge import CheckpointSpec, TensorSpec, extract_source_map
    from weightbridge.discovery.replay import replay

    spec = CheckpointSpec((TensorSpec("w", (3, 5), "bfloat16"),))
    storage = torch.zeros(3, 5, dtype=torch.bfloat16)
    params = {"w_t": storage.t()}  # (5, 3), strides (1, 5): not contiguous

    def load_weights(weights):
        for _, t in weights:
            params["w_t"].copy_(t.t())

    smap = extract_source_map(params, load_weights, spec)
    assert smap.params[0].shape == (3, 5)  # memory order: the storage's own shape
    ckpt = {"w": torch.randn(3, 5).bfloat16()}
    expected = ckpt["w"].t().contiguous()
    storage.zero_()
    replay(smap, params, ckpt)
    assert torch.equal(params["w_t"].contiguous().view(torch.uint8), expected.view(torch.uint8))
    assert storage.data_ptr() == params["w_t"].data_ptr()


def test_views_into_another_parameter_are_left_out_of_the_map():
    """vLLM's MLA W_UK_T / W_UV are views into kv_b_proj.weight: writing the owner writes them,
    so the map covers the owner only and every byte is transferred once."""
    from weightbridge import CheckpointSpec, TensorSpec, extract_source_map

    spec = CheckpointSpec((TensorSpec("kv_b", (8, 4), "bfloat16"),))
    kv_b = torch.zeros(8, 4, dtype=torch.bfloat16)
    params = {"kv_b": kv_b, "w_uv": kv_b.view(2, 4, 4)[:, 2:].transpose(1, 2),
              "w_uk_t": kv_b.view(2, 4, 4)[:, :2]}

    def load_weights(weights):
        for _, t in weights:
            kv_b.copy_(t)

    smap = extract_source_map(params, load_weights, spec)
    assert [p.name for p in smap.params] == ["kv_b"]
    assert sum(p.region.numel for p in smap.pieces) == 32


# --------------------------------------------------------------------------------------------
# Adversarial cases (issue 14)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", [
    pytest.param(CheckpointSpec(()), id="no-tensors"),
    pytest.param(CheckpointSpec((TensorSpec("w", (0, 6), "bfloat16"),)), id="zero-elements"),
])
def test_empty_checkpoint_spec_is_a_value_error_before_any_load(spec):
    """An empty spec gives the probe no element to offer: every parameter would come out
    unsourced and never be updated. Refused up front, saying how to build a spec."""
    params, calls = _params(), []
    with pytest.raises(ValueError, match=r"checkpoint spec has .*read_checkpoint_spec") as err:
        extract_source_map(params, lambda weights: calls.append(1), spec)
    assert not isinstance(err.value, LayoutError)
    assert calls == []  # before any probe load


def _moe_shard_scaling(tensor: str, factor: float):
    """The tiny Qwen3-MoE rollout shard (TP2 x EP2 rank 0) with a loader that scales one
    checkpoint tensor; params renamed so the message must name the tensor, not the param."""
    from meshes.qwen3_moe import SIZES, RolloutShard, checkpoint_spec

    config = SIZES["tiny"]
    shard = RolloutShard(config, 2, 0, 2, 0)
    params = {f"rollout/{n}": p for n, p in shard.params.items()}

    def load_weights(weights):
        shard.load_weights((n, w * factor if n == tensor else w) for n, w in weights)
    return params, load_weights, checkpoint_spec(config)


@pytest.mark.parametrize("factor", [2.0, 0.5, 4.0, 3.0, -1.0])
def test_scaling_loader_error_names_the_scaled_tensor_in_a_moe_model(factor):
    """Doubling a bf16 value adds 128 to its bits, so every probe digit and the recombined index
    shift by 128: the scaled norm decodes as a copy of another tensor (lm_head, or an expert's
    down_proj for 0.5), and the error used to name that tensor."""
    params, load_weights, spec = _moe_shard_scaling("model.norm.weight", factor)
    with pytest.raises(LayoutError) as err:
        extract_source_map(params, load_weights, spec)
    message = str(err.value)
    assert "parameter 'rollout/model.norm.weight'" in message, message
    assert "checkpoint tensor 'model.norm.weight'" in message, message
    others = [t.name for t in spec.tensors if t.name != "model.norm.weight"
              and f"'{t.name}'" in message]
    assert others == [], message
    assert "changes values" in message, message


@pytest.mark.parametrize("factor", [2.0, 0.5, -3.0])
def test_diagnosis_names_the_source_of_a_scaled_element(factor):
    from weightbridge.discovery.diagnose import source_tensor

    params, load_weights, spec = _moe_shard_scaling("model.layers.1.mlp.experts.2.up_proj.weight",
                                                    factor)
    w13 = "rollout/model.layers.1.mlp.experts.w13_weight"
    inter = params[w13].shape[1] // 2
    element = (2 * 2 * inter + inter + 5) * params[w13].shape[2] + 7  # expert 2, up half, row 5
    got = source_tensor(lambda: params, load_weights, spec, w13, element)
    assert got == "model.layers.1.mlp.experts.2.up_proj.weight"


def test_diagnosis_names_no_tensor_when_the_loader_adds_a_constant():
    from weightbridge.discovery.diagnose import source_tensor

    params = _params()
    load_weights = _copy_loader(params, lambda name, w: w + 1)
    assert source_tensor(lambda: params, load_weights, SPEC, "blk0.w13", 7) is None


SIGN_DEPENDENT = {
    "abs": torch.abs,
    "clamp-min-0": lambda w: w.clamp(min=0),
    "relu": torch.relu,
    "where-negative-zero": lambda w: torch.where(w < 0, torch.zeros_like(w), w),
}


@pytest.mark.parametrize("step", SIGN_DEPENDENT.values(), ids=SIGN_DEPENDENT.keys())
def test_sign_dependent_loader_is_refused_naming_param_and_tensor(step):
    """The index probe's values are all positive, which these steps copy unchanged; the
    verification checkpoint has both signs, so they are caught there."""
    params = _params()
    fix = lambda name, w: step(w) if name.endswith("mlp.w") else w  # noqa: E731
    with pytest.raises(LayoutError) as err:
        extract_source_map(params, _copy_loader(params, fix), SPEC)
    message = str(err.value)
    assert "parameter 'blk0.w13'" in message, message
    assert "checkpoint tensor 'layers.0.mlp.w'" in message, message
    assert "changes values" in message and "abs, clamp, relu" in message, message


LOSSLESS = {
    "through-int16-bits": lambda w: w.view(torch.int16).clone().view(torch.bfloat16),
    "through-float32": lambda w: w.float().to(torch.bfloat16),
    "negate-twice": lambda w: w.neg().neg(),
    "flip-twice": lambda w: w.view(torch.int16).flip(0).flip(0).view(torch.bfloat16),
}


@pytest.mark.parametrize("step", LOSSLESS.values(), ids=LOSSLESS.keys())
def test_loaders_that_keep_every_bit_still_map(step):
    """Values of both signs pass any copy, cast round trip or bit move that keeps the bits."""
    params = _params()
    smap = extract_source_map(params, _copy_loader(params, lambda name, w: step(w)), SPEC)
    assert sum(p.region.numel for p in smap.pieces) == 48 + 6
