"""The single controller: owns both meshes, plans centrally, drives every round of every update.

    controller                       trainer mesh (TrainerActor)      rollout mesh (RolloutActor)
    ----------                       ---------------------------      ---------------------------
    spawn procs + actors  ------->   parts = factory("trainer", spec, rank)   (likewise)
    TransferGroup.spawn   ------->   a TransferAgent on every proc (serves the library's calls)
    attach(group)         ------->   group.worker(...): this rank's TransferWorker
    connect_group (weightbridge.coordination.session, the one connect of every path):
      SOURCE_MAP          <-------   probe own load_weights           probe own load_weights
      correspond + plan_transfer (pure, here)
      SETUP               ------->   tables + depth arenas            tables + arenas, register
                          <---------------------------------------   incoming ranges -> handles
      SET_PEERS           ------->   handles                          handles
    per update:  train_step(v) -->   parameters of version v
      run_update (weightbridge.coordination.sequencer, the one round sequencer of every path):
                 SEND_ROUND(r) -->   pack r, RDMA RECEIVE =========>  arena r % depth
                 FORWARD(r, EXTERNAL), then INTERNAL  ------------->  RDMA to peers' arena
                 LAND(r)       ------------------------------------>  arena -> parameters
                 SEND_ROUND(r + depth) once LAND(r) returned everywhere
      checksums(v)            <------------------------------------  live vs own load_weights(v)

Handles travel on the control plane (endpoint arguments); bytes only through RDMA writes. Each
step is issued the moment its inputs are done: a trainer serves its sends one at a time in the
order issued, so round r + 1's send already waits in the trainer's queue when round r's writes
land; the rollouts forward and land concurrently. Every wait is bounded and a failure becomes
one `TransferError` naming the round and the step.

Typical usage::

    with MeshTransfer(TrainerSpec.parse("nodes=1,gpus=4,tp=2,ep=2"),
                      RolloutSpec.parse("engines=2,nodes=1,gpus=2,tp=2"), "tiny") as mt:
        plan = mt.connect()
        report = mt.update(1)
"""

from __future__ import annotations

import asyncio
import time
from typing import Collection

from monarch.actor import this_host

from controller.membership import Lost, Membership
from controller.report import TransferError, UpdateReport, WorkersLost  # noqa: F401 (users catch it here)
from controller.timing import update_timing, write_dests
from meshes.actors import RolloutActor, TrainerActor, load_factory
from meshes.spec import RolloutSpec, TrainerSpec
from meshes.workers import FACTORIES
from weightbridge import TransferConfig, TransferPlan
from weightbridge.coordination.sequencer import StepFailed
from weightbridge.coordination.session import connect_group, run_update, unanswered
from weightbridge.mesh.control import MeshControl, TransferGroup
from weightbridge.mesh.transport import backend, configure_transport, drop_all
from weightbridge.planning.simulate import eq1
from weightbridge.types import scaled_tensor

PROBE_BYTES = 8 << 20
"""Link probe write size: one 8 MB RDMA chunk."""
PROBE_REPEATS = 3


class ClosingContext:
    """A context manager that runs ``self._start()`` on enter (and ``self.close()`` if that
    fails, so what had started stops) and ``self.close()`` on exit."""

    def __enter__(self):
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class MeshTransfer(ClosingContext, Membership):
    """Both meshes and the plan between them. A context manager: leaving it stops the meshes.

    Args:
        trainer, rollout: Mesh specs: how many workers, on how many hosts, and the layout the
            worker factory builds (validated against the demo model before anything spawns).
        workers: The worker factory, ``"module:name"`` (`weightbridge.WorkerParts`), or the
            name of a demo model size (``"tiny"``, ``"medium"``, ``"small"``:
            `meshes.workers`).

    Keyword Args:
        config: The group's `TransferConfig` (round size, depth, timeouts).
        procs: (trainer procs, rollout procs) to spawn the actors on instead of spawning procs
            (any axis names); they are then not stopped here.
        trainer_actor, rollout_actor: Actor classes (tests substitute faulty ones).
        link_rate: Bytes/s of every host link, when known (an emulated cluster's `tc` rate):
            Eq. (1) uses it and the link probe is skipped.
        reroute: A function applied to the plan before it is handed out (the P2P ablation in
            `controller.baselines`).

    Raises:
        ValueError: a spec that does not fit the demo model, or a factory that does not
            import, before anything spawns.
    """

    def __init__(self, trainer: TrainerSpec, rollout: RolloutSpec, workers: str = "tiny", *,
                 config: TransferConfig = TransferConfig(), procs=None,
                 trainer_actor=TrainerActor, rollout_actor=RolloutActor,
                 link_rate: float | None = None, reroute=None):
        if not isinstance(config, TransferConfig):
            raise ValueError(f"config must be a weightbridge.TransferConfig, got "
                             f"{type(config).__name__}")
        if config.sender_staging or config.receiver_staging:
            raise ValueError("MeshTransfer drives synchronous updates (the controller sequences "
                             "every round); staging modes are for the adapters: use "
                             "TransferGroup.sender/receiver, or drop sender_staging / "
                             "receiver_staging from the config")
        workers = resolve_workers(workers, trainer, rollout)
        self.trainer_spec, self.rollout_spec, self.workers = trainer, rollout, workers
        self.config = config
        self._given_procs = procs
        self._actor_classes = (trainer_actor, rollout_actor)
        self._owned: list = []
        """Procs spawned here (stopping them stops everything on them)."""
        self._actors: list = []
        self._foreign: list = []
        """Actor meshes on procs this object did not spawn (stopped one by one)."""
        self._rollout_meshes: list[tuple[int, object]] = []
        """(first flat rank, actor mesh) of the rollouts: the first mesh, then each joined
        engine's (`add_engine`)."""
        self.group: TransferGroup | None = None
        self.plan: TransferPlan | None = None
        self.spawn_s = 0.0
        self.num_handles = 0
        self.links: dict[str, float] = {}
        """Bytes/s of one RDMA write stream per probed link, measured at connect."""
        self.ideal_s = 0.0
        self.link_rate, self._reroute = link_rate, reroute
        self.lost_engines: set[int] = set()
        """Engines out of the group: lost mid-update (`WorkersLost`) or `remove_engine`d."""
        self.lost_trainers: set[int] = set()
        """Trainers left out after they were lost mid-update (their replicas send for them)."""
        self._generation = 0
        """Plans made since connect (numbers the receivers' staging slots)."""
        self._tensors: frozenset[str] | None = None
        """The checkpoint tensors the plan in force moves (None: all)."""
        self._tensor_names: list[str] | None = None
        self._held: dict[str, int] | None = None
        """Per checkpoint tensor, the version the rollouts hold (None before any update)."""

    @property
    def backend(self) -> str:
        """RDMA backend ("tcp" is Monarch's fallback where there is no RDMA NIC)."""
        return backend()

    # -- lifetime -------------------------------------------------------------------------------

    def _start(self) -> None:
        t0 = time.perf_counter()
        if self._given_procs is None:
            configure_transport()  # before spawning: children read the config at start-up
            host = this_host()
            for side, spec in (("trainer", self.trainer_spec), ("rollout", self.rollout_spec)):
                self._owned.append(host.spawn_procs(per_host={"worker": spec.num_workers},
                                                    name=side))
            tp, rp = self._owned
        else:
            tp, rp = self._given_procs
        trainer_cls, rollout_cls = self._actor_classes
        self.trainers = tp.spawn("trainer", trainer_cls, self.workers, self.trainer_spec)
        self._actors.append(self.trainers)
        self.rollouts = rp.spawn("rollout", rollout_cls, self.workers, self.rollout_spec)
        self._actors.append(self.rollouts)
        self._rollout_meshes = [(0, self.rollouts)]
        if self._given_procs is not None:
            self._foreign += self._actors
        self.group = TransferGroup.spawn(tp, rp, engine_size=self.rollout_spec.workers_per_engine,
                                         config=self.config)
        self.control = MeshControl(self.group)
        futures = [m.attach.call(self.group) for m in self._actors]
        for f in futures:
            f.get()
        self.spawn_s = time.perf_counter() - t0

    def close(self) -> None:
        """Stop the actors and agents, and the procs if this object spawned them. Safe to
        call twice."""
        errors = []
        if self.group is not None and self._foreign:
            # Procs outlive this object: release the workers so the procs free their buffers.
            try:
                self.group.close()
            except Exception as e:  # keep stopping the actors; re-raised below
                errors.append(e)
        self.group = None
        for mesh in self._foreign + self._owned:
            try:
                mesh.stop().get(timeout=60)
            except Exception as e:  # keep stopping the others; re-raised below
                errors.append(e)
        self._owned, self._actors, self._foreign = [], [], []
        if errors:
            raise RuntimeError(f"stopping the meshes failed: {errors}; look for leftover "
                               f"bootstrap_main processes with ps") from errors[0]

    def _spawn_engine(self, procs, spec: RolloutSpec, first: int):
        """(procs, actors) of one joining engine (flat ranks from ``first``): on ``procs``, or
        on procs spawned on this host."""
        owned = procs is None
        if owned:
            procs = this_host().spawn_procs(per_host={"worker": spec.workers_per_engine},
                                            name=f"rollout-e{spec.engines - 1}")
            self._owned.append(procs)
        actors = procs.spawn("rollout", self._actor_classes[1], self.workers, spec, first)
        if not owned:
            self._foreign.append(actors)
        self._actors.append(actors)
        self._rollout_meshes.append((first, actors))
        return procs, actors

    # -- connect --------------------------------------------------------------------------------

    def connect(self) -> TransferPlan:
        """Probe, plan, hand out plans, register buffers, hand out handles. Moves no weights.

        Raises:
            LayoutError: the two meshes load different checkpoints, or the rollouts need
                elements no trainer holds (raised by the planner); either way before any
                worker allocates a buffer.
        """
        self._maps, connected = connect_group(self.control, self.config, reroute=self._reroute)
        self.links = ({"configured": self.link_rate} if self.link_rate else {})
        self._use(connected)
        if not self.link_rate:
            self.links = self._probe_links()
            self._use(connected)  # Eq. (1) from the probed links
        return self.plan

    def _use(self, connected) -> None:
        """Make ``connected`` (a `ConnectedGroup`) the plan in force."""
        self.connected, self.plan = connected, connected.plan
        self.num_handles = connected.num_handles
        self._dests = write_dests(self.plan)  # from its tables: no second build of the plans
        if self.links:
            egress = self.link_rate or self.links["trainer->rollout"]
            self.ideal_s = eq1(self.plan, trainer_node_bandwidth=egress,
                               rollout_node_bandwidth=self.link_rate or self.links.get(
                                   "rollout->rollout", egress))

    def _probe_links(self) -> dict[str, float]:
        """Write PROBE_BYTES into rollout 0 from trainer 0 and from a rollout of another engine
        (or the same engine if there is one), best of PROBE_REPEATS each: one stream per link."""
        handle = _one(self.rollouts, 0).probe_buffer.call_one(
            PROBE_BYTES).get()
        writers = {"trainer->rollout": _one(self.trainers, 0)}
        spec = self.rollout_spec
        peer = spec.workers_per_engine if spec.engines > 1 else 1
        if peer < spec.num_workers:
            writers["rollout->rollout"] = _one(self.rollouts, peer)
        try:
            return {link: PROBE_BYTES / mesh.probe_link.call_one(
                handle, PROBE_BYTES, PROBE_REPEATS).get() for link, mesh in writers.items()}
        finally:
            drop_all({0: handle})

    def summary(self) -> str:
        """The plan summary plus the link probe and the ideal EWTT it gives."""
        links = ", ".join(f"{k} {v / 1e6:.0f} MB/s" for k, v in self.links.items())
        how = ("every host link, each direction (tc)" if self.link_rate else
               f"one {PROBE_BYTES >> 20} MB RDMA write stream, best of {PROBE_REPEATS}")
        return (f"{self.plan.summary()}\n{self.plan.worker_summary()}\n"
                f"  links ({how}): {links}\n  ideal EWTT (Eq. 1, a link per planning "
                f"node): {self.ideal_s:.4f}s")

    # -- one update -----------------------------------------------------------------------------

    def update(self, version: int, changed: Collection[str] | None = None) -> UpdateReport:
        """Train step, transfer every round, verify every rollout parameter by checksum.

        ``changed``: a delta update: the checkpoint tensors whose values change in this
        version (the others keep the version they hold). Only their bytes move, over a plan
        restricted to them (made on the first such update, kept while the same set follows;
        another set, or a full update, re-plans from the kept maps). The first update is full.

        Raises:
            ValueError: ``changed`` names tensors the workers do not read, or comes before
                any full update (before anything moves).
            TransferError: a worker failed, died or stalled during the transfer.
        """
        if self.plan is None:
            raise RuntimeError("call connect() before update()")
        versions = self._versions_of(version, changed)
        t0 = time.perf_counter()
        for f in [mesh.train_step.call(versions) for _, mesh in self._live("trainer")]:
            f.get()
        t1 = time.perf_counter()
        tensors = None if changed is None else frozenset(changed)
        if tensors != self._tensors and tensors != frozenset():
            self._tensors = tensors
            self._replan()
        held = versions if isinstance(versions, dict) else dict.fromkeys(
            self._read_tensors(), version)
        if tensors != frozenset():  # nothing changed: nothing moves
            try:
                self._transfer(version)
            except Lost as lost:
                # The trainers hold `versions` now and recovery re-sends it to the survivors:
                # the next delta and join build on it, not on the version before.
                self._held = held
                self._recover(version, lost.workers, lost.cause, t1 - t0, versions)
        self._held = held
        return self._report(versions, t1 - t0, t1, moved=tensors != frozenset())

    def _read_tensors(self) -> list[str]:
        """Every checkpoint tensor some worker reads (walked once: the maps never change)."""
        if self._tensor_names is None:
            maps = self._maps.trainers + self._maps.rollouts
            # (A block scale's virtual tensor is its tensor's: versioned with it.)
            self._tensor_names = sorted({scaled_tensor(p.region.tensor) or p.region.tensor
                                         for m, _ in maps for p in m.pieces})
        return self._tensor_names

    def _versions_of(self, version: int, changed) -> int | dict[str, int]:
        """What each tensor holds after this update: ``version``, or tensor -> version."""
        if changed is None:
            return version
        if isinstance(changed, str):
            raise ValueError(f"changed must be a collection of tensor names, got the string "
                             f"{changed!r}; pass [{changed!r}]")
        if self._held is None:
            raise ValueError("the first update must be full (changed=None): the rollouts "
                             "hold no version of the trainers' weights yet")
        unknown = sorted(set(changed) - set(self._held))
        if unknown:
            raise ValueError(f"changed names {len(unknown)} tensors no worker reads: "
                             f"{unknown[:4]}{' and more' if len(unknown) > 4 else ''}; name "
                             f"checkpoint tensors (e.g. {sorted(self._held)[:2]})")
        return {t: version if t in changed else v for t, v in self._held.items()}

    def _report(self, versions, train_step_s: float, t1: float, *,
                moved: bool = True) -> UpdateReport:
        """Spans and verification of the update that just ended, on the live workers."""
        t2 = time.perf_counter()
        version = versions if isinstance(versions, int) else max(versions.values())
        live = {side: self._live(side) for side in ("trainer", "rollout")}
        span_f = [(side, first, mesh.timings.call()) for side, runs in live.items()
                  for first, mesh in runs]
        check_f = [mesh.checksums.call(versions) for _, mesh in live["rollout"]]
        spans = {(side, first + p.rank): s for side, first, f in span_f
                 for p, s in f.get().items()}
        count, bad = self._verify(live["rollout"], versions, check_f)
        t3 = time.perf_counter()
        sent, _ = self.plan.stage_bytes()
        return UpdateReport(version=version, train_step_s=train_step_s, transfer_s=t2 - t1,
                            verify_s=t3 - t2, rdma_bytes=int(sent.sum()) if moved else 0,
                            num_params=count, mismatched=bad,
                            timing=update_timing(spans, self._dests) if moved else None,
                            ideal_s=self.ideal_s)

    def _verify(self, runs, versions, futures=None) -> tuple[int, tuple[str, ...]]:
        """(parameters compared, mismatches) of the rollouts in ``runs`` ((first rank, actor
        mesh) pairs) against their own load_weights of ``versions``."""
        futures = futures or [mesh.checksums.call(versions) for _, mesh in runs]
        results = [r for f in futures for r in _by_rank(f.get())]
        ranks = [first + i for first, mesh in runs for i in range(int(mesh.size()))]
        return mismatches(results, ranks)

    def _transfer(self, version: int) -> None:
        """Every round of one update; returns once every rollout landed its last round.

        Raises:
            TransferError: some worker failed, died or never finished (bounded wait).
        """
        # Each write is bounded by the peer timeout on the workers and Monarch reports a dead
        # proc; this is the backstop for a step that neither finishes nor fails.
        deadline = self.config.timeout_s * (self.plan.num_rounds + 2)
        try:
            run_update(self.control, self.connected, deadline_s=deadline, version=version)
        except (StepFailed, asyncio.TimeoutError) as e:
            what = str(e) or f"did not finish within {deadline:g}s"
            live = self.connected
            lost = unanswered(self.control, list(live.live_trainers) + list(live.live_rollouts))
            if lost:
                raise Lost(lost, f"update {version} failed: {what}\n"
                                  f"{', '.join(str(w) for w in lost)} did not answer a ping "
                                  f"within {self.config.notice_timeout_s:g}s (dead or "
                                  f"stalled)") from e
            raise TransferError(
                f"update {version} failed: {what}\nevery worker still answers; the meshes are "
                f"in an unknown state: close this MeshTransfer and start again") from e


def resolve_workers(workers: str, trainer: TrainerSpec, rollout: RolloutSpec) -> str:
    """The factory path of ``workers`` (a demo model name or ``module:name``), with a demo
    model's specs validated; raises ValueError before anything spawns."""
    if ":" not in workers:
        if workers not in FACTORIES:
            raise ValueError(f"unknown model {workers!r}: give a demo model "
                             f"({sorted(FACTORIES)}) or a worker factory as module:name")
        from meshes.qwen3_moe import SIZES

        trainer.validate(SIZES[workers])
        rollout.validate(SIZES[workers])
        workers = FACTORIES[workers]
    load_factory(workers)  # fails here, before any proc spawns
    return workers


def mismatches(results: list, ranks: list[int] | None = None) -> tuple[int, tuple[str, ...]]:
    """(parameters compared, ``rollout<i>:<param>`` of each that differs) from every rollout's
    (live checksums, own load_weights' checksums), in the order of ``ranks`` (default: all
    rollouts in rank order)."""
    bad, count = [], 0
    for i, (got, want) in zip(ranks if ranks is not None else range(len(results)), results):
        count += len(want)
        bad += [f"rollout{i}:{n}" for n in want if got.get(n) != want[n]]
    return count, tuple(bad)


def _by_rank(values) -> list:
    return [v for _, v in sorted(values.items(), key=lambda kv: kv[0].rank)]


def _one(mesh, rank: int):
    """The actor of flat rank ``rank`` (any axis names)."""
    return mesh.flatten("rank").slice(rank=rank)
