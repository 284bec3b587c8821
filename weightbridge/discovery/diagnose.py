"""Name the checkpoint tensor behind a bad parameter element, to explain a refused loader.

Only runs when layout discovery already failed, so the loader is known to change values, and
the markers must name the right tensor through that change. Checkpoint tensors are numbered
1..n; pass k offers ones in the tensors whose number has bit k set and zeros in the others, and
reads only whether the bad element is zero. Scaling by any non-zero factor (negative ones
included), casting, rounding, ``abs``, ``clamp(min=0)`` and ``relu`` all keep zero zero and one
non-zero, so the passes spell the number of the tensor the element depends on. (Markers read
back by value would name a wrong tensor whenever a scaled marker equals another one.) Two more
passes confirm the answer: with ones in that tensor alone the element must be non-zero, with
ones everywhere else it must be zero. A loader that adds constants or mixes several tensors into
one element fails them, and no tensor is named rather than a wrong one. If the tensor's dtype
differs from the parameter's, the loader casts.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, Mapping

import torch

from weightbridge.types import CheckpointSpec

Params = Mapping[str, torch.Tensor]
LoadWeights = Callable[[Iterable[tuple[str, torch.Tensor]]], object]


def source_tensor(get: Callable[[], Params], load_weights: LoadWeights, spec: CheckpointSpec,
                  param: str, element: int) -> str | None:
    """The checkpoint tensor whose value ``load_weights`` puts at ``param``'s logical flat
    ``element``, or None when no single tensor decides it (the loader computes values)."""
    n = len(spec)
    with torch.no_grad():
        number = 0
        for k in range(n.bit_length()):
            if _nonzero_after(get, load_weights, spec, param, element,
                              lambda i, k=k: (i + 1) >> k & 1):
                number |= 1 << k
        if not 1 <= number <= n:
            return None
        t = number - 1
        if not _nonzero_after(get, load_weights, spec, param, element, lambda i: i == t):
            return None
        if _nonzero_after(get, load_weights, spec, param, element, lambda i: i != t):
            return None
    return spec.tensors[t].name


def _nonzero_after(get: Callable[[], Params], load_weights: LoadWeights, spec: CheckpointSpec,
                   param: str, element: int, lit: Callable[[int], bool]) -> bool:
    """Whether the element is non-zero (NaN counts) after loading ones into the tensors ``lit``
    selects by position and zeros into the others."""
    for p in dict(get()).values():
        p.detach().zero_()
    load_weights(_markers(spec, lit))
    return bool(get()[param].detach().reshape(-1)[element] != 0)


def _markers(spec: CheckpointSpec, lit: Callable[[int], bool]
             ) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor as a view into one buffer of ones or of zeros per dtype, so a pass costs two
    buffers of the largest tensor, not a checkpoint."""
    largest: dict[str, int] = {}
    for t in spec.tensors:
        largest[t.dtype] = max(largest.get(t.dtype, 0), t.numel)
    buffers: dict[tuple[str, bool], torch.Tensor] = {}
    for i, t in enumerate(spec.tensors):
        key = (t.dtype, bool(lit(i)))
        if key not in buffers:
            make = torch.ones if key[1] else torch.zeros
            buffers[key] = make(largest[t.dtype], dtype=getattr(torch, t.dtype))
        yield t.name, buffers[key][:t.numel].view(t.shape)
