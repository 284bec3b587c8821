"""The global transfer plan: one copy out of the trainers, one copy into each rollout node.

`plan_transfer` validates the two meshes, intersects their source maps (`correspond`) and routes
every needed element (`plan_route`) through three stages per round:

    trainers --RECEIVE--> one needer per element per node set --EXTERNAL--> one needer on every
    other needing node --INTERNAL--> the other needers of each node

Planning is pure (frozen inputs, numpy tables out, no I/O) and deterministic. It is done once;
executors replay the per-worker views (`TransferPlan.for_worker`) for every model version.

Typical usage::

    plan = plan_transfer([(tmap, Placement("t0"))], [(rmap, Placement("r0", engine=0))],
                         round_bytes=256 << 20)
    print(plan.summary())
    wplan = plan.for_worker(WorkerId("rollout", 0))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from weightbridge.discovery.correspond import correspond
from weightbridge.gc_pause import with_gc_paused
from weightbridge.planning.route import STAGES, RouteTables, route
from weightbridge.types import (QUANT_DTYPE, SCALE_DTYPE, Chunk, Correspondence, Placement, Round,
                                SourceMap, Stage, Transfer, WorkerId, WorkerPlan, dtype_itemsize)


@dataclass(frozen=True, eq=False)
class StageBytes:
    """Bytes per worker per stage of a plan: ``sent[i, s]`` and ``received[i, s]`` for worker
    ``workers[i]`` (trainers, then rollouts) and stage ``stages[s]``.

    Example: ``plan.stage_bytes().of(WorkerId("rollout", 0))`` ->
    ``{Stage.RECEIVE: (0, 917504), Stage.EXTERNAL: (458752, 0), Stage.INTERNAL: (0, 0)}``
    """

    workers: tuple[WorkerId, ...]
    sent: np.ndarray
    """[num workers, 3] int64."""
    received: np.ndarray
    """[num workers, 3] int64."""
    stages: tuple[Stage, ...] = STAGES
    """The columns: RECEIVE, EXTERNAL, INTERNAL."""

    def of(self, worker: WorkerId) -> dict[Stage, tuple[int, int]]:
        """(sent, received) bytes of one worker per stage."""
        i = self.workers.index(worker)
        return {s: (int(self.sent[i, k]), int(self.received[i, k]))
                for k, s in enumerate(self.stages)}

    def __iter__(self):
        """``sent, received = plan.stage_bytes()``, as before the arrays were labelled."""
        return iter((self.sent, self.received))

    def __getitem__(self, i: int) -> np.ndarray:
        return (self.sent, self.received)[i]


@with_gc_paused  # (overlaps and segments by the million: `weightbridge.gc_pause`)
def plan_transfer(trainers: Sequence[tuple[SourceMap, Placement]],
                  rollouts: Sequence[tuple[SourceMap, Placement]], *,
                  round_bytes: int) -> "TransferPlan":
    """Plan a weight transfer from trainer workers to rollout workers.

    Args:
        trainers: One (source map, placement) per trainer worker.
        rollouts: One (source map, placement) per rollout worker.

    Keyword Args:
        round_bytes: Capacity of each worker's round buffer (trainer send buffer, rollout receive
            buffer). Overlaps larger than a round are cut into runs of whole innermost rows.

    Returns:
        A `TransferPlan`.

    Raises:
        ValueError: empty meshes, malformed entries, a node used by both sides, or round_bytes
            smaller than one innermost row of some needed tensor.
        LayoutError: a rollout needs elements no trainer holds, or dtypes disagree.
    """
    trainer_maps, trainer_places = _unpack(trainers, "trainers")
    rollout_maps, rollout_places = _unpack(rollouts, "rollouts")
    if not isinstance(round_bytes, (int, np.integer)) or round_bytes < 1:
        raise ValueError(f"round_bytes must be a positive int (bytes per round buffer), got "
                         f"{round_bytes!r}")
    shared = sorted({p.node for p in trainer_places} & {p.node for p in rollout_places})
    if shared:
        raise ValueError(f"nodes {shared[:5]} host both trainer and rollout workers; the planner "
                         f"routes between disjoint trainer and rollout nodes, so give each side "
                         f"its own node names (one name per physical host)")
    corr = correspond(trainer_maps, rollout_maps)
    tables = route(corr, _node_ids(trainer_places), _node_ids(rollout_places),
                   round_bytes=int(round_bytes))
    return TransferPlan(correspondence=corr, trainer_maps=tuple(trainer_maps),
                        rollout_maps=tuple(rollout_maps), trainers=tuple(trainer_places),
                        rollouts=tuple(rollout_places), round_bytes=int(round_bytes),
                        tables=tables)


def _unpack(workers, side: str) -> tuple[list[SourceMap], list[Placement]]:
    workers = list(workers)
    if not workers:
        raise ValueError(f"{side} is empty; pass one (SourceMap, Placement) per {side[:-1]} "
                         f"worker")
    maps, places = [], []
    for i, entry in enumerate(workers):
        if (not isinstance(entry, tuple) or len(entry) != 2
                or not isinstance(entry[0], SourceMap) or not isinstance(entry[1], Placement)):
            raise ValueError(f"{side}[{i}] is {type(entry).__name__}, expected a "
                             f"(SourceMap, Placement) tuple")
        maps.append(entry[0])
        places.append(entry[1])
    return maps, places


def _node_ids(places: list[Placement]) -> list[int]:
    ids: dict[str, int] = {}
    return [ids.setdefault(p.node, len(ids)) for p in places]


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class TransferPlan:
    """Rounds of three stages, with per-worker views and byte accounting.

    Workers are numbered trainers first, then rollouts, in `tables`; the public methods take
    and return `WorkerId`s. Rounds and per-worker views are materialized on demand from the
    tables, which stay small at the paper's scale (hundreds of thousands of rows).
    """

    correspondence: Correspondence
    """What moves: a partition of the needed elements."""
    trainer_maps: tuple[SourceMap, ...]
    """Source maps of the trainer workers, in input order."""
    rollout_maps: tuple[SourceMap, ...]
    """Source maps of the rollout workers, in input order."""
    trainers: tuple[Placement, ...]
    """Placements of the trainer workers."""
    rollouts: tuple[Placement, ...]
    """Placements of the rollout workers."""
    round_bytes: int
    """Capacity of each worker's round buffer."""
    tables: RouteTables
    """The plan as numpy columns (see `plan_route.RouteTables`)."""

    @property
    def num_rounds(self) -> int:
        return self.tables.num_rounds

    @property
    def workers(self) -> tuple[WorkerId, ...]:
        """Every worker, trainers first: position = worker number in `tables`."""
        return (tuple(WorkerId("trainer", i) for i in range(len(self.trainers)))
                + tuple(WorkerId("rollout", i) for i in range(len(self.rollouts))))

    def placement(self, worker: WorkerId) -> Placement:
        return (self.trainers if worker.side == "trainer" else self.rollouts)[worker.index]

    def number(self, worker: WorkerId) -> int:
        """Worker number in `tables`."""
        if worker.side == "trainer" and 0 <= worker.index < len(self.trainers):
            return worker.index
        if worker.side == "rollout" and 0 <= worker.index < len(self.rollouts):
            return len(self.trainers) + worker.index
        raise ValueError(f"{worker!r} is not a worker of this plan ({len(self.trainers)} "
                         f"trainers, {len(self.rollouts)} rollouts)")

    # -- bytes ----------------------------------------------------------------------------------

    def stage_bytes(self) -> "StageBytes":
        """Bytes each worker sends and receives in each stage, labelled (`StageBytes`); it
        still unpacks as ``sent, received = plan.stage_bytes()``."""
        t = self.tables
        n = len(self.trainers) + len(self.rollouts)
        nbytes = t.real_bytes.astype(np.float64)
        sent = np.bincount(t.src * 3 + t.stage, weights=nbytes, minlength=n * 3)
        recv = np.bincount(t.dst * 3 + t.stage, weights=nbytes, minlength=n * 3)
        return StageBytes(self.workers, sent.reshape(n, 3).astype(np.int64),
                          recv.reshape(n, 3).astype(np.int64))

    def sent_bytes(self, worker: WorkerId, stage: Stage | None = None) -> int:
        """Bytes a worker sends, in one stage or all."""
        row = self.stage_bytes()[0][self.number(worker)]
        return int(row.sum() if stage is None else row[STAGES.index(stage)])

    def received_bytes(self, worker: WorkerId, stage: Stage | None = None) -> int:
        """Bytes a worker receives, in one stage or all."""
        row = self.stage_bytes()[1][self.number(worker)]
        return int(row.sum() if stage is None else row[STAGES.index(stage)])

    # -- rounds ---------------------------------------------------------------------------------

    def chunks(self, seg: int) -> tuple[Chunk, ...]:
        """The overlap runs of one segment, in buffer order."""
        return tuple(c for c, _ in self.placed_chunks(seg))

    def placed_chunks(self, seg: int) -> tuple[tuple[Chunk, int], ...]:
        """The overlap runs of one segment with their byte offsets from the segment's start."""
        t = self.tables
        g, start, nbytes = int(t.seg_group[seg]), int(t.seg_start[seg]), int(t.seg_bytes[seg])
        members, starts = t.group_overlaps[g], t.group_starts[g]
        i = int(np.searchsorted(starts, start, side="right")) - 1
        out = []
        overlaps = self.correspondence.overlaps
        stop = start + nbytes
        while i < len(members) and starts[i] < stop:
            o = int(members[i])
            size = dtype_itemsize(overlaps[o].dtype)
            lo = max(start - int(starts[i]), 0)
            hi = min(stop - int(starts[i]), overlaps[o].nbytes)
            if hi > lo:  # a range can hold only an overlap's ALIGN padding
                out.append((Chunk(o, lo // size, (hi - lo) // size), int(starts[i]) + lo - start))
            i += 1
        return tuple(out)

    @property
    def rounds(self) -> tuple[Round, ...]:
        """Every round's writes (built on demand: slow for paper-scale plans, fine for tests)."""
        t = self.tables
        rnd = t.round
        nbytes = t.nbytes
        order = np.lexsort((t.src_offset, t.dst, t.src, t.stage, rnd))
        workers = self.workers
        rounds: list[list[Transfer]] = [[] for _ in range(self.num_rounds)]
        current = None
        for d in order.tolist():
            key = (int(rnd[d]), int(t.stage[d]), int(t.src[d]), int(t.dst[d]))
            so, do, nb = int(t.src_offset[d]), int(t.dst_offset[d]), int(nbytes[d])
            if (current is not None and current[0] == key and current[1] + current[3] == so
                    and current[2] + current[3] == do):
                current[3] += nb
                current[4].extend(self.chunks(int(t.seg[d])))
                continue
            if current is not None:
                rounds[current[0][0]].append(_transfer(current, workers))
            current = [key, so, do, nb, list(self.chunks(int(t.seg[d])))]
        if current is not None:
            rounds[current[0][0]].append(_transfer(current, workers))
        return tuple(Round(i, tuple(ts)) for i, ts in enumerate(rounds))

    def for_worker(self, worker: WorkerId) -> WorkerPlan:
        """The per-worker view an executor builds its copy tables and buffers from."""
        from weightbridge.planning.worker_plans import worker_plan

        return worker_plan(self, worker)

    def worker_plans(self, workers: Sequence[WorkerId] | None = None
                     ) -> dict[WorkerId, WorkerPlan]:
        """``for_worker`` of every worker (or of ``workers``), built together: sorting, merging
        and the copies of replicas shared, so all of them cost about what planning did."""
        from weightbridge.planning.worker_plans import worker_plans

        return worker_plans(self, workers)

    def worker_summary(self, max_rows: int = 16) -> str:
        """One line per worker: its node and the MB it sends and receives in each stage."""
        sent, recv = self.stage_bytes()
        lines = ["  per worker (MB sent / received: receive, external, internal)"]
        for i, w in enumerate(self.workers[:max_rows]):
            cells = "  ".join(f"{s / 1e6:7.3f}/{r / 1e6:7.3f}" for s, r in zip(sent[i], recv[i]))
            lines.append(f"    {str(w):>5} {self.placement(w).node:<14} {cells}")
        if len(self.workers) > max_rows:
            lines.append(f"    ... {len(self.workers) - max_rows} more workers")
        return "\n".join(lines)

    def summary(self) -> str:
        """A few readable lines: sizes, rounds, and per-stage traffic with balance."""
        sent, recv = self.stage_bytes()
        T = len(self.trainers)
        total = self.correspondence.nbytes
        lines = [
            f"TransferPlan: {T} trainers on {len({p.node for p in self.trainers})} nodes -> "
            f"{len(self.rollouts)} rollouts on {len({p.node for p in self.rollouts})} nodes, "
            f"{len(self.correspondence.overlaps):,} overlaps, {_gb(total)} unique needed",
            f"  {self.num_rounds} rounds of <= {_gb(self.round_bytes)} per worker buffer, "
            f"{len(self.tables.seg_bytes):,} segments, {len(self.tables.stage):,} writes",
        ]
        for s, stage in enumerate(STAGES):
            senders = sent[:T, s] if stage is Stage.RECEIVE else sent[T:, s]
            active = senders[senders > 0]
            balance = (f", sender max/mean {active.max() / active.mean():.3f}"
                       if len(active) else "")
            lines.append(f"  {stage.value:>8}: {_gb(int(sent[:, s].sum()))} sent by "
                         f"{len(active)} workers{balance}")
        quantized = [o for o in self.correspondence.overlaps if o.block]
        if quantized:
            values = sum(o.nbytes for o in quantized if o.dtype == QUANT_DTYPE)
            scales = sum(o.nbytes for o in quantized if o.dtype != QUANT_DTYPE)
            tensors = {o.region.tensor for o in quantized if o.dtype == QUANT_DTYPE}
            blocks = sorted({o.block for o in quantized})
            lines.append(f"  block fp8: {len(tensors)} tensors quantized in the trainers' pack "
                         f"(blocks {', '.join('x'.join(map(str, b)) for b in blocks)}): "
                         f"{_gb(values)} {QUANT_DTYPE} + {_gb(scales)} {SCALE_DTYPE} scales, "
                         f"each block whole on one sender (none sent unquantized)")
        return "\n".join(lines)


def _transfer(current, workers) -> Transfer:
    (_, stage, src, dst), so, do, nb, chunks = current
    return Transfer(stage=STAGES[stage], src=workers[src], dst=workers[dst], src_offset=so,
                    dst_offset=do, nbytes=nb, chunks=tuple(chunks))


def _gb(n: int) -> str:
    return f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.3f} MB"
