"""Replay a `SourceMap`: the meaning of a map, and the oracle that tests and the probe check.

For each piece, the checkpoint region is a strided view of its tensor and the parameter side a
strided view of the parameter's logical elements; replaying copies one into the other (cast to
the parameter's dtype, rounding to nearest even, for a piece with ``cast_from``; a block piece
copies from its tensor's block-quantized image or scales, `weightbridge.quant`).
"""

from __future__ import annotations

import math
from typing import Mapping

import torch

from weightbridge.discovery.compare import same_bits
from weightbridge.discovery.quantized import expected_source
from weightbridge.types import Piece, Region, SourceMap, pieces_by_param, scaled_tensor
from weightbridge.views import as_bits, memory_order


def region_view(tensor: torch.Tensor, region: Region) -> torch.Tensor:
    """The region's elements of a checkpoint tensor, shaped ``region.count`` (a view)."""
    index = tuple(slice(s, s + k * (c - 1) + 1, k)
                  for s, c, k in zip(region.start, region.count, region.step))
    return tensor[index]


def param_view(flat: torch.Tensor, piece: Piece) -> tuple[torch.Tensor, list[int]]:
    """The piece's elements of a contiguous 1-d parameter view, shaped ``region.count``.

    Views cannot have negative strides: such dims are viewed from their other end and returned,
    and the caller flips the checkpoint side along them.
    """
    offset, strides, flipped = piece.offset, list(piece.strides), []
    for d, (n, s) in enumerate(zip(piece.region.count, piece.strides)):
        if s < 0:
            offset += s * (n - 1)
            strides[d] = -s
            flipped.append(d)
    view = flat.as_strided(piece.region.count, strides, flat.storage_offset() + offset)
    return view, flipped


def replay(smap: SourceMap, params: Mapping[str, torch.Tensor],
           checkpoint: Mapping[str, torch.Tensor]) -> None:
    """Fill ``params`` from ``checkpoint`` as the map says; unsourced elements stay untouched."""
    _check_inputs(smap, params, checkpoint)
    images: dict = {}
    with torch.no_grad():
        for name, pieces in pieces_by_param(smap.pieces).items():
            param = memory_order(params[name].detach())
            work = param if param.is_contiguous() else param.contiguous()
            flat = work.view(-1)
            for piece in pieces:
                dst, flipped = param_view(flat, piece)
                piece, tensor = expected_source(piece, checkpoint, images)
                src = _bits(_source(piece, tensor, dst.dtype))
                _bits(dst).copy_(src.flip(flipped) if flipped else src)
            if work is not param:
                param.copy_(work)


def first_mismatch(piece: Piece, param: torch.Tensor, tensor: torch.Tensor) -> int | None:
    """Logical flat index of the first parameter element that differs (bitwise) from the
    checkpoint element the piece says it holds, or None when all match."""
    if (param.dtype != tensor.dtype) != (piece.cast_from is not None):
        return piece.offset
    dst, flipped = param_view(param.detach().contiguous().view(-1), piece)
    src = _bits(_source(piece, tensor, param.dtype))
    if flipped:
        src = src.flip(flipped)
    if _equal(_bits(dst), src):
        return None
    diff = torch.nonzero(_bits(dst) != src)
    if not diff.numel():
        return None
    i = diff[0].tolist()
    return piece.offset + sum(a * s for a, s in zip(i, piece.strides))


COMPARE_CHUNK = 1 << 20
"""Elements compared at once on the host: the comparison's temporaries stay in cache."""


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``torch.equal`` of two equal-shaped integer views, slab by slab along dim 0 on the host
    (`same_bits`: one read of each on one core; torch's comparison is several times slower
    here, and a full-size ``!=`` would allocate a bool per element)."""
    if a.device.type != "cpu" or b.device.type != "cpu" or a.dim() == 0:
        return torch.equal(a, b)
    x, y = a.numpy(), b.numpy()
    rows = max(1, COMPARE_CHUNK // max(1, math.prod(x.shape[1:])))
    return all(same_bits(x[lo:lo + rows], y[lo:lo + rows])
               for lo in range(0, x.shape[0], rows))


def _source(piece: Piece, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The piece's checkpoint elements as the parameter holds them: cast (round to nearest
    even) when the piece records a cast."""
    view = region_view(tensor, piece.region)
    return view if piece.cast_from is None else view.to(dtype)


_bits = as_bits
"""The old private name of `weightbridge.views.as_bits`."""


def _check_inputs(smap: SourceMap, params: Mapping[str, torch.Tensor],
                  checkpoint: Mapping[str, torch.Tensor]) -> None:
    for spec in smap.params:
        if spec.name not in params:
            raise ValueError(f"parameter {spec.name!r} of the source map is missing from params")
        p = memory_order(params[spec.name])
        if tuple(p.shape) != spec.shape or str(p.dtype).removeprefix("torch.") != spec.dtype:
            raise ValueError(f"parameter {spec.name!r} is {tuple(p.shape)} {p.dtype}; the map "
                             f"was extracted for {spec.shape} {spec.dtype}")
    for name in {scaled_tensor(p.region.tensor) or p.region.tensor for p in smap.pieces}:
        if name not in checkpoint:
            raise ValueError(f"checkpoint tensor {name!r} that the map reads is missing")
