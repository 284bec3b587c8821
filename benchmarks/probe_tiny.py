"""Tiny loaders (under 1 MB of parameters): our probe against wbridge 0.1.0's, in one run.

`bench_probe.py --tiny` runs it. wbridge (a peer package on PyPI, not a dependency) probes a
loader with `wbridge.utils.specgen.infer_load_spec` and checks the result with
`verify_load_spec` after one more real load; ours is `extract_source_map` (verification pass
included) and, for the probe alone, ``verify=False``. Both probe the same loaders, written
here, on CPU parameters, one torch thread:

- ``rows``: a row-sharded rank (rank 1 of TP 2) of 8 tensors of 128 x 512 bf16 (0.5 MiB);
- ``fused``: a vLLM-style layer, q/k/v and gate/up concatenated into fused parameters, TP 2
  (column shards of the fused weights, a row shard of o and down);
- ``transposed``: weights stored transposed (``param.copy_(tensor.t())``).

Each (implementation, loader) runs in a fresh process: its first call is timed and its peak
extra resident memory sampled (`probe_sweep.PeakRss`, every 2 ms), then the best of
`REPEATS` more calls. wbridge's ``infer_load_spec`` asserts its parameters are CUDA tensors;
its probe builds on the CPU when no GPU is present, so its process runs under ``python -O``
(assertions off) to probe CPU parameters, the same ones ours probes. Only wbridge's public
functions are called; its package is found on the normal path or at ``--wbridge-path``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch

from benchmarks.probe_sweep import PeakRss

LOADERS = ("rows", "fused", "transposed")
IMPLS = ("ours", "ours-noverify", "wbridge", "wbridge-noverify")
REPEATS = 5
TARGET = 2.0
"""Issue 41: ours within 2x wbridge's time and memory on tiny loaders."""


class TinyLoader:
    """A tiny worker: its checkpoint (name -> shape), its CPU parameters and its loader."""

    def __init__(self, kind: str):
        self.kind = kind
        h, tp = 256, 2
        if kind == "rows":
            self.shapes = {f"layers.{i}.weight": (128, 512) for i in range(8)}
            self.params = {n: torch.ones(64, 512, dtype=torch.bfloat16) for n in self.shapes}
        elif kind == "fused":
            self.shapes = {"q": (h, h), "k": (h // 2, h), "v": (h // 2, h), "o": (h, h),
                           "gate": (2 * h, h), "up": (2 * h, h), "down": (h, 2 * h)}
            self.params = {"qkv": torch.ones(2 * h // tp, h, dtype=torch.bfloat16),
                           "o": torch.ones(h, h // tp, dtype=torch.bfloat16),
                           "gate_up": torch.ones(4 * h // tp, h, dtype=torch.bfloat16),
                           "down": torch.ones(h, h, dtype=torch.bfloat16)}
        elif kind == "transposed":
            self.shapes = {f"w{i}": (384, 256) for i in range(4)}
            self.params = {n: torch.ones(256, 384, dtype=torch.bfloat16) for n in self.shapes}
        else:
            raise ValueError(f"unknown tiny loader {kind!r}: one of {LOADERS}")

    def load_weights(self, weights) -> None:
        """The loader: (name, tensor) pairs, any order."""
        got = dict(weights)
        if self.kind == "rows":
            for name, t in got.items():
                self.params[name].copy_(t[64:])
        elif self.kind == "transposed":
            for name, t in got.items():
                self.params[name].copy_(t.t())
        else:  # fused, rank 1 of TP 2
            half = lambda t: t[t.shape[0] // 2:]  # noqa: E731
            self.params["qkv"].copy_(torch.cat([half(got["q"]), half(got["k"]),
                                                half(got["v"])]))
            self.params["gate_up"].copy_(torch.cat([half(got["gate"]), half(got["up"])]))
            self.params["o"].copy_(got["o"][:, got["o"].shape[1] // 2:])
            self.params["down"].copy_(got["down"][:, got["down"].shape[1] // 2:])

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params.values())


def measure(impl: str, kind: str) -> dict:
    """One (implementation, loader) in this process: first call, best repeat, peak memory."""
    torch.set_num_threads(1)
    loader = TinyLoader(kind)
    probe = _ours(loader, impl == "ours") if impl.startswith("ours") else \
        _wbridge(loader, impl == "wbridge")
    base = PeakRss.now()
    with PeakRss() as rss:
        t0 = time.perf_counter()
        probe()
        first = time.perf_counter() - t0
    best = min(_timed(probe) for _ in range(REPEATS))
    return {"impl": impl, "loader": kind, "rank_bytes": loader.nbytes, "first_s": first,
            "best_s": best, "host_bytes": rss.peak - base}


def _ours(loader: TinyLoader, verify: bool):
    from weightbridge import CheckpointSpec, TensorSpec, extract_source_map

    spec = CheckpointSpec(tuple(TensorSpec(n, s, "bfloat16") for n, s in loader.shapes.items()))
    return lambda: extract_source_map(loader.params, loader.load_weights, spec, verify=verify)


def _wbridge(loader: TinyLoader, verify: bool):
    from wbridge.utils.specgen import infer_load_spec, verify_load_spec

    gen = torch.Generator().manual_seed(1)
    checkpoint = {n: torch.randn(s, generator=gen).bfloat16() for n, s in loader.shapes.items()}
    fetch = {n: (lambda n=n: checkpoint[n]) for n in checkpoint}

    def load(fetcher):
        loader.load_weights((n, get()) for n, get in fetcher.items())

    def probe():
        spec = infer_load_spec(fetch, dict(loader.shapes), lambda: loader.params, load)
        if verify:  # wbridge's check: a real load, then the spec replayed and compared
            load(fetch)
            verify_load_spec(fetch, lambda: loader.params, spec)
        return spec
    return probe


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_tiny(script: str, wbridge_path: str | None) -> list[str]:
    """Every (implementation, loader) in a fresh process; the table's lines."""
    env = dict(os.environ)
    if wbridge_path:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), wbridge_path]))
    rows = {}
    for kind in LOADERS:
        for impl in IMPLS:
            flags = ["-O"] if impl.startswith("wbridge") else []
            proc = subprocess.run([sys.executable, *flags, script, "--tiny-row", f"{impl},{kind}"],
                                  capture_output=True, text=True, env=env)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("ROW ")), None)
            if proc.returncode or line is None:
                hint = ("; install it apart from the project, e.g. `pip install --target "
                        "/tmp/wbridge wbridge==0.1.0 --no-deps`, and pass --wbridge-path "
                        "/tmp/wbridge" if "No module named 'wbridge'" in proc.stderr else "")
                raise RuntimeError(f"tiny row {impl},{kind} failed{hint}:\n"
                                   f"{proc.stderr[-3000:]}")
            rows[impl, kind] = json.loads(line[4:])
    out = ["| loader | rank | implementation | first call | best of 5 | peak extra host | "
           "ours / wbridge: first, best, memory (target <= 2) |", "|---|---|---|---|---|---|---|"]
    for kind in LOADERS:
        for ours, theirs in (("ours", "wbridge"), ("ours-noverify", "wbridge-noverify")):
            for impl in (ours, theirs):
                r = rows[impl, kind]
                ratio = ""
                if impl == ours:
                    w = rows[theirs, kind]
                    ratios = (r["first_s"] / w["first_s"], r["best_s"] / w["best_s"],
                              r["host_bytes"] / max(w["host_bytes"], 1))
                    ratio = ", ".join(f"{x:.2f}" for x in ratios) + \
                        (" yes" if max(ratios) <= TARGET else " NO")
                out.append(f"| {kind} | {r['rank_bytes'] / 1024:.0f} KiB | {impl} | "
                           f"{r['first_s'] * 1e3:.1f} ms | {r['best_s'] * 1e3:.1f} ms | "
                           f"{r['host_bytes'] / 2**20:.1f} MiB | {ratio} |")
    return out
