"""Extend a plan in force with joining rollout workers, without touching the others' part.

An engine joining a running group is planned on its own, trainers to it (its three stages
inside the engine), and that plan's rounds are appended after the plan in force's::

    rounds [0, R)           the plan in force, unchanged: every old rollout's tables, buffers
                            and registered ranges stay as they are
    rounds [R, R + R')      trainers -> the joining engine (RECEIVE, then its own EXTERNAL and
                            INTERNAL exchanges); old rollouts have no part in them

So a join re-plans only the joining engine (its share of the model, not the group's), and
the only workers set up again are the trainers (their tables gain the new rounds) and the
joining workers. The price: the trainers send the joining engine its own copy instead of
letting the other engines relay it, so the extended plan is not the non-redundant optimum;
`plan_transfer` over everyone (a full re-plan from the kept source maps) restores it when
the group can afford one.

Typical usage::

    plan = extend_plan(plan, [(smap, Placement("rollout-h4", engine=2)), ...])
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from weightbridge.planning.plan import TransferPlan, plan_transfer
from weightbridge.planning.route import RouteTables
from weightbridge.types import Correspondence, Placement, SourceMap


def extend_plan(plan: TransferPlan, joining: Sequence[tuple[SourceMap, Placement]]
                ) -> TransferPlan:
    """``plan`` with the rollout workers ``joining`` added after its rollouts.

    The joining workers are numbered after ``plan``'s rollouts, in the order given; their
    rounds come after ``plan``'s, so ``plan``'s rounds and every old worker's part in them
    are unchanged (`TransferPlan.for_worker` of an old rollout is the same plus empty rounds).

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
    part = plan_transfer(list(zip(plan.trainer_maps, plan.trainers)), joining,
                         round_bytes=plan.round_bytes)
    old, new = plan.correspondence, part.correspondence
    shift = len(plan.rollouts)
    overlaps = old.overlaps + tuple(
        dataclasses.replace(o, needers=tuple(n + shift for n in o.needers))
        for o in new.overlaps)
    return TransferPlan(
        correspondence=Correspondence(overlaps=overlaps, num_trainers=old.num_trainers,
                                      num_rollouts=old.num_rollouts + new.num_rollouts),
        trainer_maps=plan.trainer_maps, rollout_maps=plan.rollout_maps + part.rollout_maps,
        trainers=plan.trainers, rollouts=plan.rollouts + part.rollouts,
        round_bytes=plan.round_bytes,
        tables=_appended(plan.tables, part.tables, len(plan.trainers), shift,
                         len(old.overlaps)))


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
