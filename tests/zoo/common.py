"""The case record of the loader zoo and the deterministic tensors every case is built from.

A zoo case is a function ``build(scale=1) -> Worker``. ``scale`` multiplies the model's hidden and
intermediate sizes (and head dims) but never the number of layers, heads or experts, so a compact
source map has the same number of pieces at every scale. Building is deterministic: two builds of
one case have bit-identical parameters, which is what lets a test load one build through the
loader, replay a source map into the other, and compare bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

import torch

from weightbridge import CheckpointSpec

Params = Mapping[str, torch.Tensor]
LoadWeights = Callable[[Iterable[tuple[str, torch.Tensor]]], None]

# Signed integer views of each element width: the bit patterns we compare.
INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class Expect:
    """What a case's source map must look like, besides replaying the loader bit-exactly."""

    max_pieces: int
    """Upper bound on ``len(smap.pieces)``: the loader's slice-copies, counted by hand."""
    unsourced: Mapping[str, int] = field(default_factory=dict)
    """Exact number of elements without a source, per param (absent: 0)."""
    unused: frozenset[str] = frozenset()
    """Exact set of checkpoint names the loader never copies from."""
    filled: frozenset[str] = frozenset()
    """Params whose unsourced elements the loader overwrites with constants (zero padding)."""
    scale_invariant: bool = True
    """Whether the number of pieces must stay the same at every ``scale``."""


@dataclass(frozen=True)
class Worker:
    """One worker of a zoo case: what `extract_source_map` gets, plus the case's expectations."""

    params: Params | Callable[[], Params]
    """The live parameters, or a zero-argument callable returning them (replacing loaders)."""
    load_weights: LoadWeights
    """The loader under test, vLLM style: consumes ``(checkpoint name, tensor)`` pairs."""
    spec: CheckpointSpec
    """The checkpoint the loader reads."""
    checkpoint: Callable[[int], dict[str, torch.Tensor]]
    """Pseudo-random checkpoint with the spec's names, shapes and dtypes, from a seed."""
    expect: Expect
    """The case's own assertions on the map."""

    def live(self) -> Params:
        return self.params() if callable(self.params) else self.params


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator
                  ) -> torch.Tensor:
    """Finite pseudo-random values: normal floats, or random float8 bytes without the NaNs."""
    if dtype == torch.float8_e4m3fn:
        raw = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
        # 0x7f and 0xff are e4m3fn's only NaNs; flip their last bit (to +-448).
        raw = torch.where((raw & 0x7F) == 0x7F, raw ^ 1, raw)
        return raw.view(torch.float8_e4m3fn)
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)


def random_checkpoint(spec: CheckpointSpec, seed: int) -> dict[str, torch.Tensor]:
    """A checkpoint that matches ``spec``, with values drawn from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return {t.name: random_tensor(t.shape, torch_dtype(t.dtype), gen) for t in spec.tensors}


@torch.no_grad()
def init_params(params: Params, seed: int = 0) -> None:
    """Fill every param with seeded values (in name order, through views if non-contiguous)."""
    gen = torch.Generator().manual_seed(seed)
    for name in sorted(params):
        p = params[name]
        p.copy_(random_tensor(tuple(p.shape), p.dtype, gen))


def make_worker(params: Params | Callable[[], Params], load_weights: LoadWeights,
                spec: CheckpointSpec, expect: Expect) -> Worker:
    """Seed the params and wrap everything into a `Worker`."""
    init_params(params() if callable(params) else params)
    return Worker(params, load_weights, spec, lambda seed: random_checkpoint(spec, seed), expect)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def chunk_range(size: int, num_chunks: int, index: int) -> tuple[int, int]:
    """[start, stop) of chunk ``index`` when ``size`` is cut as torch.chunk / DTensor do."""
    step = -(-size // num_chunks)
    start = min(index * step, size)
    return start, min(start + step, size)
