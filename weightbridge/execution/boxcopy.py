"""The pack/assemble interface between a plan and the bytes it moves.

A round of a plan becomes, per worker, a list of `BoxCopy` descriptors over that worker's tensors
(its parameters and its transfer buffers). A `CopyKernels` implementation turns the list into a
table once (at connect) and then executes the whole table in one or two launches per round:

    kernels = default_kernels(device)              # (executor) Triton on CUDA, torch on CPU
    table = kernels.build_table(copies, tensors)   # once per plan: validates, builds descriptors
    kernels.pack(table, send_buffer)               # per round: tensors -> buffer
    kernels.assemble(table, recv_buffer)           # per round: buffer -> tensors

Implementations:

- `TorchCopyKernels` (here): the reference semantics, one torch copy per box, any device. Slow
  per copy; the oracle for the others.
- `weightbridge.execution.cpu_kernels.CpuCopyKernels`: the default where there is no GPU.
- `kernels.TritonKernels` (the `kernels/` package, imported lazily by the executor's
  `default_kernels`): one
  Triton launch per pack or assemble.

All of them move raw bits (never float arithmetic), accept 1-, 2- and 4-byte element types, any
buffer alignment and negative strides, and validate in ``build_table``. The one exception is a
box with a ``buffer_dtype`` (a plan's dtype conversion): its elements are cast, rounding to
nearest even, between the tensor's dtype and the buffer's (`CONVERTIBLE_DTYPES`), in the same
pack or assemble call as the other boxes. Validation is in ``build_table``: a copy a user got wrong
raises `ValueError` there, before any byte moves. Two boxes of one table may read the same
buffer bytes (assemble can scatter received bytes both into a parameter and into a forwarding
buffer), but `pack` refuses a table whose boxes write overlapping buffer bytes. Boxes that write
the same tensor element twice on `assemble` are not detected; the result is then unspecified.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from weightbridge.quant import QUANT_DTYPE, SCALE_DTYPE, block_grid, block_scales, quantize_with
from weightbridge.types import CONVERTIBLE_DTYPES, BoxCopy, dtype_itemsize

SUPPORTED_ITEMSIZES = (1, 2, 4)
"""Element sizes, in bytes, every implementation moves (as int8, int16 or int32 bits)."""

MAX_RANK = 4
"""Most box dims after merging contiguous dims that the fast paths accept (see docs/kernels.md)."""

INT_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


class CopyKernels(Protocol):
    """What the executor needs from a kernel implementation."""

    def build_table(self, copies: Sequence[BoxCopy], tensors: Sequence[torch.Tensor]) -> object:
        """Validate the copies against the tensors and build the launch descriptors.

        The table keeps references to the tensors; it stays valid while they keep their storage.
        Every table has an ``nbytes`` attribute: the buffer size, in bytes, it needs.
        """
        ...

    def pack(self, table: object, buffer: torch.Tensor) -> None:
        """Gather every box of the table into ``buffer`` (1-d contiguous uint8)."""
        ...

    def assemble(self, table: object, buffer: torch.Tensor) -> None:
        """Scatter every box of the table from ``buffer`` (1-d contiguous uint8) into its tensor."""
        ...


# --------------------------------------------------------------------------------------------
# Validation, shared by the torch implementations
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CopyColumns:
    """The copies of a table as int64 columns (one row per copy), validated.

    Shapes are padded on the left to a common rank with size-1 dims of stride 0.
    """

    tensor: torch.Tensor  # [C] index into the table's tensors
    offset: torch.Tensor  # [C] storage offset (elements) of the box's first element
    shape: torch.Tensor  # [C, R]
    strides: torch.Tensor  # [C, R] elements, any sign
    buffer_offset: torch.Tensor  # [C] bytes
    itemsize: torch.Tensor  # [C] bytes per element of the copy's tensor
    numel: torch.Tensor  # [C]
    converting: torch.Tensor  # [C] bool: the box has a buffer_dtype (pack/assemble convert)
    buffer_itemsize: torch.Tensor  # [C] bytes per element in the buffer
    nbytes: int
    """Buffer bytes the table needs: one past the last byte any copy touches."""
    buffer_overlap: bool
    """True when two copies cover some of the same buffer bytes (such a table cannot pack)."""


def copy_columns(copies: Sequence[BoxCopy], tensors: Sequence[torch.Tensor]) -> CopyColumns:
    """Check the copies against the tensors and return them as columns.

    Raises ValueError naming the first bad copy: a tensor index out of range, shape and strides of
    different lengths, a negative size or buffer offset, a box reaching outside its tensor, a
    tensor of an unsupported element size, or tensors on different devices. Cost: one Python pass
    over the copies to read their fields, then vectorized torch.
    """
    if any(len(c.shape) != len(c.strides) for c in copies):
        bad = next(c for c in copies if len(c.shape) != len(c.strides))
        raise ValueError(f"{bad} has {len(bad.shape)} sizes but {len(bad.strides)} strides; "
                         "give one stride per box dim")
    rank = max((len(c.shape) for c in copies), default=0)
    ones, zeros = (1,) * rank, (0,) * rank
    try:
        cols = torch.tensor([(c.tensor, c.offset, c.buffer_offset, *ones[len(c.shape):], *c.shape,
                              *zeros[len(c.strides):], *c.strides) for c in copies],
                            dtype=torch.int64).reshape(len(copies), 3 + 2 * rank)
    except (TypeError, ValueError, RuntimeError, OverflowError) as e:
        raise ValueError(f"every BoxCopy field must be an int (or a tuple of ints) that fits in "
                         f"int64: {e}") from None
    tensor, offset, buffer_offset = cols[:, 0], cols[:, 1], cols[:, 2]
    shape, strides = cols[:, 3:3 + rank], cols[:, 3 + rank:]

    def first(bad: torch.Tensor) -> BoxCopy | None:
        return copies[int(bad.nonzero()[0, 0])] if bool(bad.any()) else None

    if (c := first((tensor < 0) | (tensor >= len(tensors)))) is not None:
        raise ValueError(f"{c} addresses tensor {c.tensor}, but only {len(tensors)} tensors were "
                         "given; pass every tensor the copies name, in the order they index them")
    if (c := first((shape < 0).any(dim=1))) is not None:
        raise ValueError(f"{c} has a negative size; box sizes must be >= 0")
    if (c := first(buffer_offset < 0)) is not None:
        raise ValueError(f"{c} has a negative buffer_offset; buffer offsets are bytes from the "
                         "start of the buffer")
    used = sorted(set(tensor.tolist()))
    _check_tensors([tensors[i] for i in used], used)
    itemsizes = torch.zeros(len(tensors), dtype=torch.int64)
    spans = torch.zeros(len(tensors), dtype=torch.int64)
    for i in used:
        itemsizes[i], spans[i] = tensors[i].element_size(), tensor_span(tensors[i])
    itemsize = itemsizes[tensor]
    numel = shape.prod(dim=1)
    converting, buffer_itemsize, buffer_numel = _buffer_dtypes(copies, tensors, itemsize, numel)

    # Lowest and highest storage offset a box touches (empty boxes touch nothing).
    reach = (shape - 1).clamp(min=0) * strides
    lo = offset + reach.clamp(max=0).sum(dim=1)
    hi = offset + reach.clamp(min=0).sum(dim=1)
    if (c := first((numel > 0) & ((lo < 0) | (hi >= spans[tensor])))) is not None:
        t = tensors[c.tensor]
        raise ValueError(
            f"{c} reaches outside tensor {c.tensor} (shape {tuple(t.shape)}, strides "
            f"{t.stride()}), whose elements lie at storage offsets 0..{tensor_span(t) - 1} from "
            "its first element; fix the box's offset, shape or strides")

    start = buffer_offset
    end = start + buffer_numel * buffer_itemsize
    nonempty = numel > 0
    nbytes = int(end[nonempty].max()) if bool(nonempty.any()) else 0
    order = torch.argsort(start[nonempty], stable=True)
    s, e = start[nonempty][order], end[nonempty][order]
    overlap = bool((e[:-1] > s[1:]).any()) if len(s) > 1 else False
    return CopyColumns(tensor, offset, shape, strides, buffer_offset, itemsize, numel, converting,
                       buffer_itemsize, nbytes, overlap)


def _buffer_dtypes(copies: Sequence[BoxCopy], tensors: Sequence[torch.Tensor],
                   itemsize: torch.Tensor, numel: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(converting mask, buffer element size, buffer elements) per copy; ValueError for a
    conversion the kernels do not implement or a converting box whose buffer offset is not
    aligned to its elements."""
    converting = torch.zeros(len(copies), dtype=torch.bool)
    buffer_itemsize = itemsize.clone()
    buffer_numel = numel.clone()
    for i, c in enumerate(copies):
        name = c.buffer_dtype
        if c.block:
            _check_block_box(c, tensors[c.tensor])
            converting[i] = True
            buffer_itemsize[i] = dtype_itemsize(name)
            if name == SCALE_DTYPE:
                buffer_numel[i] = math.prod(block_grid(c.shape, c.block))
            continue
        if name is None:
            continue
        have = str(tensors[c.tensor].dtype).removeprefix("torch.")
        if name not in CONVERTIBLE_DTYPES or have not in CONVERTIBLE_DTYPES:
            raise ValueError(f"{c} converts {have} <-> {name}; the copy kernels convert only "
                             f"between {', '.join(CONVERTIBLE_DTYPES)}")
        size = dtype_itemsize(name)
        if c.buffer_offset % size:
            raise ValueError(f"{c} converts to {name} at buffer byte {c.buffer_offset}, not a "
                             f"multiple of {size}; align converting boxes to their buffer dtype")
        converting[i] = name != have
        buffer_itemsize[i] = size
    return converting, buffer_itemsize, buffer_numel


def _check_block_box(c: BoxCopy, tensor: torch.Tensor) -> None:
    """A block-quantizing box: 2-d, positive strides, a float tensor the quantizer reads, a
    buffer dtype of float8 values or float32 scales at an aligned offset."""
    have = str(tensor.dtype).removeprefix("torch.")
    if len(c.block) != 2 or len(c.shape) != 2 or min(c.block) < 1:
        raise ValueError(f"{c} block-quantizes a {len(c.shape)}-d box in blocks {c.block}; "
                         f"block quantization takes 2-d boxes and a (rows, columns) block")
    if have not in CONVERTIBLE_DTYPES or c.buffer_dtype not in (QUANT_DTYPE, SCALE_DTYPE):
        raise ValueError(f"{c} block-quantizes {have} into {c.buffer_dtype}; it quantizes "
                         f"{', '.join(CONVERTIBLE_DTYPES)} tensors into {QUANT_DTYPE} values "
                         f"or {SCALE_DTYPE} scales")
    if any(s < 0 for s in c.strides):
        raise ValueError(f"{c} block-quantizes a box with a negative stride; give block boxes "
                         f"positive strides")
    if c.buffer_offset % dtype_itemsize(c.buffer_dtype):
        raise ValueError(f"{c} writes {c.buffer_dtype} at buffer byte {c.buffer_offset}; align "
                         f"it to {dtype_itemsize(c.buffer_dtype)} bytes")


def merge_dims(shape: torch.Tensor, strides: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop size-1 dims and merge dims that are contiguous with the next one, for every row.

    Dims ``d, d+1`` merge when ``strides[d] == strides[d+1] * shape[d+1]``: the pair then walks
    storage exactly as one dim of ``shape[d] * shape[d+1]`` elements does, and the buffer side,
    row-major, is unchanged. Returns new [C, R] tensors with the remaining dims on the right
    (left padding: size 1, stride 0), so ``(shape > 1).sum(1)`` is each box's rank.
    """
    shape, strides = shape.clone(), torch.where(shape == 1, 0, strides)
    shape, strides = _dims_right(shape, strides)
    for d in range(shape.shape[1] - 2, -1, -1):
        m = (shape[:, d] > 1) & (shape[:, d + 1] > 1) & (
            strides[:, d] == strides[:, d + 1] * shape[:, d + 1])
        shape[m, d] *= shape[m, d + 1]
        strides[m, d] = strides[m, d + 1]
        shape[m, d + 1], strides[m, d + 1] = 1, 0
    return _dims_right(shape, strides)


def _dims_right(shape: torch.Tensor, strides: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Move size-1 dims to the left of each row, keeping the order of the others."""
    order = torch.argsort((shape != 1).to(torch.int8), dim=1, stable=True)
    return shape.gather(1, order), strides.gather(1, order)


def check_rank(copies: Sequence[BoxCopy], rows: torch.Tensor, shape: torch.Tensor) -> None:
    """Raise ValueError if a merged box (``shape`` of ``copies[rows[i]]``) exceeds MAX_RANK."""
    rank = (shape > 1).sum(dim=1)
    if bool((rank > MAX_RANK).any()):
        i = int((rank > MAX_RANK).nonzero()[0, 0])
        raise ValueError(
            f"{copies[int(rows[i])]} has {int(rank[i])} dims that cannot be merged (dims merge "
            f"when one is contiguous with the next); the copy kernels support at most "
            f"{MAX_RANK}. Split the box into several boxes along its outer dims, or raise "
            "MAX_RANK as docs/kernels.md describes")


def _check_tensors(tensors: Sequence[torch.Tensor], indices: Sequence[int]) -> None:
    for i, t in zip(indices, tensors):
        if t.element_size() not in SUPPORTED_ITEMSIZES or t.is_quantized or t.is_complex():
            raise ValueError(
                f"tensor {i} has dtype {t.dtype} ({t.element_size()} bytes per element); the copy "
                f"kernels move elements of {SUPPORTED_ITEMSIZES} bytes. View it as one of those "
                "(e.g. tensor.view(torch.int32) for 8-byte types) and describe the boxes over "
                "that view")
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"the copies address tensors on several devices "
                         f"{sorted(map(str, devices))}; build one table per device")


def tensor_span(tensor: torch.Tensor) -> int:
    """Number of storage elements from a tensor's first element to its last, inclusive."""
    if tensor.numel() == 0:
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()))


def flat_span(tensor: torch.Tensor, itemsize: int | None = None) -> torch.Tensor:
    """A 1-d view of a tensor's storage span, as integers of ``itemsize`` bytes (its own default).

    Viewing as integers makes every copy move bits: no float handling touches NaN payloads.
    """
    span = tensor.as_strided((tensor_span(tensor),), (1,), tensor.storage_offset())
    span = span.view(INT_DTYPES[tensor.element_size()])
    return span if itemsize is None else span.view(INT_DTYPES[itemsize])


def check_buffer(buffer: torch.Tensor, nbytes: int, device: torch.device | None) -> None:
    """Raise ValueError unless ``buffer`` is a 1-d contiguous uint8 tensor of >= nbytes bytes."""
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
        raise ValueError(f"the buffer must be a 1-d contiguous torch.uint8 tensor, got dtype "
                         f"{buffer.dtype} and shape {tuple(buffer.shape)}; pass "
                         "buffer.view(torch.uint8).flatten()")
    if buffer.numel() < nbytes:
        raise ValueError(f"the buffer has {buffer.numel()} bytes but the table needs {nbytes}; "
                         "allocate at least table.nbytes bytes")
    if device is not None and buffer.device != device:
        raise ValueError(f"the buffer is on {buffer.device} but the table's tensors are on "
                         f"{device}; move the buffer or build the table for that device")


def check_packable(buffer_overlap: bool) -> None:
    if buffer_overlap:
        raise ValueError("two copies of this table write overlapping buffer bytes, so packing it "
                         "would depend on the order of the copies; give each box its own "
                         "buffer range (assemble allows shared ranges, pack does not)")


# --------------------------------------------------------------------------------------------
# Reference implementation
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReferenceTable:
    """A table for `TorchCopyKernels`: the copies and the tensors they address."""

    copies: tuple[BoxCopy, ...]
    tensors: tuple[torch.Tensor, ...]
    nbytes: int
    """Buffer bytes the table needs."""
    buffer_overlap: bool
    """True when two copies cover some of the same buffer bytes."""


def box_view(tensor: torch.Tensor, copy: BoxCopy) -> tuple[torch.Tensor, list[int]]:
    """The tensor elements a copy addresses as a strided view (no data moves).

    torch views cannot have negative strides, so dims with a negative stride are viewed from
    their other end; those dims are returned and the caller flips the buffer side instead.
    """
    offset, strides, flipped = copy.offset, list(copy.strides), []
    for d, (n, s) in enumerate(zip(copy.shape, copy.strides)):
        if s < 0:
            offset += s * (n - 1)
            strides[d] = -s
            flipped.append(d)
    view = tensor.as_strided(copy.shape, strides, tensor.storage_offset() + offset)
    return view, flipped


def buffer_view(buffer: torch.Tensor, copy: BoxCopy, dtype: torch.dtype) -> torch.Tensor:
    """The bytes of a copy in the buffer, viewed as its element type and box shape.

    Needs ``copy.buffer_offset`` to be a multiple of the element size (torch cannot view
    unaligned bytes as wider types); `TorchCopyKernels` itself does not need this.
    """
    raw = buffer[copy.buffer_offset:copy.buffer_offset + box_nbytes(copy, dtype)]
    return raw.view(dtype).view(copy.shape)


def box_nbytes(copy: BoxCopy, dtype: torch.dtype) -> int:
    """Bytes a copy occupies in the buffer."""
    n = dtype.itemsize
    for s in copy.shape:
        n *= s
    return n


class TorchCopyKernels:
    """Reference implementation: one torch copy per box, through a byte view of the buffer."""

    def build_table(self, copies: Sequence[BoxCopy],
                    tensors: Sequence[torch.Tensor]) -> ReferenceTable:
        cols = copy_columns(copies, tensors)
        return ReferenceTable(tuple(copies), tuple(tensors), cols.nbytes, cols.buffer_overlap)

    def pack(self, table: ReferenceTable, buffer: torch.Tensor) -> None:
        check_buffer(buffer, table.nbytes, None)
        check_packable(table.buffer_overlap)
        for c in table.copies:
            view, flipped = self._view(table, c)
            if c.block:  # block-quantizing: float8 values or float32 scales (weightbridge.quant)
                scale = block_scales(view, c.block)
                box = scale if c.buffer_dtype == SCALE_DTYPE else quantize_with(view, scale,
                                                                               c.block)
                box = box.contiguous()
            else:
                box = torch.empty(c.shape, dtype=self._buffer_dtype(c, view), device=view.device)
                box.copy_(view.flip(flipped) if flipped else view)  # a converting box casts here
            buffer[c.buffer_offset:c.buffer_offset + box.numel() * box.element_size()].copy_(
                box.view(-1).view(torch.uint8))

    def assemble(self, table: ReferenceTable, buffer: torch.Tensor) -> None:
        check_buffer(buffer, table.nbytes, None)
        for c in table.copies:
            if c.block:
                raise ValueError(f"{c} block-quantizes: such boxes only pack (rollouts receive "
                                 f"the float8 values and scales and copy them)")
            view, flipped = self._view(table, c)
            # An aligned temporary: the box may start at any byte of the buffer.
            box = torch.empty(c.shape, dtype=self._buffer_dtype(c, view), device=view.device)
            box.view(-1).view(torch.uint8).copy_(
                buffer[c.buffer_offset:c.buffer_offset + box.numel() * box.element_size()])
            view.copy_(box.flip(flipped) if flipped else box)

    @staticmethod
    def _view(table: ReferenceTable, copy: BoxCopy) -> tuple[torch.Tensor, list[int]]:
        """The box's tensor elements: as integers (bits) for a plain box, as floats for a
        converting one (torch's cast rounds to nearest even)."""
        t = table.tensors[copy.tensor].detach()
        if copy.buffer_dtype is None and not copy.block:
            t = t.view(INT_DTYPES[t.element_size()])
        return box_view(t, copy)

    @staticmethod
    def _buffer_dtype(copy: BoxCopy, view: torch.Tensor) -> torch.dtype:
        name = copy.buffer_dtype
        return view.dtype if name is None else getattr(torch, name)
