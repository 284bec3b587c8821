"""Placement, correspondence and plans: what moves where, in which round."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from operator import attrgetter

from weightbridge.types.build import instances
from weightbridge.types.maps import BoxCopy, Region
from weightbridge.types.specs import ParamSpec, dtype_itemsize


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
    """Dtype of the elements on the wire (in every round buffer): the narrower of the two
    sides' parameter dtypes, so the bytes, rounds and Eq. (1) ideal are counted in it."""
    holders: tuple[int, ...]
    """Trainer indices holding every element, sorted (never empty)."""
    needers: tuple[int, ...]
    """Rollout indices needing every element, sorted (never empty)."""
    source_dtype: str | None = None
    """The trainers' parameter dtype when it differs from `dtype`: their pack converts (e.g.
    float32 trainer weights sent as the bfloat16 the rollouts load)."""
    target_dtype: str | None = None
    """The rollouts' parameter dtype when it differs from `dtype`: their assemble converts (a
    widening cast, e.g. bfloat16 sent, float32 loaded)."""
    block: tuple[int, ...] = ()
    """Block shape when the rollouts hold the elements block-quantized (`Piece.block`): the
    trainers' pack quantizes whole blocks, so the planner cuts the overlap at whole block rows
    (an overlap of a `scale_tensor` carries the scales, float32). Empty otherwise."""

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
    """Byte offset in the sender's buffer (send buffer of a trainer, receive buffer of a
    rollout)."""
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
    """Byte offset in this worker's buffer (send buffer of a trainer, receive buffer of a
    rollout)."""
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

    def __reduce__(self):
        # Pickled as plain tuples: connect hands every worker its plan, pickled on the
        # controller one after another, and Monarch's pickler (cloudpickle) took 21 s over the
        # 1.5M copies and writes of the paper's largest deployment with the default (one dict
        # of slots per object), 5-6 s this way (benchmarks/connect_projection.py).
        return (_worker_plan, (self.worker, self.placement, self.params, self.buffer_bytes,
                               tuple(map(_round_fields, self.rounds))))


_box_fields = attrgetter(*(f.name for f in dataclasses.fields(BoxCopy)))
_write_fields = attrgetter(*(f.name for f in dataclasses.fields(BufferWrite)))


def _round_fields(r: WorkerRound) -> tuple:
    return (r.index, tuple(map(_box_fields, r.pack)), tuple(map(_write_fields, r.writes)),
            tuple(map(_box_fields, r.assemble)), r.send_bytes, r.recv_bytes)


def _made(cls, rows: tuple) -> tuple:
    """``cls`` instances of the pickled ``rows`` (each one's fields in declaration order)."""
    return tuple(instances(cls, len(rows), tuple(zip(*rows)))) if rows else ()


def _worker_plan(worker, placement, params, buffer_bytes, rounds) -> WorkerPlan:
    """A `WorkerPlan` from its pickled form (`WorkerPlan.__reduce__`)."""
    return WorkerPlan(worker=worker, placement=placement, params=params,
                      buffer_bytes=buffer_bytes, rounds=tuple(
                          WorkerRound(index=i, pack=_made(BoxCopy, pack),
                                      writes=_made(BufferWrite, writes),
                                      assemble=_made(BoxCopy, assemble),
                                      send_bytes=sent, recv_bytes=received)
                          for i, pack, writes, assemble, sent, received in rounds))
