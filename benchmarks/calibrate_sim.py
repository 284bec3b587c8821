"""Calibrate the simulator on the emulated cluster, then check its predictions at every point.

    flock /tmp/wb-cluster.lock .venv/bin/python benchmarks/calibrate_sim.py   # needs root
    .venv/bin/python benchmarks/calibrate_sim.py --from out/calibrate_sim/runs_procs1.pkl  # re-fit
    .venv/bin/python benchmarks/calibrate_sim.py --from RUN2.pkl --fit-from RUN1.pkl

Runs WeightBridge (`MeshTransfer`) at every point of `benchmarks/bench_cluster.py` (same
configs, model, links, round size and depth), keeps every update's actor spans and the plan,
and pickles them to out/calibrate_sim/runs_procs<rollout procs>.pkl. Then:

1. fit: `weightbridge.simulation.calibrate.fit_overheads` fits the per-step fixed costs, the
   control-message latency, the per-write cost, the copy and checksum rates and the links'
   goodput from the spans of the calibration points only (``--fit``, default: replicas=1 and
   trainer nodes=4);
2. predict: `simulate(plan, cluster, overheads=...)` at every point (the other four were not
   used in the fit) and print predicted against measured EWTT in one table, with the error.

Measured EWTT is the median over the updates after the first (the first warms caches).
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_cluster import attached, configs  # noqa: E402
from benchmarks.machine import load  # noqa: E402
from weightbridge.simulation.calibrate import (Run, fit_overheads, load_runs,  # noqa: E402
                                             point_cluster)
from weightbridge.simulation.simulate import simulate  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "out" / "calibrate_sim"


def collect(args) -> list[Run]:
    """Every bench_cluster point, WeightBridge only: plan, link rate and every update's spans."""
    from controller.cluster import (TRANSPORT_ENV, EmulatedCluster, link_burst_bytes,
                                    unavailable_reason)

    reason = unavailable_reason()
    if reason:
        raise SystemExit(f"cannot emulate a cluster here: {reason}; re-fit a saved run with "
                         f"--from out/calibrate_sim/runs.pkl")
    rate = args.link_mbit * 1e6 / 8
    runs = []
    with EmulatedCluster(8, link_mbit=args.link_mbit, insecure=True) as cluster:
        os.environ[TRANSPORT_ENV] = cluster.controller_transport  # before monarch starts
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        # Monarch reads the transport when first imported: only now.
        from controller.driver import MeshTransfer
        from weightbridge.specs import RolloutSpec, TrainerSpec
        from weightbridge import TransferConfig

        config = TransferConfig(round_bytes=args.round_kib << 10, depth=args.depth)
        for sweep, x, tspec_text, rspec_text in configs(args.rollout_procs):
            tspec, rspec = TrainerSpec.parse(tspec_text), RolloutSpec.parse(rspec_text)
            with attached(cluster.addresses, tspec, rspec) as procs:
                with MeshTransfer(tspec, rspec, args.model, procs=procs, config=config,
                                  link_rate=rate) as mt:
                    plan = mt.connect()
                    reports = [mt.update(v) for v in range(1, args.updates + 1)]
            bad = [r for r in reports if r.mismatched]
            if bad:
                raise SystemExit(f"[{sweep}={x}] {bad[0].line()}")
            runs.append(Run(label=f"{sweep}={x}", plan=plan, link_rate=rate, depth=args.depth,
                            spans=tuple(dict(r.timing.spans) for r in reports),
                            ewtt_s=tuple(r.timing.ewtt_s for r in reports),
                            load=load(), link_burst=link_burst_bytes(rate),
                            cpus=os.cpu_count()))
            print(f"[{sweep}={x}] measured EWTT "
                  + " ".join(f"{r.timing.ewtt_s:.3f}s" for r in reports)
                  + f"  ({runs[-1].load})", flush=True)
    return runs



def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="source", help="re-fit a pickled run instead of running")
    parser.add_argument("--fit", nargs="+", default=["replicas=1", "trainer nodes=4"],
                        help="labels of the points the parameters are fitted on")
    parser.add_argument("--fit-from", help="fit on the points of this pickled run instead "
                        "(then no point predicted was measured in the fit)")
    parser.add_argument("--link-mbit", type=float, default=50)
    parser.add_argument("--round-kib", type=int, default=512)
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--model", default="medium")
    parser.add_argument("--rollout-procs", type=int, default=1)
    parser.add_argument("--depth", type=int, default=3)
    args = parser.parse_args()
    if args.source:
        runs = load_runs(args.source)
    else:
        t0 = time.perf_counter()
        runs = collect(args)
        OUT.mkdir(parents=True, exist_ok=True)
        name = f"runs_procs{args.rollout_procs}.pkl"
        (OUT / name).write_bytes(pickle.dumps(runs))
        print(f"collected {len(runs)} points in {time.perf_counter() - t0:.0f}s -> {OUT / name}")
    pool = load_runs(args.fit_from) if args.fit_from else runs
    fitted = [r for r in pool if r.label in args.fit]
    if not fitted:
        raise SystemExit(f"--fit {args.fit} names none of the points "
                         f"{[r.label for r in pool]}")
    overheads = fit_overheads(fitted)
    print(f"fitted on {[r.label for r in fitted]}"
          f"{' of ' + args.fit_from if args.fit_from else ''}: {overheads}")
    print(f"{'point':<18} {'fit':>4} {'measured':>9} {'predicted':>9} {'error':>7} "
          f"{'ideal':>7} {'no-overhead model':>17}  load")
    worst = 0.0
    for run in runs:
        cluster = point_cluster(run)
        measured = run.measured_s
        est = simulate(run.plan, cluster, overheads=overheads, depth=run.depth)
        bare = simulate(run.plan, cluster)
        err = est.ewtt / measured - 1
        worst = max(worst, abs(err))
        print(f"{run.label:<18} {'yes' if run in fitted else 'no':>4} {measured:8.3f}s "
              f"{est.ewtt:8.3f}s {100 * err:+6.1f}% {est.ideal:6.3f}s {bare.ewtt:16.3f}s  "
              f"{run.load}")
    print(f"worst |predicted / measured - 1| = {100 * worst:.1f}% (target <= 10%)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
