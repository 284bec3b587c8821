"""Property tests of layout discovery over random layouts (hypothesis).

A layout is a few runtime params, each made from fresh checkpoint tensors by one recipe:

- shard: a ``tensor_split`` of a 1-3 d tensor along any dim, then maybe transposed / permuted;
- fuse: 2-4 tensors, each maybe TP-sharded, concatenated along dim 0 or 1, maybe transposed;
- rows: a step-k row selection, reversed rows or columns, a per-head rotary permutation (either
  direction), block-cyclic row blocks;
- scalar: a 0-d tensor into one slot of a 1-d param;
- duplicate: a tensor copied twice into one param.

Params may carry untouched padding rows and may be non-contiguous (transposed storage, strided,
offset views). The loader reads the checkpoint dict and copies each recipe's result into its
param. Checked: the map replays the loader bit-exactly (`zoo.oracle`), reports exactly the padding
as unsourced and the extra tensors as unused, and has no more pieces than the recipes' copies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightbridge import CheckpointSpec, TensorSpec, extract_source_map
from zoo.common import INT_VIEW, Expect, Worker, make_worker
from zoo.oracle import check_replay, check_unsourced_report, check_well_formed

DTYPES = ["bfloat16", "float16", "float32", "float8_e4m3fn"]
SETTINGS = settings(max_examples=30, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@dataclass(frozen=True)
class Recipe:
    """How one param is made from its checkpoint tensors."""

    inputs: tuple[TensorSpec, ...]
    make: Callable[[list[torch.Tensor]], torch.Tensor]
    max_pieces: int
    what: str

    def __repr__(self) -> str:  # hypothesis prints failing examples with this
        return f"Recipe({self.what}, inputs={[(t.shape, t.dtype) for t in self.inputs]})"


@dataclass(frozen=True)
class ParamPlan:
    recipe: Recipe
    pad_rows: int = 0
    """Untouched rows after the recipe's rows (dim 0)."""
    storage: str = "contiguous"
    """contiguous | transposed | strided | offset."""
    slot: int | None = None
    """For 0-d results: the index in a 1-d param of ``slot_len`` elements."""
    slot_len: int = 1


# --------------------------------------------------------------------------------------------
# Recipes
# --------------------------------------------------------------------------------------------


def _flip(x: torch.Tensor, dim: int) -> torch.Tensor:
    """torch.flip through an integer view: CPU flip has no float8 kernel."""
    return x.view(INT_VIEW[x.element_size()]).flip(dim).view(x.dtype)


@st.composite
def shard_recipe(draw, prefix: str, dtype: str) -> Recipe:
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 7), min_size=ndim, max_size=ndim)))
    dim = draw(st.integers(0, ndim - 1))
    degree = draw(st.integers(1, min(4, shape[dim])))
    rank = draw(st.integers(0, degree - 1))
    perm = tuple(draw(st.permutations(range(ndim))))

    def make(xs: list[torch.Tensor]) -> torch.Tensor:
        return xs[0].tensor_split(degree, dim)[rank].permute(perm)
    return Recipe((TensorSpec(f"{prefix}.w", shape, dtype),), make, 1,
                  f"shard dim={dim} degree={degree} rank={rank} then permute{perm}")


@st.composite
def fuse_recipe(draw, prefix: str, dtype: str) -> Recipe:
    num = draw(st.integers(2, 4))
    dim = draw(st.integers(0, 1))
    other = draw(st.integers(1, 6))
    degree = draw(st.integers(1, 3))
    rank = draw(st.integers(0, degree - 1))
    sizes = draw(st.lists(st.integers(degree, 7), min_size=num, max_size=num))
    transpose = draw(st.booleans())
    inputs = tuple(TensorSpec(f"{prefix}.part{i}", (s, other) if dim == 0 else (other, s), dtype)
                   for i, s in enumerate(sizes))

    def make(xs: list[torch.Tensor]) -> torch.Tensor:
        out = torch.cat([x.tensor_split(degree, dim)[rank] for x in xs], dim=dim)
        return out.t() if transpose else out
    return Recipe(inputs, make, num,
                  f"fuse {num} along dim {dim}, each shard {rank}/{degree}, transpose={transpose}")


@st.composite
def rows_recipe(draw, prefix: str, dtype: str) -> Recipe:
    kind = draw(st.sampled_from(["step", "flip_rows", "flip_cols", "rotary", "block_cyclic"]))
    cols = draw(st.integers(1, 6))
    if kind == "step":
        rows = draw(st.integers(1, 12))
        k = draw(st.integers(1, 4))
        start = draw(st.integers(0, min(k, rows) - 1))
        return Recipe((TensorSpec(f"{prefix}.w", (rows, cols), dtype),),
                      lambda xs: xs[0][start::k], 1, f"rows {start}::{k}")
    if kind in ("flip_rows", "flip_cols"):
        rows = draw(st.integers(1, 8))
        dim = 0 if kind == "flip_rows" else 1
        return Recipe((TensorSpec(f"{prefix}.w", (rows, cols), dtype),),
                      lambda xs: _flip(xs[0], dim), 1, kind)
    if kind == "rotary":
        heads = draw(st.integers(1, 3))
        half = draw(st.integers(1, 4))
        to_pairs = draw(st.booleans())

        def make(xs: list[torch.Tensor]) -> torch.Tensor:
            view = (heads, 2, half, cols) if to_pairs else (heads, half, 2, cols)
            return xs[0].view(view).transpose(1, 2).reshape(heads * 2 * half, cols)
        return Recipe((TensorSpec(f"{prefix}.w", (heads * 2 * half, cols), dtype),), make,
                      2 * heads, f"rotary heads={heads} head_dim={2 * half} to_pairs={to_pairs}")
    world = draw(st.integers(2, 3))
    per_rank = draw(st.integers(1, 3))
    block = draw(st.integers(1, 3))
    rank = draw(st.integers(0, world - 1))
    num_blocks = world * per_rank

    def make(xs: list[torch.Tensor]) -> torch.Tensor:
        return xs[0].view(num_blocks, block, cols)[rank::world].reshape(-1, cols)
    return Recipe((TensorSpec(f"{prefix}.w", (num_blocks * block, cols), dtype),), make, per_rank,
                  f"block-cyclic blocks={num_blocks}x{block} rank {rank}/{world}")


@st.composite
def duplicate_recipe(draw, prefix: str, dtype: str) -> Recipe:
    shape = (draw(st.integers(1, 5)), draw(st.integers(1, 5)))
    return Recipe((TensorSpec(f"{prefix}.w", shape, dtype),),
                  lambda xs: torch.cat([xs[0], xs[0]]), 2, "duplicate rows")


@st.composite
def param_plan(draw, index: int, storages: list[str]) -> ParamPlan:
    dtype = draw(st.sampled_from(DTYPES))
    prefix = f"t{index}"
    kind = draw(st.sampled_from(["shard", "fuse", "rows", "scalar", "duplicate"]))
    if kind == "scalar":
        n = draw(st.integers(1, 5))
        recipe = Recipe((TensorSpec(f"{prefix}.scale", (), dtype),), lambda xs: xs[0], 1, "scalar")
        return ParamPlan(recipe, slot=draw(st.integers(0, n - 1)), slot_len=n)
    recipe = draw({"shard": shard_recipe, "fuse": fuse_recipe, "rows": rows_recipe,
                   "duplicate": duplicate_recipe}[kind](prefix, dtype))
    return ParamPlan(recipe, pad_rows=draw(st.sampled_from([0, 0, 1, 3])),
                     storage=draw(st.sampled_from(storages)))


# --------------------------------------------------------------------------------------------
# Layout -> worker
# --------------------------------------------------------------------------------------------


def _shape_of(recipe: Recipe) -> tuple[int, ...]:
    metas = [torch.empty(t.shape, device="meta") for t in recipe.inputs]
    return tuple(recipe.make(metas).shape)


def _allocate(shape: tuple[int, ...], dtype: torch.dtype, storage: str) -> torch.Tensor:
    if storage == "transposed" and len(shape) >= 2:
        return torch.empty(shape[::-1], dtype=dtype).permute(*reversed(range(len(shape))))
    if storage == "strided" and len(shape) >= 1:
        return torch.empty(shape[:-1] + (2 * shape[-1],), dtype=dtype)[..., ::2]
    if storage == "offset":
        return torch.empty(math.prod(shape) + 3, dtype=dtype)[3:].view(shape)
    return torch.empty(shape, dtype=dtype)


def _layout_builder(plans: list[ParamPlan], extra: list[TensorSpec]) -> Callable[[], Worker]:
    spec = CheckpointSpec(tuple(t for p in plans for t in p.recipe.inputs) + tuple(extra))

    def build() -> Worker:
        params, unsourced = {}, {}
        for i, plan in enumerate(plans):
            shape = _shape_of(plan.recipe)
            dtype = getattr(torch, plan.recipe.inputs[0].dtype)
            if plan.slot is not None:
                full = (plan.slot_len,)
            else:
                full = (shape[0] + plan.pad_rows,) + shape[1:] if shape else shape
            params[f"p{i}"] = _allocate(full, dtype, plan.storage)
            missing = math.prod(full) - math.prod(shape)
            if missing:
                unsourced[f"p{i}"] = missing

        @torch.no_grad()
        def load_weights(weights) -> None:
            sd = dict(weights)
            for i, plan in enumerate(plans):
                out = plan.recipe.make([sd[t.name] for t in plan.recipe.inputs])
                dst = params[f"p{i}"]
                if plan.slot is not None:
                    dst = dst[plan.slot]
                elif out.dim():
                    dst = dst.narrow(0, 0, out.shape[0])
                dst.copy_(out)

        expect = Expect(max_pieces=sum(p.recipe.max_pieces for p in plans), unsourced=unsourced,
                        unused=frozenset(t.name for t in extra))
        return make_worker(params, load_weights, spec, expect)
    return build


@st.composite
def layouts(draw, storages: tuple[str, ...] = ("contiguous",)
            ) -> tuple[list[ParamPlan], list[TensorSpec]]:
    num = draw(st.integers(1, 3))
    plans = [draw(param_plan(i, list(storages))) for i in range(num)]
    extra = [TensorSpec("unused.w", (draw(st.integers(1, 4)), 3), draw(st.sampled_from(DTYPES)))
             ] if draw(st.booleans()) else []
    return plans, extra


def _extract(build: Callable[[], Worker]):
    worker = build()
    return extract_source_map(worker.params, worker.load_weights, worker.spec)


# --------------------------------------------------------------------------------------------
# Properties
# --------------------------------------------------------------------------------------------


@SETTINGS
@given(layouts())
def test_random_layouts_replay_bit_exactly_with_exact_unsourced_and_unused(layout):
    build = _layout_builder(*layout)
    smap = _extract(build)
    check_replay(build, smap)
    worker = build()
    cover = check_well_formed(smap, worker.spec, worker.live())
    assert check_unsourced_report(smap, cover) == dict(worker.expect.unsourced)
    assert set(smap.unused) == set(worker.expect.unused)


@SETTINGS
@given(layouts(storages=("transposed", "strided", "offset")))
def test_non_contiguous_params_replay_bit_exactly(layout):
    build = _layout_builder(*layout)
    check_replay(build, _extract(build))


@SETTINGS
@given(layouts())
def test_map_has_no_more_pieces_than_the_recipes_copies(layout):
    """Compact: at most twice the recipe's copy operations, plus one per parameter.

    The probe sees elements, not copies: where one copy happens to continue another in the
    checkpoint (tiny shapes make that common), the greedy cut can split a copy once more.
    What must never happen is a map that grows with the number of elements.
    """
    build = _layout_builder(*layout)
    smap = _extract(build)
    worker = build()
    bound = 2 * worker.expect.max_pieces + len(smap.params)
    assert len(smap.pieces) <= bound, (layout[0], smap.pieces)

