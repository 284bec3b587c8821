"""One index pass where every parameter is one slice-copy (`weightbridge.discovery.one_pass`):
the verification load picks each run's first index among the first pass's candidates, and the
map is checked against every element as any probe's is; anything else falls back to the index
passes. Pure torch, no Monarch."""

import pytest
import torch

from weightbridge import CheckpointSpec, LayoutError, extract_source_map
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
    assert loads == 4  # the index load, the verification load that decoded nothing, then
    # the second index pass and the verification pass


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
    monkeypatch.setattr(probe_module, "_one_pass", lambda *a: tried.append(1))
    extract_source_map(small, lambda w: load((n, t) for n, t in w if n in small), spec)
    assert not tried
