"""Assemble: scatter a received buffer's boxes into many tensors, one launch.

The same descriptors as pack, read in the other direction. A box whose tensor is a forwarding
buffer (a uint8 tensor, 1-d boxes) copies received bytes on for the exchange stages, in the same
launch; such boxes are widened to 4-byte moves where aligned.

Typical usage::

    desc = build_descriptors(copies, tensors)   # once per plan
    assemble(desc, recv_buffer)                  # per round
"""

import torch
import triton
import triton.language as tl

from kernels._convert import _convert
from kernels._launch import check_launch
from kernels._tile import _box_tile, _move
from kernels.descriptors import NUM_FIELDS, Descriptors


@triton.jit(do_not_specialize=["buffer_address"])
def _assemble_kernel(copies,  # *int64 [C, NUM_FIELDS] box descriptors
                     tiles,  # *int64 [T, 3] (copy row, first row, first column) per program
                     buffer_address,  # int64 address of the buffer's first byte
                     NUM_FIELDS: tl.constexpr,  # columns of `copies`
                     BLOCK_ROWS: tl.constexpr,  # box rows per program
                     BLOCK_COLS: tl.constexpr):  # innermost-dim elements per program
    addr, buf, esize, tensor_offsets, buffer_indices, mask, tcode, bcode = _box_tile(
        copies, tiles, NUM_FIELDS, BLOCK_ROWS, BLOCK_COLS)
    if tcode == 0:
        _move(buffer_address + buf, buffer_indices, addr, tensor_offsets, mask, esize)
    else:  # a converting box: buffer dtype -> tensor dtype
        _convert(buffer_address + buf, buffer_indices, bcode, addr, tensor_offsets, tcode, mask)


def assemble(desc: Descriptors, buffer: torch.Tensor, *, num_warps: int = 4) -> None:
    """Scatter every box of ``desc`` from ``buffer`` (1-d contiguous uint8) into its tensor."""
    check_launch(desc, buffer)
    if desc.num_quantizing:
        raise ValueError(f"this table has {desc.num_quantizing} block-quantizing boxes, which "
                         f"only pack (rollouts receive the float8 values and scales and copy "
                         f"them): build the assemble table without them")
    if desc.num_tiles == 0:
        return
    _assemble_kernel[(desc.num_tiles,)](desc.copies, desc.tiles, buffer.data_ptr(),
                                        NUM_FIELDS=NUM_FIELDS, BLOCK_ROWS=desc.block_rows,
                                        BLOCK_COLS=desc.block_cols, num_warps=num_warps)
