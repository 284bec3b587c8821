"""Same-data-plane ablations: the paper's two baseline patterns on WeightBridge's own data plane
(Monarch RDMA) and plan machinery, so only the traffic pattern differs. The baselines users
actually run (torch.distributed) are in `controller.baselines.dist`.

- **P2P** (`p2p_plan`): every rollout worker gets each piece it needs straight from the trainer
  that holds it. It is WeightBridge's own plan with the forwarding stages rewritten: each
  EXTERNAL or INTERNAL write of a segment becomes a RECEIVE write of the same bytes from the
  trainer that sent that segment, into the same place of the receiver's round buffer. So a
  trainer sends its bytes once per rollout worker that needs them (and packs them once: a
  worker's plan packs each box of a round once), and `MeshTransfer` runs it unchanged
  (``MeshTransfer(..., reroute=p2p_plan)``). A segment has one sending trainer, so each piece
  comes from a single owner.
- **Broadcast** (`Broadcast`): the trainers gather the whole checkpoint into one head actor on
  trainer host 0 (a WeightBridge transfer to a single receiver that holds the checkpoint as
  one flat bf16 tensor in checkpoint order: the FSDP layout of one rank), the head writes all
  of it to every rollout worker (one RDMA buffer each), and every rollout worker loads it with
  its own ``load_weights``. The head runs in a proc of its own beside trainer 0's (a transfer
  group has one worker per proc, and the head is a receiver of the gather while trainer 0 is
  its sender), on trainer 0's host: its broadcast leaves through that host's link.

Timing uses the same spans and stall rules as WeightBridge (`controller.timing`): the head's
``assemble`` and ``broadcast`` spans count as trainer 0's, every rollout stalls from the start
of the broadcast until its ``load`` ends.

Typical usage::

    with MeshTransfer(tspec, rspec, "tiny", procs=procs, reroute=p2p_plan) as p2p: ...
    with Broadcast(tspec, rspec, "tiny", procs=procs) as bc:   # head proc on this host
        report = bc.update(1)
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch
from monarch.actor import endpoint

from controller.baselines.members import Standalone
from controller.driver import (ClosingContext, MeshTransfer, UpdateReport, mismatches,
                               resolve_workers)
from controller.ranks import by_rank
from controller.timing import update_timing
from meshes.actors import RolloutActor
from weightbridge.driver import RolloutSpec, TrainerSpec
from weightbridge import TransferConfig, TransferPlan, WorkerParts
from weightbridge.driver import RECEIVE, configure_transport, register_ranges, wait_all, write

HEAD_SPEC = RolloutSpec.parse("engines=1,nodes=1,gpus=1")
"""The gather's receiver: one actor holding the whole checkpoint."""
FLAT_SPEC = TrainerSpec.parse("nodes=1,gpus=1,fsdp=1")
"""The head's layout: one FSDP rank, so one flat bf16 parameter of the whole checkpoint."""


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
    return dataclasses.replace(plan, tables=tables)


def _flat_bytes(parts: WorkerParts) -> int:
    return sum(t.numel for t in parts.spec.tensors) * 2  # bf16, as the head's flat parameter


class HeadActor(RolloutActor):
    """Broadcast head, on trainer host 0: the gather's one receiver, holding the whole
    checkpoint as one flat bf16 tensor; then writes all of it to every rollout worker."""

    def _make_parts(self, rank: int) -> WorkerParts:
        # The worker factory's FSDP layout over one rank: FsdpTrainerShard(config, 1, 0).
        parts = self.factory("trainer", FLAT_SPEC, 0)
        if list(parts.params) != ["flat_param"]:
            raise ValueError(f"the broadcast head needs the factory's FSDP layout (one flat "
                             f"parameter); it built {sorted(parts.params)[:4]}")
        return parts

    @endpoint
    def broadcast(self, handles: list) -> None:
        """Write the whole checkpoint into every handle at once; returns once all landed."""
        self._broadcast(handles)

    def _broadcast(self, handles: list) -> None:
        src = self.parts.params["flat_param"].view(torch.uint8)
        start = time.monotonic_ns()
        wait_all([write(h, src) for h in handles])
        self.worker.spans.append(("broadcast", 0, start, time.monotonic_ns()))


class BroadcastRollout(Standalone, RolloutActor):
    """A rollout worker that receives the whole checkpoint and loads it with load_weights.

    It is in no transfer group (nothing but the head writes to it), so it keeps its own spans
    and probes its own load_weights once for the tensors its checksums read."""

    @endpoint
    def full_buffer(self):
        """Register a buffer for the whole checkpoint; returns its RDMA handle."""
        return self._full_buffer()

    def _full_buffer(self):
        self._probe()
        n = _flat_bytes(self.parts)
        self._full = torch.zeros(n, dtype=torch.uint8)
        return register_ranges([self._full], [(0, 0, n)])[(0, 0, n)]

    @endpoint
    def load_full(self) -> None:
        """Load the received checkpoint with this rank's own load_weights."""
        self._load_full()

    def _load_full(self) -> None:
        start = time.monotonic_ns()
        flat, pos, pairs = self._full.view(torch.bfloat16), 0, []
        for t in self.parts.spec.tensors:
            pairs.append((t.name, flat[pos:pos + t.numel].view(t.shape)))
            pos += t.numel
        with torch.no_grad():
            self.parts.load_weights(pairs)
        self._span("load", 0, start)


class Broadcast(ClosingContext):
    """Gather to a head on trainer host 0, broadcast the whole checkpoint, load_weights.

    Args, Keyword Args: as `MeshTransfer` (``procs`` is required: the trainer and rollout proc
    meshes, one ``worker`` axis each; ``config`` is the gather's).

    Keyword Args:
        head_procs: A one-proc mesh on trainer 0's host for the head. By default one is
            spawned on this host (where procs spawned by `this_host()` run) and stopped on
            close.
    """

    def __init__(self, trainer: TrainerSpec, rollout: RolloutSpec, model: str, *, procs,
                 head_procs=None, config: TransferConfig = TransferConfig(),
                 link_rate: float | None = None):
        resolve_workers(model, trainer, rollout)  # before anything spawns
        self.trainer_spec, self.rollout_spec, self.model = trainer, rollout, model
        self._tp, self._rp = procs
        self._head_procs, self._owned_head = head_procs, None
        self.config, self.link_rate = config, link_rate
        self.gather: MeshTransfer | None = None
        self.rollouts = None
        self.ideal_s = 0.0

    def _start(self) -> None:
        if self._head_procs is None:
            from monarch.actor import this_host

            configure_transport()  # before spawning: children read the config at start-up
            self._owned_head = this_host().spawn_procs(per_host={"worker": 1},
                                                       name="bcast_head")
            self._head_procs = self._owned_head
        self.gather = MeshTransfer(self.trainer_spec, HEAD_SPEC, self.model,
                                   config=self.config, procs=(self._tp, self._head_procs),
                                   rollout_actor=HeadActor, link_rate=self.link_rate)
        self.gather.__enter__()
        self.gather.connect()
        self.head = self.gather.rollouts
        self.rollouts = self._rp.spawn("bcast_rollout", BroadcastRollout,
                                       self.gather.workers, self.rollout_spec)
        self._handles = by_rank(self.rollouts.full_buffer.call().get())

    def close(self) -> None:
        errors = []
        for stop in (self._stop_rollouts, self._stop_gather, self._stop_head):
            try:
                stop()
            except Exception as e:  # keep stopping the others; re-raised below
                errors.append(e)
        if errors:
            raise errors[0]

    def _stop_rollouts(self) -> None:
        if self.rollouts is not None:
            rollouts, self.rollouts = self.rollouts, None
            rollouts.stop().get(timeout=60)

    def _stop_gather(self) -> None:
        if self.gather is not None:
            gather, self.gather = self.gather, None
            gather.close()

    def _stop_head(self) -> None:
        if self._owned_head is not None:
            head, self._owned_head = self._owned_head, None
            self._head_procs = None
            head.stop().get(timeout=60)

    def update(self, version: int) -> UpdateReport:
        """Train step, gather, broadcast, load; verified like `MeshTransfer.update`."""
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
        count, bad = mismatches(by_rank(self.rollouts.checksums.call(version).get()))
        t3 = time.perf_counter()
        plan = self.gather.plan
        gathered = int(plan.stage_bytes()[0].sum())
        whole = plan.correspondence.nbytes  # the head needs every byte of the checkpoint
        return UpdateReport(version=version, train_step_s=t1 - t0, transfer_s=t2 - t1,
                            verify_s=t3 - t2, rdma_bytes=gathered + n * whole,
                            num_params=count, mismatched=bad, timing=timing,
                            ideal_s=self.ideal_s)
