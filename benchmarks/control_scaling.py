"""How a round step's control cost grows with the workers it waits for, on the emulated cluster.

    flock /tmp/wb-cluster.lock .venv/bin/python benchmarks/control_scaling.py   # needs root

A round step is one call to every worker taking part and a wait for all their answers
(`MeshControl.call_async`: one message to a run of consecutive ranks, answered by
`TransferAgent.serve` from a thread through its response port). This times the same kind of
call with nothing to do: one mesh-wide call to `benchmarks.echo_actor.Echo`, which answers
like `TransferAgent` (a sync actor, explicit response port, the answer sent from a pool
thread), waited for synchronously from the controller (not through asyncio), on n procs of
the emulated cluster (one per host, or two), ``--calls`` calls one after another, median.

It fits ``t(n) = a + b n`` on the calibration layouts (`FIT`: 2, 4 and 8 procs, one per host)
and predicts the held-out ones (4, 8, 12 and 16 procs, two per host), printing measured,
predicted and error. ``b`` is `Overheads.fanout_s` (weightbridge/simulation/timeline.py): what
each further worker a step waits for adds to that step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.machine import load  # noqa: E402

LAYOUTS = ((2, 1), (4, 1), (8, 1), (2, 2), (4, 2), (6, 2), (8, 2))
"""(hosts, procs per host) measured."""
FIT = ((2, 1), (4, 1), (8, 1))
"""The layouts the law is fitted on; the rest are held out."""


def measure(addresses, per_host: int, calls: int) -> list[float]:
    """Seconds of each of ``calls`` calls to every proc on ``addresses`` (``per_host`` each)."""
    from controller.launch import attach_procs
    from benchmarks.echo_actor import Echo
    from controller.security import Security

    owner, procs = attach_procs(addresses, gpus=per_host, name="echo", security=Security(None))
    try:
        echo = procs.spawn("echo", Echo)
        echo.serve.call(0).get(timeout=60)  # warm
        out = []
        for r in range(calls):
            t0 = time.perf_counter()
            echo.serve.call(r).get(timeout=60)
            out.append(time.perf_counter() - t0)
        return out
    finally:
        owner.stop().get(timeout=60)



def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=60)
    parser.add_argument("--link-mbit", type=float, default=200)
    args = parser.parse_args()
    from controller.cluster import TRANSPORT_ENV, EmulatedCluster, unavailable_reason

    reason = unavailable_reason()
    if reason:
        print(f"skipped: cannot emulate a cluster here: {reason}")
        return 0
    measured = {}
    with EmulatedCluster(8, link_mbit=args.link_mbit, insecure=True) as cluster:
        os.environ[TRANSPORT_ENV] = cluster.controller_transport
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        print(f"{args.calls} calls per layout, {args.link_mbit:g} Mbit/s links ({load()})",
              flush=True)
        for hosts, per in LAYOUTS:
            ts = measure(cluster.addresses[:hosts], per, args.calls)
            measured[(hosts, per)] = statistics.median(ts)
            print(f"  {hosts} hosts x {per} = {hosts * per:2d} procs: median "
                  f"{1e3 * measured[(hosts, per)]:6.2f} ms, p90 "
                  f"{1e3 * float(np.percentile(ts, 90)):6.2f} ms  ({load()})", flush=True)
    n = np.array([h * p for h, p in FIT], dtype=float)
    b, a = np.polyfit(n, [measured[k] for k in FIT], 1)
    print(f"fit on {[f'{h}x{p}' for h, p in FIT]}: t(n) = {1e3 * a:.2f} ms + {1e3 * b:.3f} ms "
          f"x n  (fanout_s = {b:.6f})")
    print(f"{'layout':<10} {'procs':>5} {'held':>4} {'measured':>9} {'predicted':>9} "
          f"{'error':>7} {'const err':>9}")
    const = statistics.mean(measured[k] for k in FIT)
    for (hosts, per), m in measured.items():
        k = hosts * per
        pred = a + b * k
        print(f"{hosts}x{per:<8} {k:5d} {'no' if (hosts, per) in FIT else 'yes':>4} "
              f"{1e3 * m:7.2f}ms {1e3 * pred:7.2f}ms {100 * (pred / m - 1):+6.1f}% "
              f"{100 * (const / m - 1):+8.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
