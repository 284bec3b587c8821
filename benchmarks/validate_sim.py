"""Validate the calibrated simulator on held-out points of a separate run, over a wide range.

    flock /tmp/wb-cluster.lock .venv/bin/python benchmarks/validate_sim.py \
        --collect out/validate_sim/run1.pkl                    # ~22-25 min, needs root
    flock /tmp/wb-cluster.lock .venv/bin/python benchmarks/validate_sim.py \
        --collect out/validate_sim/run2.pkl
    flock /tmp/wb-cluster.lock .venv/bin/python benchmarks/validate_sim.py \
        --collect out/validate_sim/run3.pkl out/validate_sim/run4.pkl   # interleaved
    .venv/bin/python benchmarks/validate_sim.py --fit-from out/validate_sim/run1.pkl \\
        --predict out/validate_sim/run2.pkl

``--collect`` (needs root) runs WeightBridge (`MeshTransfer`) at every point of `POINTS` on one
emulated cluster of 8 hosts (controller/cluster.py), changing the links' tc rate between the rate
blocks, and pickles every point's plan, link rate, depth and every update's actor spans
(`weightbridge.simulation.calibrate.Run`). Each point runs ``--updates`` updates on each of
``--spawns`` fresh sets of procs (`MORE_SETS` times as many at the controller-bound
six-proc points): on this saturated 2-core machine one set of procs can run a controller-bound
point up to 68% slower than the next, for as long as it lives (4 Dec: runs 22-25,
docs/notes/simulator-validation-runs-15-25.md), so a
point measured on one set does not repeat. Beside ``uptime`` every point
records the cores its updates kept busy: the cluster's own, other processes' and steal
(`benchmarks.machine.CpuMeter`), which says whether anything else was running, and how fast a
core was while they ran (`benchmarks.machine.CoreProbe`, `Run.core_samples`; the progress line
prints each set's median interpreter/copy ms). The points vary link
rate (50 and 200 Mbit/s), round size (64 KiB - 1 MiB), model (tiny: 2.6 MB, medium: 18 MB), rollout
replicas (1-4), trainer nodes (1-4), procs per rollout node (1-2) and depth (2-3); measured EWTT
spans over 10x. One point (`REPEATED`) is measured a second time at the end of its block: the
machine's own drift. ``--collect RUN1 RUN2`` collects two runs at once, interleaved: each
point's sets alternate between them, so both runs see the same machine through every point
and differ only by their sets of procs; predicting one from the other then measures
the model's error without the machine's drift between two runs taken minutes apart (~32 min:
1889 s on 5 Dec).

``--fit-from RUN1 --predict RUN2`` fits `Overheads` on the calibration points (``--calibrate``,
default `CALIBRATION`) of RUN1 only, and predicts every point of RUN2, a separate run. Per
point it prints measured, predicted and error beside three baselines: ``const``, one EWTT (the
mean measured on the calibration points of RUN1) for every point; ``bare``, the model
without overheads (`simulate(plan, cluster)`); and, a stronger one, ``k x bare``: that model
scaled by one factor fitted on the calibration points. Beside them: the same point's EWTT
measured in RUN1 (run-to-run drift), and ``noise``, how far apart the point's own updates lie
in RUN2 ((slowest - fastest) / median). Held-out points are those not in ``--calibrate``.
``--fanout-s X``: the model with a control cost that grows with the workers a step waits
for (`Overheads.fanout_s`, measured apart by `benchmarks/control_scaling.py`; the rest fitted
as before). The links are modelled with the token bucket the run recorded
(`Run.link_burst`); ``--no-burst`` models them without it. Every proc shares the cores the
run recorded (`Run.cpus`, the one machine the emulated hosts run on); ``--shared-cpus N``
models N instead (0: each worker its own core, as before). The fit reads the controller's
cost per message from how far apart a step's workers start (`Overheads.stagger_s`);
``--no-stagger`` fits none. ``--cores``: the fitted CPU costs scaled by how much slower the
cores ran in the predicted run than in the fit run (`core_factor`: the median over the points
of each point's ratio, the ``cores`` column; `Overheads.on_slower_cores`), for runs that
recorded it; the summary says how the points' core speeds and EWTTs moved together.

``--hops RUN`` prints every point's median gap between steps (``--rounds LABEL R...``: those
rounds' spans); ``--stages RUN`` every point's write stages against their bytes at the link's
rate, and how far apart a step's workers start.

Measured EWTT of a point: the median over its sets of procs of every update after each set's first
(the first warms caches).
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from benchmarks.bench_cluster import attached  # noqa: E402
from benchmarks.machine import CoreProbe, CpuMeter, CpuUse, load  # noqa: E402
from weightbridge.simulation.calibrate import (Run, fit_overheads, load_runs,  # noqa: E402
                                             point_cluster)
from weightbridge.simulation.simulate import simulate  # noqa: E402


@dataclass(frozen=True)
class Point:
    """One configuration: layouts, model, link rate (Mbit/s), round size (KiB), depth, and
    how many times ``--spawns`` sets of procs it takes."""

    label: str
    trainer: str
    rollout: str
    model: str
    mbit: float
    round_kib: int
    depth: int
    spawn_factor: int = 1


MORE_SETS = 3
"""Sets-of-procs factor of the controller-bound points on six procs or more (200 Mbit/s): their
speed is set by the set of procs, so the median over 4 sets moves by about +-10% and over 12
by about +-4% (`t2 r4` and `r4 d2`, 12 sets twice, 4 Dec, runs 24-25 in
docs/notes/simulator-validation-runs-15-25.md); a set there
costs seconds."""
T2 = "nodes=1,gpus=2,tp=2"
R1 = "nodes=1,gpus=1"
R2 = "nodes=1,gpus=2,tp=2"
POINTS = (
    Point("200M tiny r1", T2, f"engines=1,{R1}", "tiny", 200, 512, 3),
    Point("200M tiny t2 r4 128K", "nodes=2,gpus=1,ep=2", f"engines=4,{R1}", "tiny", 200, 128, 3,
          MORE_SETS),
    Point("200M med r2", T2, f"engines=2,{R1}", "medium", 200, 512, 3),
    Point("200M med r4 d2 256K", T2, f"engines=4,{R1}", "medium", 200, 256, 2, MORE_SETS),
    Point("200M med t4 p2", "nodes=4,gpus=1,ep=4", f"engines=2,{R2}", "medium", 200, 512, 3,
          MORE_SETS),
    Point("200M med r1 p2 1M", T2, f"engines=1,{R2}", "medium", 200, 1024, 3),
    Point("50M med r1", T2, f"engines=1,{R1}", "medium", 50, 512, 3),
    Point("50M med r4", T2, f"engines=4,{R1}", "medium", 50, 512, 3),
    Point("50M med t4", "nodes=4,gpus=1,ep=4", f"engines=4,{R1}", "medium", 50, 512, 3),
    Point("50M med t2 d2", "nodes=2,gpus=1,ep=2", f"engines=4,{R1}", "medium", 50, 512, 2),
    Point("50M med r2 128K", T2, f"engines=2,{R1}", "medium", 50, 128, 3),
    Point("50M tiny r2 p2", T2, f"engines=2,{R2}", "tiny", 50, 256, 3),
    Point("50M tiny t1 r3 64K", "nodes=1,gpus=1", f"engines=3,{R1}", "tiny", 50, 64, 3),
)
CALIBRATION = ("200M tiny r1", "50M med r1", "50M med t4", "50M tiny t1 r3 64K",
               "200M tiny t2 r4 128K")
"""The points the overheads are fitted on (of the calibration run only). ``50M tiny t1 r3
64K``, added on 3 Dec with the links' token bucket (chosen on runs 7 and 8, before runs 11
and 12 were collected), is the only one whose writes fit the bucket: it shows the cost of a
write that the link-bound points hide. ``200M tiny t2 r4 128K``, added on 5 Dec (chosen on
runs 30-33, before runs 34-37 were collected), is six procs bound by the controller's
messages: their cost per message moves by a third from one half hour to the next on a
saturated 2-core machine while the other calibration points stay put, so without such a
point the fit sees only one state of the machine (runs 30-37:
docs/notes/simulator-validation-runs-26-37.md)."""
REPEATED = "50M med r1"
"""Measured again at the end of its rate block, labelled ``+ " again"``: in-run drift."""
REPEATS = 0.15
"""Run-to-run drift up to which a point counts as one the machine repeated: past it, the two
runs disagree with each other by more than the worst-error target allows the model."""
OUT = Path(__file__).resolve().parents[1] / "out" / "validate_sim"


def set_rate(cluster, mbit: float) -> None:
    """Re-shape every host link of a running `EmulatedCluster` to ``mbit`` each direction
    (tbf rate and, with control priority, the bulk band's byte FIFO sized for the new rate)."""
    from controller.cluster import NS_PREFIX, QUEUE_S, VETH_PREFIX, netns_run

    cluster.link_mbit = float(mbit)
    for i in range(cluster.hosts):
        for dev, ns in ((f"{VETH_PREFIX}{i}", None), ("eth0", f"{NS_PREFIX}{i}")):
            netns_run("tc", "qdisc", "change", "dev", dev, "root", "handle", "1:",
                      *cluster._tbf(), ns=ns)
            if cluster.control_priority:
                netns_run("tc", "qdisc", "replace", "dev", dev, "parent", "10:2", "bfifo",
                          "limit", str(int(cluster.link_bytes_per_s * QUEUE_S)), ns=ns)


def collect(points, updates: int, spawns: int, runs: int = 1) -> list[list[Run]]:
    """``runs`` runs of every point (and `REPEATED` again), WeightBridge only: plan, rate and
    spans of ``updates`` updates on each of ``spawns`` fresh sets of procs per run.

    With ``runs`` > 1 a point's sets alternate between the runs (set k goes to run
    k % ``runs``), so the runs see the same machine through every point: what still differs
    between them is their sets of procs, not the machine's drift from one run to the next."""
    from controller.cluster import TRANSPORT_ENV, EmulatedCluster, unavailable_reason

    reason = unavailable_reason()
    if reason:
        raise SystemExit(f"cannot emulate a cluster here: {reason}")
    order = list(points)
    rep = [i for i, p in enumerate(order) if p.label == REPEATED]
    if rep:  # again at the end of its rate block
        p = order[rep[0]]
        last = max(i for i, q in enumerate(order) if q.mbit == p.mbit)
        order.insert(last + 1, replace(p, label=p.label + " again"))
    collected = [[] for _ in range(runs)]
    with EmulatedCluster(8, link_mbit=order[0].mbit, insecure=True) as cluster, \
            CoreProbe() as probe:
        os.environ[TRANSPORT_ENV] = cluster.controller_transport  # before monarch starts
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        for p in order:
            if p.mbit != cluster.link_mbit:
                set_rate(cluster, p.mbit)
            sets = spawns * p.spawn_factor
            plan = None
            reports, use, core = ([[] for _ in range(runs)] for _ in range(3))
            for k in range(sets * runs):
                spawn_plan, spawn_reports, spawn_use, window = _spawn(cluster, p, updates)
                if plan is not None and not _same_plan(plan, spawn_plan):
                    raise SystemExit(f"[{p.label}] a fresh set of procs planned differently; "
                                     f"planning must be deterministic")
                if plan is None:
                    plan = spawn_plan
                j = k % runs
                reports[j] += spawn_reports
                use[j].append(spawn_use)
                core[j] += [(k // runs, s.interp_ms, s.copy_ms) for s in probe.samples(*window)]
            for j in range(runs):
                collected[j].append(_point_run(p, plan, reports[j], use[j], core[j], sets,
                                               f" (run {j + 1} of {runs})" if runs > 1 else ""))
    return collected


def _point_run(p: Point, plan, reports, use, core, sets: int, which: str) -> Run:
    """Point ``p``'s `Run` from its ``sets`` sets' reports, `CpuUse` and probe samples,
    after checking every update's bits; prints its progress line."""
    from controller.cluster import link_burst_bytes

    bad = [r for r in reports if r.mismatched]
    if bad:
        raise SystemExit(f"[{p.label}] {bad[0].line()}")
    cores = CpuUse(*(statistics.mean(getattr(u, f) for u in use)
                     for f in ("ours", "others", "steal")))
    rate = p.mbit * 1e6 / 8
    run = Run(label=p.label, plan=plan, link_rate=rate, depth=p.depth,
              link_burst=link_burst_bytes(rate), cpus=os.cpu_count(),
              spans=tuple(dict(r.timing.spans) for r in reports),
              ewtt_s=tuple(r.timing.ewtt_s for r in reports),
              load=f"{load()}; {cores}", spawns=sets, core_samples=tuple(core))
    per_set = len(reports) // sets
    print(f"[{p.label}]{which} {plan.num_rounds} rounds, EWTT "
          + " | ".join(" ".join(f"{r.timing.ewtt_s:.3f}s" for r in
                                reports[k * per_set:(k + 1) * per_set])
                       + f" (core {_core(core, k)})" for k in range(sets))
          + f"; measured {run.measured_s:.3f}s  ({run.load})", flush=True)
    return run


def _spawn(cluster, p: Point, updates: int):
    """(plan, reports, `CpuUse` over the updates, their (start, end) ``time.monotonic()``) of
    ``updates`` updates of point ``p`` on a fresh set of procs, stopped after."""
    from controller.driver import MeshTransfer
    from weightbridge.specs import RolloutSpec, TrainerSpec
    from weightbridge import TransferConfig

    tspec, rspec = TrainerSpec.parse(p.trainer), RolloutSpec.parse(p.rollout)
    config = TransferConfig(round_bytes=p.round_kib << 10, depth=p.depth)
    with attached(cluster.addresses, tspec, rspec) as procs:
        with MeshTransfer(tspec, rspec, p.model, procs=procs, config=config,
                          link_rate=p.mbit * 1e6 / 8) as mt:
            plan = mt.connect()
            meter, start = CpuMeter(), time.monotonic()
            reports = [mt.update(v) for v in range(1, updates + 1)]
            # read while the procs still run
            return plan, reports, meter.read(), (start, time.monotonic())


def _core(samples, k: int) -> str:
    """Set ``k``'s median `CoreProbe` times: ``"0.66/0.45 ms"`` (interpreter/copy)."""
    mine = [s for s in samples if s[0] == k]
    if not mine:
        return "-"
    return "/".join(f"{statistics.median(s[i] for s in mine):.2f}" for i in (1, 2)) + " ms"


def _same_plan(a, b) -> bool:
    """Whether plans ``a`` and ``b`` move the same bytes between the same workers in the
    same rounds and stages."""
    ta, tb = a.tables, b.tables
    return all(np.array_equal(getattr(ta, f), getattr(tb, f))
               for f in ("src", "dst", "stage", "round", "nbytes"))


def validate(fit_runs: list[Run], runs: list[Run], calibrate, reference: list[Run], *,
             fanout_s: float = 0.0, stagger: bool = True, cores: bool = False) -> dict:
    """Fit on ``calibrate`` of ``fit_runs`` (``fanout_s`` given; ``stagger``: fit the
    stagger), predict ``runs`` (``cores``: the CPU costs scaled by how much slower the cores
    ran than in ``reference``, `core_factor`); print the table; the summary."""
    labels = [r.label for r in fit_runs]
    unknown = [c for c in calibrate if c not in labels]
    if unknown:
        raise SystemExit(f"--calibrate names {unknown}, not points of the fit run; its points "
                         f"are {labels} (quote each label whole)")
    fitted = [r for r in fit_runs if r.label in calibrate]
    overheads = fit_overheads(fitted, fanout_s=fanout_s, stagger=stagger)
    const = statistics.mean(r.measured_s for r in fitted)
    scale = statistics.mean(r.measured_s / simulate(r.plan, point_cluster(r)).ewtt
                            for r in fitted)
    print(f"fitted on {[r.label for r in fitted]}: {overheads}")
    print(f"const = {const:.3f}s (mean measured EWTT of the calibration points); k x bare: "
          f"k = {scale:.3f} (their mean measured / no-overhead EWTT)")
    before = {r.label: r for r in reference}
    predicting = overheads
    if cores:
        factor = core_factor(runs, reference)
        if factor is None:
            raise SystemExit("--cores: these runs did not record how fast the cores were "
                             "(Run.core_samples, collected since 4 Dec); collect them again "
                             "or leave --cores out")
        predicting = overheads.on_slower_cores(factor)
        print(f"cores x{factor:.3f} as slow as in the fit run (the median of the points' "
              f"ratios, column cores): CPU costs scaled to {predicting}")
    print(f"{'point':<22} {'held':>4} {'rounds':>6} {'measured':>8} {'predicted':>9} {'error':>7}"
          f" {'const err':>9} {'bare':>7} {'bare err':>8} {'k*bare err':>10} {'other run':>9}"
          f" {'drift':>6} {'noise':>6} {'cores':>6}  load")
    held, wins, kwins, drifts, repeated, tracked = [], 0, 0, [], [], []
    for run in runs:
        cluster = point_cluster(run)
        m = run.measured_s
        ratio = core_ratio(run, before.get(run.label))
        est = simulate(run.plan, cluster, overheads=predicting, depth=run.depth).ewtt
        bare = simulate(run.plan, cluster).ewtt
        err, cerr, berr = est / m - 1, const / m - 1, bare / m - 1
        kerr = scale * bare / m - 1
        is_held = run.label not in calibrate and not run.label.endswith(" again")
        if is_held:
            held.append(abs(err))
            wins += abs(err) < abs(cerr)
            kwins += abs(err) < abs(kerr)
        other = before[run.label].measured_s if run.label in before else None
        drift = "" if other is None else f"{100 * (m / other - 1):+5.1f}%"
        if other is not None:
            drifts.append(abs(m / other - 1))
            if ratio is not None:
                tracked.append((ratio, m / other))
            if is_held and abs(m / other - 1) <= REPEATS:
                repeated.append(abs(err))
        print(f"{run.label:<22} {'yes' if is_held else 'no':>4} {run.plan.num_rounds:6d} "
              f"{m:7.3f}s {est:8.3f}s {100 * err:+6.1f}% {100 * cerr:+8.1f}% {bare:6.3f}s "
              f"{100 * berr:+7.1f}% {100 * kerr:+9.1f}% "
              f"{'' if other is None else f'{other:8.3f}s':>9} {drift:>6} "
              f"{100 * _noise(run):5.1f}% {'' if ratio is None else f'x{ratio:.3f}':>6}  "
              f"{run.load}")
    by = {r.label: r.measured_s for r in runs}
    again = by.get(REPEATED + " again")
    measured = [r.measured_s for r in runs]
    summary = {"held": len(held), "worst": max(held, default=0.0),
               "median": statistics.median(held) if held else 0.0, "wins": wins, "kwins": kwins,
               "span": max(measured) / min(measured)}
    print(f"measured EWTT spans {min(measured):.3f}-{max(measured):.3f}s "
          f"({summary['span']:.1f}x)")
    print(f"held-out points: {len(held)}; worst |error| {100 * summary['worst']:.1f}% "
          f"(target <= 15%), median {100 * summary['median']:.1f}% (target <= 7%); "
          f"better than const at {wins}/{len(held)}, than k x bare at {kwins}/{len(held)}")
    if again is not None and REPEATED in by:
        print(f"in-run drift: {REPEATED} measured {by[REPEATED]:.3f}s then {again:.3f}s "
              f"({100 * (again / by[REPEATED] - 1):+.1f}%)")
    if drifts:
        print(f"run-to-run drift (same point, the two runs): median "
              f"{100 * statistics.median(drifts):.1f}%, worst {100 * max(drifts):.1f}%")
        print(f"held-out points the machine repeated (within {100 * REPEATS:.0f}% of the "
              f"other run): {len(repeated)} of {len(held)}; worst |error| "
              f"{100 * max(repeated, default=0.0):.1f}%, median "
              f"{100 * (statistics.median(repeated) if repeated else 0.0):.1f}%")
    if len(tracked) > 2:
        cores, ewtts = zip(*tracked)
        print(f"cores slower by {min(cores):.3f}-{max(cores):.3f}x between the runs, EWTT by "
              f"{min(ewtts):.3f}-{max(ewtts):.3f}x; correlation "
              f"{statistics.correlation(cores, ewtts):+.2f} over {len(tracked)} points")
    return summary


def core_ratio(run: Run, reference: Run | None) -> float | None:
    """How much slower the cores ran at ``run``'s point than at the same point of
    ``reference`` (`Run.core_ms`, a ratio); None where either did not record it."""
    if reference is None or run.core_ms is None or reference.core_ms is None:
        return None
    return run.core_ms / reference.core_ms


def core_factor(runs: list[Run], reference: list[Run]) -> float | None:
    """How much slower the cores ran in ``runs`` than in ``reference``: the median over the
    points both recorded of `core_ratio` (None: none did). One factor for the run: a point's
    own ratio also moves with how busy it kept the cores (the probe's share of them), and
    one ratio per point scattered twice as far as the points' EWTTs (runs 26-27)."""
    by = {r.label: r for r in reference}
    ratios = [x for x in (core_ratio(r, by.get(r.label)) for r in runs) if x is not None]
    return statistics.median(ratios) if ratios else None


def _noise(run: Run) -> float:
    """How far apart the point's measured updates lie: (slowest - fastest) / their median."""
    measured = run.measured_ewtt_s
    return (max(measured) - min(measured)) / run.measured_s


def hops(runs: list[Run]) -> None:
    """Per point: the median gap from a step's last answer to the next step on a rollout (two
    messages and a step: what the control latency is read from) and the median busiest
    worker's link time of a round; their correlation over the points."""
    from weightbridge.simulation.calibrate import hop_gaps
    from weightbridge.simulation.timeline import Overheads, plan_steps

    xs, ys = [], []
    for run in runs:
        gaps = hop_gaps(run, Overheads())
        out: dict[int, int] = {}
        for (_, r, stage), v in plan_steps(run.plan).items():
            if stage != "land":
                out[r] = max(out.get(r, 0), sum(n for _, _, n in v[1]))
        xs.append(statistics.median(out.values()) / run.link_rate)
        ys.append(statistics.median(gaps))
        print(f"{run.label:<22} round on the busiest link {1e3 * xs[-1]:6.1f} ms, median hop "
              f"{1e3 * ys[-1]:5.2f} ms")
    print(f"correlation {statistics.correlation(xs, ys):+.2f}")


def stages(runs: list[Run]) -> None:
    """Per point, medians over rounds and updates: how long a write stage (receive, external)
    lasts from its first worker's start to its last one's end, against its busiest worker's
    bytes at the link's rate; and how far apart the workers of a step start."""
    from weightbridge.simulation.calibrate import WRITE_STAGES, spans_by_worker, step_starts
    from weightbridge.simulation.timeline import plan_steps

    for run in runs:
        steps, T = plan_steps(run.plan), len(run.plan.trainers)
        took: dict[str, list] = {"receive": [], "external": []}
        ratio: dict[str, list] = {"receive": [], "external": []}
        spread = []
        for spans in run.updates():
            spread += [v[-1][0] - v[0][0] for v in step_starts(spans, T).values() if len(v) > 1]
            by_step: dict[tuple, list] = {}
            for w, ss in spans_by_worker(spans, T).items():
                for stage, r, a, b in ss:
                    by_step.setdefault((stage, r), []).append((w, a, b))
            for (stage, r), ws in by_step.items():
                if stage in took:
                    wire = max(sum(n for _, _, n in steps[(w, r, WRITE_STAGES[stage])][1])
                               for w, _, _ in ws) / run.link_rate
                    took[stage].append(max(b for *_, b in ws) - min(a for _, a, _ in ws))
                    ratio[stage].append(took[stage][-1] / wire)
        cols = "  ".join(f"{st} {1e3 * statistics.median(took[st]):6.1f} ms = "
                         f"{statistics.median(ratio[st]):4.1f}x its bytes"
                         for st in took if took[st])
        start = f"  starts {1e3 * statistics.median(spread):5.1f} ms apart" if spread else ""
        print(f"{run.label:<22} {cols}{start}")


def show_rounds(runs: list[Run], label: str, rounds) -> None:
    """Every span of ``rounds`` of the second update of point ``label``, ms from its start."""
    from weightbridge.simulation.calibrate import spans_by_worker

    run = next((r for r in runs if r.label == label), None)
    if run is None:
        raise SystemExit(f"--rounds: no point {label!r} in {[r.label for r in runs]}")
    by = spans_by_worker(run.updates()[0], len(run.plan.trainers))
    t0 = min(s[2] for ss in by.values() for s in ss)
    rows = sorted((a - t0, b - t0, w, st, r) for w, ss in by.items() for st, r, a, b in ss
                  if r in rounds)
    for a, b, w, st, r in rows:
        print(f"round {r} worker {w} {st:<9} {1e3 * a:7.1f} -> {1e3 * b:7.1f} ms "
              f"({1e3 * (b - a):5.1f})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--collect", nargs="+", metavar="PATH",
                        help="run every point and pickle the runs to this path; given two "
                             "paths or more, collect that many runs at once, each point's "
                             "sets alternating between them (same machine, separate sets)")
    parser.add_argument("--updates", type=int, default=3,
                        help="updates per spawn; a point's EWTT is the median over its "
                             "spawns of all updates but each spawn's first")
    parser.add_argument("--spawns", type=int, default=4,
                        help="fresh sets of procs per point, one after another "
                             f"({MORE_SETS}x at the controller-bound six-proc points)")
    parser.add_argument("--points", nargs="+", help="labels of the points to collect (all)")
    parser.add_argument("--fit-from", help="a pickled run: fit on its calibration points")
    parser.add_argument("--predict", help="a pickled run (a separate one): predict its points")
    parser.add_argument("--calibrate", nargs="+", default=list(CALIBRATION))
    parser.add_argument("--hops", help="a pickled run: print every point's median hop gap")
    parser.add_argument("--rounds", nargs="+", metavar=("LABEL", "ROUND"),
                        help="with --hops RUN: print these rounds' spans of point LABEL")
    parser.add_argument("--stages", help="a pickled run: every point's write stages against "
                        "their bytes at the link's rate, and how far apart a step's workers "
                        "start")
    parser.add_argument("--fanout-s", type=float, default=0.0,
                        help="Overheads.fanout_s, measured by benchmarks/control_scaling.py")
    parser.add_argument("--shared-cpus", type=int,
                        help="model every proc on this many shared cores (0: each proc its "
                             "own); default: what each run recorded (`Run.cpus`)")
    parser.add_argument("--no-stagger", action="store_true",
                        help="fit no cost per control message (Overheads.stagger_s 0: the "
                             "model before it)")
    parser.add_argument("--cores", action="store_true",
                        help="scale the fitted CPU costs by how much slower the cores ran "
                             "than in the fit run (the median over the points of each one's "
                             "Run.core_ms ratio)")
    parser.add_argument("--no-burst", action="store_true",
                        help="model the links without their token bucket (as before it was "
                             "modelled): every byte at the link's rate")
    args = parser.parse_args()
    if args.updates < 2:
        parser.error(f"--updates must be >= 2 (each spawn's first only warms caches), got "
                     f"{args.updates}")
    if args.spawns < 1:
        parser.error(f"--spawns must be >= 1, got {args.spawns}")
    if args.collect:
        paths = [Path(c) for c in args.collect]
        if len(set(p.resolve() for p in paths)) < len(paths):
            parser.error(f"--collect got the same path twice ({' '.join(args.collect)}); give "
                         f"each interleaved run its own file")
        t0 = time.perf_counter()
        print(f"collect: {load()}", flush=True)
        points = [p for p in POINTS if not args.points or p.label in args.points]
        collected = collect(points, args.updates, args.spawns, len(paths))
        for path, runs in zip(paths, collected):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(pickle.dumps(runs))
        print(f"collected {len(collected[0])} points in {time.perf_counter() - t0:.0f}s -> "
              f"{' '.join(args.collect)}  ({load()})")
    if args.stages:
        stages(load_runs(args.stages))
    if args.hops and args.rounds:
        show_rounds(load_runs(args.hops), args.rounds[0],
                    {int(r) for r in args.rounds[1:]})
    elif args.hops:
        hops(load_runs(args.hops))
    if args.fit_from and args.predict:
        fit_runs = load_runs(args.fit_from)
        runs = load_runs(args.predict)
        if args.no_burst:
            fit_runs, runs = ([replace(r, link_burst=0.0) for r in rs] for rs in (fit_runs, runs))
        if args.shared_cpus is not None:
            fit_runs, runs = ([replace(r, cpus=args.shared_cpus) for r in rs]
                              for rs in (fit_runs, runs))
        print(f"fit: {args.fit_from}; predict: {args.predict}")
        validate(fit_runs, runs, args.calibrate, fit_runs, fanout_s=args.fanout_s,
                 stagger=not args.no_stagger, cores=args.cores)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
