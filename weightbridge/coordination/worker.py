"""`TransferWorker`: one worker's part of a transfer group, whatever drives the group.

It holds the worker's parameters, its own ``load_weights`` and its data plane, and serves the
`PeerCall`s of connect and of the rounds: probe itself, build its executor and round buffers
from its `WorkerPlan`, take its peers' handles, and per round pack and write (trainers),
forward and land (rollouts). With sender staging a trainer's rounds read its staged copy
(`STAGE` takes it), and with receiver staging a rollout lands rounds in a staging slot and
installs a slot later (`INSTALL`): `weightbridge.coordination.staging`. The adapters
(`SenderAdapter`, `ReceiverAdapter`) extend it with the version protocol; the controller's
actors use it as it is (the controller sequences).

Typical usage (a worker of a controller-driven group; connect and the rounds call it)::

    worker = TransferWorker("rollout", params, load_weights, spec, rank=j,
                            placement=Placement("rollout-h0", engine=0),
                            transport=transport, config=TransferConfig())
"""

from __future__ import annotations

import collections
import functools
import itertools
import math
import pickle
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

import torch

from weightbridge.config import TransferConfig
from weightbridge.coordination.control import ControlPlane, PeerCall, Transport
from weightbridge.discovery.cache import (SourceMapCache, cache_key, probe_and_keep,
                                          verified_map)
# Defined in weightbridge.errors (one hierarchy); importable from here as before.
from weightbridge.errors import ChecksumMismatch, ReplicaMismatch  # noqa: F401
from weightbridge.execution.boxcopy import CopyKernels
from weightbridge.execution.checksum import checksum, matches
from weightbridge.coordination.params import (Padded, named_params, not_loaded_error,
                                              padded_pieces, param_digest, poison, poisoned,
                                              rebound_error, storage_of)
from weightbridge.coordination.signals import STAGES, Abandoned, RoundPart, RoundSignals
from weightbridge.coordination.staging import SlotBuffers, StagedCopy, host_buffer
from weightbridge.execution.executor import WorkerExecutor, on_real_cuda
from weightbridge.types import (CheckpointSpec, Placement, Range, SourceMap, Stage, WorkerId,
                                WorkerPlan)

LoadWeights = Callable[[Iterable[tuple[str, torch.Tensor]]], None]
Checkpoint = Callable[..., Iterable[tuple[str, torch.Tensor]]]
SIDES = ("trainer", "rollout")
MAX_SPANS = 1 << 16
"""Spans kept for `take_spans` (older ones are dropped: a group nobody reads must not grow)."""
MAX_EVENTS = 128
"""Events kept in `TransferWorker.events` (the newest: a worker logs 2-3 per update, so about
the last 50 updates). Nothing reads them but tests and a debugger; a log that takes thousands
of updates to fill (4,096 did) grows the process by every update until then."""
Checksums = tuple[int, ...]
"""The checksums of writes of one round: flat records (receiving rollout's index, arena,
offset, nbytes, checksum), five ints each. Flat ints pickle about 15x faster than a dict keyed
by `WorkerId`, and the sums ride on every round's control messages."""
RECORD = 5
SOURCE_MAP_WAYS = ("kept", "verify", "probe")
"""What `TransferWorker.on_source_map` may be asked to do."""
_SEQ = itertools.count()
"""Process-wide event order (itertools.count is atomic under the GIL): tests compare it."""


def _a_step(handler):
    """A step of an update (a send, forward, land or whole round): counted while it runs, so
    that `TransferWorker.on_drain` can wait for it."""

    @functools.wraps(handler)
    def counted(self, *args, **kwargs):
        with self._stepping:
            self._steps += 1
        try:
            return handler(self, *args, **kwargs)
        finally:
            with self._stepping:
                self._steps -= 1
                self._stepping.notify_all()

    return counted


class UnsourcedParameter(UserWarning):
    """A parameter that no checkpoint element lands in, of a rollout or of a trainer that kept
    no copy (``trainer_restore="none"``): the probe zeroed it, and neither an update nor a load
    of the checkpoint writes it."""


def _host_copy(params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Host copies of the parameters in one host buffer (`staging.host_buffer`: pinned where
    a parameter is on a real GPU): one device-to-host copy each, no device memory."""
    sizes = [p.numel() * p.element_size() for p in params.values()]
    starts = [0]
    for n in sizes:
        starts.append(-(-(starts[-1] + n) // 64) * 64)  # (every dtype's alignment)
    device = next((p.device for p in params.values() if on_real_cuda(p.device)), "cpu")
    flat = host_buffer(starts[-1], torch.device(device))
    return {name: flat[s:s + n].view(p.dtype).view(p.shape).copy_(p.detach())
            for (name, p), s, n in zip(params.items(), starts, sizes)}


def _warn_unsourced(worker: WorkerId, smap: SourceMap) -> None:
    sourced = {p.param for p in smap.pieces}
    lost = [s.name for s in smap.params if s.name not in sourced and math.prod(s.shape)]
    if lost:
        warnings.warn(f"{worker}: no checkpoint element lands in parameter(s) "
                      f"{', '.join(lost[:4])}{' and more' if len(lost) > 4 else ''}; the probe "
                      f"left them zero, and neither an update nor a load of the checkpoint "
                      f"writes them. Restore their values after connect if the model needs "
                      f"them", UnsourcedParameter, stacklevel=3)


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerParts:
    """What a worker factory builds for one rank: its model, its loader and the checkpoint.

    A controller-driven run (`python -m controller --workers module:factory`) calls
    ``factory(side, spec, rank)`` in each actor, ``side`` "trainer" or "rollout", ``spec`` that
    side's mesh spec (`weightbridge.specs.TrainerSpec` / `RolloutSpec`), ``rank`` the worker's flat
    rank. The controller probes ``load_weights``, has trainers run ``train_step(v)`` before
    update v, and checks each rollout against a second build of its rank loading
    ``checkpoint(v)``.

    Example (a one-tensor model, every rank holding all of it)::

        def factory(side, spec, rank):
            w = torch.zeros(4, 4, dtype=torch.bfloat16)
            ckpt = lambda v, names=None: [("w", torch.full((4, 4), v, dtype=torch.bfloat16))]
            return WorkerParts(params={"w": w}, load_weights=lambda kv: [w.copy_(t) for _, t in kv],
                               spec=CheckpointSpec.from_tensors(dict(ckpt(0))), checkpoint=ckpt)
    """

    params: Mapping[str, torch.Tensor]
    """Parameter name -> tensor, as ``load_weights`` fills it."""
    load_weights: LoadWeights
    """The rank's own loader: (checkpoint name, tensor) pairs in, parameters filled."""
    spec: CheckpointSpec
    """The checkpoint ``load_weights`` reads (names, shapes, dtypes)."""
    checkpoint: Checkpoint
    """``checkpoint(version, names=None)``: the (name, tensor) pairs of that version (only
    ``names`` where given); what trainers load and rollouts are checked against."""
    train_step: Callable[[int], None] | None = None
    """Trainers: make the parameters those of ``version`` (default: load ``checkpoint(v)``)."""


class TransferWorker:
    """One worker of a transfer group: its parameters, executor and transport.

    Args:
        side: "trainer" or "rollout".
        params: Parameter name -> tensor, or (name, tensor) pairs with distinct names;
            updated in place (rollouts), read (trainers).
        load_weights: The worker's own loader (probed at connect).
        spec: The checkpoint ``load_weights`` reads.

    Keyword Args:
        rank: This worker's index among the group's trainers or rollout workers.
        placement: Its planning node (host) and, for rollouts, its engine.
        transport: Its data plane (`weightbridge.coordination.control.Transport`).
        config: The group's `TransferConfig`.
        kernels: Pack/assemble implementation; by default chosen from the parameters' device
            (Triton on CUDA, the vectorized torch path elsewhere).
    """

    def __init__(self, side: str, params: Mapping[str, torch.Tensor], load_weights: LoadWeights,
                 spec: CheckpointSpec, *, rank: int, placement: Placement, transport: Transport,
                 config: TransferConfig, kernels: CopyKernels | None = None,
                 control: ControlPlane | None = None):
        if side not in SIDES:
            raise ValueError(f"side must be one of {SIDES}, got {side!r}")
        if not isinstance(config, TransferConfig):
            raise ValueError(f"config must be a weightbridge.TransferConfig, got "
                             f"{type(config).__name__}")
        if not params:
            raise ValueError(f"{side} {rank} has no parameters: pass the name -> tensor mapping "
                             f"its load_weights fills")
        self.side = side
        self.params = named_params(params, side, rank)
        self.load_weights, self.spec = load_weights, spec
        self.worker, self.placement = WorkerId(side, rank), placement
        self.transport, self.config, self.kernels = transport, config, kernels
        self.control = control
        """Its calls on its peers: the WRITTEN messages of `on_round` (None: a worker whose
        rounds the controller drives stage by stage)."""
        self.signals = RoundSignals()
        """What its peers said of the rounds of an update (`TransferConfig.round_control`
        "rounds")."""
        self.executor: WorkerExecutor | None = None
        self.source_map: SourceMap | None = None
        """What the probe found (set by `on_source_map`)."""
        self._map_key: str | None = None
        """This worker's source map cache key, as taken at connect's first call."""
        self.map_reused = False
        """Whether `on_source_map` took the map from the source map cache (verified) instead
        of probing (`TransferConfig.source_map_cache`)."""
        self.cond = threading.Condition()
        self._steps = 0
        """Steps of an update running here now (`_a_step`), guarded by ``_stepping``."""
        self._stepping = threading.Condition()
        self.spans: collections.deque = collections.deque(maxlen=MAX_SPANS)
        """(stage, round, start_ns, end_ns) of every step this worker ran (CLOCK_MONOTONIC)."""
        self.events: collections.deque = collections.deque(maxlen=MAX_EVENTS)
        """(sequence number, what, version): what this worker did, ordered process-wide (the
        newest `MAX_EVENTS`)."""
        self.staged = StagedCopy()
        """Trainers, sender staging: the copy of the parameters the rounds send."""
        self.slots = SlotBuffers()
        """Rollouts, receiver staging: versions landed and not installed yet."""
        self.failure: str | None = None
        """Why this worker's engine is out of the group (`on_fail`; None: it is not)."""
        self.padded: Padded = {}
        """Trainers: the pieces of each parameter with padding (set by the probe): its
        digest reads only those elements (`param_digest`)."""
        self.storage = {n: storage_of(p) for n, p in self.params.items()}
        """Parameter -> the storage registered here (`storage_of`), what the copy tables
        read; `check_sendable` compares it before every send."""
        self._registered = {n: p.detach() for n, p in self.params.items()}
        """The registered storage itself: a trainer's copy tables are built on it at every
        set-up, so a re-plan while a parameter is rebound (refused at its send) does not
        read the new storage, which nothing checks once the registered one is put back."""
        self._poisoned = False
        """Trainers with ``trainer_restore="none"``, from connect's probe to their first send:
        the probe left NaN in each parameter's first elements (`poison`)."""

    def check_sendable(self) -> None:
        """Trainers, before every send: each parameter still uses its registered storage,
        and at the first send after a probe that kept no copy (``trainer_restore="none"``),
        the weights were loaded since (`poisoned`).

        Raises:
            ParameterRebound: one was rebound (names the first, and how to fix it).
            ValueError: parameters still hold the probe's values (names them).
        """
        for name, p in self.params.items():
            was = self.storage[name]
            if p.data_ptr() != was[0] or p.stride() != was[2] or p.shape != was[1] or (
                    p.dtype != was[3]):
                raise rebound_error(self.worker, name, was, storage_of(p))
        if self._poisoned:
            stale = poisoned(self.params)
            if stale:
                raise not_loaded_error(self.worker, stale, len(self.params))
            self._poisoned = False

    def _log(self, event: tuple[str, int]) -> None:
        self.events.append((next(_SEQ), *event))

    def take_spans(self) -> list[tuple[str, int, int, int]]:
        """The spans recorded since the last call (and forget them)."""
        out = list(self.spans)
        self.spans.clear()
        return out

    def _timed(self, what: str, r: int, fn, *args):
        start = time.monotonic_ns()
        out = fn(*args)
        self.spans.append((what, r, start, time.monotonic_ns()))
        return out

    # -- connect ------------------------------------------------------------------------------

    def on_config(self) -> TransferConfig:
        """The `TransferConfig` this worker was given: connect checks it equals the leader's
        (`weightbridge.coordination.session.check_configs`)."""
        return self.config

    def on_source_map(self, how: str = "probe"):
        """This worker's source map, one of three ways (``how``), as connect asks every worker
        of the group alike (`weightbridge.coordination.session.source_maps`):

        - ``"kept"``: whether an earlier connect kept a map for this worker, checkpoint,
          parameters and loader (`TransferConfig.source_map_cache`); no load. Returns a bool.
        - ``"verify"``: that kept map, if the probe's verification pass alone (one load)
          confirms it (`map_reused`), else None.
        - ``"probe"``: probe this worker's own load_weights, and keep the map.

        ``"verify"`` and ``"probe"`` return (source map, placement, checkpoint spec) and
        overwrite the parameters. No second copy of them is made on their device (a GPU is
        usually full). A trainer whose config says ``trainer_restore="host-copy"`` gets its
        weights back from a host copy (pinned where CUDA is real); by default (``"none"``) it
        loads them after connect: the probe leaves NaN in each parameter's first elements, and
        its first send refuses parameters that still hold NaN there (`check_sendable`). A
        rollout keeps no copy: its first update writes every element that a checkpoint
        element lands in; the others (padding) hold zero after the probe or the check of a
        kept map, which zero them and refuse a loader that writes a non-zero value there. A
        parameter no checkpoint element lands in at all, of a rollout or of a trainer that
        kept no copy, is warned about by name (`UnsourcedParameter`): its value is lost to the
        probe.
        """
        if how not in SOURCE_MAP_WAYS:
            raise ValueError(f"how must be one of {SOURCE_MAP_WAYS}, got {how!r}")
        cache = (None if self.config.source_map_cache is None else
                 SourceMapCache(self.config.source_map_cache))
        if cache is not None and (how == "kept" or self._map_key is None):
            # Taken before this connect's first load and kept for its later calls: a loader
            # whose plain settings change as it loads (a counter) keeps one key.
            self._map_key = cache_key(str(self.worker), self.params, self.load_weights,
                                      self.spec)
        key = self._map_key
        if how == "kept":
            return cache is not None and cache.load(key) is not None
        saved = (_host_copy(self.params) if self.side == "trainer"
                 and self.config.trainer_restore == "host-copy" else None)
        try:
            if how == "verify":
                smap = None if cache is None else verified_map(
                    cache, key, self.params, self.load_weights, self.spec)
                if smap is None:
                    return None
            else:
                smap = probe_and_keep(cache, key, self.params, self.load_weights, self.spec)
            self.source_map, self.map_reused = smap, how == "verify"
        finally:
            if saved is not None:
                with torch.no_grad():
                    for n, p in self.params.items():
                        p.copy_(saved[n])
        if saved is None:  # no copy: what the probe zeroed stays zero
            _warn_unsourced(self.worker, smap)
        if self.side == "trainer" and saved is None:  # the first send checks for a load since
            with torch.no_grad():
                poison(self.params)
            self._poisoned = True
        self.padded = padded_pieces(smap)
        return smap, self.placement, self.spec

    def digest(self) -> tuple[int, ...]:
        """Per-parameter checksums of the parameters now (`param_digest`, padding left
        out)."""
        return param_digest(self.params, self.padded)

    def on_ping(self) -> bool:
        """Asked who is still there after a transfer failed."""
        return True

    def on_digest(self, version: int, digest: bool = True, live: bool = False
                  ) -> tuple[int, ...]:
        """Trainers, before the rounds of ``version``: if ``digest``, per-parameter checksums
        of what this trainer sends, compared with its data-parallel replicas': the
        parameters now (after `check_sendable`), or with sender staging
        the staged copy's, taken with it (the parameters may be a train step further).
        ``live``: the parameters' checksums now in every mode (the controller's
        ``changed="auto"``, before anything is staged)."""
        if live:
            return self.digest()
        if self.config.mode.sends_staged_copy:  # the staged copy is sent: its digest, taken with it
            assert self.staged.version == version, (self.staged.version, version)
            return self.staged.digest if digest else ()
        self.check_sendable()
        return self.digest() if digest else ()

    def on_setup(self, plan: WorkerPlan | bytes, ranges: list[Range] | None = (),
                 generation: int = 0) -> dict:
        """Build the copy tables and round buffers of ``plan``; register ``ranges`` (the buffer
        ranges peers write into) and return their handles. ``ranges`` None: only this
        worker's writes changed (an engine joined, `weightbridge.planning.extend`): keep the
        buffers, their registrations and tables, take the new writes; returns no handle.
        ``plan`` pickled: as connect hands it out (pickled once on the controller, and kept
        in its plan cache: `weightbridge.coordination.plan_cache`)."""
        if isinstance(plan, bytes):
            plan = pickle.loads(plan)
        if plan.worker != self.worker:
            raise ValueError(f"{self.worker} was handed the plan of {plan.worker}; the control "
                             f"plane must address workers by their rank in the group")
        if ranges is None:
            with self.cond:
                self.executor.rewire(plan)
            return {}
        with self.cond:  # a re-plan: not while a trainer stages (SS)
            self._setup(plan)
            if self.side == "rollout" and self.config.mode.lands_in_staging:
                self.slots.add(generation, self.executor)
        return dict(self.transport.register(self.executor.arenas, list(ranges)))

    def on_resetup(self, plan: WorkerPlan | bytes, ranges: list[Range] | None = (),
                   generation: int = 0) -> dict:
        """`on_setup` asked by a re-plan of the connected group (`PeerCall.RESETUP`)."""
        return self.on_setup(plan, ranges, generation)

    def _setup(self, plan: WorkerPlan) -> None:
        params = self._registered if self.side == "trainer" else self.params
        self.executor = WorkerExecutor(plan, params, self.kernels, depth=self.config.depth,
                                       host_arenas=self.config.arenas == "host")
        self.staged.reset(self.executor)  # (laid out for this plan; allocated when taken)

    def on_set_peers(self, handles: Mapping, addresses: Mapping | None = None) -> None:
        """The handles of the peer ranges this worker writes into, and the control plane's
        addresses of those peers (its `PeerCall.WRITTEN` messages go there)."""
        self.transport.set_peers(handles)
        if addresses and self.control is not None:
            self.control.learn(addresses)

    # -- the rounds of an update --------------------------------------------------------------

    def on_stage(self, version: int) -> None:
        """Trainers, sender staging: take the staged copy of ``version`` (the parameters now)
        that the rounds send from; the parameters may change once this returned.

        Raises:
            ParameterRebound: a parameter's storage was rebound (`check_sendable`).
            ValueError: the weights were not loaded after connect's probe (`check_sendable`).
        """
        self.check_sendable()
        with self.cond:
            self.take_staged(version)
            self._log(("staged", version))

    def take_staged(self, version: int) -> None:
        """Take the staged copy of ``version`` and, with checksums on, its digest (what
        replicas compare); ``self.cond`` held."""
        self.staged.take(self.executor, version)
        self.staged.digest = self.digest() if self.config.checksums else ()

    @_a_step
    def on_send_round(self, r: int) -> Checksums:
        """Trainers: pack round r into its buffer and write its RECEIVE bytes (returns once
        they landed, with their checksums); with sender staging, write them from the staged
        copy instead (packed when it was taken)."""
        if self.beyond(r):
            return ()
        if self.config.mode.sends_staged_copy:
            return self._write(r, Stage.RECEIVE, self.staged.view(r))
        if self.executor.plan.rounds[r].pack:
            self._timed("pack", r, self.executor.pack, r)
        return self._write(r, Stage.RECEIVE)

    @_a_step
    def on_forward(self, r: int, stage: Stage) -> Checksums:
        """Rollouts: write this stage's bytes of round r (they arrived in an earlier stage)."""
        return () if self.beyond(r) else self._write(r, stage)

    @_a_step
    def on_round(self, update: int, r: int, slots: Mapping[int, int] | None,
                 part: RoundPart) -> None:
        """This worker's whole part of round r (`TransferConfig.round_control` "rounds"):
        a trainer sends; a rollout waits for each stage's bytes (its writers say when they
        landed: `on_written`), forwards them, and lands the round. Every worker it wrote into
        is told once its writes landed, with their checksums.

        Raises:
            TimeoutError: a writer's bytes did not land within the peer timeout (named).
            weightbridge.coordination.signals.Abandoned: the update was given up on.
        """
        if self.beyond(r):
            return
        why = self.signals.given_up(update)
        if why is not None:  # queued behind the round that failed: nothing of it is written
            raise Abandoned(f"{self.worker}: round {r} was abandoned: {why}")
        if self.side == "trainer":
            self._tell(update, r, Stage.RECEIVE, self.on_send_round(r))
            return
        writers, timeout = part.writers_of(self.worker), self.config.peer_timeout_s
        mine = {w.stage for w in self.executor.plan.rounds[r].writes}
        sums: list[int] = []
        waited = 0  # the stages before STAGES[waited] have landed here
        for i, stage in enumerate(STAGES[1:], 1):
            if stage in mine:
                sums += self.signals.wait(self.worker, update, r, writers, STAGES[waited:i],
                                          timeout)
                waited = i
                self._tell(update, r, stage, self.on_forward(r, stage))
        sums += self.signals.wait(self.worker, update, r, writers, STAGES[waited:], timeout)
        self.on_land(r, slots, tuple(sums))

    def _tell(self, update: int, r: int, stage: Stage, sums: Checksums) -> None:
        """Tell every worker this one wrote into in (round r, ``stage``) that the writes
        landed, each with the checksums of its own ranges."""
        own: dict[int, list[int]] = collections.defaultdict(list)
        for k in range(0, len(sums), RECORD):  # (each record starts with its reader's index)
            own[sums[k]] += sums[k:k + RECORD]
        for peer in {w.peer for w in self.executor.plan.rounds[r].writes if w.stage is stage}:
            self.control.post([peer], PeerCall.WRITTEN, update, r, STAGES.index(stage),
                              self.worker, tuple(own.get(peer.index, ())))

    def on_written(self, update: int, r: int, stage: int, writer: WorkerId,
                   sums: Checksums) -> None:
        """``writer``'s writes of (round r, stage number ``stage``) into this worker landed."""
        self.signals.written(update, r, stage, writer, sums)

    def on_abandon(self, update: int, why: str) -> None:
        """The controller gave up on ``update``: this worker's waits in it end at once."""
        self.signals.abandon(update, why)

    def on_drain(self) -> None:
        """After an update failed: return once no step of it runs here any more. Served in
        order behind the sends and rounds issued before it (`PeerCall.ordered`), then waits
        for the forwards and lands still running, so that the next update's writes never
        meet a late one of this update in a round buffer.

        Raises:
            TimeoutError: steps still run after `TransferConfig.drain_timeout_s` (a write
                to a peer that is gone waits up to the peer timeout).
        """
        timeout = self.config.drain_timeout_s
        with self._stepping:
            if not self._stepping.wait_for(lambda: not self._steps, timeout):
                raise TimeoutError(f"{self.worker}: {self._steps} step(s) of the failed update "
                                   f"still running after {timeout:g}s "
                                   f"(TransferConfig.drain_timeout_s)")

    def beyond(self, r: int) -> bool:
        """Round r comes after this worker's plan: engines joined since it was set up, and
        their rounds are appended (`weightbridge.planning.extend`); it has no part in them."""
        return r >= self.executor.num_rounds

    @_a_step
    def on_land(self, r: int, slots: Mapping[int, int] | None = None,
                expected: Checksums | None = None) -> None:
        """Rollouts: round r landed (every stage): check what arrived against ``expected``
        (the writers' checksums), then assemble it into the parameters, or keep it in this
        worker's engine's staging slot (``slots``: engine -> slot; receiver staging)."""
        if self.beyond(r):
            return
        self.verify(r, expected)
        slot = (slots or {}).get(self.placement.engine)
        if slot is not None:
            self._timed("stage", r, self.slots.land, slot, r, self.executor.arena(r))
        elif self.executor.plan.rounds[r].assemble:
            self._timed("assemble", r, self.executor.assemble, r)

    def on_install(self, slot: int, version: int) -> None:
        """Rollouts, receiver staging: put ``version``, landed whole in staging slot ``slot``,
        into the parameters."""
        with self.cond:
            self.slots.install(slot)
            self._log(("installed", version))

    def on_fail(self, message: str) -> None:
        """This worker's engine is out of the group: ``message`` says why."""
        with self.cond:
            self.failure = message
            self.cond.notify_all()

    def verify(self, r: int, expected: Checksums | None) -> None:
        """Raise `ChecksumMismatch` if a range written into this worker in round r holds
        other bytes than its writer sent; before anything of the round is assembled."""
        expected = expected or ()
        for k in range(0, len(expected), RECORD):
            peer, index, offset, nbytes, want = expected[k:k + RECORD]
            if peer != self.worker.index or self.worker.side != "rollout":
                continue
            if not matches(self.executor.arenas[index][offset:offset + nbytes], want):
                raise ChecksumMismatch(
                    f"{self.worker}: the {nbytes} bytes written at offset {offset} of its round "
                    f"buffer in round {r} differ from what their writer sent (its checksum "
                    f"{want & (2**64 - 1):#018x} does not match them); they hold "
                    f"{self._params_at(r, offset, nbytes)}. Nothing of round {r} was "
                    f"assembled into this worker's parameters")

    def _params_at(self, r: int, offset: int, nbytes: int) -> str:
        """Which parameters' elements a received range of round r carries (for errors)."""
        plan = self.executor.plan
        names = sorted({plan.params[c.tensor].name for c in plan.rounds[r].assemble
                        if offset <= c.buffer_offset < offset + nbytes})
        return (f"elements of {', '.join(names[:4])}{' and more' if len(names) > 4 else ''}"
                if names else "bytes this worker forwards to its peers")

    def _write(self, r: int, stage: Stage, buffer: torch.Tensor | None = None) -> Checksums:
        writes = list(self.executor.writes(r, stage, buffer))
        if not writes:
            return ()
        return self._timed(stage.value, r, self._write_all, r, stage, writes)

    def _write_all(self, r: int, stage: Stage, writes: list) -> Checksums:
        futures = self.transport.write(writes)
        # Summed while the bytes are on their way (nothing writes into the sources before
        # this round's writes landed).
        sums = (tuple(x for peer, key, src in writes for x in (peer.index, *key, checksum(src)))
                if self.config.checksums else ())
        for peers, f in futures:  # a failure names the peers, the round and the stage
            try:
                self.transport.wait([f])
            except Exception as e:
                raise RuntimeError(
                    f"{self.worker}: the {stage.value} write of round {r} into "
                    f"{', '.join(map(str, peers))} failed "
                    f"({type(e).__name__}: {e}); that worker died or its link stalled for "
                    f"{self.config.peer_timeout_s:g}s") from e
        return sums
