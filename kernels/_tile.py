"""Triton helpers shared by the pack and assemble kernels: where a program's tile lies, and how
its elements move (as int8/int16/int32 bits, or byte by byte when an address is unaligned)."""

import triton
import triton.language as tl


@triton.jit
def _box_tile(copies,  # *int64 [C, NUM_FIELDS] box descriptors (kernels/descriptors.py)
              tiles,  # *int64 [T, 3] (copy row, first row, first column) per program
              NUM_FIELDS: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """This program's box: (tensor address, buffer byte offset, element size, element offsets
    in the tensor, element indices in the buffer box, mask, tensor dtype code, buffer dtype
    code), offsets [BLOCK_ROWS, BLOCK_COLS]; the codes are 0 for a plain box (kernels/_convert)."""
    pid = tl.program_id(0).to(tl.int64)
    copy = tl.load(tiles + pid * 3)
    row0 = tl.load(tiles + pid * 3 + 1)
    col0 = tl.load(tiles + pid * 3 + 2)
    d = copies + copy * NUM_FIELDS  # ADDR BUF ESIZE NROWS N1 N2 N3 S0 S1 S2 S3 TCODE BCODE
    addr = tl.load(d + 0)
    buf = tl.load(d + 1)
    esize = tl.load(d + 2)
    nrows = tl.load(d + 3)
    n1 = tl.load(d + 4)
    n2 = tl.load(d + 5)
    n3 = tl.load(d + 6)
    s0 = tl.load(d + 7)
    s1 = tl.load(d + 8)
    s2 = tl.load(d + 9)
    s3 = tl.load(d + 10)
    tcode = tl.load(d + 11)
    bcode = tl.load(d + 12)
    rows = row0 + tl.arange(0, BLOCK_ROWS).to(tl.int64)
    cols = col0 + tl.arange(0, BLOCK_COLS).to(tl.int64)
    if nrows == n2:  # rank <= 2 (dims 0 and 1 have size 1): no division at all
        row_offsets = rows * s2
    else:  # row index -> (i0, i1, i2), in int32 (build_descriptors keeps NROWS < 2**31)
        r = rows.to(tl.int32)
        i2 = r % n2.to(tl.int32)
        q = r // n2.to(tl.int32)
        i1 = q % n1.to(tl.int32)
        i0 = q // n1.to(tl.int32)
        row_offsets = i0.to(tl.int64) * s0 + i1.to(tl.int64) * s1 + i2.to(tl.int64) * s2
    tensor_offsets = row_offsets[:, None] + cols[None, :] * s3
    buffer_indices = rows[:, None] * n3 + cols[None, :]  # the box is row-major in the buffer
    mask = (rows < nrows)[:, None] & (cols < n3)[None, :]
    return addr, buf, esize, tensor_offsets, buffer_indices, mask, tcode, bcode


@triton.jit
def _move_as(src, src_offsets, dst, dst_offsets, mask, DTYPE: tl.constexpr):
    """Copy elements of DTYPE (naturally aligned addresses) from src to dst."""
    values = tl.load(src.to(tl.pointer_type(DTYPE)) + src_offsets, mask=mask)
    tl.store(dst.to(tl.pointer_type(DTYPE)) + dst_offsets, values, mask=mask)


@triton.jit
def _move_bytes(src, src_offsets, dst, dst_offsets, mask, ESIZE: tl.constexpr):
    """Copy ESIZE-byte elements one byte at a time (any alignment)."""
    for j in tl.static_range(ESIZE):
        values = tl.load(src.to(tl.pointer_type(tl.int8)) + src_offsets * ESIZE + j, mask=mask)
        tl.store(dst.to(tl.pointer_type(tl.int8)) + dst_offsets * ESIZE + j, values, mask=mask)


@triton.jit
def _move(src, src_offsets, dst, dst_offsets, mask, esize):
    """Copy elements of esize bytes between two addresses (ints), element offsets given."""
    aligned = (src % esize == 0) & (dst % esize == 0)
    if esize == 4:
        if aligned:
            _move_as(src, src_offsets, dst, dst_offsets, mask, tl.int32)
        else:
            _move_bytes(src, src_offsets, dst, dst_offsets, mask, 4)
    elif esize == 2:
        if aligned:
            _move_as(src, src_offsets, dst, dst_offsets, mask, tl.int16)
        else:
            _move_bytes(src, src_offsets, dst, dst_offsets, mask, 2)
    else:
        _move_as(src, src_offsets, dst, dst_offsets, mask, tl.int8)
