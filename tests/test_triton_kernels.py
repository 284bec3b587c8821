"""The Triton pack/assemble kernels against the torch reference, bit for bit.

Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, on CPU tensors). The
interpreter is chosen when a kernel is decorated, i.e. when `kernels` is first imported, so this
module sets the variable and, if an earlier test already imported `kernels` compiled, reloads it.
Cases are small (the interpreter runs each program in numpy) but irregular: odd sizes, several
tiles per box (small block sizes), transposes, reversals, 1-element boxes, unaligned buffers,
fp8/bf16/fp32, and a forwarding-buffer copy in the same launch as the parameter copies.
"""

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")

from boxcopy_cases import (assert_assemble_matches_reference,  # noqa: E402
                           assert_conversions_match_reference, assert_pack_matches_reference,
                           bad_tables, box, disjoint, layout,
                           random_bits, tables)
from hypothesis import given, settings  # noqa: E402

from weightbridge.execution.boxcopy import TorchCopyKernels  # noqa: E402
from weightbridge.execution.executor import default_kernels  # noqa: E402
from weightbridge.types import BoxCopy  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
REPO = Path(__file__).resolve().parents[1]


def _import_kernels():
    from triton.runtime.interpreter import InterpretedFunction

    import kernels

    modules = [importlib.import_module(f"kernels.{m}")
               for m in ("_tile", "_convert", "_quantize", "pack", "assemble")]
    if not ON_GPU and not isinstance(modules[3]._pack_kernel, InterpretedFunction):
        for m in (*modules, kernels):  # helpers first: pack/assemble import them by name
            importlib.reload(m)
    return kernels


kernels = _import_kernels()
from kernels.descriptors import ADDR, BUF, ESIZE, N3, NROWS, S3, build_descriptors  # noqa: E402

SMALL_TILES = kernels.TritonKernels(block_rows=4, block_cols=8)  # many tiles per box


def _check(k, copies, tensors, nbytes, *, buffer_shift=0):
    assert_pack_matches_reference(k, copies, tensors, nbytes, buffer_shift=buffer_shift,
                                  device=DEVICE)
    assert_assemble_matches_reference(k, disjoint(copies, tensors), tensors, nbytes,
                                      buffer_shift=buffer_shift, device=DEVICE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_odd_sized_shards_and_transposes(dtype):
    w = random_bits(dtype, (37, 53), seed=1)
    copies, nbytes = layout([
        box(0, w, (0, 20), (37, 33)),  # column shard, odd offset
        box(0, w, (3, 0), (11, 20), order=(1, 0)),  # transposed
        box(0, w, (14, 0), (23, 20), reverse=(0, 1)),  # rotated 180 degrees
    ], [w], gaps=[0, 1, 3])
    _check(SMALL_TILES, copies, [w], nbytes)
    _check(kernels.TritonKernels(), copies, [w], nbytes, buffer_shift=1)


def test_one_element_boxes_of_every_size():
    tensors = [random_bits(d, (5, 3), seed=i) for i, d in
               enumerate([torch.uint8, torch.bfloat16, torch.float32, torch.float8_e4m3fn])]
    tensors.append(random_bits(torch.float16, (), seed=9))
    copies = [box(i, tensors[i], (i, 2), (1, 1)) for i in range(4)]
    copies.append(BoxCopy(4, 0, (), (), 0))
    copies, nbytes = layout(copies, tensors, gaps=[0, 1, 1, 2, 1])
    _check(SMALL_TILES, copies, tensors, nbytes)


def test_table_of_only_zero_d_boxes():
    a = random_bits(torch.float8_e4m3fn, (), seed=10)
    _check(SMALL_TILES, [BoxCopy(0, 0, (), (), 1), BoxCopy(0, 0, (), (), 3)], [a], 4)


def test_long_one_d_boxes_fold_into_full_tiles_plus_a_tail():
    v = random_bits(torch.bfloat16, (1000,), seed=2)
    copies, nbytes = layout([box(0, v, (1,), (999,)), box(0, v, (0,), (500,), steps=(2,))],
                            [v], gaps=[0, 4])
    desc = build_descriptors(copies, [v], block_rows=4, block_cols=8)
    assert desc.num_copies == 4  # two folded boxes, each with a tail
    _check(SMALL_TILES, copies, [v], nbytes)


def test_contiguous_rows_are_widened_to_four_byte_moves():
    w = random_bits(torch.bfloat16, (8, 10), seed=3)
    copies = [BoxCopy(0, 2, (8, 4), (10, 1), 0), BoxCopy(0, 1, (8, 4), (10, 1), 64),
              BoxCopy(0, 2, (8, 4), (10, 1), 130)]
    desc = build_descriptors(copies, [w], block_rows=4, block_cols=8)
    assert desc.copies[:, ESIZE].tolist() == [4, 2, 2]  # odd start / odd buffer offset: no
    assert desc.copies[0, N3] == 2 and desc.copies[0, NROWS] == 8
    _check(SMALL_TILES, copies[:2], [w], 128)


def test_unmergeable_rank_four_box():
    t = random_bits(torch.int16, (4, 5, 6, 7), seed=4)
    copies, nbytes = layout([box(0, t, (0, 1, 0, 1), (2, 2, 3, 3), steps=(2, 2, 2, 2),
                                 order=(2, 0, 3, 1))], [t], [1])
    _check(SMALL_TILES, copies, [t], nbytes)
    c = BoxCopy(0, 0, (2, 2, 2, 2, 2), (80, 24, 9, 4, 1), 0)
    with pytest.raises(ValueError, match="at most 4"):
        SMALL_TILES.build_table([c], [torch.zeros(144, dtype=torch.int16)])


def test_forwarding_copy_runs_in_the_same_assemble_launch():
    # A receiver's round: bytes 0..95 go into a bf16 parameter (transposed), bytes 96..255 are
    # forwarded to another worker's stage through a uint8 forwarding buffer.
    param = torch.zeros((6, 8), dtype=torch.bfloat16, device=DEVICE)
    forward = torch.zeros(300, dtype=torch.uint8, device=DEVICE)
    recv = random_bits(torch.uint8, (256,), seed=5).to(DEVICE)
    copies = [BoxCopy(0, 0, (8, 6), (1, 8), 0),
              BoxCopy(1, 40, (160,), (1,), 96),  # aligned: moves as int32
              BoxCopy(1, 203, (7,), (1,), 3)]  # unaligned bytes
    k = kernels.TritonKernels()
    table = k.build_table(copies, [param, forward])
    assert table.copies[1, ESIZE] == 4
    k.assemble(table, recv)
    ref_param, ref_forward = torch.zeros_like(param), torch.zeros_like(forward)
    ref = TorchCopyKernels()
    ref.assemble(ref.build_table(copies, [ref_param, ref_forward]), recv)
    assert torch.equal(param.view(torch.int16), ref_param.view(torch.int16))
    assert torch.equal(forward, ref_forward)


def test_converting_boxes_cast_as_torch_does_in_the_same_launch():
    """fp32 <-> bf16 <-> fp16 boxes in one pack launch with a plain box, several tiles per box
    and a folded tail: bit for bit torch's casts (ties to even, subnormals, overflow to inf)."""
    assert_conversions_match_reference(SMALL_TILES, device=DEVICE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_block_quantizing_boxes_pack_as_the_reference_in_the_same_launch(dtype):
    """Values and scales of whole blocks (a cut last block row, a transposed box), with a plain
    and a converting box in one pack launch; the values are the probe's telling ones (ties,
    float8 subnormals, a zero block, one under the amax floor). Bit for bit the torch
    reference, which is `weightbridge.quant` (vLLM's formula)."""
    from weightbridge.discovery.quantized import salted
    block = (16, 8)
    gen = torch.Generator().manual_seed(11)
    w = salted((40, 24), dtype, block, gen)
    base = w.t().contiguous()  # (24, 40): the box below reads it transposed
    other = torch.randn(10, generator=gen)
    tensors = [base.to(DEVICE), other.to(DEVICE)]
    rows = 40 - 16  # rows 16.. of w: a whole block row and a cut one
    copies = [BoxCopy(0, 16, (rows, 24), (1, 40), 0, "float8_e4m3fn", block),
              BoxCopy(0, 16, (rows, 24), (1, 40), rows * 24, "float32", block),
              BoxCopy(1, 0, (10,), (1,), rows * 24 + 4 * 6, None),
              BoxCopy(1, 0, (10,), (1,), rows * 24 + 4 * 6 + 40, "bfloat16")]
    got = torch.zeros(rows * 24 + 4 * 6 + 60, dtype=torch.uint8, device=DEVICE)
    k = kernels.TritonKernels(block_rows=4, block_cols=4)  # several tiles per block
    k.pack(k.build_table(copies, tensors), got)
    ref = TorchCopyKernels()
    want = torch.zeros_like(got.cpu())
    ref.pack(ref.build_table(copies, [base, other]), want)
    assert torch.equal(got.cpu(), want)
    with pytest.raises(ValueError, match="only pack"):
        k.assemble(k.build_table(copies, tensors), got)


def test_converting_rows_are_not_widened_and_keep_their_dtype_codes():
    from kernels.descriptors import BCODE, DTYPE_CODES, TCODE
    t = torch.zeros(64, dtype=torch.float32, device=DEVICE)
    desc = build_descriptors([BoxCopy(0, 0, (64,), (1,), 0, "bfloat16")], [t], block_cols=16)
    rows = desc.copies.cpu()
    assert (rows[:, ESIZE] == 4).all() and (rows[:, TCODE] == DTYPE_CODES["float32"]).all()
    assert (rows[:, BCODE] == DTYPE_CODES["bfloat16"]).all() and desc.nbytes == 128


@settings(max_examples=30, deadline=None)
@given(case=tables(max_tensors=3, max_copies=5, max_size=9))
def test_random_tables_match_reference(case):
    copies, tensors, nbytes = case
    _check(SMALL_TILES, copies, tensors, nbytes)


@settings(max_examples=20, deadline=None)
@given(case=tables(max_tensors=3, max_copies=5, max_size=9, conversions=True))
def test_random_tables_with_conversions_pack_like_reference(case):
    """Converting and plain boxes in one pack launch. (Assemble of random buffers would compare
    NaN bits, which conversions do not promise: `assert_conversions_match_reference` covers
    assemble on finite values.)"""
    copies, tensors, nbytes = case
    assert_pack_matches_reference(SMALL_TILES, copies, tensors, nbytes, device=DEVICE)


@pytest.mark.parametrize("name", list(bad_tables()))
def test_bad_copies_raise_the_same_value_errors_as_the_core(name):
    copies, tensors, message = bad_tables()[name]
    with pytest.raises(ValueError, match=message):
        kernels.TritonKernels().build_table(copies, tensors)


def test_bad_buffers_and_overlapping_pack_raise_value_error():
    k = kernels.TritonKernels()
    a, b = (torch.zeros(4, dtype=torch.int16, device=DEVICE) for _ in range(2))
    table = k.build_table([BoxCopy(0, 0, (4,), (1,), 0), BoxCopy(1, 0, (4,), (1,), 2)], [a, b])
    assert table.nbytes == 10 and table.buffer_overlap
    with pytest.raises(ValueError, match="needs 10"):
        k.assemble(table, torch.zeros(9, dtype=torch.uint8, device=DEVICE))
    with pytest.raises(ValueError, match="torch.uint8"):
        k.assemble(table, torch.zeros(10, dtype=torch.int16, device=DEVICE))
    with pytest.raises(ValueError, match="overlapping buffer bytes"):
        k.pack(table, torch.zeros(10, dtype=torch.uint8, device=DEVICE))


@pytest.mark.skipif(ON_GPU, reason="checks the CPU-tensor guard of the launchers")
def test_cpu_tensors_without_the_interpreter_are_refused(monkeypatch):
    k = kernels.TritonKernels()
    table = k.build_table([BoxCopy(0, 0, (4,), (1,), 0)], [torch.zeros(4, dtype=torch.int16)])
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="CpuCopyKernels"):
        k.pack(table, torch.zeros(8, dtype=torch.uint8))


def test_descriptor_rows_hold_addresses_and_buffer_offsets():
    w = random_bits(torch.float32, (3, 4), seed=6)
    desc = build_descriptors([BoxCopy(0, 5, (2,), (-4,), 12)], [w])
    row = desc.copies[0].tolist()
    assert row[ADDR] == w.data_ptr() + 5 * 4 and row[BUF] == 12 and row[S3] == -4
    assert desc.num_tiles == 1 and desc.tensors[0] is w


def test_default_kernels_on_cuda_is_triton(monkeypatch):
    # Triton where torch drives CUDA; here (no GPU) pretend it does, as test_executor does.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert isinstance(default_kernels("cuda"), kernels.TritonKernels)


def test_few_long_rows_are_split_into_full_width_rows():
    w = random_bits(torch.float32, (3, 64), seed=7)
    copies = [BoxCopy(0, 0, (2, 32), (64, 1), 0), BoxCopy(0, 0, (2, 2, 16), (64, 32, 1), 256)]
    desc = build_descriptors(copies, [w], block_rows=4, block_cols=8)
    assert desc.copies[:, NROWS].tolist() == [8, 8] and desc.copies[:, N3].tolist() == [8, 8]
    _check(SMALL_TILES, copies, [w], 512)


_COMPILE_FOR_HOPPER = """
import importlib, os, subprocess, sys, tempfile
import triton
import triton.backends.nvidia as nvidia
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.descriptors import BLOCK_COLS, BLOCK_ROWS, NUM_FIELDS
signature = {"copies": "*i64", "tiles": "*i64", "buffer_address": "i64",
             "NUM_FIELDS": "constexpr", "BLOCK_ROWS": "constexpr", "BLOCK_COLS": "constexpr"}
constexprs = {"NUM_FIELDS": NUM_FIELDS, "BLOCK_ROWS": BLOCK_ROWS, "BLOCK_COLS": BLOCK_COLS}
cuobjdump = os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump")
for module, name in (("kernels.pack", "_pack_kernel"), ("kernels.assemble", "_assemble_kernel")):
    fn = getattr(importlib.import_module(module), name)
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name],
                               capture_output=True, text=True, check=True).stdout
    print(name, [line.strip() for line in usage.splitlines() if "REG:" in line][0])
"""


@pytest.mark.slow
def test_kernels_compile_for_hopper_without_spills():
    """Compile both kernels for sm_90 with Triton's bundled ptxas (no GPU needed): catches
    compile errors the interpreter cannot, and register spills."""
    nvidia = pytest.importorskip("triton.backends.nvidia")
    if not os.path.exists(os.path.join(os.path.dirname(nvidia.__file__), "bin", "ptxas")):
        pytest.skip("this triton wheel carries no ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # silences a deprecation warning; no floats here
    out = subprocess.run([sys.executable, "-c", _COMPILE_FOR_HOPPER], env=env, cwd=REPO,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert len(lines) == 2 and all("STACK:0" in line for line in lines), out.stdout
