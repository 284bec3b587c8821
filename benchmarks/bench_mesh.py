"""Mesh transfer benchmark: EWTT, AGST, ideal EWTT and the pack/assemble share, two layouts.

    .venv/bin/python benchmarks/bench_mesh.py                   # "small" model (~200M elements)
    .venv/bin/python benchmarks/bench_mesh.py --model tiny      # seconds, for a smoke run
    .venv/bin/python benchmarks/bench_mesh.py --model tiny --writes both --reps 3   # A/B

One run, one pair of proc meshes (4 trainer procs, 4 rollout procs on this host): the default
layout (trainer TP2 x EP2 -> two TP2 engines) and a 4-replica layout (the same trainers -> four
TP1 engines) each connect (probe, plan, link probe, buffers) and run ``--updates`` updates with
8 MB RDMA chunks. One line per update: EWTT and AGST from the actors' own timestamps, the ideal
EWTT of Eq. (1) from the link probe at connect, EWTT / ideal, and pack + assemble time as a share
of EWTT (the paper: < 3%). Every update is verified bit-exact; a mismatch exits 1.

``--writes both`` connects each layout ``--reps`` times per way of starting a step's RDMA writes
(`TransferConfig.rdma_writes`: a ``write_from`` per range, or one action per step), the two
alternating, and prints each way's median EWTT and median write step (a worker's writes of
one round's stage, issue to all landed) with the ratio batched / per-range.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

from monarch.actor import this_host

from controller.driver import MeshTransfer
from meshes.qwen3_moe import SIZES, checkpoint_spec
from weightbridge.specs import RolloutSpec, TrainerSpec
from weightbridge import TransferConfig
from weightbridge.planning.worker_plans import worker_plan
from weightbridge.mesh.transport import configure_transport

TRAINER = "nodes=1,gpus=4,tp=2,ep=2"
LAYOUTS = {
    "default (TP2xEP2 -> 2 x TP2 engines)": "engines=2,nodes=1,gpus=2,tp=2",
    "4 replicas (TP2xEP2 -> 4 x TP1 engines)": "engines=4,nodes=1,gpus=1",
}


WRITE_STAGES = ("receive", "external", "internal")


def ranges_per_step(plan) -> str:
    """How many byte ranges a write step of the plan writes (one worker, one round's stage)."""
    counts = collections.Counter()
    for worker in plan.workers:
        for rnd in worker_plan(plan, worker).rounds:
            for w in rnd.writes:
                counts[(worker, rnd.index, w.stage)] += 1
    n = sorted(counts.values())
    return (f"{len(n)} write steps of {statistics.median(n):g} ranges (median; {n[0]}-{n[-1]})"
            if n else "no write steps")


def run_layout(label: str, rollout: str, args, procs, writes: str = "per-range",
               measured: dict | None = None) -> bool:
    """Connect one layout on the shared procs and run the updates; False on a mismatch.
    Appends each update's EWTT and write step times (s) to ``measured`` if given."""
    config = TransferConfig(round_bytes=int(args.round_mib * (1 << 20)), rdma_writes=writes)
    with MeshTransfer(TrainerSpec.parse(TRAINER), RolloutSpec.parse(rollout), args.model,
                      config=config, procs=procs) as mt:
        t0 = time.perf_counter()
        plan = mt.connect()
        links = ", ".join(f"{k} {v / 1e6:.0f} MB/s" for k, v in mt.links.items())
        print(f"[{label}] connect {time.perf_counter() - t0:.1f}s, {plan.num_rounds} rounds, "
              f"{plan.correspondence.nbytes / 1e6:.1f} MB unique; links {links}; "
              f"ideal EWTT {mt.ideal_s:.3f}s; {ranges_per_step(plan)}", flush=True)
        ok = True
        for version in range(1, args.updates + 1):
            report = mt.update(version)
            ok &= not report.mismatched
            verdict = "bit-exact" if not report.mismatched else \
                f"MISMATCH {len(report.mismatched)}"
            print(f"[{label}] update {version}: {report.timing_line()}  "
                  f"({report.rdma_bytes / 1e6:.0f} MB over RDMA, {verdict})", flush=True)
            if measured is not None:
                measured["ewtt"].append(report.timing.ewtt_s)
                measured["step"].extend((t1 - t0) / 1e9 for spans in report.timing.spans.values()
                                        for stage, _, t0, t1 in spans if stage in WRITE_STAGES)
        return ok


def compare_writes(label: str, rollout: str, args, procs) -> bool:
    """Per-range writes against one action per step on one layout, alternating connects."""
    measured = {w: {"ewtt": [], "step": []} for w in ("per-range", "batched")}
    ok = True
    for rep in range(args.reps):
        for writes in (("per-range", "batched") if rep % 2 == 0 else ("batched", "per-range")):
            ok &= run_layout(f"{label}, {writes}", rollout, args, procs, writes,
                             measured[writes])
    med = {w: {k: statistics.median(v) for k, v in m.items()} for w, m in measured.items()}
    base = med["per-range"]
    print(f"[{label}] writes, medians of {args.reps} connects x {args.updates} updates "
          f"(load {os.getloadavg()[0]:.2f}): " + "  ".join(
              f"{w}: EWTT {m['ewtt']:.3f}s ({m['ewtt'] / base['ewtt']:.2f}x), write step "
              f"{m['step'] * 1e3:.2f} ms ({m['step'] / base['step']:.2f}x) over "
              f"{len(measured[w]['step'])} steps" for w, m in med.items()), flush=True)
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(SIZES), default="small")
    parser.add_argument("--updates", type=int, default=2, help="updates per layout")
    parser.add_argument("--round-mib", type=float, default=8,
                        help="round buffer per worker, MiB (0.5: 512 KiB)")
    parser.add_argument("--writes", choices=("per-range", "batched", "both"), default="per-range",
                        help="how a step's RDMA writes start (TransferConfig.rdma_writes); "
                             "both: an A/B of the two")
    parser.add_argument("--reps", type=int, default=3, help="connects per way with --writes both")
    args = parser.parse_args()
    spec = checkpoint_spec(SIZES[args.model])
    print(f"model {args.model}: {spec.numel:,} elements ({spec.numel * 2 / 1e6:.0f} MB bf16); "
          f"trainer [{TRAINER}] 4 procs, rollout 4 procs; rounds of {args.round_mib:g} MiB",
          flush=True)
    t_start = time.perf_counter()
    configure_transport()  # 8 MB chunks; before spawning (children read the config at start)
    meshes = []
    ok = True
    try:
        meshes.append(this_host().spawn_procs(per_host={"worker": 4}, name="trainer"))
        meshes.append(this_host().spawn_procs(per_host={"worker": 4}, name="rollout"))
        for label, rollout in LAYOUTS.items():
            if args.writes == "both":
                ok &= compare_writes(label, rollout, args, tuple(meshes))
            else:
                ok &= run_layout(label, rollout, args, tuple(meshes), args.writes)
    finally:
        for mesh in meshes:
            mesh.stop().get(timeout=60)
    print(f"total {time.perf_counter() - t_start:.0f}s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
