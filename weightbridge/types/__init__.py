"""Value types that cross module and process boundaries.

Every type here is a frozen dataclass of ints, strings and tuples: picklable, hashable and cheap
to compare. None of them holds a tensor, so a `SourceMap` or a plan can travel through Monarch
endpoints to the controller and back without moving weight bytes.

Coordinates: a checkpoint tensor is addressed in its own N-d coordinates (HF checkpoint names and
shapes). A runtime parameter is addressed by its *logical* flat index (row-major over its shape,
whatever its storage strides are). A `Piece` ties the two together: one slice-copy that
`load_weights` performed.

Three modules, imported in this order (each imports only the ones before it): `specs`
(checkpoint and parameter specs), `maps` (source maps, box copies), `plans` (placement,
correspondence, rounds, per-worker plans); and `build.instances`, which makes them by the
million (a worker plan's boxes and writes; a source map's pieces when it is unpickled: source
maps and worker plans pickle as plain tuples). Import the names from here.
"""

from weightbridge.types.maps import (SCALE_SUFFIX, BoxCopy, Piece, Region, SourceMap,
                                     pieces_by_param, scale_tensor, scaled_tensor)
from weightbridge.types.plans import (BufferWrite, Chunk, Correspondence, Overlap, Placement,
                                      Range, Round, Stage, Transfer, WorkerId, WorkerPlan,
                                      WorkerRound)
from weightbridge.types.specs import (CONVERTIBLE_DTYPES, QUANT_DTYPE, SCALE_DTYPE, CheckpointSpec,
                                      ParamSpec, TensorSpec, dtype_itemsize)

__all__ = [
    "BoxCopy", "BufferWrite", "CONVERTIBLE_DTYPES", "CheckpointSpec", "Chunk", "Correspondence",
    "Overlap", "ParamSpec",
    "Piece", "Placement", "Range", "Region", "Round", "SourceMap", "Stage", "TensorSpec",
    "Transfer", "WorkerId", "WorkerPlan", "WorkerRound", "dtype_itemsize", "pieces_by_param",
    "QUANT_DTYPE", "SCALE_DTYPE", "SCALE_SUFFIX", "scale_tensor", "scaled_tensor",
]
