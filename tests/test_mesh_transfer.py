"""The controller on real Monarch process meshes on this host (CPU tensors, TCP RDMA fallback).

Layout pairs share one trainer and one rollout proc mesh of 4 procs each (spawning procs and
importing torch in them dominates the cost); each test spawns fresh actors on them and stops
them. Every rollout parameter must be bit-identical (by checksum, computed on the rollout) to
its own load_weights of the trainers' version after every update.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from controller.driver import MeshTransfer
from meshes.actors import TrainerActor
from meshes.spec import RolloutSpec, TrainerSpec
from weightbridge import LayoutError

pytestmark = pytest.mark.mesh

ROUND_BYTES = 64 << 10  # tiny model: ~20 rounds, so both arenas alternate many times


def _bootstrap_children() -> set[int]:
    """Monarch proc processes descended from this test process."""
    me, found = os.getpid(), set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if b"bootstrap_main" not in (entry / "cmdline").read_bytes():
                continue
            pid = int(entry.name)
            while pid > 1:  # walk up to us, or to init
                stat = (Path("/proc") / str(pid) / "stat").read_text()
                pid = int(stat.rsplit(")", 1)[1].split()[1])
                if pid == me:
                    found.add(int(entry.name))
                    break
        except (OSError, ValueError, IndexError):
            continue  # the process exited while we looked
    return found


@pytest.fixture(scope="module")
def procs():
    from monarch.actor import this_host

    from weightbridge.monarch_transport import configure_transport

    configure_transport()
    meshes = []
    try:
        meshes.append(this_host().spawn_procs(per_host={"worker": 4}, name="trainer"))
        meshes.append(this_host().spawn_procs(per_host={"worker": 4}, name="rollout"))
        yield tuple(meshes)
    finally:
        for mesh in meshes:
            mesh.stop().get(timeout=60)


@pytest.mark.parametrize("trainer,rollout", [
    ("nodes=1,gpus=4,tp=2,ep=2", "engines=2,nodes=1,gpus=2,tp=2"),  # TP mismatch, 2 replicas
    ("nodes=1,gpus=4,ep=4", "engines=2,nodes=1,gpus=2,ep=2"),       # EP4 -> EP2 engines
    ("nodes=2,gpus=2,tp=2", "engines=4,nodes=1,gpus=1"),            # DP2 x TP2 -> 4 TP1 engines
], ids=["tp2ep2-to-2xtp2", "ep4-to-2xep2", "dp2tp2-to-4xtp1"])
def test_rollouts_are_bit_identical_to_their_loader_after_each_update(procs, trainer, rollout):
    with MeshTransfer(TrainerSpec.parse(trainer), RolloutSpec.parse(rollout), "tiny",
                      round_bytes=ROUND_BYTES, procs=procs) as mt:
        plan = mt.connect()
        assert plan.num_rounds > 2
        for version in (1, 2):
            report = mt.update(version)
            assert not report.mismatched, report.line()
            assert report.num_params > 0 and report.rdma_bytes > 0


class SkipsExpertTrainer(TrainerActor):
    """A trainer whose loader drops expert 0 of layer 0: no trainer holds those tensors."""

    def _make_shard(self, config, spec, index):
        shard = super()._make_shard(config, spec, index)
        load = shard.load_weights
        shard.load_weights = lambda weights: load(
            (n, w) for n, w in weights if not n.startswith("model.layers.0.mlp.experts.0."))
        return shard


def test_a_rollout_tensor_no_trainer_holds_fails_in_connect_and_meshes_stop():
    before = _bootstrap_children()
    mt = MeshTransfer(TrainerSpec.parse("nodes=1,gpus=2,ep=2"),
                      RolloutSpec.parse("engines=1,nodes=1,gpus=1"), "tiny",
                      round_bytes=ROUND_BYTES, trainer_actor=SkipsExpertTrainer)
    with pytest.raises(LayoutError, match="experts.0"):
        with mt:
            assert len(_bootstrap_children() - before) == 3
            mt.connect()
    assert mt.plan is None  # failed while planning: no worker got a plan or a buffer
    assert _bootstrap_children() - before == set()
