"""The vectorized CPU pack/assemble path against the torch reference, bit for bit.

Large and irregular hand-made cases, hypothesis over random descriptor tables (both the batched
gather and the direct-copy path, forced by monkeypatching the size limits), and the ValueErrors
a user can cause, raised by every implementation before any byte moves.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from boxcopy_cases import (DTYPES, assert_assemble_matches_reference,
                           assert_conversions_match_reference, assert_pack_matches_reference,
                           bad_tables, bits, box, disjoint, layout, random_bits, random_buffer,
                           tables)
from hypothesis import HealthCheck, given, settings

import weightbridge.execution.cpu_kernels as cpu_kernels
from weightbridge.execution.boxcopy import TorchCopyKernels
from weightbridge.execution.cpu_kernels import CpuCopyKernels
from weightbridge.execution.executor import default_kernels
from weightbridge.types import BoxCopy

IMPLEMENTATIONS = [TorchCopyKernels, CpuCopyKernels]
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(params=["gather", "direct"])
def cpu(request, monkeypatch):
    """CpuCopyKernels with small boxes batched through the gather, or every box direct."""
    if request.param == "direct":
        monkeypatch.setattr(cpu_kernels, "GATHER_MAX_BOX", 0)
    return CpuCopyKernels()


# ---------------------------------------------------------------------------------------------
# Large and irregular cases
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1 << 16, 2000])  # 2000: shorter than one row of a box
def test_large_shards_transposes_and_reversals_match_reference(monkeypatch, chunk):
    monkeypatch.setattr(cpu_kernels, "FLIP_CHUNK", chunk)  # split the reversed boxes
    monkeypatch.setattr(cpu_kernels, "TRANSPOSE_CHUNK", chunk)  # and the transposed ones
    w = random_bits(torch.bfloat16, (3000, 2049), seed=1)
    v = random_bits(torch.float32, (1 << 22,), seed=2)
    f8 = random_bits(torch.float8_e4m3fn, (777, 1031), seed=3)
    tensors = [w, v, f8]
    copies, nbytes = layout([
        box(0, w, (0, 1000), (3000, 1049)),  # column shard, 3M elements
        box(0, w, (0, 0), (3000, 1000), order=(1, 0)),  # transposed shard
        box(1, v, (5,), ((1 << 22) - 9,), reverse=(0,)),  # 4M reversed, split in chunks
        box(2, f8, (1, 3), (776, 1027), reverse=(0,)),  # fp8 rows bottom-up
        box(2, f8, (0, 0), (1, 3), order=(1, 0)),  # a sliver
    ], tensors, gaps=[0, 1, 2, 0, 3])
    assert_pack_matches_reference(CpuCopyKernels(), copies, tensors, nbytes)
    assert_assemble_matches_reference(CpuCopyKernels(), disjoint(copies, tensors), tensors,
                                      nbytes)


def test_many_tiny_boxes_over_many_tensors_match_reference(cpu):
    tensors = [random_bits(DTYPES[i % len(DTYPES)], (37, 5), seed=i) for i in range(12)]
    copies = [box(i % 12, tensors[i % 12], (i % 37, 0), (1, 5)) for i in range(400)]
    copies += [box(i % 12, tensors[i % 12], (0, i % 5), (37, 1)) for i in range(12)]
    copies, nbytes = layout(copies, tensors, gaps=[i % 3 for i in range(len(copies))])
    assert_pack_matches_reference(cpu, copies, tensors, nbytes)
    assert_assemble_matches_reference(cpu, disjoint(copies, tensors), tensors, nbytes)


def test_gather_budget_overflow_falls_back_to_direct_copies(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "GATHER_BUDGET", 100)
    t = random_bits(torch.bfloat16, (64, 64), seed=4)
    copies, nbytes = layout([box(0, t, (r, 0), (1, 64)) for r in range(64)], [t], [0] * 64)
    table = CpuCopyKernels().build_table(copies, [t])
    assert len(table._direct) == 63  # one 64-element row fits the budget of 100
    assert_pack_matches_reference(CpuCopyKernels(), copies, [t], nbytes)
    assert_assemble_matches_reference(CpuCopyKernels(), copies, [t], nbytes)


def test_one_element_and_zero_d_boxes(cpu):
    a = random_bits(torch.float32, (), seed=5)
    b = random_bits(torch.int16, (3, 3), seed=6)
    copies, nbytes = layout([BoxCopy(0, 0, (), (), 0), BoxCopy(1, 4, (1, 1), (7, -9), 0),
                             BoxCopy(1, 8, (1,), (1,), 0)], [a, b], gaps=[0, 1, 0])
    assert_pack_matches_reference(cpu, copies, [a, b], nbytes)
    assert_assemble_matches_reference(cpu, copies, [a, b], nbytes)


def test_table_of_only_zero_d_boxes(cpu):
    a = random_bits(torch.bfloat16, (), seed=13)
    copies = [BoxCopy(0, 0, (), (), 1), BoxCopy(0, 0, (), (), 4)]
    assert_assemble_matches_reference(cpu, copies[:1], [a], 6)
    assert_pack_matches_reference(cpu, copies, [a], 6)


def test_unaligned_buffer_start_is_bounced(cpu):
    t = random_bits(torch.bfloat16, (33, 17), seed=8)
    copies, nbytes = layout([box(0, t, (0, 0), (33, 17), order=(1, 0))], [t], [3])
    assert_pack_matches_reference(cpu, copies, [t], nbytes, buffer_shift=1)
    assert_assemble_matches_reference(cpu, copies, [t], nbytes, buffer_shift=3)


def test_empty_table_and_empty_boxes_move_nothing(cpu):
    t = random_bits(torch.float16, (4,), seed=9)
    buffer = random_buffer(8)
    before = buffer.clone()
    for copies in ([], [BoxCopy(0, 0, (0, 3), (3, 1), 2)]):
        table = cpu.build_table(copies, [t])
        cpu.pack(table, buffer)
        cpu.assemble(table, buffer)
    assert torch.equal(buffer, before)


def test_pack_leaves_gaps_between_boxes_untouched(cpu):
    t = random_bits(torch.int16, (10,), seed=10)
    buffer = torch.full((40,), 0xAB, dtype=torch.uint8)
    cpu.pack(cpu.build_table([BoxCopy(0, 0, (3,), (1,), 5), BoxCopy(0, 3, (2,), (1,), 20)],
                             [t]), buffer)
    assert buffer[:5].eq(0xAB).all() and buffer[11:20].eq(0xAB).all() and buffer[24:].eq(0xAB).all()


def test_table_is_reusable_across_buffers_and_rounds(cpu):
    t = random_bits(torch.bfloat16, (16, 16), seed=11)
    copies, nbytes = layout([box(0, t, (0, 0), (16, 8)), box(0, t, (0, 8), (16, 8))], [t], [0, 1])
    table = cpu.build_table(copies, [t])
    buffers = [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(3)]
    for step in range(2):
        t.add_(1)
        for b in buffers:
            cpu.pack(table, b)
            expected = torch.zeros_like(b)
            TorchCopyKernels().pack(TorchCopyKernels().build_table(copies, [t]), expected)
            assert torch.equal(b, expected)


# ---------------------------------------------------------------------------------------------
# Random descriptor tables
# ---------------------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=tables())
def test_random_tables_pack_like_reference(cpu, case):
    copies, tensors, nbytes = case
    assert_pack_matches_reference(cpu, copies, tensors, nbytes)


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=tables())
def test_random_tables_assemble_like_reference(cpu, case):
    copies, tensors, nbytes = case
    assert_assemble_matches_reference(cpu, disjoint(copies, tensors), tensors, nbytes)


@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=tables(conversions=True))
def test_random_tables_with_conversions_pack_and_assemble_like_reference(cpu, case):
    """Converting boxes mixed with plain ones of every dtype, strides, reversals, transposes."""
    copies, tensors, nbytes = case
    assert_pack_matches_reference(cpu, copies, tensors, nbytes)
    assert_assemble_matches_reference(cpu, disjoint(copies, tensors), tensors, nbytes)


# ---------------------------------------------------------------------------------------------
# Errors a user can cause
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("name", list(bad_tables()))
def test_bad_copies_raise_value_error_in_build_table(implementation, name):
    copies, tensors, message = bad_tables()[name]
    with pytest.raises(ValueError, match=message):
        implementation().build_table(copies, tensors)


def test_converting_boxes_cast_as_torch_does_in_the_same_call(cpu):
    """fp32 <-> bf16 <-> fp16 boxes (plain, transposed, reversed, strided; rounding ties,
    subnormals, overflow) next to a plain box: the bytes are ``tensor.to(dtype)``'s."""
    assert_conversions_match_reference(cpu)


def test_unmergeable_rank_five_box_is_rejected_by_the_fast_path():
    t = torch.zeros(144, dtype=torch.int16)
    c = BoxCopy(0, 0, (2, 2, 2, 2, 2), (80, 24, 9, 4, 1), 0)  # no dim contiguous with the next
    with pytest.raises(ValueError, match="at most 4"):
        CpuCopyKernels().build_table([c], [t])
    TorchCopyKernels().build_table([c], [t])  # the reference takes any rank
    fine = BoxCopy(0, 0, (2, 3, 2, 3, 2), (36, 12, 6, 2, 1), 0)  # merges into one dim
    CpuCopyKernels().build_table([fine], [torch.zeros(72, dtype=torch.int16)])


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_bad_buffers_raise_value_error(implementation):
    k = implementation()
    table = k.build_table([BoxCopy(0, 0, (4,), (1,), 2)], [torch.zeros(4, dtype=torch.int16)])
    assert table.nbytes == 10
    with pytest.raises(ValueError, match="needs 10"):
        k.pack(table, torch.zeros(9, dtype=torch.uint8))
    with pytest.raises(ValueError, match="torch.uint8"):
        k.assemble(table, torch.zeros(10, dtype=torch.int16))
    with pytest.raises(ValueError, match="1-d contiguous"):
        k.pack(table, torch.zeros((2, 10), dtype=torch.uint8))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_pack_refuses_overlapping_buffer_ranges_but_assemble_reads_them(implementation):
    k = implementation()
    src = random_bits(torch.int16, (4,), seed=12)
    a, b = torch.zeros(4, dtype=torch.int16), torch.zeros(4, dtype=torch.int16)
    table = k.build_table([BoxCopy(0, 0, (4,), (1,), 0), BoxCopy(1, 0, (4,), (1,), 0)], [a, b])
    with pytest.raises(ValueError, match="overlapping buffer bytes"):
        k.pack(table, torch.zeros(8, dtype=torch.uint8))
    k.assemble(table, src.view(torch.uint8).clone())
    assert torch.equal(a, src) and torch.equal(b, src)  # e.g. a param and a forwarding buffer


def test_default_kernels_on_cpu_is_the_vectorized_path():
    assert isinstance(default_kernels("cpu"), CpuCopyKernels)
    assert isinstance(default_kernels(torch.device("cpu")), CpuCopyKernels)


def test_importing_the_core_does_not_import_triton():
    code = ("import sys, weightbridge, weightbridge.execution.cpu_kernels; "
            "sys.exit('triton' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_parameters_that_require_grad_are_copied_in_place(implementation):
    param = torch.nn.Parameter(random_bits(torch.float32, (6, 5), seed=14))
    target = torch.nn.Parameter(torch.zeros((5, 6)))
    k = implementation()
    buffer = torch.zeros(120, dtype=torch.uint8)
    k.pack(k.build_table([BoxCopy(0, 0, (5, 6), (1, 5), 0)], [param]), buffer)
    k.assemble(k.build_table([BoxCopy(0, 0, (30,), (1,), 0)], [target]), buffer)
    assert torch.equal(bits(target.detach()), bits(param.detach().t()))
