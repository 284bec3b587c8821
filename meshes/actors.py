"""Trainer and rollout actors: thin Monarch wrappers over a shard and a `WorkerExecutor`.

Each actor builds its own shard from (model name, mesh spec text, its rank in the mesh), probes
its own ``load_weights`` for the controller, and at connect builds its copy tables and two round
arenas once. Rollouts register the arena ranges peers write into as RDMA buffers and return the
handles; the controller hands every writer the handles it needs, its `Schedule` and the two
actor meshes.

Per update, one of two ways (``MeshTransfer(sequencing=...)``):

- controller-sequenced (the default): the controller calls ``send(r)`` on the trainers (pack,
  RDMA RECEIVE), then ``forward(r, stage)`` and ``assemble(r)`` on the rollouts, each as soon as
  its inputs are done. ``send`` is a plain ``@endpoint`` (one at a time, in the order issued, so
  a queued send starts the moment the previous one's writes landed); ``forward`` and
  ``assemble`` are ``@concurrent_endpoint`` so round r's forwards overlap round r + 1's;
- data flow: one ``run_update`` per actor, and the actors run every round themselves
  (`meshes/dataflow.py`): each step starts when the peers that feed it said ``landed``, and a
  writer reuses a peer's arena only after ``free``. ``run_update`` is a ``@concurrent_endpoint``
  whose round loops run in threads (a rollout forwards each stage and assembles in loops of
  their own), so the event loop stays free to take the peers' ``landed`` / ``free`` /
  ``abort`` messages meanwhile.

Every other endpoint is a plain ``@endpoint`` and runs blocking work in a thread.

Typical usage (see controller/driver.py)::

    trainers = procs.spawn("trainer", TrainerActor, "tiny", "nodes=1,gpus=4,tp=2,ep=2")
    maps = trainers.source_map.call().get()
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from typing import Iterable, Iterator, Mapping

import torch
from monarch.actor import Actor, concurrent_endpoint, current_rank, endpoint

from meshes.dataflow import STAGES, Inbox, Notifier, Schedule, UpdateAborted, describe
from meshes.forward import rank_forward
from meshes.qwen3_moe import SIZES, MoEConfig, RolloutShard, checkpoint_spec
from meshes.spec import RolloutSpec, TrainerSpec
from weightbridge import Stage, WorkerId, WorkerPlan, default_kernels, extract_source_map
from weightbridge.executor import Range, WorkerExecutor
from weightbridge.monarch_transport import register_ranges, write

SELF = WorkerId("self", -1)
"""Marks this worker's own forwards of a (round, stage) as done, in its own inbox."""
WRITE_TIMEOUT_S = 60
"""Default bound of every wait: a write (to a dead receiver it hangs until this timeout on the
TCP fallback) and a peer's notification."""


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
    """What trainer and rollout actors share: a shard, its source map, an executor, and the
    data-flow state of an update (schedule, inbox, notifier)."""

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
        self.me = WorkerId(self.side, self.index)
        self.smap = None
        self.executor: WorkerExecutor | None = None
        self.arenas: list[torch.Tensor] = []
        self.peers: dict[tuple[WorkerId, Range], object] = {}
        self.schedule: Schedule | None = None
        self.notifier = None
        self.inbox = Inbox(self.me)
        self._acks: dict[Stage, list] = {}  # stage -> (peer, future) of the last landed sent
        self.timeout_s = WRITE_TIMEOUT_S
        self.spans: list[tuple[str, int, int, int]] = []  # (stage, round, start_ns, end_ns)

    def _make_shard(self, config: MoEConfig, spec: str, index: int):
        raise NotImplementedError

    @endpoint
    async def checkpoint_spec(self):
        """Names, shapes and dtypes of the checkpoint this rank's load_weights reads."""
        return checkpoint_spec(self.config)

    @endpoint
    async def source_map(self):
        """Probe this rank's own load_weights (overwrites the parameters)."""
        return await asyncio.to_thread(self._source_map)

    def _source_map(self):
        self.smap = extract_source_map(self.shard.params, self.shard.load_weights,
                                       checkpoint_spec(self.config))
        return self.smap

    def _connect(self, plan: WorkerPlan, depth: int) -> None:
        if plan.worker != self.me:
            raise ValueError(f"{self.side} actor {self.index} was handed the plan of "
                             f"{plan.worker}; the controller must slice plans by mesh rank")
        if depth < 2:
            raise ValueError(f"depth must be >= 2 round arenas, got {depth}")
        self.executor = WorkerExecutor(plan, self.shard.params, default_kernels("cpu"))
        # The executor's two arenas, plus more of the same size for a deeper pipeline.
        self.arenas = self.executor.arenas + [torch.zeros_like(self.executor.arenas[0])
                                              for _ in range(depth - 2)]
        self.load_version(0)  # what the engine starts from; also clears the probe's values

    def _arena(self, r: int) -> torch.Tensor:
        return self.arenas[r % len(self.arenas)]

    def load_version(self, version: int) -> None:
        with torch.no_grad():
            self.shard.load_weights(checkpoint(self.config, version, self.smap.tensors()))

    @endpoint
    async def set_peers(self, handles: dict, schedule: Schedule, trainers, rollouts,
                        timeout_s: float = WRITE_TIMEOUT_S) -> None:
        """The receivers' ranges this worker writes into, keyed by (peer WorkerId, range); its
        `Schedule`; the two actor meshes to notify peers on; the bound of every wait."""
        if schedule.worker != self.me or schedule.depth != len(self.arenas):
            raise ValueError(f"{describe(self.me)} (with {len(self.arenas)} arenas) was handed "
                             f"the schedule of {describe(schedule.worker)} for depth "
                             f"{schedule.depth}; slice schedules by mesh rank, same depth as "
                             f"connect")
        self.peers, self.schedule, self.timeout_s = handles, schedule, timeout_s
        self.notifier = Notifier(self.me, trainers, rollouts, schedule.peers())

    # -- one update: round loops (threads) and the peers' notifications (the event loop) ------

    @concurrent_endpoint
    async def run_update(self, update: int) -> None:
        """Run this worker's part of every round of ``update``; returns when it is done.

        Concurrent: the peers' ``landed`` / ``freed`` / ``abort`` must be served while it runs.
        Raises what failed here (after telling every peer to stop), `UpdateAborted` if a peer
        failed, or `StepTimeout` if a peer never reported.
        """
        if self.schedule is None:
            raise RuntimeError("run_update before set_peers: the controller connects first")
        self.inbox.start(update)
        self._acks = {}
        results = await asyncio.gather(
            *(asyncio.to_thread(self._guarded, update, loop) for loop in self._loops()),
            return_exceptions=True)
        errors = [e for e in results if isinstance(e, BaseException)]
        if errors:  # the root cause, not the loops it stopped
            raise next((e for e in errors if not isinstance(e, UpdateAborted)), errors[0])

    def _guarded(self, update: int, loop) -> None:
        try:
            loop(update)
        except UpdateAborted:
            raise
        except BaseException as e:
            reason = f"{describe(self.me)} failed: {type(e).__name__}: {e}"
            self.inbox.abort(update, reason)  # this worker's other loops
            self.notifier.abort_all(update, reason)
            raise

    def _loops(self) -> list:
        """The round loops of an update, each run in its own thread."""
        raise NotImplementedError

    @endpoint
    async def landed(self, update: int, r: int, stage: Stage, writer: WorkerId) -> None:
        """``writer``'s (round r, stage) writes into this worker have landed. A plain endpoint
        (in order per sender, no reply): the event loop is free while run_update runs."""
        self.inbox.landed(update, r, stage, writer)

    @endpoint
    async def freed(self, update: int, r: int, reader: WorkerId) -> None:
        """``reader`` is done with round r: that round's arena may take round r + depth."""
        self.inbox.freed(update, r, reader)

    @endpoint
    async def abort(self, update: int, reason: str) -> None:
        """A worker failed in ``update``: stop waiting, fail with ``reason``."""
        self.inbox.abort(update, reason)

    def _write(self, update: int, r: int, stage: Stage, needs=None) -> None:
        """Round r's writes of ``stage`` (once each peer freed round r - depth; with ``needs``,
        each write once the bytes it forwards have landed), then ``landed`` to each peer."""
        targets = self.schedule.outputs.get((r, stage))
        if not targets:
            return
        if r >= self.schedule.depth:
            self.inbox.wait_freed(update, r - self.schedule.depth, targets, self.timeout_s)
        self._delivered(stage)
        depth = len(self.arenas)
        writes = list(self.executor.writes(r, stage, self._arena(r)))
        pending = dict(enumerate(needs)) if needs is not None else {}
        ready = set(range(len(writes))) - set(pending)
        start, futures = None, []  # the span starts with the first write issued
        while True:
            start = start if start is not None or not ready else time.monotonic_ns()
            for i in sorted(ready):
                peer, key, src = writes[i]
                futures.append((peer, write(self.peers[(peer, (r % depth, *key[1:]))], src,
                                            timeout_s=int(self.timeout_s))))
                pending.pop(i, None)
            if not pending:
                break
            ready = self.inbox.wait_ready(update, r, pending, self.timeout_s)
        for peer, f in futures:
            self._landed(f, peer, r, stage)
        self.spans.append((stage.value, r, start, time.monotonic_ns()))
        acks = [(peer, self.notifier.landed(peer, update, r, stage)) for peer in targets]
        if stage is Stage.RECEIVE:
            self._acks[stage] = acks

    def _write_all(self, r: int, stage: Stage) -> None:
        """Every write of (round r, stage) at once; returns when all landed (controller-
        sequenced rounds: the controller orders the stages and rounds)."""
        depth = len(self.arenas)
        futures = [(peer, write(self.peers[(peer, (r % depth, *key[1:]))], src,
                                timeout_s=int(self.timeout_s)))
                   for peer, key, src in self.executor.writes(r, stage, self._arena(r))]
        for peer, f in futures:
            self._landed(f, peer, r, stage)

    def _write_step(self, r: int, stage: Stage) -> None:
        """Controller-sequenced: this worker's writes of (round r, stage), timed, if it has any
        (the controller calls every worker of the mesh)."""
        if self.schedule.outputs.get((r, stage)):
            self._timed(stage.value, r, self._write_all, r, stage)

    def _landed(self, future, peer: WorkerId, r: int, stage: Stage) -> None:
        """Wait for one RDMA write; a failure names the peer, the round and the stage."""
        try:
            future.get()
        except Exception as e:
            raise RuntimeError(f"{describe(self.me)}: the {stage.value} write of round {r} "
                               f"into {describe(peer)} failed ({e}); that worker died or "
                               f"its link stalled for {self.timeout_s:g}s") from e

    def _delivered(self, stage: Stage) -> None:
        """Wait until a trainer's previous ``landed`` reached its peers.

        Sent right before the next round's RDMA writes, the notification lost the race to them
        in the trainer's own proc (measured: 20-70 ms late at 50 Mbit/s, against ~2 ms when
        nothing follows it). The wait costs one round trip, mostly hidden behind the pack and
        the credit wait before it. Rollouts don't wait: their acks would queue behind their
        peers' own forwarding writes.
        """
        for peer, ack in self._acks.pop(stage, ()):
            try:
                ack.get(timeout=self.timeout_s)
            except Exception as e:
                raise RuntimeError(f"{describe(self.me)}: {describe(peer)} did not take the "
                                   f"{stage.value} notification within {self.timeout_s:g}s "
                                   f"({type(e).__name__}: {e}); that worker died or "
                                   f"stalled") from e

    def _timed(self, stage: str, r: int, step, *args) -> None:
        # time.monotonic_ns is CLOCK_MONOTONIC: comparable across the procs of one host.
        start = time.monotonic_ns()
        step(*args)
        self.spans.append((stage, r, start, time.monotonic_ns()))

    @endpoint
    async def timings(self) -> list[tuple[str, int, int, int]]:
        """This update's (stage, round, start_ns, end_ns) spans; clears them."""
        spans, self.spans = self.spans, []
        return spans

    @endpoint
    async def probe_link(self, handle, nbytes: int, repeats: int) -> float:
        """Best seconds of ``repeats`` RDMA writes of ``nbytes`` into ``handle``, after a warm-up
        write (the first write starts this proc's RDMA manager)."""
        return await asyncio.to_thread(self._probe_link, handle, nbytes, repeats)

    def _probe_link(self, handle, nbytes: int, repeats: int) -> float:
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
    async def connect(self, plan: WorkerPlan, depth: int = 2) -> None:
        """Build copy tables and ``depth`` arenas once; load version 0. Trainers expose no RDMA
        ranges."""
        await asyncio.to_thread(self._connect, plan, depth)

    @endpoint
    async def train_step(self, version: int) -> None:
        """A stand-in optimizer step: every weight becomes that of checkpoint ``version``."""
        await asyncio.to_thread(self.load_version, version)

    @endpoint
    async def send(self, r: int) -> None:
        """Controller-sequenced rounds: pack round r and write its RECEIVE stage; returns once it
        landed. A plain endpoint: sends run one at a time in the order the controller issued
        them, so the next round's send starts the moment this one's writes landed."""
        await asyncio.to_thread(self._send_one, r)

    def _send_one(self, r: int) -> None:
        if self._packs(r):
            self._timed("pack", r, self.executor.pack, r, self._arena(r))
        self._write_step(r, Stage.RECEIVE)

    def _packs(self, r: int) -> bool:
        return r < self.executor.num_rounds and bool(self.executor.plan.rounds[r].pack)

    def _loops(self) -> list:
        return [self._send_rounds]

    def _send_rounds(self, update: int) -> None:
        # Round r packs into arena r % depth, whose last reader was round r - depth's writes
        # (done: this loop waits for its writes). Packing before waiting for the peers'
        # free(r - depth) hides the pack behind the rollouts' forwards.
        for r in range(self.schedule.num_rounds):
            if self._packs(r):
                self._timed("pack", r, self.executor.pack, r, self._arena(r))
            self._write(update, r, Stage.RECEIVE)
        self._delivered(Stage.RECEIVE)


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
    async def connect(self, plan: WorkerPlan, ranges: list, depth: int = 2) -> dict:
        """Build tables and ``depth`` arenas, load version 0, register every incoming range
        (arena index, offset, nbytes) once.

        Returns {range: RDMABuffer} for the controller to hand to the writers.
        """
        await asyncio.to_thread(self._connect, plan, depth)
        return register_ranges(self.arenas, ranges)

    def _loops(self) -> list:
        # One loop per forwarding stage this worker has, and one that assembles: forwarding
        # round r + 1 never waits for round r's last input to land (only for its own inputs).
        stages = {stage for _, stage in self.schedule.outputs}
        forwards = [lambda u, s=s: self._forward_rounds(u, s)
                    for s in (Stage.EXTERNAL, Stage.INTERNAL) if s in stages]
        self._forwarding = [s for s in (Stage.EXTERNAL, Stage.INTERNAL) if s in stages]
        return forwards + [self._assemble_rounds]

    def _forward_rounds(self, update: int, stage: Stage) -> None:
        # Each write forwards bytes that arrived in an earlier stage of the same round: it goes
        # as soon as exactly those writes landed (Schedule.needs).
        s = self.schedule
        for r in range(s.num_rounds):
            self._write(update, r, stage, s.needs.get((r, stage), ()))
            self.inbox.landed(update, r, stage, SELF)
        self._delivered(stage)

    def _assemble_rounds(self, update: int) -> None:
        # Round r is assembled once every write into it landed and this worker's own forwards
        # of it (which read the same arena) are done; then round r + depth's writers may go.
        s = self.schedule
        for r in range(s.num_rounds):
            for e in STAGES:
                self.inbox.wait_landed(update, r, e, s.inputs.get((r, e), ()), self.timeout_s)
            for e in self._forwarding:
                self.inbox.wait_landed(update, r, e, (SELF,), self.timeout_s)
            if self._assembles(r):
                self._timed("assemble", r, self._assemble, r)
            for writer in s.frees.get(r, ()):
                self.notifier.freed(writer, update, r)

    def _assembles(self, r: int) -> bool:
        return r < self.executor.num_rounds and bool(self.executor.plan.rounds[r].assemble)

    def _assemble(self, r: int) -> None:
        """Receive arena of round r -> parameters (after every stage of round r landed)."""
        self.executor.assemble(r, self._arena(r))

    @concurrent_endpoint
    async def forward(self, r: int, stage: Stage) -> None:
        """Controller-sequenced rounds: write this stage's bytes of round r; returns once they
        landed. Concurrent: round r's forwards overlap round r + 1's, and assemble(r - 1)."""
        await asyncio.to_thread(self._write_step, r, stage)

    @concurrent_endpoint
    async def assemble(self, r: int) -> None:
        """Controller-sequenced rounds: the arena of round r -> parameters."""
        if self._assembles(r):
            await asyncio.to_thread(self._timed, "assemble", r, self._assemble, r)

    @endpoint
    async def probe_buffer(self, nbytes: int):
        """Register an ``nbytes`` scratch RDMA buffer for the link probe; returns its handle."""
        self._probe_arena = torch.zeros(nbytes, dtype=torch.uint8)
        return register_ranges([self._probe_arena], [(0, 0, nbytes)])[(0, 0, nbytes)]

    @endpoint
    async def generate_step(self, seed: int, num_tokens: int = 8) -> list[int]:
        """A forward pass with the current weights on ``num_tokens`` pseudo-random tokens: this
        rank's share (its heads, experts and vocabulary shard; no collectives). Returns the
        argmax over the local vocabulary shard per token."""
        return await asyncio.to_thread(self._generate_step, seed, num_tokens)

    def _generate_step(self, seed: int, num_tokens: int) -> list[int]:
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, self.config.vocab, (1, num_tokens), generator=gen)
        return rank_forward(self.shard, tokens)[0].argmax(-1).tolist()

    @endpoint
    async def checksums(self, version: int) -> tuple[dict[str, str], dict[str, str]]:
        """(checksums of the live parameters, of this rank's own load_weights of ``version``)."""
        return await asyncio.to_thread(self._checksums, version)

    def _checksums(self, version: int) -> tuple[dict[str, str], dict[str, str]]:
        scratch = RolloutShard(*self._shard_args)
        with torch.no_grad():
            scratch.load_weights(checkpoint(self.config, version, self.smap.tensors()))
        return checksums(self.shard.params), checksums(scratch.params)

