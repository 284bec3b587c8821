"""WorkerExecutor without Monarch: registered ranges as arena views, writes as copies.

The controller's sequence (send, forward EXTERNAL, forward INTERNAL, assemble) run in one
process must give every rollout exactly what its own loader gives.
"""

import pytest
import torch

import weightbridge.execution.executor as executor_module
from meshes.actors import checksums
from meshes.qwen3_moe import SIZES, RolloutShard, TrainerShard, checkpoint_spec
from meshes.workers import checkpoint
from weightbridge import CpuCopyKernels, Placement, extract_source_map, plan_transfer
from weightbridge.types import Stage
from weightbridge.execution.executor import WorkerExecutor, incoming_ranges

CONFIG = SIZES["tiny"]


@pytest.mark.slow
def test_executors_with_copy_writes_match_the_rollouts_own_loader():
    spec = checkpoint_spec(CONFIG)
    trainers = [TrainerShard(CONFIG, 2, r % 2, 2, r // 2) for r in range(4)]
    rollouts = [RolloutShard(CONFIG, 2, r % 2, 1, 0) for r in range(4)]
    tmaps = [extract_source_map(w.params, w.load_weights, spec) for w in trainers]
    rmaps = [extract_source_map(w.params, w.load_weights, spec) for w in rollouts]
    plan = plan_transfer([(m, Placement("t")) for m in tmaps],
                         [(m, Placement(f"r{i // 2}", engine=i // 2)) for i, m in enumerate(rmaps)],
                         round_bytes=64 << 10)
    shards = trainers + rollouts
    ex = {w: WorkerExecutor(plan.for_worker(w), s.params, CpuCopyKernels())
          for w, s in zip(plan.workers, shards)}
    registered = {(w, key): ex[w].arenas[key[0]][key[1]:key[1] + key[2]]
                  for w, keys in incoming_ranges(e.plan for e in ex.values()).items()
                  for key in keys}
    for s in trainers:
        s.load_weights(checkpoint(CONFIG, 5))
    for r in range(plan.num_rounds):
        for e in ex.values():
            e.pack(r)
        for stage in (Stage.RECEIVE, Stage.EXTERNAL, Stage.INTERNAL):
            for e in ex.values():
                for peer, key, src in e.writes(r, stage):
                    registered[(peer, key)].copy_(src)
        for e in ex.values():
            e.assemble(r)
    for s in rollouts:
        want = RolloutShard(CONFIG, s.tp, s.tp_rank, 1, 0)
        want.load_weights(checkpoint(CONFIG, 5))
        assert checksums(s.params) == checksums(want.params)


def _plan_for_one_rollout():
    spec = checkpoint_spec(CONFIG)
    trainer, rollout = TrainerShard(CONFIG, 1, 0, 1, 0), RolloutShard(CONFIG, 1, 0, 1, 0)
    maps = [extract_source_map(w.params, w.load_weights, spec) for w in (trainer, rollout)]
    plan = plan_transfer([(maps[0], Placement("t"))], [(maps[1], Placement("r", engine=0))],
                         round_bytes=256 << 10)
    return plan, trainer, rollout


@pytest.mark.parametrize("depth", [2, 3, 5])
@pytest.mark.slow
def test_the_executor_keeps_depth_arenas_and_writes_round_r_into_arena_r_mod_depth(depth):
    plan, trainer, _ = _plan_for_one_rollout()
    ex = WorkerExecutor(plan.for_worker(plan.workers[0]), trainer.params, depth=depth)
    assert len(ex.arenas) == depth
    for r in range(plan.num_rounds):
        assert ex.arena(r) is ex.arenas[r % depth]
        assert all(key[0] == r % depth for stage in Stage for _, key, _ in ex.writes(r, stage))


def test_the_copy_kernels_follow_the_parameters_device(monkeypatch):
    """Triton on CUDA, the CPU path elsewhere: the executor asks for the kernels of the device
    its parameters are on (no GPU here: the choice is checked, and `default_kernels` gives the
    Triton implementation for a CUDA device that torch can drive; the emulated device, where
    it cannot, keeps the torch path: tests/test_emulated_cuda.py)."""
    from kernels import TritonKernels
    from weightbridge.driver import default_kernels

    seen = []
    real = executor_module.default_kernels
    monkeypatch.setattr(executor_module, "default_kernels",
                        lambda device: seen.append(torch.device(device)) or real(device))
    plan, trainer, _ = _plan_for_one_rollout()
    ex = WorkerExecutor(plan.for_worker(plan.workers[0]), trainer.params)
    assert seen == [torch.device("cpu")] and isinstance(ex.kernels, CpuCopyKernels)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert isinstance(default_kernels(torch.device("cuda", 0)), TritonKernels)
    assert isinstance(default_kernels("cpu"), CpuCopyKernels)


def test_pack_and_assemble_launch_on_the_parameters_gpu(monkeypatch):
    """The library serves its calls on threads of its own, whose current CUDA device is GPU 0
    whatever the proc bound: on a real GPU, pack and assemble run under a guard of the
    parameters' device (Triton launches on the current device). Checked by recording the
    guard (no GPU here)."""
    entered = []

    class Guard:
        def __init__(self, device):
            self.device = device

        def __enter__(self):
            entered.append(self.device)

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(executor_module, "on_real_cuda", lambda device: True)
    monkeypatch.setattr(torch.cuda, "device", Guard)
    plan, trainer, _ = _plan_for_one_rollout()
    wplan = plan.for_worker(plan.workers[0])
    ex = WorkerExecutor(wplan, trainer.params, CpuCopyKernels())
    ex.pack(next(r.index for r in wplan.rounds if r.pack))
    assert entered == [ex.device]
