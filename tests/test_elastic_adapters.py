"""Engines joining and leaving an adapter group between versions, in one process, every mode.

`tinygroup`: two data-parallel trainers, an engine per rollout. Per mode: version 1 to two
engines; a third engine's receiver is added and every trainer calls `add_engines()`; version 2
reaches all three (the new engine's first installed version is 2, whole); `remove_engine(0)`
on every trainer; engine 0's polls raise saying it was removed; version 3 reaches engines 1
and 2, bit-exact. Refusals: a call that is not collective, nothing to add, a bad engine.
"""

import re

import pytest
import tinygroup
import torch
from tinygroup import MODES, SHAPES, SPEC, Model, build, checkpoint, connect, in_threads

from weightbridge import (CheckpointSpec, LayoutError, ReceiverAdapter, TransferConfig,
                          TransferFailed, WorkersLost)
from weightbridge.coordination.local_control import WorkerGone


class Partial(Model):
    """A rollout of another layout: it serves only two of the three tensors."""

    def __init__(self):
        super().__init__()
        del self.params["m"]

    def load_weights(self, weights) -> None:
        super().load_weights((n, t) for n, t in weights if n in self.params)


def plan_rollouts(plan):
    """The rollout workers ``plan`` routes bytes to."""
    return tuple(w for w in plan.workers if w.side == "rollout"
                 and plan.rollout_maps[w.index].pieces)


class DiesInItsProbe(ReceiverAdapter):
    """A joining rollout whose process dies as it is probed."""

    def on_source_map(self, how: str = "probe"):
        self.control.kill(self.worker)
        raise WorkerGone(f"{self.worker} died")


def _add_receiver(control, config, rank: int, model=Model, cls=ReceiverAdapter):
    m = model()
    return m, control.add(cls(
        m.params, m.load_weights, SPEC, rank=rank, engine=rank, engine_rank=0, engine_size=1,
        control=control, transport=control.transport, config=config))


@pytest.mark.parametrize("mode", sorted(MODES))
def test_an_engine_joins_and_another_leaves_and_every_install_is_whole(mode):
    ss, rs = MODES[mode]
    config = TransferConfig(timeout_s=5, sender_staging=ss, receiver_staging=rs)
    control, trainers, rollouts = build(config)
    connect(trainers)

    def polls(v, which):
        return [lambda a=a: a.wait_for_version(v) for _, a in which]

    def update(v, which):
        return in_threads(*tinygroup.send(trainers, v, ss=ss), *polls(v, which))[2:]

    assert update(1, rollouts) == [1, 1]
    rounds = trainers[0][1].plan.num_rounds
    rollouts.append(_add_receiver(control, config, 2))
    assert in_threads(*[a.add_engines for _, a in trainers]) == [None, None]
    assert trainers[0][1].plan.num_rounds == rounds  # a replica: mirrored, no round added
    assert rollouts[2][1].version == 0  # nothing yet: its first version is the next one
    assert update(2, rollouts) == [2, 2, 2]
    assert all(m.holds(2) for m, _ in rollouts)
    assert in_threads(*[lambda a=a: a.remove_engine(0) for _, a in trainers]) == [None, None]
    with pytest.raises(TransferFailed, match=r"engine 0 was removed .*remove_engine\(0\)"):
        rollouts[0][1].poll_requests()
    assert update(3, rollouts[1:]) == [3, 3]
    assert all(m.holds(3) for m, _ in rollouts[1:]) and rollouts[0][0].holds(2)
    # A fourth engine joins (a replica: mirrored) and leaves again: only the rollouts that
    # forwarded to it change, and the plan routes to the same workers as before.
    plan = trainers[0][1].plan
    rollouts.append(_add_receiver(control, config, 3))
    assert in_threads(*[a.add_engines for _, a in trainers]) == [None, None]
    assert update(4, rollouts[1:]) == [4, 4, 4]
    assert in_threads(*[lambda a=a: a.remove_engine(3) for _, a in trainers]) == [None, None]
    assert trainers[0][1].group.live_rollouts == plan_rollouts(plan)
    assert update(5, rollouts[1:3]) == [5, 5] and rollouts[3][0].holds(4)


@pytest.mark.parametrize("mode", ["sync", "rs"])
def test_an_engine_of_another_layout_gets_rounds_of_its_own(mode):
    ss, rs = MODES[mode]
    config = TransferConfig(timeout_s=5, sender_staging=ss, receiver_staging=rs)
    control, trainers, rollouts = build(config)
    connect(trainers)
    polls = lambda v, which: [lambda a=a: a.wait_for_version(v) for _, a in which]  # noqa: E731
    assert in_threads(*tinygroup.send(trainers, 1, ss=ss), *polls(1, rollouts))[2:] == [1, 1]
    rounds = trainers[0][1].plan.num_rounds
    rollouts.append(_add_receiver(control, config, 2, Partial))
    assert in_threads(*[a.add_engines for _, a in trainers]) == [None, None]
    assert trainers[0][1].plan.num_rounds > rounds  # appended: the old engines keep theirs
    assert in_threads(*tinygroup.send(trainers, 2, ss=ss), *polls(2, rollouts))[2:] == [2] * 3
    assert all(m.holds(2) for m, _ in rollouts)


@pytest.mark.parametrize("mode", ["sync", "rs"])
def test_an_engine_joining_between_delta_updates_gets_every_tensor(mode):
    ss, rs = MODES[mode]
    config = TransferConfig(timeout_s=5, sender_staging=ss, receiver_staging=rs)
    control, trainers, rollouts = build(config)
    connect(trainers)
    held = {}  # tensor -> the version whose value every rollout must hold

    def delta(v, changed, which):
        def one(model, adapter):
            model.load_weights((n, checkpoint(v)[n]) for n in changed or SHAPES)
            adapter.send_weights(v, changed=changed)
        held.update(dict.fromkeys(changed or SHAPES, v))
        polls = [lambda a=a: a.wait_for_version(v) for _, a in which]
        assert in_threads(*[lambda m=m, a=a: one(m, a) for m, a in trainers],
                          *polls)[2:] == [v] * len(which)

    delta(1, None, rollouts)
    delta(2, ["w"], rollouts)
    rollouts.append(_add_receiver(control, config, 2))
    assert in_threads(*[a.add_engines for _, a in trainers]) == [None, None]
    delta(3, ["v"], rollouts)  # the new engine needs every tensor: they all move
    for m, _ in rollouts:
        assert all(torch.equal(m.params[n].view(torch.uint8),
                               checkpoint(v)[n].view(torch.uint8)) for n, v in held.items())
    assert held == {"w": 2, "v": 3, "m": 1}


def test_an_engine_that_reads_another_checkpoint_is_refused_and_the_group_goes_on():
    config = TransferConfig(timeout_s=5)
    control, trainers, rollouts = build(config)
    connect(trainers)
    polls = lambda v, which: [lambda a=a: a.wait_for_version(v) for _, a in which]  # noqa: E731
    assert in_threads(*tinygroup.send(trainers, 1, ss=False), *polls(1, rollouts))[2:] == [1, 1]
    smaller = {n: t[:2].clone() for n, t in checkpoint(0).items()}  # a model of other shapes

    def load(weights):
        for n, t in weights:
            smaller[n].copy_(t)
    stranger = control.add(ReceiverAdapter(
        smaller, load, CheckpointSpec.from_tensors(smaller), rank=2, engine=2, engine_rank=0,
        engine_size=1,
        control=control, transport=control.transport, config=config))
    out = in_threads(*[a.add_engines for _, a in trainers])
    assert isinstance(out[0], LayoutError) and "load different checkpoints" in str(out[0]), out
    # Every trainer raises what trainer 0 raised, told by it (before, the others raised a
    # RuntimeError saying nothing changed).
    assert isinstance(out[1], LayoutError) and "load different checkpoints" in str(out[1]), out
    assert "T1: trainer 0's add_engines() failed" in str(out[1]), out
    with pytest.raises(TransferFailed, match=r"engines \[2\] could not join"):
        stranger.poll_requests()
    assert in_threads(*tinygroup.send(trainers, 2, ss=False), *polls(2, rollouts))[2:] == [2, 2]
    # Issue 44, item 8: engine 2's number stays taken, out for good; the next engine to join
    # is planned in after it (its join must not probe the stranger again).
    rollouts.append(_add_receiver(control, config, 3))
    assert in_threads(*[a.add_engines for _, a in trainers]) == [None, None]
    sent = in_threads(*tinygroup.send(trainers, 3, ss=False), *polls(3, rollouts))
    assert sent[2:] == [3, 3, 3] and all(m.holds(3) for m, _ in rollouts), sent


def test_membership_changes_are_refused_clearly():
    config = TransferConfig(timeout_s=2)
    control, trainers, rollouts = build(config)
    (_, t0), (_, t1) = trainers
    with pytest.raises(RuntimeError, match="call connect"):
        t0.add_engines()
    connect(trainers)
    nothing, other = in_threads(t0.add_engines, t1.add_engines)
    assert isinstance(nothing, ValueError) and "no rollout engine joined" in str(nothing)
    assert isinstance(other, ValueError) and "no rollout engine joined" in str(other)
    for bad, match in ((2, r"in \[0, 2\), got 2"), ("1", "got '1'")):
        out = in_threads(lambda: t0.remove_engine(bad), lambda: t1.remove_engine(bad))
        assert isinstance(out[0], ValueError) and re.search(match, str(out[0])), out
    alone = t0.remove_engine  # trainer 1 never calls: refused, nothing changed
    with pytest.raises(TimeoutError, match=r"not every trainer called the same remove_engine\(1\)"):
        alone(1)
    assert in_threads(*[lambda a=a: a.remove_engine(1) for _, a in trainers]) == [None, None]
    out = in_threads(lambda: t0.remove_engine(0), lambda: t1.remove_engine(0))
    assert isinstance(out[0], ValueError) and "last engine" in str(out[0]), out


def test_a_joiner_lost_in_add_engines_gives_every_trainer_the_same_workers_lost():
    # Before, trainer 0 raised `WorkersLost` and the others a RuntimeError saying nothing
    # changed, though the joining engine was out for good.
    config = TransferConfig(timeout_s=2)
    control, trainers, rollouts = build(config)
    connect(trainers)
    _add_receiver(control, config, 2, cls=DiesInItsProbe)
    out = in_threads(*[a.add_engines for _, a in trainers])
    assert all(isinstance(e, WorkersLost) for e in out), out
    assert all(e.lost_engines == {2} and e.lost_trainers == set() for e in out), out
    assert "add_engines() was not made" in str(out[0]), out
    assert "T1: trainer 0's add_engines() failed" in str(out[1]), out
    assert "add_engines() was not made" in str(out[1]), out
    polls = [lambda a=a: a.wait_for_version(1) for _, a in rollouts]
    assert in_threads(*tinygroup.send(trainers, 1, ss=False), *polls)[2:] == [1, 1]
