"""The driver face: what a custom driver of a transfer group imports (`controller/` does).

Users of the adapters need only ``weightbridge`` (the user face). A driver owns a group's
sequencing itself, as `controller.MeshTransfer` does: it builds a control plane, connects,
plans, runs updates round by round, and handles joins, leaves and losses::

    from weightbridge import TransferConfig
    from weightbridge.driver import LocalControl, connect_group, run_update

    control = LocalControl()                     # or MeshControl(group) on Monarch meshes
    ...                                          # a TransferWorker per rank, registered
    maps, group = connect_group(control, TransferConfig())
    run_update(control, group, version=1)        # after the trainers' step

Sections: control planes and calls; connect, plan and run an update (`weightbridge.coordination
.session`) and the group's one owner (`GroupLeader`); membership and losses (`lose`); the
worker; errors across processes; mesh specs; plan values and the views a custom data plane
copies through (the baselines'); and, imported on first use because they need Monarch, the
mesh control plane and RDMA transport (`MeshControl`, `TransferGroup`, `TransferAgent`,
`configure_transport`, `register_ranges`, `write`, `write_batch`, `wait_all`, `drop_all`,
`backend`).
"""

from __future__ import annotations

# The package first: in an actor process several threads import the library at once (an
# endpoint, the agent's serve threads, unpickling a message). ``import weightbridge`` waits
# until another thread has finished the package's __init__; importing a submodule does not, so
# this module's imports (session, leader, ...) could lock modules that __init__, half done in
# the other thread, needs next, and one of them is then handed out half built ("cannot import
# name ... partially initialized module").
import weightbridge  # noqa: F401,I001

from weightbridge.config import DEFAULT_DEPTH, Mode, TransferConfig
from weightbridge.coordination.control import (ControlPlane, PeerCall, Transport, engine_workers,
                                               rollouts, trainers)
from weightbridge.coordination.delta import (AUTO, changed_params, check_changed,
                                             tensors_loaded_by)
from weightbridge.coordination.elastic import check_removable, join_group, leave_group
from weightbridge.coordination.leader import GroupLeader
from weightbridge.coordination.local_control import LocalControl, WorkerGone
from weightbridge.coordination.loss import Loss, lose, one_line
from weightbridge.coordination.version import check_version
from weightbridge.coordination.session import (ConnectedGroup, ConnectSteps, GroupMaps,
                                               check_configs, connect_group, plan_group,
                                               probe_group, run_update, unanswered)
from weightbridge.coordination.worker import TransferWorker
from weightbridge.discovery.replay import param_view, region_view
from weightbridge.errors import (StepFailed, describe, failure_kind, from_kind, library_error,
                                 surfaced)
from weightbridge.execution.boxcopy import CopyKernels
from weightbridge.execution.executor import default_kernels
from weightbridge.planning.route import RECEIVE, STAGES
from weightbridge.planning.ideal import eq1
from weightbridge.specs import RolloutSpec, TrainerSpec
from weightbridge.types import (BoxCopy, BufferWrite, CheckpointSpec, Chunk, Correspondence,
                                Overlap, ParamSpec, Piece, Region, Round, SourceMap, Stage,
                                Transfer, WorkerId, WorkerPlan, WorkerRound, dtype_itemsize,
                                scaled_tensor)
from weightbridge.views import as_bits, memory_order

_MESH = {"MeshControl": "control", "TransferGroup": "group", "TransferAgent": "agent",
         "configure_transport": "transport", "backend": "transport", "drop_all": "transport",
         "register_ranges": "transport", "wait_all": "transport", "write": "transport",
         "write_batch": "transport", "own_faults": "faults", "disown_faults": "faults"}
"""Imported on first use from ``weightbridge.mesh.<module>``: they need Monarch."""


def __getattr__(name: str):
    if name in _MESH:
        import importlib

        return getattr(importlib.import_module(f"weightbridge.mesh.{_MESH[name]}"), name)
    raise AttributeError(f"module 'weightbridge.driver' has no attribute {name!r}")


__all__ = [
    # control planes and calls
    "ControlPlane", "LocalControl", "MeshControl", "PeerCall", "Transport", "WorkerGone",
    "engine_workers", "rollouts", "trainers",
    # connect, plan, run an update; the group's owner
    "AUTO", "ConnectedGroup", "ConnectSteps", "GroupLeader", "GroupMaps", "changed_params",
    "check_changed", "check_configs", "check_version", "tensors_loaded_by",
    "connect_group", "plan_group", "probe_group", "run_update", "unanswered",
    # membership, and a loss
    "Loss", "check_removable", "join_group", "leave_group", "lose", "one_line",
    # the worker, its kernels, the config
    "CopyKernels", "DEFAULT_DEPTH", "Mode", "TransferConfig", "TransferWorker",
    "default_kernels",
    # errors across processes
    "StepFailed", "describe", "failure_kind", "from_kind", "library_error", "surfaced",
    # mesh specs
    "RolloutSpec", "TrainerSpec",
    # plan values, tables and views
    "BoxCopy", "BufferWrite", "CheckpointSpec", "Chunk", "Correspondence", "Overlap",
    "ParamSpec", "Piece", "RECEIVE", "Region", "STAGES", "Round", "SourceMap", "Stage", "Transfer",
    "WorkerId", "WorkerPlan", "WorkerRound", "as_bits", "dtype_itemsize", "eq1",
    "memory_order", "param_view", "region_view", "scaled_tensor",
    # Monarch (imported on first use)
    "TransferAgent", "TransferGroup", "backend", "configure_transport", "drop_all",
    "register_ranges", "wait_all", "write", "write_batch", "own_faults", "disown_faults",
]
