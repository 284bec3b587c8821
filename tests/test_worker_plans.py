"""All workers' plans built together equal the one-worker-at-a-time reference, field by field."""

import pytest
import torch
from moegroup import probed_workers

from planning_layouts import fsdp_trainer, fused_rollout, tp_trainer
from reference_worker_plan import reference_worker_plan
from weightbridge import Placement, plan_transfer
from weightbridge.planning.worker_plans import worker_plan, worker_plans
from weightbridge.shapes import TABLE_2, workers


def _small_layouts():
    engines = lambda n, tp: [(fused_rollout(r, tp), Placement(f"r{(e * tp + r) // 2}",  # noqa: E731
                                                              engine=e))
                             for e in range(n) for r in range(tp)]
    yield "tp2 -> 2 engines tp2, 2 per node", plan_transfer(
        [(tp_trainer(r % 2, 2), Placement(f"t{r // 2}")) for r in range(4)], engines(2, 2),
        round_bytes=96)
    yield "fsdp3 -> 3 engines tp1", plan_transfer(
        [(fsdp_trainer(r, 3), Placement(f"t{r}")) for r in range(3)], engines(3, 1),
        round_bytes=128)
    yield "tp1 -> 1 engine tp2, one round", plan_transfer(
        [(tp_trainer(0, 1), Placement("t0"))], engines(1, 2), round_bytes=1 << 20)
    # Converting boxes: float32 trainers, bfloat16 rollouts (the wire is bfloat16).
    yield "fp32 tp2 x ep2 -> 2 bf16 engines", probed_workers(torch.float32, torch.bfloat16)[-1]


def _assert_same(plan):
    together = worker_plans(plan)
    assert list(together) == list(plan.workers)
    for w in plan.workers:
        want = reference_worker_plan(plan, w)
        assert together[w] == want, w
        assert worker_plan(plan, w) == want and plan.for_worker(w) == want, w


@pytest.mark.parametrize("name,plan", list(_small_layouts()), ids=lambda v: v if
                         isinstance(v, str) else "")
def test_all_workers_together_equal_the_per_worker_reference(name, plan):
    assert plan.num_rounds >= 1
    _assert_same(plan)
    converting = {b.buffer_dtype for wp in worker_plans(plan).values() for r in wp.rounds
                  for b in r.pack + r.assemble}
    assert converting == ({None, "bfloat16"} if "fp32" in name else {None}), converting


def test_p2p_plans_pack_each_box_once_as_the_reference_does():
    from controller.baselines import p2p_plan

    plan = dict((n, p) for n, p in _small_layouts())["tp2 -> 2 engines tp2, 2 per node"]
    _assert_same(p2p_plan(plan))


@pytest.mark.slow
def test_block_fp8_plans_equal_the_reference():
    """A sender's quantizing boxes (whole blocks, `block` set) in the reference's order, small
    rounds cutting the value overlaps often; in a P2P plan too, where one segment is packed at
    several offsets (boxes built once and shifted, `block` carried)."""
    from controller.baselines import p2p_plan
    from moegroup import CONFIG, replica_plan

    from meshes.fp8_rollout import Fp8RolloutShard
    from meshes.qwen3_moe import TrainerShard, checkpoint_spec

    trainers = [TrainerShard(CONFIG, 2, r % 2, 2, r // 2) for r in range(4)]
    rollouts = [Fp8RolloutShard(CONFIG, 2, r, 1, 0, block=(32, 32))
                for _ in range(2) for r in range(2)]
    for round_bytes in (64 << 10, 8 << 10):
        plan, _ = replica_plan(trainers, rollouts, round_bytes,
                               checkpoint_spec(CONFIG, "bfloat16"))
        for each in (plan, p2p_plan(plan)):
            _assert_same(each)
            packs = [b for wp in worker_plans(each).values() for r in wp.rounds for b in r.pack]
            assert {(b.buffer_dtype, b.block) for b in packs if b.block} == {
                ("float8_e4m3fn", (32, 32)), ("float32", (32, 32))}


def test_a_plan_that_moves_nothing_has_empty_worker_plans():
    """A delta update with nothing changed plans maps without pieces: no groups, no rounds."""
    import dataclasses

    plan = dict(_small_layouts())["tp1 -> 1 engine tp2, one round"]
    empty = lambda maps, places: [  # noqa: E731
        (dataclasses.replace(m, pieces=(), params=(), unsourced=(), unused=()), p)
        for m, p in zip(maps, places)]
    nothing = plan_transfer(empty(plan.trainer_maps, plan.trainers),
                            empty(plan.rollout_maps, plan.rollouts), round_bytes=1 << 20)
    _assert_same(nothing)
    assert not any(r.pack or r.assemble or r.writes for wp in worker_plans(nothing).values()
                   for r in wp.rounds)


def test_paper_scale_moonlight_equals_the_reference():
    dep = TABLE_2[0]  # Moonlight-16B: 8 trainers, 8 rollouts, real shapes
    trainers, rollouts = workers(dep)
    _assert_same(plan_transfer(trainers, rollouts, round_bytes=64 << 20))


def test_a_subset_of_workers_gets_only_theirs():
    plan = next(p for _, p in _small_layouts())
    some = [plan.workers[-1], plan.workers[0]]
    got = worker_plans(plan, some)
    assert list(got) == some
    assert all(got[w] == reference_worker_plan(plan, w) for w in some)


def test_write_dests_from_the_tables_are_the_peers_of_the_workers_writes():
    from controller.baselines import p2p_plan
    from controller.timing import write_dests

    for _, plan in [*_small_layouts(), ("p2p", p2p_plan(next(p for _, p in _small_layouts())))]:
        want: dict = {}
        for p in worker_plans(plan).values():
            for rnd in p.rounds:
                for w in rnd.writes:
                    want.setdefault((p.worker.side, p.worker.index, rnd.index, w.stage.value),
                                    set()).add(w.peer.index)
        assert write_dests(plan) == {k: frozenset(v) for k, v in want.items()}


@pytest.mark.slow
def test_segment_chunks_are_every_segments_placed_chunks():
    from weightbridge.planning.box_copies import segment_chunks

    dep = TABLE_2[0]
    trainers, rollouts = workers(dep)
    for plan in [p for _, p in _small_layouts()] + [
            plan_transfer(trainers, rollouts, round_bytes=64 << 20)]:
        cuts, overlap, first, count, rel = (c.tolist() for c in segment_chunks(plan))
        for s in range(len(plan.tables.seg_bytes)):
            want = [(c.overlap, c.start, c.count, r) for c, r in plan.placed_chunks(s)]
            part = slice(cuts[s], cuts[s + 1])
            assert list(zip(overlap[part], first[part], count[part], rel[part])) == want, s


def test_instances_equal_the_constructed_dataclasses():
    from weightbridge.types.build import instances
    from weightbridge.types import BoxCopy

    values = [(1, 7, (2, 3), (3, 1), 64, None, ()), (0, 0, (), (), 0, "bfloat16", ()),
              (2, 5, (64, 32), (32, 1), 8, "float8_e4m3fn", (32, 32))]
    made = instances(BoxCopy, len(values), [list(c) for c in zip(*values)])
    assert made == [BoxCopy(*v) for v in values]
    assert [hash(b) for b in made] == [hash(BoxCopy(*v)) for v in values]


def test_folded_sort_order_is_lexsorts_and_falls_back_to_it_when_keys_do_not_fit():
    import numpy as np

    from weightbridge.planning.worker_plans import _order

    rng = np.random.default_rng(0)
    a, b, c = rng.integers(0, 5, 1000), rng.integers(0, 7, 1000), rng.integers(0, 3, 1000)
    want = np.lexsort((c, b, a))
    assert (_order([a, b, c], [5, 7]) == want).all()
    huge = c.astype(np.int64) << 60  # does not fold: lexsort
    assert (_order([a, b, huge], [5, 7]) == np.lexsort((huge, b, a))).all()


def test_worker_plans_and_source_maps_pickle_as_plain_tuples_and_come_back_equal():
    """Connect pickles every worker's plan on the controller and unpickles every source map
    there: as plain tuples (no object per copy, write or piece), every field kept."""
    import dataclasses
    import pickle

    from weightbridge.types import BoxCopy, BufferWrite, Piece, Region, WorkerRound
    from weightbridge.types import maps as maps_module
    from weightbridge.types import plans as plans_module

    plan = dict(_small_layouts())["fp32 tp2 x ep2 -> 2 bf16 engines"]
    plans = worker_plans(plan)
    quantizing = BoxCopy(1, 8, (2, 4), (4, 1), 64, "float8_e4m3fn", (32, 32))
    some = next(iter(plans.values()))
    plans["block"] = dataclasses.replace(some, rounds=(dataclasses.replace(
        some.rounds[0], pack=(quantizing,)),) + some.rounds[1:])
    maps = [m for m in plan.trainer_maps + plan.rollout_maps]
    maps.append(dataclasses.replace(maps[0], pieces=(Piece(
        Region("w", (0, 4), (2, 8), (1, 2)), "p", 3, (8, 1), "float32", (32, 32)),),
        unsourced=(("p", 5),), unused=("x",)))
    for value in [*plans.values(), *maps]:
        blob = pickle.dumps(value, protocol=5)
        assert pickle.loads(blob) == value
        for name in (b"BoxCopy", b"BufferWrite", b"WorkerRound", b"Piece", b"Region"):
            assert name not in blob, name
    # Every field is in the pickled form (a new field must be added there too).
    assert len(plans_module._box_fields(quantizing)) == len(dataclasses.fields(BoxCopy))
    writing = next(r for wp in plans.values() for r in wp.rounds if r.writes)
    fields = plans_module._round_fields(writing)
    assert (len(fields), len(fields[2][0])) == (len(dataclasses.fields(WorkerRound)),
                                                len(dataclasses.fields(BufferWrite)))
    piece = maps[-1].pieces[0]
    assert len(maps_module._piece_fields(piece)) == (len(dataclasses.fields(Piece)) - 1
                                                      + len(dataclasses.fields(Region)))
