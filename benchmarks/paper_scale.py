"""Paper-scale planning and simulation: Table 2 and the section 4.3 sensitivity studies.

Builds shape-only source maps (no tensors) for Megatron-style trainers and SGLang-style rollout
engines with real model shapes, plans each deployment, and simulates it on the paper's cluster
(8 GPUs per node, 400 GB/s RDMA per node, 450 GB/s NVLink per GPU). Writes CSV and PNG files
and prints one line per measurement.

Run (about a minute on 2 cores)::

    .venv/bin/python benchmarks/paper_scale.py                  # writes out/paper_scale/
    .venv/bin/python benchmarks/paper_scale.py --out /tmp/ps --skip-sweeps
"""

from __future__ import annotations

import argparse
import csv
import multiprocessing
import resource
import time
from dataclasses import replace
from pathlib import Path

from weightbridge import plan_transfer, simulate
from weightbridge.shapes import PAPER_CLUSTER, QWEN3_30B_A3B, TABLE_2, Deployment, workers

FIELDS = ["study", "label", "trainer_nodes", "rollout_nodes", "rounds", "ideal_s", "ewtt_s",
          "broadcast_s", "p2p_s", "ewtt_over_ideal", "broadcast_over_ewtt", "p2p_over_ewtt",
          "plan_s"]


def measure(study: str, dep: Deployment) -> dict:
    trainers, rollouts = workers(dep)
    start = time.perf_counter()
    plan = plan_transfer(trainers, rollouts, round_bytes=dep.round_bytes)
    plan_s = time.perf_counter() - start
    est = simulate(plan, PAPER_CLUSTER)
    row = dict(study=study, label=dep.name, trainer_nodes=dep.trainer_nodes,
               rollout_nodes=len({p.node for _, p in rollouts}), rounds=est.num_rounds,
               ideal_s=est.ideal, ewtt_s=est.ewtt, broadcast_s=est.broadcast, p2p_s=est.p2p,
               ewtt_over_ideal=est.ratio, broadcast_over_ewtt=est.broadcast / est.ewtt,
               p2p_over_ewtt=est.p2p / est.ewtt, plan_s=plan_s)
    print(f"{study:>9} {dep.name:<22} {dep.model.name:<16} ideal {est.ideal * 1e3:8.1f} ms  "
          f"plan {est.ewtt * 1e3:8.1f} ms ({est.ratio:.3f}x ideal)  broadcast "
          f"{est.broadcast * 1e3:9.1f} ms ({row['broadcast_over_ewtt']:5.1f}x)  p2p "
          f"{est.p2p * 1e3:8.1f} ms ({row['p2p_over_ewtt']:4.1f}x)  rounds {est.num_rounds:3d}  "
          f"planned in {plan_s:.2f} s", flush=True)
    return row


def _plan_d_alone(_: int) -> tuple[float, float, int, int]:
    """Plan deployment (d) in a fresh process: (seconds, peak RSS MB, pieces, workers)."""
    dep = TABLE_2[3]
    trainers, rollouts = workers(dep)
    pieces = sum(len(m.pieces) for m, _ in trainers + rollouts)
    start = time.perf_counter()
    plan_transfer(trainers, rollouts, round_bytes=dep.round_bytes)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return seconds, peak, pieces, len(trainers) + len(rollouts)


def sweeps() -> list[tuple[str, Deployment]]:
    """Section 4.3 on Qwen3-30B-A3B: rollout replicas, trainer nodes, and the DP sweep."""
    base = Deployment(name="", model=QWEN3_30B_A3B, trainer_nodes=1, trainer_tp=4, trainer_ep=8,
                      engines=1, engine_tp=8, engine_ep=8)
    out = [("replicas", replace(base, name=f"1 trainer node, {n} rollout", engines=n))
           for n in (1, 2, 4, 8, 16)]
    out += [("trainers", replace(base, name=f"{n} trainer, 4 rollout", trainer_nodes=n,
                                 engines=4)) for n in (1, 2, 4, 8)]
    for tdp in (1, 2, 4):
        for rdp in (1, 2, 4):
            out.append(("dp", replace(base, name=f"TDP{tdp} RDP{rdp}", trainer_nodes=2,
                                      trainer_pp=4 // tdp, trainer_ep=4 * tdp, engines=rdp,
                                      engine_tp=16 // rdp, engine_ep=16 // rdp)))
    return out


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for study in sorted({r["study"] for r in rows}):
        sel = [r for r in rows if r["study"] == study]
        fig, ax = plt.subplots(figsize=(max(6, len(sel) * 0.9), 4))
        x = range(len(sel))
        for key, name in (("ideal_s", "ideal (Eq. 1)"), ("ewtt_s", "WeightBridge plan"),
                          ("broadcast_s", "broadcast"), ("p2p_s", "P2P")):
            ax.plot(x, [r[key] * 1e3 for r in sel], marker="o", label=name)
        ax.set_xticks(list(x), [r["label"] for r in sel], rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("simulated EWTT (ms)")
        ax.set_yscale("log")
        ax.set_title(f"{study}: simulated end-to-end weight transfer time")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / f"{study}.png", dpi=120)
        plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out/paper_scale", help="output directory")
    parser.add_argument("--skip-sweeps", action="store_true", help="Table 2 only")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        seconds, peak, pieces, num_workers = pool.map(_plan_d_alone, [0])[0]
    print(f"planning (d) Kimi-K2: {num_workers} workers, {pieces:,} pieces, planned in "
          f"{seconds:.2f} s (target <= 10 s), peak RSS {peak:.0f} MB incl. the maps "
          f"(target <= 4096 MB)", flush=True)
    rows = [measure("table2", dep) for dep in TABLE_2]
    if not args.skip_sweeps:
        rows += [measure(study, dep) for study, dep in sweeps()]
    worst = max(r["ewtt_over_ideal"] for r in rows if r["study"] == "table2")
    print(f"Table 2: worst simulated EWTT / ideal = {worst:.3f} (target <= 1.05)")
    with open(out / "paper_scale.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, out)
    print(f"wrote {out / 'paper_scale.csv'} and {len({r['study'] for r in rows})} plots")


if __name__ == "__main__":
    main()
