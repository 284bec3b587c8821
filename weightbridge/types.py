"""Value types that cross module and process boundaries.

Every type here is a frozen dataclass of ints, strings and tuples: picklable, hashable and cheap
to compare. None of them holds a tensor, so a `SourceMap` or a plan can travel through Monarch
endpoints to the controller and back without moving weight bytes.

Coordinates: a checkpoint tensor is addressed in its own N-d coordinates (HF checkpoint names and
shapes). A runtime parameter is addressed by its *logical* flat index (row-major over its shape,
whatever its storage strides are). A `Piece` ties the two together: one slice-copy that
`load_weights` performed.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Mapping

if TYPE_CHECKING:
    import torch

# --------------------------------------------------------------------------------------------
# Checkpoint and parameter specs
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Name, shape and dtype of one tensor.

    Example: ``TensorSpec("model.layers.0.mlp.gate_proj.weight", (768, 2048), "bfloat16")``
    """

    name: str
    """Checkpoint FQN (or parameter FQN when used as a `ParamSpec`)."""
    shape: tuple[int, ...]
    """Logical shape; ``()`` for a 0-d tensor."""
    dtype: str
    """torch dtype name without the ``torch.`` prefix, e.g. ``"bfloat16"``."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


ParamSpec = TensorSpec
"""A runtime parameter's name, shape and dtype (same fields as a checkpoint tensor)."""


@dataclass(frozen=True, slots=True)
class CheckpointSpec:
    """The checkpoint both sides agree on: the common coordinate system of layout discovery.

    Build it from tensors (``CheckpointSpec.from_tensors(state_dict)``) or from safetensors
    headers (``weightbridge.read_checkpoint_spec("model.safetensors")``; no tensor data is read).

    Example: ``CheckpointSpec((TensorSpec("lm_head.weight", (151936, 2048), "bfloat16"), ...))``
    """

    tensors: tuple[TensorSpec, ...]
    """Every checkpoint tensor, in a fixed order (the order of global element indices)."""
    _by_name: dict[str, int] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        by_name: dict[str, int] = {}
        for i, t in enumerate(self.tensors):
            if t.name in by_name:
                raise ValueError(f"checkpoint tensor {t.name!r} appears twice; names must be unique")
            by_name[t.name] = i
        object.__setattr__(self, "_by_name", by_name)

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, "torch.Tensor"]) -> "CheckpointSpec":
        """Spec of an in-memory checkpoint (a name -> tensor mapping)."""
        return cls(tuple(TensorSpec(n, tuple(t.shape), str(t.dtype).removeprefix("torch."))
                         for n, t in tensors.items()))

    def __getitem__(self, name: str) -> TensorSpec:
        try:
            return self.tensors[self._by_name[name]]
        except KeyError:
            raise KeyError(f"{name!r} is not a tensor of this checkpoint") from None

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __len__(self) -> int:
        return len(self.tensors)

    def index(self, name: str) -> int:
        """Position of a tensor in `tensors`."""
        return self._by_name[name]

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.tensors)

    def differences(self, other: "CheckpointSpec", labels: tuple[str, str] = ("this", "other")
                    ) -> tuple[str, ...]:
        """One line per tensor that is missing on one side or has another shape or dtype.

        Tensor order is ignored (source maps address tensors by name). Empty when both specs
        describe the same tensors.

        Example: ``("'lm_head.weight': trainer (1024, 128) bfloat16, rollout (1000, 128)
        bfloat16",)`` for ``labels=("trainer", "rollout")``.
        """
        out = []
        for t in self.tensors:
            if t.name not in other:
                out.append(f"{t.name!r}: only in {labels[0]}")
                continue
            o = other[t.name]
            if (t.shape, t.dtype) != (o.shape, o.dtype):
                out.append(f"{t.name!r}: {labels[0]} {t.shape} {t.dtype}, "
                           f"{labels[1]} {o.shape} {o.dtype}")
        out += [f"{t.name!r}: only in {labels[1]}" for t in other.tensors if t.name not in self]
        return tuple(out)


# --------------------------------------------------------------------------------------------
# Source maps
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Region:
    """A box of checkpoint elements: along each tensor dim an arithmetic progression.

    Element coordinates are ``start[d] + step[d] * i[d]`` for ``0 <= i[d] < count[d]``. Steps are
    >= 1 (a step of 1 is an ordinary slice; 2 picks every other row, as a rotary interleave does).
    A 0-d tensor is the region with empty tuples.

    Example: rows 0..767 and columns 1024..2047 of a (768, 2048) weight:
    ``Region("model.layers.0.mlp.gate_proj.weight", (0, 1024), (768, 1024), (1, 1))``
    """

    tensor: str
    """Checkpoint FQN."""
    start: tuple[int, ...]
    """First coordinate along each dim."""
    count: tuple[int, ...]
    """Number of coordinates along each dim (all >= 1)."""
    step: tuple[int, ...]
    """Distance between coordinates along each dim (all >= 1)."""

    @property
    def numel(self) -> int:
        return math.prod(self.count)

    @property
    def stop(self) -> tuple[int, ...]:
        """One past the last coordinate along each dim."""
        return tuple(s + k * (c - 1) + 1 for s, c, k in zip(self.start, self.count, self.step))

    def intersect(self, other: "Region") -> "Region | None":
        """The elements in both regions, or None when they share none."""
        if other.tensor != self.tensor:
            return None
        start, count, step = [], [], []
        for dim in zip(self.start, self.count, self.step, other.start, other.count, other.step):
            got = _intersect_progressions(*dim)
            if got is None:
                return None
            start.append(got[0]), count.append(got[1]), step.append(got[2])
        return Region(self.tensor, tuple(start), tuple(count), tuple(step))


def _intersect_progressions(s1: int, c1: int, k1: int, s2: int, c2: int, k2: int
                            ) -> tuple[int, int, int] | None:
    """Intersect {s1 + k1*i, i < c1} with {s2 + k2*j, j < c2}: (start, count, step) or None."""
    lo = max(s1, s2)
    hi = min(s1 + k1 * (c1 - 1), s2 + k2 * (c2 - 1))
    if lo > hi:
        return None
    if k1 == 1 and k2 == 1:  # the common case: plain slices
        return lo, hi - lo + 1, 1
    # Solve x = s1 (mod k1), x = s2 (mod k2) by CRT; solutions form a progression of step lcm.
    g = math.gcd(k1, k2)
    if (s2 - s1) % g:
        return None
    lcm = k1 // g * k2
    m = (s2 - s1) // g * pow(k1 // g, -1, k2 // g) % (k2 // g) if k2 // g > 1 else 0
    x0 = s1 + k1 * m  # one solution; shift it to the first one >= lo
    first = x0 + (lo - x0 + lcm - 1) // lcm * lcm
    if first > hi:
        return None
    count = (hi - first) // lcm + 1
    return first, count, (lcm if count > 1 else 1)


@dataclass(frozen=True, slots=True)
class Piece:
    """One slice-copy that ``load_weights`` performed: a checkpoint region into a parameter.

    The element at region index ``i`` (one index per region dim) lands at logical flat index
    ``offset + sum(i[d] * strides[d])`` of the parameter. Strides may be any integers: a
    transposed copy has its strides swapped, a reversed copy a negative stride.

    Example: the k rows of a fused qkv weight on TP rank 1 of 2, from a (512, 2048) k_proj:
    ``Piece(Region("...k_proj.weight", (256, 0), (256, 2048), (1, 1)),
    "...qkv_proj.weight", offset=2048 * 2048, strides=(2048, 1))``
    """

    region: Region
    """Which checkpoint elements."""
    param: str
    """Runtime parameter FQN on this worker."""
    offset: int
    """Logical flat index in the parameter of the region's first element."""
    strides: tuple[int, ...]
    """Parameter flat-index step per region dim."""

    @property
    def transposed(self) -> bool:
        """True when the copy does not preserve the checkpoint's row-major element order."""
        dims = [d for d, c in enumerate(self.region.count) if c > 1]
        return any(abs(self.strides[a]) < abs(self.strides[b]) for a, b in zip(dims, dims[1:]))


@dataclass(frozen=True, slots=True)
class SourceMap:
    """Which checkpoint element each parameter element of one worker comes from.

    The output of `extract_source_map`; its meaning is `weightbridge.replay`: replaying the pieces
    fills the parameters exactly as the worker's own ``load_weights`` does.
    """

    params: tuple[ParamSpec, ...]
    """The worker's parameters (logical shapes and dtypes)."""
    pieces: tuple[Piece, ...]
    """Every slice-copy, sorted by (param, offset)."""
    unsourced: tuple[tuple[str, int], ...] = ()
    """(param, number of elements no checkpoint element lands in), for params with any."""
    unused: tuple[str, ...] = ()
    """Checkpoint tensors the loader never copied from (not an error)."""

    @property
    def num_elements(self) -> int:
        """Number of parameter elements with a source."""
        return sum(p.region.numel for p in self.pieces)

    def tensors(self) -> tuple[str, ...]:
        """Checkpoint tensors this worker reads, in first-use order."""
        return tuple(dict.fromkeys(p.region.tensor for p in self.pieces))

    def summary(self) -> str:
        """A few readable lines: params, pieces, transposed pieces, unsourced, unused."""
        num_transposed = sum(p.transposed for p in self.pieces)
        num_unsourced = sum(n for _, n in self.unsourced)
        return (f"SourceMap: {len(self.params)} params, {len(self.pieces)} pieces "
                f"({num_transposed} transposed), {self.num_elements:,} sourced elements, "
                f"{num_unsourced:,} unsourced, {len(self.tensors())} checkpoint tensors read, "
                f"{len(self.unused)} unused")


def pieces_by_param(pieces: Iterable[Piece]) -> dict[str, list[Piece]]:
    """Group pieces by parameter name, keeping order."""
    out: dict[str, list[Piece]] = {}
    for p in pieces:
        out.setdefault(p.param, []).append(p)
    return out


# --------------------------------------------------------------------------------------------
# Data plane descriptors
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BoxCopy:
    """Copy one strided box of elements between a tensor and a contiguous byte buffer.

    The box's elements are laid out in the buffer row-major over ``shape``, starting at byte
    ``buffer_offset``. In the tensor, box index ``i`` is the element at storage offset
    ``offset + sum(i[d] * strides[d])`` (strides in elements; any sign). Packing reads the tensor
    and writes the buffer; assembling does the reverse. Copying bytes between two buffers is a
    1-d box over a ``uint8`` view.

    Example: rows 512..767 of a contiguous (1024, 2048) parameter, written to the buffer
    transposed (column by column) at byte 4096:
    ``BoxCopy(tensor=3, offset=512 * 2048, shape=(2048, 256), strides=(1, 2048),
    buffer_offset=4096)``
    """

    tensor: int
    """Index into the list of tensors the table is built over."""
    offset: int
    """Storage offset, in elements, of the box's first element."""
    shape: tuple[int, ...]
    """Box shape (row-major order of the bytes in the buffer)."""
    strides: tuple[int, ...]
    """Storage stride, in elements, of each box dim."""
    buffer_offset: int
    """Byte offset of the box in the buffer."""


# --------------------------------------------------------------------------------------------
# Placement and plans
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a worker runs: its node, and for a rollout worker the engine (replica) it serves.

    Example: ``Placement("node3", engine=1)``; a trainer: ``Placement("node0")``.
    """

    node: str
    """Host name; workers with the same node share fast intra-node links."""
    engine: int | None = None
    """Rollout engine (inference replica) index; None for trainers."""


@dataclass(frozen=True, slots=True)
class WorkerId:
    """One worker of a transfer: its side and its position in the list given to `plan_transfer`.

    Example: ``WorkerId("rollout", 5)`` is the sixth rollout worker.
    """

    side: str
    """``"trainer"`` or ``"rollout"``."""
    index: int
    """Position in the trainer or rollout sequence given to `plan_transfer`."""

    def __str__(self) -> str:
        return f"{self.side[0].upper()}{self.index}"


@dataclass(frozen=True, slots=True)
class Overlap:
    """A box of checkpoint elements that the same trainers hold and the same rollouts need.

    The output of `correspond` is a partition of every needed element into overlaps: no element
    is in two of them, so sending each overlap once sends every needed element exactly once.

    Example: a (4096, 2048) q_proj shard held by two data-parallel trainers and needed by rank 1
    of two rollout engines: ``Overlap(Region("...q_proj.weight", (1024, 0), (1024, 2048),
    (1, 1)), "bfloat16", holders=(1, 5), needers=(1, 9))``
    """

    region: Region
    """The elements (a sub-box of every source-map region that contains any of them)."""
    dtype: str
    """Element dtype name, the same on both sides."""
    holders: tuple[int, ...]
    """Trainer indices holding every element, sorted (never empty)."""
    needers: tuple[int, ...]
    """Rollout indices needing every element, sorted (never empty)."""

    @property
    def nbytes(self) -> int:
        return self.region.numel * dtype_itemsize(self.dtype)


@dataclass(frozen=True, slots=True)
class Correspondence:
    """Which trainers hold each element some rollout needs: the input of the planner.

    Example: ``Correspondence(overlaps=(Overlap(...), ...), num_trainers=8, num_rollouts=16)``
    """

    overlaps: tuple[Overlap, ...]
    """A partition of the needed elements, in checkpoint order (first use, then row-major)."""
    num_trainers: int
    """Number of trainer source maps."""
    num_rollouts: int
    """Number of rollout source maps."""

    @property
    def nbytes(self) -> int:
        """Bytes of the unique needed elements (the M of Eq. 1)."""
        return sum(o.nbytes for o in self.overlaps)


class Stage(enum.Enum):
    """The three stages of a round, in the order a round runs them."""

    RECEIVE = "receive"
    """Trainer to rollout over inter-node links: each needed element leaves the trainers once."""
    EXTERNAL = "external"
    """Rollout to rollout across nodes: every node that needs an element gets it once."""
    INTERNAL = "internal"
    """Rollout to rollout inside a node (NVLink): the other workers of the node that need it."""


@dataclass(frozen=True, slots=True)
class Chunk:
    """A run of an overlap's elements in row-major order: the unit that buffers carry.

    Example: rows 256..511 of a (1024, 2048) overlap: ``Chunk(overlap=17, start=256 * 2048,
    count=256 * 2048)``
    """

    overlap: int
    """Index into `Correspondence.overlaps`."""
    start: int
    """First element (row-major index in the overlap's region)."""
    count: int
    """Number of elements."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Transfer:
    """One buffer-to-buffer write of a round: contiguous bytes from one worker to another.

    A trainer sends from its send buffer (filled by packing its parameters); a rollout worker
    forwards from its receive buffer (bytes it received earlier in the same round). The bytes are
    `chunks` concatenated, each in canonical checkpoint order.

    Example: ``Transfer(stage=Stage.RECEIVE, src=WorkerId("trainer", 0),
    dst=WorkerId("rollout", 3), src_offset=0, dst_offset=1 << 20, nbytes=4 << 20,
    chunks=(Chunk(17, 0, 2 << 20),))``
    """

    stage: Stage
    """Which stage of the round."""
    src: WorkerId
    """Sending worker."""
    dst: WorkerId
    """Receiving worker (always a rollout worker)."""
    src_offset: int
    """Byte offset in the sender's buffer (send buffer of a trainer, receive buffer of a rollout)."""
    dst_offset: int
    """Byte offset in the receiver's receive buffer."""
    nbytes: int
    """Bytes written."""
    chunks: tuple[Chunk, ...]
    """What the bytes are, in buffer order."""


@dataclass(frozen=True, slots=True)
class Round:
    """All writes of one round. Rounds run in order, pipelined over two buffers per worker.

    Example: ``Round(index=0, transfers=(Transfer(...), ...))``
    """

    index: int
    """Position of the round."""
    transfers: tuple[Transfer, ...]
    """Writes, sorted by (stage, src, dst)."""

    def stage(self, stage: Stage) -> tuple[Transfer, ...]:
        """The writes of one stage."""
        return tuple(t for t in self.transfers if t.stage is stage)


Range = tuple[int, int, int]
"""(round buffer index, byte offset, nbytes) in a receiver's round buffers: the key of
one registered RDMA buffer."""


@dataclass(frozen=True, slots=True, kw_only=True)
class BufferWrite:
    """A write a worker issues in a round: a range of its own buffer into a peer's receive buffer.

    Example: ``BufferWrite(stage=Stage.EXTERNAL, peer=WorkerId("rollout", 12), offset=0,
    peer_offset=8 << 20, nbytes=16 << 20)``
    """

    stage: Stage
    """Stage the write belongs to; a stage's writes wait for the previous stage's to land."""
    peer: WorkerId
    """Receiving worker."""
    offset: int
    """Byte offset in this worker's buffer (send buffer of a trainer, receive buffer of a rollout)."""
    peer_offset: int
    """Byte offset in the peer's receive buffer."""
    nbytes: int
    """Bytes written."""


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerRound:
    """One worker's share of one round.

    Trainers: pack `pack` (params -> send buffer), then issue `writes`. Rollouts: wait for the
    bytes of each stage, issue the stage's `writes` (forwarding straight out of the receive
    buffer), and after the last stage assemble `assemble` (receive buffer -> params).

    Example: ``WorkerRound(index=0, pack=(BoxCopy(...),), writes=(BufferWrite(...),),
    assemble=(), send_bytes=1 << 30, recv_bytes=0)``
    """

    index: int
    """Round index."""
    pack: tuple[BoxCopy, ...]
    """Copies from parameters into the send buffer (trainers only)."""
    writes: tuple[BufferWrite, ...]
    """Writes this worker issues, sorted by (stage, peer)."""
    assemble: tuple[BoxCopy, ...]
    """Copies from the receive buffer into parameters (rollouts only)."""
    send_bytes: int
    """Bytes of the send buffer used (trainers)."""
    recv_bytes: int
    """Bytes of the receive buffer used (rollouts)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerPlan:
    """What one worker does in every round: built once per plan, reused for every version.

    `BoxCopy.tensor` indexes `params` (this worker's parameters in `SourceMap.params` order);
    `BoxCopy.offset` counts logical elements of a contiguous parameter. The buffer a copy reads
    or writes is the round's send buffer (pack) or receive buffer (assemble). Register two buffers
    of `buffer_bytes` each and use them for alternate rounds.

    Example: ``WorkerPlan(worker=WorkerId("trainer", 0), placement=Placement("node0"),
    params=(ParamSpec(...), ...), buffer_bytes=1 << 30, rounds=(WorkerRound(...), ...))``
    """

    worker: WorkerId
    """Whose plan this is."""
    placement: Placement
    """Where the worker runs."""
    params: tuple[ParamSpec, ...]
    """The worker's parameters; `BoxCopy.tensor` indexes this tuple."""
    buffer_bytes: int
    """Size of each of the worker's round buffers: the largest round it takes part in."""
    rounds: tuple[WorkerRound, ...]
    """One entry per round of the plan (empty ones included, so indices line up)."""


_ITEMSIZE = {"float64": 8, "int64": 8, "uint64": 8, "complex64": 8, "float32": 4, "int32": 4,
             "uint32": 4, "float16": 2, "bfloat16": 2, "int16": 2, "uint16": 2, "int8": 1,
             "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1,
             "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1, "complex128": 16}


def dtype_itemsize(dtype: str) -> int:
    """Bytes per element of a dtype name, e.g. 2 for ``"bfloat16"``."""
    try:
        return _ITEMSIZE[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; expected a torch dtype name such as "
                         f"'bfloat16'") from None
