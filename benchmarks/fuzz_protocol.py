"""The protocol fuzz over many seeds: per-kind violation counts and the seeds that show them.

    .venv/bin/python benchmarks/fuzz_protocol.py --seeds 500            # seeds 0..499
    .venv/bin/python benchmarks/fuzz_protocol.py --seeds 20 --first 1000 --jobs 1
    .venv/bin/python benchmarks/fuzz_protocol.py --only 19 --verbose    # one seed, every detail
    .venv/bin/python benchmarks/fuzz_protocol.py --path controller --seeds 100

Each seed is a small adapter group in one process (`tests/fuzz_adapters.py`: one or two
trainers, one to three engines of one or two ranks, a three-tensor model) in the mode
``seed % 4`` (sync, SS, RS, async), running eight random operations (full and delta updates,
joins, leaves, kills, stalls, pauses; in 30% of seeds a train step that rebinds a parameter's
storage, which every send must refuse) and then full updates until one goes through. Printed:
one line per violation kind with the number of seeds showing it (per mode), the first seeds
that do and one example; then a summary line. Exit status 1 when any seed violates.

``--path controller`` fuzzes the controller's path instead (`tests/fuzz_controller.py`: a
long-lived `MeshTransfer` per mode and round control on real local Monarch meshes; joins
after a train step, membership changes from another thread, padded parameters, storage
rebinding; ``--ops`` operations per seed, each followed by a bit-exact check of every live
engine), in this process.
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The harnesses live with the tests; Monarch's children (the controller's path) find them, and
# their actor classes, through PYTHONPATH.
sys.path[:0] = [str(REPO), str(REPO / "tests")]
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)

from fuzz_adapters import KINDS  # noqa: E402
from fuzz_plan import MODES  # noqa: E402


def _one(args: tuple[int, int, float]):
    seed, num_ops, timeout_s = args
    import torch

    from fuzz_adapters import run_seed

    torch.set_num_threads(1)
    r = run_seed(seed, num_ops=num_ops, timeout_s=timeout_s)
    return (seed, r.scenario.mode, r.scenario.describe(), len(r.scenario.ops),
            [(v.kind, v.detail) for v in r.violations], r.trainer_errors, r.wall_s)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=500, help="how many seeds")
    parser.add_argument("--first", type=int, default=0, help="the first seed")
    parser.add_argument("--only", type=int, nargs="*", help="run just these seeds")
    parser.add_argument("--ops", type=int, default=8, help="operations per seed")
    parser.add_argument("--timeout-s", type=float, default=1.0, help="the groups' timeout_s")
    parser.add_argument("--jobs", type=int, default=2, help="processes running seeds")
    parser.add_argument("--verbose", action="store_true", help="every seed's violations")
    parser.add_argument("--path", choices=("adapters", "controller"), default="adapters",
                        help="the adapters in one process, or MeshTransfer on local meshes")
    args = parser.parse_args()
    if args.seeds < 1 or args.jobs < 1 or args.ops < 0 or args.timeout_s <= 0:
        parser.error("--seeds, --jobs >= 1, --ops >= 0, --timeout-s > 0")
    seeds = args.only if args.only else range(args.first, args.first + args.seeds)
    if args.path == "controller":
        return _controller(seeds, args)
    work = [(s, args.ops, args.timeout_s) for s in seeds]
    t0 = time.monotonic()
    results = []
    if args.jobs == 1:
        results = [_one(w) for w in work]
    else:
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(args.jobs, maxtasksperchild=25) as pool:
            for res in pool.imap_unordered(_one, work):
                results.append(res)
                if args.verbose or res[4]:
                    _show(res, args.verbose)
    wall = time.monotonic() - t0
    if args.jobs == 1:
        for res in results:
            if args.verbose or res[4]:
                _show(res, args.verbose)
    results.sort()
    by_kind: dict[str, dict[str, set]] = {k: collections.defaultdict(set) for k in KINDS}
    example: dict[str, str] = {}
    for seed, mode, _, _, violations, _, _ in results:
        for kind, detail in violations:
            by_kind[kind][mode].add(seed)
            example.setdefault(kind, f"seed {seed}: {detail}")
    per_mode = collections.Counter(mode for _, mode, *_ in results)
    for kind in KINDS:
        seeds_of = sorted(set().union(*by_kind[kind].values()))
        modes = " ".join(f"{m} {len(by_kind[kind][m])}" for m in MODES)
        line = f"{kind:<12} {len(seeds_of):4d} seeds ({modes})"
        if seeds_of:
            line += f"  seeds {seeds_of[:8]}{' ...' if len(seeds_of) > 8 else ''}\n" \
                    f"{'':17}e.g. {example[kind][:220]}"
        print(line)
    bad = sorted(r[0] for r in results if r[4])
    ops = sum(r[3] for r in results)
    slowest = max(results, key=lambda r: r[6])
    print(f"fuzz_protocol: {len(results)} seeds ("
          + ", ".join(f"{m} {per_mode[m]}" for m in MODES)
          + f"), {ops} operations, timeout_s={args.timeout_s:g}: "
          + (f"{len(bad)} seeds with violations, {len(results) - len(bad)} clean"
             if bad else "0 violations")
          + f"; {wall:.0f}s wall ({args.jobs} jobs; slowest seed {slowest[0]}: "
            f"{slowest[6]:.1f}s)")
    return 1 if bad else 0


def _controller(seeds, args) -> int:
    """The controller's path: `fuzz_controller.run_seeds`, in this process."""
    import fuzz_controller as fuzz

    t0 = time.monotonic()
    results = fuzz.run_seeds(seeds, num_ops=args.ops, timeout_s=args.timeout_s)
    wall = time.monotonic() - t0
    by_kind = {k: collections.defaultdict(set) for k in fuzz.KINDS}
    example: dict[str, str] = {}
    for r in results:
        if args.verbose or r.violations:
            print(f"seed {r.seed} ({r.mode}, {r.round_control}) {list(r.ops)} [{r.wall_s:.1f}s]"
                  + "".join(f"\n    {v.kind}: {v.detail[:300]}" for v in r.violations))
        for v in r.violations:
            by_kind[v.kind][r.mode].add(r.seed)
            example.setdefault(v.kind, f"seed {r.seed}: {v.detail}")
    for kind in fuzz.KINDS:
        seeds_of = sorted(set().union(*by_kind[kind].values()))
        modes = " ".join(f"{m} {len(by_kind[kind][m])}" for m in fuzz.MODES)
        print(f"{kind:<12} {len(seeds_of):4d} seeds ({modes})"
              + (f"  seeds {seeds_of[:8]}\n{'':17}e.g. {example[kind][:220]}" if seeds_of
                 else ""))
    per_mode = collections.Counter(r.mode for r in results)
    ops = collections.Counter(op for r in results for op in r.ops)
    refusals = sum(len(r.refusals) for r in results)
    bad = [r.seed for r in results if r.violations]
    controls = collections.Counter(r.round_control for r in results)
    print(f"fuzz_protocol (controller): {len(results)} seeds ("
          + ", ".join(f"{m} {per_mode[m]}" for m in fuzz.MODES) + "; "
          + ", ".join(f"{c} {controls[c]}" for c in sorted(controls))
          + f"), {sum(ops.values())} operations ("
          + ", ".join(f"{op} {n}" for op, n in sorted(ops.items()))
          + f"), {refusals} documented refusals, timeout_s={args.timeout_s:g}: "
          + (f"{len(bad)} seeds with violations, {len(results) - len(bad)} clean" if bad
             else "0 violations")
          + f"; {wall:.0f}s wall")
    return 1 if bad else 0


def _show(res, verbose: bool) -> None:
    seed, _, described, _, violations, trainer_errors, wall = res
    print(f"{described} [{wall:.1f}s]")
    for kind, detail in violations:
        print(f"    {kind}: {detail[:300]}")
    if verbose:
        for e in trainer_errors:
            print(f"    (trainer) {e[:300]}")
    sys.stdout.flush()


if __name__ == "__main__":
    raise SystemExit(main())
