"""A/B of WeightBridge variants on the emulated cluster: median EWTT / ideal over many updates.

    .venv/bin/python benchmarks/cluster_ab.py                       # the six points, 2 variants
    .venv/bin/python benchmarks/cluster_ab.py --points "replicas=4" --model tiny \
        --variants 2:512 3:512 3:256 --reps 3

A variant is ``depth:round_kib`` (`weightbridge.TransferConfig`'s ``depth`` and
``round_bytes``). Per point the controller attaches to the hosts
once, then runs every variant ``--reps`` times, interleaved (A B C A B C ...: a slow spell of
this shared machine hits every variant alike), ``--updates`` updates each; the first update of
each run is a warm-up. Prints one line per run and the median, min and max EWTT / ideal per
variant and point. `benchmarks/bench_cluster.py` is the side-by-side with the baselines; this
is for choosing between WeightBridge's own knobs, where single runs differ by 10-25% here.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_cluster import attached, configs  # noqa: E402
from controller.cluster import TRANSPORT_ENV, EmulatedCluster, unavailable_reason  # noqa: E402

DEFAULT_VARIANTS = ("2:512", "3:512")


def parse_variant(text: str):
    """``depth:round_kib`` -> its `TransferConfig`.

    Raises:
        ValueError: not two numbers, or numbers `TransferConfig` refuses.
    """
    from weightbridge import TransferConfig

    parts = text.split(":")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise ValueError(f"variant {text!r} is not depth:round_kib, e.g. 3:512 or 2:256")
    return TransferConfig(depth=int(parts[0]), round_bytes=int(parts[1]) << 10)


def run_point(addrs, tspec_text: str, rspec_text: str, args) -> dict[str, list[float]]:
    """EWTT / ideal of every measured update, per variant."""
    from controller.driver import MeshTransfer
    from weightbridge.specs import RolloutSpec, TrainerSpec

    tspec, rspec = TrainerSpec.parse(tspec_text), RolloutSpec.parse(rspec_text)
    ratios: dict[str, list[float]] = {v: [] for v in args.variants}
    with attached(addrs, tspec, rspec) as procs:
        for rep in range(args.reps):
            for variant in args.variants:
                with MeshTransfer(tspec, rspec, args.model, procs=procs,
                                  config=parse_variant(variant),
                                  link_rate=args.link_mbit * 1e6 / 8) as mt:
                    plan = mt.connect()
                    got = []
                    for version in range(1, args.updates + 1):
                        report = mt.update(version)
                        if report.mismatched:
                            raise SystemExit(f"{variant}: {report.line()}")
                        if version > 1:
                            got.append(report.timing.ewtt_s / mt.ideal_s)
                ratios[variant] += got
                print(f"  run {rep} {variant:<18} {plan.num_rounds:3d} rounds  EWTT/ideal "
                      + " ".join(f"{x:.2f}" for x in got), flush=True)
    return ratios


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS),
                        help="depth:round_kib")
    parser.add_argument("--points", nargs="+", default=None,
                        help='e.g. "replicas=4" "trainer nodes=1" (default: all six)')
    parser.add_argument("--model", default="medium")
    parser.add_argument("--link-mbit", type=float, default=50)
    parser.add_argument("--updates", type=int, default=3, help="per run; the first is a warm-up")
    parser.add_argument("--reps", type=int, default=2, help="runs per variant, interleaved")
    args = parser.parse_args()
    try:
        for v in args.variants:
            parse_variant(v)
        if args.updates < 2 or args.reps < 1:
            raise ValueError("--updates must be >= 2 (the first is a warm-up), --reps >= 1")
    except ValueError as e:
        parser.error(str(e))
    points = [c for c in configs(1) if args.points is None or f"{c[0]}={c[1]}" in args.points]
    if not points:
        parser.error(f"no point matches {args.points}; use e.g. replicas=4 or 'trainer nodes=1'")
    reason = unavailable_reason()
    if reason:
        print(f"skipped: cannot emulate a cluster here: {reason}")
        return 0
    t0 = time.perf_counter()
    summary = []
    with EmulatedCluster(8, link_mbit=args.link_mbit, insecure=True) as cluster:
        os.environ[TRANSPORT_ENV] = cluster.controller_transport  # before monarch starts
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        print(f"emulated cluster: 8 hosts, {args.link_mbit:g} Mbit/s links; model {args.model}, "
              f"{args.reps} interleaved runs of {args.updates} updates per variant", flush=True)
        for sweep, x, tspec, rspec in points:
            print(f"[{sweep}={x}] trainer {tspec} -> rollout {rspec}", flush=True)
            ratios = run_point(cluster.addresses, tspec, rspec, args)
            for v, xs in ratios.items():
                summary.append(f"[{sweep}={x}] {v:<18} EWTT/ideal median "
                               f"{statistics.median(xs):.2f}  min {min(xs):.2f}  "
                               f"max {max(xs):.2f}  ({len(xs)} updates)")
    print("\n".join(summary))
    print(f"done in {time.perf_counter() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
