"""The adapters on Monarch meshes: a control plane over actor endpoints, RDMA as the data plane.

Unlike `meshes.actors` (thin actors, the controller sequences every round), these actors stand
for a user's own trainer and rollout actors: each wraps a `SenderAdapter` or `ReceiverAdapter`,
and the adapters talk to each other directly (the rank-0 sender sequences every transfer).

    controller (the user's RL loop)          trainer actors               rollout actors
    -------------------------------          --------------               --------------
    setup(trainers, rollouts) ------------>  SenderAdapter + MeshControl  ReceiverAdapter + ...
    trainers.connect() ------------------->  rank 0: probe all, plan, hand out plans + handles
    per version: trainers.train_and_send(v)  step; send_weights(v)
    per engine, in a loop: rollouts.step() ---------------------------->  poll_requests(); forward

Every adapter-to-adapter call is the ``wb`` endpoint, a ``@concurrent_endpoint``: it must run
while the same actor is inside ``send_weights`` or ``poll_requests`` (a blocked trainer serves
its rounds, a blocked rollout receives its bytes). The user's endpoints are concurrent too, for
the same reason: an actor dequeues its next message only when a normal endpoint returns. The
adapters are thread based, so each endpoint runs its adapter call with ``asyncio.to_thread``.

Typical usage: ``examples/rl_loop.py``; ``tests/test_adapters_mesh.py``.
"""

from __future__ import annotations

import asyncio
import hashlib
import time

import torch
from monarch.actor import Actor, concurrent_endpoint

from meshes.forward import rank_forward
from meshes.qwen3_moe import SIZES, RolloutShard, TrainerShard, checkpoint_spec
from weightbridge.adapter_base import PeerFailed, gathered
from weightbridge.adapters import AdapterOptions, ReceiverAdapter, SenderAdapter
from weightbridge.monarch_transport import drop_all, register_ranges, wait_all, write


def checkpoint(model: str, version: int) -> dict[str, torch.Tensor]:
    """The full checkpoint of ``version`` (deterministic; a stand-in for an optimizer step)."""
    gen = torch.Generator().manual_seed(7919 * version + 1)
    return {t.name: torch.randn(t.shape, generator=gen).bfloat16()
            for t in checkpoint_spec(SIZES[model]).tensors}


def digest(params) -> str:
    h = hashlib.blake2b(digest_size=8)
    for n in sorted(params):
        h.update(params[n].detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class MeshTransport:
    """`monarch_transport` behind the adapters' transport calls."""

    def __init__(self, timeout_s: float):
        self.timeout_s = max(1, int(timeout_s))
        self.peers: dict = {}
        self.registered: dict = {}

    def register(self, arenas, ranges) -> dict:
        """Register this worker's incoming ranges; after a re-plan, deregister the old plan's
        (its arenas are no longer written: the failed transfer's writes ended or timed out)."""
        if self.registered:
            drop_all(self.registered)
        self.registered = register_ranges(arenas, ranges)
        return self.registered

    def set_peers(self, handles: dict) -> None:
        self.peers = handles

    def write(self, peer, key, src):
        return write(self.peers[(peer, key)], src, timeout_s=self.timeout_s)

    def wait(self, futures) -> None:
        wait_all(futures)


SETUP_CALLS = frozenset({"_wb_source_map", "_wb_setup"})
"""Adapter calls without a deadline: probing and building tables scale with the model."""


class _Proxy:
    """A peer adapter: ``proxy._wb_x(*args)`` is ``peer.wb.call_one("_wb_x", *args).get()``,
    bounded by the control plane's timeout (a dead peer fails at once with a
    SupervisionError; one that stopped answering, within the timeout)."""

    def __init__(self, actor, control: "MeshControl"):
        self._actor, self._control = actor, control

    def __getattr__(self, name: str):
        if not name.startswith("_wb_"):
            raise AttributeError(name)
        return lambda *args: self._actor.wb.call_one(name, *args).get(
            timeout=self._control.timeout_for(name))


class MeshControl:
    """Where the peers are: trainer and rollout actor meshes with one ``worker`` axis each.

    ``timeout_s``: the longest an adapter call on a peer may take during a transfer (None: no
    limit); pass `AdapterOptions.timeout_s`.
    """

    poll_interval_s = 0.01
    """Waits on remote state poll it over endpoint calls: at most 100 calls a second."""

    def __init__(self, trainers, rollouts, num_trainers: int, num_engines: int,
                 engine_size: int, *, timeout_s: float | None = None):
        self._t = [_Proxy(trainers.slice(worker=i), self) for i in range(num_trainers)]
        self._r = [_Proxy(rollouts.slice(worker=j), self)
                   for j in range(num_engines * engine_size)]
        self.num_engines, self.engine_size = num_engines, engine_size
        self.timeout_s = timeout_s

    def timeout_for(self, name: str) -> float | None:
        return None if name in SETUP_CALLS else self.timeout_s

    def trainers(self) -> list:
        return self._t

    def receivers(self) -> list:
        return self._r

    def sequencer(self):
        return self._t[0]

    def engine(self, engine: int) -> list:
        return self._r[engine * self.engine_size:(engine + 1) * self.engine_size]

    def gather(self, peers: list, name: str, *args, return_errors: bool = False) -> list:
        """Issue the call on every peer, then wait for all: the results, in order.

        Raises the first peer's error once all have answered; ``return_errors``: the errors
        are returned in place of results instead.
        """
        futures = [p._actor.wb.call_one(name, *args) for p in peers]
        out = []
        for f in futures:
            try:
                out.append(f.get(timeout=self.timeout_for(name)))
            except Exception as e:  # noqa: BLE001  (raised below, after every peer answered)
                out.append(PeerFailed(e))
        return gathered(out, return_errors)

    def call_all(self, peers: list, name: str, *args) -> None:
        """Issue the call on every peer, then wait for all (they run in parallel)."""
        self.gather(peers, name, *args)

    def engine_rank0s(self) -> list:
        return [self.engine(e)[0] for e in range(self.num_engines)]



def mesh_wiring(trainers, rollouts, topology: tuple[int, int, int],
                options: AdapterOptions) -> dict:
    """Keyword arguments that put a `SenderAdapter` / `ReceiverAdapter` on Monarch meshes: its
    control plane and transport, both bounded by ``options.peer_timeout_s``, and the options.
    ``topology`` is (trainers, engines, ranks per engine)."""
    return {"control": MeshControl(trainers, rollouts, *topology,
                                   timeout_s=options.peer_timeout_s),
            "transport": MeshTransport(options.peer_timeout_s), "options": options}


class _AdapterActor(Actor):
    adapter = None

    @concurrent_endpoint
    async def wb(self, name: str, *args):
        """A peer adapter's call (control plane); runs beside this actor's own calls."""
        if not name.startswith("_wb_"):
            raise ValueError(f"{name!r} is not an adapter call")
        return await asyncio.to_thread(getattr(self.adapter, name), *args)


class RLTrainer(_AdapterActor):
    """A trainer rank holding a TP shard of the tiny model (TP x 1 x 1)."""

    def __init__(self, model: str, tp: int):
        torch.set_num_threads(1)
        self.model, self.tp = model, tp

    @concurrent_endpoint
    async def setup(self, rank: int, trainers, rollouts, topology: tuple[int, int, int],
                    options: AdapterOptions) -> None:
        self.shard = TrainerShard(SIZES[self.model], self.tp, rank, 1, 0)
        self.adapter = SenderAdapter(
            self.shard.params, self.shard.load_weights, checkpoint_spec(SIZES[self.model]),
            rank=rank, **mesh_wiring(trainers, rollouts, topology, options))

    @concurrent_endpoint
    async def connect(self) -> None:
        await asyncio.to_thread(self.adapter.connect)

    @concurrent_endpoint
    async def train_and_send(self, version: int) -> tuple[float, float]:
        """Stand-in optimizer step to ``version``, then send_weights. Returns (start, stall)
        seconds: when send_weights began (CLOCK_MONOTONIC) and how long it blocked."""
        with torch.no_grad():
            self.shard.load_weights(checkpoint(self.model, version).items())
        start = time.monotonic()
        await asyncio.to_thread(self.adapter.send_weights, version)
        return start, time.monotonic() - start

    @concurrent_endpoint
    async def finish(self) -> None:
        """Rank 0: wait until every staged version was transferred (SS modes)."""
        if self.adapter.options.sender_staging:
            await asyncio.to_thread(self.adapter.wait_idle)


class RLRollout(_AdapterActor):
    """A rollout rank: TP shard of one engine; `step` polls, then runs a forward pass."""

    def __init__(self, model: str, tp: int):
        torch.set_num_threads(1)
        self.model, self.tp = model, tp

    @concurrent_endpoint
    async def setup(self, rank: int, trainers, rollouts, topology: tuple[int, int, int],
                    options: AdapterOptions) -> None:
        num_trainers, num_engines, engine_size = topology
        self.rank_in_engine = rank % engine_size
        self.shard = RolloutShard(SIZES[self.model], self.tp, self.rank_in_engine, 1, 0)
        self.adapter = ReceiverAdapter(
            self.shard.params, self.shard.load_weights, checkpoint_spec(SIZES[self.model]),
            rank=rank, engine=rank // engine_size, engine_rank=self.rank_in_engine,
            engine_size=engine_size, **mesh_wiring(trainers, rollouts, topology, options))

    def _step(self, seed: int) -> dict:
        start = time.monotonic()
        installed = self.adapter.poll_requests()
        stall = time.monotonic() - start
        exact = None
        if installed is not None:  # bit-exact against this rank's own loader of that version
            ref = RolloutShard(SIZES[self.model], self.tp, self.rank_in_engine, 1, 0)
            ref.load_weights(checkpoint(self.model, installed).items())
            exact = digest(ref.params) == digest(self.shard.params)
        tokens = torch.randint(0, SIZES[self.model].vocab, (1, 4),
                               generator=torch.Generator().manual_seed(seed))
        rank_forward(self.shard, tokens)  # the inference step, with the version installed
        return {"rank": self.adapter.worker.index, "step": self.adapter.step - 1, "version": self.adapter.version,
                "installed": installed, "stall_s": stall, "start": start, "exact": exact}

    @concurrent_endpoint
    async def step(self, seed: int) -> dict:
        """poll_requests(), then one inference step. Returns what it ran with."""
        return await asyncio.to_thread(self._step, seed)
