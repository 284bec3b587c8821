"""Descriptor tables for the pack and assemble kernels, built once per plan.

Imports only torch and weightbridge's copy validation (`copy_columns`, `merge_dims`: the one
definition of a valid `BoxCopy` table, shared with the CPU path): the tables can be built (and
inspected, and benchmarked) without Triton or a GPU. A table has two int64 tensors on the
tensors' device:

``copies`` [C, NUM_FIELDS], one row per (normalized) box:

    ADDR   address of the box's first element in its tensor (data_ptr + offset * itemsize)
    BUF    byte offset of the box in the buffer
    ESIZE  bytes per moved element: 1, 2 or 4 (moved as int8/int16/int32 bits)
    NROWS  N0 * N1 * N2: rows of the box (every dim but the innermost)
    N1, N2, N3     sizes of dims 1..3 (dim 0 is NROWS / (N1 * N2)); N3 is the innermost dim
    S0, S1, S2, S3 strides of dims 0..3 in elements of ESIZE bytes, any sign
    TCODE, BCODE   0 for a plain box; for a converting box (a ``buffer_dtype``) the dtype codes
                   of the tensor and of the buffer elements (kernels/_convert.py): the box is
                   then moved by value, and ESIZE and strides are the tensor's
    BM, BK, QKIND  a block-quantizing box (a ``block``; pack only, kernels/_quantize.py): its
                   block shape and 1 for float8 values, 2 for float32 scales; 0 otherwise.
                   Such a box is never normalized: NROWS x N3 is its 2-d shape, S2 and S3
                   its strides, and it has one program per block

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

from weightbridge.execution.boxcopy import MAX_RANK, check_rank, copy_columns, merge_dims
from weightbridge.types import QUANT_DTYPE

# MAX_RANK (weightbridge.execution.boxcopy) is the number of box dims the kernels address after
# merging. To raise it: add N/S fields here, pad to the new rank where `merge_dims` is called,
# and decompose the extra row dims in `kernels/_tile.py`.
ADDR, BUF, ESIZE, NROWS, N1, N2, N3, S0, S1, S2, S3, TCODE, BCODE, BM, BK, QKIND = range(16)
NUM_FIELDS = 16
DTYPE_CODES = {"float32": 1, "bfloat16": 2, "float16": 3}
"""TCODE / BCODE of each convertible dtype; the branches of kernels/_convert.py use them."""
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
    num_quantizing: int = 0
    """Block-quantizing boxes (their rows come last in `copies`); such a table only packs."""

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
    quant_rows, quant_tiles = _quantizing(copies, tensors, cols)
    if quant_rows is not None:  # the other boxes' table, then the block boxes' rows
        return _with_quantizing(build_descriptors(
            [c for c in copies if not getattr(c, "block", ())], tensors, block_rows=block_rows,
            block_cols=block_cols), quant_rows, quant_tiles, cols)
    device, count = cols["device"], len(cols["tensor"])
    if not count:
        empty = torch.zeros((0, NUM_FIELDS), dtype=torch.int64, device=device)
        return Descriptors(empty, torch.zeros((0, 3), dtype=torch.int64, device=device),
                           cols["nbytes"], cols["overlap"], device, block_rows, block_cols,
                           tuple(tensors))
    shape, strides = merge_dims(cols["shape"], cols["strides"])
    check_rank(copies, cols["index"], shape)
    # Right-align the dims in MAX_RANK columns (padding: size 1, stride 0).
    shape = torch.cat([torch.ones((count, MAX_RANK), dtype=torch.int64), shape], 1)[:, -MAX_RANK:]
    strides = torch.cat([torch.zeros((count, MAX_RANK), dtype=torch.int64), strides],
                        1)[:, -MAX_RANK:]
    addr = cols["data_ptr"] + cols["offset"] * cols["itemsize"]
    buf, esize, codes = cols["buffer_offset"], cols["itemsize"], cols["codes"]
    shape, strides, esize = _widen(addr, buf, shape, strides, esize, codes[:, 0] == 0)
    addr, buf, esize, shape, strides, codes = _fold(addr, buf, esize, shape, strides, codes,
                                                    cols["buffer_itemsize"], block_cols)
    nrows = shape[:, 0] * shape[:, 1] * shape[:, 2]
    if bool((nrows >= 2**31).any()):  # the kernels split row indices in int32
        i = int((nrows >= 2**31).nonzero()[0, 0])
        raise ValueError(f"{copies[int(cols['index'][i])]} has {int(nrows[i])} rows (all dims "
                         "but the innermost); the kernels take fewer than 2**31: split the box")
    zero = torch.zeros_like(addr)
    table = torch.stack([addr, buf, esize, nrows, shape[:, 1], shape[:, 2], shape[:, 3],
                         *strides.unbind(1), *codes.unbind(1), zero, zero, zero], dim=1)
    tiles = _tiles(table, block_rows, block_cols)
    return Descriptors(table.to(device), tiles.to(device), cols["nbytes"], cols["overlap"],
                       device, block_rows, block_cols, tuple(tensors))


def _columns(copies: Sequence[Any], tensors: Sequence[torch.Tensor]) -> dict[str, Any]:
    """Validate the copies (`weightbridge`'s one definition of a valid BoxCopy table) and drop
    empty boxes. Returns int64 columns (CPU) plus each box's tensor address."""
    cols = copy_columns(copies, tensors)
    keep = (cols.numel > 0).nonzero()[:, 0]
    used = sorted(set(cols.tensor.tolist()))
    data_ptr = torch.zeros(len(tensors), dtype=torch.int64)
    for i in used:
        data_ptr[i] = tensors[i].data_ptr()
    devices = {tensors[i].device for i in used}  # one at most: copy_columns checks it
    return {
        "index": keep, "tensor": cols.tensor[keep], "offset": cols.offset[keep],
        "shape": cols.shape[keep], "strides": cols.strides[keep],
        "buffer_offset": cols.buffer_offset[keep], "itemsize": cols.itemsize[keep],
        "data_ptr": data_ptr[cols.tensor[keep]], "device": next(iter(devices), None),
        "codes": _dtype_codes(copies, tensors, cols.converting)[keep],
        "quant": torch.tensor([bool(getattr(copies[i], "block", ())) for i in keep.tolist()],
                              dtype=torch.bool),
        "buffer_itemsize": cols.buffer_itemsize[keep],
        "nbytes": cols.nbytes, "overlap": cols.buffer_overlap,
    }


def _dtype_codes(copies: Sequence[Any], tensors: Sequence[torch.Tensor],
                 converting: torch.Tensor) -> torch.Tensor:
    """[C, 2] (tensor dtype code, buffer dtype code) per copy; zeros for plain copies."""
    codes = torch.zeros((len(copies), 2), dtype=torch.int64)
    for i in converting.nonzero()[:, 0].tolist():
        c = copies[i]
        if getattr(c, "block", ()):
            continue  # _quantizing codes them
        codes[i, 0] = DTYPE_CODES[str(tensors[c.tensor].dtype).removeprefix("torch.")]
        codes[i, 1] = DTYPE_CODES[c.buffer_dtype]
    return codes


def _widen(addr: torch.Tensor, buf: torch.Tensor, shape: torch.Tensor, strides: torch.Tensor,
           esize: torch.Tensor, plain: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Move k contiguous innermost elements as one wider element where that is exact (plain
    boxes only: a converting box moves values)."""
    shape, strides, esize = shape.clone(), strides.clone(), esize.clone()
    for wide in (4, 2):
        k = wide // esize  # 0 where the element is already wider
        ok = plain & (k > 1) & (strides[:, -1] == 1) & (addr % wide == 0) & (buf % wide == 0)
        k = torch.where(ok, k, 1)
        ok &= (shape[:, -1] % k == 0) & (strides[:, :-1] % k[:, None] == 0).all(dim=1)
        k = torch.where(ok, k, 1)
        shape[:, -1] //= k
        strides[:, :-1] //= k[:, None]
        esize *= k
    return shape, strides, esize


def _fold(addr, buf, esize, shape, strides, codes, buffer_itemsize, block_cols: int):
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
    # A converting box's buffer elements have the buffer dtype's size; a plain one's ESIZE.
    bsize = torch.where(codes[:, 0] == 0, esize, buffer_itemsize)
    return (torch.cat([addr, addr[tail] + full[tail] * s[tail] * esize[tail]]),
            torch.cat([buf, buf[tail] + full[tail] * bsize[tail]]),
            torch.cat([esize, esize[tail]]),
            torch.cat([shape, t_shape]), torch.cat([strides, t_strides]),
            torch.cat([codes, codes[tail]]))


def _tiles(table: torch.Tensor, block_rows: int, block_cols: int) -> torch.Tensor:
    """(copy row, first row, first column) of every program, copy by copy."""
    row_tiles = (table[:, NROWS] + block_rows - 1) // block_rows
    col_tiles = (table[:, N3] + block_cols - 1) // block_cols
    count = row_tiles * col_tiles
    copy = torch.repeat_interleave(torch.arange(len(table)), count)
    local = torch.arange(int(count.sum())) - (torch.cumsum(count, 0) - count)[copy]
    return torch.stack([copy, local // col_tiles[copy] * block_rows,
                        local % col_tiles[copy] * block_cols], dim=1)


def _quantizing(copies: Sequence[Any], tensors: Sequence[torch.Tensor], cols: dict[str, Any]
                ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Rows and tiles (copy row relative to the first block box, block's first row and column)
    of the block-quantizing boxes, or (None, None) when there are none. Validated already."""
    index = cols["index"][cols["quant"]].tolist()
    if not index:
        return None, None
    rows, tiles = [], []
    for k, i in enumerate(index):
        c = copies[i]
        t = tensors[c.tensor]
        bm, bk = c.block
        code = DTYPE_CODES[str(t.dtype).removeprefix("torch.")]
        rows.append([t.data_ptr() + c.offset * t.element_size(), c.buffer_offset,
                     t.element_size(), c.shape[0], 1, c.shape[0], c.shape[1], 0, 0,
                     c.strides[0], c.strides[1], code, 0, bm, bk,
                     1 if c.buffer_dtype == QUANT_DTYPE else 2])
        tiles += [(k, r, col) for r in range(0, c.shape[0], bm)
                  for col in range(0, c.shape[1], bk)]
    return (torch.tensor(rows, dtype=torch.int64), torch.tensor(tiles, dtype=torch.int64))


def _with_quantizing(desc: Descriptors, rows: torch.Tensor, tiles: torch.Tensor,
                     cols: dict[str, Any]) -> Descriptors:
    """``desc`` (the other boxes) with the block boxes' rows and tiles appended; buffer size
    and overlap those of all boxes (``cols``)."""
    device = cols["device"]
    tiles = tiles.clone()
    tiles[:, 0] += desc.num_copies
    return Descriptors(torch.cat([desc.copies.to(device), rows.to(device)]),
                       torch.cat([desc.tiles.to(device), tiles.to(device)]), cols["nbytes"],
                       cols["overlap"], device, desc.block_rows, desc.block_cols, desc.tensors,
                       len(rows))
