"""An engine joining a running group: extending the plan against planning the group again.

    .venv/bin/python benchmarks/bench_elastic.py                    # Table 2 (b), (c); planning
    .venv/bin/python benchmarks/bench_elastic.py --deployments d --repeats 1
    .venv/bin/python benchmarks/bench_elastic.py --mesh             # plus a join on real meshes

Planning, per Table 2 deployment (one engine more than the paper's), best of ``--repeats``,
interleaved in one run: the full plan of every engine (`plan_transfer`, what a join costs
without `extend_plan`) and its worker plans (every worker set up again), against the join:
`extend_plan` of the plan in force with the new engine (a replica: mirrored) and the worker
plans of only the workers it sets up (the forwarders it rewires and the new engine; the others
keep theirs). Also the simulated EWTT on the paper's
H100 cluster (no-overhead model) of the extended plan against the full plan: what the
extension costs each later update until `replan()`.

``--mesh``: `controller.MeshTransfer` on this host (tiny model, trainer TP2 -> 2 TP1 engines):
an update, a join (`add_engine`: its report), an update over the extended plan, `replan()`,
an update over the full plan; each transfer time and the ratios.
"""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from weightbridge import plan_transfer  # noqa: E402
from weightbridge.planning.extend import extend_plan, rewired  # noqa: E402
from weightbridge.simulation.simulate import simulate  # noqa: E402
from weightbridge.shapes import TABLE_2, workers  # noqa: E402
from weightbridge.shapes.deployments import PAPER_CLUSTER  # noqa: E402


def _best(fn, repeats: int):
    best, out = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def planning(name: str, repeats: int) -> str:
    dep = next(d for d in TABLE_2 if d.name == name)
    grown = dataclasses.replace(dep, engines=dep.engines + 1)
    trainers, rollouts = workers(grown)
    per_engine = grown.engine_tp
    before, joining = rollouts[:-per_engine], rollouts[-per_engine:]
    in_force = plan_transfer(trainers, before, round_bytes=dep.round_bytes)
    full_s, full = _best(lambda: plan_transfer(trainers, rollouts, round_bytes=dep.round_bytes),
                         repeats)
    full_wp_s, _ = _best(full.worker_plans, repeats)
    ext_s, ext = _best(lambda: extend_plan(in_force, joining), repeats)
    changed, joined = rewired(in_force, ext)
    setup = changed + joined
    ext_wp_s, _ = _best(lambda: ext.worker_plans(setup), repeats)
    sim_full, sim_ext = simulate(full, PAPER_CLUSTER), simulate(ext, PAPER_CLUSTER)
    join, replan = ext_s + ext_wp_s, full_s + full_wp_s
    return (f"({dep.name}) {dep.model.name}: {dep.engines} -> {grown.engines} engines, "
            f"{len(trainers)} trainers\n"
            f"  full re-plan  plan {full_s:6.2f} s + every worker's plan ({len(full.workers)}) "
            f"{full_wp_s:6.2f} s = {replan:6.2f} s\n"
            f"  join          extend {ext_s:6.2f} s + plans of the {len(setup)} workers set up "
            f"({len(changed)} rewired forwarders, {len(joined)} joining) {ext_wp_s:6.2f} s = "
            f"{join:6.2f} s   = {join / replan:.3f}x the full re-plan\n"
            f"  simulated EWTT (H100 cluster, no overheads): extended plan "
            f"{sim_ext.ewtt:.3f} s vs full plan {sim_full.ewtt:.3f} s = "
            f"{sim_ext.ewtt / sim_full.ewtt:.2f}x ({ext.num_rounds} vs {full.num_rounds} rounds)")


def mesh() -> str:
    from controller.driver import MeshTransfer
    from weightbridge.specs import RolloutSpec, TrainerSpec
    from weightbridge import TransferConfig

    lines = []
    with MeshTransfer(TrainerSpec.parse("nodes=1,gpus=2,tp=2"),
                      RolloutSpec.parse("engines=2,nodes=1,gpus=1"), "tiny",
                      config=TransferConfig(round_bytes=64 << 10)) as mt:
        t0 = time.perf_counter()
        mt.connect()
        connect_s = time.perf_counter() - t0
        first = mt.update(1)
        joined = mt.add_engine()
        extended = mt.update(2)
        t0 = time.perf_counter()
        mt.replan()
        replan_s = time.perf_counter() - t0
        folded = mt.update(3)
    for report in (first, extended, folded):
        if report.mismatched:
            raise SystemExit(f"not bit-exact: {report.line()}")
    lines.append(f"mesh (tiny, trainer TP2 -> TP1 engines, this host): connect (probe + plan "
                 f"all) {connect_s:.3f}s; {joined.line()}")
    lines.append(f"  join probe+plan+setup {joined.plan_s:.3f}s = "
                 f"{joined.plan_s / connect_s:.2f}x connect; replan() {replan_s:.3f}s")
    for label, r in (("2 engines", first), ("3, extended plan", extended),
                     ("3, after replan()", folded)):
        lines.append(f"  update over {label:<18} transfer {r.transfer_s:.3f}s  "
                     f"{r.rdma_bytes / 1e6:.2f} MB  (bit-exact, {r.num_params} params)")
    lines.append(f"  extended / replanned transfer time: "
                 f"{extended.transfer_s / folded.transfer_s:.2f}x")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deployments", default="bc")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--mesh", action="store_true")
    args = parser.parse_args()
    for name in args.deployments:
        print(planning(name, args.repeats), flush=True)
    if args.mesh:
        print(mesh(), flush=True)
    print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
