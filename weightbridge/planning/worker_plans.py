"""One worker's view of a plan: copy descriptors and writes per round, built once per plan.

Inside buffers, bytes are in canonical checkpoint order: a run of an overlap's elements,
row-major, in the overlap's wire dtype; a box between a parameter of another dtype and the
buffer carries ``buffer_dtype``, so that worker's single pack (or assemble) launch converts;
a sender's box of a block-quantized overlap is whole blocks and carries its ``block`` (its pack
quantizes). A sender packs with its own pieces' strides and a receiver assembles with its own,
so transposes, fusions, padding and reversals on either side are just strides of a `BoxCopy`.

Typical usage (an executor at connect)::

    wplan = plan.for_worker(WorkerId("trainer", 3))
    tables = [kernels.build_table(r.pack, params) for r in wplan.rounds]
"""

from __future__ import annotations

import math

import numpy as np

from weightbridge.gc_pause import with_gc_paused
from weightbridge.planning.box_copies import BOX_FIELDS, Copies, concat_ranges
from weightbridge.planning.route import RECEIVE, STAGES
from weightbridge.types import BoxCopy, BufferWrite, WorkerId, WorkerPlan, WorkerRound
from weightbridge.types.build import instances


def worker_plan(plan, worker: WorkerId) -> WorkerPlan:
    """Build `WorkerPlan` for one worker of ``plan`` (a `TransferPlan`)."""
    return worker_plans(plan, [worker])[worker]


@with_gc_paused  # (millions of small acyclic objects: `weightbridge.gc_pause`)
def worker_plans(plan, workers=None) -> dict[WorkerId, WorkerPlan]:
    """The `WorkerPlan` of every worker of ``plan`` (or of ``workers``), built together.

    The work is shared: the plan's columns are sorted once per side (rows a worker writes,
    rows written into it), contiguous writes are merged for all workers at once, and the
    copies of a segment are built once per source map, then shifted to each distinct buffer
    offset a worker of that map holds it at (replicas share theirs). Boxes and writes are made
    in one pass each, then put in plan order, so that each (worker, round) takes a slice. Same
    result as one `worker_plan` per worker.
    """
    t = plan.tables
    workers = list(plan.workers if workers is None else workers)
    numbers = [plan.number(w) for w in workers]
    rnd = t.round
    num_workers, num_rounds = len(plan.workers), plan.num_rounds
    rows = np.arange(len(t.seg))
    if len(numbers) < num_workers:  # only the rows these workers write or receive
        mine = np.zeros(num_workers, dtype=bool)
        mine[numbers] = True
        rows = np.flatnonzero(mine[t.src] | mine[t.dst])
    # Rows each worker writes, in its order: round, stage, peer, peer offset (then row).
    src, dst = t.src[rows], t.dst[rows]
    step = (rnd[rows] * len(STAGES) + t.stage[rows]).astype(np.int64)
    steps = num_rounds * len(STAGES)
    peer_offset = t.dst_offset[rows]
    by_src = rows[_order([(src.astype(np.int64) * steps + step) * num_workers + dst,
                          peer_offset], [num_workers * steps * num_workers])]
    # Rows written into each worker, in the same order (the peer is the worker itself).
    by_dst = rows[_order([dst.astype(np.int64) * steps + step, peer_offset],
                         [num_workers * steps])]
    if len(numbers) < num_workers:  # (then only these workers' own writes and assembles)
        by_src, into = by_src[mine[t.src[by_src]]], by_dst[mine[t.dst[by_dst]]]
    else:
        into = by_dst
    packed = by_src[t.stage[by_src] == RECEIVE]
    boxes, (pack_at, pack_n), (asm_at, asm_n) = _all_copies(plan, packed, into)
    writes, write_rows = _all_writes(plan, by_src)
    # Every worker's boxes in plan order, one tuple per side (a row's boxes, rows in
    # order); a (worker, round) takes a slice of it, and of the writes.
    pack, pack_cuts = _in_order(boxes, t.src[packed], rnd[packed], pack_at, pack_n,
                                num_workers, num_rounds)
    assemble, asm_cuts = _in_order(boxes, t.dst[into], rnd[into], asm_at, asm_n,
                                   num_workers, num_rounds)
    writes = tuple(writes)
    write_cuts = _cuts(t.src[write_rows], rnd[write_rows], num_workers, num_rounds)
    repeated = _repeated_rounds(t.src[packed], rnd[packed], t.seg[packed], num_rounds,
                                len(t.seg_bytes))
    out = {}
    for worker, me in zip(workers, numbers):
        smap = (plan.trainer_maps if worker.side == "trainer" else plan.rollout_maps)[
            worker.index]
        send, recv = t.send_bytes[me], t.recv_bytes[me]
        at = me * num_rounds
        rounds = []
        for r, s, v in zip(range(num_rounds), send.tolist(), recv.tolist()):
            i = at + r
            packs = pack[pack_cuts[i]:pack_cuts[i + 1]]
            # A segment written to several receivers in one round (a P2P plan: no
            # forwarding) is packed once; WeightBridge's plans write each segment once.
            if (me, r) in repeated:
                packs = tuple(dict.fromkeys(packs))
            rounds.append(WorkerRound(
                index=r, pack=packs,
                writes=writes[write_cuts[i]:write_cuts[i + 1]],
                assemble=assemble[asm_cuts[i]:asm_cuts[i + 1]], send_bytes=s, recv_bytes=v))
        out[worker] = WorkerPlan(
            worker=worker, placement=plan.placement(worker), params=smap.params,
            buffer_bytes=int(max(send.max(initial=0), recv.max(initial=0))),
            rounds=tuple(rounds))
    return out


def _all_copies(plan, packed: np.ndarray, by_dst: np.ndarray):
    """(boxes, (first box, box count) of each packed row, the same of each row written into its
    receiver): the boxes of one run per distinct (source map, segment, buffer offset)."""
    t = plan.tables
    sides = list(plan.trainer_maps) + list(plan.rollout_maps)
    ids: dict[int, int] = {}
    maps = []
    for smap in sides:
        if id(smap) not in ids:
            ids[id(smap)] = len(maps)
            maps.append(smap)
    # A trainer's and a rollout's copies differ (one piece, or all) even for one map object.
    num_trainers = len(plan.trainers)
    worker_map = np.array([ids[id(m)] * 2 + (k >= num_trainers) for k, m in enumerate(sides)],
                          dtype=np.int64)
    m = np.concatenate([worker_map[t.src[packed]], worker_map[t.dst[by_dst]]])
    seg = np.concatenate([t.seg[packed], t.seg[by_dst]])
    off = np.concatenate([t.src_offset[packed], t.dst_offset[by_dst]])
    keys = np.stack([m, seg, off])
    order = _order(list(keys), [len(maps) * 2, len(t.seg_bytes)])
    new = np.ones(len(order), dtype=bool)
    if len(order) > 1:
        new[1:] = (np.diff(keys[:, order], axis=1) != 0).any(0)
    run_of = np.empty(len(order), dtype=np.int64)
    run_of[order] = np.cumsum(new) - 1
    firsts = order[new]  # one row per run, runs sorted by (map, segment, offset)
    fm, fs, fo = m[firsts], seg[firsts], off[firsts]
    # Runs of one (map, segment) differ only by their offsets: its copies are built once, at
    # its first offset, and shifted for the others.
    head = np.ones(len(firsts), dtype=bool)
    head[1:] = (fm[1:] != fm[:-1]) | (fs[1:] != fs[:-1])
    group = np.cumsum(head) - 1
    # The built copies, map by map (runs are sorted by map), then every run's boxes made at
    # once from their fields: a shifted run takes its group's fields, offsets moved.
    needed = np.zeros(len(t.seg_bytes), dtype=bool)
    needed[seg] = True
    copies = Copies(plan, needed)
    hm, hs, ho = fm[head], fs[head], fo[head]
    sizes = np.concatenate([np.zeros(0, dtype=np.int64)] + [
        copies.build(maps[int(hm[lo]) // 2], bool(hm[lo] % 2), hs[lo:hi], ho[lo:hi])
        for lo, hi in _bounds(hm)])
    count = sizes[group]
    at = np.cumsum(sizes) - sizes  # each group's first built box
    index = concat_ranges(at[group], count)
    shifts = np.repeat(fo - fo[head][group], count)
    columns = [np.concatenate(c) for c in zip(*copies.parts)] if copies.parts else [
        np.zeros(0, dtype=np.int64)] * len(BOX_FIELDS)
    # Every field gathered as built but buffer_offset, which a shifted run moves.
    boxes = instances(BoxCopy, len(index), [
        (c[index] + shifts if f == "buffer_offset" else c[index]).tolist()
        for f, c in zip(BOX_FIELDS, columns)])
    at = np.cumsum(count) - count  # each run's first box
    row_at, row_n = at[run_of], count[run_of]
    return (boxes, (row_at[:len(packed)], row_n[:len(packed)]),
            (row_at[len(packed):], row_n[len(packed):]))


def _order(keys: list[np.ndarray], bounds: list[int]) -> np.ndarray:
    """The stable order sorting rows by ``keys`` (most significant first, non-negative; every
    key but the last below its bound): one argsort of the keys folded into one int64 where
    they fit (several times faster than lexsort's pass per key), else lexsort."""
    last = int(keys[-1].max(initial=0)) + 1
    if math.prod(bounds) * last < 1 << 62:
        folded = keys[0].astype(np.int64)
        for key, bound in zip(keys[1:], bounds[1:] + [last]):
            folded = folded * bound + key
        return np.argsort(folded, kind="stable")
    return np.lexsort(keys[::-1])


def _bounds(values: np.ndarray) -> list[tuple[int, int]]:
    """(start, stop) of each run of equal values in ``values``."""
    edges = np.flatnonzero(np.diff(values)) + 1
    cuts = [0, *edges.tolist(), len(values)]
    return list(zip(cuts[:-1], cuts[1:])) if len(values) else []


def _cuts(worker: np.ndarray, rounds: np.ndarray, num_workers: int, num_rounds: int
          ) -> list[int]:
    """[W * R + 1] bounds of each (worker, round)'s rows, the rows sorted by worker, round."""
    return np.searchsorted(worker.astype(np.int64) * num_rounds + rounds,
                           np.arange(num_workers * num_rounds + 1)).tolist()


def _in_order(boxes: list, worker, rounds, at: np.ndarray, n: np.ndarray, num_workers: int,
              num_rounds: int) -> tuple[tuple, list[int]]:
    """The boxes of rows sorted by worker, round (row ``i`` has ``boxes[at[i]:at[i] + n[i]]``),
    in row order, and the [W * R + 1] bounds of each (worker, round)'s boxes in them."""
    ordered = tuple(map(boxes.__getitem__, concat_ranges(at, n).tolist()))
    bounds = np.concatenate(([0], np.cumsum(n)))[_cuts(worker, rounds, num_workers, num_rounds)]
    return ordered, bounds.tolist()


def _repeated_rounds(workers: np.ndarray, rounds: np.ndarray, segs: np.ndarray,
                     num_rounds: int, num_segments: int) -> set[tuple[int, int]]:
    """(worker, round) pairs in which a worker packs one segment more than once (a P2P plan)."""
    if not len(rounds):
        return set()
    key = (workers.astype(np.int64) * num_rounds + rounds) * num_segments + segs
    uniq, counts = np.unique(key, return_counts=True)
    pairs = uniq[counts > 1] // num_segments
    return set(zip((pairs // num_rounds).tolist(), (pairs % num_rounds).tolist()))


def _all_writes(plan, by_src: np.ndarray) -> tuple[list[BufferWrite], np.ndarray]:
    """Every worker's writes (in ``by_src`` order) and each one's first row: consecutive rows
    of one writer, round, stage and peer whose ranges continue each other on both sides are
    merged into one write."""
    t = plan.tables
    src, dst, stage = t.src[by_src], t.dst[by_src], t.stage[by_src]
    r, so, do = t.round[by_src], t.src_offset[by_src], t.dst_offset[by_src]
    nb = t.nbytes[by_src]
    cont = ((src[1:] == src[:-1]) & (r[1:] == r[:-1]) & (stage[1:] == stage[:-1])
            & (dst[1:] == dst[:-1]) & (so[1:] == so[:-1] + nb[:-1])
            & (do[1:] == do[:-1] + nb[:-1]))
    starts = np.flatnonzero(np.concatenate([[True], ~cont])) if len(src) else np.zeros(0, int)
    sums = np.add.reduceat(nb, starts) if len(starts) else np.zeros(0, np.int64)
    workers = plan.workers
    writes = instances(BufferWrite, len(starts), [
        map(STAGES.__getitem__, stage[starts].tolist()),
        map(workers.__getitem__, dst[starts].tolist()), so[starts].tolist(),
        do[starts].tolist(), sums.tolist()])
    return writes, by_src[starts]
