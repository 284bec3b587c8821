"""Hand-built source maps for planner tests: no probe, just Regions and Pieces.

Each builder returns a `SourceMap` whose meaning (`SourceMap.load`) is what a real loader of that
layout does. `CHECKPOINT` is a small mixed-dtype checkpoint with 2-d, 1-d and expert tensors.
`check_invariants` checks a plan's guarantees; `one_tensor_plan` is the simulator tests' plan.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from weightbridge import Placement, SourceMap, plan_transfer, replay
from weightbridge.types import ParamSpec, Piece, Region, Stage

SHAPES = {
    "attn.w": ((12, 8), "bfloat16"),
    "mlp.w": ((8, 10), "float32"),
    "norm.b": ((10,), "bfloat16"),
    "scale": ((), "float32"),
    **{f"expert.{e}": ((6, 8), "bfloat16") for e in range(4)},
}


def checkpoint(seed: int = 0) -> dict[str, torch.Tensor]:
    """Random values; float32 tensors get random bit patterns so any byte slip shows."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (shape, dtype) in SHAPES.items():
        bits = torch.randint(-2**15, 2**15, shape, generator=g, dtype=torch.int32)
        out[name] = (bits.to(torch.int16).view(torch.bfloat16) if dtype == "bfloat16"
                     else torch.randn(shape, generator=g))
    return out


def region(tensor: str, start=None, count=None, step=None) -> Region:
    shape = SHAPES[tensor][0]
    start = start if start is not None else (0,) * len(shape)
    count = count if count is not None else shape
    return Region(tensor, tuple(start), tuple(count), tuple(step or (1,) * len(shape)))


def params_of(smap: SourceMap, fill: float = 0.0) -> dict[str, torch.Tensor]:
    return {p.name: torch.full(p.shape, fill).to(getattr(torch, p.dtype)) for p in smap.params}


def loaded(smap: SourceMap, ckpt, fill: float = 0.0) -> dict[str, torch.Tensor]:
    params = params_of(smap, fill)
    replay(smap, params, ckpt)
    return params


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


class Builder:
    """One worker's params and pieces."""

    def __init__(self):
        self.params: list[ParamSpec] = []
        self.pieces: list[Piece] = []

    def param(self, name: str, shape: tuple[int, ...], dtype: str) -> str:
        self.params.append(ParamSpec(name, tuple(shape), dtype))
        return name

    def piece(self, reg: Region, param: str, offset: int, strides: tuple[int, ...]) -> None:
        self.pieces.append(Piece(reg, param, offset, tuple(strides)))

    def build(self) -> SourceMap:
        return SourceMap(tuple(self.params),
                         tuple(sorted(self.pieces, key=lambda p: (p.param, p.offset))))


def tp_trainer(rank: int, tp: int, *, experts=range(4)) -> SourceMap:
    """Megatron-like: attn rows split, mlp columns split, vectors replicated, whole experts."""
    b = Builder()
    rows = 12 // tp
    b.piece(region("attn.w", (rank * rows, 0), (rows, 8)),
            b.param("attn", (rows, 8), "bfloat16"), 0, (8, 1))
    cols = 10 // tp if 10 % tp == 0 else None
    if cols:
        b.piece(region("mlp.w", (0, rank * cols), (8, cols)),
                b.param("mlp", (8, cols), "float32"), 0, (cols, 1))
    else:
        b.piece(region("mlp.w"), b.param("mlp", (8, 10), "float32"), 0, (10, 1))
    b.piece(region("norm.b"), b.param("norm", (10,), "bfloat16"), 0, (1,))
    b.piece(region("scale"), b.param("scale", (), "float32"), 0, ())
    for k, e in enumerate(experts):
        b.piece(region(f"expert.{e}"), b.param(f"expert{k}", (6, 8), "bfloat16"), 0, (8, 1))
    return b.build()


def fsdp_trainer(rank: int, world: int) -> SourceMap:
    """FSDP-flat: all bf16 tensors concatenated into one flat buffer, cut into equal shards.

    A shard's pieces cross tensor boundaries and start and stop mid-row.
    """
    names = [n for n, (_, d) in SHAPES.items() if d == "bfloat16"]
    sizes = [math.prod(SHAPES[n][0]) for n in names]
    total = sum(sizes)
    shard = -(-total // world)
    lo, hi = rank * shard, min(total, (rank + 1) * shard)
    b = Builder()
    flat = b.param("flat_param", (shard,), "bfloat16")
    pos = 0
    for name, size in zip(names, sizes):
        a, z = max(lo, pos), min(hi, pos + size)
        if a < z:
            for start, count in _flat_boxes(SHAPES[name][0], a - pos, z - pos):
                offset = a - lo + _flat_index(SHAPES[name][0], start) - (a - pos)
                strides = _row_major(SHAPES[name][0])
                b.piece(region(name, start, count), flat, offset, strides)
        pos += size
    # The float32 tensors live outside the flat buffer, replicated on every rank.
    b.piece(region("mlp.w"), b.param("mlp", (8, 10), "float32"), 0, (10, 1))
    b.piece(region("scale"), b.param("scale", (), "float32"), 0, ())
    return b.build()


def fused_rollout(rank: int, tp: int, *, ep: int = 1) -> SourceMap:
    """vLLM-like: attn rows split and fused with a transposed norm-free block, mlp transposed,
    experts stacked (EP), norm reversed into a padded param."""
    b = Builder()
    rows = 12 // tp
    # fused: [attn rows shard ; 2 rows of padding], then attn stored transposed elsewhere
    fused = b.param("fused", (rows + 2, 8), "bfloat16")
    b.piece(region("attn.w", (rank * rows, 0), (rows, 8)), fused, 0, (8, 1))
    b.piece(region("mlp.w"), b.param("mlp_t", (10, 8), "float32"), 0, (1, 8))
    b.piece(region("norm.b"), b.param("norm_padded", (12,), "bfloat16"), 10, (-1,))
    b.piece(region("scale"), b.param("scale", (1,), "float32"), 0, ())
    per = 4 // ep
    mine = range((rank % ep) * per, (rank % ep + 1) * per)
    stacked = b.param("experts", (per, 6, 8), "bfloat16")
    for k, e in enumerate(mine):
        b.piece(region(f"expert.{e}"), stacked, k * 48, (8, 1))
    return b.build()


def _row_major(shape) -> tuple[int, ...]:
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= s
    return tuple(reversed(out))


def _flat_index(shape, start) -> int:
    return sum(i * s for i, s in zip(start, _row_major(shape)))


def _flat_boxes(shape, lo, hi):
    from weightbridge.planning.box_copies import flat_boxes as boxes

    return boxes(tuple(shape), lo, hi)


def _tiles(intervals, numel) -> bool:
    """Do (start, count) intervals cover [0, numel) exactly once?"""
    pos = 0
    for start, count in sorted(intervals):
        if start != pos:
            return False
        pos += count
    return pos == numel


def check_invariants(plan, round_bytes):
    """The plan's invariants: trainers send each needed element once, each needing node gets
    it once over RDMA and each needer once, rounds fit ``round_bytes``, bytes add up."""
    corr = plan.correspondence
    overlaps = corr.overlaps
    rounds = plan.rounds
    node_of = [p.node for p in plan.rollouts]
    sent_by_trainers = defaultdict(list)
    into_node = defaultdict(list)           # (node, overlap) -> intervals over RDMA
    into_worker = defaultdict(list)         # (rollout, overlap) -> intervals, all stages
    for rnd in rounds:
        recv = defaultdict(int)
        send = defaultdict(int)
        for t in rnd.transfers:
            assert t.dst.side == "rollout"
            recv[t.dst] += t.nbytes
            if t.src.side == "trainer":
                send[t.src] += t.nbytes
                assert t.stage is Stage.RECEIVE
            else:
                assert t.stage is not Stage.RECEIVE
                same_node = node_of[t.src.index] == node_of[t.dst.index]
                assert same_node == (t.stage is Stage.INTERNAL)
            for c in t.chunks:
                assert t.dst.index in overlaps[c.overlap].needers
                if t.stage is Stage.RECEIVE:
                    assert t.src.index in overlaps[c.overlap].holders
                    sent_by_trainers[c.overlap].append((c.start, c.count))
                if t.stage is not Stage.INTERNAL:
                    into_node[node_of[t.dst.index], c.overlap].append((c.start, c.count))
                into_worker[t.dst.index, c.overlap].append((c.start, c.count))
        # (3) every round fits round_bytes on both buffers
        assert max(recv.values(), default=0) <= round_bytes
        assert max(send.values(), default=0) <= round_bytes
    for i, o in enumerate(overlaps):
        # (1) trainers send every needed element exactly once
        assert _tiles(sent_by_trainers[i], o.region.numel), o
        # (2) each needing node gets it exactly once over RDMA; each needer exactly once
        for node in {node_of[w] for w in o.needers}:
            assert _tiles(into_node[node, i], o.region.numel), (node, o)
        for w in o.needers:
            assert _tiles(into_worker[w, i], o.region.numel), (w, o)
    # (2) nothing a node does not need crosses into it
    assert all(node in {node_of[w] for w in overlaps[i].needers} for node, i in into_node)
    # byte accounting agrees with the node's unique need
    sent, received = plan.stage_bytes()
    T = len(plan.trainers)
    assert sent[:T, 0].sum() == corr.nbytes
    for node in set(node_of):
        need = sum(o.nbytes for o in overlaps if any(node_of[w] == node for w in o.needers))
        rdma = sum(received[T + w, :2].sum() for w in range(len(node_of)) if node_of[w] == node)
        assert rdma == need
    for w in plan.workers:
        assert plan.for_worker(w).buffer_bytes <= round_bytes


def one_tensor_plan(num_trainers, num_rollout_nodes, workers_per_node=1, round_bytes=4096,
                    trainers_per_node=1):
    """One 64 KiB float32 tensor, whole on every trainer and every rollout worker, planned over
    ``num_trainers`` trainers and ``num_rollout_nodes`` nodes of ``workers_per_node`` engines."""
    reg = Region("w", (0, 0), (256, 64), (1, 1))  # 64 KiB of float32
    smap = SourceMap((ParamSpec("w", (256, 64), "float32"),), (Piece(reg, "w", 0, (64, 1)),))
    trainers = [(smap, Placement(f"t{i // trainers_per_node}")) for i in range(num_trainers)]
    rollouts = [(smap, Placement(f"r{n}", engine=n * workers_per_node + k))
                for n in range(num_rollout_nodes) for k in range(workers_per_node)]
    return plan_transfer(trainers, rollouts, round_bytes=round_bytes)
