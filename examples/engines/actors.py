"""Real engines in Monarch actors: torchtitan trainers and vLLM rollout engines behind the adapters.

These are a user's own actors as docs/integration.md describes them: each proc builds its engine
(`TitanWorker` or `VllmWorker`, in its own torch.distributed group), hands the engine's live
parameters and own ``load_weights`` to a `SenderAdapter` / `ReceiverAdapter`, and the adapters
talk to each other over the ``wb`` endpoint (`meshes.adapter_actors`). Nothing here knows a
layout: the probe discovers both sides from the engines' loaders.

    trainer mesh: one gloo group over all trainer procs (FSDP2 x TP x EP)
    rollout mesh: one gloo group per engine (its TP ranks), ranks engine * tp + i

Typical usage: `examples/engines/transfer.py`.
"""

from __future__ import annotations

import asyncio
import time

import torch
from monarch.actor import concurrent_endpoint

from examples.engines import models
from meshes.adapter_actors import _AdapterActor, mesh_wiring
from weightbridge.adapters import AdapterOptions, ReceiverAdapter, SenderAdapter


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8).clone()


class EngineTrainer(_AdapterActor):
    """One torchtitan trainer rank; ``degrees`` are TitanWorker's dp_shard / tp / ep."""

    def __init__(self, model: str, degrees: dict, master_port: int):
        torch.set_num_threads(1)
        self.model, self.degrees, self.master_port = model, degrees, master_port

    @concurrent_endpoint
    async def setup(self, rank: int, trainers, rollouts, topology: tuple[int, int, int],
                    options: AdapterOptions) -> None:
        """Build this rank of the trainer (collective over the trainer mesh), then its adapter."""
        from examples.engines.titan_trainer import TitanWorker

        self.worker = await asyncio.to_thread(
            TitanWorker, self.model, rank=rank, world_size=topology[0],
            master_port=self.master_port, **self.degrees)
        # Start from checkpoint 0, as a trainer resumes from disk (before the adapter takes the
        # parameters: FSDP2 may re-point a local tensor after a load that replaced storage).
        await asyncio.to_thread(self.worker.load_weights, models.checkpoint(self.model, 0).items())
        self.adapter = SenderAdapter(
            self.worker.params, self.worker.load_weights, models.checkpoint_spec(self.model),
            rank=rank, **mesh_wiring(trainers, rollouts, topology, options))

    @concurrent_endpoint
    async def connect(self) -> float:
        """Every trainer calls it; rank 0 probes all workers and plans. Returns seconds."""
        start = time.monotonic()
        await asyncio.to_thread(self.adapter.connect)
        return time.monotonic() - start

    @concurrent_endpoint
    async def plan_summary(self) -> str:
        """Rank 0: the plan's byte accounting (`TransferPlan.summary`)."""
        return self.adapter.plan.summary()

    @concurrent_endpoint
    async def train_and_send(self, version: int) -> float:
        """Load checkpoint ``version`` through torchtitan's HF path (the stand-in optimizer step,
        collective), then send_weights. Returns send_weights' seconds."""
        state = models.checkpoint(self.model, version)
        await asyncio.to_thread(self.worker.load_weights, state.items())
        start = time.monotonic()
        await asyncio.to_thread(self.adapter.send_weights, version)
        return time.monotonic() - start

    @concurrent_endpoint
    async def close(self) -> None:
        await asyncio.to_thread(self.worker.close)


class EngineRollout(_AdapterActor):
    """One vLLM rank of an engine of ``tp`` ranks; ``master_ports[e]`` is engine e's group."""

    def __init__(self, model: str, tp: int, enable_expert_parallel: bool,
                 master_ports: list[int]):
        torch.set_num_threads(1)
        self.model, self.tp, self.ep = model, tp, enable_expert_parallel
        self.master_ports = master_ports

    @concurrent_endpoint
    async def setup(self, rank: int, trainers, rollouts, topology: tuple[int, int, int],
                    options: AdapterOptions) -> None:
        """Build this rank's share of its engine (collective over the engine), then its adapter.
        The engine starts from checkpoint version 0, as if loaded from disk at start-up."""
        from examples.engines.vllm_rollout import VllmWorker

        _, _, engine_size = topology
        engine, engine_rank = divmod(rank, engine_size)
        self.worker = await asyncio.to_thread(
            VllmWorker, self.model, rank=engine_rank, world_size=engine_size,
            master_port=self.master_ports[engine], enable_expert_parallel=self.ep,
            weights=models.checkpoint(self.model, 0).items())
        self.adapter = ReceiverAdapter(
            self.worker.params, self.worker.load_weights, models.checkpoint_spec(self.model),
            rank=rank, engine=engine, engine_rank=engine_rank, engine_size=engine_size,
            **mesh_wiring(trainers, rollouts, topology, options))

    def _serve(self, version: int, timeout_s: float) -> list[int]:
        installed, end = [], time.monotonic() + timeout_s
        while self.adapter.version < version:
            if time.monotonic() > end:
                raise TimeoutError(f"rollout {self.adapter.worker}: version {version} not "
                                   f"installed within {timeout_s}s (has {self.adapter.version})")
            v = self.adapter.poll_requests()  # between inference steps, in a real engine
            if v is None:
                time.sleep(0.005)
            else:
                installed.append(v)
        return installed

    @concurrent_endpoint
    async def serve(self, version: int, timeout_s: float) -> list[int]:
        """poll_requests() until ``version`` is installed; returns the versions installed."""
        return await asyncio.to_thread(self._serve, version, timeout_s)

    def _check(self, version: int) -> list[str]:
        transferred = {n: _bits(p) for n, p in self.worker.params.items()}
        self.worker.load_weights(models.checkpoint(self.model, version).items())
        return sorted(n for n, p in self.worker.params.items()
                      if not torch.equal(transferred[n], _bits(p)))

    @concurrent_endpoint
    async def check(self, version: int) -> tuple[int, list[str]]:
        """Compare the transferred parameters with vLLM loading checkpoint ``version`` itself
        (bits). Returns (parameters compared, names that differ); leaves vLLM's own load."""
        return len(self.worker.params), await asyncio.to_thread(self._check, version)

    @concurrent_endpoint
    async def close(self) -> None:
        await asyncio.to_thread(self.worker.close)
