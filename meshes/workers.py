"""The demo model as worker factories: what `python -m controller` runs by default.

A worker factory builds one rank's `weightbridge.WorkerParts` from (side, mesh spec, rank);
the controller runs any factory named by import path (``--workers module:factory``). These
build the Qwen3-MoE-shaped model of `meshes.qwen3_moe` at each named size: trainers in the
Megatron-like or FSDP layout of their `TrainerSpec`, rollouts in the inference layout of their
`RolloutSpec`, and a deterministic checkpoint per version (one generator seed per tensor and
version, so no worker materializes more than it reads).

Typical usage::

    parts = tiny("rollout", RolloutSpec.parse("engines=2,gpus=2,tp=2"), rank=3)
"""

from __future__ import annotations

import functools
from typing import Iterable, Iterator

import torch

from meshes.device import bind_local_device
from meshes.fp8_rollout import Fp8RolloutShard
from meshes.qwen3_moe import SIZES, MoEConfig, RolloutShard, checkpoint_spec
from meshes.spec import trainer_shard
from weightbridge.specs import RolloutSpec, TrainerSpec
from weightbridge import WorkerParts


def checkpoint(config: MoEConfig, version: int, names: Iterable[str] | None = None, *,
               dtype: torch.dtype = torch.bfloat16) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint of ``version`` in ``dtype``; ``names`` restricts it to the tensors a
    worker reads."""
    wanted = None if names is None else set(names)
    for i, t in enumerate(checkpoint_spec(config).tensors):
        if wanted is None or t.name in wanted:
            gen = torch.Generator().manual_seed(version * 1_000_003 + i)
            yield t.name, torch.randn(t.shape, generator=gen).to(dtype)


def qwen3_moe(size: str, side: str, spec: TrainerSpec | RolloutSpec, rank: int, *,
              trainer_dtype: torch.dtype = torch.bfloat16,
              fp8_block: tuple[int, int] | None = None,
              device: torch.device | str | None = None) -> WorkerParts:
    """Rank ``rank`` of the demo model of size ``size`` (a key of `SIZES`). The trainers hold
    ``trainer_dtype`` parameters and the checkpoint is written in it; the rollouts are bf16
    and cast it on load, or with ``fp8_block`` quantize their attention projections and
    experts to block-scaled FP8 (`meshes.fp8_rollout`). Parameters live on ``device``
    (default: this proc's own GPU where CUDA is available, `meshes.device.bind_local_device`,
    else the CPU); checkpoints are made on the host."""
    config = SIZES[size]
    spec.validate(config)
    device = bind_local_device() if device is None else device
    if side == "trainer":
        shard = trainer_shard(spec, config, rank, dtype=trainer_dtype, device=device)
    elif fp8_block is not None:
        c = spec.coords(rank)
        shard = Fp8RolloutShard(config, spec.tp, c["tp"], spec.ep, c["ep"], block=fp8_block,
                                device=device)
    else:
        c = spec.coords(rank)
        shard = RolloutShard(config, spec.tp, c["tp"], spec.ep, c["ep"], device=device)
    return WorkerParts(params=shard.params, load_weights=shard.load_weights,
                       spec=checkpoint_spec(config, str(trainer_dtype).removeprefix("torch.")),
                       checkpoint=functools.partial(checkpoint, config, dtype=trainer_dtype))


tiny = functools.partial(qwen3_moe, "tiny")
medium = functools.partial(qwen3_moe, "medium")
small = functools.partial(qwen3_moe, "small")
FACTORIES = {name: f"meshes.workers:{name}" for name in SIZES}
"""Demo model name -> its factory's import path."""
tiny_fp32_trainer = functools.partial(qwen3_moe, "tiny", trainer_dtype=torch.float32)
"""The tiny model with float32 trainers and an fp32 checkpoint (``--workers
meshes.workers:tiny_fp32_trainer``): the bf16 rollouts' loaders cast it, so the plan sends
bfloat16, converted in the trainers' pack."""
tiny_fp8_rollout = functools.partial(qwen3_moe, "tiny", fp8_block=(32, 32))
"""The tiny model with block-scaled FP8 rollouts (``--workers meshes.workers:tiny_fp8_rollout``):
bf16 trainers, rollouts quantizing attention and experts in 32 x 32 blocks (the tiny model's
TP shards are 32-row multiples); the plan sends float8 values and float32 scales, quantized in
the trainers' pack."""


def tiny_emulated_cuda(side: str, spec: TrainerSpec | RolloutSpec, rank: int) -> WorkerParts:
    """The tiny model with its parameters on the emulated CUDA device (``--workers
    meshes.workers:tiny_emulated_cuda``): activates `weightbridge.testing.emulated_cuda` in
    this proc, so the CUDA path (device parameters, device round buffers and checksums, CUDA's
    device rules) runs on meshes without a GPU. A test tool: the torch copy path runs, not
    Triton."""
    from weightbridge.testing import emulated_cuda

    emulated_cuda.activate()
    return qwen3_moe("tiny", side, spec, rank, device="cuda")
