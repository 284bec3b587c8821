"""The pipeline on CUDA parameters, run on the emulated device (`weightbridge.testing.
emulated_cuda`: real values on the host, CUDA's device rules enforced, allocations counted).

Every step from probe to install: the probe (plain, casting and FP8 loaders) gives the same
source map as on the host and adds at most a quarter of the parameter bytes on the device;
bit-exact, always compared on the host.
"""

import gc

import pytest
import torch

from meshes.fp8_rollout import Fp8RolloutShard
from meshes.qwen3_moe import SIZES, RolloutShard, TrainerShard, checkpoint_spec
from weightbridge import TransferConfig, extract_source_map
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


def _worker(side: str, shard) -> TransferWorker:
    return TransferWorker(side, shard.params, shard.load_weights, checkpoint_spec(CONFIG),
                          rank=0, placement=Placement(side), transport=LocalControl().transport,
                          config=TransferConfig())


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
    of every parameter); a trainer gets its weights back bit for bit."""
    shard = (TrainerShard(CONFIG, 2, 0, 2, 1, device="cuda") if side == "trainer" else
             RolloutShard(CONFIG, 2, 0, 1, 0, device="cuda"))
    shard.load_weights(_checkpoint(0).items())
    before = _host(shard.params)
    param_bytes = sum(p.numel() * p.element_size() for p in shard.params.values())
    assert _probe_peak(_worker(side, shard)) <= 0.25 * param_bytes
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
