"""Name the checkpoint tensor behind a bad parameter element, to explain a refused loader.

Only runs when layout discovery already failed. Each pass fills every checkpoint tensor with
one small integer (1..7, exact in every float format, so a cast keeps it), the digits of the
tensor's number in base 7; reading the bad element after each pass spells out which tensor
landed there. If that tensor's dtype differs from the parameter's, the loader casts.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Iterator, Mapping

import torch

from weightbridge.types import CheckpointSpec

_BASE = 7


def source_tensor(get: Callable[[], Mapping[str, torch.Tensor]],
                  load_weights: Callable[[Iterable[tuple[str, torch.Tensor]]], object],
                  spec: CheckpointSpec, param: str, element: int) -> str | None:
    """The checkpoint tensor whose value ``load_weights`` puts at ``param``'s logical flat
    ``element``, or None when the element holds no such marker (the loader computes values)."""
    num_passes = max(1, math.ceil(math.log(len(spec) + 1, _BASE)))
    number = 0
    with torch.no_grad():
        for k in range(num_passes):
            for p in dict(get()).values():
                p.detach().zero_()
            load_weights(_markers(spec, k))
            value = float(get()[param].detach().reshape(-1)[element])
            digit = value - 1
            if digit != int(digit) or not 0 <= digit < _BASE:
                return None
            number += int(digit) * _BASE ** k
    if not 1 <= number <= len(spec):
        return None
    return spec.tensors[number - 1].name


def _markers(spec: CheckpointSpec, k: int) -> Iterator[tuple[str, torch.Tensor]]:
    for i, t in enumerate(spec.tensors):
        digit = (i + 1) // _BASE ** k % _BASE
        yield t.name, torch.full(t.shape, float(digit + 1), dtype=getattr(torch, t.dtype))
