"""Run a plan in one process: the reference executor for tests and mesh-free simulations.

It does exactly what a distributed executor does, minus the network: per worker, build the copy
tables once; per round, trainers pack their send buffers, each stage's writes copy bytes between
buffers (standing in for RDMA writes), and rollouts assemble their receive buffers into
parameters. Two buffers per worker alternate between rounds, as on the real mesh.

Typical usage::

    plan = plan_transfer(trainers, rollouts, round_bytes=1 << 20)
    run_plan_locally(plan, [dict(m.named_parameters()) for m in trainer_models],
                     [dict(m.named_parameters()) for m in rollout_models])
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from weightbridge.boxcopy import CopyKernels, TorchCopyKernels
from weightbridge.plan import TransferPlan
from weightbridge.plan_route import STAGES
from weightbridge.types import WorkerId, WorkerPlan


def run_plan_locally(plan: TransferPlan, trainer_params: Sequence[Mapping[str, torch.Tensor]],
                     rollout_params: Sequence[Mapping[str, torch.Tensor]], *,
                     kernels: CopyKernels | None = None) -> None:
    """Move the trainers' parameter bytes into the rollouts' parameters as ``plan`` says.

    Args:
        plan: From `plan_transfer`.
        trainer_params: Per trainer worker (plan order), parameter name -> tensor.
        rollout_params: Per rollout worker (plan order), parameter name -> tensor; written in
            place. Elements no checkpoint element lands in are left untouched.

    Keyword Args:
        kernels: Pack/assemble implementation; `TorchCopyKernels` when None.

    Raises:
        ValueError: wrong number of workers, or a parameter missing or of another shape/dtype.
    """
    kernels = kernels or TorchCopyKernels()
    for side, given, want in (("trainer", trainer_params, plan.trainers),
                              ("rollout", rollout_params, plan.rollouts)):
        if len(given) != len(want):
            raise ValueError(f"the plan has {len(want)} {side} workers but {len(given)} "
                             f"{side} parameter mappings were given")
    workers = [_Worker(plan.for_worker(w), params, kernels)
               for w, params in zip(plan.workers, list(trainer_params) + list(rollout_params))]
    by_id = {w.plan.worker: w for w in workers}
    for r in range(plan.num_rounds):
        for w in workers:
            w.pack(r)
        for stage in STAGES:  # a stage's writes read bytes that earlier stages delivered
            for w in workers:
                for write in w.plan.rounds[r].writes:
                    if write.stage is stage:
                        src = w.buffers[r % 2][write.offset:write.offset + write.nbytes]
                        peer = by_id[write.peer].buffers[r % 2]
                        peer[write.peer_offset:write.peer_offset + write.nbytes].copy_(src)
        for w in workers:
            w.assemble(r)
    for w in workers:
        w.write_back()


class _Worker:
    """One worker's tensors, buffers and copy tables."""

    def __init__(self, plan: WorkerPlan, params: Mapping[str, torch.Tensor],
                 kernels: CopyKernels):
        self.plan, self.kernels = plan, kernels
        self.targets: list[torch.Tensor] = []
        self.tensors: list[torch.Tensor] = []
        for spec in plan.params:
            t = params.get(spec.name)
            if t is None:
                raise ValueError(f"{_name(plan.worker)} has no parameter {spec.name!r}; pass the "
                                 f"same parameters its source map was extracted from")
            if tuple(t.shape) != spec.shape or str(t.dtype).removeprefix("torch.") != spec.dtype:
                raise ValueError(f"{_name(plan.worker)} parameter {spec.name!r} is "
                                 f"{tuple(t.shape)} {t.dtype}, but its source map says "
                                 f"{spec.shape} {spec.dtype}")
            self.targets.append(t)
            # Copy descriptors count logical elements, so strided parameters get a dense shadow.
            self.tensors.append(t if t.is_contiguous() else t.contiguous())
        device = self.tensors[0].device if self.tensors else torch.device("cpu")
        self.buffers = [torch.zeros(plan.buffer_bytes, dtype=torch.uint8, device=device)
                        for _ in range(2)]
        self.pack_tables = [kernels.build_table(r.pack, self.tensors) for r in plan.rounds]
        self.assemble_tables = [kernels.build_table(r.assemble, self.tensors)
                                for r in plan.rounds]

    def pack(self, r: int) -> None:
        if self.plan.rounds[r].pack:
            self.kernels.pack(self.pack_tables[r], self.buffers[r % 2])

    def assemble(self, r: int) -> None:
        if self.plan.rounds[r].assemble:
            self.kernels.assemble(self.assemble_tables[r], self.buffers[r % 2])

    def write_back(self) -> None:
        if self.plan.worker.side == "rollout":
            for target, shadow in zip(self.targets, self.tensors):
                if shadow is not target:
                    target.copy_(shadow)


def _name(worker: WorkerId) -> str:
    return f"{worker.side} worker {worker.index}"
