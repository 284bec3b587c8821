"""The probe's bounded-memory, fast paths: they must find exactly the map the exact path finds.

`runs.Rings` proves a chunk is one slice-copy by comparing it with a ring of digits; here the
chunks and the fast path's threshold are shrunk so that every zoo loader's parameters cross it,
and the maps must equal those of the exact path alone. The scan reads parameters on a device
chunk by chunk (the emulated device: no device memory of the probe's own but a few dozen
elements' reads); the probe runs its
own steps on one torch thread and gives the loader, and the caller, their own.
"""

from __future__ import annotations

import math

import pytest
import torch

from weightbridge import CheckpointSpec, TensorSpec, extract_source_map
from weightbridge.discovery import merge, runs
from weightbridge.testing import emulated_cuda
from zoo import CASES


def _map(case: str):
    worker = CASES[case]()
    return extract_source_map(worker.params, worker.load_weights, worker.spec)


@pytest.mark.parametrize("case", CASES)
def test_the_ring_fast_path_finds_the_exact_paths_map(case, monkeypatch):
    monkeypatch.setattr(runs, "FAST_MIN", 1 << 40)  # exact path only
    exact = _map(case)
    monkeypatch.setattr(runs, "CHUNK", 61)  # chunk edges everywhere, a prime apart
    monkeypatch.setattr(runs, "FAST_MIN", 3)
    assert _map(case) == exact


def test_a_chunk_that_breaks_its_step_takes_the_exact_path(monkeypatch):
    """One element out of step in a long run: the ring comparison fails there, and the map
    has that element as a piece of its own."""
    monkeypatch.setattr(runs, "CHUNK", 1000)
    monkeypatch.setattr(runs, "FAST_MIN", 100)
    spec = CheckpointSpec((TensorSpec("w", (5000,), "bfloat16"),))
    param = torch.zeros(5000, dtype=torch.bfloat16)
    order = torch.arange(5000)
    order[2500] = 17  # element 2500 comes from checkpoint element 17

    def load_weights(weights):
        for _, t in weights:
            param.copy_(t[order])
    smap = extract_source_map({"w": param}, load_weights, spec)
    assert sorted((p.offset, p.region.start, p.region.count) for p in smap.pieces) == [
        (0, (0,), (2500,)), (2500, (17,), (1,)), (2501, (2501,), (2499,))]



@pytest.mark.parametrize("at", [40_000, 65_533, 100_000, 299_990])
def test_an_element_out_of_step_past_the_first_period_of_a_chunk_is_found(at):
    """The ring comparison reads one period of a chunk (the modulus, about 32K digits for
    bf16) against the ring and the rest against the chunk itself one period earlier, and so
    does the search for where a failed chunk's step breaks (`Rings.steady_prefix`): an
    element out of step in a later period must still break the run, and be its own piece."""
    n = 300_000
    spec = CheckpointSpec((TensorSpec("w", (n,), "bfloat16"),))
    param = torch.zeros(n, dtype=torch.bfloat16)
    order = torch.arange(n)
    order[at] = 17

    def load_weights(weights):
        for _, t in weights:
            param.copy_(t[order])
    smap = extract_source_map({"w": param}, load_weights, spec)
    assert sorted((p.offset, p.region.start, p.region.count) for p in smap.pieces) == [
        (0, (0,), (at,)), (at, (17,), (1,)), (at + 1, (at + 1,), (n - at - 1,))]

def _rank(device: str):
    spec = CheckpointSpec(tuple(TensorSpec(f"w{i}", (64, 512), "bfloat16") for i in range(4)))
    params = {t.name: torch.ones(32, 512, dtype=torch.bfloat16, device=device)
              for t in spec.tensors}

    def load_weights(weights):
        for name, t in weights:
            params[name].copy_(t[32:])
    return params, load_weights, spec


def test_device_parameters_are_read_back_in_chunks_with_no_device_memory(monkeypatch):
    monkeypatch.setattr(runs, "CHUNK", 4096)
    monkeypatch.setattr(runs, "FAST_MIN", 1024)
    want = extract_source_map(*_rank("cpu"))
    with emulated_cuda.active():
        params, load_weights, spec = _rank("cuda")
        base = emulated_cuda.memory.current
        emulated_cuda.memory.reset_peak()
        got = extract_source_map(params, load_weights, spec)
        # (the one-pass guess reads a few dozen elements of a parameter at a time: their
        # indices and values, freed at once)
        assert emulated_cuda.memory.peak - base <= 1024
    assert got == want



def test_a_device_parameter_with_copy_boundaries_is_read_back_once_per_pass(monkeypatch):
    """A chunk that breaks its step goes on from the boundary: the rest of it is scanned from
    the host copy already made, not read back from the device again (PCIe on a GPU)."""
    monkeypatch.setattr(runs, "CHUNK", 4096)
    monkeypatch.setattr(runs, "FAST_MIN", 256)
    monkeypatch.setattr(runs, "ROW_PREFIX", 1 << 30)  # (no row path: one copy per tensor)
    spec = CheckpointSpec(tuple(TensorSpec(f"w{i}", (1000,), "bfloat16") for i in range(16)))

    def rank(device):
        params = {"w": torch.zeros(16_000, dtype=torch.bfloat16, device=device)}

        def load_weights(weights):  # tensor i at element (15 - i) * 1000: a boundary each 1000
            for name, t in weights:
                i = int(name[1:])
                params["w"][(15 - i) * 1000:(16 - i) * 1000].copy_(t)
        return params, load_weights

    want = extract_source_map(*rank("cpu"), spec)
    copied = []
    host_chunk = runs._host_chunk

    def counting(values, lo, hi, *args):
        if values.device.type != "cpu":
            copied.append(hi - lo)
        return host_chunk(values, lo, hi, *args)
    monkeypatch.setattr(runs, "_host_chunk", counting)
    with emulated_cuda.active():
        got = extract_source_map(*rank("cuda"), spec)
    assert got == want
    chunks = -(-16_000 // 4096)  # each read with the two elements before it
    assert sum(copied) == 2 * (16_000 + 2 * (chunks - 1)), copied  # two index passes

def test_the_probe_leaves_the_callers_threads_and_gives_them_to_the_loader():
    params, load_weights, spec = _rank("cpu")
    seen = []

    def counting(weights):
        seen.append(torch.get_num_threads())
        load_weights(weights)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        extract_source_map(params, counting, spec)
        assert torch.get_num_threads() == 2
        assert seen and set(seen) == {2}
    finally:
        torch.set_num_threads(before)


def _trainer(restore: str):
    from meshes.qwen3_moe import SIZES, TrainerShard, checkpoint_spec
    from weightbridge import Placement, TransferConfig
    from weightbridge.coordination.local_control import LocalControl
    from weightbridge.coordination.worker import TransferWorker

    shard = TrainerShard(SIZES["tiny"], 2, 0, 2, 1)
    for p in shard.params.values():
        p.normal_(generator=torch.Generator().manual_seed(2))
    config = TransferConfig(trainer_restore=restore, source_map_cache=None)
    worker = TransferWorker("trainer", shard.params, shard.load_weights,
                            checkpoint_spec(SIZES["tiny"]), rank=0, placement=Placement("t"),
                            transport=LocalControl().transport, config=config)
    return shard, worker


@pytest.mark.parametrize("restore", ["host-copy", "none"])
def test_a_trainer_keeps_a_host_copy_only_when_its_config_asks(restore, monkeypatch):
    from weightbridge.coordination import worker as worker_module

    copies = []
    real = worker_module._host_copy
    monkeypatch.setattr(worker_module, "_host_copy", lambda p: copies.append(1) or real(p))
    shard, worker = _trainer(restore)
    before = {n: p.clone() for n, p in shard.params.items()}
    worker.on_source_map()
    same = all(torch.equal(shard.params[n].view(torch.uint8), p.view(torch.uint8))
               for n, p in before.items())
    assert (len(copies), same) == ((1, True) if restore == "host-copy" else (0, False))


def test_the_host_copy_keeps_every_parameters_bits_in_one_host_buffer():
    from weightbridge.coordination.worker import _host_copy

    gen = torch.Generator().manual_seed(3)
    with emulated_cuda.active():
        params = {"a": torch.randn(3, 5, generator=gen).bfloat16(),
                  "b": torch.arange(7, dtype=torch.int8),
                  "c": torch.randn(4, 6, generator=gen, dtype=torch.float64).t(),  # strided
                  "d": torch.empty(0, 3), "e": torch.randn(1, generator=gen).half(),
                  "f": torch.randn(9, generator=gen).to("cuda")}
        saved = _host_copy(params)
        for n, p in params.items():
            host = p.cpu()
            assert (saved[n].device.type, saved[n].shape, saved[n].dtype) == (
                "cpu", host.shape, host.dtype), n
            assert torch.equal(saved[n].reshape(-1).view(torch.uint8),
                               host.reshape(-1).view(torch.uint8)), n
    assert len({t.untyped_storage().data_ptr() for t in saved.values()}) == 1


def test_an_unknown_trainer_restore_is_refused():
    from weightbridge import TransferConfig

    with pytest.raises(ValueError, match="trainer_restore must be one of"):
        TransferConfig(trainer_restore="disk")


def test_a_loader_that_skips_an_element_in_a_later_pass_is_refused():
    """Index passes after the first are not zeroed when the first found every element
    written: an element a later load leaves alone keeps a stale digit, decodes as another
    element, and the verification pass refuses the map."""
    from weightbridge import LayoutError

    spec = CheckpointSpec((TensorSpec("w", (40_000,), "bfloat16"),))  # two index passes
    param = torch.zeros(40_000, dtype=torch.bfloat16)
    calls = []

    def load_weights(weights):
        # The halves swapped: two runs, so the probe makes its second index pass (one run
        # would be decoded from the verification load instead: `one_pass`).
        calls.append(1)
        for _, t in weights:
            t = torch.cat([t[20_000:], t[:20_000]])
            if len(calls) == 2:  # the second index pass: element 15000 (35000) left alone
                param[:15_000].copy_(t[:15_000])
                param[15_001:].copy_(t[15_001:])
            else:
                param.copy_(t)
    with pytest.raises(LayoutError):
        extract_source_map({"w": param}, load_weights, spec)


def test_every_element_the_verification_load_leaves_alone_is_refused():
    """The verification pass follows the index passes without zeroing the parameters: an
    element its load leaves alone keeps the last index pass's digit. Each of 1024 float8
    elements left alone in turn is refused: the digits are positive and the verification's
    values negative. (Values of both signs would equal the digit left behind about once in
    240 float8 elements.)"""
    from weightbridge import LayoutError
    from weightbridge.views import as_bits

    spec = CheckpointSpec((TensorSpec("w", (32, 32), "float8_e4m3fn"),))
    param = torch.zeros(32, 32, dtype=torch.float8_e4m3fn)
    skip = [None]

    def load_weights(weights):
        for _, t in weights:
            bits = as_bits(param).view(-1)
            kept = None if skip[0] is None else bits[skip[0]].clone()
            param.copy_(t)
            if kept is not None and bool((t.float() < 0).all()):  # a verification load
                bits[skip[0]] = kept
    extract_source_map({"w": param}, load_weights, spec)
    for element in range(param.numel()):
        skip[0] = element
        with pytest.raises(LayoutError, match=rf"element {element} "):
            extract_source_map({"w": param}, load_weights, spec)


@pytest.mark.parametrize("shape,index,stride", [
    ((4, 8), 0, 1), ((4, 8), 100, 1), ((1, 32), 7, 1), ((32,), 3, 2), ((3, 1, 5), 50, 3),
    ((2, 3, 4), 200, -1), ((6, 4), 40, 16), ((2, 2), 999, -7), ((5, 7), 60, 1)])
def test_a_one_run_parameter_gets_the_box_grouping_its_rows_finds(shape, index, stride):
    """`one_run` and `run_box` skip the per-row runs of a parameter that is one slice-copy:
    they must give the box that `merge_passes` and `group_boxes` find for it."""
    from weightbridge.discovery.boxes import group_boxes, run_box
    from weightbridge.discovery.codec import alphabet

    moduli = alphabet(torch.bfloat16).moduli[:2]
    bases = torch.tensor([0, 1000, 2000])
    numel = math.prod(shape)
    passes = [merge.PassRuns(torch.tensor([0]), torch.tensor([index % m]),
                            torch.tensor([stride % m]), numel) for m in moduli]
    dims = [d for d in shape if d > 1]
    row = dims[-1] if len(dims) >= 2 else numel
    one = merge.one_run(passes, moduli, bases)
    assert one == (index, stride)
    want = group_boxes(merge.merge_passes(passes, moduli, bases, row), shape)
    got = run_box(*one, numel, row)
    assert all(torch.equal(getattr(got, f), getattr(want, f))
               for f in ("pos", "index", "shape", "cstride", "pstride"))


@pytest.mark.parametrize("index,stride", [(990, 1), (5, -1), (2999, 1), (0, 0)])
def test_a_run_that_crosses_or_leaves_the_tensors_is_decoded_the_general_way(index, stride):
    """Crossing a tensor boundary, leaving the checkpoint or a step of zero: no shortcut
    (`merge_passes` cuts the run or the probe refuses it)."""
    from weightbridge.discovery.codec import alphabet

    moduli = alphabet(torch.bfloat16).moduli[:2]
    passes = [merge.PassRuns(torch.tensor([0]), torch.tensor([index % m]),
                            torch.tensor([stride % m]), 32) for m in moduli]
    assert merge.one_run(passes, moduli, torch.tensor([0, 1000, 2000])) is None


@pytest.mark.parametrize("case", CASES)
def test_the_one_run_shortcut_finds_the_general_paths_map(case, monkeypatch):
    from weightbridge.discovery import probe

    fast = _map(case)
    monkeypatch.setattr(probe, "one_run", lambda *a: None)
    assert _map(case) == fast
