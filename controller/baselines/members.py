"""The actors of the torch.distributed baselines: trainers and rollouts in one gloo group.

Each actor builds its rank's parts with the worker factory, as the controller's actors do, and
is in no WeightBridge transfer group: it probes its own ``load_weights`` once (for the tensors
it reads and, on a trainer, the pieces it holds), keeps its own spans, and moves bytes only
through ``torch.distributed`` (gloo over TCP). Ranks: trainer *i* is rank *i*, rollout *j* is
rank ``num_trainers + j``. What each sends is planned on the controller
(`controller.baselines.plans`); here it is executed:

- trainers: ``collect`` (pieces of split tensors to their owner, which assembles full tensors),
  then ``broadcast`` (trainer 0: every bucket, one ``dist.broadcast`` each, to trainer 0 and all
  rollouts; or, for a ring, ``dist.isend`` to rollout 0) or ``send`` (every owner:
  ``dist.isend`` of each bucket to each rollout needing it);
- rollouts: receive each bucket (``dist.broadcast`` / ``dist.irecv``; in a ring, then
  ``dist.isend`` it on to the next rollout) and run their own ``load_weights`` on its full
  tensors, bucket by bucket, as verl and checkpoint-engine do.
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from monarch.actor import endpoint

from controller.baselines.plans import Bucket, DistPlan, aligned, aligned_total
from meshes.actors import RolloutActor, TrainerActor
from weightbridge import extract_source_map
from weightbridge.driver import (CheckpointSpec, Piece, SourceMap, as_bits, memory_order,
                                 param_view, region_view)

SIOCGIFADDR = 0x8915


class Standalone:
    """Mixin for an actor in no transfer group: probes its own loader, keeps its own spans."""

    def __init__(self, *args):
        super().__init__(*args)
        self.spans: list[tuple[str, int, int, int]] = []
        self._names: tuple[str, ...] | None = None

    def _probe(self) -> SourceMap:
        # Probing overwrites the parameters: call it before any update.
        p = self.parts
        smap = extract_source_map(p.params, p.load_weights, p.spec)
        self._names = smap.tensors()
        return smap

    def _checkpoint(self, version: int):
        return self.parts.checkpoint(version, self._names)

    def _span(self, stage: str, rnd: int, start: int) -> None:
        self.spans.append((stage, rnd, start, time.monotonic_ns()))

    @endpoint
    def timings(self) -> list[tuple[str, int, int, int]]:
        """This update's spans; clears them."""
        out, self.spans = self.spans, []
        return out


def local_ip(toward: str) -> str:
    """This process's address on the route to ``toward`` (sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((toward, 9))
        return s.getsockname()[0]


def interface_of(ip: str) -> str:
    """The network interface holding ``ip`` in this process's namespace (gloo binds to it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                got = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:  # no IPv4 address on it
                continue
            if socket.inet_ntoa(got[20:24]) == ip:
                return name
    raise RuntimeError(f"no interface here holds {ip}")


class GlooMember(Standalone):
    """Mixin: membership of the baseline's gloo group and the probe at connect."""

    @endpoint
    def source_map(self) -> tuple[SourceMap, CheckpointSpec]:
        """(this rank's source map, the checkpoint its factory describes)."""
        return self._probe(), self.parts.spec

    @endpoint
    def rendezvous(self, toward: str) -> tuple[str, int]:
        """(address, free port) for the group's TCP store, on this proc's route to ``toward``."""
        ip = local_ip(toward)
        with socket.socket() as s:
            s.bind((ip, 0))
            return ip, s.getsockname()[1]

    @endpoint
    def join_group(self, addr: str, port: int, num_trainers: int, world: int,
                         timeout_s: float) -> None:
        """Join the group of every rank and the broadcast group of trainer 0 and the rollouts
        (blocks until every rank joined)."""
        self._join(addr, port, num_trainers, world, timeout_s)

    def _join(self, addr, port, num_trainers, world, timeout_s) -> None:
        os.environ["GLOO_SOCKET_IFNAME"] = interface_of(local_ip(addr))
        rank = self.index + (num_trainers if self.side == "rollout" else 0)
        dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=timeout_s))
        # Every rank creates every group (a collective); only members use it.
        self.bcast_group = dist.new_group([0, *range(num_trainers, world)])
        self.num_trainers = num_trainers

    @endpoint
    def setup_plan(self, plan: DistPlan) -> None:
        self.plan = plan
        self._setup()

    @endpoint
    def leave_group(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


class DistTrainer(GlooMember, TrainerActor):
    """A trainer rank: collects full tensors on their owners, sends buckets to rollouts."""

    def _setup(self) -> None:
        spec = self.plan.spec
        self.full = {n: torch.empty(spec[n].shape, dtype=_dtype(spec[n].dtype))
                     for n in self.plan.owned(self.index)}

    @endpoint
    def send_update(self) -> None:
        """One update: collect, then broadcast or send every bucket; returns once all left."""
        self._send()

    def _send(self) -> None:
        plan, me, start = self.plan, self.index, time.monotonic_ns()
        flats: dict[str, torch.Tensor] = {}
        outgoing = [(m, self._pack_pieces(m.pieces, flats)) for m in plan.messages if m.src == me]
        sends = [dist.isend(buf, m.dst, tag=0) for m, buf in outgoing]
        incoming = [(m, torch.empty(m.nbytes, dtype=torch.uint8))
                    for m in plan.messages if m.dst == me]
        recvs = [dist.irecv(buf, m.src, tag=0) for m, buf in incoming]
        for p in plan.local[me]:
            self._place(p, self._read(p, flats))
        for (m, buf), work in zip(incoming, recvs):
            work.wait()
            self._unpack_pieces(m.pieces, buf)
        for work in sends:
            work.wait()
        if outgoing or incoming or plan.local[me]:
            self._span("collect", 0, start)
        buckets = plan.buckets_from(me)
        if not buckets:
            return
        start = time.monotonic_ns()
        if plan.ring:  # to the chain's first rollout; it relays
            bufs = [self._pack_bucket(b) for b in buckets]
            for work in [dist.isend(buf, self.num_trainers, tag=b.index + 1)
                         for b, buf in zip(buckets, bufs)]:
                work.wait()
            self._span("broadcast", 0, start)
            return
        if plan.broadcast:
            for b in buckets:  # one collective per bucket, in order, as the libraries do
                dist.broadcast(self._pack_bucket(b), src=0, group=self.bcast_group)
            self._span("broadcast", 0, start)
            return
        packed: dict[tuple, torch.Tensor] = {}  # a bucket's bytes, packed once for all rollouts
        works = []
        for b in _interleaved(buckets, key=lambda b: b.dsts):
            buf = packed.get(b.tensors)
            if buf is None:
                buf = packed[b.tensors] = self._pack_bucket(b)
            works.append(dist.isend(buf, self.num_trainers + b.dsts[0], tag=b.index + 1))
        for work in works:
            work.wait()
        self._span("send", 0, start)

    def _read(self, piece: Piece, flats: dict[str, torch.Tensor]) -> torch.Tensor:
        """The piece's elements as raw integers, shaped like its region, checkpoint order."""
        flat = flats.get(piece.param)
        if flat is None:
            flat = flats[piece.param] = \
                memory_order(self.parts.params[piece.param].detach()).contiguous().view(-1)
        view, flipped = param_view(flat, piece)
        return as_bits(view).flip(flipped) if flipped else as_bits(view)

    def _place(self, piece: Piece, bits: torch.Tensor) -> None:
        as_bits(region_view(self.full[piece.region.tensor], piece.region)).copy_(bits)

    def _pack_pieces(self, pieces, flats) -> torch.Tensor:
        parts = [self._read(p, flats).contiguous().view(-1).view(torch.uint8) for p in pieces]
        buf = torch.zeros(aligned_total(p.numel() for p in parts), dtype=torch.uint8)
        pos = 0
        for part in parts:
            buf[pos:pos + part.numel()].copy_(part)
            pos = aligned(pos + part.numel())
        return buf

    def _unpack_pieces(self, pieces, buf: torch.Tensor) -> None:
        pos = 0
        for p in pieces:
            target = as_bits(region_view(self.full[p.region.tensor], p.region))
            n = target.numel() * target.element_size()
            target.copy_(buf[pos:pos + n].view(target.dtype).view(target.shape))
            pos = aligned(pos + n)

    def _pack_bucket(self, b: Bucket) -> torch.Tensor:
        buf = torch.empty(b.nbytes, dtype=torch.uint8)
        for name, offset, nbytes in b.tensors:
            buf[offset:offset + nbytes].copy_(self.full[name].view(-1).view(torch.uint8))
        return buf


def _interleaved(buckets, key):
    """Buckets in round-robin order over ``key`` (per destination or per source), keeping each
    one's own order: every peer's stream progresses at once, as with one sender per peer."""
    queues: dict = {}
    for b in buckets:
        queues.setdefault(key(b), []).append(b)
    out, streams = [], list(queues.values())
    for i in range(max(map(len, streams), default=0)):
        out += [s[i] for s in streams if i < len(s)]
    return out


class DistRollout(GlooMember, RolloutActor):
    """A rollout rank: receives buckets of full tensors, loads each with its own load_weights."""

    def _setup(self) -> None:
        self.buffers = {b.index: torch.empty(b.nbytes, dtype=torch.uint8)
                        for b in self.plan.buckets_to(self.index)}

    @endpoint
    def receive_update(self) -> None:
        """One update: receive every bucket aimed at this rank and load it."""
        self._receive()

    def _receive(self) -> None:
        buckets = self.plan.buckets_to(self.index)
        if self.plan.ring:
            # Chain: trainer 0 -> rollout 0 -> 1 -> ...; forward each bucket as it lands.
            t, j, n = self.num_trainers, self.index, self.plan.num_rollouts
            prev, nxt = (0 if j == 0 else t + j - 1), (t + j + 1 if j + 1 < n else None)
            sends = []
            for b in buckets:
                dist.irecv(self.buffers[b.index], prev, tag=b.index + 1).wait()
                if nxt is not None:
                    sends.append(dist.isend(self.buffers[b.index], nxt, tag=b.index + 1))
                self._load(b)  # reads the buffer only: it may be on its way out meanwhile
            for work in sends:
                work.wait()
            return
        if self.plan.broadcast:
            for b in buckets:
                dist.broadcast(self.buffers[b.index], src=0, group=self.bcast_group)
                self._load(b)
            return
        works = {b.index: dist.irecv(self.buffers[b.index], b.src, tag=b.index + 1)
                 for b in buckets}
        for b in _interleaved(buckets, key=lambda b: b.src):
            works[b.index].wait()
            self._load(b)

    def _load(self, b: Bucket) -> None:
        start, buf, spec = time.monotonic_ns(), self.buffers[b.index], self.plan.spec
        pairs = [(n, buf[o:o + k].view(_dtype(spec[n].dtype)).view(spec[n].shape))
                 for n, o, k in b.tensors]
        with torch.no_grad():
            self.parts.load_weights(pairs)
        self._span("load", b.index, start)
