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
      [SS, async: STAGE(v) --->   staged copy of v; the rounds run on a thread of the
                                  controller, update() returns]
      run_update (weightbridge.coordination.sequencer, the one round sequencer of every path):
                 SEND_ROUND(r) -->   pack r, RDMA RECEIVE =========>  arena r % depth
                 FORWARD(r, EXTERNAL), then INTERNAL  ------------->  RDMA to peers' arena
                 LAND(r)       ------------------------------------>  arena -> parameters
                 SEND_ROUND(r + depth) once LAND(r) returned everywhere
      [round_control="rounds": one ROUND(r) per worker; the writers tell their readers
       (WRITTEN, peer to peer) when a stage's bytes landed]
      [RS, async: round r lands in the engine's staging slot instead]
      checksums(v)            <------------------------------------  live vs own load_weights(v)
    poll_requests() (between generation steps; RS, async):
                 INSTALL(slot, v) ------------------------------------>  staging slot -> parameters

Handles travel on the control plane (`MeshControl`), bytes only through RDMA writes. Steps
are issued as their inputs are done (a trainer serves its sends in order; rollouts forward
and land concurrently). Every wait is bounded; a failure is one `TransferFailed` naming
round and step.
The group's state (maps, the plan in force and its generation, who is out, the staging-slot
ledger) is its `GroupLeader`; what was sent and what the rollouts hold, a `VersionBook`.

Typical usage::

    with MeshTransfer(TrainerSpec.parse("nodes=1,gpus=4,tp=2,ep=2"),
                      RolloutSpec.parse("engines=2,nodes=1,gpus=2,tp=2"), "tiny") as mt:
        plan = mt.connect()
        report = mt.update(1)      # sync: installed and verified
        mt.poll_requests()         # between generation steps: SS waits, RS/async install
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from typing import Collection

from controller.actors import (PROBE_BYTES, PROBE_REPEATS, ClosingContext,  # noqa: F401
                               WorkerMeshes)  # (ClosingContext re-exported)
from controller.calls import serialized
from controller.membership import RESTART, Lost, Membership
from controller.ranks import by_rank
from controller.report import (InstallReport, JoinReport, UpdateReport, WorkersLost,  # noqa: F401
                               mismatches)  # (re-exported)
from controller.streaming import Streaming
from controller.timing import update_timing, write_dests
from controller.versions import VersionBook
from meshes.actors import RolloutActor, TrainerActor
from meshes.factories import resolve_workers
from weightbridge import TransferConfig, TransferFailed, TransferPlan
from weightbridge.driver import (AUTO, ConnectSteps, GroupLeader, MeshControl, PeerCall,
                                 RolloutSpec, StepFailed, Loss, TrainerSpec, TransferGroup, backend,
                                 changed_params, describe, eq1, lose, one_line, run_update,
                                 scaled_tensor, surfaced, tensors_loaded_by, unanswered)



class MeshTransfer(ClosingContext):
    """Both meshes and the plan between them. A context manager: leaving it stops the meshes.

    Every sync mode runs here (docs/controller.md, "Sync modes"): `update` returns once the
    trainers may take their next step (sync: the rollouts hold the version; SS, async: the
    staged copy is taken, the rounds stream on a controller thread; RS: it landed in staging),
    and `poll_requests`, between generation steps, puts the newest version into every engine
    at that step. The group's state is its `GroupLeader` (``leader``).

    Args:
        trainer, rollout: Mesh specs: how many workers, on how many hosts, and the layout the
            worker factory builds (validated against the demo model before anything spawns).
        workers: The worker factory, ``"module:name"`` (`weightbridge.WorkerParts`), or the
            name of a demo model size (``"tiny"``, ``"medium"``, ``"small"``:
            `meshes.workers`).

    Keyword Args:
        config: The group's `TransferConfig` (round size, depth, timeouts, sync mode).
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
        workers = resolve_workers(workers, trainer, rollout)
        self.trainer_spec, self.rollout_spec, self.workers = trainer, rollout, workers
        self.config, self.mode = config, config.mode
        self.meshes = WorkerMeshes(trainer, rollout, workers, procs=procs,
                                   actor_classes=(trainer_actor, rollout_actor))
        self.group: TransferGroup | None = None
        self.leader: GroupLeader | None = None
        """The group's state: maps, plan in force, who is out, staging slots (set at
        connect)."""
        self.book: VersionBook | None = None
        """What the trainers sent and the rollouts hold (set at connect)."""
        self.spawn_s = 0.0
        self.link_probe_s = 0.0
        """The last connect's link probe (none with a configured ``link_rate``)."""
        self.num_handles = 0
        self.links: dict[str, float] = {}
        """Bytes/s of one RDMA write stream per probed link, measured at connect."""
        self.ideal_s = 0.0
        self.link_rate, self._reroute = link_rate, reroute
        self._streaming = Streaming()
        """The transfer running on a thread of its own (SS, async)."""
        self.staged_generation: int | None = None
        """Sender staging: the plan generation the trainers' staged copies were taken for (a
        re-plan drops them: a join's catch-up then stages the held version again)."""
        self.closed = False
        """Set by `close`: every later call raises `GroupClosed`."""
        self.calls = threading.RLock()
        """Held by every public call (`serialized`): one runs at a time, whatever thread."""
        self._book_lock = threading.Lock()
        """``book``: the streaming thread lands versions while `poll_requests` installs."""
        self.membership = Membership(self)
        """Engines joining and leaving, and recovery after a loss (`add_engine`, ...)."""
        self._auto_digests: tuple[int, dict[int, tuple[int, ...]]] | None = None
        """(version, per live trainer its parameters' checksums) at the last update with
        ``changed="auto"``: what the next one compares with (`_auto_changed`)."""

    @property
    def backend(self) -> str:  # the RDMA backend ("tcp": Monarch's fallback, no RDMA NIC)
        return backend()

    @property
    def plan(self) -> TransferPlan | None:
        """The plan in force (None before connect); replaced by every re-plan."""
        return None if self.leader is None else self.leader.plan

    @property
    def connect_steps(self) -> ConnectSteps | None:
        """How the last connect went (None before it): whether the source maps and the plan
        came from the caches (a restart), and each step's seconds."""
        return None if self.leader is None or self.leader.group is None else (
            self.leader.group.steps)

    @property
    def lost_engines(self) -> set[int]:
        """Engines out of the group: lost mid-update (`WorkersLost`) or `remove_engine`d."""
        return set() if self.leader is None else self.leader.out_engines

    @property
    def lost_trainers(self) -> set[int]:
        """Trainers left out after they were lost mid-update (their replicas send for them)."""
        return set() if self.leader is None else self.leader.out_trainers

    # -- lifetime -------------------------------------------------------------------------------

    def _start(self) -> None:
        t0 = time.perf_counter()
        tp, rp = self.meshes.spawn()
        self.group = TransferGroup.spawn(tp, rp, engine_size=self.rollout_spec.workers_per_engine,
                                         config=self.config)
        self.control = MeshControl(self.group)
        self.meshes.attach(self.group)
        self.spawn_s = time.perf_counter() - t0

    def close(self) -> None:
        """Stop the actors and agents, and the procs if this object spawned them (a transfer
        still streaming is waited for first, at most its deadline). Safe to call twice.

        Raises:
            WeightBridgeError: (the error itself: `WorkersLost`, `ChecksumMismatch`, ...) the
                last transfer streaming on the controller (SS, async) failed and no call
                collected it: that version did not arrive whole. Raised once everything is
                stopped; on leaving a ``with`` block on an error of its own, added to that
                error as a note instead.
            RuntimeError: stopping the meshes failed (leftover processes).
        """
        self.closed = True
        streamed = None
        try:
            self._streaming.join(self._deadline())
        except Exception as e:  # noqa: BLE001  (raised once the meshes are stopped)
            streamed = e
        errors = []
        if self.group is not None and self.meshes.foreign:
            # Procs outlive this object: release the workers so the procs free their buffers.
            try:
                self.group.close()
            except Exception as e:  # keep stopping the actors; re-raised below
                errors.append(e)
        if self.group is not None:
            self.control.close()  # (its mailbox's threads)
        self.group = None
        errors += self.meshes.stop()
        if errors:
            raise RuntimeError(f"stopping the meshes failed: {errors}; look for leftover "
                               f"bootstrap_main processes with ps") from (streamed or errors[0])
        if streamed is not None:
            streamed.add_note("(raised by close(): the last transfer streaming on the "
                              "controller failed and no wait() collected it; the meshes are "
                              "stopped)")
            raise streamed

    @property
    def trainers(self):
        """The trainer actor mesh."""
        return self.meshes.trainers

    @property
    def rollouts(self):
        """The first rollout actor mesh (joined engines have their own)."""
        return self.meshes.rollouts

    def _live(self, side: str) -> list[tuple[int, object]]:
        """(first flat rank, actor mesh) of each run of consecutive live ranks of one side."""
        lost = self.lost_trainers if side == "trainer" else self.lost_engines
        return self.meshes.live(side, lost, self.rollout_spec.workers_per_engine)

    # -- connect --------------------------------------------------------------------------------

    @surfaced()  # (a worker's library error reaches the caller as itself)
    @serialized
    def connect(self) -> TransferPlan:
        """Probe, plan, hand out plans, register buffers, hand out handles. Moves no weights.

        Raises:
            LayoutError: the two meshes load different checkpoints, or the rollouts need
                elements no trainer holds (raised by the planner); either way before any
                worker allocates a buffer.
        """
        self.leader = GroupLeader(self.control, self.config)
        self.leader.connect(reroute=self._reroute)
        maps = self.leader.maps.trainers + self.leader.maps.rollouts
        # (A block scale's virtual tensor is its tensor's: versioned with it.)
        self.book = VersionBook({scaled_tensor(p.region.tensor) or p.region.tensor
                                 for m, _ in maps for p in m.pieces},
                                [t.name for t in getattr(self.leader.maps.spec, "tensors", ())])
        self.links = ({"configured": self.link_rate} if self.link_rate else {})
        self._use()
        if not self.link_rate:
            t0 = time.perf_counter()
            self.links = self.meshes.probe_links()
            self.link_probe_s = time.perf_counter() - t0
            self._use()  # Eq. (1) from the probed links
        return self.plan

    def _use(self) -> None:
        """The leader's plan is in force: what the reports need of it."""
        self.num_handles = self.leader.group.num_handles
        self._dests = write_dests(self.plan)  # from its tables: no second build of the plans
        if self.links:
            egress = self.link_rate or self.links["trainer->rollout"]
            self.ideal_s = eq1(self.plan, trainer_node_bandwidth=egress,
                               rollout_node_bandwidth=self.link_rate or self.links.get(
                                   "rollout->rollout", egress))

    def summary(self) -> str:
        """The plan summary plus the link probe and the ideal EWTT it gives."""
        links = ", ".join(f"{k} {v / 1e6:.0f} MB/s" for k, v in self.links.items())
        how = ("every host link, each direction (tc)" if self.link_rate else
               f"one {PROBE_BYTES >> 20} MB RDMA write stream, best of {PROBE_REPEATS}")
        return (f"{self.plan.summary()}\n{self.plan.worker_summary()}\n"
                f"  links ({how}): {links}\n  ideal EWTT (Eq. 1, a link per planning "
                f"node): {self.ideal_s:.4f}s\n  sync mode: {self.mode.value}")

    def _connected(self, call: str) -> None:
        if self.plan is None:
            raise RuntimeError(f"call connect() before {call}()")

    # -- who is in (`Membership`) ---------------------------------------------------------------

    @surfaced()  # (a worker's library error reaches the caller as itself)
    @serialized
    def add_engine(self, procs=None) -> JoinReport:
        """Add a rollout engine to the running group, between updates, without a new group.

        Spawns its procs on this host (or uses ``procs``: one engine's worth, e.g. on hosts
        attached later), its actors and the transfer agents; probes only its workers; extends
        the plan in force (`weightbridge.planning.extend`: a replica of a live engine is
        mirrored on it, the trainers untouched and the rollouts that land segments forwarding
        one more copy; another layout gets rounds of its own appended); sets up only it and
        the workers whose part changed; then moves the version the other engines hold into
        it and verifies it, so it holds a whole version before this returns (a mirrored join
        re-sends that version to every engine: their bytes do not change). Its engine number
        is the next one; later updates include it.

        Raises:
            ValueError: ``procs`` of another size than an engine.
            CatchUpRefused: without sender staging, the trainers' parameters no longer hold
                the version the engines hold (a train step ran since it was sent); before
                anything spawns.
            LayoutError: the engine loads another checkpoint or needs what no trainer holds
                (before any of its buffers exist).
            TransferFailed: setting the engine up failed (its process died, say: the join
                is rolled back, its engine number is the next join's), the catch-up transfer
                failed (the engine is taken out again) or did not verify.
        """
        return self.membership.add_engine(procs)

    @surfaced()  # (a worker's library error reaches the caller as itself)
    @serialized
    def replan(self) -> TransferPlan:
        """Plan the whole group again from the source maps of connect and joins (no probe):
        one non-redundant plan over every live engine, where joins had appended theirs. Every
        live worker is set up again. Returns the new plan."""
        return self.membership.replan()

    @surfaced()  # (a worker's library error reaches the caller as itself)
    @serialized
    def remove_engine(self, engine: int) -> TransferPlan:
        """Take rollout engine ``engine`` out of the group between updates (to restart or
        retire it); no byte is sent to or through it afterwards. An engine nothing depends on
        (one mirrored in by `add_engine`) just loses its rows: only the rollouts that
        forwarded to it take new writes. Otherwise the others are planned again from the
        source maps of connect (no probe). Returns the plan in force.

        An engine `add_engine` added is retired with it: its transfer agents and actors are
        stopped, and its procs if `add_engine` spawned them, so a long-lived group that adds
        and removes engines does not keep their processes and memory. An engine of the first
        rollout mesh shares its procs with the others: they run until `close`.

        Raises:
            ValueError: no such engine, it is already out, or it is the last one.
        """
        return self.membership.remove_engine(engine)

    # -- one update -----------------------------------------------------------------------------

    @surfaced()  # (a worker's library error reaches the caller as itself)
    @serialized
    def update(self, version: int, changed: Collection[str] | str | None = None, *,
               train: bool = True) -> UpdateReport:
        """Train step, then move ``version`` as the sync mode says; returns once the trainers
        may take their next step (the report's ``stall_s`` is how long that took after the
        train step). ``train=False``: no train step here: the trainers' parameters already
        hold ``version`` (the caller ran its own step on the trainer actors, e.g. to overlap
        it with the previous version's transfer):

        - sync: every live rollout's parameters hold it, verified by checksum;
        - SS, async: each trainer's staged copy is taken; the rounds run on a thread of this
          controller (`wait` returns their report; SS: the rollouts must not generate until
          `poll_requests` or `wait` returned; async: they go on and install it at a later
          `poll_requests`). The previous version's rounds end first (the staged copy is
          one buffer), after this version's train step;
        - RS: it landed in every live engine's staging slot; `poll_requests` installs it.

        ``changed``: a delta update: the checkpoint tensors whose values change in this
        version (the others keep the version they hold). Only what the rollouts lack moves
        (a version landed but never installed rides along), over a plan restricted to it.
        ``"auto"``: after the train step every trainer's parameters are checksummed and
        compared with the previous update's (if that one was "auto" too; else this one is
        full), and the tensors the changed parameters load from are sent.

        Raises:
            ValueError: a version not newer than the last one; ``changed`` names tensors the
                workers do not read, or comes before any full update (before anything moves).
            TransferFailed: a worker failed, died or stalled during the transfer (with
                staging: perhaps the previous version's, raised here once).
            WorkersLost: workers were lost and left out, raised within timeout_s of the loss;
                the group goes on without them (sync, RS: the version is re-sent to them
                afterwards, `wait` returns its report).
        """
        self._connected("update")
        versions = self.book.next(version, changed)
        if self.mode.resends_after_loss:  # (a re-send after a loss reads the parameters)
            self._streaming.join(self._deadline())
        t0 = time.perf_counter()
        auto = changed == AUTO
        trained = version if changed is None or auto else versions
        for f in ([mesh.train_step.call(trained) for _, mesh in self._live("trainer")]
                  if train else []):
            f.get()
        versions = self.book.holding(version, self._auto_changed(version)) if auto else versions
        if not auto:
            self._auto_digests = None  # (the next "auto" has no call of its own to compare)
        t1 = time.perf_counter()
        self._streaming.join(self._deadline())  # (the previous version's rounds; its failure)
        with self._book_lock:
            # What moves is the leader's call, as on the adapters' path: the delta log over
            # the version the rollouts' parameters hold (0: none whole).
            previous = self.book.version
            self.leader.record_delta(version, [previous], self.book.sent(version, versions))
            needed = self.leader.delta_log.needed(self.book.held_version)
        if needed == frozenset():  # nothing the rollouts lack: nothing moves
            with self._book_lock:
                self.book.installed(version)
            return self._report(version, t1 - t0, t1, moved=False)
        self.leader.restrict(needed)
        self._use()
        if self.mode.sends_staged_copy:
            self.control.call(self.leader.live_trainers(), PeerCall.STAGE, version)
            self.staged_generation = self.leader.generation
            t2 = time.perf_counter()
            self._streaming.start(self._stream, version, t1 - t0, t2 - t1)
            return UpdateReport(version=version, train_step_s=t1 - t0, transfer_s=0.0,
                                verify_s=0.0, rdma_bytes=0, num_params=0, mismatched=(),
                                stall_s=t2 - t1, state="staged", ideal_s=self.ideal_s)
        self._send(version, t1 - t0)
        return self._report(version, t1 - t0, t1)

    def _stream(self, version: int, train_step_s: float, stall_s: float) -> UpdateReport:
        t1 = time.perf_counter()  # (SS, async: on the streaming thread)
        self._send(version, train_step_s)
        return dataclasses.replace(self._report(version, train_step_s, t1), stall_s=stall_s)

    def _send(self, version: int, train_step_s: float) -> None:
        """`_move` ``version``; a lost worker goes to `Membership.recover` (which re-sends it
        there)."""
        try:
            self._move(version)
        except Lost as lost:
            self.membership.recover(version, lost.workers, lost.cause, train_step_s)

    def _auto_changed(self, version: int) -> frozenset[str] | None:
        """``changed="auto"``: the tensors the live trainers' changed parameters load from,
        by their checksums now against the previous update's (one checksum pass over each
        trainer's parameters). None (full) when that update was not "auto", or not the last
        one sent, or the live trainers differ: only a call's own predecessor tells what
        changed since the rollouts got it (a parameter changed and changed back would look
        unchanged against an older one)."""
        ts = self.leader.live_trainers()
        now = dict(zip((t.index for t in ts), self.control.call(ts, PeerCall.DIGEST, version,
                                                                True, True)))
        before, self._auto_digests = self._auto_digests, (version, now)
        if before is None or before[0] != self.book.version or before[1].keys() != now.keys():
            return None
        names = self.leader.group.param_names
        return frozenset().union(*(
            tensors_loaded_by(changed_params(names[i], before[1][i], now[i]),
                              self.leader.tensors_of(i)) for i in now))

    def _move(self, version: int) -> None:
        """The rounds of ``version`` into the parameters or staging; the books told."""
        staging = self.mode.lands_in_staging
        self._transfer(version, self.leader.begin_landing(version) if staging else None)
        with self._book_lock:
            if staging:
                self.leader.landed(version)
                self.book.landed(version)
            else:
                self.book.installed(version)

    @surfaced()  # (a worker's library error reaches the caller as itself)
    @serialized
    def wait(self) -> UpdateReport | None:
        """SS, async: wait until the rounds of the newest staged version ended; returns their
        report (verified in SS; async: landed in staging). Sync, RS: after a `WorkersLost`,
        wait until the version was re-sent to the surviving engines; returns that re-send's
        report (verified; RS: landed). None: no transfer was streaming.

        Raises:
            TransferFailed, WorkersLost: that transfer failed (raised once).
        """
        return self._streaming.join(self._deadline())

    @surfaced()  # (a worker's library error reaches the caller as itself)
    @serialized
    def poll_requests(self) -> InstallReport | None:
        """Call between the rollouts' generation steps: afterwards every live engine's
        parameters hold the newest version they may take, all switched at this step.

        Sync: nothing to do (`update` installed it). SS: waits for the rounds streaming into
        the parameters (`wait`). RS, async: installs the newest version landed in staging on
        every worker of every live engine and verifies it. Returns what was installed (None:
        nothing newer).

        Raises:
            TransferFailed: an installed parameter differs from its own load_weights, or the
                streaming transfer failed (SS, async: raised once); SS: the parameters may
                hold part of a version (a transfer into them failed part-way), until the next
                update reached them.
        """
        self._connected("poll_requests")
        if not self.mode.lands_in_staging:
            report = self.wait()  # (SS: the streaming rounds; sync: a re-send after a loss)
            self._check_whole()
            return None if report is None else InstallReport(
                version=report.version, install_s=0.0, verify_s=report.verify_s,
                num_params=report.num_params, mismatched=report.mismatched)
        if self.mode.sends_staged_copy:
            self._streaming.raise_failure()  # (async: the rounds stream on; not waited for)
        else:
            self._streaming.join(self._deadline())  # (RS: a re-send after a loss)
        with self._book_lock:
            # The leader's ledger says what landed where (a newer landing may have overwritten
            # a version never installed: superseded); every live engine lands every version.
            # An engine that joined since holds the held version in its parameters (its
            # catch-up did not land in staging): no claim, and nothing newer to install.
            claims = {e: self.leader.claim(e) for e in self.leader.live_engines()}
            versions = {c[0] for c in claims.values() if c is not None}
            assert len(versions) <= 1, claims
            version = versions.pop() if versions else None
            if version is None or version <= self.book.held_version:
                return None
            assert None not in claims.values(), claims  # (every live engine lands each one)
        t0 = time.perf_counter()
        live = self.leader.live_rollouts()
        size = self.control.engine_size
        answers = self.control.call_each(live, PeerCall.INSTALL,
                                         [(claims[w.index // size][1], version) for w in live],
                                         return_errors=True)
        t1 = time.perf_counter()
        with self._book_lock:
            holds = self.book.installed(version)
        failed = [(w, a) for w, a in zip(live, answers) if isinstance(a, BaseException)]
        loss = self._fence_install(version, failed) if failed else None
        count, bad = self._verify(self._live("rollout"), holds)
        report = InstallReport(version=version, install_s=t1 - t0,
                               verify_s=time.perf_counter() - t1, num_params=count,
                               mismatched=bad)
        if bad:
            raise TransferFailed(f"{report.line()}: {list(bad[:4])}")
        if loss is not None:
            raise loss.lost(f"The other engines installed version {version} ({report.line()}): "
                            f"go on with them.")
        return report

    def _fence_install(self, version: int, failed: list) -> Loss:
        """Workers that did not install ``version`` (stalled past the peer timeout, dead):
        their engines' other ranks did, so each may run two versions. Leave them out
        (`weightbridge.coordination.loss.lose`: their workers told why, their polls raise;
        the others planned again); the `Loss`, raised once the others are verified.

        Raises:
            TransferFailed: no engine is left.
        """
        cause = (f"{one_line(describe(failed[0][1]))}; so it did not install version "
                 f"{version} and its engine, whose other ranks did, may run two versions")
        loss = lose(self.leader, [w.index for w, _ in failed], [],
                    during=f"the install of version {version}", cause=cause,
                    rejoin="add_engine()", restart=RESTART)
        self._use()
        return loss

    def _check_whole(self) -> None:
        """SS: a transfer into the parameters that failed part-way left them holding no whole
        version (`VersionBook.torn`); every poll raises until the next update reached them,
        as the adapters' polls do.

        Raises:
            TransferFailed: the live engines' parameters may hold part of a version.
        """
        with self._book_lock:
            version = self.book.partial
        if version is not None:
            raise TransferFailed(
                f"the live engines' parameters may hold part of version {version} (its "
                f"transfer into them failed part-way, raised once as WorkersLost): run no "
                f"generation step on them until the next update() reached them (it carries "
                f"every tensor); call update() with the next version")

    def _deadline(self) -> float:
        """The longest a transfer may take (the rounds and a recovery), for waits on it."""
        rounds = self.plan.num_rounds if self.plan is not None else 0
        return 2 * self.config.timeout_s * (rounds + 2)

    def _report(self, version: int, train_step_s: float, t1: float, *,
                moved: bool = True) -> UpdateReport:
        """Spans and verification of the update that just ended, on the live workers
        (verified where the parameters hold it: not with receiver staging)."""
        t2 = time.perf_counter()
        live = {side: self._live(side) for side in ("trainer", "rollout")}
        span_f = [(side, first, mesh.timings.call()) for side, runs in live.items()
                  for first, mesh in runs]
        installed = not self.mode.lands_in_staging or not moved
        holds = self.book.holds
        check_f = ([mesh.checksums.call(holds) for _, mesh in live["rollout"]]
                   if installed else [])
        spans = {(side, first + p.rank): s for side, first, f in span_f
                 for p, s in f.get().items()}
        count, bad = self._verify(live["rollout"], holds, check_f) if installed else (0, ())
        t3 = time.perf_counter()
        sent = self.plan.stage_bytes().sent
        return UpdateReport(version=version, train_step_s=train_step_s, transfer_s=t2 - t1,
                            verify_s=t3 - t2, rdma_bytes=int(sent.sum()) if moved else 0,
                            num_params=count, mismatched=bad,
                            timing=update_timing(spans, self._dests) if moved else None,
                            ideal_s=self.ideal_s, stall_s=t2 - t1,
                            state="installed" if installed else "landed")

    def _verify(self, runs, versions, futures=None, side: str = "rollout"
                ) -> tuple[int, tuple[str, ...]]:
        """(parameters compared, mismatches) of the workers in ``runs`` ((first rank, actor
        mesh) pairs) against their own load_weights of ``versions``."""
        futures = futures or [mesh.checksums.call(versions) for _, mesh in runs]
        results = [r for f in futures for r in by_rank(f.get())]
        ranks = [first + i for first, mesh in runs for i in range(int(mesh.size()))]
        return mismatches(results, ranks, side)

    def _transfer(self, version: int, slots: dict | None = None, *,
                  first_round: int = 0) -> None:
        """Every round of one update (from ``first_round``); returns once every rollout landed
        its last round (into ``slots``: engine -> staging slot, or the parameters).

        Raises:
            Lost: some worker does not answer any more (`Membership.recover` handles it).
            TransferFailed: some worker failed or never finished and every worker answers.
        """
        group = self.leader.group
        # Each write is bounded by the peer timeout on the workers and Monarch reports a dead
        # proc; this is the backstop for a step that neither finishes nor fails.
        deadline = self.config.timeout_s * (self.plan.num_rounds - first_round + 2)
        try:
            run_update(self.control, group, slots=slots, deadline_s=deadline, version=version,
                       first_round=first_round)
        except (StepFailed, asyncio.TimeoutError) as e:
            what = str(e) or f"did not finish within {deadline:g}s"
            lost = unanswered(self.control, list(group.live_trainers) + list(group.live_rollouts))
            if lost:
                raise Lost(lost, f"update {version} failed: {what}\n"
                                  f"{', '.join(str(w) for w in lost)} did not answer a ping "
                                  f"within {self.config.notice_timeout_s:g}s (dead or "
                                  f"stalled)") from e
            raise TransferFailed(
                f"update {version} failed: {what}\nevery worker still answers; the meshes are "
                f"in an unknown state: close this MeshTransfer and start again") from e
