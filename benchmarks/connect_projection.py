"""Time to connect at the paper's scale, projected from what this machine measures.

    .venv/bin/python benchmarks/connect_projection.py     # about a minute on 2 cores

Measured here, in this run: the probe's and the verification pass's throughput on one CPU rank
of 1 GiB (the sweep's loader, `probe_sweep.ShardedRank`, one torch thread; a checkpoint over
about 500 MiB of bf16 needs three index passes, as every deployment here does) and each
deployment's controller work from its shape-only source maps (`weightbridge.shapes`), which
runs on the controller one step after another. At a first connect: unpickling every worker's
map as it arrives (the gather), the plan cache's key (a digest of the maps), planning (the
plan, every worker's plan, each pickled: `plan_cache.plan_of`), writing the cache entry, and
the hand-out (Monarch pickling each worker's set-up call, with cloudpickle). At a cached one
(a restart: `weightbridge.coordination.plan_cache`): the gather, the key, reading the entry
back, the hand-out. Derived, per deployment of Table 2: the largest worker's parameter bytes
and largest parameter, the source maps gathered (pickled, as they travel), and

    first connect  = largest rank / probe throughput  + controller, first
    cached connect = largest rank / verification throughput + controller, cached

(workers probe at once, so the largest rank sets the pace; the workers' own set-up of buffers
and handles, at once, is left out). The controller's steps run with the cyclic collector
paused, as connect runs them (`weightbridge.gc_pause`). The probe's peak extra host memory is
projected as the sweep measures it: a fixed part (measured here) plus, for parameters on a
GPU, one parameter's host copy (the verification pass compares a parameter at a time) and the
index and random rings (one checkpoint tensor of the largest size each).
"""

from __future__ import annotations

import contextlib
import pickle
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import cloudpickle
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.machine import load  # noqa: E402
from benchmarks.probe_sweep import PeakRss, ShardedRank  # noqa: E402
from weightbridge.config import DEFAULT_DEPTH  # noqa: E402
from weightbridge.coordination.plan_cache import PlanCache, plan_key, plan_of  # noqa: E402
from weightbridge.discovery import probe as probe_module  # noqa: E402
from weightbridge.discovery.probe import probe, reverify  # noqa: E402
from weightbridge.gc_pause import gc_paused  # noqa: E402
from weightbridge.shapes import TABLE_2, checkpoint, workers  # noqa: E402

_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1}


def throughput(checkpoint_mib: int = 1024) -> tuple[float, float, int]:
    """(probe bytes/s, verification bytes/s, peak extra host bytes of the probe). The probe
    makes its index passes: the deployments' ranks hold fused and stacked parameters, which
    the one-pass decode of a rank of boxes (`weightbridge.discovery.one_pass`) does not apply
    to, so it is kept out of this measurement."""
    torch.set_num_threads(1)
    rank = ShardedRank(checkpoint_mib, 1, 0, "cpu")
    base = PeakRss.now()
    with PeakRss() as rss, mock.patch.object(probe_module, "_one_pass", lambda *a: None):
        t0 = time.perf_counter()
        probed = probe(rank.params, rank.load_weights, rank.spec)
        probe_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    assert reverify(probed, rank.params, rank.load_weights, rank.spec)
    verify_s = time.perf_counter() - t0
    return rank.nbytes / probe_s, rank.nbytes / verify_s, rss.peak - base


def deployment(dep) -> dict:
    trainers, rollouts = workers(dep)
    maps = [m for m, _ in trainers + rollouts]
    ranks = [sum(_numel(p.shape) * _BYTES[p.dtype] for p in m.params) for m in maps]
    largest_param = max(_numel(p.shape) * _BYTES[p.dtype] for m in maps for p in m.params)
    largest_tensor = max(t.numel * _BYTES[t.dtype] for t in checkpoint(dep.model).tensors)
    blobs = [pickle.dumps(m) for m in maps]  # (each worker its own, at once)
    sizes = {"round_bytes": dep.round_bytes, "depth": DEFAULT_DEPTH}
    first: dict = {}
    cached: dict = {}
    with tempfile.TemporaryDirectory(prefix="wb-plans-") as directory, gc_paused():
        cache = PlanCache(directory)
        for steps in (first, cached):  # (`session.probe_group`, then `session.plan_group`)
            with _timed(steps, "gather"):
                [pickle.loads(b) for b in blobs]
            with _timed(steps, "key"):
                key = plan_key(trainers, rollouts, **sizes)
            if steps is first:
                with _timed(steps, "plan"):
                    planned = plan_of(trainers, rollouts, **sizes)
                with _timed(steps, "save"):
                    cache.save(key, planned)
            else:
                with _timed(steps, "read"):
                    planned = cache.load(key)
                assert planned is not None
            with _timed(steps, "hand-out"):  # (Monarch pickles each worker's call)
                [cloudpickle.dumps((planned.handed[w], list(planned.ranges.get(w, ())), 0))
                 for w in planned.handed]
        entry = cache.path(key).stat().st_size
    return {"name": f"({dep.name}) {dep.model.name}", "workers": len(maps), "rank": max(ranks),
            "param": largest_param, "tensor": largest_tensor,
            "gathered": sum(map(len, blobs)), "first": first, "cached": cached, "entry": entry}


@contextlib.contextmanager
def _timed(steps: dict, name: str):
    t0 = time.perf_counter()
    yield
    steps[name] = time.perf_counter() - t0


def _steps(steps: dict) -> str:
    return f"{' + '.join(f'{s:.1f}' for s in steps.values())} = {sum(steps.values()):.1f} s"


def _numel(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def main() -> None:
    print(f"load before: {load()}")
    probe_rate, verify_rate, fixed = throughput()
    print(f"measured on a 1 GiB CPU rank (three index passes): probe "
          f"{probe_rate / 2**20:.0f} MiB/s, verification pass {verify_rate / 2**20:.0f} MiB/s, "
          f"probe peak extra host {fixed / 2**20:.1f} MiB")
    print("| deployment | workers | largest rank | probe (first connect) | verification "
          "(cached) | peak extra host, GPU params | maps gathered | plan cache entry | "
          "controller, first: gather + key + plan + save + hand-out | controller, cached: "
          "gather + key + read + hand-out | first connect | cached connect | cached / first |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for dep in TABLE_2:
        d = deployment(dep)
        probe_s, verify_s = d["rank"] / probe_rate, d["rank"] / verify_rate
        host = fixed + d["param"] + d["tensor"]
        first = probe_s + sum(d["first"].values())
        cached = verify_s + sum(d["cached"].values())
        print(f"| {d['name']} | {d['workers']} | {d['rank'] / 2**30:.1f} GiB | {probe_s:.0f} s "
              f"| {verify_s:.0f} s | {host / 2**30:.2f} GiB ({host / d['rank']:.3f}x) | "
              f"{d['gathered'] / 2**20:.1f} MiB | {d['entry'] / 2**20:.1f} MiB | "
              f"{_steps(d['first'])} | {_steps(d['cached'])} | {first:.0f} s | {cached:.0f} s "
              f"| {cached / first:.2f} |", flush=True)
    print(f"load after: {load()}")


if __name__ == "__main__":
    main()
