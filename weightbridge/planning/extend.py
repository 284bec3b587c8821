"""Grow a plan in force by a joining rollout engine (or shrink it by one that leaves),
leaving the other workers' buffers be.

Two ways, chosen by `extend_plan`:

mirror (the joining engine has the source maps of a live engine, rank by rank: a replica;
    the usual way to scale out). Nothing changes for the trainers, and no round is added.
    The joining worker x' takes the receive-buffer layout of its template x in the live
    engine; each segment x receives in round r reaches x' in the same round: over RDMA
    (EXTERNAL) from the rollout that landed it from the trainers (it holds the segment in
    its buffer by then), once per joining node, then INTERNAL to the other needers on that
    node. So each element still leaves the trainers once; the landing rollouts forward one
    more copy each (the planner spread the landings over the rollout nodes). Only those
    forwarders get new write tables (their buffers, registered ranges and copy tables stay);
    the joining workers are set up; everyone else is untouched.

append (any other layout). The joining engine is planned on its own, trainers to it, and its
    rounds are appended after the plan in force's: the old rollouts have no part in them and
    keep everything; the trainers are set up again (their tables gain the rounds). The
    trainers send the engine its own copy, after the others' rounds, so every update takes
    longer; `plan_transfer` over everyone (a full re-plan from the kept source maps, e.g.
    `MeshTransfer.replan`) restores the non-redundant plan.

Either way the result is a `TransferPlan` whose joining workers are numbered after the plan's
rollouts and whose added writes are appended to its tables: the workers to set up again are
the writers of those rows and the joining workers (`rewired`).

`shrink_plan` takes an engine out the same way when nothing else depends on it (it lands no
segment from the trainers and forwards nothing to workers that stay: true of a mirrored
engine): its rows go, and only the workers that forwarded to it take new writes. Otherwise
the group is planned again (`plan_transfer` from the kept source maps).

Typical usage::

    plan = extend_plan(plan, [(smap, Placement("rollout-h4", engine=2)), ...])
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from weightbridge.planning.plan import TransferPlan, plan_transfer
from weightbridge.planning.route import EXTERNAL, INTERNAL, RECEIVE, RouteTables
from weightbridge.types import Correspondence, Overlap, Placement, SourceMap, WorkerId


def extend_plan(plan: TransferPlan, joining: Sequence[tuple[SourceMap, Placement]]
                ) -> TransferPlan:
    """``plan`` with the rollout workers ``joining`` (one engine, or engines of one layout)
    added after its rollouts, mirrored on a live engine of the same source maps when there is
    one, else in appended rounds (see the module docstring).

    Raises:
        ValueError: nothing joins, or a joining worker shares a node with a trainer or with
            a rollout of ``plan`` (an engine joins on hosts of its own).
        LayoutError: a joining worker needs elements no trainer holds.
    """
    joining = list(joining)
    if not joining:
        raise ValueError("extend_plan needs at least one joining (SourceMap, Placement)")
    taken = sorted({p.node for p in plan.rollouts} & {p.node for _, p in joining})
    if taken:
        raise ValueError(f"joining workers are on nodes {taken[:4]} that rollouts of the plan "
                         f"in force already use; a joining engine needs hosts of its own "
                         f"(give its workers new node names), or re-plan the whole group")
    template = _template(plan, [m for m, _ in joining])
    if template is not None:
        return _mirrored(plan, joining, template)
    return _appended_plan(plan, joining)


def rewired(old: TransferPlan, new: TransferPlan) -> tuple[list[WorkerId], list[WorkerId]]:
    """(old workers whose part ``extend_plan`` changed: the writers of the added rows,
    the joining workers) of ``new = extend_plan(old, ...)``."""
    t = new.tables
    writers = np.unique(t.src[len(old.tables.stage):])
    workers = new.workers
    first_new = len(old.trainers) + len(old.rollouts)
    return ([workers[int(w)] for w in writers if w < first_new],
            list(workers[first_new:]))


def shrink_plan(plan: TransferPlan, leaving: Sequence[int]
                ) -> tuple[TransferPlan, list[WorkerId]] | None:
    """(``plan`` without the rollout workers ``leaving``, the workers that wrote to them and
    stay), when the others do not depend on them; None when some segment is landed by one of
    them or forwarded by one of them to a worker that stays (then plan again).

    The leaving workers keep their numbers, with empty source maps and no rows, as
    `plan_transfer` numbers workers that are left out.
    """
    t = plan.tables
    T = len(plan.trainers)
    gone = np.zeros(T + len(plan.rollouts), dtype=bool)
    gone[[T + i for i in leaving]] = True
    into = gone[t.dst]
    if (into & (t.stage == RECEIVE)).any() or (gone[t.src] & ~into).any():
        return None
    keep = ~into
    writers = np.unique(t.src[into & ~gone[t.src]])
    recv = t.recv_bytes.copy()
    recv[gone] = 0
    tables = dataclasses.replace(
        t, stage=t.stage[keep], src=t.src[keep], dst=t.dst[keep], seg=t.seg[keep],
        src_offset=t.src_offset[keep], dst_offset=t.dst_offset[keep], recv_bytes=recv)
    out = frozenset(leaving)
    kept: dict[tuple[int, ...], tuple[int, ...]] = {}
    overlaps = []
    for o in plan.correspondence.overlaps:
        needers = kept.get(o.needers)
        if needers is None:
            needers = kept[o.needers] = tuple(n for n in o.needers if n not in out)
        overlaps.append(o if len(needers) == len(o.needers) else
                        Overlap(o.region, o.dtype, o.holders, needers, o.source_dtype,
                                o.target_dtype))
    maps = tuple(dataclasses.replace(m, pieces=(), unsourced=(), unused=()) if i in out else m
                 for i, m in enumerate(plan.rollout_maps))
    corr = plan.correspondence
    shrunk = TransferPlan(
        correspondence=Correspondence(overlaps=tuple(overlaps), num_trainers=corr.num_trainers,
                                      num_rollouts=corr.num_rollouts),
        trainer_maps=plan.trainer_maps, rollout_maps=maps, trainers=plan.trainers,
        rollouts=plan.rollouts, round_bytes=plan.round_bytes, tables=tables)
    workers = plan.workers
    return shrunk, [workers[int(w)] for w in writers]


def _template(plan: TransferPlan, maps: list[SourceMap]) -> list[int] | None:
    """Rollout indices of a live engine whose workers have ``maps``, rank by rank."""
    engines: dict[int, list[int]] = {}
    for i, p in enumerate(plan.rollouts):
        engines.setdefault(p.engine, []).append(i)
    for _, members in sorted(engines.items()):
        held = [plan.rollout_maps[i] for i in members]
        if len(held) == len(maps) and held[0].pieces and all(
                a is b or a == b for a, b in zip(held, maps)):
            return members
    return None


def _mirrored(plan: TransferPlan, joining, template: list[int]) -> TransferPlan:
    t = plan.tables
    T, R = len(plan.trainers), len(plan.rollouts)
    first = T + R  # worker number of the first joining worker
    mirror = np.full(T + R, -1, dtype=np.int64)
    mirror[[T + i for i in template]] = first + np.arange(len(template))
    # Who landed each segment from the trainers, and where in its buffer.
    recv = np.flatnonzero(t.stage == RECEIVE)
    segs, at = np.unique(t.seg[recv], return_index=True)
    holder = np.full(len(t.seg_bytes), -1, dtype=np.int64)
    holder_offset = np.zeros(len(t.seg_bytes), dtype=np.int64)
    holder[segs], holder_offset[segs] = t.dst[recv[at]], t.dst_offset[recv[at]]
    # Every delivery into the template: the joining mirror needs that segment, at that offset.
    into = np.flatnonzero(mirror[t.dst] >= 0)
    dst = mirror[t.dst[into]]
    seg, dst_offset = t.seg[into], t.dst_offset[into]
    node_ids: dict[str, int] = {}
    node = np.array([node_ids.setdefault(p.node, len(node_ids)) for _, p in joining])
    key = node[dst - first] * len(t.seg_bytes) + seg  # (joining node, segment)
    order = np.lexsort((dst, key))
    key, dst, seg, dst_offset = key[order], dst[order], seg[order], dst_offset[order]
    lead = np.concatenate(([True], key[1:] != key[:-1]))  # one RDMA copy per node
    lead_at = np.maximum.accumulate(np.where(lead, np.arange(len(key)), 0))
    src = np.where(lead, holder[seg], dst[lead_at])
    assert (src >= 0).all()  # every segment was landed by some rollout
    src_offset = np.where(lead, holder_offset[seg], dst_offset[lead_at])
    stage = np.where(lead, EXTERNAL, INTERNAL).astype(t.stage.dtype)
    cat = np.concatenate
    usage = cat([t.recv_bytes, t.recv_bytes[[T + i for i in template]]])
    tables = dataclasses.replace(
        t, stage=cat([t.stage, stage]), src=cat([t.src, src]), dst=cat([t.dst, dst]),
        seg=cat([t.seg, seg]), src_offset=cat([t.src_offset, src_offset]),
        dst_offset=cat([t.dst_offset, dst_offset]),
        send_bytes=cat([t.send_bytes, np.zeros((len(template), t.num_rounds), np.int64)]),
        recv_bytes=usage)
    twin = {i: R + k for k, i in enumerate(template)}
    grown: dict[tuple[int, ...], tuple[int, ...]] = {}  # few distinct needer sets: once each
    overlaps = []
    for o in plan.correspondence.overlaps:
        needers = grown.get(o.needers)
        if needers is None:
            needers = grown[o.needers] = o.needers + tuple(twin[n] for n in o.needers
                                                           if n in twin)
        overlaps.append(o if needers is o.needers or len(needers) == len(o.needers) else
                        Overlap(o.region, o.dtype, o.holders, needers, o.source_dtype,
                                o.target_dtype))
    return _grown(plan, joining, tuple(overlaps), tables)


def _appended_plan(plan: TransferPlan, joining) -> TransferPlan:
    part = plan_transfer(list(zip(plan.trainer_maps, plan.trainers)), joining,
                         round_bytes=plan.round_bytes)
    shift = len(plan.rollouts)
    overlaps = plan.correspondence.overlaps + tuple(
        dataclasses.replace(o, needers=tuple(n + shift for n in o.needers))
        for o in part.correspondence.overlaps)
    return _grown(plan, joining, overlaps,
                  _appended(plan.tables, part.tables, len(plan.trainers), shift,
                            len(plan.correspondence.overlaps)))


def _grown(plan: TransferPlan, joining, overlaps, tables: RouteTables) -> TransferPlan:
    corr = plan.correspondence
    return TransferPlan(
        correspondence=Correspondence(overlaps=overlaps, num_trainers=corr.num_trainers,
                                      num_rollouts=corr.num_rollouts + len(joining)),
        trainer_maps=plan.trainer_maps,
        rollout_maps=plan.rollout_maps + tuple(m for m, _ in joining),
        trainers=plan.trainers, rollouts=plan.rollouts + tuple(p for _, p in joining),
        round_bytes=plan.round_bytes, tables=tables)


def _appended(a: RouteTables, b: RouteTables, num_trainers: int, shift: int,
              num_overlaps: int) -> RouteTables:
    """``a``'s tables followed by ``b``'s, ``b``'s rollouts numbered after ``a``'s, its
    rounds after ``a``'s rounds, its groups, segments and overlaps after ``a``'s."""

    def renumbered(workers: np.ndarray) -> np.ndarray:  # b's rollouts come after a's
        return np.where(workers < num_trainers, workers, workers + shift)

    def usage(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        # [workers, rounds]: a's block, then b's trainers' rows and its rollouts' rows
        # after a's rollouts, in b's rounds.
        out = np.zeros((x.shape[0] + y.shape[0] - num_trainers, x.shape[1] + y.shape[1]),
                       dtype=np.int64)
        out[:x.shape[0], :x.shape[1]] = x
        out[:num_trainers, x.shape[1]:] = y[:num_trainers]
        out[x.shape[0]:, x.shape[1]:] = y[num_trainers:]
        return out

    cat = np.concatenate
    return RouteTables(
        num_rounds=a.num_rounds + b.num_rounds,
        group_overlaps=a.group_overlaps + tuple(g + num_overlaps for g in b.group_overlaps),
        group_starts=a.group_starts + b.group_starts,
        seg_group=cat([a.seg_group, b.seg_group + len(a.group_overlaps)]),
        seg_start=cat([a.seg_start, b.seg_start]),
        seg_bytes=cat([a.seg_bytes, b.seg_bytes]),
        seg_real=cat([a.seg_real, b.seg_real]),
        seg_round=cat([a.seg_round, b.seg_round + a.num_rounds]),
        stage=cat([a.stage, b.stage]),
        src=cat([a.src, renumbered(b.src)]),
        dst=cat([a.dst, renumbered(b.dst)]),
        seg=cat([a.seg, b.seg + len(a.seg_bytes)]),
        src_offset=cat([a.src_offset, b.src_offset]),
        dst_offset=cat([a.dst_offset, b.dst_offset]),
        send_bytes=usage(a.send_bytes, b.send_bytes),
        recv_bytes=usage(a.recv_bytes, b.recv_bytes))
