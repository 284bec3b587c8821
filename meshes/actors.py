"""Trainer and rollout actors of the controller-driven path: a model shard and nothing more.

Each actor builds its rank's `weightbridge.WorkerParts` with a worker factory (an import path,
``module:factory``; the demo model's are in `meshes.workers`), then, given the group handle,
its `TransferWorker` (`TransferGroup.worker`). The library's agents on the same procs serve
connect and the rounds (`weightbridge.mesh.control`); these endpoints are the demo's own:
the stand-in train step, the checksums that verify an update (and what a trainer holds),
the spans, the link probe.

Typical usage (see controller/driver.py)::

    trainers = procs.spawn("trainer", TrainerActor, "meshes.workers:tiny", trainer_spec)
    trainers.attach.call(group).get()
"""

from __future__ import annotations

import hashlib
import itertools
import time
from typing import Mapping

import torch
from monarch.actor import Actor, current_rank, endpoint

from meshes.device import bind_local_device
from meshes.factories import load_factory
from weightbridge.specs import RolloutSpec, TrainerSpec
from weightbridge import Placement, WorkerParts
from weightbridge.driver import TransferWorker
from weightbridge.mesh.transport import register_ranges, write

PROBE_TIMEOUT_S = 60


def checksums(params: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Per-parameter 64-bit blake2b digest of the raw bytes (read on the host: parameters
    on a GPU are copied there first)."""
    return {n: hashlib.blake2b(p.detach().contiguous().view(torch.uint8).cpu().numpy()
                               .tobytes(), digest_size=8).hexdigest()
            for n, p in params.items()}


class _WorkerActor(Actor):
    """One rank of either side: its parts, its placement, its `TransferWorker`."""

    side = ""
    worker_class = TransferWorker
    """The worker the group builds for this rank (tests substitute faulty subclasses)."""

    def __init__(self, factory: str, spec: TrainerSpec | RolloutSpec, first_rank: int = 0):
        # ``first_rank``: the flat rank of this mesh's first actor in its side (an engine
        # that joined later runs on procs of its own).
        self.index = first_rank + current_rank().rank
        self.device = bind_local_device()  # this proc's GPU, by its place on the host
        if not torch.cuda.is_available():
            # CPU workers: every proc of both meshes shares this host's cores, and torch's
            # default of one thread per core per process oversubscribes them many times over.
            torch.set_num_threads(1)
        self.factory, self.spec = load_factory(factory), spec
        self.parts = self._make_parts(self.index)
        self.worker: TransferWorker | None = None

    def _make_parts(self, rank: int) -> WorkerParts:
        parts = self.factory(self.side, self.spec, rank)
        if not isinstance(parts, WorkerParts):
            raise ValueError(f"the worker factory returned {type(parts).__name__}; it must "
                             f"return weightbridge.WorkerParts")
        return parts

    def _placement(self) -> Placement:
        # One planning node per host of the spec: workers [h * gpus, (h + 1) * gpus) share
        # host h (on this machine the hosts are names; attached meshes are laid out the same).
        raise NotImplementedError

    @endpoint
    def attach(self, group) -> None:
        """Build this rank's worker in ``group`` (a `weightbridge.TransferGroup`)."""
        p = self.parts
        self.worker = group.worker(self.side, p.params, p.load_weights, p.spec,
                                   placement=self._placement(), cls=self.worker_class)

    def _checkpoint(self, version: int | Mapping[str, int]):
        """The checkpoint this rank reads, of ``version``, or of each tensor's own version
        (tensor -> version: after delta updates, tensors hold the version they last changed
        in)."""
        names = self.worker.source_map.tensors() if self.worker.source_map else None
        if isinstance(version, int):
            return self.parts.checkpoint(version, names)
        by_version: dict[int, list[str]] = {}
        for name in (version if names is None else names):
            by_version.setdefault(version[name], []).append(name)
        return itertools.chain.from_iterable(self.parts.checkpoint(v, ns)
                                             for v, ns in by_version.items())

    @endpoint
    def busy(self, seconds: float) -> int:
        """A stand-in for the device work of a train or generation step (the example loops):
        reads every parameter, pass after pass, for ``seconds``; returns the passes made."""
        end, passes = time.monotonic() + seconds, 0
        with torch.no_grad():
            while time.monotonic() < end:
                for p in self.parts.params.values():
                    p.float().sum()
                passes += 1
        return passes

    @endpoint
    def checksums(self, version: int | Mapping[str, int]
                  ) -> tuple[dict[str, str], dict[str, str]]:
        """(checksums of the live parameters, of this rank's own load_weights of ``version``
        on a second build of its parts): a rollout's verification, and whether a trainer's
        parameters still hold the version the engines hold (a join's catch-up)."""
        return self._checksums(version)

    def _checksums(self, version: int | Mapping[str, int]
                   ) -> tuple[dict[str, str], dict[str, str]]:
        scratch = self._make_parts(self.index)
        with torch.no_grad():
            scratch.load_weights(self._checkpoint(version))
        return checksums(self.parts.params), checksums(scratch.params)

    @endpoint
    def timings(self) -> list[tuple[str, int, int, int]]:
        """This update's (stage, round, start_ns, end_ns) spans; clears them."""
        return self.worker.take_spans()

    @endpoint
    def probe_link(self, handle, nbytes: int, repeats: int) -> float:
        """Best seconds of ``repeats`` RDMA writes of ``nbytes`` into ``handle``, after a warm-up
        write (the first write starts this proc's RDMA manager)."""
        return self._probe_link(handle, nbytes, repeats)

    def _probe_link(self, handle, nbytes: int, repeats: int) -> float:
        src = torch.full((nbytes,), 7, dtype=torch.uint8)
        best = float("inf")
        for i in range(repeats + 1):
            start = time.monotonic_ns()
            write(handle, src, timeout_s=PROBE_TIMEOUT_S).get()
            best = best if i == 0 else min(best, (time.monotonic_ns() - start) / 1e9)
        return best


class TrainerActor(_WorkerActor):
    """One trainer rank; its worker packs and writes the RECEIVE stage."""

    side = "trainer"

    def _placement(self) -> Placement:
        return Placement(f"trainer-h{self.index // self.spec.gpus}")

    @endpoint
    def train_step(self, version: int) -> None:
        """A stand-in optimizer step: the parameters become those of ``version``."""
        self._train_step(version)

    def _train_step(self, version: int) -> None:
        with torch.no_grad():
            if self.parts.train_step is not None and isinstance(version, int):
                self.parts.train_step(version)
            else:
                self.parts.load_weights(self._checkpoint(version))


class RolloutActor(_WorkerActor):
    """One rollout rank; its worker forwards and assembles."""

    side = "rollout"

    def _placement(self) -> Placement:
        return Placement(f"rollout-h{self.index // self.spec.gpus}",
                         engine=self.index // self.spec.workers_per_engine)

    @endpoint
    def probe_buffer(self, nbytes: int):
        """Register an ``nbytes`` scratch RDMA buffer for the link probe; returns its handle."""
        self._probe_arena = torch.zeros(nbytes, dtype=torch.uint8)
        return register_ranges([self._probe_arena], [(0, 0, nbytes)])[(0, 0, nbytes)]

