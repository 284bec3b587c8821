"""Triton helpers for converting boxes: elements cast between float32, bfloat16 and float16.

A box with a ``buffer_dtype`` (a plan's dtype conversion: float32 trainer weights sent as the
bfloat16 the rollouts load) is moved by value instead of by bits, inside the same pack or
assemble launch. Every value goes through float32, exactly (bfloat16 and float16 widen
exactly), and is rounded once, to nearest even, as torch's casts round: to bfloat16 by integer
arithmetic on the float32 bits (torch's formula; NaN -> 0x7FFF, as torch's CUDA casts give),
exact on every backend and in the interpreter; to float16 by the hardware conversion in
round-to-nearest-even mode. Dtype codes: 1 float32, 2 bfloat16, 3 float16
(`kernels.descriptors.DTYPE_CODES`); 0
marks a plain box.
"""

import triton
import triton.language as tl


@triton.jit
def _load_f32(ptr, offsets, mask, code):
    """Elements of dtype ``code`` at ``ptr`` (an int address), widened exactly to float32."""
    if code == 1:
        x = tl.load(ptr.to(tl.pointer_type(tl.float32)) + offsets, mask=mask)
    elif code == 2:
        b = tl.load(ptr.to(tl.pointer_type(tl.int16)) + offsets, mask=mask)
        x = ((b.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    else:
        x = tl.load(ptr.to(tl.pointer_type(tl.float16)) + offsets, mask=mask).to(tl.float32)
    return x


@triton.jit
def _store_f32(ptr, offsets, x, mask, code):
    """Store float32 ``x`` as dtype ``code``, rounding to nearest even."""
    if code == 1:
        tl.store(ptr.to(tl.pointer_type(tl.float32)) + offsets, x, mask=mask)
    elif code == 2:
        u = x.to(tl.int32, bitcast=True)
        # torch's round_to_nearest_even: add 0x7FFF plus the lowest kept bit, keep the top half.
        # Logical shifts on int32 bits: mask off the sign extension of the arithmetic shift.
        r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
        r = tl.where(x != x, 0x7FFF, r)
        tl.store(ptr.to(tl.pointer_type(tl.int16)) + offsets, r.to(tl.int16), mask=mask)
    else:
        tl.store(ptr.to(tl.pointer_type(tl.float16)) + offsets,
                 x.to(tl.float16, fp_downcast_rounding="rtne"), mask=mask)


@triton.jit
def _convert(src, src_offsets, src_code, dst, dst_offsets, dst_code, mask):
    """Cast elements of dtype ``src_code`` at ``src`` into dtype ``dst_code`` at ``dst``."""
    _store_f32(dst, dst_offsets, _load_f32(src, src_offsets, mask, src_code), mask, dst_code)
