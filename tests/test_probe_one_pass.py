"""One index pass where every parameter is one box (`weightbridge.discovery.one_pass`): the
first pass's digits at a few elements guess each box, the verification load picks its first
index, and the map is checked against every element as any probe's is; a parameter that is
no box is seen before the verification load, and anything else falls back to the index
passes. Pure torch, no Monarch."""

import pytest
import torch

from weightbridge import CheckpointSpec, LayoutError, extract_source_map
from weightbridge.discovery import one_pass
from weightbridge.discovery import probe as probe_module
from weightbridge.discovery.codec import alphabet
from weightbridge.types import TensorSpec

P0 = alphabet(torch.bfloat16).moduli[0]  # the first pass's modulus


def _counting(load):
    calls = []

    def load_weights(weights):
        calls.append(1)
        load(weights)
    return load_weights, calls


def _probed(params, load, spec, *, one_pass: bool, monkeypatch):
    """(map, loads) with the one-pass decode allowed or not."""
    with monkeypatch.context() as m:
        if not one_pass:
            m.setattr(probe_module, "_one_pass", lambda *a: None)
        load_weights, calls = _counting(load)
        return extract_source_map(params, load_weights, spec), len(calls)


def _row_sharded(tp: int, rank: int):
    """Rank ``rank`` of ``tp`` of a bf16 checkpoint of 24 tensors of 96 x 1024 (2.4M elements:
    two index passes), sharded by rows; and every other element of one more (a one-run
    parameter of another step)."""
    spec = CheckpointSpec(tuple(TensorSpec(f"w{i}", (96, 1024), "bfloat16") for i in range(24))
                          + (TensorSpec("t", (64, 48), "bfloat16"),))
    rows = slice(rank * 96 // tp, (rank + 1) * 96 // tp)
    params = {f"w{i}": torch.zeros(96 // tp, 1024, dtype=torch.bfloat16) for i in range(24)}
    params["t"] = torch.zeros(64 * 48 // 2, dtype=torch.bfloat16)

    def load(weights):
        for name, t in weights:
            params[name].copy_(t.reshape(-1)[::2] if name == "t" else t[rows])
    return params, load, spec


@pytest.mark.parametrize("tp, rank", [(1, 0), (4, 3)])
def test_a_rank_of_one_slice_copies_is_mapped_with_one_index_load_and_the_same_map(
        tp, rank, monkeypatch):
    params, load, spec = _row_sharded(tp, rank)
    assert alphabet(torch.bfloat16).num_passes(spec.numel) == 2
    fast, fast_loads = _probed(params, load, spec, one_pass=True, monkeypatch=monkeypatch)
    slow, slow_loads = _probed(params, load, spec, one_pass=False, monkeypatch=monkeypatch)
    assert fast == slow
    assert (fast_loads, slow_loads) == (2, 3)  # an index load and the verification load


def test_a_run_whose_step_is_the_residue_step_plus_the_modulus_falls_back_and_is_mapped(
        monkeypatch):
    """A column of a tensor P0 + 1 wide steps by P0 + 1, which the first pass reads as a
    step of 1: no candidate's values match, and the index passes map it. (A whole tensor
    beside it makes the rank large enough for its candidates: `ELEMENTS_PER_CANDIDATE`.)"""
    spec = CheckpointSpec((TensorSpec("w", (64, P0 + 1), "bfloat16"),
                           TensorSpec("big", (4096, 1024), "bfloat16")))
    params = {"col": torch.zeros(64, dtype=torch.bfloat16),
              "big": torch.zeros(4096, 1024, dtype=torch.bfloat16)}

    def load(weights):
        for name, t in weights:
            params["col" if name == "w" else "big"].copy_(t[:, 3] if name == "w" else t)
    smap, loads = _probed(params, load, spec, one_pass=True, monkeypatch=monkeypatch)
    (piece,) = [p for p in smap.pieces if p.param == "col"]
    assert (piece.region.start, piece.region.count) == ((0, 3), (64, 1))
    assert loads == 5  # the index load, the verification load that decoded nothing, then
    # both index passes (the first one's digits were overwritten) and the verification pass


@pytest.mark.parametrize("change", [lambda t: t * 2, lambda t: -t, torch.abs])
def test_a_loader_that_changes_values_is_still_refused(change):
    """A scaled first pass still reads as one run each (doubling adds 128 to every bit
    pattern): its verification values match no candidate, and the index passes refuse it."""
    params, load, spec = _row_sharded(2, 1)

    def changing(weights):
        load((n, change(t)) for n, t in weights)
    with pytest.raises(LayoutError):
        extract_source_map(params, changing, spec)


def test_a_loader_that_leaves_an_element_alone_in_the_verification_load_is_refused():
    """The decoding load is the verification load: an element it leaves alone keeps the
    index pass's positive digit and fails the check (or the decode, among the first
    elements), and so it does in the verification after the fallback's index pass."""
    params, load, spec = _row_sharded(1, 0)

    def skipping(weights):
        kept = params["w5"][7, 100].clone()
        load(weights)
        if bool((params["w0"][0, :8].float() < 0).all()):  # a verification load
            params["w5"][7, 100] = kept
    with pytest.raises(LayoutError, match=r"'w5'.*element 7268 "):
        extract_source_map(params, skipping, spec)


def test_a_rank_of_too_many_candidates_for_its_size_takes_its_index_passes(monkeypatch):
    """Each parameter's candidates are the checkpoint's elements over the first modulus: a
    rank holding a small part of a large checkpoint would spend more on them than a pass
    (`one_pass.ELEMENTS_PER_CANDIDATE`), so it is not decoded this way."""
    params, load, spec = _row_sharded(1, 0)
    small = {"t": params["t"]}  # 1536 elements of a checkpoint of 2.4M: 73 candidates
    tried = []
    monkeypatch.setattr(one_pass, "guess", lambda *a: tried.append(1))
    load_weights, calls = _counting(lambda w: load((n, t) for n, t in w if n in small))
    extract_source_map(small, load_weights, spec)
    assert not tried and len(calls) == 3  # both index passes and the verification pass


def _spec(extra=()):
    return CheckpointSpec(tuple(TensorSpec(f"w{i}", (96, 1024), "bfloat16") for i in range(24))
                          + tuple(extra))


def _copying(params, place):
    """A loader that copies checkpoint tensor ``name`` into ``params`` as ``place(name, t)``
    says (a dict of parameter name -> value), zero for a parameter it does not name."""
    def load(weights):
        for name, t in weights:
            for param, value in place(name, t).items():
                params[param].copy_(value)
    return load


@pytest.mark.parametrize("layout", ["column shard", "transposed", "3-d view", "strided"])
def test_a_rank_of_boxes_is_mapped_with_one_index_load_and_the_same_map(layout, monkeypatch):
    """A row-parallel shard (a run a row), a transposed copy, a 3-d view of a tensor and a
    parameter that is itself a strided view (of a wider buffer) are each one box: the first
    pass's digits at a few elements give its residue and steps, the verification load its
    first index."""
    spec = _spec()
    shape = {"column shard": (96, 256), "transposed": (1024, 96), "3-d view": (8, 12, 512),
             "strided": (96, 2048)}
    params = {f"w{i}": torch.zeros(shape[layout], dtype=torch.bfloat16) for i in range(24)}
    if layout == "strided":
        params = {n: p[:, :1024] for n, p in params.items()}
    value = {"column shard": lambda t: t[:, 256:512], "transposed": lambda t: t.T,
             "3-d view": lambda t: t[:, 512:].reshape(8, 12, 512), "strided": lambda t: t}[layout]
    load = _copying(params, lambda name, t: {name: value(t)})
    fast, fast_loads = _probed(params, load, spec, one_pass=True, monkeypatch=monkeypatch)
    slow, slow_loads = _probed(params, load, spec, one_pass=False, monkeypatch=monkeypatch)
    assert fast == slow
    assert (fast_loads, slow_loads) == (2, 3)


def test_a_float32_parameter_in_a_bf16_rank_is_decoded_from_its_residue(monkeypatch):
    """A float32 digit's modulus exceeds the checkpoint: its residue is its index."""
    spec = _spec((TensorSpec("f", (64, 128), "float32"),))
    params = {f"w{i}": torch.zeros(48, 1024, dtype=torch.bfloat16) for i in range(24)}
    params["f"] = torch.zeros(32, 128, dtype=torch.float32)
    load = _copying(params, lambda name, t: {name: t[:t.shape[0] // 2]})
    fast, fast_loads = _probed(params, load, spec, one_pass=True, monkeypatch=monkeypatch)
    slow, _ = _probed(params, load, spec, one_pass=False, monkeypatch=monkeypatch)
    assert fast == slow and fast_loads == 2


@pytest.mark.parametrize("layout", ["fused", "padded"])
def test_a_parameter_that_is_not_one_box_is_seen_before_the_verification_load(
        layout, monkeypatch):
    """A fused weight (rows of three tensors) or a padded one (zero rows at its end) is no
    box at its sampled elements: the probe scans the first pass it has loaded and takes
    its second, with no load spent on the one-pass decode."""
    spec = _spec()
    params = {f"w{i}": torch.zeros(96, 1024, dtype=torch.bfloat16) for i in range(3, 24)}
    params["qkv" if layout == "fused" else "padded"] = torch.zeros(
        (96, 1024) if layout == "fused" else (100, 1024), dtype=torch.bfloat16)

    def place(name, t):
        i = int(name[1:])
        if i >= 3:
            return {name: t}
        if layout == "fused":
            return {"qkv": torch.cat([params["qkv"][:32 * i], t[32 * i:32 * (i + 1)],
                                      params["qkv"][32 * (i + 1):]])}
        return {"padded": torch.cat([t, params["padded"][96:]])} if i == 0 else {}
    load = _copying(params, place)
    fast, fast_loads = _probed(params, load, spec, one_pass=True, monkeypatch=monkeypatch)
    slow, _ = _probed(params, load, spec, one_pass=False, monkeypatch=monkeypatch)
    assert fast == slow and fast_loads == 3
    if layout == "padded":
        assert dict(fast.unsourced) == {"padded": 4 * 1024}


def test_a_hole_the_samples_miss_fails_the_check_and_is_mapped_by_the_index_passes(
        monkeypatch):
    """One element the loader never writes, between the sampled ones: the guess holds, the
    map of one box fails its check there (the element keeps the zero the first pass's fill
    left), and the index passes map the hole."""
    params, load, spec = _row_sharded(1, 0)

    def holey(weights):
        load(weights)
        params["w5"][7, 101] = 0
    fast, loads = _probed(params, holey, spec, one_pass=True, monkeypatch=monkeypatch)
    assert dict(fast.unsourced) == {"w5": 1}
    assert loads == 5  # the first index load, the decoding load, both index passes, the check


def test_a_probe_in_a_torch_distributed_group_of_ranks_takes_its_index_passes(tmp_path,
                                                                              monkeypatch):
    """A loader in a process group may be collective (torchtitan's redistributes DTensors):
    every rank must make the same loads, and whether the one-pass decode applies is each
    rank's own finding (torchtitan's FSDP2 x TP ranks hung in their loads when it differed).
    So a probe in a group of two or more ranks makes its index passes, as many on every rank;
    in a group of one (vLLM's worker at TP 1 has one) nothing can differ, and the one pass
    applies."""
    import torch.distributed as dist
    params, load, spec = _row_sharded(4, 3)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        single, single_loads = _probed(params, load, spec, one_pass=True,
                                       monkeypatch=monkeypatch)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
        grouped, loads = _probed(params, load, spec, one_pass=True, monkeypatch=monkeypatch)
    finally:
        dist.destroy_process_group()
    alone, _ = _probed(params, load, spec, one_pass=True, monkeypatch=monkeypatch)
    assert grouped == single == alone
    assert (single_loads, loads) == (2, 3)
