"""Descriptor tables for the pack and assemble kernels, built once per plan.

Imports only torch: the tables can be built (and inspected, and benchmarked) without Triton or a
GPU. A table has two int64 tensors on the tensors' device:

``copies`` [C, NUM_FIELDS], one row per (normalized) box:

    ADDR   address of the box's first element in its tensor (data_ptr + offset * itemsize)
    BUF    byte offset of the box in the buffer
    ESIZE  bytes per moved element: 1, 2 or 4 (moved as int8/int16/int32 bits)
    NROWS  N0 * N1 * N2: rows of the box (every dim but the innermost)
    N1, N2, N3     sizes of dims 1..3 (dim 0 is NROWS / (N1 * N2)); N3 is the innermost dim
    S0, S1, S2, S3 strides of dims 0..3 in elements of ESIZE bytes, any sign

``tiles`` [T, 3], one row per program of a launch: (copy row, first box row, first column). A
program moves the BLOCK_ROWS x BLOCK_COLS elements of its box from there, masked at the edges.

Normalization (exact: the buffer bytes and the tensor elements touched do not change):
dims of size 1 are dropped and dims contiguous with the next are merged (rank <= MAX_RANK after
that, else ValueError); boxes whose innermost dim is contiguous are widened to 4- or 2-byte
moves when sizes and alignments allow (bf16 rows move as int32 pairs); long innermost dims are
split into rows of BLOCK_COLS (1-d boxes plus a tail box) so that tiles are full.

Typical usage::

    desc = build_descriptors(copies, tensors)   # once, at connect
    pack(desc, send_buffer)                      # kernels.pack: one launch per round
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

MAX_RANK = 4
"""Box dims the kernels address after merging. To raise it: add N/S fields here, pad to the new
rank in `_merge_dims`' callers, and decompose the extra row dims in `kernels/_tile.py`."""
SUPPORTED_ITEMSIZES = (1, 2, 4)
ADDR, BUF, ESIZE, NROWS, N1, N2, N3, S0, S1, S2, S3 = range(11)
NUM_FIELDS = 11
BLOCK_ROWS = 16
"""Default box rows per program."""
BLOCK_COLS = 128
"""Default innermost-dim elements per program (2048 elements, 8 KB of int32, per program: with
4 warps, 122 registers and no spills for sm_90; see docs/kernels.md)."""


@dataclass(frozen=True, slots=True)
class Descriptors:
    """A validated, normalized table; see the module docstring for the columns."""

    copies: torch.Tensor  # [num_copies, NUM_FIELDS] int64, on `device`
    tiles: torch.Tensor  # [num_tiles, 3] int64, on `device`
    nbytes: int
    """Buffer bytes the table needs."""
    buffer_overlap: bool
    """True when two boxes cover some of the same buffer bytes (then it cannot pack)."""
    device: torch.device | None
    block_rows: int
    block_cols: int
    tensors: tuple[torch.Tensor, ...]
    """The addressed tensors: the table holds raw addresses, so it keeps their storage alive."""

    @property
    def num_copies(self) -> int:
        return self.copies.shape[0]

    @property
    def num_tiles(self) -> int:
        return self.tiles.shape[0]


def build_descriptors(copies: Sequence[Any], tensors: Sequence[torch.Tensor], *,
                      block_rows: int = BLOCK_ROWS, block_cols: int = BLOCK_COLS) -> Descriptors:
    """Validate BoxCopy-like copies (read by attribute: tensor, offset, shape, strides,
    buffer_offset) against the tensors and build the launch tables.

    Raises ValueError, before any byte moves, for a tensor index out of range, shape and strides
    of different lengths, a negative size or buffer offset, a box outside its tensor, an element
    size other than 1, 2 or 4 bytes, tensors on several devices, or a box of more than MAX_RANK
    dims that cannot be merged.
    """
    cols = _columns(copies, tensors)
    device, count = cols["device"], len(cols["tensor"])
    if not count:
        empty = torch.zeros((0, NUM_FIELDS), dtype=torch.int64, device=device)
        return Descriptors(empty, torch.zeros((0, 3), dtype=torch.int64, device=device),
                           cols["nbytes"], cols["overlap"], device, block_rows, block_cols,
                           tuple(tensors))
    shape, strides = _merge_dims(cols["shape"], cols["strides"])
    rank = (shape > 1).sum(dim=1)
    if bool((rank > MAX_RANK).any()):
        i = int((rank > MAX_RANK).nonzero()[0, 0])
        raise ValueError(
            f"{copies[int(cols['index'][i])]} has {int(rank[i])} dims that cannot be merged (dims "
            f"merge when one is contiguous with the next); the copy kernels support at most "
            f"{MAX_RANK}. Split the box into several boxes along its outer dims, or raise "
            "MAX_RANK as kernels/descriptors.py describes")
    # Right-align the dims in MAX_RANK columns (padding: size 1, stride 0).
    shape = torch.cat([torch.ones((count, MAX_RANK), dtype=torch.int64), shape], 1)[:, -MAX_RANK:]
    strides = torch.cat([torch.zeros((count, MAX_RANK), dtype=torch.int64), strides],
                        1)[:, -MAX_RANK:]
    addr = cols["data_ptr"] + cols["offset"] * cols["itemsize"]
    buf, esize = cols["buffer_offset"], cols["itemsize"]
    shape, strides, esize = _widen(addr, buf, shape, strides, esize)
    addr, buf, esize, shape, strides = _fold(addr, buf, esize, shape, strides, block_cols)
    nrows = shape[:, 0] * shape[:, 1] * shape[:, 2]
    if bool((nrows >= 2**31).any()):  # the kernels split row indices in int32
        i = int((nrows >= 2**31).nonzero()[0, 0])
        raise ValueError(f"{copies[int(cols['index'][i])]} has {int(nrows[i])} rows (all dims "
                         "but the innermost); the kernels take fewer than 2**31: split the box")
    table = torch.stack([addr, buf, esize, nrows, shape[:, 1], shape[:, 2], shape[:, 3],
                         *strides.unbind(1)], dim=1)
    tiles = _tiles(table, block_rows, block_cols)
    return Descriptors(table.to(device), tiles.to(device), cols["nbytes"], cols["overlap"],
                       device, block_rows, block_cols, tuple(tensors))


def _columns(copies: Sequence[Any], tensors: Sequence[torch.Tensor]) -> dict[str, Any]:
    """Read and validate the copies; drop empty boxes. Returns int64 columns (CPU)."""
    for c in copies:
        if len(c.shape) != len(c.strides):
            raise ValueError(f"{c} has {len(c.shape)} sizes but {len(c.strides)} strides; give "
                             "one stride per box dim")
    rank = max((len(c.shape) for c in copies), default=0)
    ones, zeros = (1,) * rank, (0,) * rank
    try:
        cols = torch.tensor([(c.tensor, c.offset, c.buffer_offset, *ones[len(c.shape):], *c.shape,
                              *zeros[len(c.strides):], *c.strides) for c in copies],
                            dtype=torch.int64).reshape(len(copies), 3 + 2 * rank)
    except (TypeError, ValueError, RuntimeError, OverflowError) as e:
        raise ValueError(f"every BoxCopy field must be an int (or a tuple of ints) that fits in "
                         f"int64: {e}") from None
    tensor, offset, boff = cols[:, 0], cols[:, 1], cols[:, 2]
    shape, strides = cols[:, 3:3 + rank], cols[:, 3 + rank:]

    def first(bad: torch.Tensor) -> Any:
        return copies[int(bad.nonzero()[0, 0])] if bool(bad.any()) else None

    if (c := first((tensor < 0) | (tensor >= len(tensors)))) is not None:
        raise ValueError(f"{c} addresses tensor {c.tensor}, but only {len(tensors)} tensors were "
                         "given; pass every tensor the copies name, in the order they index them")
    if (c := first((shape < 0).any(dim=1))) is not None:
        raise ValueError(f"{c} has a negative size; box sizes must be >= 0")
    if (c := first(boff < 0)) is not None:
        raise ValueError(f"{c} has a negative buffer_offset; buffer offsets are bytes from the "
                         "start of the buffer")
    used = sorted(set(tensor.tolist()))
    for i in used:
        t = tensors[i]
        if t.element_size() not in SUPPORTED_ITEMSIZES or t.is_quantized or t.is_complex():
            raise ValueError(
                f"tensor {i} has dtype {t.dtype} ({t.element_size()} bytes per element); the copy "
                f"kernels move elements of {SUPPORTED_ITEMSIZES} bytes. View it as one of those "
                "(e.g. tensor.view(torch.int32) for 8-byte types) and describe the boxes over "
                "that view")
    devices = {tensors[i].device for i in used}
    if len(devices) > 1:
        raise ValueError(f"the copies address tensors on several devices "
                         f"{sorted(map(str, devices))}; build one table per device")
    info = torch.zeros((len(tensors), 3), dtype=torch.int64)  # itemsize, span, data_ptr
    for i in used:
        t = tensors[i]
        span = 0 if t.numel() == 0 else 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
        info[i] = torch.tensor([t.element_size(), span, t.data_ptr()])
    itemsize, span, data_ptr = info[tensor].unbind(1)
    numel = shape.prod(dim=1)
    reach = (shape - 1).clamp(min=0) * strides
    lo = offset + reach.clamp(max=0).sum(dim=1)
    hi = offset + reach.clamp(min=0).sum(dim=1)
    if (c := first((numel > 0) & ((lo < 0) | (hi >= span)))) is not None:
        t = tensors[c.tensor]
        raise ValueError(
            f"{c} reaches outside tensor {c.tensor} (shape {tuple(t.shape)}, strides "
            f"{t.stride()}), whose elements lie at storage offsets 0..{int(info[c.tensor, 1]) - 1} "
            "from its first element; fix the box's offset, shape or strides")
    keep = (numel > 0).nonzero()[:, 0]
    end = boff + numel * itemsize
    s, e = boff[keep], end[keep]
    order = torch.argsort(s, stable=True)
    return {
        "index": keep, "tensor": tensor[keep], "offset": offset[keep], "shape": shape[keep],
        "strides": strides[keep], "buffer_offset": s, "itemsize": itemsize[keep],
        "data_ptr": data_ptr[keep], "device": next(iter(devices)) if devices else None,
        "nbytes": int(e.max()) if len(e) else 0,
        "overlap": bool((e[order][:-1] > s[order][1:]).any()) if len(s) > 1 else False,
    }


def _merge_dims(shape: torch.Tensor, strides: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop size-1 dims and merge each dim into the next outer one when they are contiguous
    (``strides[d] == strides[d+1] * shape[d+1]``); remaining dims end up on the right."""
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
    order = torch.argsort((shape != 1).to(torch.int8), dim=1, stable=True)
    return shape.gather(1, order), strides.gather(1, order)


def _widen(addr: torch.Tensor, buf: torch.Tensor, shape: torch.Tensor, strides: torch.Tensor,
           esize: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Move k contiguous innermost elements as one wider element where that is exact."""
    shape, strides, esize = shape.clone(), strides.clone(), esize.clone()
    for wide in (4, 2):
        k = wide // esize  # 0 where the element is already wider
        ok = (k > 1) & (strides[:, -1] == 1) & (addr % wide == 0) & (buf % wide == 0)
        k = torch.where(ok, k, 1)
        ok &= (shape[:, -1] % k == 0) & (strides[:, :-1] % k[:, None] == 0).all(dim=1)
        k = torch.where(ok, k, 1)
        shape[:, -1] //= k
        strides[:, :-1] //= k[:, None]
        esize *= k
    return shape, strides, esize


def _fold(addr, buf, esize, shape, strides, block_cols: int):
    """Give boxes with a long innermost dim full-width tiles (exact: the buffer stays row-major).

    A 1-d box longer than block_cols becomes (N // block_cols, block_cols) plus a 1-d tail box;
    a box of rank 2 or 3 whose innermost dim is a multiple of block_cols gets that dim split
    into (N3 // block_cols, block_cols), so a (2, 1024) shard is 16 full rows, not 2 sparse ones.
    """
    n, s = shape[:, -1], strides[:, -1]
    one_d = (shape[:, :-1] == 1).all(dim=1) & (n > block_cols)
    split = ~one_d & (shape[:, 0] == 1) & (n > block_cols) & (n % block_cols == 0)
    shape, strides = shape.clone(), strides.clone()
    shape[split, :-2], strides[split, :-2] = shape[split, 1:-1], strides[split, 1:-1]
    for m in (one_d, split):
        shape[m, -2], shape[m, -1] = n[m] // block_cols, block_cols
        strides[m, -2] = s[m] * block_cols
    tail = one_d & (n % block_cols > 0)
    full = n // block_cols * block_cols
    t_shape = torch.ones_like(shape[tail])
    t_shape[:, -1] = n[tail] % block_cols
    t_strides = torch.zeros_like(strides[tail])
    t_strides[:, -1] = s[tail]
    return (torch.cat([addr, addr[tail] + full[tail] * s[tail] * esize[tail]]),
            torch.cat([buf, buf[tail] + full[tail] * esize[tail]]),
            torch.cat([esize, esize[tail]]),
            torch.cat([shape, t_shape]), torch.cat([strides, t_strides]))


def _tiles(table: torch.Tensor, block_rows: int, block_cols: int) -> torch.Tensor:
    """(copy row, first row, first column) of every program, copy by copy."""
    row_tiles = (table[:, NROWS] + block_rows - 1) // block_rows
    col_tiles = (table[:, N3] + block_cols - 1) // block_cols
    count = row_tiles * col_tiles
    copy = torch.repeat_interleave(torch.arange(len(table)), count)
    local = torch.arange(int(count.sum())) - (torch.cumsum(count, 0) - count)[copy]
    return torch.stack([copy, local // col_tiles[copy] * block_rows,
                        local % col_tiles[copy] * block_cols], dim=1)
