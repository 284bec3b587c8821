"""Converting boxes on the torch paths: a box whose buffer elements have another dtype.

A plan gives a box a ``buffer_dtype`` where a worker's parameter dtype differs from the wire
dtype of its overlap (float32 trainer weights sent as bfloat16). Packing casts tensor -> buffer,
assembling buffer -> tensor, with torch's own ``copy_``: the very cast a rollout's ``load_weights``
performs (round to nearest even), so the result is bit-identical to its loader by construction.
The boxes are views made once, at build time; a round copies every unflipped one in a single
``torch._foreach_copy_`` (one dispatcher call), boxes with a negative stride one by one through
``flip``. Both `TorchCopyKernels` and `CpuCopyKernels` run their converting boxes through this,
inside the same pack or assemble call as their other boxes.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Sequence

import torch

from weightbridge.execution.boxcopy import box_view
from weightbridge.quant import SCALE_DTYPE, block_grid, block_scales, quantize_with
from weightbridge.types import BoxCopy


@dataclass(slots=True)
class _Box:
    view: torch.Tensor  # the tensor's elements (its float dtype), negative strides flipped
    flip: list[int]  # dims to flip when copying
    dtype: torch.dtype  # buffer element dtype
    offset: int  # buffer byte offset
    shape: tuple[int, ...]  # of the buffer side (the block grid for scales)
    block: tuple[int, ...] = ()  # a block-quantizing box (pack only)


class ConvertTable:
    """The converting boxes of one table; buffer-side views cached for the last two buffers."""

    __slots__ = ("_boxes", "_cache")

    def __init__(self, copies: Sequence[BoxCopy], tensors: Sequence[torch.Tensor]) -> None:
        self._boxes = []
        for c in copies:
            view, flip = box_view(tensors[c.tensor].detach(), c)
            shape = (block_grid(c.shape, c.block) if c.block and c.buffer_dtype == SCALE_DTYPE
                     else tuple(c.shape))
            self._boxes.append(_Box(view, flip, getattr(torch, c.buffer_dtype), c.buffer_offset,
                                    shape, tuple(c.block)))
        self._cache: list[tuple[weakref.ref, list[torch.Tensor]]] = []

    def __len__(self) -> int:
        return len(self._boxes)

    @property
    def num_launches(self) -> int:
        """torch calls per pack or assemble."""
        return any(not b.flip for b in self._boxes) + sum(bool(b.flip) for b in self._boxes)

    def pack(self, buffer: torch.Tensor) -> None:
        """Cast every box's tensor elements into the buffer (``buffer`` 4-byte aligned)."""
        self._copy(buffer, to_buffer=True)

    def assemble(self, buffer: torch.Tensor) -> None:
        """Cast every box's buffer elements into its tensor."""
        self._copy(buffer, to_buffer=False)

    def _copy(self, buffer: torch.Tensor, *, to_buffer: bool) -> None:
        pairs = [(v, b) for v, b in zip(self._buffer_views(buffer), self._boxes)]
        quantizing = [(v, b) for v, b in pairs if b.block]
        if quantizing:
            if not to_buffer:
                raise ValueError("a block-quantizing box only packs (rollouts receive the "
                                 "float8 values and scales and copy them)")
            _quantize(quantizing)
            pairs = [(v, b) for v, b in pairs if not b.block]
        plain = [(v, b.view) if to_buffer else (b.view, v) for v, b in pairs if not b.flip]
        if plain:
            torch._foreach_copy_([dst for dst, _ in plain], [src for _, src in plain])
        for v, b in pairs:
            if b.flip:  # flip makes a copy: flip the side read from
                if to_buffer:
                    v.copy_(b.view.flip(b.flip))
                else:
                    b.view.copy_(v.flip(b.flip))

    def _buffer_views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        for ref, views in self._cache:
            if ref() is buffer:
                return views
        assert buffer.storage_offset() % 4 == 0, "callers bounce unaligned buffers"
        views = []
        for b in self._boxes:
            n = b.dtype.itemsize
            for s in b.shape:
                n *= s
            views.append(buffer[b.offset:b.offset + n].view(b.dtype).view(b.shape))
        self._cache = [(weakref.ref(buffer), views)] + self._cache[:1]
        return views


def _quantize(pairs: list[tuple[torch.Tensor, _Box]]) -> None:
    """Block-quantize boxes into their buffer views: the values box and the scales box of the
    same elements share one scale computation (the plan packs both in one round, usually)."""
    scales: dict[tuple, torch.Tensor] = {}
    for v, b in pairs:
        key = (b.view.data_ptr(), b.view.shape, b.view.stride(), b.block)
        scale = scales.get(key)
        if scale is None:
            scale = scales[key] = block_scales(b.view, b.block)
        v.copy_(scale if b.dtype == torch.float32 else quantize_with(b.view, scale, b.block))
