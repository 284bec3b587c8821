"""WeightBridge: weight transfer from RL trainers to rollout engines.

Layout discovery probes each worker's own ``load_weights`` and returns a compact `SourceMap`;
`correspond` intersects trainer and rollout maps in checkpoint coordinates.

Typical usage::

    spec = weightbridge.CheckpointSpec.from_safetensors("model.safetensors")
    smap = weightbridge.extract_source_map(model.named_parameters, model.load_weights, spec)
    smap.load(params, checkpoint)   # what load_weights does, replayed from the map
"""

from weightbridge.errors import LayoutError
from weightbridge.probe import extract_source_map
from weightbridge.types import (
    BoxCopy,
    CheckpointSpec,
    ParamSpec,
    Piece,
    Placement,
    Region,
    SourceMap,
    TensorSpec,
)

__all__ = [
    "BoxCopy",
    "CheckpointSpec",
    "LayoutError",
    "ParamSpec",
    "Piece",
    "Placement",
    "Region",
    "SourceMap",
    "TensorSpec",
    "extract_source_map",
]
