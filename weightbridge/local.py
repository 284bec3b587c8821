"""Run a plan in one process: the reference executor for tests and mesh-free simulations.

It does exactly what the mesh executor does, minus the network: one `WorkerExecutor` per worker
(copy tables and two round arenas, built once); per round, trainers pack, each stage's writes
copy bytes between arenas (standing in for RDMA writes), and rollouts assemble.

Typical usage::

    plan = plan_transfer(trainers, rollouts, round_bytes=1 << 20)
    run_plan_locally(plan, [dict(m.named_parameters()) for m in trainer_models],
                     [dict(m.named_parameters()) for m in rollout_models])
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from weightbridge.boxcopy import CopyKernels, TorchCopyKernels
from weightbridge.executor import WorkerExecutor
from weightbridge.plan import TransferPlan
from weightbridge.plan_route import STAGES


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
    # Copy descriptors count logical elements, so strided parameters get a dense shadow that
    # is written back at the end.
    shadows = [{name: (t if t.is_contiguous() else t.contiguous()) for name, t in p.items()}
               for p in list(trainer_params) + list(rollout_params)]
    executors = {w: WorkerExecutor(plan.for_worker(w), params, kernels)
                 for w, params in zip(plan.workers, shadows)}
    for r in range(plan.num_rounds):
        for ex in executors.values():
            ex.pack(r)
        for stage in STAGES:  # a stage's writes read bytes that earlier stages delivered
            for ex in executors.values():
                for peer, (parity, offset, nbytes), src in ex.writes(r, stage):
                    executors[peer].arenas[parity][offset:offset + nbytes].copy_(src)
        for ex in executors.values():
            ex.assemble(r)
    for params, shadow in zip(rollout_params, shadows[len(trainer_params):]):
        for name, target in params.items():
            if shadow[name] is not target:
                target.copy_(shadow[name])
