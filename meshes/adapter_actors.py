"""A user's own trainer and rollout actors on Monarch meshes, with the adapters inside.

Unlike `meshes.actors` (thin actors, the controller sequences every round), these actors stand
for a user's RL actors: plain SYNC actors (``def`` endpoints) that each build their rank's
`SenderAdapter` / `ReceiverAdapter` through a `weightbridge.TransferGroup`. The adapters talk
to each other through the group's agents (`weightbridge.mesh.control`), never through
these actors, so an actor blocked in ``send_weights`` or ``poll_requests`` still serves its
peers, and the actors need no endpoint of the library's.

    controller (the user's RL loop)              trainer actors              rollout actors
    -------------------------------              --------------              --------------
    group = TransferGroup.spawn(tprocs, rprocs, engine_size=.., config=..)
    trainers.setup.call(group); rollouts.setup.call(group)
                                        ------>  group.sender(...)           group.receiver(...)
    trainers.connect.call() ------------------>  rank 0: probe all, plan, hand out plans
    per version: trainers.train_and_send(v)      step; send_weights(v)
    per engine, in a loop: rollouts.step() -------------------------------->  poll_requests();
                                                                              forward pass
    trainers.finish.call(); group.close()        rank 0: wait_idle (SS)

Ranks are the actors' flat ranks in their meshes, whatever the axes are called: call
``setup`` on the whole mesh (a call on a slice numbers the ranks within the slice).

Typical usage: ``examples/rl_loop.py``; ``tests/test_adapters_mesh.py``.
"""

from __future__ import annotations

import hashlib
import time
from typing import Collection, Mapping

import torch
from monarch.actor import Actor, current_rank, endpoint

from meshes.device import bind_local_device
from meshes.forward import rank_forward
from meshes.qwen3_moe import SIZES, RolloutShard, TrainerShard, checkpoint_spec


def checkpoint(model: str, version: int) -> dict[str, torch.Tensor]:
    """The full checkpoint of ``version`` (deterministic; a stand-in for an optimizer step)."""
    gen = torch.Generator().manual_seed(7919 * version + 1)
    return {t.name: torch.randn(t.shape, generator=gen).bfloat16()
            for t in checkpoint_spec(SIZES[model]).tensors}


def held_checkpoint(model: str, history: Mapping[int, Collection[str] | None], version: int
                    ) -> dict[str, torch.Tensor]:
    """What the trainers hold at ``version`` after delta steps: each tensor's values of the
    newest version up to it that changed it. ``history``: version -> the tensors that version
    changed (None: all of them), for every version sent so far."""
    names = [t.name for t in checkpoint_spec(SIZES[model]).tensors]
    last = {n: max(v for v, ch in history.items() if v <= version and (ch is None or n in ch))
            for n in names}
    full = {v: checkpoint(model, v) for v in set(last.values())}
    return {n: full[v][n] for n, v in last.items()}


def digest(params) -> str:
    """A hash of the parameters' bytes (names sorted): equal digests, bit-identical weights.
    Read on the host (a GPU's parameters are copied there first)."""
    h = hashlib.blake2b(digest_size=8)
    for n in sorted(params):
        h.update(params[n].detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def _check_model(model: str) -> None:
    if model not in SIZES:
        raise ValueError(f"unknown model size {model!r}; choose one of {sorted(SIZES)}")


class RLTrainer(Actor):
    """A trainer rank holding a TP shard of the model (TP x 1 x 1; TP = the trainer mesh)."""

    def __init__(self, model: str, tp: int):
        _check_model(model)
        torch.set_num_threads(1)
        self.model, self.tp = model, tp

    @endpoint
    def setup(self, group) -> None:
        """Build this rank's shard and its `SenderAdapter` (call on the whole mesh)."""
        if group.num_trainers != self.tp:
            raise ValueError(f"the transfer group has {group.num_trainers} trainers but this "
                             f"actor holds a TP{self.tp} shard; spawn it on a mesh of {self.tp} "
                             f"procs and the group over the same procs")
        rank = current_rank().rank
        self.shard = TrainerShard(SIZES[self.model], self.tp, rank, 1, 0,
                                  device=self._device())
        self.adapter = group.sender(self.shard.params, self.shard.load_weights,
                                    checkpoint_spec(SIZES[self.model]))

    def _device(self) -> torch.device:
        """Where this rank's shard lives: its proc's GPU (by its place on the host) where
        CUDA is available, else the CPU (tests override it)."""
        return bind_local_device()

    @endpoint
    def connect(self) -> None:
        self.adapter.connect()

    @endpoint
    def train_and_send(self, version: int) -> tuple[float, float]:
        """Stand-in optimizer step to ``version``, then send_weights. Returns (start, stall)
        seconds: when send_weights began (CLOCK_MONOTONIC) and how long it blocked."""
        with torch.no_grad():
            self.shard.load_weights(checkpoint(self.model, version).items())
        start = time.monotonic()
        self.adapter.send_weights(version)
        return start, time.monotonic() - start

    @endpoint
    def add_engines(self, group) -> None:
        """Plan in the engines ``group`` (from `TransferGroup.add_engines`) added; collective."""
        self.adapter.add_engines(group)

    @endpoint
    def remove_engine(self, engine: int) -> None:
        """Take rollout engine ``engine`` out of the group; collective."""
        self.adapter.remove_engine(engine)

    @endpoint
    def train_and_send_delta(self, version: int, changed: list[str]) -> tuple[float, float]:
        """A step that changes only ``changed`` (their values of ``version``), then a delta
        ``send_weights(version, changed=changed)``; returns as `train_and_send`."""
        with torch.no_grad():
            full = checkpoint(self.model, version)
            self.shard.load_weights((n, full[n]) for n in changed)
        start = time.monotonic()
        self.adapter.send_weights(version, changed=changed)
        return start, time.monotonic() - start

    @endpoint
    def plan_bytes(self) -> int | None:
        """Rank 0: the RDMA bytes one transfer over the plan in force writes, every stage of
        every worker (the last update's, once its send_weights returned); others: None."""
        plan = self.adapter.plan
        return None if plan is None else int(plan.stage_bytes()[0].sum())

    @endpoint
    def finish(self) -> None:
        """Rank 0 in SS modes: wait until every staged version was transferred (raises an
        error of the background transfer). Other ranks and modes: nothing to wait for."""
        if self.adapter.worker.index == 0 and self.adapter.config.sender_staging:
            self.adapter.wait_idle()


class RLRollout(Actor):
    """A rollout rank: a TP shard of one engine; `step` polls, then runs a forward pass."""

    receiver_cls = None
    """A `ReceiverAdapter` subclass to build instead of it (tests inject faults this way)."""

    def __init__(self, model: str, tp: int):
        _check_model(model)
        torch.set_num_threads(1)
        self.model, self.tp = model, tp

    @endpoint
    def setup(self, group) -> None:
        """Build this rank's shard and its `ReceiverAdapter` (call on the whole mesh)."""
        if group.engine_size != self.tp:
            raise ValueError(f"the transfer group has engines of {group.engine_size} ranks but "
                             f"this actor holds a TP{self.tp} shard; pass "
                             f"engine_size={self.tp} to TransferGroup.spawn")
        self.rank_in_engine = current_rank().rank % self.tp
        self.device = self._device()  # the references below stay on the host
        self.shard = RolloutShard(SIZES[self.model], self.tp, self.rank_in_engine, 1, 0,
                                  device=self.device)
        self.adapter = group.receiver(self.shard.params, self.shard.load_weights,
                                      checkpoint_spec(SIZES[self.model]),
                                      cls=self.receiver_cls)

    _device = RLTrainer._device

    @endpoint
    def wait_version(self, version: int, history: Mapping[int, Collection[str] | None]
                     ) -> tuple[int, bool]:
        """Poll until the parameters hold ``version``; (version held, bit-exact against this
        rank's own loader of what the trainers held then, per `held_checkpoint`)."""
        held = self.adapter.wait_for_version(version)
        ref = RolloutShard(SIZES[self.model], self.tp, self.rank_in_engine, 1, 0)
        ref.load_weights(held_checkpoint(self.model, history, held).items())
        return held, digest(ref.params) == digest(self.shard.params)

    @endpoint
    def step(self, seed: int) -> dict:
        """poll_requests(), then one inference step. Returns what it ran with: rank, step,
        version, installed (None: nothing), stall_s, start and exact (the install bit-exact
        against this rank's own loader of that version; None without an install)."""
        start = time.monotonic()
        installed = self.adapter.poll_requests()
        stall = time.monotonic() - start
        exact = None
        if installed is not None:  # bit-exact against this rank's own loader of that version
            ref = RolloutShard(SIZES[self.model], self.tp, self.rank_in_engine, 1, 0)
            ref.load_weights(checkpoint(self.model, installed).items())
            exact = digest(ref.params) == digest(self.shard.params)
        tokens = torch.randint(0, SIZES[self.model].vocab, (1, 4),
                               generator=torch.Generator().manual_seed(seed)).to(self.device)
        rank_forward(self.shard, tokens)  # the inference step, with the version installed
        return {"rank": self.adapter.worker.index, "step": self.adapter.step - 1,
                "version": self.adapter.version, "installed": installed, "stall_s": stall,
                "start": start, "exact": exact}
