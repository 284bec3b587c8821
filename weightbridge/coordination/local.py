"""Run a plan in one process: the reference executor for tests and mesh-free simulations.

It runs exactly what a mesh runs, minus the network: one `TransferWorker` per worker (copy
tables and round buffers, built once) on a `LocalControl`, and the same connect and round
sequencer as every other path (`weightbridge.coordination.session`); each write is a copy
between round buffers, standing in for an RDMA write.

Typical usage::

    plan = plan_transfer(trainers, rollouts, round_bytes=1 << 20)
    run_plan_locally(plan, [dict(m.named_parameters()) for m in trainer_models],
                     [dict(m.named_parameters()) for m in rollout_models])
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from weightbridge.config import DEFAULT_DEPTH, DEFAULT_ROUND_CONTROL, TransferConfig
from weightbridge.coordination.control import PeerCall
from weightbridge.coordination.local_control import LocalControl
from weightbridge.coordination.sequencer import active_steps
from weightbridge.coordination.session import ConnectedGroup, run_update
from weightbridge.coordination.worker import TransferWorker
from weightbridge.execution.boxcopy import CopyKernels, TorchCopyKernels
from weightbridge.execution.executor import incoming_ranges, outgoing_ranges
from weightbridge.planning.plan import TransferPlan
from weightbridge.types import Placement
from weightbridge.views import memory_order


def run_plan_locally(plan: TransferPlan, trainer_params: Sequence[Mapping[str, torch.Tensor]],
                     rollout_params: Sequence[Mapping[str, torch.Tensor]], *,
                     kernels: CopyKernels | None = None, depth: int = DEFAULT_DEPTH,
                     round_control: str = DEFAULT_ROUND_CONTROL) -> None:
    """Move the trainers' parameter bytes into the rollouts' parameters as ``plan`` says.

    Args:
        plan: From `plan_transfer`.
        trainer_params: Per trainer worker (plan order), parameter name -> tensor.
        rollout_params: Per rollout worker (plan order), parameter name -> tensor; written in
            place. Elements no checkpoint element lands in are left untouched.

    Keyword Args:
        kernels: Pack/assemble implementation; `TorchCopyKernels` when None.
        depth: Round buffers per worker (`TransferConfig.depth`).
        round_control: How the rounds are driven (`TransferConfig.round_control`).

    Raises:
        ValueError: wrong number of workers, or a parameter missing or of another shape/dtype.
    """
    config = TransferConfig(round_bytes=plan.round_bytes, depth=depth,
                            round_control=round_control)
    kernels = kernels or TorchCopyKernels()
    for side, given, want in (("trainer", trainer_params, plan.trainers),
                              ("rollout", rollout_params, plan.rollouts)):
        if len(given) != len(want):
            raise ValueError(f"the plan has {len(want)} {side} workers but {len(given)} "
                             f"{side} parameter mappings were given")
    # The plan is given: hand it out as connect would after planning (no probe).
    plans = plan.worker_plans()
    shadows = [_shadows(p) for p in list(trainer_params) + list(rollout_params)]
    control = LocalControl()
    for w, params in zip(plan.workers, shadows):
        control.add(TransferWorker(w.side, params, _no_loader, None, rank=w.index,
                                   placement=Placement(w.side), transport=control.transport,
                                   config=config, kernels=kernels, control=control))
    ranges = incoming_ranges(plans.values(), depth)
    for w in plan.workers:
        control.call([w], PeerCall.SETUP, plans[w], sorted(ranges.get(w, ())))
        control.call([w], PeerCall.SET_PEERS, dict.fromkeys(outgoing_ranges(plans[w], depth)))
    rollouts = tuple(w for w in plan.workers if w.side == "rollout")
    run_update(control, ConnectedGroup(plan=plan, active=active_steps(plans.values()),
                                       live_rollouts=rollouts, num_handles=0, depth=depth,
                                       round_control=config.round_control))
    for params, shadow in zip(rollout_params, shadows[len(trainer_params):]):
        for name, target in params.items():
            if shadow[name] is not target:
                target.copy_(shadow[name])


def _shadows(params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``params`` as the executor takes them. Source maps describe a parameter in memory order
    (the probe sees a transposed view through `memory_order`), and the executor writes such a
    view in place, so it is passed as is. Only memory that no dim order makes dense (row
    padding, every other element) gets a dense copy in logical order, written back at the end.
    """
    out = {}
    for name, t in params.items():
        out[name] = t if memory_order(t).is_contiguous() else t.contiguous()
    return out


def _no_loader(weights) -> None:
    raise AssertionError("run_plan_locally never probes: the plan is given")
