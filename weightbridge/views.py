"""How the library sees an engine's parameters: each memory once, in the order it lies in.

Engines keep some weights as views of others. A transposed view of a contiguous tensor is seen
through `memory_order` (the same elements and memory, dims permuted so the view is contiguous):
the probe, the executor and `replay` all use it, so source maps describe it in that order and
writes land in place. A view into another parameter's memory (vLLM's MLA ``W_UK_T`` / ``W_UV``
inside ``kv_b_proj.weight``) is left out of the probe by `without_aliases`: writing the owner
writes it.
"""

from __future__ import annotations

import torch


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """The same elements as raw integers of their width (uint8, int16, int32, int64): for
    bit-exact copies and compares, and for flip, which torch does not implement for every
    float dtype."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32,
                   8: torch.int64}[t.element_size()])


def memory_order(t: torch.Tensor) -> torch.Tensor:
    """``t`` if contiguous; else the permutation of ``t`` that is contiguous, if one is (a
    transpose or permute of a contiguous tensor); else ``t`` itself, for the caller to refuse."""
    if t.is_contiguous():
        return t
    order = sorted(range(t.dim()), key=lambda d: (-t.stride(d), -t.shape[d]))
    view = t.permute(order)
    return view if view.is_contiguous() else t


def without_aliases(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``params`` less those whose memory lies inside another parameter's contiguous memory.

    Engines expose derived views as parameters of their own (vLLM's MLA ``W_UK_T`` and ``W_UV``
    are views into ``kv_b_proj.weight``): writing the owner writes them, so they need no map,
    and mapping them would make every transfer write the same bytes twice. Of two names for
    the same memory the first in sorted order stays. Non-tensors pass through for the caller
    to refuse.
    """
    by_storage: dict[int, list[tuple[str, tuple[int, int]]]] = {}
    for n, p in params.items():
        if isinstance(p, torch.Tensor) and p.numel():
            by_storage.setdefault(p.untyped_storage().data_ptr(), []).append((n, _span(p)))
    aliases = set()
    for group in by_storage.values():
        if len(group) < 2:
            continue
        owners = [(n, span) for n, span in group if params[n].is_contiguous()]
        for n, (lo, hi) in group:
            if any(o != n and olo <= lo and hi <= ohi and ((olo, ohi) != (lo, hi) or o < n)
                   for o, (olo, ohi) in owners):
                aliases.add(n)
    return {n: p for n, p in params.items() if n not in aliases}


def _span(t: torch.Tensor) -> tuple[int, int]:
    """(first byte, end byte) of the storage that ``t``'s elements touch."""
    first = t.storage_offset()
    last = first + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return first * t.element_size(), (last + 1) * t.element_size()
