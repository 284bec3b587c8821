"""Triton helpers for block-quantizing boxes: one program quantizes one whole block.

A box with a ``block`` (a trainer's pack for block-scaled FP8 rollouts) is packed by value in
the same launch as the round's other boxes: its program reads the block's elements (widened
exactly to float32, `kernels._convert`), takes their amax, and writes either the block's float32
scale or its float8_e4m3fn values, with vLLM's formula step for step (`weightbridge.quant`):
``scale = max(amax, 1e-4) / 448`` and ``q = fp8(x * (1 / scale))``, both divisions correctly
rounded (``div_rn``), the product a plain float32 multiply. The float8 rounding is torch's own
conversion by integer arithmetic on the float32 bits (c10's ``fp8e4m3fn_from_fp32_value``:
round to nearest even, subnormals through one float32 add, NaN from 480 up), so the bits are
torch's on every backend and in the interpreter, whose own float8 cast does not round so.
"""

import triton
import triton.language as tl

from kernels._convert import _load_f32


@triton.jit
def _fp8_bits(x):
    """float32 -> float8_e4m3fn bits (int32 in 0..255), exactly as torch converts."""
    u = x.to(tl.int32, bitcast=True)
    sign = (u >> 24) & 0x80
    a = u & 0x7FFFFFFF
    af = a.to(tl.float32, bitcast=True)
    # Subnormal range (< 2**-6): adding 2**14 rounds to a multiple of 2**-9, nearest even.
    sub = (af + 16384.0).to(tl.int32, bitcast=True) - (141 << 23)
    odd = (a >> 20) & 1
    normal = (a + (((7 - 127) << 23) + 0x7FFFF) + odd) >> 20
    r = tl.where(a < (121 << 23), sub, normal)
    r = tl.where(a >= (1087 << 20), 0x7F, r)
    return r | sign


@triton.jit
def _block_amax(addr, row0, col0, r_end, c_end, s_row, s_col, tcode,
                BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """Largest |x| over rows [row0, r_end) and columns [col0, c_end) of the box, in float32."""
    amax = tl.zeros((BLOCK_ROWS, BLOCK_COLS), dtype=tl.float32)
    for r in range(row0, r_end, BLOCK_ROWS):
        rows = r + tl.arange(0, BLOCK_ROWS).to(tl.int64)
        for c in range(col0, c_end, BLOCK_COLS):
            cols = c + tl.arange(0, BLOCK_COLS).to(tl.int64)
            mask = (rows < r_end)[:, None] & (cols < c_end)[None, :]
            x = _load_f32(addr, rows[:, None] * s_row + cols[None, :] * s_col, mask, tcode)
            amax = tl.maximum(amax, tl.where(mask, tl.abs(x), 0.0))
    return tl.max(tl.max(amax, axis=1), axis=0)


@triton.jit
def _quant_block(d, row0, col0, buffer_address,
                 BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """Quantize the block at (row0, col0) of the block box whose descriptor row is at ``d``
    (fields ADDR BUF ESIZE NROWS N1 N2 N3 S0 S1 S2 S3 TCODE BCODE BM BK QKIND)."""
    addr = tl.load(d + 0)
    buf = tl.load(d + 1)
    nrows = tl.load(d + 3)
    ncols = tl.load(d + 6)
    s_row = tl.load(d + 9)
    s_col = tl.load(d + 10)
    tcode = tl.load(d + 11)
    bm = tl.load(d + 13)
    bk = tl.load(d + 14)
    qkind = tl.load(d + 15)
    r_end = tl.minimum(row0 + bm, nrows)
    c_end = tl.minimum(col0 + bk, ncols)
    amax = _block_amax(addr, row0, col0, r_end, c_end, s_row, s_col, tcode,
                       BLOCK_ROWS, BLOCK_COLS)
    scale = tl.math.div_rn(tl.maximum(amax, 1e-4), 448.0)
    if qkind == 2:  # the block's scale, row-major over the block grid
        grid_cols = (ncols + bk - 1) // bk
        at = buffer_address + buf + 4 * ((row0 // bm) * grid_cols + col0 // bk)
        tl.store(at.to(tl.pointer_type(tl.float32)), scale)
    else:  # its values, row-major over the box
        inverse = tl.math.div_rn(1.0, scale)
        out = (buffer_address + buf).to(tl.pointer_type(tl.int8))
        for r in range(row0, r_end, BLOCK_ROWS):
            rows = r + tl.arange(0, BLOCK_ROWS).to(tl.int64)
            for c in range(col0, c_end, BLOCK_COLS):
                cols = c + tl.arange(0, BLOCK_COLS).to(tl.int64)
                mask = (rows < r_end)[:, None] & (cols < c_end)[None, :]
                x = _load_f32(addr, rows[:, None] * s_row + cols[None, :] * s_col, mask, tcode)
                q = _fp8_bits(x * inverse)
                tl.store(out + rows[:, None] * ncols + cols[None, :], q.to(tl.int8), mask=mask)
