"""Connect and update, once, for every path: the controller, the adapters' rank-0 sender and
any driver of a `ControlPlane`.

    connect_group(control, config) -> (GroupMaps, ConnectedGroup)
        every worker at once: CONFIG -> equal to the leader's? (ConfigMismatch otherwise)
        every worker at once: SOURCE_MAP -> (source map, placement, checkpoint spec): kept
            maps verified if every worker holds one and all hold, else every worker probes
        same checkpoint everywhere? (LayoutError otherwise, before any buffer exists)
        plan_transfer -> WorkerPlans -> incoming ranges per receiver (or all of it read back
            from the plan cache: same maps, sizes and library code as a connect before)
        rollouts: SETUP -> handles;  trainers: SETUP;  everyone: SET_PEERS (its handles)
    run_update(control, group)
        the round sequencer (`weightbridge.coordination.sequencer`) over SEND_ROUND / FORWARD / LAND

Probing and planning happen once per group; `plan_group` alone re-plans from the kept maps
(a lost engine left out) without probing again. Engines joining and leaving a connected group:
`weightbridge.coordination.elastic`.

Typical usage::

    maps, group = connect_group(control, TransferConfig())   # maps: kept for re-plans
    run_update(control, group)           # per version, after the trainers' step
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import secrets
import time
from dataclasses import dataclass, field
from typing import Callable, Collection, Mapping, Sequence

from weightbridge.config import TransferConfig
from weightbridge.coordination.control import ControlPlane, PeerCall, rollouts, trainers
from weightbridge.coordination.plan_cache import PlanCache, kept_or_planned, plan_of
from weightbridge.coordination.sequencer import run_rounds, run_whole_rounds
from weightbridge.coordination.signals import round_parts
from weightbridge.errors import ConfigMismatch, LayoutError, ReplicaMismatch, describe
from weightbridge.gc_pause import with_gc_paused
from weightbridge.planning.plan import TransferPlan
from weightbridge.types import CheckpointSpec, Placement, SourceMap, Stage, WorkerId, scaled_tensor


@dataclass(frozen=True, slots=True)
class GroupMaps:
    """What probing found: kept to re-plan without probing again (a probe overwrites a
    worker's parameters for a moment: not while it generates)."""

    trainers: tuple[tuple[SourceMap, Placement], ...]
    rollouts: tuple[tuple[SourceMap, Placement], ...]
    spec: CheckpointSpec | None = None
    """The checkpoint every worker reads (a joining engine must read it too)."""
    kept: bool = False
    """The maps an earlier connect kept, every one verified (`source_maps`), not probed."""


@dataclass(frozen=True, slots=True)
class ConnectSteps:
    """How the plan in force was set up, step by step: what came from the caches (a restart)
    and what each step took on the connecting host. Printed by the controller after connect.
    """

    maps: str = ""
    """``"probed"``, ``"kept"`` (every worker's kept map verified), or empty (a re-plan from
    the maps the group holds)."""
    plan: str = "planned"
    """``"planned"`` or ``"kept"`` (read back from `TransferConfig.plan_cache`)."""
    config_s: float = 0.0
    maps_s: float = 0.0
    plan_s: float = 0.0
    setup_s: float = 0.0
    """Every worker's set-up (buffers, registered ranges) and the writers' handles."""

    def __str__(self) -> str:
        maps = f"source maps {self.maps_s:.2f}s ({self.maps}), " if self.maps else ""
        config = f"config check {self.config_s:.2f}s, " if self.maps else ""
        return (f"{config}{maps}plan {self.plan_s:.2f}s ({self.plan}), set-up "
                f"{self.setup_s:.2f}s")


@dataclass(frozen=True, slots=True)
class ConnectedGroup:
    """A group after connect: the plan in force and what the sequencer needs of it."""

    plan: TransferPlan
    active: frozenset
    """(round, stage) and (round, "land") steps some worker has a part in."""
    live_rollouts: tuple[WorkerId, ...]
    """The rollout workers the plan routes bytes to (all, unless engines were left out)."""
    num_handles: int
    """Registered receive ranges, over all rollouts."""
    depth: int
    live_trainers: tuple[WorkerId, ...] = ()
    """The trainers the plan sends from (all, unless lost ones were left out; empty: all)."""
    replicas: tuple[tuple[tuple[int, str], ...], ...] = ()
    """Groups of (trainer, parameter) holding the same checkpoint elements in the same layout
    on two or more trainers (data-parallel replicas; norms, biases, embeddings replicated
    across tensor-parallel ranks), compared by `check_replicas` before each update; empty
    with checksums off."""
    param_names: tuple[tuple[str, ...], ...] = ()
    """Per trainer, its parameter names in the order of its `PeerCall.DIGEST` answer."""
    handles: dict = field(default_factory=dict)
    """(rollout, range) -> its registered handle: the writers' `PeerCall.SET_PEERS` table
    (kept, so a join hands the trainers the old rollouts' handles again)."""
    round_control: str = "stages"
    """`TransferConfig.round_control` of the group: how `run_update` drives the rounds."""
    drain_timeout_s: float | None = None
    """`TransferConfig.drain_timeout_s` of the group: the longest `run_update` waits, after
    an update failed, for its steps to end on every worker (`drain`); None: as long as the
    control plane bounds each `PeerCall.DRAIN`."""
    steps: ConnectSteps = ConnectSteps()
    """How this plan was set up (and, at connect, how the maps were found)."""


@with_gc_paused  # (the maps' pieces, unpickled as they arrive: `weightbridge.gc_pause`)
def probe_group(control: ControlPlane) -> GroupMaps:
    """Probe every worker at once and check that they all read the same checkpoint.

    All at once: a real engine's load_weights may be collective over its ranks (a DCP load
    over the trainers), so probing one rank after another would deadlock.

    Raises:
        LayoutError: two workers read different checkpoints.
    """
    ts, rs = trainers(control), rollouts(control)
    found, how = source_maps(control, ts + rs)
    check_engines(control, [placement for _, placement, _ in found[len(ts):]])
    check_same_checkpoint([spec for _, _, spec in found[:len(ts)]],
                          [spec for _, _, spec in found[len(ts):]])
    pairs = tuple((smap, placement) for smap, placement, _ in found)
    return GroupMaps(pairs[:len(ts)], pairs[len(ts):], found[0][2], kept=how == "kept")


def source_maps(control: ControlPlane, workers: Sequence[WorkerId]) -> tuple[list, str]:
    """(source map, placement, checkpoint spec) of every worker, all taken the same way, and
    which way: ``"kept"``, the maps an earlier connect kept (`TransferConfig.source_map_cache`)
    if every worker holds one and the verification pass confirms each, else ``"probed"``, a
    probe of every worker. A collective loader (a DCP load over the trainers, vLLM's over an
    engine's TP ranks) then sees the same loads on every rank: a probe on one rank beside a
    verification on another would wait on each other forever."""
    if all(control.call(workers, PeerCall.SOURCE_MAP, "kept")):
        found = control.call(workers, PeerCall.SOURCE_MAP, "verify")
        if all(f is not None for f in found):
            return found, "kept"
    return control.call(workers, PeerCall.SOURCE_MAP, "probe"), "probed"


@with_gc_paused  # (the plan, every worker's, each pickled for it: `weightbridge.gc_pause`)
def plan_group(control: ControlPlane, maps: GroupMaps, config: TransferConfig, *,
               excluded: frozenset[int] = frozenset(),
               excluded_trainers: frozenset[int] = frozenset(), generation: int = 0,
               reroute: Callable[[TransferPlan], TransferPlan] | None = None,
               tensors: frozenset[str] | None = None, replan: bool = False) -> ConnectedGroup:
    """Plan from ``maps`` and set every worker up on it: buffers, registered ranges, handles.

    Rollout workers whose index is in ``excluded`` get an empty source map, so no byte is
    routed to or through them, and they are not called; so do the trainers in
    ``excluded_trainers``, whose regions then come from the replicas that hold them too
    (`LayoutError`, naming what no trainer holds, if none does). ``generation`` numbers the
    receivers'
    staging slots (a re-plan keeps a slot an engine is installing from). ``reroute`` rewrites
    the plan before it is handed out (the same-data-plane P2P ablation). ``tensors`` restricts
    the plan to those checkpoint tensors (a delta update: the others stay as they are).
    ``replan``: every worker was set up before (`PeerCall.RESETUP`, bounded by the peer
    timeout, rather than connect's unbounded `PeerCall.SETUP`). At connect (no ``replan``,
    ``reroute`` or ``tensors``) the plan is read back from `TransferConfig.plan_cache` when a
    connect of the same maps kept it (`plan_cache.kept_or_planned`).
    """
    restricted = maps if tensors is None else GroupMaps(
        *(tuple((_restricted(m, tensors), p) for m, p in side)
          for side in (maps.trainers, maps.rollouts)))
    planning = (_emptied(restricted.trainers, excluded_trainers),
                _emptied(restricted.rollouts, excluded))
    sizes = {"round_bytes": config.round_bytes, "depth": config.depth}
    # Kept only at connect: a re-plan, a delta or a rerouted plan is made once.
    keep = config.plan_cache is not None and not replan and reroute is None and tensors is None
    t0 = time.perf_counter()
    planned, hit = (kept_or_planned(PlanCache(config.plan_cache), *planning, **sizes) if keep
                    else (plan_of(*planning, **sizes, reroute=reroute), False))
    t1 = time.perf_counter()
    # (Engines the control plane has beyond the maps, added but not joined, are not planned.)
    live = [w for w in rollouts(control)[:len(maps.rollouts)] if w.index not in excluded]
    ts = [w for w in trainers(control) if w.index not in excluded_trainers]
    everyone = live + ts
    # Both sides at once: a trainer registers nothing (its writes need the rollouts'
    # handles, handed out below), so its set-up waits for no rollout's.
    found = control.call_each(everyone, PeerCall.RESETUP if replan else PeerCall.SETUP, [
        (planned.handed[w], list(planned.ranges.get(w, ())), generation) for w in everyone])
    handles = {(w, key): h for w, hs in zip(everyone, found) for key, h in hs.items()}
    # (An in-process transport registers nothing: its writes reach the peer's buffers directly.)
    set_peers(control, {w: planned.outgoing[w] for w in everyone}, handles, config)
    steps = ConnectSteps(plan="kept" if hit else "planned", plan_s=t1 - t0,
                         setup_s=time.perf_counter() - t1)
    return ConnectedGroup(steps=steps, plan=planned.plan, active=planned.active,
                          live_rollouts=tuple(live), live_trainers=tuple(ts),
                          num_handles=len(handles), depth=config.depth,
                          round_control=config.round_control,
                          drain_timeout_s=config.drain_timeout_s,
                          # Replicas by their whole maps (a delta plan's are partial).
                          replicas=(replicated_params(_emptied(maps.trainers,
                                                                       excluded_trainers))
                                    if config.checksums else ()),
                          param_names=tuple(_compared(smap) for smap, _ in maps.trainers),
                          handles=handles)


def _restricted(smap: SourceMap, tensors: frozenset[str]) -> SourceMap:
    """``smap`` with only the pieces of ``tensors`` (and of their block scales: a changed
    tensor a rollout quantizes changes its scales too), and only the parameters they reach."""
    pieces = tuple(p for p in smap.pieces
                   if (scaled_tensor(p.region.tensor) or p.region.tensor) in tensors)
    reached = {p.param for p in pieces}
    return dataclasses.replace(
        smap, pieces=pieces, params=tuple(p for p in smap.params if p.name in reached),
        unsourced=tuple(u for u in smap.unsourced if u[0] in reached), unused=())


def _emptied(maps, excluded: frozenset[int]) -> list:
    """``maps`` with the workers in ``excluded`` holding and needing nothing."""
    return [(dataclasses.replace(m, pieces=(), unsourced=(), unused=()), p)
            if i in excluded else (m, p) for i, (m, p) in enumerate(maps)]


def unjoined(maps: GroupMaps, count: int, engine_size: int) -> GroupMaps:
    """``maps`` grown by ``count`` rollout workers that hold and need nothing: engines whose
    join failed and that stay on the control plane, out of the group for good, so that a
    later join's workers come after them (each on the node of its engine rank in engine 0;
    never planned, as an excluded one)."""
    size = len(maps.rollouts)
    added = tuple((dataclasses.replace(maps.rollouts[i % engine_size][0], pieces=(),
                                       unsourced=(), unused=()),
                   dataclasses.replace(maps.rollouts[i % engine_size][1],
                                       engine=i // engine_size))
                  for i in range(size, size + count))
    return dataclasses.replace(maps, rollouts=maps.rollouts + added)


def _compared(smap: SourceMap) -> tuple[str, ...]:
    """A trainer's parameter names in digest order (a parameter with padding is summed
    without it: `params.param_digest`)."""
    return tuple(sorted(p.name for p in smap.params))


def replicated_params(trainer_maps: Sequence[tuple[SourceMap, Placement]]
                      ) -> tuple[tuple[tuple[int, str], ...], ...]:
    """Parameters of two or more trainers that hold the same checkpoint elements in the same
    layout (equal parameter spec, equal pieces), which must hold equal bytes: every parameter
    of data-parallel replicas, and a norm, bias or embedding replicated across
    tensor-parallel ranks whose other parameters are sharded. Groups of (trainer, parameter
    name), in rank order. A parameter with padding (elements no checkpoint element lands in:
    they may differ) is compared on the elements its pieces land in (`param_digest`)."""
    groups: dict[tuple, list[tuple[int, str]]] = {}
    for i, (smap, _) in enumerate(trainer_maps):
        pieces: dict[str, list] = {}
        for p in smap.pieces:
            pieces.setdefault(p.param, []).append(p)
        for spec in smap.params:
            if spec.name in pieces:
                groups.setdefault((spec, frozenset(pieces[spec.name])), []).append(
                    (i, spec.name))
    return tuple(tuple(g) for g in groups.values() if len({i for i, _ in g}) > 1)


def check_replicas(control: ControlPlane, group: ConnectedGroup, version: int, *,
                   every_trainer: bool = False) -> None:
    """Compare the per-parameter checksums of ``version`` of every parameter more than one
    trainer holds (`replicated_params`). ``every_trainer``: ask every live trainer, for its
    storage check too (`TransferWorker.on_digest`; the controller's path, whose trainers
    have no send call of their own to check in).

    The plan takes each element from one holder, so holders that diverged would be blended
    element by element into the rollouts without this; it runs before any byte moves.

    Raises:
        ReplicaMismatch: two trainers hold different bytes for the same elements.
        ParameterRebound: (``every_trainer``) a trainer's parameter storage was rebound.
    """
    ranks = sorted({i for g in group.replicas for i, _ in g})
    if every_trainer:
        asked = list(group.live_trainers or trainers(control))
        answers = control.call_each(asked, PeerCall.DIGEST,
                                    [(version, t.index in ranks) for t in asked])
        by_rank = dict(zip((t.index for t in asked), answers))
        answers = [by_rank[i] for i in ranks]
    if not group.replicas:
        return
    if not every_trainer:
        answers = control.call([WorkerId("trainer", i) for i in ranks], PeerCall.DIGEST,
                               version)
    digests = {i: dict(zip(group.param_names[i], d)) for i, d in zip(ranks, answers)}
    bad: dict[tuple[int, int], list[str]] = {}
    for g in group.replicas:
        first, name = g[0]
        for other, other_name in g[1:]:
            if digests[first][name] != digests[other][other_name]:
                bad.setdefault((first, other), []).append(name)
    if not bad:
        return
    (first, other), names = min(bad.items())
    more = f" and {len(names) - 4} more" if len(names) > 4 else ""
    raise ReplicaMismatch(
        f"trainers T{first} and T{other} hold the same layout of the checkpoint in "
        f"{len(names)} parameters (data-parallel replicas, or a norm, bias or embedding "
        f"replicated across tensor-parallel ranks) but different bytes for version {version} "
        f"in {', '.join(map(repr, names[:4]))}{more}"
        + (f" (and {len(bad) - 1} more pairs of trainers differ)" if len(bad) > 1 else "")
        + f": a replica diverged (a failed or non-deterministic gradient reduction, a rank "
          f"that skipped a step). Nothing of version {version} was sent; resynchronize the "
          f"replicas (e.g. broadcast from one) and send again")


def set_peers(control: ControlPlane, outgoing: Mapping[WorkerId, Collection],
              handles: Mapping, config: TransferConfig) -> None:
    """Give each writer of ``outgoing`` (worker -> the (peer, range) of each of its writes:
    `outgoing_ranges`) what it writes into and whom it tells (`PeerCall.SET_PEERS`): the
    handle of every such peer range, and, with whole rounds (where writers tell their readers:
    `TransferConfig.round_control`), the control plane's address of every such peer
    (`ControlPlane.addresses`): a rollout of an engine that joined later is one its writers'
    own control plane cannot name by itself."""
    writers = list(outgoing)
    tables = [{k: handles[k] for k in outgoing[w] if k in handles} for w in writers]
    peers = {k[0] for table in tables for k in table}
    where = (control.addresses(sorted(peers, key=lambda w: (w.side, w.index)))
             if config.round_control == "rounds" else {})
    control.call_each(writers, PeerCall.SET_PEERS, [
        (table, {p: where[p] for p in {k[0] for k in table} if p in where})
        for table in tables])


def connect_group(control: ControlPlane, config: TransferConfig, *,
                  reroute: Callable[[TransferPlan], TransferPlan] | None = None
                  ) -> tuple[GroupMaps, ConnectedGroup]:
    """Check every worker was given ``config``, probe every worker, plan once, set everyone
    up. Moves no weights.

    Raises:
        ConfigMismatch: a worker's config differs from ``config`` (before anything else).
        LayoutError: the workers' layouts do not fit (before any buffer exists).
    """
    t0 = time.perf_counter()
    check_configs(control, config)
    t1 = time.perf_counter()
    maps = probe_group(control)
    t2 = time.perf_counter()
    group = plan_group(control, maps, config, reroute=reroute)
    return maps, dataclasses.replace(group, steps=dataclasses.replace(
        group.steps, maps="kept" if maps.kept else "probed", config_s=t1 - t0, maps_s=t2 - t1))


class ControlSteps:
    """The sequencer's steps as `PeerCall`s on every worker taking part."""

    def __init__(self, control: ControlPlane, group: ConnectedGroup,
                 slots: Mapping[int, int] | None = None):
        self.control, self.slots = control, dict(slots or {})
        self.trainers = list(group.live_trainers or trainers(control))
        self.rollouts = list(group.live_rollouts)
        self.sums: dict[int, tuple[int, ...]] = {}
        """Round -> the writers' checksums of its writes (empty with checksums off); handed
        to the receivers with land(r), which check them before assembling."""

    def _collect(self, r: int, answers: list) -> None:
        for sums in answers:
            self.sums[r] = self.sums.get(r, ()) + tuple(sums or ())

    async def send(self, r: int) -> None:
        self._collect(r, await self.control.call_async(self.trainers, PeerCall.SEND_ROUND, r))

    async def forward(self, r: int, stage: Stage) -> None:
        self._collect(r, await self.control.call_async(self.rollouts, PeerCall.FORWARD, r,
                                                       stage))

    async def land(self, r: int) -> None:
        await self.control.call_async(self.rollouts, PeerCall.LAND, r, self.slots,
                                      self.sums.pop(r, ()))


class WholeRoundSteps:
    """The rounds as one `PeerCall.ROUND` per worker taking part (`TransferConfig
    .round_control` "rounds"): the writers tell their readers themselves when a stage
    landed, with its checksums (`weightbridge.coordination.signals`)."""

    def __init__(self, control: ControlPlane, group: ConnectedGroup,
                 slots: Mapping[int, int] | None = None):
        self.control, self.slots = control, dict(slots or {})
        self.update = secrets.randbits(62)
        """Names this update's messages: a late one of an update given up on is not taken
        for one of the next."""
        self.parts = round_parts(group.plan)
        self.workers = sorted({w for p in self.parts.values() for w in p.workers},
                              key=lambda w: (w.side, w.index))

    async def round(self, r: int) -> None:
        """Round r on every worker taking part; the first to fail fails the round at once
        (the others may be waiting for the bytes of the one that failed)."""
        part = self.parts[r]
        await self.control.call_async(list(part.workers), PeerCall.ROUND, self.update, r,
                                      self.slots, part)

    async def run(self, num_rounds: int, depth: int, first: int) -> None:
        """Every round (`run_whole_rounds`); when one fails (or the whole is cancelled: the
        deadline), every worker of the update is told to give it up, before the rounds
        still in flight are awaited no more: their waits on the failed round's writers end
        at once, not after their peer timeout."""
        try:
            await run_whole_rounds(self, frozenset(self.parts), num_rounds, depth, first=first)
        except BaseException as e:
            # (A worker that could not be told waits out its peer timeout; the round's own
            # failure is the error to raise, not that one.)
            with contextlib.suppress(Exception):
                self.control.post(self.workers, PeerCall.ABANDON, self.update,
                                  f"the controller gave up on the update: {describe(e)[:300]}")
            raise


def run_update(control: ControlPlane, group: ConnectedGroup, *,
               slots: Mapping[int, int] | None = None, deadline_s: float | None = None,
               version: int | None = None, first_round: int = 0) -> None:
    """Move one version: every round, sequenced; returns once the last round landed.

    ``slots``: engine -> the staging slot its rollouts land into (receiver staging); engines
    not in it assemble into their parameters. With ``version``, every trainer checks its
    parameters' storage and data-parallel replicas are compared first (`check_replicas`).
    ``first_round``: start there (the rounds a join appended: the joining engines alone).

    Raises:
        ReplicaMismatch: replicas disagree (before any byte moved).
        ParameterRebound: a trainer's parameter storage was rebound (before any byte moved).
        StepFailed: a step failed on some worker (names the round and the step).
        asyncio.TimeoutError: the whole update outlasted ``deadline_s``.
    """
    if version is not None:
        check_replicas(control, group, version, every_trainer=True)
    if group.round_control == "rounds":
        whole = WholeRoundSteps(control, group, slots)
        rounds = whole.run(group.plan.num_rounds, group.depth, first_round)
    else:
        rounds = run_rounds(ControlSteps(control, group, slots), group.active,
                            group.plan.num_rounds, group.depth, first=first_round)
    try:
        asyncio.run(asyncio.wait_for(rounds, deadline_s) if deadline_s else rounds)
    except Exception:
        drain(control, group)
        raise


def drain(control: ControlPlane, group: ConnectedGroup) -> None:
    """After an update failed: wait until no worker of ``group`` runs a step of it any more
    (`PeerCall.DRAIN`), at most ``group.drain_timeout_s``. The sequencer stops at the first
    failure, but the steps already issued go on where they run: a send queued behind the
    one that failed, a forward of a round that had landed its first stage. Unwaited, one of
    them could write into a round buffer the next update is filling (a checksum refuses
    that update then; with checksums off it would be assembled). A worker that cannot be
    reached, or whose steps outlast the wait (a write to a peer that is gone), is not
    waited for: the error to raise is the update's own."""
    workers = [*(group.live_trainers or trainers(control)), *group.live_rollouts]

    async def drained() -> None:
        calls = asyncio.gather(*(control.call_async([w], PeerCall.DRAIN) for w in workers),
                               return_exceptions=True)
        await (calls if group.drain_timeout_s is None
               else asyncio.wait_for(calls, group.drain_timeout_s))

    with contextlib.suppress(Exception):
        asyncio.run(drained())


def unanswered(control: ControlPlane, workers: Sequence[WorkerId]) -> list[WorkerId]:
    """The ``workers`` that do not answer a `PeerCall.PING` within the notice timeout: dead,
    stalled or cut off. Asked after a step failed, to name who is lost."""
    answers = control.call(list(workers), PeerCall.PING, return_errors=True)
    return [w for w, a in zip(workers, answers) if a is not True]


def check_configs(control: ControlPlane, config: TransferConfig,
                  workers: Sequence[WorkerId] | None = None) -> None:
    """Every worker of a group must run on an equal `TransferConfig` (round size and depth
    size its buffers and ranges; the mode and timeouts, its waits): ask each of ``workers``
    (default: all) for its own (`PeerCall.CONFIG`) and compare with ``config``, the leader's.

    Raises:
        ConfigMismatch: a ValueError naming the first worker whose config differs, the
            fields and both values; nothing was probed or allocated yet.
    """
    workers = list(workers) if workers is not None else trainers(control) + rollouts(control)
    for worker, theirs in zip(workers, control.call(workers, PeerCall.CONFIG)):
        diff = config.differences(theirs)
        if diff:
            raise ConfigMismatch(
                f"{worker} was given a different TransferConfig than the group's leader "
                f"({'; '.join(diff)}, leader's value first). Give every worker of the group "
                f"the same TransferConfig (one object, e.g. built once and passed to every "
                f"adapter or the TransferGroup)")


def check_engines(control: ControlPlane, placements: Sequence[Placement], *,
                  first: int = 0) -> None:
    """Rollout worker j must be in engine j // engine_size: the group numbers its rollouts
    engine by engine, and installs an engine's version on exactly its workers.
    ``placements`` are those of workers ``first``, ``first + 1``, ..."""
    for j, placement in enumerate(placements, first):
        if placement.engine != j // control.engine_size:
            raise ValueError(f"rollout worker {j} says it is in engine {placement.engine}, but "
                             f"with engine_size={control.engine_size} the group puts it in "
                             f"engine {j // control.engine_size}; number rollout workers engine "
                             f"by engine (rank = engine * engine_size + engine_rank) and give "
                             f"each engine's workers one engine number")


def check_same_checkpoint(trainer_specs: Sequence[CheckpointSpec],
                          rollout_specs: Sequence[CheckpointSpec], *, first: int = 0) -> None:
    """Every worker must read the same checkpoint: source-map regions are coordinates in it.

    Without this, a trainer of a bigger vocabulary (say) would hold every row a rollout needs,
    and the plan would silently move rows of a tensor the rollout does not have.
    """
    want = trainer_specs[0]
    for side, specs, start in (("trainer", trainer_specs, 0), ("rollout", rollout_specs, first)):
        for i, spec in enumerate(specs, start):
            diff = want.differences(spec, ("trainer 0", f"{side} {i}"))
            if diff:
                more = f" and {len(diff) - 4} more" if len(diff) > 4 else ""
                raise LayoutError(
                    f"trainer worker 0 and {side} worker {i} load different checkpoints: "
                    f"{len(diff)} tensors differ: {'; '.join(diff[:4])}{more}. Every worker "
                    f"must load the same checkpoint: build both sides from the same model "
                    f"config")
