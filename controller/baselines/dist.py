"""The baselines users actually run: weight updates through ``torch.distributed`` (gloo here).

- **`GlooBroadcast`** (Miles, verl, OpenRLHF): the trainers collect full tensors on trainer 0
  (pieces of split tensors sent with ``dist.isend``), trainer 0 broadcasts them in flat buckets
  of full tensors (``dist.broadcast`` on a group of trainer 0 and every rollout rank), and
  every rollout rank
  runs its own ``load_weights`` on each bucket's full tensors.
- **`RingBroadcast`**: the same with NCCL's ring instead of gloo's binomial tree (gloo's
  ``broadcast`` sends whole messages down a binomial tree: the root sends ceil(log2(P))
  copies of every bucket, 3 for 4 rollouts; NCCL pipelines chunks along a ring, one copy per
  link): trainer 0 sends each bucket to rollout 0, which forwards it to rollout 1 while it
  receives the next one, and so on (gloo ``isend``/``irecv``).
- **`BucketedP2P`** (checkpoint-engine's pattern): full tensors collected on owners balanced
  over the trainers, then each owner sends each rollout rank, in fixed-size buckets with
  per-tensor metadata, the full tensors that rank's ``load_weights`` reads (gloo
  ``dist.isend``/``irecv`` over TCP: what a user without an RDMA engine has); the receiver
  loads bucket by bucket as they arrive.

Both run on the same procs, model and links as WeightBridge, one gloo group of every trainer
and rollout actor (TCP store on trainer 0's address; each rank binds gloo to the interface on
its route to it, so emulated hosts use their namespace's link). The plan (owners, pieces,
buckets, metadata) is made once at connect (`controller.baselines.plans`), so an update sends
no metadata, which favours the baselines. Timing uses `controller.timing`'s rules: trainers
stall from the first trainer span to their own last; a rollout from the start of the first
send or broadcast aimed at it to the end of its last load. Every update is verified like
`MeshTransfer.update` (each rollout's parameters against its own ``load_weights``).

Typical usage::

    with GlooBroadcast(tspec, rspec, "tiny", procs=(trainer_procs, rollout_procs)) as bc:
        report = bc.update(1)
"""

from __future__ import annotations

import os
import time

from controller.baselines.members import DistRollout, DistTrainer
from controller.baselines.plans import DistPlan, plan_dist
from controller.driver import ClosingContext, UpdateReport, mismatches, resolve_workers
from controller.ranks import actor_at, by_rank
from controller.timing import update_timing
from weightbridge.driver import RolloutSpec, TrainerSpec

TRANSPORT_ENV = "HYPERACTOR_MESH_DEFAULT_TRANSPORT"
DEFAULT_BUCKET_BYTES = 512 << 10


def controller_address() -> str:
    """An address of this controller the procs can route to: its Monarch TCP transport's host
    (an emulated cluster's bridge), else loopback (procs spawned on this host)."""
    transport = os.environ.get(TRANSPORT_ENV, "")
    host = transport.removeprefix("tcp://").rsplit(":", 1)[0] if transport.startswith(
        "tcp://") else ""
    return host if host and host not in ("0.0.0.0", "[::]") else "127.0.0.1"


class _DistBaseline(ClosingContext):
    """Actors on both proc meshes in one gloo group, the plan, one update at a time."""

    broadcast = ring = False
    stage = ""
    """The trainers' span that writes to rollouts (its start is a rollout's stall start)."""

    def __init__(self, trainer: TrainerSpec, rollout: RolloutSpec, model: str, *, procs,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout_s: float = 300.0):
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.workers = resolve_workers(model, trainer, rollout)
        self.trainer_spec, self.rollout_spec = trainer, rollout
        self._tp, self._rp = procs
        self.bucket_bytes, self.timeout_s = bucket_bytes, timeout_s
        self.trainers = self.rollouts = None
        self.plan: DistPlan | None = None
        self._joined = False

    def _start(self) -> None:
        self.trainers = self._tp.spawn("dist_trainer", DistTrainer, self.workers,
                                       self.trainer_spec)
        self.rollouts = self._rp.spawn("dist_rollout", DistRollout, self.workers,
                                       self.rollout_spec)
        maps = [self.trainers.source_map.call(), self.rollouts.source_map.call()]
        tmaps, rmaps = (by_rank(f.get()) for f in maps)
        specs = {spec for _, spec in tmaps + rmaps}
        if len(specs) != 1:
            raise ValueError("the workers' factories describe different checkpoints; both "
                             "sides must load the same one")
        self.plan = plan_dist([m for m, _ in tmaps], [m.tensors() for m, _ in rmaps],
                              specs.pop(), bucket_bytes=self.bucket_bytes,
                              broadcast=self.broadcast, ring=self.ring)
        t, world = len(tmaps), len(tmaps) + len(rmaps)
        addr, port = actor_at(self.trainers, 0).rendezvous.call_one(controller_address()).get()
        self._joined = True
        joins = [m.join_group.call(addr, port, t, world, self.timeout_s)
                 for m in (self.trainers, self.rollouts)]
        for f in joins:
            f.get()
        for f in [m.setup_plan.call(self.plan) for m in (self.trainers, self.rollouts)]:
            f.get()
        dests: dict[tuple, set[int]] = {}
        for b in self.plan.buckets:  # a ring's rollouts count as written by trainer 0's span
            dests.setdefault(("trainer", b.src, 0, self.stage), set()).update(b.dsts)
        self._dests = {k: frozenset(v) for k, v in dests.items()}

    def close(self) -> None:
        """Leave the gloo group, stop both actor meshes (the procs are the caller's)."""
        errors = []
        if self._joined:
            self._joined = False
            for mesh in (self.trainers, self.rollouts):
                try:
                    mesh.leave_group.call().get(timeout=60)
                except Exception as e:  # keep stopping the others; re-raised below
                    errors.append(e)
        for name in ("rollouts", "trainers"):
            mesh = getattr(self, name)
            setattr(self, name, None)
            if mesh is not None:
                try:
                    mesh.stop().get(timeout=60)
                except Exception as e:  # keep stopping the others; re-raised below
                    errors.append(e)
        if errors:
            raise RuntimeError(f"stopping the baseline's actors failed: {errors}") from errors[0]

    def update(self, version: int) -> UpdateReport:
        """Train step, collect and send every bucket, load; verified like
        `MeshTransfer.update`."""
        t0 = time.perf_counter()
        self.trainers.train_step.call(version).get()
        t1 = time.perf_counter()
        moves = [self.trainers.send_update.call(), self.rollouts.receive_update.call()]
        for f in moves:
            f.get()
        t2 = time.perf_counter()
        spans = {(side, p.rank): s for side, mesh in (("trainer", self.trainers),
                                                       ("rollout", self.rollouts))
                 for p, s in mesh.timings.call().get().items()}
        count, bad = mismatches(by_rank(self.rollouts.checksums.call(version).get()))
        t3 = time.perf_counter()
        return UpdateReport(version=version, train_step_s=t1 - t0, transfer_s=t2 - t1,
                            verify_s=t3 - t2, rdma_bytes=self.plan.delivered_bytes(),
                            num_params=count, mismatched=bad,
                            timing=update_timing(spans, self._dests))


class GlooBroadcast(_DistBaseline):
    """Collect on trainer 0, ``dist.broadcast`` buckets of full tensors, ``load_weights``.

    Args:
        trainer, rollout, model: As `MeshTransfer` (a demo model name or ``module:name``).

    Keyword Args:
        procs: (trainer procs, rollout procs), one ``worker`` axis each; not stopped here.
        bucket_bytes: Most bytes of one broadcast (a larger tensor goes alone).
        timeout_s: gloo's timeout for every collective and the rendezvous.

    Raises:
        ValueError: bad specs, ``bucket_bytes`` or ``timeout_s``, before anything spawns; a
            trainer parameter whose dtype differs from the checkpoint's, or rollout tensors
            no trainer holds, at connect before any byte moves.
    """

    broadcast = True
    stage = "broadcast"


class RingBroadcast(_DistBaseline):
    """`GlooBroadcast` with NCCL's ring pattern: trainer 0 sends each bucket to rollout 0,
    each rollout forwards it to the next while receiving the following one (gloo send/recv),
    so every link carries the checkpoint once, however many rollouts.

    Args, Keyword Args, Raises: as `GlooBroadcast`.
    """

    broadcast = ring = True
    stage = "broadcast"


class BucketedP2P(_DistBaseline):
    """Collect on balanced owners, ``dist.isend`` each rollout the buckets it needs, load.

    Args, Keyword Args, Raises: as `GlooBroadcast` (``bucket_bytes``: the fixed bucket size).
    """

    stage = "send"
