"""extend_plan: a joining engine planned on its own, appended; the old workers' part unchanged."""

import dataclasses

import pytest

from planning_layouts import checkpoint, fused_rollout, loaded, params_of, same_bytes, tp_trainer
from weightbridge import LayoutError, Placement, WorkerId, plan_transfer, run_plan_locally
from weightbridge.planning.extend import extend_plan

TRAINERS = [(tp_trainer(r % 2, 2), Placement(f"t{r // 2}")) for r in range(4)]


def _engine(e: int, tp: int = 2, gpus_per_node: int = 1):
    return [(fused_rollout(r, tp), Placement(f"r{e}-{r // gpus_per_node}", engine=e))
            for r in range(tp)]


def _strip(wplan, num_rounds: int):
    """A worker plan with rounds past ``num_rounds`` dropped (they must be empty)."""
    tail = wplan.rounds[num_rounds:]
    assert all(not r.pack and not r.assemble and not r.writes for r in tail), wplan.worker
    return dataclasses.replace(wplan, rounds=wplan.rounds[:num_rounds])


def test_old_rollouts_keep_their_part_and_trainers_keep_their_first_rounds():
    plan = plan_transfer(TRAINERS, _engine(0) + _engine(1), round_bytes=96)
    grown = extend_plan(plan, _engine(2))
    assert len(grown.rollouts) == 6
    assert grown.num_rounds > plan.num_rounds
    before, after = plan.worker_plans(), grown.worker_plans()
    for w in plan.workers:
        if w.side == "rollout":  # nothing to set up again: same tables, buffers, ranges
            assert _strip(after[w], plan.num_rounds) == before[w]
        else:  # the trainers' first rounds are as they were; the new ones follow
            assert after[w].rounds[:plan.num_rounds] == before[w].rounds
    joined = [WorkerId("rollout", i) for i in (4, 5)]
    assert all(not any(r.assemble for r in after[w].rounds[:plan.num_rounds]) for w in joined)
    assert all(any(r.assemble for r in after[w].rounds[plan.num_rounds:]) for w in joined)


def test_an_extended_plan_moves_every_rollout_bit_exact_and_the_join_alone_in_its_rounds():
    ckpt = checkpoint(seed=3)
    rollouts = _engine(0) + _engine(1)
    plan = extend_plan(extend_plan(plan_transfer(TRAINERS, rollouts, round_bytes=96),
                                   _engine(2)), _engine(3, gpus_per_node=2))
    everyone = rollouts + _engine(2) + _engine(3, gpus_per_node=2)
    trainer_params = [loaded(m, ckpt) for m, _ in TRAINERS]
    rollout_params = [params_of(m, fill=-1.0) for m, _ in everyone]
    run_plan_locally(plan, trainer_params, rollout_params)
    for (smap, _), got in zip(everyone, rollout_params):
        want = loaded(smap, ckpt, fill=-1.0)
        assert all(same_bytes(got[n], want[n]) for n in want)
    # Each join's trainer egress is its engine's need, once: the parts are separate plans.
    sent, _ = plan.stage_bytes()
    first = plan_transfer(TRAINERS, rollouts, round_bytes=96)
    alone = plan_transfer(TRAINERS, _engine(2), round_bytes=96)
    assert sent[:4, 0].sum() == (first.correspondence.nbytes + alone.correspondence.nbytes
                                 + plan_transfer(TRAINERS, _engine(3, gpus_per_node=2),
                                                 round_bytes=96).correspondence.nbytes)


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
