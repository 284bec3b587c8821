"""What a worker checks of its parameters: each name given once, the storage registered, and
per-parameter digests with padding left out.

A worker's parameters are registered once (`TransferWorker`): the copy tables built at connect
read their storage, so a trainer checks before every send that each still uses it
(`storage_of`; a rebound one raises `ParameterRebound`, `rebound_error`) and, the first
time after a probe that kept no copy of its weights, that they were loaded since
(`poison`, `poisoned`). Replicas and delta
updates compare one checksum per parameter (`param_digest`); a parameter with padding
(elements no checkpoint element lands in) is summed over the elements its pieces land in only.

Typical usage::

    params = named_params(model.named_parameters(), "trainer", 0)
    registered = {n: storage_of(p) for n, p in params.items()}
    digest = param_digest(params, padded_pieces(source_map))
"""

from __future__ import annotations

from typing import Mapping

import torch
import xxhash

from weightbridge.discovery.replay import param_view
from weightbridge.errors import ParameterRebound
from weightbridge.execution.checksum import checksum
from weightbridge.types import Piece, SourceMap, WorkerId

Padded = Mapping[str, tuple[Piece, ...]]
"""Parameter with padding -> its pieces (`padded_pieces`): the elements its digest reads."""


def padded_pieces(smap: SourceMap) -> dict[str, tuple[Piece, ...]]:
    """The pieces of each parameter with padding (elements no checkpoint element lands in,
    which may differ between replicas and change freely between versions)."""
    padded = {n for n, _ in smap.unsourced}
    out: dict[str, list[Piece]] = {}
    for p in smap.pieces:
        if p.param in padded:
            out.setdefault(p.param, []).append(p)
    return {n: tuple(ps) for n, ps in out.items()}


def _sourced_digest(p: torch.Tensor, pieces: tuple[Piece, ...]) -> int:
    """One checksum of the elements of ``p`` that ``pieces`` land in (padding left out):
    one strided view per piece (a negative step viewed from its other end: replicas have
    equal pieces, so they read their elements in the same order)."""
    flat = p.detach().reshape(-1)
    sums = [checksum(param_view(flat, piece)[0].contiguous().reshape(-1).view(torch.uint8))
            for piece in pieces]
    return xxhash.xxh3_64_intdigest(b"".join(x.to_bytes(9, "little") for x in sums))


def param_digest(params: Mapping[str, torch.Tensor], padded: Padded | None = None
                 ) -> tuple[int, ...]:
    """One checksum per parameter, in name order: what replicas compare, and what delta
    updates compare between versions. A parameter in ``padded`` is summed over the elements
    its pieces land in only (its padding may differ and change)."""
    padded = padded or {}
    return tuple(_sourced_digest(params[n], padded[n]) if n in padded else
                 checksum(params[n].detach().contiguous().reshape(-1).view(torch.uint8))
                 for n in sorted(params))


def named_params(params, side: str, rank: int) -> dict[str, torch.Tensor]:
    """Name -> tensor of a mapping or of (name, tensor) pairs (``named_parameters()``).

    Raises:
        ValueError: a name given twice (``dict`` would keep the last tensor only, and the
            first would never be updated).
    """
    if isinstance(params, Mapping):
        return dict(params)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in params:
        if name in out:
            raise ValueError(f"the parameters of {side} {rank} name parameter {name!r} twice; "
                             f"give one tensor per name (a mapping, or named_parameters() "
                             f"with its default remove_duplicate=True)")
        out[name] = tensor
    return out


POISONED = 16
"""How many of a parameter's first elements `poison` sets to NaN."""


def poison(params: Mapping[str, torch.Tensor]) -> None:
    """Set the first elements (along the last dimension, at most `POISONED`) of each float
    parameter to NaN, where the probe left a non-zero value (zero: padding, which the
    trainer's own loader does not write). A trainer that kept no copy of its weights and
    sends before loading them is refused (`poisoned`); one that trains on them first sees
    NaN in its loss, and its parameters keep NaN to the send, even where a step is skipped.
    """
    for p in params.values():
        first = _first_elements(p)
        if first is not None:
            first.masked_fill_(first != 0, float("nan"))


def poisoned(params: Mapping[str, torch.Tensor]) -> list[str]:
    """The parameters with NaN among their first elements (what `poison` set): the weights
    were not loaded into them since."""
    out = []
    for name, p in params.items():
        first = _first_elements(p)
        if first is not None and bool(first.isnan().any()):
            out.append(name)
    return out


def _first_elements(p: torch.Tensor) -> torch.Tensor | None:
    """A view of ``p``'s first `POISONED` elements along its last dimension (no copy), for
    a float parameter of 16 bits or more (None for other dtypes and empty parameters)."""
    p = p.detach()
    if not p.numel() or not p.is_floating_point() or p.element_size() < 2:
        return None
    row = p[(0,) * (p.dim() - 1)] if p.dim() else p.reshape(1)
    return row[:POISONED]


def not_loaded_error(worker: WorkerId, names: list[str], total: int) -> ValueError:
    """The error for a trainer whose parameters still hold what the probe left at its first
    send (`poisoned`)."""
    shown = ", ".join(repr(n) for n in names[:3]) + (", ..." if len(names) > 3 else "")
    return ValueError(
        f"{worker}: {len(names)} of its {total} parameters ({shown}) hold the NaN connect's "
        f"probe left in their first elements, so this trainer's weights were not loaded "
        f"after connect (or a step trained on the probe's values). With "
        f"TransferConfig.trainer_restore=\"none\" (the default) connect keeps no copy of a "
        f"trainer's weights. Nothing was sent: load the weights after connect (the trainer's "
        f"own loader or checkpoint load, or connect before loading them at all), or set "
        f"trainer_restore=\"host-copy\" to have connect copy them to host memory and back "
        f"(1.0x their bytes of host memory)")


def storage_of(p: torch.Tensor) -> tuple:
    """What the copy tables read of a parameter: data pointer, shape, strides, dtype."""
    return p.data_ptr(), p.shape, p.stride(), p.dtype


def rebound_error(worker: WorkerId, name: str, was: tuple, now: tuple) -> ParameterRebound:
    """The error for a parameter whose storage is no longer the one registered."""
    return ParameterRebound(
        f"{worker}: parameter {name!r} no longer uses the storage it was registered with "
        f"(data pointer {was[0]:#x}, shape {tuple(was[1])}, strides {was[2]}, {was[3]}; now "
        f"{now[0]:#x}, {tuple(now[1])}, {now[2]}, {now[3]}): something rebound it (`p.data = "
        f"new`, `load_state_dict(assign=True)`, a resharding wrapper). The copy tables read "
        f"the registered storage, so its new values would never be sent. Nothing was sent: "
        f"write new values in place (`p.copy_(new)` under torch.no_grad(), load_state_dict "
        f"without assign=True), or build a new group on the new parameters")
