"""The CUDA path on real Monarch meshes on this host, parameters on the emulated CUDA device
(`weightbridge.testing.emulated_cuda`, activated in each proc by the worker factory or actor):
device parameters, device round buffers and checksums, CUDA's device rules, RDMA (TCP
fallback) into device arenas. Through the controller (`MeshTransfer`) and through
`TransferGroup` (the adapters, round buffers in host memory), bit-exact against each rank's
own loader. Few and small: two trainer procs, one TP2 engine.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from monarch.actor import endpoint

from controller.driver import MeshTransfer
from meshes.actors import RolloutActor, TrainerActor
from meshes.adapter_actors import RLRollout, RLTrainer
from weightbridge.specs import RolloutSpec, TrainerSpec
from meshprocs import close_group, proc_pair
from weightbridge import TransferConfig, TransferGroup
from weightbridge.testing import emulated_cuda

pytestmark = pytest.mark.mesh

CONFIG = TransferConfig(round_bytes=64 << 10, timeout_s=60)


@pytest.fixture(scope="module")
def procs():
    with proc_pair(2, 2) as meshes:
        yield meshes


def _devices(params) -> set[str]:
    return {str(p.device) for p in params.values()}


class DeviceTrainerActor(TrainerActor):  # sync actors (Monarch refuses a mix)
    @endpoint
    def devices(self) -> set[str]:
        return _devices(self.parts.params)


class DeviceRolloutActor(RolloutActor):
    @endpoint
    def devices(self) -> set[str]:
        return _devices(self.parts.params)


def test_the_controller_moves_cuda_parameters_bit_exact(procs):
    with MeshTransfer(TrainerSpec.parse("nodes=1,gpus=2,tp=2"),
                      RolloutSpec.parse("engines=1,nodes=1,gpus=2,tp=2"),
                      "meshes.workers:tiny_emulated_cuda", config=CONFIG, procs=procs,
                      trainer_actor=DeviceTrainerActor, rollout_actor=DeviceRolloutActor) as mt:
        mt.connect()
        for side in (mt.trainers, mt.rollouts):
            assert all(d == {"cuda:0"} for d in side.devices.call().get().values())
        for version in (1, 2):
            report = mt.update(version)
            assert not report.mismatched, report.line()
            assert report.num_params > 0 and report.rdma_bytes > 0


class EmulatedTrainer(RLTrainer):
    def _device(self) -> torch.device:
        emulated_cuda.activate()
        return torch.device("cuda")

    @endpoint
    def devices(self) -> set[str]:
        return _devices(self.shard.params)


class EmulatedRollout(RLRollout):
    _device = EmulatedTrainer._device
    devices = EmulatedTrainer.devices


def test_a_transfer_group_moves_cuda_parameters_bit_exact(procs):
    tp, rp = procs
    # Round buffers in host memory this time (`TransferConfig.arenas`; the controller test
    # keeps them on the device).
    config = dataclasses.replace(CONFIG, arenas="host")
    group = TransferGroup.spawn(tp, rp, engine_size=2, config=config)
    trainers = rollouts = None
    try:
        trainers = tp.spawn("trainer_cuda", EmulatedTrainer, "tiny", 2)
        rollouts = rp.spawn("rollout_cuda", EmulatedRollout, "tiny", 2)
        for f in [trainers.setup.call(group), rollouts.setup.call(group)]:
            f.get()
        for side in (trainers, rollouts):
            assert all(d == {"cuda:0"} for d in side.devices.call().get().values())
        trainers.connect.call().get()
        history = {}
        for version in (1, 2):
            history[version] = None
            sent = trainers.train_and_send.call(version)  # sync: returns once installed
            held = rollouts.wait_version.call(version, history).get()
            sent.get()
            assert list(held.values()) == [(version, True)] * 2
    finally:
        close_group(group, trainers, rollouts)
