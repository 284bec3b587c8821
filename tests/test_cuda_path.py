"""The pipeline on CUDA parameters, run on the emulated device (`weightbridge.testing.
emulated_cuda`: real values on the host, CUDA's device rules enforced, allocations counted).

Every step from probe to install: the probe (plain, casting and FP8 loaders) gives the same
source map as on the host and adds at most a quarter of the parameter bytes on the device;
bit-exact, always compared on the host.
"""

import functools
import gc
import threading
import time

import pytest
import moegroup
import tinygroup
import torch

from meshes.fp8_rollout import Fp8RolloutShard
from meshes.qwen3_moe import SIZES, RolloutShard, TrainerShard, checkpoint_spec
from weightbridge import (CheckpointSpec, LayoutError, ReceiverAdapter, TransferConfig,
                          extract_source_map, plan_transfer, run_plan_locally)
from weightbridge.discovery.replay import replay
from weightbridge.execution.cpu_kernels import CpuCopyKernels
from weightbridge.execution.executor import WorkerExecutor
from weightbridge.coordination.local_control import LocalControl
from weightbridge.coordination.worker import TransferWorker, UnsourcedParameter
from weightbridge.types import Placement
from weightbridge.testing import emulated_cuda

CONFIG = SIZES["tiny"]


@pytest.fixture(autouse=True)
def emulated():
    with emulated_cuda.active():
        yield


def _host(params):
    return {n: p.cpu() for n, p in params.items()}


PROBED = {
    "plain": (lambda device: RolloutShard(CONFIG, 2, 1, 1, 0, device=device),
              checkpoint_spec(CONFIG)),
    "casting bf16->fp32": (lambda device: TrainerShard(CONFIG, 2, 0, 2, 1, dtype=torch.float32,
                                                       device=device), checkpoint_spec(CONFIG)),
    "casting fp32->bf16": (lambda device: RolloutShard(CONFIG, 2, 0, 1, 0, device=device),
                           checkpoint_spec(CONFIG, "float32")),
    "fp8": (lambda device: Fp8RolloutShard(CONFIG, 2, 0, 1, 0, block=(32, 32), device=device),
            checkpoint_spec(CONFIG)),
}


@pytest.mark.parametrize("case", list(PROBED))
@pytest.mark.slow
def test_the_probe_maps_cuda_parameters_as_host_ones(case):
    make, spec = PROBED[case]
    host = make("cpu")
    want = extract_source_map(host.params, host.load_weights, spec)
    shard = make("cuda")
    assert all(p.is_cuda for p in shard.params.values())
    assert extract_source_map(shard.params, shard.load_weights, spec) == want


def _checkpoint(version: int, spec=checkpoint_spec(CONFIG)) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + version)
    return {t.name: torch.randn(t.shape, generator=gen).to(getattr(torch, t.dtype))
            for t in spec.tensors}


def _worker(side: str, shard, config: TransferConfig | None = None) -> TransferWorker:
    return TransferWorker(side, shard.params, shard.load_weights, checkpoint_spec(CONFIG),
                          rank=0, placement=Placement(side), transport=LocalControl().transport,
                          config=config or TransferConfig())


def _probe_peak(worker: TransferWorker) -> int:
    """Peak device bytes the worker's probe adds to what is allocated before it."""
    gc.collect()
    before = emulated_cuda.memory.current
    emulated_cuda.memory.reset_peak()
    worker.on_source_map()
    return emulated_cuda.memory.peak - before


@pytest.mark.parametrize("side", ["trainer", "rollout"])
def test_the_probe_keeps_no_second_copy_on_the_device(side):
    """At most 0.25x the parameter bytes of extra device memory (it was 1.0x: a device clone
    of every parameter); a trainer that asks for the host copy gets its weights back bit for
    bit."""
    shard = (TrainerShard(CONFIG, 2, 0, 2, 1, device="cuda") if side == "trainer" else
             RolloutShard(CONFIG, 2, 0, 1, 0, device="cuda"))
    shard.load_weights(_checkpoint(0).items())
    before = _host(shard.params)
    param_bytes = sum(p.numel() * p.element_size() for p in shard.params.values())
    config = TransferConfig(trainer_restore="host-copy")
    assert _probe_peak(_worker(side, shard, config)) <= 0.25 * param_bytes
    if side == "trainer":
        assert all(torch.equal(shard.params[n].cpu().view(torch.uint8), t.view(torch.uint8))
                   for n, t in before.items())


def test_a_rollout_parameter_no_checkpoint_element_lands_in_is_named():
    """A rollout keeps no copy: a parameter the loader never writes is left zero, said by name."""
    shard = RolloutShard(CONFIG, 1, 0, 1, 0, device="cuda")
    shard.params["rotary.inv_freq"] = torch.full((16,), 7.0, device="cuda")
    with pytest.warns(UnsourcedParameter, match="rotary.inv_freq"):
        _worker("rollout", shard).on_source_map()
    assert not shard.params["rotary.inv_freq"].cpu().any()


# --------------------------------------------------------------------------------------------
# Adapters (every mode, checksums on), delta updates and a join, on CUDA parameters: the
# in-process adapter tests' groups with their shards and models built on the device.
# --------------------------------------------------------------------------------------------


class CudaModel(tinygroup.Model):
    """tinygroup's whole-model rank with its parameters on the device."""

    def __init__(self):
        super().__init__()
        self.params = {n: p.to("cuda") for n, p in self.params.items()}

    def holds(self, version: int) -> bool:
        return all(torch.equal(p.cpu().view(torch.uint8),
                               tinygroup.checkpoint(version)[n].view(torch.uint8))
                   for n, p in self.params.items())


@pytest.fixture
def on_device(monkeypatch):
    """The adapter tests' groups, built on the device (compared on the host)."""
    same = moegroup.same_bits
    monkeypatch.setattr(moegroup, "TrainerShard",
                        functools.partial(TrainerShard, device="cuda"))
    monkeypatch.setattr(moegroup, "RolloutShard",
                        functools.partial(RolloutShard, device="cuda"))
    monkeypatch.setattr(moegroup, "same_bits", lambda params, want: same(_host(params), want))
    monkeypatch.setattr(tinygroup, "Model", CudaModel)


@pytest.mark.parametrize("arenas", ["device", "host"])
@pytest.mark.parametrize("mode", list(moegroup.MODES))
@pytest.mark.slow
def test_every_mode_installs_bit_exact_versions_on_cuda_parameters(on_device, mode, arenas):
    ss, rs = moegroup.MODES[mode]
    config = TransferConfig(timeout_s=30, sender_staging=ss, receiver_staging=rs,
                            checksums=True, arenas=arenas)
    control, trainers, rollouts, _ = moegroup.run_versions(config)
    assert all(p.is_cuda for shard, _ in trainers + rollouts for p in shard.params.values())
    assert all(a.version == moegroup.NUM_VERSIONS for _, a in rollouts)
    for _, a in trainers + rollouts:  # round buffers where the config puts them
        assert all(arena.is_cuda == (arenas == "device") for arena in a.executor.arenas)


@pytest.mark.parametrize("mode", ["sync", "rs"])
def test_delta_updates_and_a_join_on_cuda_parameters(on_device, mode):
    """Full, then delta updates; an engine joins between two deltas and gets every tensor;
    another leaves: every rollout bit-exact, all on the device."""
    ss, rs = tinygroup.MODES[mode]
    config = TransferConfig(timeout_s=30, sender_staging=ss, receiver_staging=rs)
    control, trainers, rollouts = tinygroup.build(config)
    assert all(p.is_cuda for m, _ in trainers + rollouts for p in m.params.values())
    tinygroup.connect(trainers)
    held = {}  # tensor -> the version whose value every live rollout must hold

    def delta(v, changed, which):
        def one(model, adapter):
            model.load_weights((n, tinygroup.checkpoint(v)[n])
                               for n in changed or tinygroup.SHAPES)
            adapter.send_weights(v, changed=changed)
        held.update(dict.fromkeys(changed or tinygroup.SHAPES, v))
        polls = [lambda a=a: a.wait_for_version(v) for _, a in which]
        assert tinygroup.in_threads(*[lambda m=m, a=a: one(m, a) for m, a in trainers],
                                    *polls)[2:] == [v] * len(which)
        for m, _ in which:
            host = _host(m.params)
            assert all(torch.equal(host[n].view(torch.uint8),
                                   tinygroup.checkpoint(u)[n].view(torch.uint8))
                       for n, u in held.items())

    delta(1, None, rollouts)
    delta(2, ["w"], rollouts)
    joined = CudaModel()
    rollouts.append((joined, control.add(ReceiverAdapter(
        joined.params, joined.load_weights, tinygroup.SPEC, rank=2, engine=2, engine_rank=0,
        engine_size=1, control=control, transport=control.transport, config=config))))
    assert tinygroup.in_threads(*[a.add_engines for _, a in trainers]) == [None, None]
    delta(3, ["v"], rollouts)  # the new engine needs every tensor: they all move
    assert tinygroup.in_threads(*[lambda a=a: a.remove_engine(0) for _, a in trainers]) \
        == [None, None]
    delta(4, ["m"], rollouts[1:])
    assert held == {"w": 2, "v": 3, "m": 4}


# --------------------------------------------------------------------------------------------
# Replay, plan and run_plan_locally
# --------------------------------------------------------------------------------------------


def _maps(make_trainer, make_rollout, spec):
    def probed(shard):
        return extract_source_map(shard.params, shard.load_weights, spec)
    return ([(probed(make_trainer(i, "cpu")), Placement("t0")) for i in range(2)],
            [(probed(make_rollout(k, "cpu")), Placement("r0", engine=0)) for k in range(2)])


TRAINER = lambda i, device: TrainerShard(CONFIG, 2, i, 1, 0, device=device)  # noqa: E731
ROLLOUT = lambda k, device: RolloutShard(CONFIG, 2, k, 1, 0, device=device)  # noqa: E731


def test_replay_fills_cuda_parameters_as_their_loader_does():
    spec = checkpoint_spec(CONFIG)
    ckpt = _checkpoint(3)
    want = ROLLOUT(1, "cpu")
    want.load_weights(ckpt.items())
    host_shard = ROLLOUT(1, "cpu")
    smap = extract_source_map(host_shard.params, host_shard.load_weights, spec)
    got = ROLLOUT(1, "cuda")
    replay(smap, got.params, ckpt)
    host = _host(got.params)
    assert all(torch.equal(host[n].view(torch.uint8), want.params[n].view(torch.uint8))
               for n in want.params)


@pytest.mark.parametrize("kernels", [None, CpuCopyKernels()], ids=["torch", "cpu-path"])
@pytest.mark.slow
def test_run_plan_locally_moves_cuda_parameters_bit_exact(kernels):
    spec = checkpoint_spec(CONFIG)
    trainers, rollouts = _maps(TRAINER, ROLLOUT, spec)
    plan = plan_transfer(trainers, rollouts, round_bytes=64 << 10)
    ckpt = _checkpoint(4)
    tshards = [TRAINER(i, "cuda") for i in range(2)]
    for s in tshards:
        s.load_weights(ckpt.items())
    rshards = [ROLLOUT(k, "cuda") for k in range(2)]
    run_plan_locally(plan, [s.params for s in tshards], [s.params for s in rshards],
                     kernels=kernels)
    for k, shard in enumerate(rshards):
        want = ROLLOUT(k, "cpu")
        want.load_weights(ckpt.items())
        host = _host(shard.params)
        assert all(torch.equal(host[n].view(torch.uint8), want.params[n].view(torch.uint8))
                   for n in want.params)


def test_the_demo_actors_hash_cuda_parameters_on_the_host():
    """meshes/ never calls .numpy() on a device parameter (CUDA refuses it)."""
    from meshes.actors import checksums
    from meshes.adapter_actors import digest

    shard = RolloutShard(CONFIG, 2, 0, 1, 0, device="cuda")
    shard.load_weights(_checkpoint(5).items())
    host = _host(shard.params)
    assert checksums(shard.params) == checksums(host)
    assert digest(shard.params) == digest(host)


# --------------------------------------------------------------------------------------------
# Device binding (meshes.device): a proc's GPU from its place on its host
# --------------------------------------------------------------------------------------------


def test_a_proc_binds_the_gpu_of_its_place_on_its_host(monkeypatch):
    from monarch.actor import Extent, Point

    from meshes.device import bind_local_device

    bound = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", bound.append)
    hosts = Extent(["hosts", "gpus"], [2, 4])
    assert bind_local_device(Point(6, hosts)) == torch.device("cuda", 2)  # host 1, gpu 2
    assert bind_local_device(Point(1, Extent(["worker"], [2]))) == torch.device("cuda", 1)
    assert bound == [torch.device("cuda", 2), torch.device("cuda", 1)]


def test_without_cuda_a_proc_uses_the_cpu():
    from meshes.device import bind_local_device

    assert bind_local_device() == torch.device("cpu")


def test_arenas_take_device_or_host_only():
    assert TransferConfig().arenas == "device"
    with pytest.raises(ValueError, match="arenas must be one of"):
        TransferConfig(arenas="gpu")


def test_host_arenas_keep_one_round_of_device_scratch():
    """``arenas="host"``: depth round buffers in host memory, one round on the device."""
    spec = checkpoint_spec(CONFIG)
    trainers, rollouts = _maps(TRAINER, ROLLOUT, spec)
    plan = plan_transfer(trainers, rollouts, round_bytes=64 << 10)
    shard = TRAINER(0, "cuda")

    def device_bytes(host_arenas: bool) -> tuple[WorkerExecutor, int]:
        gc.collect()
        before = emulated_cuda.memory.current
        ex = WorkerExecutor(plan.for_worker(plan.workers[0]), shard.params, CpuCopyKernels(),
                            depth=3, host_arenas=host_arenas)
        return ex, emulated_cuda.memory.current - before

    on_device, device_arenas = device_bytes(False)
    on_host, host_arenas = device_bytes(True)
    assert all(a.is_cuda for a in on_device.arenas) and not any(a.is_cuda for a in on_host.arenas)
    assert device_arenas - host_arenas == 2 * on_host.plan.buffer_bytes  # 3 arenas -> 1 round


def test_host_arenas_assemble_one_round_at_a_time_through_the_scratch():
    """Rounds land on several threads at once: a round's bytes must stay in the device
    scratch while its assemble reads them (a second round copied in meanwhile corrupted the
    first on meshes)."""
    spec = checkpoint_spec(CONFIG)
    trainers, rollouts = _maps(TRAINER, ROLLOUT, spec)
    plan = plan_transfer(trainers, rollouts, round_bytes=64 << 10)
    rollout = next(w for w in plan.workers if w.side == "rollout")
    torn = []

    class Slow(CpuCopyKernels):
        def assemble(self, table, buffer):
            first = buffer[:64].cpu()
            time.sleep(0.3)  # the other round's thread runs meanwhile
            torn.append(not torch.equal(first, buffer[:64].cpu()))
            super().assemble(table, buffer)

    ex = WorkerExecutor(plan.for_worker(rollout), ROLLOUT(0, "cuda").params, Slow(),
                        host_arenas=True)
    rounds = [r.index for r in ex.plan.rounds if r.assemble][:2]
    for r in rounds:
        ex.arena(r).fill_(r + 1)
    threads = [threading.Thread(target=ex.assemble, args=(r,)) for r in rounds]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "an assemble hung"
    assert torn == [False, False]


@pytest.mark.parametrize("loader", ["scales", "abs"])
def test_a_loader_that_changes_values_is_refused_on_cuda_parameters_as_on_the_host(loader):
    """The refusal path (its diagnosis reloads markers) runs on device parameters too."""
    ckpt = {"a": torch.randn(8, 16).bfloat16(), "b": torch.randn(4, 16).bfloat16()}
    spec = CheckpointSpec.from_tensors(ckpt)

    def build(device):
        w = torch.zeros(12, 16, dtype=torch.bfloat16, device=device)

        def load_weights(weights):
            for name, t in weights:
                rows = slice(0, 8) if name == "a" else slice(8, 12)
                w[rows].copy_(t * 2 if loader == "scales" else t.abs())
        return {"w": w}, load_weights

    messages = []
    for device in ("cpu", "cuda"):
        params, load_weights = build(device)
        with pytest.raises(LayoutError) as e:
            extract_source_map(params, load_weights, spec)
        messages.append(str(e.value))
    assert messages[0] == messages[1]
