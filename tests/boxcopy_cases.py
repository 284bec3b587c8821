"""Random and hand-made BoxCopy tables, and bit-exact comparison against the torch reference.

Shared by tests/test_boxcopy.py (the CPU path) and tests/test_triton_kernels.py.
"""

from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

from weightbridge.execution.boxcopy import TorchCopyKernels, box_view
from weightbridge.types import BoxCopy

DTYPES = (torch.uint8, torch.int16, torch.bfloat16, torch.float16, torch.float32,
          torch.float8_e4m3fn)
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def random_bits(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """A tensor of random bit patterns (NaN payloads and infinities included for floats)."""
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape) * dtype.itemsize
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).view(dtype).view(shape)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor as integers of its element size: torch.equal on these is bit equality."""
    return t.view(_INT[t.element_size()])


def random_buffer(nbytes: int, seed: int = 1) -> torch.Tensor:
    return random_bits(torch.uint8, (nbytes,), seed)


def box(tensor_index: int, t: torch.Tensor, starts, counts, *, steps=None, reverse=(),
        order=None, buffer_offset: int = 0) -> BoxCopy:
    """A box over tensor ``t``'s logical dims: start/count/step per dim, some dims reversed,
    box dims in ``order`` (a permutation of the tensor dims: a transpose)."""
    steps = steps or [1] * t.dim()
    offset = sum(s * t.stride(d) for d, s in enumerate(starts))
    shape = list(counts)
    strides = [k * t.stride(d) for d, k in enumerate(steps)]
    for d in reverse:
        offset += strides[d] * (shape[d] - 1)
        strides[d] = -strides[d]
    order = order or range(t.dim())
    return BoxCopy(tensor_index, offset, tuple(shape[d] for d in order),
                   tuple(strides[d] for d in order), buffer_offset)


def layout(copies: list[BoxCopy], tensors, gaps) -> tuple[list[BoxCopy], int]:
    """Place the boxes back to back in the buffer with the given byte gaps; returns nbytes.
    A converting box (``buffer_dtype``) is aligned to its buffer dtype, as plans place them."""
    out, pos = [], 0
    for c, gap in zip(copies, gaps):
        pos += gap
        size = tensors[c.tensor].element_size()
        if c.buffer_dtype is not None:
            size = getattr(torch, c.buffer_dtype).itemsize
            pos = -(-pos // size) * size
        out.append(BoxCopy(c.tensor, c.offset, c.shape, c.strides, pos, c.buffer_dtype))
        pos += math.prod(c.shape) * size
    return out, pos


def disjoint(copies: list[BoxCopy], tensors) -> list[BoxCopy]:
    """The copies that touch no tensor element an earlier copy touches (assemble needs this)."""
    marks = [torch.zeros(max(1, t.numel()), dtype=torch.int32) for t in tensors]
    kept = []
    for c in copies:
        t = tensors[c.tensor]
        view, _ = box_view(marks[c.tensor].as_strided(t.shape, t.stride()), c)
        if int(view.sum()) == 0 and int(view.numel()) == len(set(_positions(view))):
            view += 1
            kept.append(c)
    return kept


def _positions(view: torch.Tensor) -> list[int]:
    """Storage offsets of a view's elements (to spot boxes that visit an element twice)."""
    idx = torch.zeros(view.shape, dtype=torch.int64)
    for d, (n, s) in enumerate(zip(view.shape, view.stride())):
        shape = [1] * view.dim()
        shape[d] = n
        idx = idx + (torch.arange(n) * s).view(shape)
    return idx.flatten().tolist()


_FLOATS = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@st.composite
def tables(draw, max_tensors: int = 4, max_copies: int = 8, max_size: int = 12,
           conversions: bool = False):
    """(copies, tensors, nbytes): random tensors (dtypes, shapes, transposed storage) and boxes
    (sub-ranges, steps, reversed dims, permuted dims), packed with random unaligned gaps. With
    ``conversions``, boxes of fp32 / bf16 / fp16 tensors may draw a ``buffer_dtype`` too (their
    tensors then hold finite values: NaN bits are no part of a conversion's contract)."""
    tensors = []
    for i in range(draw(st.integers(1, max_tensors))):
        dtype = draw(st.sampled_from(DTYPES))
        shape = tuple(draw(st.lists(st.integers(1, max_size), min_size=1, max_size=3)))
        make = rounding_values if conversions and dtype in _FLOATS else random_bits
        t = make(dtype, shape, seed=draw(st.integers(0, 2**16)))
        if t.dim() >= 2 and draw(st.booleans()):
            t = make(dtype, shape[::-1], seed=i).transpose(0, -1)  # column-major storage
        tensors.append(t)
    copies = []
    for _ in range(draw(st.integers(1, max_copies))):
        i = draw(st.integers(0, len(tensors) - 1))
        t = tensors[i]
        starts = [draw(st.integers(0, n - 1)) for n in t.shape]
        steps = [draw(st.sampled_from([1, 1, 1, 2, 3])) for _ in t.shape]
        counts = [draw(st.integers(1, (n - s - 1) // k + 1))
                  for n, s, k in zip(t.shape, starts, steps)]
        reverse = [d for d in range(t.dim()) if draw(st.integers(0, 4)) == 0]
        order = draw(st.permutations(range(t.dim())))
        c = box(i, t, starts, counts, steps=steps, reverse=reverse, order=order)
        if conversions and t.dtype in _FLOATS:
            c = BoxCopy(c.tensor, c.offset, c.shape, c.strides, 0,
                        draw(st.sampled_from([None, *_FLOATS.values()])))
        copies.append(c)
    gaps = [draw(st.sampled_from([0, 0, 0, 1, 2, 3, 8])) for _ in copies]
    copies, nbytes = layout(copies, tensors, gaps)
    return copies, tensors, nbytes


def assert_pack_matches_reference(kernels, copies, tensors, nbytes: int, *,
                                  buffer_shift: int = 0, device: str = "cpu") -> None:
    """Pack with ``kernels`` and with the reference into equal random buffers; compare bits.

    ``buffer_shift`` packs into ``buffer[shift:]``, a buffer whose first byte is unaligned.
    """
    ref = TorchCopyKernels()
    tensors = [t.to(device) for t in tensors]
    expected = random_buffer(nbytes + buffer_shift + 5).to(device)
    got = expected.clone()
    ref.pack(ref.build_table(copies, tensors), expected[buffer_shift:])
    kernels.pack(kernels.build_table(copies, tensors), got[buffer_shift:])
    assert torch.equal(got, expected)


def assert_assemble_matches_reference(kernels, copies, tensors, nbytes: int, *,
                                      buffer_shift: int = 0, device: str = "cpu") -> None:
    """Assemble a random buffer into copies of the tensors with both; compare every bit."""
    ref = TorchCopyKernels()
    buffer = random_buffer(nbytes + buffer_shift + 5, seed=7).to(device)
    expected = [t.to(device, copy=True) for t in tensors]
    got = [t.to(device, copy=True) for t in tensors]
    ref.assemble(ref.build_table(copies, expected), buffer[buffer_shift:])
    kernels.assemble(kernels.build_table(copies, got), buffer[buffer_shift:])
    for e, g in zip(expected, got):
        assert torch.equal(bits(g), bits(e))


def bad_tables() -> dict[str, tuple[list[BoxCopy], list[torch.Tensor], str]]:
    """Tables a user can get wrong: name -> (copies, tensors, part of the ValueError message)."""
    t = torch.zeros((4, 6), dtype=torch.bfloat16)
    return {
        "tensor index": ([BoxCopy(1, 0, (2,), (1,), 0)], [t], "only 1 tensors"),
        "rank mismatch": ([BoxCopy(0, 0, (2, 2), (1,), 0)], [t], "2 sizes but 1 strides"),
        "negative size": ([BoxCopy(0, 0, (-1,), (1,), 0)], [t], "negative size"),
        "negative buffer offset": ([BoxCopy(0, 0, (2,), (1,), -2)], [t], "negative buffer_offset"),
        "past the end": ([BoxCopy(0, 20, (5,), (1,), 0)], [t], "reaches outside tensor 0"),
        "before the start": ([BoxCopy(0, 2, (2, 3), (-6, 1), 0)], [t], "reaches outside"),
        "8-byte dtype": ([BoxCopy(0, 0, (2,), (1,), 0)], [torch.zeros(4, dtype=torch.float64)],
                         "torch.int32"),
        "huge offset": ([BoxCopy(0, 2**70, (1,), (1,), 0)], [t], "fits in int64"),
        "two devices": ([BoxCopy(0, 0, (1,), (1,), 0), BoxCopy(1, 0, (1,), (1,), 2)],
                        [t, torch.zeros(2, dtype=torch.bfloat16, device="meta")],
                        "several devices"),
        "fp8 conversion": ([BoxCopy(0, 0, (2,), (1,), 0, "float8_e4m3fn")], [t],
                           "convert only between"),
        "int conversion": ([BoxCopy(0, 0, (2,), (1,), 0, "float32")],
                           [torch.zeros(4, dtype=torch.int16)], "convert only between"),
        "unaligned conversion": ([BoxCopy(0, 0, (2,), (1,), 2, "float32")], [t],
                                 "not a multiple of 4"),
    }


def rounding_values(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Finite values that exercise a narrowing cast: random bits (NaNs replaced), every 3rd a
    bf16/fp16 rounding tie, every 7th in the fp16/bf16 subnormal range, some beyond fp16's max."""
    t = random_bits(dtype, shape, seed).clone()
    flat = t.view(-1)
    flat[torch.isnan(flat)] = 1.5
    if dtype == torch.float32:
        b = flat.view(torch.int32)
        b[::3] = b[::3] & ~0xFFFF | 0x8000  # a bf16 tie
        b[1::3] = b[1::3] & ~0x1FFF | 0x1000  # an fp16 tie
    g = torch.Generator().manual_seed(seed)
    sub = flat[2::7]
    sub.copy_(((torch.rand(sub.numel(), generator=g, dtype=torch.float64) - 0.5) * 1.3e-4)
              .to(dtype))
    flat[5::11] = 70000.0 if dtype != torch.float16 else 65504.0
    return t


def conversion_layout(tensors) -> tuple[list[BoxCopy], int]:
    """Converting boxes between the fp32, bf16 and fp16 tensors ``tensors`` (shapes (37, 45),
    (29, 31), (23, 19)): plain, transposed, reversed, strided, plus one plain copy. Every box
    is aligned to its buffer dtype, as a plan places them."""
    f32, b16, f16 = tensors
    spec = [
        (box(0, f32, (0, 0), (37, 45)), "bfloat16"),
        (box(0, f32, (1, 2), (30, 40), order=(1, 0)), "bfloat16"),  # transposed
        (box(0, f32, (0, 3), (37, 41), reverse=(0,)), "float16"),  # reversed rows
        (box(0, f32, (0, 0), (12, 15), steps=(3, 3)), "float16"),  # strided
        (box(1, b16, (0, 0), (29, 31)), "float16"),
        (box(1, b16, (2, 1), (20, 30), order=(1, 0)), "float32"),  # widening, transposed
        (box(2, f16, (0, 0), (23, 19)), "bfloat16"),
        (box(2, f16, (3, 0), (20, 19), reverse=(1,)), "float32"),
        (box(1, b16, (0, 0), (5, 7)), None),  # a plain copy in the same table
    ]
    out, pos = [], 0
    for c, dtype in spec:
        size = tensors[c.tensor].element_size() if dtype is None else getattr(torch, dtype).itemsize
        pos = -(-pos // 4) * 4 + 4
        out.append(BoxCopy(c.tensor, c.offset, c.shape, c.strides, pos, dtype))
        pos += math.prod(c.shape) * size
    return out, pos


def conversion_tensors(seed: int = 0) -> list[torch.Tensor]:
    return [rounding_values(torch.float32, (37, 45), seed),
            rounding_values(torch.bfloat16, (29, 31), seed + 1),
            rounding_values(torch.float16, (23, 19), seed + 2)]


def assert_conversions_match_reference(kernels, device: str = "cpu") -> None:
    """Every box of `conversion_layout` packed in one table, and each assembled on its own
    (they overlap), bit for bit against the reference; the packed bytes also against
    ``tensor.to(dtype)`` itself (the cast a loader performs). Assembled buffers are finite
    values: NaN bits of a conversion are not part of the contract (docs/kernels.md)."""
    tensors = conversion_tensors()
    copies, nbytes = conversion_layout(tensors)
    assert_pack_matches_reference(kernels, copies, tensors, nbytes, device=device)
    buffer = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    on = [t.to(device) for t in tensors]
    kernels.pack(kernels.build_table(copies, on), buffer)
    for c in copies:
        dtype = getattr(torch, c.buffer_dtype) if c.buffer_dtype else tensors[c.tensor].dtype
        view, flip = box_view(tensors[c.tensor], c)
        want = (view.flip(flip) if flip else view).to(dtype)
        got = buffer[c.buffer_offset:c.buffer_offset + want.numel() * dtype.itemsize].cpu()
        assert torch.equal(got, want.contiguous().view(-1).view(torch.uint8)), c
    finite = [rounding_values(t.dtype, tuple(t.shape), seed=9) for t in tensors]
    for c in copies:  # a buffer of finite values of each box's buffer dtype
        dtype = getattr(torch, c.buffer_dtype) if c.buffer_dtype else tensors[c.tensor].dtype
        source = {t.dtype: t for t in finite}.get(dtype, finite[0].to(dtype))
        values = source.reshape(-1)[:math.prod(c.shape)]
        buf = torch.zeros(nbytes, dtype=torch.uint8)
        buf[c.buffer_offset:c.buffer_offset + values.numel() * dtype.itemsize] = (
            values.contiguous().view(torch.uint8))
        ref, got = [t.clone() for t in tensors], [t.to(device, copy=True) for t in tensors]
        TorchCopyKernels().assemble(TorchCopyKernels().build_table([c], ref), buf)
        kernels.assemble(kernels.build_table([c], got), buf.to(device))
        for e, g in zip(ref, got):
            assert torch.equal(bits(g.cpu()), bits(e)), c
