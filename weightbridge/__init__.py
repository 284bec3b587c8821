"""WeightBridge: weight transfer from RL trainers to rollout engines.

The user face: what an RL framework integrating WeightBridge calls (docs/integration.md).
Custom drivers of a group (control planes, connect, run an update, the group leader, mesh
specs) import `weightbridge.driver`; wire values are in `weightbridge.types`.

    TransferConfig                          round size, depth, timeouts, sync mode
    TransferGroup, SenderAdapter,           the group on Monarch meshes and each rank's part
      ReceiverAdapter, WorkerParts,
      Placement, CheckpointSpec, TensorSpec
    read_checkpoint_spec, extract_source_map, correspond, replay, SourceMap    discovery
    plan_transfer, TransferPlan, simulate, Cluster, Estimate, run_plan_locally planning
    CpuCopyKernels, TorchCopyKernels        copy paths
    WeightBridgeError and its subclasses (weightbridge.errors), UnsourcedParameter (a warning)

Typical usage::

    spec = weightbridge.read_checkpoint_spec("model.safetensors")
    smap = weightbridge.extract_source_map(model.named_parameters, model.load_weights, spec)
    weightbridge.replay(smap, params, checkpoint)   # what load_weights does, from the map

Names that were exported here before and are not on this face still import, with a
DeprecationWarning naming where they live now.
"""

from weightbridge.config import TransferConfig
from weightbridge.adapters import ReceiverAdapter, SenderAdapter
from weightbridge.coordination.local import run_plan_locally
from weightbridge.coordination.worker import UnsourcedParameter, WorkerParts
from weightbridge.discovery.checkpoint_spec import read_checkpoint_spec
from weightbridge.discovery.correspond import correspond
from weightbridge.discovery.probe import extract_source_map
from weightbridge.discovery.replay import replay
from weightbridge.errors import (CatchUpRefused, ChecksumMismatch, ConfigMismatch, GroupClosed,
                                 LayoutError, ParameterRebound, ReplicaMismatch, TransferFailed,
                                 WeightBridgeError, WorkersLost)
from weightbridge.execution.boxcopy import TorchCopyKernels
from weightbridge.execution.cpu_kernels import CpuCopyKernels
from weightbridge.planning.plan import TransferPlan, plan_transfer
from weightbridge.simulation.simulate import Cluster, Estimate, simulate
from weightbridge.types import CheckpointSpec, Placement, SourceMap, TensorSpec

_MOVED = {
    **{name: "weightbridge.types" for name in (
        "BoxCopy", "BufferWrite", "Chunk", "Correspondence", "Overlap", "ParamSpec", "Piece",
        "Region", "Round", "Stage", "Transfer", "WorkerId", "WorkerPlan", "WorkerRound")},
    "TransferWorker": "weightbridge.driver",
    "TransferAgent": "weightbridge.driver",
    "CopyKernels": "weightbridge.driver",
    "default_kernels": "weightbridge.driver",
}
"""Names exported here before the user face was cut down -> where they live now (deprecated
here: they import with a DeprecationWarning for a release)."""


def __getattr__(name: str):
    import importlib

    if name == "TransferGroup":  # imported on first use: it needs Monarch
        return importlib.import_module("weightbridge.mesh.group").TransferGroup
    if name in _MOVED:
        import warnings

        warnings.warn(f"weightbridge.{name} is deprecated: import it from {_MOVED[name]} "
                      f"(from {_MOVED[name]} import {name})", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module 'weightbridge' has no attribute {name!r}")


__all__ = [
    "CatchUpRefused",
    "CheckpointSpec",
    "ChecksumMismatch",
    "Cluster",
    "ConfigMismatch",
    "CpuCopyKernels",
    "Estimate",
    "GroupClosed",
    "LayoutError",
    "ParameterRebound",
    "Placement",
    "ReceiverAdapter",
    "ReplicaMismatch",
    "SenderAdapter",
    "SourceMap",
    "TensorSpec",
    "TorchCopyKernels",
    "TransferConfig",
    "TransferFailed",
    "TransferGroup",
    "TransferPlan",
    "UnsourcedParameter",
    "WeightBridgeError",
    "WorkerParts",
    "WorkersLost",
    "correspond",
    "extract_source_map",
    "plan_transfer",
    "read_checkpoint_spec",
    "replay",
    "run_plan_locally",
    "simulate",
]
