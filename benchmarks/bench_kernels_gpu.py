"""Benchmark the Triton pack/assemble kernels on a GPU against the device's own copy bandwidth.

For each round (regions of 4 KB, 64 KB, 1 MB and 16 MB cut from bf16 matrices as column shards,
and a mixed realistic round), it checks the kernels bit for bit once, then prints:
- pack and assemble GB/s (bytes of the round per second) and their ratio to a torch copy of the
  same number of bytes on the same device (target >= 0.8);
- launches per round (one per pack or assemble) and programs per launch;
- the kernels' share of a round: pack time over pack time plus the time the round's bytes need
  on an RDMA link of --link-gbps (default 400 Gb/s, one NIC per GPU), the share the kernels
  would take if nothing overlapped them (the paper reports < 3% for its kernels, overlapped).

Timing: triton.testing.do_bench (CUDA events), median. Without a GPU it says so and exits 0.

Run::

    python benchmarks/bench_kernels_gpu.py                 # about 1-2 minutes on an H100/H200
    python benchmarks/bench_kernels_gpu.py --round-mib 256 --link-gbps 200
    python benchmarks/bench_kernels_gpu.py --sweep         # also tile shapes and warp counts
    # smoke-test the script itself on a CPU, kernels in Triton's interpreter (slow, tiny sizes):
    TRITON_INTERPRET=1 python benchmarks/bench_kernels_gpu.py --device cpu --round-mib 1 \
        --layers 1 --hidden 256
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from rounds import column_shard_round, mixed_round


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--round-mib", type=int, default=1024, help="bytes per synthetic round")
    parser.add_argument("--link-gbps", type=float, default=400.0,
                        help="RDMA link bandwidth, Gbit/s, for the kernels' share of a round")
    parser.add_argument("--layers", type=int, default=8, help="layers in the mixed round")
    parser.add_argument("--hidden", type=int, default=4096, help="hidden size of the mixed round")
    parser.add_argument("--device", default="cuda", help="cpu only to smoke-test this script")
    parser.add_argument("--sweep", action="store_true",
                        help="also time other tile shapes and warp counts on two rounds")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_kernels_gpu: no CUDA GPU is visible (torch.cuda.is_available() is False); "
              "nothing to measure. Run it on a machine with a GPU, or use "
              "benchmarks/bench_kernels.py for the CPU path.")
        return 0
    import triton
    import triton.testing

    from kernels import TritonKernels
    from weightbridge.execution.cpu_kernels import CpuCopyKernels

    device = args.device
    name = torch.cuda.get_device_name() if device == "cuda" else device
    median_ms = _do_bench if device == "cuda" else perf_counter_ms
    print(f"{name}, torch {torch.__version__}, "
          f"triton {triton.__version__}, round {args.round_mib} MiB, link {args.link_gbps} Gb/s")
    rounds = [(f"{size >> 10} KB regions" if size < (1 << 20) else f"{size >> 20} MB regions",
               lambda size=size: column_shard_round(size, args.round_mib << 20, device))
              for size in (4 << 10, 64 << 10, 1 << 20, 16 << 20)
              if size <= args.round_mib << 20]
    rounds.append(("mixed round", lambda: mixed_round(args.layers, args.hidden, device)))
    kernels = TritonKernels()
    rows = []
    for label, make in rounds:
        copies, tensors = make()
        t = time.perf_counter()
        table = kernels.build_table(copies, tensors)
        build_ms = (time.perf_counter() - t) * 1e3
        buffer = torch.empty(table.nbytes, dtype=torch.uint8, device=device)
        t = time.perf_counter()
        kernels.pack(table, buffer)
        _sync(device)
        first_ms = (time.perf_counter() - t) * 1e3  # includes compilation on the first round
        _check_bits(kernels, table, copies, tensors, buffer, CpuCopyKernels())
        src = torch.randint(0, 256, (table.nbytes,), dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        copy_ms = median_ms(lambda: dst.copy_(src))
        pack_ms = median_ms(lambda: kernels.pack(table, buffer))
        asm_ms = median_ms(lambda: kernels.assemble(table, buffer))
        link_ms = table.nbytes * 8 / (args.link_gbps * 1e9) * 1e3
        gbs = lambda ms: table.nbytes / ms / 1e6  # noqa: E731
        rows.append(f"{label:<14} {len(copies):>7} boxes {table.nbytes / 2**20:7.1f} MiB | copy "
                    f"{gbs(copy_ms):6.0f} GB/s | pack {gbs(pack_ms):6.0f} GB/s "
                    f"({copy_ms / pack_ms:4.2f}x copy) | assemble {gbs(asm_ms):6.0f} GB/s "
                    f"({copy_ms / asm_ms:4.2f}x) | 1 launch, {table.num_tiles} programs | "
                    f"pack share of round {pack_ms / (pack_ms + link_ms):5.1%} | build "
                    f"{build_ms:5.0f} ms, first pack {first_ms:5.0f} ms")
        print(rows[-1], flush=True)
        del copies, tensors, table, buffer, src, dst
        if device == "cuda":
            torch.cuda.empty_cache()
    print("\nsummary (bytes of the round per second; copy = torch copy of the same bytes):")
    print("\n".join(rows))
    if args.sweep:
        _sweep(rounds[1:2] + rounds[-1:], device, median_ms)
    return 0


SWEEP = ((16, 128, 4), (32, 128, 8), (8, 256, 4), (16, 64, 4), (32, 64, 4), (8, 128, 2))
"""(block_rows, block_cols, num_warps) to try; the first is the default."""


def _sweep(rounds, device: str, median_ms) -> None:
    from kernels import TritonKernels

    print("\nsweep: pack / assemble GB/s by (block_rows, block_cols, num_warps)")
    for label, make in rounds:
        copies, tensors = make()
        results = []
        for block_rows, block_cols, num_warps in SWEEP:
            k = TritonKernels(block_rows=block_rows, block_cols=block_cols, num_warps=num_warps)
            table = k.build_table(copies, tensors)
            buffer = torch.empty(table.nbytes, dtype=torch.uint8, device=device)
            pack_ms = median_ms(lambda: k.pack(table, buffer))
            asm_ms = median_ms(lambda: k.assemble(table, buffer))
            results.append(f"{block_rows}x{block_cols}w{num_warps} "
                           f"{table.nbytes / pack_ms / 1e6:.0f}/{table.nbytes / asm_ms / 1e6:.0f}")
        print(f"{label:<14} " + " | ".join(results), flush=True)


def _do_bench(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, return_mode="median")


def perf_counter_ms(fn, repeats: int = 3) -> float:
    """Median wall-clock milliseconds of ``repeats`` calls (CPU runs: this script's smoke test,
    `gpu_check.py --interpret`)."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[len(times) // 2]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _check_bits(kernels, table, copies, tensors, buffer, cpu_kernels) -> None:
    """Pack on the GPU equals the CPU path's pack; assemble of it restores every box."""
    cpu_tensors = [t.cpu() for t in tensors]
    expected = torch.zeros(table.nbytes, dtype=torch.uint8)
    cpu_kernels.pack(cpu_kernels.build_table(copies, cpu_tensors), expected)
    buffer.zero_()
    kernels.pack(table, buffer)
    if not torch.equal(buffer.cpu(), expected):
        raise SystemExit("pack on the GPU differs from the CPU path: a kernel bug, report it")
    for t in tensors:
        t.zero_()
    kernels.assemble(table, buffer)
    restored = torch.zeros_like(expected)
    cpu_kernels.pack(cpu_kernels.build_table(copies, [t.cpu() for t in tensors]), restored)
    if not torch.equal(restored, expected):
        raise SystemExit("assemble on the GPU did not restore the boxes: a kernel bug, report it")


if __name__ == "__main__":
    sys.exit(main())
