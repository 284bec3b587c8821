"""The scan's row path (`weightbridge.discovery.rows`): chunks of equal rows, each row a
slice-copy of its own (row-parallel shards), must give exactly the map the exact path gives.

Each layout is probed twice: as the probe runs (ring comparisons, halving, the row path) and
with the exact path alone (`runs.FAST_MIN` and `runs.ROW_PREFIX` out of reach); the maps must
be equal, and the row path must have taken part (it is spied on). The row path's sizes are
shrunk so that small parameters cross chunk edges, pattern breaks and partial rows often.
"""

from __future__ import annotations

import pytest
import torch

from weightbridge import CheckpointSpec, TensorSpec, extract_source_map
from weightbridge.discovery import runs

E, H, COLS = 4, 96, 256
"""Experts, rows and checkpoint columns of the stacked layouts (bf16)."""


def _spec(shape=(H, COLS)) -> CheckpointSpec:
    return CheckpointSpec(tuple(TensorSpec(f"e{e}", shape, "bfloat16") for e in range(E)))


def _stacked(cols: slice, pad: int = 0):
    """``w[e] = e{e}[:, cols]`` (vLLM's row-parallel ``w2_weight``), ``pad`` zero columns
    after each row's copy."""
    width = len(range(COLS)[cols])
    param = torch.zeros(E, H, width + pad, dtype=torch.bfloat16)

    def load(weights):
        for name, t in weights:
            param[int(name[1:]), :, :width].copy_(t[:, cols])
    return {"w": param}, load


def _transposed():
    """``w[e] = e{e}[:, 64:192].T``: rows of H elements whose digits step by COLS."""
    param = torch.zeros(E, 128, H, dtype=torch.bfloat16)

    def load(weights):
        for name, t in weights:
            param[int(name[1:])].copy_(t[:, 64:192].T)
    return {"w": param}, load


def _one_element_elsewhere():
    """Row-parallel, but one element in the middle of expert 1 comes from another place:
    the row pattern breaks there and must resume after it."""
    params, load = _stacked(slice(128, 256))

    def load_one_off(weights):
        weights = dict(weights)
        load(weights.items())
        params["w"][1, 50, 7] = weights["e3"][0, 0]
    return params, load_one_off


LAYOUTS = {
    "w2-like, right half": lambda: _stacked(slice(128, 256)),
    "w2-like, rows of 64": lambda: _stacked(slice(0, 64)),
    "every other column of the left part": lambda: _stacked(slice(0, 192, 2)),
    "padded rows": lambda: _stacked(slice(0, 128), pad=8),
    "transposed slice": _transposed,
    "one element elsewhere": _one_element_elsewhere,
}


@pytest.mark.parametrize("chunk", [1 << 20, 20_011], ids=["one-chunk", "chunk-edges"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_row_path_finds_the_exact_paths_map(layout, chunk, monkeypatch):
    params, load = LAYOUTS[layout]()
    monkeypatch.setattr(runs, "FAST_MIN", 1 << 40)
    monkeypatch.setattr(runs, "ROW_PREFIX", 1 << 40)
    exact = extract_source_map(params, load, _spec())
    monkeypatch.setattr(runs, "FAST_MIN", 1 << 11)
    monkeypatch.setattr(runs, "ROW_PREFIX", 1 << 11)
    monkeypatch.setattr(runs, "ROW_GATE", 1 << 8)
    monkeypatch.setattr(runs, "CHUNK", chunk)
    taken = []
    real = runs._rows

    def spy(*args):
        found, end = real(*args)
        taken.append(found is not None)
        return found, end
    monkeypatch.setattr(runs, "_rows", spy)
    assert extract_source_map(params, load, _spec()) == exact
    if layout != "padded rows":  # (rows with holes take the exact path)
        assert any(taken), "the row path never found rows"


@pytest.mark.parametrize("first", [True, False])
@pytest.mark.parametrize("length,step,jump,digit,size", [
    (64, 1, 193, 5, 9000), (100, 7, 3, 32_000, 12_345), (2, 1, 40, 0, 5000),
    (333, 32_000, 17, 123, 20_000)])
def test_row_stretches_are_the_exact_paths_stretches(first, length, step, jump, digit, size,
                                                     monkeypatch):
    """On raw bits of rows of one pattern, with a row start inside the chunk's first
    elements: the row path reports exactly the exact path's stretches (relation, step, digit
    before, digit after), whether the chunk's first relation is its own or not."""
    from weightbridge.discovery.codec import alphabet

    alpha = torch.bfloat16
    a = alphabet(alpha)
    p = a.moduli[0]
    monkeypatch.setattr(runs, "ROW_PREFIX", 2048)
    base, offset = 1000, 37  # row 0 starts at element base + offset
    e = torch.arange(size, dtype=torch.int64) - offset
    row, col = torch.div(e, length, rounding_mode="floor"), torch.remainder(e, length)
    digits = (digit + row * (jump + (length - 1) * step) + col * step) % p
    bits = (digits + a.first_normal).to(torch.int16)
    want = runs.exact_stretches(bits, base, first, a, p)
    got, end = runs._rows(bits, base, first, a, p, runs.Rings())
    assert end == base + size
    for x, y in zip(got, want):
        assert torch.equal(x, y)
