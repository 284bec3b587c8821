"""The two mechanisms the paper compares with, on the same meshes and data plane (Monarch RDMA).

- **P2P** (`p2p_plan`): every rollout worker gets each piece it needs straight from the trainer
  that holds it. It is WeightBridge's own plan with the forwarding stages rewritten: each
  EXTERNAL or INTERNAL write of a segment becomes a RECEIVE write of the same bytes from the
  trainer that sent that segment, into the same place of the receiver's round buffer. So a
  trainer sends its bytes once per rollout worker that needs them, and `MeshTransfer` runs it
  unchanged (``MeshTransfer(..., reroute=p2p_plan)``). A segment has one sending trainer, so each
  piece comes from a single owner.
- **Broadcast** (`Broadcast`): the trainers gather the whole checkpoint into one head actor on
  trainer rank 0 (a WeightBridge transfer to a single receiver that holds the checkpoint as
  one flat bf16 tensor in checkpoint order), the head writes all of it to every rollout worker
  (one RDMA buffer each), and every rollout worker loads it with its own ``load_weights``.

Timing uses the same spans and stall rules as WeightBridge (`controller.timing`): the head's
``assemble`` and ``broadcast`` spans count as trainer 0's, every rollout stalls from the start
of the broadcast until its ``load`` ends.

Typical usage::

    with MeshTransfer(tspec, rspec, "tiny", procs=procs, reroute=p2p_plan) as p2p: ...
    with Broadcast(tspec, rspec, "tiny", procs=procs) as bc:
        report = bc.update(1)
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import numpy as np
import torch
from monarch.actor import endpoint

from controller.driver import MeshTransfer, UpdateReport, _by_rank, _text
from controller.timing import update_timing
from meshes.actors import RolloutActor, checkpoint, checksums
from meshes.qwen3_moe import FsdpTrainerShard, MoEConfig, checkpoint_spec
from meshes.spec import RolloutSpec, TrainerSpec
from weightbridge.monarch_transport import register_ranges, wait_all, write
from weightbridge.plan import TransferPlan
from weightbridge.plan_route import RECEIVE

HEAD_SPEC = RolloutSpec.parse("engines=1,nodes=1,gpus=1")
"""The gather's receiver: one actor holding the whole checkpoint."""


def p2p_plan(plan: TransferPlan) -> TransferPlan:
    """``plan`` with every forwarding write replaced by a write from the segment's trainer."""
    t = plan.tables
    recv = np.flatnonzero(t.stage == RECEIVE)
    owner = np.full(len(t.seg_bytes), -1, dtype=np.int64)
    offset = np.zeros(len(t.seg_bytes), dtype=np.int64)
    owner[t.seg[recv]] = t.src[recv]
    offset[t.seg[recv]] = t.src_offset[recv]
    if (owner[t.seg] < 0).any():
        raise ValueError("a forwarded segment has no RECEIVE write; not a WeightBridge plan")
    tables = dataclasses.replace(t, stage=np.full_like(t.stage, RECEIVE), src=owner[t.seg],
                                 src_offset=offset[t.seg])
    fields = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)}
    return _P2PPlan(**{**fields, "tables": tables})


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class _P2PPlan(TransferPlan):
    """A trainer packs a segment once however many receivers it writes it to."""

    def for_worker(self, worker):
        p = TransferPlan.for_worker(self, worker)
        rounds = tuple(dataclasses.replace(r, pack=tuple(dict.fromkeys(r.pack)))
                       for r in p.rounds)
        return dataclasses.replace(p, rounds=rounds)


def _checkpoint_bytes(config: MoEConfig) -> int:
    return checkpoint_spec(config).numel * 2  # bf16


class HeadActor(RolloutActor):
    """Broadcast head, on trainer rank 0's proc: receives the gather, then writes the whole
    checkpoint to every rollout worker."""

    def _make_shard(self, config: MoEConfig, spec: str, index: int):
        return FsdpTrainerShard(config, 1, 0)  # the whole checkpoint, one flat bf16 tensor

    def _checksums(self, version: int) -> tuple[dict[str, str], dict[str, str]]:
        want = FsdpTrainerShard(self.config, 1, 0)
        with torch.no_grad():
            want.load_weights(checkpoint(self.config, version))
        return checksums(self.shard.params), checksums(want.params)

    @endpoint
    async def broadcast(self, handles: list) -> None:
        """Write the whole checkpoint into every handle at once; returns once all landed."""
        src = self.shard.params["flat_param"].view(torch.uint8)
        await asyncio.to_thread(self._timed, "broadcast", 0,
                                lambda: wait_all([write(h, src) for h in handles]))


class BroadcastRollout(RolloutActor):
    """A rollout worker that receives the whole checkpoint and loads it with load_weights."""

    @endpoint
    async def full_buffer(self):
        """Register a buffer for the whole checkpoint; returns its RDMA handle."""
        n = _checkpoint_bytes(self.config)
        self._full = torch.zeros(n, dtype=torch.uint8)
        return register_ranges([self._full], [(0, 0, n)])[(0, 0, n)]

    @endpoint
    async def load_full(self) -> None:
        """Load the received checkpoint with this rank's own load_weights."""
        await asyncio.to_thread(self._timed, "load", 0, self._load_full)

    def _load_full(self) -> None:
        flat, pos, pairs = self._full.view(torch.bfloat16), 0, []
        for t in checkpoint_spec(self.config).tensors:
            pairs.append((t.name, flat[pos:pos + t.numel].view(t.shape)))
            pos += t.numel
        with torch.no_grad():
            self.shard.load_weights(pairs)


class Broadcast:
    """Gather to a head on trainer rank 0, broadcast the whole checkpoint, load_weights.

    Args, Keyword Args: as `MeshTransfer` (``procs`` is required: the trainer and rollout proc
    meshes, one ``worker`` axis each).
    """

    def __init__(self, trainer: TrainerSpec, rollout: RolloutSpec, model: str, *, procs,
                 round_bytes: int = 256 << 10, link_rate: float | None = None):
        self.trainer_spec, self.rollout_spec, self.model = trainer, rollout, model
        tp, rp = procs
        self._rp = rp
        self.gather = MeshTransfer(trainer, HEAD_SPEC, model, round_bytes=round_bytes,
                                   procs=(tp, tp.slice(worker=slice(0, 1))),
                                   rollout_actor=HeadActor, link_rate=link_rate)
        self.link_rate = link_rate
        self.rollouts = None
        self.ideal_s = 0.0

    def __enter__(self) -> "Broadcast":
        try:
            self.gather.__enter__()
            self.gather.connect()
            self.rollouts = self._rp.spawn("bcast_rollout", BroadcastRollout, self.model,
                                           _text(self.rollout_spec))
            self.rollouts.initialized.get()
            self.rollouts.source_map.call().get()  # checksums read the tensors it names
            self._handles = _by_rank(self.rollouts.full_buffer.call().get())
            self.head = self.gather.rollouts
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        try:
            if self.rollouts is not None:
                self.rollouts.stop().get(timeout=60)
                self.rollouts = None
        finally:
            self.gather.close()

    def update(self, version: int) -> UpdateReport:
        t0 = time.perf_counter()
        self.gather.trainers.train_step.call(version).get()
        t1 = time.perf_counter()
        self.gather._transfer(version)
        self.head.broadcast.call_one(self._handles).get()
        self.rollouts.load_full.call().get()
        t2 = time.perf_counter()
        spans = {("trainer", p.rank): s
                 for p, s in self.gather.trainers.timings.call().get().items()}
        spans[("trainer", 0)] = spans.get(("trainer", 0), []) + \
            self.head.timings.call_one().get()
        spans.update({("rollout", p.rank): s
                      for p, s in self.rollouts.timings.call().get().items()})
        n = self.rollout_spec.num_workers
        timing = update_timing(spans, {("trainer", 0, 0, "broadcast"): frozenset(range(n))})
        results = _by_rank(self.rollouts.checksums.call(version).get())
        t3 = time.perf_counter()
        bad, count = [], 0
        for i, (got, want) in enumerate(results):
            count += len(want)
            bad += [f"rollout{i}:{k}" for k in want if got.get(k) != want[k]]
        gathered = int(self.gather.plan.stage_bytes()[0].sum())
        return UpdateReport(version=version, train_step_s=t1 - t0, transfer_s=t2 - t1,
                            verify_s=t3 - t2,
                            rdma_bytes=gathered + n * _checkpoint_bytes(_config(self.model)),
                            num_params=count, mismatched=tuple(bad), timing=timing,
                            ideal_s=self.ideal_s)


def _config(model: str) -> MoEConfig:
    from meshes.qwen3_moe import SIZES

    return SIZES[model]
