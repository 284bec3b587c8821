"""Benchmark the CPU pack/assemble path against a plain torch copy of the same bytes.

Prints, in one run:
- throughput of `CpuCopyKernels.pack` and `.assemble` divided by that of ``dst.copy_(src)`` over
  the same number of bytes (one contiguous copy), for rounds of regions of 4 KB, 64 KB, 1 MB and
  16 MB (column shards of bf16 matrices: 2-d strided boxes) and for a mixed realistic round
  (bf16 TP shards, a transposed shard, fp8, fp32 norms, tiny unaligned bias pieces, a reversal);
- torch calls per round for the CPU path, and Triton launches and programs (tiles) per round;
- descriptor-building time per plan for 10k and 100k copies: the CPU table and the Triton
  descriptors (built on the CPU; no GPU or Triton launch is needed to build them).

Timing: best of REPEATS, the copy and the kernels timed in turn (the machine may be shared).

Run (about 30 s)::

    .venv/bin/python benchmarks/bench_kernels.py              # torch's default thread count
    .venv/bin/python benchmarks/bench_kernels.py --threads 1  # steadier on a shared machine
"""

from __future__ import annotations

import argparse
import time

import torch
from rounds import column_shard_round, mixed_round, plan_copies

from weightbridge.execution.cpu_kernels import CpuCopyKernels

ROUND_BYTES = 64 << 20
REPEATS = 15


def best_seconds(fns, repeats: int = REPEATS) -> list[float]:
    """Best-of-``repeats`` seconds of each function, timed in turn so that load from other
    processes on a shared machine hits them alike."""
    for fn in fns:
        fn()
    times = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t = time.perf_counter()
            fn()
            times[i] = min(times[i], time.perf_counter() - t)
    return times


def ratio_line(label: str, copies, tensors) -> str:
    kernels = CpuCopyKernels()
    table = kernels.build_table(copies, tensors)
    buffer = torch.empty(table.nbytes, dtype=torch.uint8)
    src, dst = torch.randint(0, 256, (table.nbytes,), dtype=torch.uint8), torch.empty_like(buffer)
    t_copy, t_pack, t_asm = best_seconds([
        lambda: dst.copy_(src), lambda: kernels.pack(table, buffer),
        lambda: kernels.assemble(table, buffer)])
    return (f"{label:<14} {len(copies):>6} boxes {table.nbytes / 2**20:5.1f} MiB | torch copy "
            f"{table.nbytes / t_copy / 1e9:5.1f} GB/s | pack/copy {t_copy / t_pack:4.2f} | "
            f"assemble/copy {t_copy / t_asm:4.2f} | torch calls/round {table.num_launches}")


def triton_line(copies, tensors) -> str:
    from kernels.descriptors import build_descriptors  # torch only: no Triton launch, no GPU

    desc = build_descriptors(copies, tensors)
    return (f"{'':<14} Triton: 1 launch per pack or assemble, {desc.num_tiles} programs, "
            f"{desc.num_copies} descriptor rows")


def build_line(num_copies: int) -> str:
    from kernels.descriptors import build_descriptors

    copies, tensors = plan_copies(num_copies)
    t_cpu, t_triton = best_seconds([lambda: CpuCopyKernels().build_table(copies, tensors),
                                    lambda: build_descriptors(copies, tensors)], repeats=3)
    return (f"build {num_copies:>6} copies: CPU table {t_cpu * 1e3:6.0f} ms, "
            f"Triton descriptors {t_triton * 1e3:6.0f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="torch CPU threads, for the copy and the kernels alike")
    torch.set_num_threads(parser.parse_args().threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"best of {REPEATS}")
    for size, label in ((4 << 10, "4 KB regions"), (64 << 10, "64 KB regions"),
                        (1 << 20, "1 MB regions"), (16 << 20, "16 MB regions")):
        copies, tensors = column_shard_round(size, ROUND_BYTES)
        print(ratio_line(label, copies, tensors))
        print(triton_line(copies, tensors))
    copies, tensors = mixed_round()
    print(ratio_line("mixed round", copies, tensors))
    print(triton_line(copies, tensors))
    for n in (10_000, 100_000):
        print(build_line(n))


if __name__ == "__main__":
    main()
