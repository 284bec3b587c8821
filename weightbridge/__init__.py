"""WeightBridge: weight transfer from RL trainers to rollout engines.

Layout discovery probes each worker's own ``load_weights`` and returns a compact `SourceMap`;
`correspond` intersects trainer and rollout maps in checkpoint coordinates.

Typical usage::

    spec = weightbridge.read_checkpoint_spec("model.safetensors")
    smap = weightbridge.extract_source_map(model.named_parameters, model.load_weights, spec)
    weightbridge.replay(smap, params, checkpoint)   # what load_weights does, from the map
"""

from weightbridge.config import TransferConfig
from weightbridge.coordination.adapters import ReceiverAdapter, SenderAdapter, TransferFailed
from weightbridge.coordination.local import run_plan_locally
from weightbridge.coordination.worker import (ChecksumMismatch, ReplicaMismatch, TransferWorker,
                                              UnsourcedParameter, WorkerParts)
from weightbridge.discovery.checkpoint_spec import read_checkpoint_spec
from weightbridge.discovery.correspond import correspond
from weightbridge.discovery.probe import extract_source_map
from weightbridge.discovery.replay import replay
from weightbridge.errors import LayoutError
from weightbridge.execution.boxcopy import CopyKernels, TorchCopyKernels
from weightbridge.execution.cpu_kernels import CpuCopyKernels
from weightbridge.execution.executor import default_kernels
from weightbridge.planning.plan import TransferPlan, plan_transfer
from weightbridge.planning.simulate import Cluster, Estimate, simulate
from weightbridge.types import (BoxCopy, BufferWrite, CheckpointSpec, Chunk, Correspondence,
                                Overlap, ParamSpec, Piece, Placement, Region, Round, SourceMap,
                                Stage, TensorSpec, Transfer, WorkerId, WorkerPlan, WorkerRound)

_MONARCH_NAMES = ("TransferGroup", "TransferAgent")
"""Imported on first use: they need Monarch, which the planning and in-process paths do not."""


def __getattr__(name: str):
    if name in _MONARCH_NAMES:
        from weightbridge.mesh import control

        return getattr(control, name)
    raise AttributeError(f"module 'weightbridge' has no attribute {name!r}")


__all__ = [
    "TransferAgent",
    "TransferGroup",
    "BoxCopy",
    "BufferWrite",
    "CheckpointSpec",
    "Chunk",
    "Cluster",
    "Correspondence",
    "CopyKernels",
    "CpuCopyKernels",
    "Estimate",
    "LayoutError",
    "Overlap",
    "ParamSpec",
    "Piece",
    "Placement",
    "ReceiverAdapter",
    "Region",
    "Round",
    "SenderAdapter",
    "SourceMap",
    "Stage",
    "TensorSpec",
    "TorchCopyKernels",
    "TransferConfig",
    "TransferFailed",
    "ChecksumMismatch",
    "ReplicaMismatch",
    "UnsourcedParameter",
    "Transfer",
    "TransferPlan",
    "TransferWorker",
    "WorkerId",
    "WorkerParts",
    "WorkerPlan",
    "WorkerRound",
    "correspond",
    "default_kernels",
    "extract_source_map",
    "plan_transfer",
    "read_checkpoint_spec",
    "replay",
    "run_plan_locally",
    "simulate",
]
