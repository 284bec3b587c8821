"""Recovery of slice-copies from index sequences: exact for any element map, compact for
structured ones, across chunk edges and passes. Loaders here are raw element gathers, so any
map at all can be expressed; the oracle is the gather itself."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from weightbridge import CheckpointSpec, TensorSpec, extract_source_map, replay
from weightbridge.discovery import runs


def gather_loader(params, sources, spec):
    """load_weights that sets params[name].view(-1)[i] = ckpt_flat[sources[name][i]] (-1: skip)."""
    def load(weights):
        flat = torch.cat([w.reshape(-1) for _, w in weights])
        for name, idx in sources.items():
            dst = params[name].view(-1)
            hit = idx >= 0
            dst[hit] = flat[idx[hit]]
    return load


def check(sources, dtype=torch.bfloat16, shapes=((40, 30), (7,), (3, 5, 4))):
    spec = CheckpointSpec(tuple(TensorSpec(f"t{i}", s, str(dtype)[6:])
                                for i, s in enumerate(shapes)))
    params = {n: torch.zeros(len(i), dtype=dtype) for n, i in sources.items()}
    load = gather_loader(params, sources, spec)
    smap = extract_source_map(params, load, spec)
    gen = torch.Generator().manual_seed(3)
    ckpt = {t.name: torch.randn(t.shape, generator=gen).to(dtype) for t in spec.tensors}
    expect = {n: torch.zeros_like(p) for n, p in params.items()}
    got = {n: torch.zeros_like(p) for n, p in params.items()}
    params.update(expect)
    load(ckpt.items())
    replay(smap, got, ckpt)
    for n in params:
        assert torch.equal(got[n].view(torch.uint8), expect[n].view(torch.uint8)), n
    return smap


def total(shapes=((40, 30), (7,), (3, 5, 4))):
    return sum(int(torch.tensor(s).prod()) for s in shapes)


def test_contiguous_copy_of_a_whole_tensor_is_one_piece():
    smap = check({"w": torch.arange(1200)})
    assert len(smap.pieces) == 1 and smap.pieces[0].region.count == (40, 30)


def test_column_shard_transpose_and_row_interleave_stay_one_or_two_pieces():
    grid = torch.arange(1200).view(40, 30)
    assert len(check({"w": grid[:, 10:20].reshape(-1)}).pieces) == 1
    smap = check({"w": grid.t().reshape(-1)})
    assert len(smap.pieces) == 1 and smap.pieces[0].transposed
    assert len(check({"w": torch.cat([grid[0::2], grid[1::2]]).reshape(-1)}).pieces) == 2


def test_flat_shard_across_tensor_boundaries_splits_at_tensors_and_rows():
    smap = check({"flat": torch.arange(1195, 1220)})  # last 5 of t0, all of t1, 13 of t2
    assert {p.region.tensor for p in smap.pieces} == {"t0", "t1", "t2"}
    assert len(smap.pieces) <= 6


def test_padding_and_untouched_elements_are_unsourced():
    idx = torch.cat([torch.arange(10), torch.full((6,), -1)])
    smap = check({"w": idx})
    assert smap.unsourced == (("w", 6),)


def test_one_checkpoint_element_in_many_places():
    smap = check({"a": torch.arange(30), "b": torch.arange(30), "bcast": torch.full((9,), 1207)})
    assert smap.num_elements == 69


def test_runs_cut_by_chunk_edges_join_again(monkeypatch):
    monkeypatch.setattr(runs, "CHUNK", 7)
    smap = check({"w": torch.arange(1200), "t": torch.arange(1200).view(40, 30).t().reshape(-1)})
    assert len(smap.pieces) == 2


def test_fp8_needs_more_passes_and_still_decodes():
    check({"w": torch.arange(1200).flip(0)}, dtype=torch.float8_e4m3fn)


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_any_element_map_is_reproduced_exactly(data):
    n = data.draw(st.integers(1, 300))
    kind = data.draw(st.sampled_from(["random", "blocks", "strided"]))
    if kind == "random":
        idx = torch.tensor(data.draw(st.lists(st.integers(-1, total() - 1), min_size=n,
                                              max_size=n)))
    elif kind == "blocks":
        parts, size = [], 0
        while size < n:
            length = data.draw(st.integers(1, 40))
            start = data.draw(st.integers(-1, total() - length))
            step = data.draw(st.sampled_from([1, 1, -1, 2, 30]))
            block = torch.arange(length) * step + start
            block = torch.where((block >= 0) & (block < total()) & (start >= 0), block, -1)
            parts.append(block)
            size += length
        idx = torch.cat(parts)[:n]
    else:
        idx = torch.arange(1200).view(40, 30)[data.draw(st.integers(0, 3))::2].t().reshape(-1)
    check({"w": idx})


def test_empty_parameters_and_tensors_have_no_pieces():
    spec = CheckpointSpec.from_tensors({"a": torch.zeros(4, dtype=torch.bfloat16),
                                        "e": torch.zeros(0, 3, dtype=torch.bfloat16)})
    params = {"a": torch.zeros(4, dtype=torch.bfloat16),
              "e": torch.zeros(0, 3, dtype=torch.bfloat16)}

    def load(weights):
        for name, w in weights:
            params[name].copy_(w)
    smap = extract_source_map(params, load, spec)
    assert [p.param for p in smap.pieces] == ["a"] and len(smap.params) == 2
