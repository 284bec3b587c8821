"""Pure planning of the torch.distributed baselines: who owns each full tensor, what the trainers
send each other to build the full tensors, and the fixed-size buckets of full tensors sent to
the rollouts. No torch.distributed, no Monarch: frozen values, computed once at connect.

How the libraries users run do it (Miles, verl, OpenRLHF; checkpoint-engine), reproduced here:

- **collect**: the trainers turn their shards into full checkpoint tensors on one owner rank
  per tensor (Megatron's TP all-gather and HF export). Which elements a trainer holds comes
  from its source map (the probe of its own ``load_weights``): what an export routine encodes
  by hand. A tensor the owner holds whole needs nothing; otherwise every other trainer sends
  the owner the pieces it holds that the owner does not (each distinct region once).
- **buckets**: full tensors in checkpoint order, packed into flat messages of at most
  ``bucket_bytes`` (a larger tensor travels alone), with per-tensor metadata (name, byte
  offset, bytes). Broadcast: one owner (trainer 0) and one bucket sequence for every rollout.
  P2P: owners balanced over the trainers that hold each tensor whole, and per (owner,
  rollout) the tensors that rollout's ``load_weights`` reads.

Typical usage::

    plan = plan_dist(trainer_maps, rollout_needs, spec, bucket_bytes=512 << 10,
                     broadcast=True)
    plan.for_trainer(0).sends, plan.buckets_to(1)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from weightbridge.driver import CheckpointSpec, Piece, SourceMap, dtype_itemsize

@dataclass(frozen=True, slots=True)
class PieceMessage:
    """One trainer's pieces for one owner, sent as one flat message in this order."""

    src: int
    dst: int
    pieces: tuple[Piece, ...]
    nbytes: int


@dataclass(frozen=True, slots=True)
class Bucket:
    """Full checkpoint tensors in one flat message from trainer ``src`` to rollouts ``dsts``."""

    index: int
    """Position in the plan's bucket list (also the message tag)."""
    src: int
    dsts: tuple[int, ...]
    tensors: tuple[tuple[str, int, int], ...]
    """(checkpoint name, byte offset in the bucket, bytes) of each tensor."""
    nbytes: int


@dataclass(frozen=True, slots=True)
class DistPlan:
    """Everything every rank of a torch.distributed baseline needs, planned once."""

    spec: CheckpointSpec
    num_trainers: int
    num_rollouts: int
    owner: tuple[tuple[str, int], ...]
    """(tensor, trainer) for every tensor some rollout reads, checkpoint order."""
    messages: tuple[PieceMessage, ...]
    local: tuple[tuple[Piece, ...], ...]
    """Per trainer: its own pieces of the tensors it owns (each distinct region once)."""
    buckets: tuple[Bucket, ...]
    broadcast: bool
    """True: every bucket goes to every rollout (``dsts`` = all) from trainer 0."""
    ring: bool = False
    """With ``broadcast``: relayed along a chain (trainer 0, rollout 0, 1, ...), each rollout
    forwarding bucket k while it receives k + 1: NCCL's ring broadcast, built from
    send/recv; False: one ``dist.broadcast`` per bucket (gloo's binomial tree)."""

    def owned(self, trainer: int) -> tuple[str, ...]:
        return tuple(t for t, o in self.owner if o == trainer)

    def buckets_from(self, trainer: int) -> tuple[Bucket, ...]:
        return tuple(b for b in self.buckets if b.src == trainer)

    def buckets_to(self, rollout: int) -> tuple[Bucket, ...]:
        return tuple(b for b in self.buckets if rollout in b.dsts)

    def collect_bytes(self) -> int:
        return sum(m.nbytes for m in self.messages)

    def delivered_bytes(self) -> int:
        """Bytes handed to the network: trainer-to-trainer pieces plus every bucket per
        receiving rollout."""
        return self.collect_bytes() + sum(b.nbytes * len(b.dsts) for b in self.buckets)


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to 8: every tensor and piece starts 8-byte aligned in a message,
    so its bytes view as any dtype."""
    return -(-nbytes // 8) * 8


def aligned_total(sizes) -> int:
    """Bytes of a message holding parts of these sizes, each aligned."""
    total = 0
    for n in sizes:
        total = aligned(total + n)
    return total


def plan_dist(trainer_maps: list[SourceMap], rollout_needs: list[tuple[str, ...]],
              spec: CheckpointSpec, *, bucket_bytes: int, broadcast: bool,
              ring: bool = False) -> DistPlan:
    """Owners, collect messages and buckets (module doc).

    Args:
        trainer_maps: Every trainer's source map, trainer order.
        rollout_needs: The checkpoint tensors each rollout's ``load_weights`` reads.
        spec: The checkpoint both sides load.

    Keyword Args:
        bucket_bytes: Most bytes of one bucket (a larger tensor gets a bucket of its own).
        broadcast: One owner (trainer 0) and one bucket sequence for all rollouts; else P2P.
        ring: With ``broadcast``, relay the buckets along a chain (`DistPlan.ring`).

    Raises:
        ValueError: ``bucket_bytes`` < 1, a parameter whose dtype differs from its checkpoint
            tensor's, or elements some rollout reads that no trainer holds; before any byte
            moves.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    if ring and not broadcast:
        raise ValueError("ring=True relays a broadcast: give broadcast=True too")
    if not trainer_maps or not rollout_needs:
        raise ValueError("the gloo baselines need at least one trainer and one rollout")
    for i, smap in enumerate(trainer_maps):
        dtypes = {p.name: p.dtype for p in smap.params}
        for piece in smap.pieces:
            want = spec[piece.region.tensor].dtype
            if dtypes[piece.param] != want:
                raise ValueError(
                    f"trainer {i}: parameter {piece.param} is {dtypes[piece.param]} but its "
                    f"checkpoint tensor {piece.region.tensor} is {want}; the gloo baselines "
                    f"send checkpoint bytes and do not convert: use a trainer layout in the "
                    f"checkpoint dtype")
    needed = set().union(*rollout_needs)
    names = [t.name for t in spec.tensors if t.name in needed]
    regions = [_distinct_regions(m) for m in trainer_maps]
    full = [{n for n in names if _covers(spec, n, regs.get(n, []))} for regs in regions]
    for n in names:
        union = [p for regs in regions for p in regs.get(n, [])]
        if not _covers(spec, n, union):
            raise ValueError(f"the rollouts read {n}, but the trainers together do not hold "
                             f"all of it: do both sides load the same checkpoint?")
    owner = {n: 0 for n in names} if broadcast else _balance(spec, names, regions, full)
    messages: dict[tuple[int, int], list[Piece]] = {}
    local: list[list[Piece]] = [[] for _ in trainer_maps]
    for n in names:
        o = owner[n]
        local[o] += regions[o].get(n, [])
        if n in full[o]:
            continue
        seen = {p.region for p in regions[o].get(n, [])}
        for i, regs in enumerate(regions):
            for p in regs.get(n, []) if i != o else []:
                if p.region not in seen:
                    seen.add(p.region)
                    messages.setdefault((i, o), []).append(p)
    msgs = tuple(PieceMessage(s, d, tuple(ps), aligned_total(_nbytes(spec, p) for p in ps))
                 for (s, d), ps in sorted(messages.items()))
    buckets = _buckets(spec, names, owner, rollout_needs, bucket_bytes, broadcast)
    return DistPlan(spec=spec, num_trainers=len(trainer_maps), num_rollouts=len(rollout_needs),
                    owner=tuple((n, owner[n]) for n in names), messages=msgs,
                    local=tuple(tuple(ps) for ps in local), buckets=buckets, broadcast=broadcast,
                    ring=ring)


def _nbytes(spec: CheckpointSpec, piece: Piece) -> int:
    return piece.region.numel * dtype_itemsize(spec[piece.region.tensor].dtype)


def _distinct_regions(smap: SourceMap) -> dict[str, list[Piece]]:
    """Per checkpoint tensor, one piece per distinct region this worker holds."""
    out: dict[str, dict] = {}
    for p in smap.pieces:
        out.setdefault(p.region.tensor, {}).setdefault(p.region, p)
    return {n: list(by_region.values()) for n, by_region in out.items()}


def _covers(spec: CheckpointSpec, name: str, pieces: list[Piece]) -> bool:
    shape = spec[name].shape
    mask = np.zeros(shape, dtype=bool)
    for p in pieces:
        r = p.region
        mask[tuple(slice(s, s + k * (c - 1) + 1, k)
                   for s, c, k in zip(r.start, r.count, r.step))] = True
    return bool(mask.all())


def _balance(spec, names, regions, full) -> dict[str, int]:
    """Largest tensors first, each to the least-loaded trainer that holds it whole (else to
    the least-loaded one holding any of it)."""
    load = [0] * len(regions)
    owner = {}
    for n in sorted(names, key=lambda n: -spec[n].numel):
        cands = [i for i, f in enumerate(full) if n in f] or \
                [i for i, regs in enumerate(regions) if n in regs]
        o = min(cands, key=lambda i: (load[i], i))
        owner[n] = o
        load[o] += spec[n].numel
    return owner


def _buckets(spec, names, owner, rollout_needs, bucket_bytes, broadcast) -> tuple[Bucket, ...]:
    everyone = tuple(range(len(rollout_needs)))
    groups = ([(0, everyone, names)] if broadcast else
              [(o, (r,), [n for n in names if owner[n] == o and n in set(need)])
               for r, need in enumerate(rollout_needs) for o in sorted(set(owner.values()))])
    out: list[Bucket] = []
    for src, dsts, tensors in groups:
        cur, size = [], 0
        for n in tensors:
            t = spec[n]
            nbytes = math.prod(t.shape) * dtype_itemsize(t.dtype)
            if cur and size + nbytes > bucket_bytes:
                out.append(Bucket(len(out), src, dsts, tuple(cur), size))
                cur, size = [], 0
            cur.append((n, size, nbytes))
            size = aligned(size + nbytes)
        if cur:
            out.append(Bucket(len(out), src, dsts, tuple(cur), size))
    return tuple(out)
