"""Per-update stall windows, EWTT, AGST and a Chrome trace from the actors' own timestamps.

Every actor records one span per (stage, round) it runs in an update, with `time.monotonic_ns()`
(CLOCK_MONOTONIC: one clock for every process on a host, so spans from different procs line up
without any offset correction). Stages: trainers ``pack`` and ``receive`` (its RECEIVE writes,
from issue until all landed); rollouts ``external`` and ``internal`` (their forwarding writes)
and ``assemble``. Pure arithmetic here: no Monarch, no torch.

Stall windows in the fully synchronous mode (every worker stops computing for the
whole transfer, as in the paper's fully synchronous mode):

- a trainer stalls from the update's first send (the earliest trainer span) until its own last
  span ended (its last write landed);
- a rollout stalls from the first write aimed at it (issue time of the earliest span of any
  worker that writes into it in that stage and round: a lower bound of the first byte landing)
  until its own last span ended (its last assemble); a rollout nobody writes to starts at the
  update start;
- a worker with no span at all does not stall.

EWTT (paper section 4.1) = last stall end - first stall start; AGST = sum of stalls / workers,
so AGST <= EWTT always.

Typical usage::

    timing = update_timing({("trainer", 0): spans0, ("rollout", 0): spans1, ...}, dests)
    print(timing.ewtt_s, timing.agst_s)
    json.dump(chrome_trace(timing), open("update.json", "w"))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

import numpy as np

from weightbridge.driver import Mode

Span = tuple[str, int, int, int]
"""(stage, round, start_ns, end_ns) of one step an actor ran."""
Worker = tuple[str, int]
"""(side, mesh rank): ``("trainer", 2)``."""
Dests = Mapping[tuple[str, int, int, str], frozenset[int]]
"""(side, rank, round, stage) -> the rollout ranks that step writes into."""

KERNEL_STAGES = ("pack", "assemble")
LAND_STAGES = ("assemble", "stage")
"""A rollout's land of a round: assembled into its parameters, or into a staging slot
(receiver staging)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class UpdateTiming:
    """One update's spans and stall windows (ns, CLOCK_MONOTONIC).

    Example: ``UpdateTiming(start_ns=10, spans={("trainer", 0): [("pack", 0, 10, 20)]},
    stalls={("trainer", 0): (10, 20)})`` has EWTT 10 ns and AGST 10 ns.
    """

    start_ns: int
    """The update's first send: when the first worker stopped computing."""
    spans: Mapping[Worker, list[Span]]
    """Every worker's spans, including workers with none (empty list)."""
    stalls: Mapping[Worker, tuple[int, int]]
    """(start_ns, end_ns) of every worker's stall window; (t, t) for a worker that did not stall."""

    @property
    def ewtt_s(self) -> float:
        """First worker stops computing -> last worker resumes, seconds."""
        end = max((e for _, e in self.stalls.values()), default=self.start_ns)
        return (end - self.start_ns) / 1e9

    @property
    def agst_s(self) -> float:
        """Average stall per worker (trainers and rollouts), seconds."""
        if not self.stalls:
            return 0.0
        return sum(e - s for s, e in self.stalls.values()) / len(self.stalls) / 1e9

    def mode_agst_s(self, mode: Mode, *, trainer_stall_s: float, install_s: float) -> float:
        """AGST in a staging mode: a trainer with sender staging stalls for its staged copy
        (``trainer_stall_s``, not the rounds), a rollout with receiver staging for its
        install (``install_s``, not the rounds); the others as their stall windows say."""
        if not self.stalls:
            return 0.0
        total = 0.0
        for (side, _), (s, e) in self.stalls.items():
            if side == "trainer" and mode.sends_staged_copy:
                total += trainer_stall_s
            elif side == "rollout" and mode.lands_in_staging:
                total += install_s
            else:
                total += (e - s) / 1e9
        return total / len(self.stalls)

    def kernel_s(self, worker: Worker) -> float:
        """Seconds a worker spent in pack and assemble."""
        return sum(e - s for st, _, s, e in self.spans[worker] if st in KERNEL_STAGES) / 1e9

    def kernel_share(self) -> tuple[float, float]:
        """(mean, max) over workers of pack + assemble time, as fractions of EWTT."""
        ewtt = self.ewtt_s
        if not self.spans or ewtt <= 0:
            return 0.0, 0.0
        times = [self.kernel_s(w) for w in self.spans]
        return sum(times) / len(times) / ewtt, max(times) / ewtt


@dataclass(frozen=True, slots=True, kw_only=True)
class WriteTimeline:
    """Where an update's time goes around the trainers' RECEIVE writes, the bytes Eq. (1)
    counts (seconds): `write_timeline`.

    Example: writes of round 0 over 0-10 ms and of round 1 over 14-20 ms, round 1 waiting for
    round 0's buffer (depth 1) which landed at 12 ms, the last assemble ending at 25 ms:
    ``writes_s`` 0.020, ``idle_s`` 0.004, ``buffer_wait_s`` 0.002, ``drain_s`` 0.005.
    """

    writes_s: float
    """First trainer write issued -> last trainer write landed."""
    idle_s: float
    """Of ``writes_s``, the time no trainer was writing."""
    buffer_wait_s: float
    """Of ``idle_s``, before round r - depth had landed everywhere, whose round buffer round
    r's writes needed (the rest is that land's trip to the controller, the send's trip to
    the trainer and its pack)."""
    drain_s: float
    """Last trainer write landed -> the update's last span ended (the last rounds'
    forwards and assembly, which Eq. (1) leaves out)."""


def write_timeline(timing: UpdateTiming, depth: int) -> WriteTimeline:
    """The trainers' write intervals of ``timing`` (``receive`` spans), their union's gaps,
    and the part of each gap spent before the round ``depth`` back had landed (its last
    `LAND_STAGES` span on a rollout ended)."""
    writes = sorted((s, e, r) for (side, _), spans in timing.spans.items() if side == "trainer"
                    for stage, r, s, e in spans if stage == "receive")
    if not writes:
        raise ValueError("no trainer wrote in this update")
    landed: dict[int, int] = {}
    for (side, _), spans in timing.spans.items():
        for stage, r, _, e in spans:
            if side == "rollout" and stage in LAND_STAGES:
                landed[r] = max(landed.get(r, e), e)
    idle = wait = 0
    covered = writes[0][1]
    for s, e, r in writes[1:]:
        if s > covered:
            idle += s - covered
            freed = landed.get(r - depth)
            if freed is not None and freed > covered:
                wait += min(s, freed) - covered
        covered = max(covered, e)
    last = max(e for spans in timing.spans.values() for _, _, _, e in spans)
    return WriteTimeline(writes_s=(covered - writes[0][0]) / 1e9, idle_s=idle / 1e9,
                         buffer_wait_s=wait / 1e9, drain_s=(last - covered) / 1e9)


def update_timing(spans: Mapping[Worker, Iterable[Span]], dests: Dests) -> UpdateTiming:
    """Stall windows of every worker from its spans and who writes to whom (see module doc)."""
    spans = {w: sorted(s, key=lambda x: x[2]) for w, s in spans.items()}
    starts = [sp[2] for w, s in spans.items() if w[0] == "trainer" for sp in s]
    starts = starts or [sp[2] for s in spans.values() for sp in s]
    if not starts:
        raise ValueError("no spans: the update ran no step on any worker")
    t0 = min(starts)
    first_in: dict[int, int] = {}
    last_in: dict[int, int] = {}
    for (side, rank), s in spans.items():
        for stage, r, start, end in s:
            for dst in dests.get((side, rank, r, stage), ()):
                first_in[dst] = min(first_in.get(dst, start), start)
                last_in[dst] = max(last_in.get(dst, end), end)
    stalls = {}
    for (side, rank), s in spans.items():
        end = max([sp[3] for sp in s] + ([last_in[rank]] if side == "rollout" and rank in last_in
                                          else []), default=None)
        if end is None:
            stalls[(side, rank)] = (t0, t0)
        elif side == "trainer":
            stalls[(side, rank)] = (t0, end)
        else:
            stalls[(side, rank)] = (min(first_in.get(rank, t0), end), end)
    return UpdateTiming(start_ns=t0, spans=spans, stalls=stalls)


def write_dests(plan) -> dict[tuple[str, int, int, str], frozenset[int]]:
    """(side, rank, round, stage) -> rollout ranks written, from a `TransferPlan`'s tables: the
    peers of its workers' `BufferWrite`s, without building their `WorkerPlan`s."""
    from weightbridge.driver import STAGES

    t = plan.tables
    num_trainers, num_rounds = len(plan.trainers), plan.num_rounds
    num_workers = num_trainers + len(plan.rollouts)
    key = (((t.src.astype(np.int64) * num_rounds + t.round) * len(STAGES) + t.stage)
           * num_workers + t.dst)
    key = np.unique(key)
    dst, key = key % num_workers, key // num_workers
    stage, key = key % len(STAGES), key // len(STAGES)
    rnd, src = key % num_rounds, key // num_rounds
    out: dict[tuple[str, int, int, str], set[int]] = {}
    for s, r, k, d in zip(src.tolist(), rnd.tolist(), stage.tolist(), dst.tolist()):
        side, rank = ("trainer", s) if s < num_trainers else ("rollout", s - num_trainers)
        out.setdefault((side, rank, r, STAGES[k].value), set()).add(d - num_trainers)
    return {k: frozenset(v) for k, v in out.items()}


def chrome_trace(timing: UpdateTiming, *, label: str = "update") -> dict:
    """Chrome trace JSON (opens in Perfetto): pid = mesh (0 trainer, 1 rollout), tid = rank.

    One complete event (``ph: "X"``, microseconds from the update start) per (rank, stage,
    round), named ``"<stage> r<round>"``, plus one ``stall`` event per worker that encloses them.
    """
    pids = {"trainer": 0, "rollout": 1}
    events: list[dict] = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                           "args": {"name": f"{side} mesh"}} for side, pid in pids.items()]
    us = lambda ns: (ns - timing.start_ns) / 1e3  # noqa: E731
    for (side, rank), spans in sorted(timing.spans.items()):
        pid = pids[side]
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": rank,
                       "args": {"name": f"{side} {rank}"}})
        s, e = timing.stalls[(side, rank)]
        if e > s:
            events.append({"ph": "X", "name": "stall", "cat": "stall", "pid": pid, "tid": rank,
                           "ts": us(s), "dur": (e - s) / 1e3})
        for stage, r, start, end in spans:
            events.append({"ph": "X", "name": f"{stage} r{r}", "cat": stage, "pid": pid,
                           "tid": rank, "ts": us(start), "dur": (end - start) / 1e3,
                           "args": {"round": r}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"label": label, "ewtt_s": timing.ewtt_s, "agst_s": timing.agst_s}}
