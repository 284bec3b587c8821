"""The tiny loaders `bench_probe.py --tiny` probes (`benchmarks/probe_tiny.py`): each is mapped,
and its map replays a random checkpoint bit for bit as the loader itself loads it."""

from __future__ import annotations

import pytest
import torch

from benchmarks.probe_tiny import LOADERS, TinyLoader
from weightbridge import CheckpointSpec, TensorSpec, extract_source_map
from weightbridge.discovery.replay import replay


@pytest.mark.parametrize("kind", LOADERS)
def test_a_tiny_loaders_map_replays_its_own_load(kind):
    loader = TinyLoader(kind)
    assert loader.nbytes < 1 << 20
    spec = CheckpointSpec(tuple(TensorSpec(n, s, "bfloat16") for n, s in loader.shapes.items()))
    smap = extract_source_map(loader.params, loader.load_weights, spec)
    gen = torch.Generator().manual_seed(3)
    checkpoint = {n: torch.randn(s, generator=gen).bfloat16() for n, s in loader.shapes.items()}
    replayed = {n: torch.zeros_like(p) for n, p in loader.params.items()}
    replay(smap, replayed, checkpoint)
    loader.load_weights(checkpoint.items())
    for name, p in loader.params.items():
        assert torch.equal(replayed[name].view(torch.uint8), p.view(torch.uint8)), name
    assert not smap.unsourced


def test_an_unknown_tiny_loader_is_refused():
    with pytest.raises(ValueError, match="unknown tiny loader"):
        TinyLoader("diagonal")
