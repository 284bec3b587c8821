"""Per-worker plans against the global plan: building every worker's plan vs planning.

    .venv/bin/python benchmarks/bench_worker_plans.py              # Kimi-K2, Table 2 (d)
    .venv/bin/python benchmarks/bench_worker_plans.py --deployment b --repeats 3

Measures, in one run and interleaved (the machine is shared: each figure is the best of
``--repeats``): `plan_transfer` of a Table 2 deployment; `TransferPlan.worker_plans()`
(every worker's `WorkerPlan`, built together); and `for_worker` called one worker at a time
on ``--sample`` workers spread over both sides, scaled to all workers (the path that was
used before). Prints the seconds and the ratios to the plan's time, with ``uptime``; and the
ratio of this process's CPU seconds (best of the same repeats), which other jobs on a shared
machine disturb less than wall-clock time.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from weightbridge import plan_transfer  # noqa: E402
from weightbridge.shapes import TABLE_2, workers  # noqa: E402


def _timed(fn):
    start, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - start, time.process_time() - cpu, out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deployment", default="d", choices=[d.name for d in TABLE_2])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--sample", type=int, default=8,
                        help="workers timed one at a time through for_worker")
    args = parser.parse_args()
    dep = next(d for d in TABLE_2 if d.name == args.deployment)
    trainers, rollouts = workers(dep)
    plan_s, all_s, one_s, plan_cpu, all_cpu = [], [], [], [], []
    for _ in range(args.repeats):
        seconds, cpu, plan = _timed(lambda: plan_transfer(trainers, rollouts,
                                                          round_bytes=dep.round_bytes))
        plan_s.append(seconds)
        plan_cpu.append(cpu)
        seconds, cpu, plans = _timed(plan.worker_plans)
        all_s.append(seconds)
        all_cpu.append(cpu)
        del plans
        step = max(1, len(plan.workers) // args.sample)
        some = plan.workers[::step][:args.sample]
        seconds, _, _ = _timed(lambda: [plan.for_worker(w) for w in some])
        one_s.append(seconds / len(some) * len(plan.workers))
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    n = len(plan.workers)
    p, a, o = min(plan_s), min(all_s), min(one_s)
    print(f"({dep.name}) {dep.model.name}: {n} workers, {len(plan.tables.seg):,} writes; best "
          f"of {args.repeats}: plan {p:.2f} s; all {n} worker plans together {a:.2f} s "
          f"({a / p:.2f}x the plan; CPU {min(all_cpu) / min(plan_cpu):.2f}x); for_worker one at "
          f"a time {o:.1f} s for all "
          f"(from {len(some)} workers; {o / p:.1f}x the plan)  [{load}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
