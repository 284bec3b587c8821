"""Routing: who sends which bytes to whom in which round and stage, as flat numpy tables.

The unit of work is a *group*: the overlaps with the same holders and the same needers, laid end
to end as one byte stream in checkpoint order. Streams are cut, never per-element:

1. rounds: a group larger than a round's share is spread evenly over all rounds (part k in
   round k); smaller groups go whole to the round where their workers are least loaded;
2. trainers: inside a round, each part is water-filled over its holders (least-loaded first),
   so replicated data splits evenly and trainers collectively send it once;
3. landing: each piece of a part lands on one needer of one needing node, water-filled over
   nodes by the landing worker's forwarding (egress) load, so forwarders are balanced too;
4. the landing worker forwards the piece to one needer on each other needing node (EXTERNAL),
   the least-loaded by ingress; the piece's holder on each node copies it to the node's other
   needers (INTERNAL).

Cuts fall on unit boundaries (one innermost row of an overlap; one element for 1-d; one row of
whole blocks for block-quantized values), so each cut piece is a run of whole rows in row-major
order.

Typical usage (internal; `plan_transfer` calls it)::

    tables = route(corr, trainer_nodes, rollout_nodes, round_bytes=1 << 30)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from weightbridge.types import QUANT_DTYPE, Correspondence, Overlap, Stage, dtype_itemsize

RECEIVE, EXTERNAL, INTERNAL = 0, 1, 2
ALIGN = 8
"""Byte alignment of every overlap and cut inside a buffer (the largest common itemsize)."""
STAGES = (Stage.RECEIVE, Stage.EXTERNAL, Stage.INTERNAL)


@dataclass(frozen=True, slots=True, eq=False)
class RouteTables:
    """The plan as columns. Workers are numbered trainers first, then rollouts.

    Segments are byte ranges of a group's stream; deliveries move one segment from one worker's
    buffer to one rollout's receive buffer.
    """

    num_rounds: int
    group_overlaps: tuple[np.ndarray, ...]   # per group: overlap indices, stream order
    group_starts: tuple[np.ndarray, ...]     # per group: stream byte offset of each overlap
    seg_group: np.ndarray                    # [S]
    seg_start: np.ndarray                    # [S] byte offset in the group stream
    seg_bytes: np.ndarray                    # [S] buffer bytes (ALIGN-padded overlaps)
    seg_real: np.ndarray                     # [S] element bytes (no padding)
    seg_round: np.ndarray                    # [S]
    stage: np.ndarray                        # [D]
    src: np.ndarray                          # [D] worker number
    dst: np.ndarray                          # [D] worker number (a rollout)
    seg: np.ndarray                          # [D]
    src_offset: np.ndarray                   # [D] byte offset in the src's round buffer
    dst_offset: np.ndarray                   # [D] byte offset in the dst's receive buffer
    send_bytes: np.ndarray                   # [W, R] trainer send buffer use per round
    recv_bytes: np.ndarray                   # [W, R] rollout receive buffer use per round

    @property
    def round(self) -> np.ndarray:
        """[D] round of each delivery."""
        return self.seg_round[self.seg]

    @property
    def nbytes(self) -> np.ndarray:
        """[D] buffer bytes each delivery writes (padding included)."""
        return self.seg_bytes[self.seg]

    @property
    def real_bytes(self) -> np.ndarray:
        """[D] element bytes each delivery carries (padding excluded)."""
        return self.seg_real[self.seg]


def route(corr: Correspondence, trainer_nodes: list[int], rollout_nodes: list[int], *,
          round_bytes: int) -> RouteTables:
    """Route every overlap; the smallest round count (from the byte lower bound up) that fits."""
    sizes = np.array([o.nbytes for o in corr.overlaps], dtype=np.int64)
    rows = [_unit_elems(o) * dtype_itemsize(o.dtype) for o in corr.overlaps]
    # A unit is the fewest whole innermost rows filling a multiple of ALIGN bytes (capped at the
    # overlap), so every cut keeps every chunk in a buffer ALIGN-aligned for any dtype view.
    units = np.array([min(r * ALIGN // math.gcd(r, ALIGN), _pad(int(n)))
                      for r, n in zip(rows, sizes)], dtype=np.int64)
    if len(units) and units.max() > round_bytes:
        worst = corr.overlaps[int(units.argmax())]
        raise ValueError(f"round_bytes={round_bytes:,} is smaller than the smallest piece of "
                         f"{worst.region.tensor!r} the planner moves ({int(units.max()):,} bytes: "
                         f"whole innermost rows, a multiple of {ALIGN} bytes); use round_bytes >= "
                         f"{int(units.max()):,}")
    groups = _groups(corr)
    need = np.zeros(len(rollout_nodes), dtype=np.int64)
    est = np.zeros(len(trainer_nodes))
    for holders, needers, members in groups:
        b = sizes[members].sum()
        need[list(needers)] += b
        est[list(holders)] += b / len(holders)
    lower = max(int(need.max(initial=0)), int(math.ceil(est.max(initial=0))))
    num_rounds = max(1, math.ceil(lower / (0.97 * round_bytes))) if len(sizes) else 0
    router = _Router(corr, groups, sizes, units, trainer_nodes, rollout_nodes, round_bytes)
    for _ in range(60):
        tables = router.run(num_rounds)
        if tables is not None:
            return tables
        num_rounds = max(num_rounds + 1, math.ceil(num_rounds * 1.08))
    raise AssertionError("routing did not fit round_bytes after 60 attempts")  # pragma: no cover


def _pad(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _unit_elems(overlap: Overlap) -> int:
    """Elements of the smallest piece the planner cuts an overlap into: one innermost row; for
    block-quantized values one row of whole blocks (the pack quantizes a block whole, so every
    block stays with one sender in one round)."""
    count = overlap.region.count
    if overlap.block and overlap.dtype == QUANT_DTYPE:
        return min(overlap.block[0], count[0]) * count[-1]
    return count[-1] if len(count) >= 2 else 1


def _groups(corr: Correspondence) -> list[tuple[tuple[int, ...], tuple[int, ...], np.ndarray]]:
    by_key: dict[tuple[tuple[int, ...], tuple[int, ...]], list[int]] = {}
    for i, o in enumerate(corr.overlaps):
        by_key.setdefault((o.holders, o.needers), []).append(i)
    return [(h, n, np.array(m, dtype=np.int64)) for (h, n), m in by_key.items()]


class _Router:
    """One routing attempt per round count; state is rebuilt by `run`."""

    def __init__(self, corr, groups, sizes, units, trainer_nodes, rollout_nodes, round_bytes):
        self.groups = groups
        self.sizes, self.units = sizes, units
        self.num_trainers = len(trainer_nodes)
        self.num_workers = len(trainer_nodes) + len(rollout_nodes)
        self.round_bytes = round_bytes
        self.rollout_nodes = rollout_nodes
        self.padded = -(-sizes // ALIGN) * ALIGN
        self.group_starts = tuple(np.concatenate(([0], np.cumsum(self.padded[m])[:-1]))
                                  for _, _, m in groups)
        self.group_bytes = np.array([self.padded[m].sum() for _, _, m in groups],
                                    dtype=np.int64)
        # Per group: needing nodes and, per node, its needers (as rollout indices).
        T = len(trainer_nodes)
        self.group_nodes = []
        for _, needers, _ in groups:
            per_node: dict[int, list[int]] = {}
            for w in needers:
                per_node.setdefault(rollout_nodes[w], []).append(T + w)
            self.group_nodes.append([(node, ws, np.array(ws)) for node, ws in
                                     sorted(per_node.items())])

    # -- step 1: parts and their rounds ---------------------------------------------------------

    def _parts(self, num_rounds: int) -> list[list[tuple[int, int, int]]] | None:
        """Per round: (group, start byte, stop byte) parts; None if a receive buffer overflows."""
        per_round: list[list[tuple[int, int, int]]] = [[] for _ in range(num_rounds)]
        load = np.zeros((num_rounds, self.num_workers))
        small = []
        for g, (holders, needers, _) in enumerate(self.groups):
            b = int(self.group_bytes[g])
            # Parts of round_bytes / 64 keep every worker's rounds even; data many workers need
            # gets coarser parts, since every cut costs a write per needer.
            part_min = max(1, self.round_bytes // 64) * max(1, len(needers) // 8)
            num_parts = min(num_rounds, max(1, b // part_min))
            cuts = self._snap(g, [b * k // num_parts for k in range(num_parts + 1)])
            workers = np.array(list(holders) + [self.num_trainers + w for w in needers])
            for k in range(num_parts):
                if cuts[k + 1] <= cuts[k]:
                    continue
                if num_parts == num_rounds:
                    per_round[k].append((g, cuts[k], cuts[k + 1]))
                    load[k, workers] += cuts[k + 1] - cuts[k]
                else:
                    small.append((cuts[k + 1] - cuts[k], g, cuts[k], cuts[k + 1], workers))
        # Largest first, each to the round whose busiest affected worker is least loaded.
        small.sort(key=lambda p: (-p[0], p[1], p[2]))
        for nbytes, g, lo, hi, workers in small:
            r = int(np.argmin(load[:, workers].max(axis=1)))
            load[r, workers] += nbytes
            per_round[r].append((g, lo, hi))
        # Every needer receives every part of its groups: rollout buffers are known already.
        fits = load[:, self.num_trainers:].max(initial=0) <= self.round_bytes
        return per_round if fits else None

    def _snap(self, g: int, positions: list[int]) -> list[int]:
        """Move stream byte positions to the nearest unit boundary of the overlap they fall in."""
        starts = self.group_starts[g]
        members = self.groups[g][2]
        pos = np.array(positions, dtype=np.int64)
        i = np.searchsorted(starts, pos, side="right") - 1
        unit = self.units[members[i]]
        off = pos - starts[i]
        snapped = (off + unit // 2) // unit * unit
        # A cut past the last whole unit moves to the padded end: the tail goes with it.
        snapped = np.where(snapped >= self.sizes[members[i]], self.padded[members[i]], snapped)
        snapped = starts[i] + snapped
        snapped[0], snapped[-1] = positions[0], positions[-1]
        return np.maximum.accumulate(snapped).tolist()

    # -- steps 2-4: inside a round --------------------------------------------------------------

    def run(self, num_rounds: int) -> RouteTables | None:
        segs: list[tuple[int, int, int, int]] = []   # group, start, bytes, round
        dels: list[tuple[int, int, int, int]] = []   # stage, src, dst, seg
        per_round = self._parts(num_rounds)
        if per_round is None:
            return None
        self.total_out = np.zeros(self.num_workers)
        self.total_in = np.zeros(self.num_workers)
        self.total_nvl = np.zeros(self.num_workers)
        for r, parts in enumerate(per_round):
            self._route_round(r, parts, segs, dels)
        return _layout(self, num_rounds, segs, dels)

    def _route_round(self, r, parts, segs, dels) -> None:
        # Loads of this round, seeded with a trace of the plan so far: ties between equally
        # loaded workers go to whoever did less in earlier rounds, so roles rotate.
        out = self.total_out * 1e-6           # inter-node egress
        inn = self.total_in * 1e-6            # inter-node ingress
        nvl = self.total_nvl * 1e-6           # NVLink egress
        parts = sorted(parts, key=lambda p: (-(p[2] - p[1]), p[0], p[1]))
        for g, lo, hi in parts:
            holders = self.groups[g][0]
            nodes = self.group_nodes[g]
            fan = len(nodes) - 1
            trainer_cuts = self._fill(g, lo, hi, holders, out, 1.0)
            # One landing candidate per needing node: its needer that forwards least so far.
            # Inside a single node the candidate that sends least over NVLink (and receives
            # least) lands it, so a node's replicas take turns fanning data out.
            spread = max(len(ws) for _, ws, _ in nodes)
            if spread > 1 and hi - lo >= len(nodes) * spread * self.round_bytes // 64:
                # Counterpart slices: slice (v, j) lands on needer j of node v, and needer j of
                # every other node takes it in, so each GPU's NIC carries 1 / spread of the part.
                num = len(nodes) * spread
                cuts = self._snap(g, [lo + (hi - lo) * k // num for k in range(num + 1)])
                land_cuts = [(cuts[k], (k // spread, (k + r) % spread)) for k in range(num)]
            else:
                key = (out if fan else inn) + nvl / 8
                land = [ws[0] if len(ws) == 1 else int(arr[np.argmin(key[arr])])
                        for _, ws, arr in nodes]
                land_cuts = self._fill(g, lo, hi, land, key, float(max(fan, 1)))
            bounds = sorted({b for b, _ in trainer_cuts} | {b for b, _ in land_cuts} | {hi})
            for a, b in zip(bounds[:-1], bounds[1:]):
                t = _owner(trainer_cuts, a)
                lw = _owner(land_cuts, a)
                slot = None
                if isinstance(lw, tuple):  # counterpart slice
                    v, slot = lw
                    ws = nodes[v][1]
                    lw = ws[slot % len(ws)]
                if b <= a:
                    continue
                seg = len(segs)
                size = b - a
                segs.append((g, a, size, r))
                out[t] += size
                dels.append((RECEIVE, t, lw, seg))
                inn[lw] += size
                out[lw] += size * fan
                for _, ws, arr in nodes:
                    if len(ws) == 1:
                        first = ws[0]
                        if first != lw:
                            inn[first] += size
                            dels.append((EXTERNAL, lw, first, seg))
                        continue
                    if lw in ws:
                        first = lw
                    else:
                        first = (ws[slot % len(ws)] if slot is not None
                                 else int(arr[np.argmin(inn[arr] + nvl[arr] / 8)]))
                        inn[first] += size
                        dels.append((EXTERNAL, lw, first, seg))
                    nvl[first] += size * (len(ws) - 1)
                    dels.extend((INTERNAL, first, w, seg) for w in ws if w != first)
        self.total_out += out
        self.total_in += inn
        self.total_nvl += nvl

    def _fill(self, g, lo, hi, options, load, weight) -> list[tuple[int, int]]:
        """Split stream range [lo, hi) over options by water-filling ``load``; (start, option)."""
        nbytes = hi - lo
        if len(options) == 1:
            return [(lo, options[0])]
        options = list(options)
        loads = load[options]
        low = np.partition(loads, 1)[:2]
        if low[0] + nbytes * weight <= low[1]:  # the least loaded stays least loaded: no cut
            return [(lo, options[int(np.argmin(loads))])]
        members = self.groups[g][2]
        unit = int(self.units[members].max())
        min_piece = max(unit, min(self.round_bytes // 64, nbytes // (2 * len(options))))
        alloc = _waterfill(loads, nbytes * weight, min_piece * weight) / weight
        picked = [(o, a) for o, a in zip(options, alloc) if a > 0]
        if len(picked) == 1:
            return [(lo, picked[0][0])]
        cum = lo + np.cumsum([a for _, a in picked])[:-1]
        cuts = self._snap(g, [lo] + [int(round(c)) for c in cum] + [hi])[:-1]
        return [(c, o) for c, (o, _) in zip(cuts, picked)]


def _owner(cuts: list[tuple[int, int]], pos: int) -> int:
    """The option whose range contains stream position ``pos`` (cuts sorted by start)."""
    owner = cuts[0][1]
    for start, option in cuts:
        if start > pos:
            break
        owner = option
    return owner


def _waterfill(loads: np.ndarray, amount: float, min_piece: float) -> np.ndarray:
    """Give ``amount`` to the least-loaded options until their loads meet; drop tiny shares."""
    n = len(loads)
    if amount < 2 * min_piece:
        alloc = np.zeros(n)
        alloc[int(np.argmin(loads))] = amount
        return alloc
    order = np.sort(loads)
    level = order[-1]
    for k in range(1, n + 1):
        level = (order[:k].sum() + amount) / k
        if k == n or level <= order[k]:
            break
    alloc = np.maximum(level - loads, 0.0)
    # At most amount // min_piece shares survive: the largest (ties to the lower index).
    keep = max(1, int(amount // min_piece))
    if np.count_nonzero(alloc) > keep:
        alloc[np.argsort(-alloc, kind="stable")[keep:]] = 0.0
    return alloc * (amount / alloc.sum())


def _layout(router: _Router, num_rounds: int, segs, dels) -> RouteTables | None:
    """Buffer offsets for every delivery; None when some buffer exceeds round_bytes."""
    W = router.num_workers
    seg_arr = np.array(segs, dtype=np.int64).reshape(-1, 4)
    del_arr = np.array(dels, dtype=np.int64).reshape(-1, 4)
    stage, src, dst, seg = del_arr.T
    nbytes = seg_arr[seg, 2]
    rnd = seg_arr[seg, 3]
    # Forwards read the forwarder's own receive buffer, where the segment landed (`held`).
    dst_offset, held = _receive_offsets(W, num_rounds, stage, src, dst, seg, rnd, nbytes)
    recv = np.bincount(dst * num_rounds + rnd, weights=nbytes, minlength=W * num_rounds)
    # Trainer send buffers: per (src, round), ordered by (dst, seg): the same order as the
    # receiver's, so each (trainer, receiver) pair is one contiguous write.
    is_send = stage == RECEIVE
    sidx = np.flatnonzero(is_send)
    order = sidx[np.lexsort((seg[sidx], dst[sidx], rnd[sidx], src[sidx]))]
    src_offset = held
    src_offset[sidx] = _offsets(order, src * num_rounds + rnd, nbytes)[sidx]
    send = np.bincount(src[sidx] * num_rounds + rnd[sidx], weights=nbytes[sidx],
                       minlength=W * num_rounds)
    if max(recv.max(initial=0), send.max(initial=0)) > router.round_bytes:
        return None
    return RouteTables(
        num_rounds=num_rounds,
        group_overlaps=tuple(m for _, _, m in router.groups),
        group_starts=router.group_starts,
        seg_group=seg_arr[:, 0], seg_start=seg_arr[:, 1], seg_bytes=seg_arr[:, 2],
        seg_round=seg_arr[:, 3], seg_real=_real_bytes(router, seg_arr),
        stage=stage, src=src, dst=dst, seg=seg, src_offset=src_offset, dst_offset=dst_offset,
        send_bytes=send.reshape(W, num_rounds).astype(np.int64),
        recv_bytes=recv.reshape(W, num_rounds).astype(np.int64))


def _receive_offsets(W: int, num_rounds: int, stage, src, dst, seg, rnd,
                     nbytes) -> tuple[np.ndarray, np.ndarray]:
    """Every delivery's offset in its receiver's buffer of its round, and each forward's
    offset in its forwarder's (where the segment landed; 0 for RECEIVE rows).

    Per (dst, round), by stage, then sender: all bytes from one sender in one stage are
    contiguous, so each (sender, stage) pair is one write. Within it, a trainer's segments go
    in segment order (its send buffer's order), a forwarder's in the order they sit in its own
    buffer: a forward of a contiguous part of that buffer is then one write, where segment
    order would cut it wherever the forwarder's senders interleave (648 more writes than the
    1008 (sender, receiver, stage, round) pairs of the 4-trainer-node cluster benchmark's
    update). Each stage reads the offsets of the one before, so stages are
    laid out in order."""
    bucket = dst * num_rounds + rnd
    dst_offset = np.zeros(len(stage), dtype=np.int64)
    held = np.zeros(len(stage), dtype=np.int64)
    laid = np.zeros(W * num_rounds, dtype=np.int64)  # bytes of earlier stages per bucket
    received = np.argsort(seg * W + dst, kind="stable")
    received_key = (seg * W + dst)[received]
    for s in (RECEIVE, EXTERNAL, INTERNAL):
        rows = np.flatnonzero(stage == s)
        if not len(rows):
            continue
        if s == RECEIVE:
            within = seg[rows]
        else:  # where the forwarder holds the segment (received in an earlier stage)
            at = np.searchsorted(received_key, seg[rows] * W + src[rows])
            within = held[rows] = dst_offset[received[at]]
        b = bucket[rows]
        dst_offset[rows] = _offsets(np.lexsort((within, src[rows], b)), b, nbytes[rows]) + laid[b]
        laid += np.bincount(b, weights=nbytes[rows], minlength=W * num_rounds).astype(np.int64)
    return dst_offset, held


def _offsets(order: np.ndarray, bucket: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """Exclusive running sum of ``nbytes`` along ``order``, restarting at each new bucket."""
    out = np.zeros(len(bucket), dtype=np.int64)
    if not len(order):
        return out
    b = bucket[order]
    n = nbytes[order]
    cum = np.cumsum(n) - n
    first = np.concatenate(([True], b[1:] != b[:-1]))
    base = np.maximum.accumulate(np.where(first, cum, 0))
    out[order] = cum - base
    return out


def _real_bytes(router: _Router, seg_arr: np.ndarray) -> np.ndarray:
    """Element bytes of each segment: its stream range minus the overlaps' ALIGN padding."""
    out = np.zeros(len(seg_arr), dtype=np.int64)
    if not len(seg_arr):  # nothing to move (a delta update of no tensor)
        return out
    order = np.argsort(seg_arr[:, 0], kind="stable")
    groups = seg_arr[order, 0]
    bounds = np.flatnonzero(np.concatenate(([True], groups[1:] != groups[:-1], [True])))
    for a, b in zip(bounds[:-1], bounds[1:]):
        idx = order[a:b]
        g = int(seg_arr[idx[0], 0])
        starts = router.group_starts[g]
        real = router.sizes[router.groups[g][2]]
        before = np.concatenate(([0], np.cumsum(real)[:-1]))

        def upto(p):
            i = np.searchsorted(starts, p, side="right") - 1
            return before[i] + np.minimum(p - starts[i], real[i])

        lo = seg_arr[idx, 1]
        out[idx] = upto(lo + seg_arr[idx, 2]) - upto(lo)
    return out
