"""Pack: gather a round's boxes from many tensors into one contiguous byte buffer, one launch.

Each program moves one tile of one box (see kernels/descriptors.py for the tables), or, for a
block-quantizing box, quantizes one whole block (kernels/_quantize.py); the tensors are reached
through the addresses in the descriptor table, so one launch serves every tensor.

Typical usage::

    desc = build_descriptors(copies, tensors)   # once per plan
    pack(desc, send_buffer)                      # per round
"""

import torch
import triton
import triton.language as tl

from kernels._convert import _convert
from kernels._launch import check_launch
from kernels._quantize import _quant_block
from kernels._tile import _box_tile, _move
from kernels.descriptors import NUM_FIELDS, Descriptors


@triton.jit(do_not_specialize=["buffer_address"])
def _pack_kernel(copies,  # *int64 [C, NUM_FIELDS] box descriptors
                 tiles,  # *int64 [T, 3] (copy row, first row, first column) per program
                 buffer_address,  # int64 address of the buffer's first byte
                 NUM_FIELDS: tl.constexpr,  # columns of `copies`
                 BLOCK_ROWS: tl.constexpr,  # box rows per program
                 BLOCK_COLS: tl.constexpr):  # innermost-dim elements per program
    pid = tl.program_id(0).to(tl.int64)
    d = copies + tl.load(tiles + pid * 3) * NUM_FIELDS
    if tl.load(d + 15) != 0:  # QKIND: a block-quantizing box, one whole block per program
        _quant_block(d, tl.load(tiles + pid * 3 + 1), tl.load(tiles + pid * 3 + 2),
                     buffer_address, BLOCK_ROWS, BLOCK_COLS)
    else:
        addr, buf, esize, tensor_offsets, buffer_indices, mask, tcode, bcode = _box_tile(
            copies, tiles, NUM_FIELDS, BLOCK_ROWS, BLOCK_COLS)
        if tcode == 0:
            _move(addr, tensor_offsets, buffer_address + buf, buffer_indices, mask, esize)
        else:  # a converting box: tensor dtype -> buffer dtype, round to nearest even
            _convert(addr, tensor_offsets, tcode, buffer_address + buf, buffer_indices, bcode,
                     mask)


def pack(desc: Descriptors, buffer: torch.Tensor, *, num_warps: int = 4) -> None:
    """Gather every box of ``desc`` into ``buffer`` (1-d contiguous uint8, >= desc.nbytes)."""
    check_launch(desc, buffer)
    if desc.buffer_overlap:
        raise ValueError("two copies of this table write overlapping buffer bytes, so packing it "
                         "would depend on the order of the copies; give each box its own "
                         "buffer range (assemble allows shared ranges, pack does not)")
    if desc.num_tiles == 0:
        return
    _pack_kernel[(desc.num_tiles,)](desc.copies, desc.tiles, buffer.data_ptr(),
                                    NUM_FIELDS=NUM_FIELDS, BLOCK_ROWS=desc.block_rows,
                                    BLOCK_COLS=desc.block_cols, num_warps=num_warps)
