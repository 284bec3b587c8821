"""The probe's scaling table: rank sizes x TP degrees x devices, each row in a fresh process.

`bench_probe.py --sweep` runs it. A row probes one TP rank of a bf16 checkpoint of 4096 x 1024
tensors through a row-sharded loader (``param.copy_(tensor[rows of this rank])``, what a
column-parallel vLLM layer does) and, in the same process, times one plain ``load_weights`` of
pre-built checkpoint tensors (best of five) and samples the process's resident memory (every
2 ms) during the probe, all on one torch thread (`THREADS`). The parameters hold real values
before the probe (their pages are touched), so the extra memory is the probe's own. A fresh
process per run of a row: memory one run freed cannot hide the next one's.

Each run prints one line, ``ROW {...}``; the parent runs each row three times and shows the run
of the median ratio, the range of the ratios, and the highest memory of the three. On the
emulated CUDA device (`weightbridge.testing.emulated_cuda`) the parameters' values live in host
memory; its times include the emulation's overhead and say nothing about a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import torch

from weightbridge import CheckpointSpec, TensorSpec, extract_source_map
from weightbridge.testing import emulated_cuda

ROWS, COLS = 4096, 1024
"""Every checkpoint tensor: 4096 x 1024 bf16 (8 MiB)."""
SWEEP = (("cpu", 256, 1, "rows"), ("cpu", 256, 2, "rows"), ("cpu", 256, 4, "rows"),
         ("cpu", 256, 8, "rows"), ("cpu", 64, 8, "rows"), ("cpu", 1024, 1, "rows"),
         ("cpu", 1, 2, "rows"), ("cpu", 256, 2, "cols"), ("cpu", 256, 8, "cols"),
         ("emulated-cuda", 256, 2, "rows"), ("emulated-cuda", 256, 8, "rows"),
         ("emulated-cuda", 64, 8, "rows"))
"""(device, checkpoint MiB, TP degree, split): ranks of 8 MiB to 1 GiB on CPU (the last
"rows" row on CPU is a tiny loader, a 0.5 MiB rank of 8 tensors of 128 x 512), two
row-parallel ranks ("cols": each row a slice-copy of its own), three on the emulated CUDA
device."""
TARGET_RATIO, TARGET_SHARE, TARGET_SLACK = 6.0, 0.25, 64 << 20
"""Issue 41: probe <= 6x a plain load for CPU ranks of 8 MiB to 1 GiB (a tiny loader's target
is against wbridge: `probe_tiny`; the emulated device's times include the emulation's own
overhead); extra host memory <= 0.25x the rank + 64 MiB; extra device memory <= 0.25x the
rank."""


THREADS = 1
"""Torch intra-op threads in every row (see `measure`)."""


class PeakRss:
    """Samples this process's resident memory in a thread; `peak` is the high-water mark."""

    def __init__(self):
        self.peak = self.now()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def now() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self.now())

    def __enter__(self) -> "PeakRss":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.now())


class ShardedRank:
    """Rank ``rank`` of ``tp`` of a checkpoint of equal 2-d tensors, sharded by rows
    (``split="rows"``: a column-parallel layer, one slice-copy per tensor) or by columns
    (``"cols"``: a row-parallel layer, one slice-copy per row)."""

    def __init__(self, checkpoint_mib: float, tp: int, rank: int, device: str,
                 split: str = "rows"):
        if split not in ("rows", "cols"):
            raise ValueError(f"split must be 'rows' (column-parallel) or 'cols' (row-parallel), "
                             f"got {split!r}")
        rows, cols = (ROWS, COLS) if checkpoint_mib >= 8 else (128, 512)
        num = max(1, round(checkpoint_mib * 2**20 / (rows * cols * 2)))
        self.spec = CheckpointSpec(tuple(TensorSpec(f"layers.{i}.weight", (rows, cols),
                                                    "bfloat16") for i in range(num)))
        size = rows if split == "rows" else cols
        lo, hi = rank * size // tp, (rank + 1) * size // tp
        self.index = slice(lo, hi) if split == "rows" else (slice(None), slice(lo, hi))
        shape = (hi - lo, cols) if split == "rows" else (rows, hi - lo)
        self.params = {t.name: torch.empty(shape, dtype=torch.bfloat16,
                                           device=device).fill_(1.0) for t in self.spec.tensors}

    def load_weights(self, weights) -> None:
        for name, tensor in weights:
            self.params[name].copy_(tensor[self.index])

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params.values())


def measure(device: str, checkpoint_mib: float, tp: int, split: str = "rows",
            repeats: int = 5) -> dict:
    """One row, in this process: probe time, plain-load time, peak extra host/device bytes."""
    # One torch thread for the loads and the probe alike: on a shared machine a parallel op
    # waits for a busy core, and the plain load's times then spread over 20x.
    torch.set_num_threads(THREADS)
    emulated = device == "emulated-cuda"
    if emulated:
        emulated_cuda.activate()
    rank = ShardedRank(checkpoint_mib, tp, tp - 1, "cuda" if emulated else "cpu", split)
    device_base = emulated_cuda.memory.current
    emulated_cuda.memory.reset_peak()
    base = PeakRss.now()
    with PeakRss() as rss:
        t0 = time.perf_counter()
        smap = extract_source_map(rank.params, rank.load_weights, rank.spec)
        probe_s = time.perf_counter() - t0
    host = rss.peak - base
    dev = emulated_cuda.memory.peak - device_base if emulated else 0
    gen = torch.Generator().manual_seed(1)
    checkpoint = {t.name: torch.randn(t.shape, generator=gen).bfloat16()
                  for t in rank.spec.tensors}
    load_s = min(_timed(lambda: rank.load_weights(checkpoint.items())) for _ in range(repeats))
    return {"device": device, "tp": tp, "split": split, "rank_bytes": rank.nbytes,
            "probe_s": probe_s, "load_s": load_s, "host_bytes": host, "device_bytes": dev,
            "pieces": len(smap.pieces)}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_sweep(script: str, rows=SWEEP, runs: int = 3) -> list[dict]:
    """Every row ``runs`` times, each in a fresh process (``script --row
    device,mib,tp,split``); prints each row as it ends: the run of the median ratio, the
    ratios' range, and the highest memory of the runs. (One run a row read 4.2 and then 7.2
    for the same rank on this shared host.)"""
    out = []
    for device, mib, tp, split in rows:
        got = []
        for _ in range(runs):
            proc = subprocess.run([sys.executable, script, "--row",
                                   f"{device},{mib},{tp},{split}"],
                                  capture_output=True, text=True, env=dict(os.environ))
            line = next((x for x in proc.stdout.splitlines() if x.startswith("ROW ")), None)
            if proc.returncode or line is None:
                raise RuntimeError(f"sweep row {device},{mib},{tp},{split} failed:\n"
                                   f"{proc.stderr[-3000:]}")
            got.append(json.loads(line[4:]))
        got.sort(key=lambda r: r["probe_s"] / r["load_s"])
        row = dict(got[len(got) // 2], ratios=[r["probe_s"] / r["load_s"] for r in got],
                   host_bytes=max(r["host_bytes"] for r in got),
                   device_bytes=max(r["device_bytes"] for r in got))
        out.append(row)
        print(format_row(row), flush=True)
    return out


def format_row(r: dict) -> str:
    mib = r["rank_bytes"] / 2**20
    ratio = r["probe_s"] / r["load_s"]
    host = r["host_bytes"] / r["rank_bytes"]
    budget = TARGET_SHARE * r["rank_bytes"] + TARGET_SLACK
    memory_ok = r["host_bytes"] <= budget and r["device_bytes"] <= TARGET_SHARE * r["rank_bytes"]
    if r["device"] != "cpu":
        verdict = "(emulation: no target)"
    elif r["rank_bytes"] < 8 << 20:
        verdict = "(under 8 MiB: --tiny)"
    else:
        verdict = "yes" if ratio <= TARGET_RATIO else "NO"
    spread = r.get("ratios", [ratio])
    return (f"| {r['device']} | {r['tp']} {r['split']} | {mib:.1f} MiB | {r['probe_s']:.3f} s | "
            f"{r['load_s']:.4f} s | {ratio:.1f} {verdict} | {min(spread):.1f}-{max(spread):.1f} | "
            f"{r['host_bytes'] / 2**20:.1f} MiB ({host:.2f}x) | "
            f"{r['device_bytes'] / r['rank_bytes']:.2f}x | {'yes' if memory_ok else 'NO'} |")


HEADER = ("| device | tp, split | rank | probe | plain load (best of 5) | ratio (target <= 6) | "
          "ratios of the runs | peak extra host | peak extra device | memory within targets "
          "(host <= 0.25x + 64 MiB, device <= 0.25x) |\n|---|---|---|---|---|---|---|---|---|---|")
