"""extend_plan and shrink_plan: engines joining and leaving a plan in force.

A replica joins mirrored on a live engine (the trainers untouched, forwarders rewired), another
layout in appended rounds (the old rollouts untouched); every extended plan moves every rollout
bit-exact; a mirrored engine leaves by dropping its rows, back to the plan before the join.
"""

import dataclasses

import pytest
import torch
from planning_layouts import check_invariants

from planning_layouts import checkpoint, fused_rollout, loaded, params_of, same_bytes, tp_trainer
from weightbridge import LayoutError, Placement, plan_transfer, run_plan_locally
from weightbridge.types import WorkerId
from weightbridge.planning.extend import extend_plan, rewired, shrink_plan

TRAINERS = [(tp_trainer(r % 2, 2), Placement(f"t{r // 2}")) for r in range(4)]


def _engine(e: int, tp: int = 2, gpus_per_node: int = 1):
    return [(fused_rollout(r, tp), Placement(f"r{e}-{r // gpus_per_node}", engine=e))
            for r in range(tp)]


def _strip(wplan, num_rounds: int):
    """A worker plan with rounds past ``num_rounds`` dropped (they must be empty)."""
    tail = wplan.rounds[num_rounds:]
    assert all(not r.pack and not r.assemble and not r.writes for r in tail), wplan.worker
    return dataclasses.replace(wplan, rounds=wplan.rounds[:num_rounds])


def test_a_replica_is_mirrored_the_trainers_untouched_and_each_element_leaves_them_once():
    plan = plan_transfer(TRAINERS, _engine(0) + _engine(1), round_bytes=96)
    grown = extend_plan(plan, _engine(2))
    assert len(grown.rollouts) == 6 and grown.num_rounds == plan.num_rounds
    changed, joined = rewired(plan, grown)
    assert joined == [WorkerId("rollout", 4), WorkerId("rollout", 5)]
    assert changed and all(w.side == "rollout" for w in changed)  # forwarders only
    before, after = plan.worker_plans(), grown.worker_plans()
    for w in plan.workers:
        if w in changed:  # new writes; the same buffers and copy tables
            assert after[w].buffer_bytes == before[w].buffer_bytes
            assert [(r.pack, r.assemble) for r in after[w].rounds] == \
                [(r.pack, r.assemble) for r in before[w].rounds]
        else:
            assert after[w] == before[w], w
    sent, received = grown.stage_bytes()
    assert sent[:4, 0].sum() == plan.correspondence.nbytes  # trainer egress unchanged
    # Each joining node gets what its engine needs once over RDMA (one node per worker here).
    for w in joined:
        need = sum(o.nbytes for o in grown.correspondence.overlaps if w.index in o.needers)
        assert received[grown.number(w), :2].sum() == need


def test_another_layout_gets_rounds_appended_and_the_old_rollouts_keep_their_part():
    plan = plan_transfer(TRAINERS, _engine(0) + _engine(1), round_bytes=96)
    grown = extend_plan(plan, _engine(2, tp=1))
    assert grown.num_rounds > plan.num_rounds
    changed, joined = rewired(plan, grown)
    assert joined == [WorkerId("rollout", 4)] and all(w.side == "trainer" for w in changed)
    before, after = plan.worker_plans(), grown.worker_plans()
    for w in plan.workers:
        if w.side == "rollout":  # nothing to set up again: same tables, buffers, ranges
            assert _strip(after[w], plan.num_rounds) == before[w]
        else:  # the trainers' first rounds are as they were; the new ones follow
            assert after[w].rounds[:plan.num_rounds] == before[w].rounds
    assert not any(r.assemble for r in after[joined[0]].rounds[:plan.num_rounds])


@pytest.mark.parametrize("tp", [2, 1], ids=["mirrored", "appended"])
def test_extended_plans_move_every_rollout_bit_exact(tp):
    ckpt = checkpoint(seed=3)
    rollouts = _engine(0) + _engine(1)
    joins = [_engine(2, tp=tp), _engine(3, tp=tp, gpus_per_node=2)]
    plan = plan_transfer(TRAINERS, rollouts, round_bytes=96)
    for join in joins:
        plan = extend_plan(plan, join)
    everyone = rollouts + joins[0] + joins[1]
    trainer_params = [loaded(m, ckpt) for m, _ in TRAINERS]
    rollout_params = [params_of(m, fill=-1.0) for m, _ in everyone]
    if tp == 2:  # exactly once out of the trainers, once into each node, buffers in bounds
        check_invariants(plan, 96)
    run_plan_locally(plan, trainer_params, rollout_params)
    for (smap, _), got in zip(everyone, rollout_params):
        want = loaded(smap, ckpt, fill=-1.0)
        assert all(same_bytes(got[n], want[n]) for n in want)


def test_a_mirrored_engine_leaves_by_dropping_its_rows_and_an_original_one_cannot():
    plan = plan_transfer(TRAINERS, _engine(0) + _engine(1), round_bytes=96)
    grown = extend_plan(plan, _engine(2))
    changed, _ = rewired(plan, grown)
    shrunk, writers = shrink_plan(grown, [4, 5])
    assert set(writers) == set(changed)  # the forwarders, and only they, change again
    before, after = plan.worker_plans(), shrunk.worker_plans(plan.workers)
    assert all(after[w] == before[w] for w in plan.workers)  # as before the join
    assert shrink_plan(grown, [0, 1]) is None  # it lands segments the others need
    ckpt = checkpoint(seed=5)
    maps = [m for m, _ in _engine(0) + _engine(1) + _engine(2)]
    rollout_params = [params_of(m, fill=-1.0) for m in maps]
    run_plan_locally(shrunk, [loaded(m, ckpt) for m, _ in TRAINERS], rollout_params)
    for smap, got in zip(maps[:4], rollout_params[:4]):
        want = loaded(smap, ckpt, fill=-1.0)
        assert all(same_bytes(got[n], want[n]) for n in want)
    assert all(torch.equal(t, torch.full_like(t, -1.0)) for p in rollout_params[4:]
               for t in p.values())  # the engine that left gets nothing


def test_a_join_on_a_node_the_group_uses_is_refused():
    plan = plan_transfer(TRAINERS, _engine(0), round_bytes=96)
    with pytest.raises(ValueError, match="hosts of its own"):
        extend_plan(plan, [(fused_rollout(0, 2), Placement("r0-0", engine=1))])
    with pytest.raises(ValueError, match="at least one"):
        extend_plan(plan, [])


def _only(smap, tensor: str):
    pieces = tuple(p for p in smap.pieces if p.region.tensor == tensor)
    names = {p.param for p in pieces}
    return dataclasses.replace(smap, pieces=pieces, unused=(),
                               params=tuple(p for p in smap.params if p.name in names))


def test_a_join_needing_what_no_trainer_holds_fails_closed():
    trainers = [(_only(m, "attn.w"), p) for m, p in TRAINERS]  # they hold attn.w alone
    plan = plan_transfer(trainers, [(_only(m, "attn.w"), p) for m, p in _engine(0)],
                         round_bytes=96)
    with pytest.raises(LayoutError, match="no trainer holds"):
        extend_plan(plan, _engine(1))
