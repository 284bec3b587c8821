"""Trainer and rollout actors: thin Monarch wrappers over a shard and a `WorkerExecutor`.

Each actor builds its own shard from (model name, mesh spec text, its rank in the mesh), probes
its own ``load_weights`` for the controller, and at connect builds its copy tables and two round
arenas once. Rollouts register the arena ranges peers write into as RDMA buffers and return the
handles; the controller hands every writer the handles it needs. Per update the controller calls
``send`` (trainers: pack + RECEIVE writes), ``forward`` (rollouts: EXTERNAL, then INTERNAL
writes straight out of the receive arena) and ``assemble`` round by round.

Endpoints are plain ``def``: the actors are sync (each endpoint runs on the actor's own thread,
one message at a time), so waiting on RDMA futures with ``.get()`` is fine in them.

Typical usage (see controller/driver.py)::

    trainers = procs.spawn("trainer", TrainerActor, "tiny", "nodes=1,gpus=4,tp=2,ep=2")
    maps = trainers.source_map.call().get()
"""

from __future__ import annotations

import hashlib
import time
from typing import Iterable, Iterator, Mapping

import torch
from monarch.actor import Actor, current_rank, endpoint

from meshes.forward import rank_forward
from meshes.qwen3_moe import SIZES, MoEConfig, RolloutShard, checkpoint_spec
from meshes.spec import RolloutSpec, TrainerSpec
from weightbridge import Stage, WorkerId, WorkerPlan, default_kernels, extract_source_map
from weightbridge.executor import Range, WorkerExecutor
from weightbridge.monarch_transport import register_ranges, wait_all, write

WRITE_TIMEOUT_S = 60
"""A write to a dead receiver hangs until this timeout on the TCP fallback."""


def checkpoint(config: MoEConfig, version: int, names: Iterable[str] | None = None
               ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint of ``version`` (deterministic: one generator seed per tensor and version).

    ``names`` restricts it to the tensors a worker reads, so no worker materializes all of it.
    """
    spec = checkpoint_spec(config)
    wanted = None if names is None else set(names)
    for i, t in enumerate(spec.tensors):
        if wanted is None or t.name in wanted:
            gen = torch.Generator().manual_seed(version * 1_000_003 + i)
            yield t.name, torch.randn(t.shape, generator=gen).to(torch.bfloat16)


def checksums(params: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Per-parameter 64-bit blake2b digest of the raw bytes."""
    return {n: hashlib.blake2b(p.detach().contiguous().view(torch.uint8).numpy().tobytes(),
                               digest_size=8).hexdigest() for n, p in params.items()}


class _Worker(Actor):
    """What trainer and rollout actors share: a shard, its source map and an executor."""

    side = ""

    def __init__(self, model: str, spec: str):
        if model not in SIZES:
            raise ValueError(f"unknown model {model!r}; choose one of {sorted(SIZES)}")
        self.config = SIZES[model]
        self.index = current_rank().rank
        if not torch.cuda.is_available():
            # CPU workers: every proc of both meshes shares this host's cores, and torch's
            # default of one thread per core per process oversubscribes them many times over.
            torch.set_num_threads(1)
        self.shard = self._make_shard(self.config, spec, self.index)
        self.smap = None
        self.executor: WorkerExecutor | None = None
        self.peers: dict[tuple[WorkerId, Range], object] = {}
        self.spans: list[tuple[str, int, int, int]] = []  # (stage, round, start_ns, end_ns)

    def _make_shard(self, config: MoEConfig, spec: str, index: int):
        raise NotImplementedError

    @endpoint
    def checkpoint_spec(self):
        """Names, shapes and dtypes of the checkpoint this rank's load_weights reads."""
        return checkpoint_spec(self.config)

    def _source_map(self):
        self.smap = extract_source_map(self.shard.params, self.shard.load_weights,
                                       checkpoint_spec(self.config))
        return self.smap

    def _connect(self, plan: WorkerPlan) -> None:
        if plan.worker != WorkerId(self.side, self.index):
            raise ValueError(f"{self.side} actor {self.index} was handed the plan of "
                             f"{plan.worker}; the controller must slice plans by mesh rank")
        self.executor = WorkerExecutor(plan, self.shard.params, default_kernels("cpu"))
        self.load_version(0)  # what the engine starts from; also clears the probe's values

    def load_version(self, version: int) -> None:
        with torch.no_grad():
            self.shard.load_weights(checkpoint(self.config, version, self.smap.tensors()))

    def _issue(self, r: int, stage: Stage) -> None:
        futures = [write(self.peers[(peer, key)], src, timeout_s=WRITE_TIMEOUT_S)
                   for peer, key, src in self.executor.writes(r, stage)]
        wait_all(futures)

    def _timed(self, stage: str, r: int, step, *args) -> None:
        # time.monotonic_ns is CLOCK_MONOTONIC: comparable across the procs of one host.
        start = time.monotonic_ns()
        step(*args)
        self.spans.append((stage, r, start, time.monotonic_ns()))

    @endpoint
    def timings(self) -> list[tuple[str, int, int, int]]:
        """This update's (stage, round, start_ns, end_ns) spans; clears them."""
        spans, self.spans = self.spans, []
        return spans

    @endpoint
    def probe_link(self, handle, nbytes: int, repeats: int) -> float:
        """Best seconds of ``repeats`` RDMA writes of ``nbytes`` into ``handle``, after a warm-up
        write (the first write starts this proc's RDMA manager)."""
        src = torch.full((nbytes,), 7, dtype=torch.uint8)
        best = float("inf")
        for i in range(repeats + 1):
            start = time.monotonic_ns()
            write(handle, src, timeout_s=WRITE_TIMEOUT_S).get()
            best = best if i == 0 else min(best, (time.monotonic_ns() - start) / 1e9)
        return best


class TrainerActor(_Worker):
    """One trainer rank: Megatron-like shard (TP x EP x PP, DP replicas) or an FSDP flat shard;
    writes RECEIVE-stage bytes."""

    side = "trainer"

    def _make_shard(self, config: MoEConfig, spec: str, index: int):
        s = TrainerSpec.parse(spec)
        s.validate(config)
        return s.shard(config, index)

    @endpoint
    def source_map(self):
        """Probe this rank's own load_weights (overwrites the parameters)."""
        return self._source_map()

    @endpoint
    def connect(self, plan: WorkerPlan) -> None:
        """Build copy tables and arenas once; load version 0. Trainers expose no RDMA ranges."""
        self._connect(plan)

    @endpoint
    def set_peers(self, handles: dict) -> None:
        """Handles of the receivers' ranges, keyed by (peer WorkerId, range)."""
        self.peers = handles

    @endpoint
    def train_step(self, version: int) -> None:
        """A stand-in optimizer step: every weight becomes that of checkpoint ``version``."""
        self.load_version(version)

    @endpoint
    def send(self, r: int) -> None:
        """Round r: pack into arena r % 2 and write the RECEIVE stage; returns once it landed."""
        self._timed("pack", r, self.executor.pack, r)
        self._timed(Stage.RECEIVE.value, r, self._issue, r, Stage.RECEIVE)


class RolloutActor(_Worker):
    """One rollout rank: inference shard (fused qkv, stacked experts, padded vocab)."""

    side = "rollout"

    def _make_shard(self, config: MoEConfig, spec: str, index: int):
        s = RolloutSpec.parse(spec)
        s.validate(config)
        c = s.coords(index)
        self._shard_args = (config, s.tp, c["tp"], s.ep, c["ep"])
        return RolloutShard(*self._shard_args)

    @endpoint
    def source_map(self):
        """Probe this rank's own load_weights (overwrites the parameters)."""
        return self._source_map()

    @endpoint
    def connect(self, plan: WorkerPlan, ranges: list) -> dict:
        """Build tables and arenas, load version 0, register every incoming range once.

        Returns {range: RDMABuffer} for the controller to hand to the writers.
        """
        self._connect(plan)
        return register_ranges(self.executor.arenas, ranges)

    @endpoint
    def set_peers(self, handles: dict) -> None:
        """Handles of other rollouts' ranges this rank forwards into."""
        self.peers = handles

    @endpoint
    def forward(self, r: int, stage: Stage) -> None:
        """Round r: write this stage's bytes out of receive arena r % 2; returns once landed."""
        self._timed(stage.value, r, self._issue, r, stage)

    @endpoint
    def assemble(self, r: int) -> None:
        """Round r: receive arena r % 2 -> parameters (after the round's last stage)."""
        self._timed("assemble", r, self.executor.assemble, r)

    @endpoint
    def probe_buffer(self, nbytes: int):
        """Register an ``nbytes`` scratch RDMA buffer for the link probe; returns its handle."""
        self._probe_arena = torch.zeros(nbytes, dtype=torch.uint8)
        return register_ranges([self._probe_arena], [(0, 0, nbytes)])[(0, 0, nbytes)]

    @endpoint
    def generate_step(self, seed: int, num_tokens: int = 8) -> list[int]:
        """A forward pass with the current weights on ``num_tokens`` pseudo-random tokens: this
        rank's share (its heads, experts and vocabulary shard; no collectives). Returns the
        argmax over the local vocabulary shard per token."""
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, self.config.vocab, (1, num_tokens), generator=gen)
        return rank_forward(self.shard, tokens)[0].argmax(-1).tolist()

    @endpoint
    def checksums(self, version: int) -> tuple[dict[str, str], dict[str, str]]:
        """(checksums of the live parameters, of this rank's own load_weights of ``version``)."""
        scratch = RolloutShard(*self._shard_args)
        with torch.no_grad():
            scratch.load_weights(checkpoint(self.config, version, self.smap.tensors()))
        return checksums(self.shard.params), checksums(scratch.params)
