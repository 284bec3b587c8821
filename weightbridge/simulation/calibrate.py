"""Fit the simulator's `Overheads` from the spans of measured updates.

A measured update is the spans every worker recorded (`controller.timing`: ``(stage, round,
start_ns, end_ns)`` of each pack, write and assemble) plus the plan it ran. Each parameter
is read off the spans it shows in, not tuned per point:

- copy rate and fixed cost: least squares of pack and assemble span lengths on their bytes;
- checksum rate: a trainer's gap from its pack's end to its writes' start (it checksums what
  it writes in between), least squares on the bytes written;
- link efficiency: per host link and direction, the bytes of the writes crossing it over the
  union of those writes' spans, over the configured rate; the best link of all updates (a
  saturated one: elsewhere the spans include waits on other links). With a token bucket
  (`Run.link_burst`) the bytes each busy period sent unshaped (a full bucket, or what the idle
  gap before it refilled) are not counted: they are the bucket, not the link's goodput (where
  every write fit its bucket no goodput shows, and the efficiency is left at 1);
- stagger (the controller's cost per message: it sends one at a time): how far apart the
  rollouts of one step (a forward, a land) start, over the rollouts less one (median over
  steps);
- control latency: median over rollouts and rounds of the gap between the last reply of a
  step and the start of the next step's span on a rollout (its forward after the trainers'
  sends, its assemble after the forwards), less its checksum time and its stagger (the k-th
  to start, k stagger): two messages and a step;
- step cost: the gap between a trainer's writes landing and its next pack, where the next
  send was already waiting (median);
- fanout (per worker a step waits for): not read off transfer spans, but given
  (``fanout_s=``, measured by `benchmarks/control_scaling.py`) and taken out of the gaps above;
- flow penalty, then write cost: the two parameters no span isolates (a write's span also
  holds its wait for the link); each the value whose predicted EWTT best matches (least
  squares) the measured EWTT of the calibration runs, the other parameters fixed.

Typical usage::

    overheads = fit_overheads([run_a, run_b])       # `Run`s of two calibration points
    est = simulate(run_c.plan, point_cluster(run_c), overheads=overheads, depth=run_c.depth)
"""

from __future__ import annotations

import math
import pickle
import statistics
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from weightbridge.planning.route import EXTERNAL, INTERNAL, RECEIVE
from weightbridge.simulation.simulate import Cluster
from weightbridge.simulation.timeline import Overheads, plan_steps, timeline_ewtt

WRITE_STAGES = {"receive": RECEIVE, "external": EXTERNAL, "internal": INTERNAL}
"""Span stage name (`controller.timing`) -> route stage of the writes it times."""
MAX_WRITE_S = 0.02
"""Upper end of the write-cost search."""
MAX_PENALTY = 0.5
"""Upper end of the flow-penalty search."""


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Run:
    """One measured point: its plan, links, depth and every update's spans.

    Example: ``Run(label="replicas=1", plan=plan, link_rate=6.25e6, depth=3,
    spans=({("trainer", 0): [("pack", 0, 10, 20), ...], ...},), ewtt_s=(3.03,), load="...")``
    """

    label: str
    """The point's name (``"replicas=4"``)."""
    plan: object
    """The `TransferPlan` the updates ran."""
    link_rate: float
    """Configured bytes/s of every host link, each direction."""
    depth: int
    """Round arenas per worker."""
    spans: tuple[Mapping, ...]
    """Per update: (side, rank) -> [(stage, round, start_ns, end_ns)]."""
    ewtt_s: tuple[float, ...]
    """Per update: the measured EWTT."""
    load: str
    """What the machine was doing when the point ran (it is shared): ``uptime``'s load and,
    since 4 Dec, the cores busy by the emulated cluster, by other processes and by steal."""
    link_burst: float = 0.0
    """Bytes every host link sends unshaped after idling (its token bucket; 0: none)."""
    cpus: int = 0
    """Cores of the machine the emulated cluster ran on, which all its procs share (0: not
    recorded: each worker its own)."""
    spawns: int = 1
    """Fresh sets of procs the point ran on, one after another, each for an equal share of
    the updates (in order): how fast a saturated machine serves a set of procs varies from
    one set to the next, so a point measured on one set need not repeat on another."""
    core_samples: tuple[tuple[int, float, float], ...] = ()
    """(set of procs, interpreter ms, copy ms) of each run of a fixed piece of work, timed in
    CPU time every 0.1 s while the point's updates ran (`benchmarks.machine.CoreProbe`): how
    fast a core was. How busy the cores were moves it too, so compare it only with the same
    point of another run (empty: not recorded, runs before 4 Dec)."""

    def __post_init__(self) -> None:
        if self.spawns < 1 or len(self.ewtt_s) % self.spawns:
            raise ValueError(f"Run {self.label!r}: {len(self.ewtt_s)} EWTTs do not split into "
                             f"{self.spawns} spawns of equal length; give spawns >= 1 that "
                             f"divides the number of updates")

    @property
    def measured_ewtt_s(self) -> tuple[float, ...]:
        """The EWTTs that count: of each spawn's updates after its first (the first warms
        caches), where a spawn ran more than one."""
        return self._counted(self.ewtt_s)

    @property
    def measured_s(self) -> float:
        """Median of `measured_ewtt_s`."""
        return statistics.median(self.measured_ewtt_s)

    @property
    def core_ms(self) -> float | None:
        """Median interpreter ms of `core_samples` (None: not recorded): compared between two
        runs of the same point, how much slower the cores were in one (the probe's own share
        of a busy machine is the same in both)."""
        if not self.core_samples:
            return None
        return statistics.median(s[1] for s in self.core_samples)

    def updates(self) -> tuple[Mapping, ...]:
        """The spans of the updates the fit uses (those of `measured_ewtt_s`)."""
        return self._counted(self.spans)

    def _counted(self, per_update: tuple) -> tuple:
        n = len(per_update) // self.spawns
        if n < 2:
            return per_update
        return tuple(x for k, x in enumerate(per_update) if k % n)


def load_runs(path) -> list[Run]:
    """The `Run`s pickled at ``path``; a field added to `Run` since they were pickled takes
    its default (a slotted dataclass unpickles without it)."""
    runs = pickle.loads(Path(path).read_bytes())
    return [Run(**{f.name: getattr(r, f.name, f.default) for f in fields(Run)}) for r in runs]


def point_cluster(run: Run) -> Cluster:
    """The emulated cluster of ``run``: every host one link of ``link_rate`` each direction,
    shared by its procs, any of which may use all of it, with the run's token bucket; loopback
    inside a host unshaped; every proc on the cores of the one machine (`Run.cpus`)."""
    plan = run.plan
    places = list(plan.trainers) + list(plan.rollouts)
    per_node = max(sum(1 for p in places if p.node == n) for n in {p.node for p in places})
    return Cluster(gpus_per_node=per_node, inter_node_bandwidth=run.link_rate,
                   intra_node_bandwidth=1e12, nic_bandwidth=run.link_rate,
                   link_burst_bytes=run.link_burst, shared_cpus=run.cpus)


def fit_overheads(runs: Sequence[Run], *, fanout_s: float = 0.0,
                  stagger: bool = True) -> Overheads:
    """Fit every `Overheads` field but ``fanout_s`` from the spans of ``runs`` (see the
    module doc); ``fanout_s`` (measured apart: `benchmarks/control_scaling.py`) is kept, and
    taken out of the gaps the control latency is read from. ``stagger=False``: messages cost
    the controller nothing (``stagger_s`` 0), as the model was before it had the cost."""
    if not runs:
        raise ValueError("fit_overheads needs at least one measured Run")
    copy_x, copy_y, sum_x, sum_y, efficiency = [], [], [], [], []
    for run in runs:
        steps, T = plan_steps(run.plan), len(run.plan.trainers)
        for spans in run.updates():
            for w, ss in spans_by_worker(spans, T).items():
                for stage, r, start, end in ss:
                    if stage == "pack":
                        copy_x.append(steps[(w, r, RECEIVE)][0])
                        copy_y.append(end - start)
                    elif stage == "assemble":
                        copy_x.append(steps[(w, r, "land")])
                        copy_y.append(end - start)
                for (s0, r0, _, e0), (s1, r1, b1, _) in zip(ss, ss[1:]):
                    if s0 == "pack" and s1 == "receive" and r0 == r1:
                        sum_x.append(steps[(w, r0, RECEIVE)][0])
                        sum_y.append(b1 - e0)
            efficiency.append(_best_link_rate(run, steps, spans) / run.link_rate)
    copy_fixed, copy_per_byte = _line(copy_x, copy_y)
    _, sum_per_byte = _line(sum_x, sum_y)
    base = Overheads(copy_fixed_s=copy_fixed, copy_bandwidth=_rate(copy_per_byte),
                     checksum_bandwidth=_rate(sum_per_byte),
                     link_efficiency=min(1.0, max(efficiency)) or 1.0, fanout_s=fanout_s,
                     stagger_s=_stagger(runs) if stagger else 0.0)
    two_hops = statistics.median(g for run in runs for g in hop_gaps(run, base))
    step = statistics.median(_queued_gaps(runs, two_hops) or [0.0])
    base = replace(base, step_s=step, control_s=max(0.0, (two_hops - step) / 2))
    base = replace(base, flow_penalty=_fit_by_ewtt(runs, base, "flow_penalty", MAX_PENALTY))
    return replace(base, write_s=_fit_by_ewtt(runs, base, "write_s", MAX_WRITE_S))


def spans_by_worker(spans: Mapping, num_trainers: int) -> dict[int, list]:
    """Worker number (trainers first) -> its spans in seconds, by start."""
    return {(rank if side == "trainer" else num_trainers + rank):
            sorted(((st, r, a / 1e9, b / 1e9) for st, r, a, b in ss), key=lambda x: x[2])
            for (side, rank), ss in spans.items()}


def _line(x, y) -> tuple[float, float]:
    """Least squares y = a + b x with a, b >= 0; through the origin (a = 0) where x spans
    too narrow a range to tell a from b (rounds of nearly equal size)."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if len(x) == 0 or not x.any():
        return 0.0, 0.0
    origin = (0.0, max(0.0, float((x @ y) / (x @ x))))
    if len(x) < 3 or np.ptp(x) < 0.5 * x.mean():
        return origin
    b, a = np.polyfit(x, y, 1)
    if a < 0 or b < 0:
        return origin
    return float(a), float(b)


def _rate(per_byte: float) -> float:
    return 1.0 / per_byte if per_byte > 0 else math.inf


def _best_link_rate(run: Run, steps: dict, spans: Mapping) -> float:
    """Bytes/s of the busiest host link direction over the union of its writes' spans, less
    what its token bucket sent unshaped."""
    plan, T = run.plan, len(run.plan.trainers)
    node = [p.node for p in list(plan.trainers) + list(plan.rollouts)]
    busy: dict[tuple[str, str], list] = {}
    moved: dict[tuple[str, str], int] = {}
    for w, ss in spans_by_worker(spans, T).items():
        for stage, r, start, end in ss:
            if stage not in WRITE_STAGES or WRITE_STAGES[stage] == INTERNAL:
                continue
            for _, dst, n in steps[(w, r, WRITE_STAGES[stage])][1]:
                for link in ((node[w], "out"), (node[dst], "in")):
                    busy.setdefault(link, []).append((start, end))
                    moved[link] = moved.get(link, 0) + n
    best = 0.0
    for link, intervals in busy.items():
        periods = _merged(intervals)
        sent = moved[link] - _burst_credit(periods, run.link_rate, run.link_burst)
        best = max(best, max(0.0, sent) / sum(b - a for a, b in periods))
    return best


def _merged(intervals: list) -> list[tuple[float, float]]:
    """The busy periods: ``intervals`` merged where they overlap, by start."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _burst_credit(periods: list, rate: float, burst: float) -> float:
    """Bytes a link with a token bucket of ``burst`` bytes (refilled at ``rate`` while idle)
    sent unshaped over its busy ``periods`` (`_merged`): a full bucket before the first, and
    what each idle gap refilled before the others."""
    if not burst:
        return 0.0
    return burst + sum(min(burst, rate * (a - end)) for (_, end), (a, _) in
                       zip(periods, periods[1:]))


def step_starts(spans: Mapping, num_trainers: int) -> dict[tuple[str, int], list]:
    """(stage, round) -> sorted [(start, worker)] of the rollouts' forward ("external") and
    assemble spans of one update: when each worker of a step began it."""
    out: dict[tuple[str, int], list] = {}
    for w, ss in spans_by_worker(spans, num_trainers).items():
        if w >= num_trainers:
            for stage, r, start, _ in ss:
                if stage in ("external", "assemble"):
                    out.setdefault((stage, r), []).append((start, w))
    return {k: sorted(v) for k, v in out.items()}


def _stagger(runs: Sequence[Run]) -> float:
    """Median over the steps of more than one rollout: first to last start over workers - 1."""
    per = [(v[-1][0] - v[0][0]) / (len(v) - 1) for run in runs for spans in run.updates()
           for v in step_starts(spans, len(run.plan.trainers)).values() if len(v) > 1]
    return statistics.median(per) if per else 0.0


def hop_gaps(run: Run, oh: Overheads) -> list[float]:
    """Reply-to-next-step gaps seen on rollouts, less their checksum time, their stagger (the
    k-th of a step to start: k stagger) and the fanout of the step before (its workers: the
    trainers before a forward, the rollouts before a land after a forward): two messages and
    a step each."""
    steps, T = plan_steps(run.plan), len(run.plan.trainers)
    R = len(run.plan.rollouts)
    out = []
    for spans in run.updates():
        by = spans_by_worker(spans, T)
        nth = {(key, w): k for key, v in step_starts(spans, T).items()
               for k, (_, w) in enumerate(v)}
        ends: dict[tuple[int, str], float] = {}
        for w, ss in by.items():
            for stage, r, _, end in ss:
                ends[(r, stage)] = max(ends.get((r, stage), 0.0), end)
        for w, ss in by.items():
            if w < T:
                continue
            for stage, r, start, _ in ss:
                if stage == "external":
                    before, nbytes = ends.get((r, "receive")), sum(
                        n for _, _, n in steps[(w, r, EXTERNAL)][1])
                    waited = T
                elif stage == "assemble":
                    forwarded = ends.get((r, "internal"), ends.get((r, "external")))
                    before = forwarded if forwarded is not None else ends.get((r, "receive"))
                    nbytes = steps[(w, r, "land")]
                    waited = R if forwarded is not None else T
                else:
                    continue
                if before is not None:
                    out.append(start - before - nbytes / oh.checksum_bandwidth
                               - oh.fanout_s * waited - oh.stagger_s * nth[((stage, r), w)])
    return out


def _queued_gaps(runs: Sequence[Run], two_hops: float) -> list[float]:
    """A trainer's gap from its writes landing to its next pack, where that send was issued
    before: the next round's buffer was free (its round - depth assembled everywhere two
    messages earlier) before the writes landed."""
    out = []
    for run in runs:
        T = len(run.plan.trainers)
        for spans in run.updates():
            by = spans_by_worker(spans, T)
            assembled: dict[int, float] = {}
            for w, ss in by.items():
                for stage, r, _, end in ss:
                    if stage == "assemble":
                        assembled[r] = max(assembled.get(r, 0.0), end)
            for w in range(T):
                ss = [s for s in by.get(w, []) if s[0] in ("pack", "receive")]
                for (s0, r0, _, e0), (s1, r1, b1, _) in zip(ss, ss[1:]):
                    if s0 == "receive" and s1 == "pack" and r1 == r0 + 1:
                        free = assembled.get(r1 - run.depth, -math.inf) + two_hops
                        if free < e0:
                            out.append(b1 - e0)
    return out


def golden_min(loss, lo: float, hi: float, *, iters: int = 20) -> float:
    """The x in [lo, hi] where the unimodal ``loss`` is least (golden-section search)."""
    g = (math.sqrt(5) - 1) / 2
    a, b = hi - g * (hi - lo), lo + g * (hi - lo)
    fa, fb = loss(a), loss(b)
    for _ in range(iters):
        if fa <= fb:
            hi, b, fb = b, a, fa
            a = hi - g * (hi - lo)
            fa = loss(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + g * (hi - lo)
            fb = loss(b)
    return (a + b) / 2


def _fit_by_ewtt(runs: Sequence[Run], oh: Overheads, field: str, top: float) -> float:
    """The value in [0, top] of ``field`` whose predicted EWTTs best match the measured ones
    of ``runs`` (least squares of the relative errors; golden section)."""
    clusters = [point_cluster(r) for r in runs]

    def loss(value: float) -> float:
        o = replace(oh, **{field: value})
        return sum((timeline_ewtt(r.plan, c, o, r.depth) / r.measured_s - 1) ** 2
                   for r, c in zip(runs, clusters))

    best = golden_min(loss, 0.0, top, iters=20)
    return 0.0 if loss(0.0) <= loss(best) else best
