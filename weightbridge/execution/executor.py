"""One worker's side of a plan: round buffers (arenas), copy tables, and the writes of a stage.

Every worker of every path runs a `WorkerExecutor` (built once, at connect); the round
sequencer (`weightbridge.coordination.sequencer`) orders its steps (pack, each stage's writes,
assemble).
The executor is transport-free: it says which bytes of which arena go to which registered range
of which peer (`writes`), and a transport moves them. Receivers register, once, every range some
peer writes into (`incoming_ranges`, computed on the controller from all worker plans).

Typical usage::

    ex = WorkerExecutor(worker_plan, shard.params, CpuCopyKernels(), depth=2)  # at connect
    ex.pack(r)                                                         # trainers, per round
    for peer, key, src in ex.writes(r, Stage.RECEIVE): ...             # src: a view of an arena
    ex.assemble(r)                                                     # rollouts, after the round
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Iterable, Iterator, Mapping

import torch

from weightbridge.config import DEFAULT_DEPTH
from weightbridge.execution.boxcopy import CopyKernels
from weightbridge.execution.cpu_kernels import CpuCopyKernels
from weightbridge.types import Range, Stage, WorkerId, WorkerPlan
from weightbridge.views import memory_order


def on_real_cuda(device: torch.device | str) -> bool:
    """Whether ``device`` is a CUDA device this torch drives: False on the emulated device of
    the test suite (`weightbridge.testing.emulated_cuda`), where ``torch.cuda.is_available()``
    is False. Triton kernels and pinned host memory need a real one."""
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


def default_kernels(device: torch.device | str) -> CopyKernels:
    """The fastest implementation for tensors on ``device``.

    Triton kernels on CUDA (the ``kernels`` package, imported only here, so that the core imports
    without Triton), the vectorized torch path anywhere else. A CUDA device that this torch cannot
    drive (``torch.cuda.is_available()`` False: the test suite's emulated device,
    `weightbridge.testing.emulated_cuda`) gets the torch path, run under the device's rules.
    """
    if on_real_cuda(device):
        from kernels import TritonKernels  # lazy: Triton is needed only on GPUs

        return TritonKernels()
    return CpuCopyKernels()


def incoming_ranges(plans: Iterable[WorkerPlan], depth: int = DEFAULT_DEPTH
                    ) -> dict[WorkerId, set[Range]]:
    """Per receiving worker, every distinct (arena r % depth, offset, nbytes) some peer writes
    into, over all rounds."""
    out: dict[WorkerId, set[Range]] = {}
    for plan in plans:
        for rnd in plan.rounds:
            for w in rnd.writes:
                out.setdefault(w.peer, set()).add((rnd.index % depth, w.peer_offset, w.nbytes))
    return out


def outgoing_ranges(plan: WorkerPlan, depth: int = DEFAULT_DEPTH
                    ) -> set[tuple[WorkerId, Range]]:
    """(peer, range) of every write of one worker: the handles it needs."""
    return {(w.peer, (r.index % depth, w.peer_offset, w.nbytes))
            for r in plan.rounds for w in r.writes}


class WorkerExecutor:
    """A worker's ``depth`` round arenas and copy tables, built once, reused for every version.

    Parameters must stay the same tensor objects (update them in place): the tables point at
    their storage.
    """

    def __init__(self, plan: WorkerPlan, params: Mapping[str, torch.Tensor],
                 kernels: CopyKernels | None = None, *, depth: int = DEFAULT_DEPTH,
                 host_arenas: bool = False):
        assert depth >= 2, depth  # TransferConfig validates it
        self.plan, self.depth = plan, depth
        tensors = []
        for spec in plan.params:
            t = params.get(spec.name)
            if t is None:
                raise ValueError(f"{plan.worker} has no parameter {spec.name!r}; connect with "
                                 f"the same parameters its source map was extracted from")
            t = memory_order(t)  # as the probe saw it
            if (tuple(t.shape) != spec.shape
                    or str(t.dtype).removeprefix("torch.") != spec.dtype):
                raise ValueError(f"{plan.worker} parameter {spec.name!r} is {tuple(t.shape)} "
                                 f"{t.dtype}, but its source map says {spec.shape} {spec.dtype}")
            if not t.is_contiguous():
                raise ValueError(f"{plan.worker} parameter {spec.name!r} is not contiguous in "
                                 f"any dim order; the executor writes parameters in place, so "
                                 f"pass a contiguous tensor (or a permuted view of one)")
            tensors.append(t)
        self.device = tensors[0].device if tensors else torch.device("cpu")
        # Triton on CUDA, the vectorized torch path elsewhere: chosen by where the weights are.
        self.kernels = kernels or default_kernels(self.device)
        # Pack and assemble run on the library's threads, whose current CUDA device is GPU 0
        # whatever the proc bound, and Triton launches on the current device.
        self._guard = (functools.partial(torch.cuda.device, self.device)
                       if on_real_cuda(self.device) else contextlib.nullcontext)
        # Host arenas next to device parameters (`TransferConfig.arenas`): pack and assemble
        # go through one round of device scratch, copied across at each round, one round at a
        # time (rounds land on several threads at once).
        self._scratch = (torch.zeros(plan.buffer_bytes, dtype=torch.uint8, device=self.device)
                         if host_arenas and self.device.type != "cpu" else None)
        self._scratch_lock = threading.Lock()
        where = self.device if self._scratch is None else torch.device("cpu")
        self.arenas = [torch.zeros(plan.buffer_bytes, dtype=torch.uint8, device=where,
                                   pin_memory=self._scratch is not None
                                   and on_real_cuda(self.device))
                       for _ in range(depth)]
        self._pack = [self.kernels.build_table(r.pack, tensors) if r.pack else None
                      for r in plan.rounds]
        self._assemble = [self.kernels.build_table(r.assemble, tensors) if r.assemble else None
                          for r in plan.rounds]

    @property
    def num_rounds(self) -> int:
        return len(self.plan.rounds)

    def rewire(self, plan: WorkerPlan) -> None:
        """Take ``plan``, which differs from this one only in its writes (an engine joined and
        this worker forwards to it): the arenas, their registered ranges and the copy tables
        stay."""
        same = (plan.buffer_bytes == self.plan.buffer_bytes
                and len(plan.rounds) == len(self.plan.rounds)
                and all(a.pack == b.pack and a.assemble == b.assemble
                        for a, b in zip(plan.rounds, self.plan.rounds)))
        assert same, f"{plan.worker}: a rewired plan changed more than its writes"
        self.plan = plan

    def arena(self, r: int) -> torch.Tensor:
        """The round buffer of round r."""
        return self.arenas[r % self.depth]

    def pack(self, r: int, buffer: torch.Tensor | None = None) -> None:
        """Parameters -> arena r % depth (trainers), or -> ``buffer`` (on the parameters'
        device)."""
        if self._pack[r] is None:
            return
        staged = buffer is None and self._scratch is not None
        with self._guard(), (self._scratch_lock if staged else contextlib.nullcontext()):
            self.kernels.pack(self._pack[r], self._scratch if staged else
                              self.arena(r) if buffer is None else buffer)
            if staged:  # device -> host arena
                n = self.round_nbytes(r)[0]
                self.arena(r)[:n].copy_(self._scratch[:n])

    def assemble(self, r: int, buffer: torch.Tensor | None = None) -> None:
        """Arena r % depth (or ``buffer``, on the parameters' device) -> parameters (rollouts,
        after the round's last stage has landed)."""
        if self._assemble[r] is None:
            return
        staged = buffer is None and self._scratch is not None
        with self._guard(), (self._scratch_lock if staged else contextlib.nullcontext()):
            if staged:  # host arena -> device
                n = self.round_nbytes(r)[1]
                self._scratch[:n].copy_(self.arena(r)[:n])
            self.kernels.assemble(self._assemble[r], self._scratch if staged else
                                  self.arena(r) if buffer is None else buffer)

    def round_nbytes(self, r: int) -> tuple[int, int]:
        """(sent, assembled) bytes of round r: what a staging buffer keeps of the round.

        Sent bytes reach to the end of the round's last write: the planner pads every overlap
        to 8 bytes in the buffer (3 bf16 elements pack 6 bytes, the write carries 8), so a
        staged copy of only the packed bytes would be short of the write.
        """
        packed, assembled = (0 if t is None else int(t.nbytes)
                             for t in (self._pack[r], self._assemble[r]))
        ends = [w.offset + w.nbytes for w in self.plan.rounds[r].writes]
        return max([packed, *ends]), assembled

    def writes(self, r: int, stage: Stage, buffer: torch.Tensor | None = None
               ) -> Iterator[tuple[WorkerId, Range, torch.Tensor]]:
        """(peer, peer's registered range, source bytes) of every write of round r's stage;
        the bytes are read from arena r % depth, or from ``buffer`` (a staged copy of it)."""
        arena = self.arena(r) if buffer is None else buffer
        for w in self.plan.rounds[r].writes:
            if w.stage is stage:
                yield (w.peer, (r % self.depth, w.peer_offset, w.nbytes),
                       arena[w.offset:w.offset + w.nbytes])
