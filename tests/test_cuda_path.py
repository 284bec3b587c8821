"""The pipeline on CUDA parameters, run on the emulated device (`weightbridge.testing.
emulated_cuda`: real values on the host, CUDA's device rules enforced, allocations counted).

Every step from probe to install: the probe (plain, casting and FP8 loaders) gives the same
source map as on the host; bit-exact, always compared on the host.
"""

import pytest
import torch

from meshes.fp8_rollout import Fp8RolloutShard
from meshes.qwen3_moe import SIZES, RolloutShard, TrainerShard, checkpoint_spec
from weightbridge import extract_source_map
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
