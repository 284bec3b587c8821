"""The GPU check: everything that needs a real GPU, in one command, one line per result.

    bash scripts/dev.sh gpu-check            # under 8 minutes on one GPU
    python benchmarks/gpu_check.py --only probe,mesh
    # the steps that need no Monarch, from the repository root with no install (a GPU
    # machine's own torch and triton: torch, triton, numpy, pytest, hypothesis and xxhash):
    python3 benchmarks/gpu_check.py --only triton,kernels,checksum,probe
    # the same code paths with no GPU: CPU, Triton's interpreter, smoke-test sizes
    python3 benchmarks/gpu_check.py --only triton,kernels,checksum,probe --interpret

Steps (each in its own process, each bounded in time, so one hang costs only its own budget):

- ``triton``: the compiled Triton pack / assemble / quantize kernels bit for bit against the torch
  path on the copy-case zoo (``tests/test_triton_kernels.py``, which compiles when CUDA is there).
- ``kernels``: pack and assemble GB/s against a device copy of the same bytes
  (``benchmarks/bench_kernels_gpu.py``); targets >= 0.8x at >= 64 KB regions, >= 0.5x on the
  mixed round.
- ``checksum``: the device checksum's GB/s against a device copy of the same bytes.
- ``probe``: layout discovery of a CUDA-resident ~1 GB rollout rank: probe time against one plain
  ``load_weights``, peak extra device memory against the parameter bytes (target <= 0.25x).
- ``mesh``: a two-proc Monarch mesh (one trainer, one rollout) moving CUDA parameters through
  the controller, bit-exact, naming the RDMA backend it used.

Without CUDA it says so and exits 0, unless ``--interpret`` asks for the steps' code paths on
the CPU (Triton's interpreter, small sizes, no ``mesh``): a check of the check itself under
another torch / triton, whose numbers say nothing about a GPU. Every step runs from the
repository root with no install: its children get the root on ``PYTHONPATH``, and the
``triton`` step's pytest skips ``tests/conftest.py`` (it imports Monarch; the kernel tests need
none of it). Lines start with ``gpu-check:``; a failed step prints its output's last lines and
makes the exit status 1.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
STEPS = ("triton", "kernels", "checksum", "probe", "mesh")
BUDGET_S = {"triton": 150, "kernels": 120, "checksum": 30, "probe": 90, "mesh": 90}
"""Each step's limit; together under 8 minutes."""
INTERPRET_SLOWER = 4
"""--interpret: each step's limit times this (Triton's interpreter on a shared CPU: the kernels
step took over 120 s at load 27 on two cores)."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(STEPS),
                        help=f"comma-separated steps to run, of {', '.join(STEPS)}")
    parser.add_argument("--step", choices=("checksum", "probe"), help=argparse.SUPPRESS)
    parser.add_argument("--probe-gib", type=float,
                        help="parameter bytes of the probed rank, GiB (default 1, or 1/64 with "
                             "--interpret)")
    parser.add_argument("--interpret", action="store_true",
                        help="no GPU: the steps' code paths on the CPU, Triton in its "
                             "interpreter, small sizes (not mesh); timings mean nothing")
    args = parser.parse_args()
    if args.probe_gib is None:
        args.probe_gib = 1 / 64 if args.interpret else 1.0
    if args.step:  # one in-process step, run by the parent below
        return {"checksum": _checksum_step, "probe": _probe_step}[args.step](args)
    steps = [s for s in args.only.split(",") if s]
    unknown = sorted(set(steps) - set(STEPS))
    if unknown:
        raise SystemExit(f"gpu-check: unknown step(s) {', '.join(unknown)}; choose from "
                         f"{', '.join(STEPS)}")
    if args.interpret:
        if "mesh" in steps:
            raise SystemExit("gpu-check: --interpret runs no mesh step (it needs Monarch and a "
                             "GPU): leave mesh out of --only")
        import triton

        print(f"gpu-check: --interpret: no GPU, CPU and Triton's interpreter, torch "
              f"{torch.__version__}, triton {triton.__version__}, Python "
              f"{sys.version.split()[0]} (smoke-test sizes: the numbers say nothing about a "
              f"GPU)", flush=True)
    elif not torch.cuda.is_available():
        print("gpu-check: no CUDA device is visible (torch.cuda.is_available() is False): "
              "nothing run. Run it on a machine with a GPU; here the CUDA path is covered by "
              "the emulated-CUDA tests of the default suite, and --interpret runs the steps' "
              "code paths on the CPU.")
        return 0
    else:
        print(f"gpu-check: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
              f"CUDA {torch.version.cuda}", flush=True)
    failed = [s for s in steps if not STEP_RUNNERS[s](interpret=args.interpret)]
    print(f"gpu-check: {len(steps) - len(failed)} of {len(steps)} steps passed"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def _run(step: str, cmd: list[str], interpret: bool = False) -> tuple[bool, str]:
    """Run ``cmd`` from the repository root within the step's budget (``interpret``: Triton's
    interpreter)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO), str(REPO / "benchmarks"), os.environ.get("PYTHONPATH", "")]))
    budget = BUDGET_S[step] * (INTERPRET_SLOWER if interpret else 1)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    t0 = time.monotonic()
    try:
        out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=budget)
    except subprocess.TimeoutExpired as e:
        # What the step printed before it was stopped: bytes here even with text=True.
        text = "".join(x.decode(errors="replace") if isinstance(x, bytes) else x
                       for x in (e.stdout, e.stderr) if x)
        _fail(step, f"did not finish within {budget} s", text)
        return False, text
    text = out.stdout + out.stderr
    if out.returncode:
        _fail(step, f"exit status {out.returncode} after {time.monotonic() - t0:.0f} s", text)
        return False, text
    return True, text


def _fail(step: str, why: str, text: str) -> None:
    print(f"gpu-check: {step}: FAILED ({why}); last lines:")
    for line in text.strip().splitlines()[-15:]:
        print(f"    {line}")


def _triton(interpret: bool = False) -> bool:
    # --noconftest: tests/conftest.py imports Monarch, which this file needs none of.
    ok, text = _run("triton", [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               "--noconftest", "tests/test_triton_kernels.py"], interpret)
    if ok:
        summary = [ln for ln in text.splitlines() if " passed" in ln][-1:]
        print(f"gpu-check: triton: {'interpreted' if interpret else 'compiled'} kernels "
              f"bit-exact against the torch path: "
              f"{summary[0].strip('= ') if summary else 'passed'}", flush=True)
    return ok


def _kernels(interpret: bool = False) -> bool:
    size = (["--device", "cpu", "--round-mib", "1", "--layers", "1", "--hidden", "256"]
            if interpret else ["--round-mib", "256"])
    ok, text = _run("kernels", [sys.executable, "benchmarks/bench_kernels_gpu.py", *size],
                    interpret)
    if not ok:
        return False
    lines = kernel_verdicts(text, judged=not interpret)
    print("\n".join(lines), flush=True)
    return bool(lines)


def kernel_verdicts(text: str, judged: bool = True) -> list[str]:
    """One line per summary row of bench_kernels_gpu's output, with its target's verdict: the
    lower of pack and assemble against a device copy, >= 0.8x at >= 64 KB regions and >= 0.5x
    on the mixed round (4 KB regions have no target). ``judged=False`` (the interpreter's
    rows): no verdict, the numbers say nothing about a GPU."""
    out = []
    for row in text.split("summary", 1)[-1].splitlines()[1:]:
        m = re.search(r"pack .*?\(([\d.]+)x copy\) \| assemble .*?\(([\d.]+)x\)", row)
        if not m:
            continue
        label = row[:14].strip()
        target = None if label.startswith("4 KB") else 0.5 if label.startswith("mixed") else 0.8
        low = min(float(m[1]), float(m[2]))
        verdict = ("interpreter: no verdict" if not judged else "no target" if target is None
                   else f"target {target}x: {'ok' if low >= target else 'BELOW'}")
        out.append(f"gpu-check: kernels: {row.strip()} | {verdict}")
    return out


def _checksum(interpret: bool = False) -> bool:
    ok, text = _run("checksum", [sys.executable, __file__, "--step", "checksum"]
                    + (["--interpret"] if interpret else []), interpret)
    print("\n".join(ln for ln in text.splitlines() if ln.startswith("gpu-check:")), flush=True)
    return ok


def _probe(interpret: bool = False) -> bool:
    ok, text = _run("probe", [sys.executable, __file__, "--step", "probe"]
                    + (["--interpret"] if interpret else []), interpret)
    print("\n".join(ln for ln in text.splitlines() if ln.startswith("gpu-check:")), flush=True)
    return ok


def _mesh(interpret: bool = False) -> bool:
    ok, text = _run("mesh", [sys.executable, "-m", "controller", "--trainer",
                             "nodes=1,gpus=1,tp=1", "--rollout", "engines=1,nodes=1,gpus=1,tp=1",
                             "--updates", "2"])
    if ok:
        exact = [ln for ln in text.splitlines() if "bit-identical" in ln]
        backend = re.search(r"backend (\w+)", text)  # connect's "..., backend tcp"
        print(f"gpu-check: mesh: 1 trainer proc -> 1 rollout proc, CUDA parameters, "
              f"{len(exact)} verified updates, RDMA backend "
              f"{backend[1] if backend else _backend()}: {exact[-1].strip() if exact else ''}",
              flush=True)
        ok = len(exact) == 2
    return ok


def _backend() -> str:
    from monarch.rdma import get_rdma_backend

    return get_rdma_backend()


STEP_RUNNERS = {"triton": _triton, "kernels": _kernels, "checksum": _checksum,
                "probe": _probe, "mesh": _mesh}


def _timed_ms(fn, repeats: int = 10, device: str = "cuda") -> float:
    if device != "cuda":  # --interpret: wall clock
        from bench_kernels_gpu import perf_counter_ms

        return perf_counter_ms(fn, repeats)
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _checksum_step(args) -> int:
    from weightbridge.execution.checksum import device_checksum

    device = "cpu" if args.interpret else "cuda"
    for mib in (1,) if args.interpret else (1, 64, 256):
        src = torch.randint(0, 256, (mib << 20,), dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        copy_ms = _timed_ms(lambda: dst.copy_(src), device=device)
        sum_ms = _timed_ms(lambda: device_checksum(src), device=device)
        rate = src.numel() / sum_ms / 1e6
        print(f"gpu-check: checksum: {mib:4d} MiB  device checksum {rate:7.0f}"
              f" GB/s  copy {src.numel() / copy_ms / 1e6:7.0f} GB/s  = {copy_ms / sum_ms:.2f}x "
              f"copy speed ({sum_ms:.3f} ms per checksum)")
    return 0


def _probe_step(args) -> int:
    from meshes.qwen3_moe import MoEConfig, RolloutShard, checkpoint_spec
    from weightbridge import extract_source_map

    # The benchmark model's shapes, layers scaled so one whole rank (TP1 x EP1) holds ~1 GiB.
    per_layer = RolloutShard(MoEConfig(layers=1), 1, 0, 1, 0)
    layer_bytes = sum(p.numel() * p.element_size() for n, p in per_layer.params.items()
                      if ".layers." in n)
    layers = max(1, round(args.probe_gib * 2**30 / layer_bytes))
    config = MoEConfig(layers=layers)
    spec = checkpoint_spec(config)
    worker = RolloutShard(config, 1, 0, 1, 0)
    device = "cpu" if args.interpret else "cuda"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if device == "cuda":
        torch.cuda.set_device(0)
    for name, p in worker.params.items():  # the loader writes into worker.params in place
        worker.params[name] = p.to(device)
    param_bytes = sum(p.numel() * p.element_size() for p in worker.params.values())
    gen = torch.Generator().manual_seed(1)
    checkpoint = {t.name: torch.randn(t.shape, generator=gen).bfloat16() for t in spec.tensors}
    sync()
    t0 = time.perf_counter()
    worker.load_weights(checkpoint.items())
    sync()
    load_s = time.perf_counter() - t0
    del checkpoint
    if device == "cuda":
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    smap = extract_source_map(worker.params, worker.load_weights, spec)
    sync()
    probe_s = time.perf_counter() - t0
    if device == "cuda":
        extra = torch.cuda.max_memory_allocated() - base
        memory = (f"peak extra device memory {extra / 2**20:.0f} MiB = "
                  f"{extra / param_bytes:.3f}x the parameter bytes (target <= 0.25x"
                  f"{', ok' if extra <= 0.25 * param_bytes else ', ABOVE'})")
    else:
        memory = "CPU parameters (--interpret): no device memory to measure"
    print(f"gpu-check: probe: {layers}-layer rank, {param_bytes / 2**30:.3f} GiB of "
          f"{device.upper()} parameters, {len(smap.pieces)} pieces: probe {probe_s:.2f} s / "
          f"plain load_weights {load_s:.2f} s = {probe_s / load_s:.1f}x; {memory}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
