"""Real engines in Monarch actors: torchtitan trainers and vLLM rollout engines behind the adapters.

These are a user's own actors as docs/integration.md describes them: plain sync actors; each
proc builds its engine (`TitanWorker` or `VllmWorker`, in its own torch.distributed group) and
hands the engine's live parameters and own ``load_weights`` to ``group.sender`` /
``group.receiver`` of a `weightbridge.TransferGroup`, whose agents serve the adapters' calls on
each other (`weightbridge.mesh.control`). Nothing here knows a layout: the probe discovers
both sides from the engines' loaders.

    trainer mesh: one gloo group over all trainer procs (FSDP2 x TP x EP)
    rollout mesh: one gloo group per engine (its TP ranks), ranks engine * tp + i

Ranks are the actors' flat ranks in their meshes: call ``setup`` on the whole mesh.

Typical usage: `examples/engines/transfer.py`.
"""

from __future__ import annotations

import time

import torch
from monarch.actor import Actor, current_rank, endpoint

from examples.engines import models


def check_engine_size(group, tp: int) -> None:
    """Refuse a transfer group whose engines are not of this engine's TP degree."""
    if group.engine_size != tp:
        raise ValueError(f"the transfer group has engines of {group.engine_size} ranks but "
                         f"these vLLM engines have TP {tp}; pass engine_size={tp} to "
                         f"TransferGroup.spawn")


def close_all(group, meshes) -> None:
    """Close the transfer group, then each actor mesh (its ``close`` endpoint, then stop), last
    spawned first; every one is closed even if an earlier one fails (the first error is
    raised)."""
    try:
        group.close()
    finally:
        for mesh in reversed(meshes):
            try:
                mesh.close.call().get(timeout=60)
            finally:
                mesh.stop().get(timeout=60)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8).clone()


class EngineTrainer(Actor):
    """One torchtitan trainer rank; ``degrees`` are TitanWorker's dp_shard / tp / ep."""

    def __init__(self, model: str, degrees: dict, master_port: int):
        torch.set_num_threads(1)
        self.model, self.degrees, self.master_port = model, degrees, master_port
        self.worker = None

    @endpoint
    def setup(self, group) -> None:
        """Build this rank of the trainer (collective over the trainer mesh: call on the whole
        mesh), then its adapter."""
        from examples.engines.titan_trainer import TitanWorker

        self.worker = TitanWorker(self.model, rank=current_rank().rank,
                                  world_size=group.num_trainers, master_port=self.master_port,
                                  **self.degrees)
        # Start from checkpoint 0, as a trainer resumes from disk (before the adapter takes the
        # parameters: FSDP2 may re-point a local tensor after a load that replaced storage).
        self.worker.load_weights(models.checkpoint(self.model, 0).items())
        self.adapter = group.sender(self.worker.params, self.worker.load_weights,
                                    models.checkpoint_spec(self.model))

    @endpoint
    def connect(self) -> float:
        """Every trainer calls it; rank 0 probes all workers and plans. Returns seconds."""
        start = time.monotonic()
        self.adapter.connect()
        return time.monotonic() - start

    @endpoint
    def plan_summary(self) -> str | None:
        """Rank 0: the plan's byte accounting (`TransferPlan.summary`); None on other ranks."""
        return None if self.adapter.plan is None else self.adapter.plan.summary()

    @endpoint
    def train_and_send(self, version: int) -> float:
        """Load checkpoint ``version`` through torchtitan's HF path (the stand-in optimizer step,
        collective), then send_weights. Returns send_weights' seconds."""
        self.worker.load_weights(models.checkpoint(self.model, version).items())
        start = time.monotonic()
        self.adapter.send_weights(version)
        return time.monotonic() - start

    @endpoint
    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()


class EngineRollout(Actor):
    """One vLLM rank of an engine of ``tp`` ranks; ``master_ports[e]`` is engine e's group."""

    def __init__(self, model: str, tp: int, enable_expert_parallel: bool,
                 master_ports: list[int]):
        torch.set_num_threads(1)
        self.model, self.tp, self.ep = model, tp, enable_expert_parallel
        self.master_ports = master_ports
        self.worker = None

    @endpoint
    def setup(self, group) -> None:
        """Build this rank's share of its engine (collective over the engine: call on the whole
        mesh), then its adapter. The engine starts from checkpoint version 0, as if loaded from
        disk at start-up."""
        from examples.engines.vllm_rollout import VllmWorker

        check_engine_size(group, self.tp)
        engine, engine_rank = divmod(current_rank().rank, group.engine_size)
        self.worker = VllmWorker(self.model, rank=engine_rank, world_size=group.engine_size,
                                 master_port=self.master_ports[engine],
                                 enable_expert_parallel=self.ep,
                                 weights=models.checkpoint(self.model, 0).items())
        self.adapter = group.receiver(self.worker.params, self.worker.load_weights,
                                      models.checkpoint_spec(self.model))

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

    @endpoint
    def serve(self, version: int, timeout_s: float) -> list[int]:
        """poll_requests() until ``version`` is installed; returns the versions installed."""
        return self._serve(version, timeout_s)

    def _check(self, version: int) -> list[str]:
        transferred = {n: _bits(p) for n, p in self.worker.params.items()}
        self.worker.load_weights(models.checkpoint(self.model, version).items())
        return sorted(n for n, p in self.worker.params.items()
                      if not torch.equal(transferred[n], _bits(p)))

    @endpoint
    def check(self, version: int) -> tuple[int, list[str]]:
        """Compare the transferred parameters with vLLM loading checkpoint ``version`` itself
        (bits). Returns (parameters compared, names that differ); leaves vLLM's own load."""
        return len(self.worker.params), self._check(version)

    @endpoint
    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
