"""The single controller: owns both meshes, plans centrally, drives every round of every update.

    controller                       trainer mesh (TrainerActor)      rollout mesh (RolloutActor)
    ----------                       ---------------------------      ---------------------------
    spawn procs + actors  ------->   shard from (model, spec, rank)   shard from (model, spec, rank)
    gather source maps    <-------   probe own load_weights           probe own load_weights
    correspond + plan_transfer (pure, here)
    scatter WorkerPlans   ------->   tables + 2 arenas                tables + 2 arenas, register
                          <---------------------------------------   incoming ranges -> handles
    hand out handles      ------->   set_peers                        set_peers
    per update:  train_step(v) -->   load checkpoint v
      per round r, each step issued the moment its inputs are done:
                 send(r)       -->   pack r, RDMA RECEIVE =========>  arena r%2
                 forward(r, EXTERNAL), then INTERNAL  ------------->  RDMA to peers' arena r%2
                 assemble(r)   ------------------------------------>  arena r%2 -> parameters
                 send(r + 2) once assemble(r) returned everywhere (arena r%2 free again)
      checksums(v)            <------------------------------------  live vs own load_weights(v)

Handles travel on the control plane (endpoint arguments); bytes only through RDMA writes. The
controller does not sequence in lockstep: a trainer runs its sends one at a time in the order
issued, so round r + 1's send already waits in the trainer's queue when round r's writes land;
the rollouts forward and assemble concurrently, round r's forwards beside round r + 1's RECEIVE
bytes. ``sequencing="dataflow"`` instead starts one ``run_update`` per actor and
lets the actors sequence the rounds with one-way peer notifications (`meshes/dataflow.py`).
Either way every wait is bounded and a failure becomes one `TransferError`.

Typical usage::

    with MeshTransfer(TrainerSpec.parse("nodes=1,gpus=4,tp=2,ep=2"),
                      RolloutSpec.parse("engines=2,nodes=1,gpus=2,tp=2"), "tiny") as mt:
        plan = mt.connect()
        report = mt.update(1)
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from monarch.actor import this_host

from controller.timing import UpdateTiming, update_timing, write_dests
from meshes.actors import WRITE_TIMEOUT_S, RolloutActor, TrainerActor
from meshes.dataflow import UpdateAborted, schedules
from meshes.qwen3_moe import SIZES
from meshes.spec import RolloutSpec, TrainerSpec
from weightbridge import LayoutError, Placement, Stage, TransferPlan, WorkerId, plan_transfer
from weightbridge.monarch_transport import backend, configure_transport, drop_all
from weightbridge.simulate import eq1

PROBE_BYTES = 8 << 20
"""Link probe write size: one 8 MB RDMA chunk."""
PROBE_REPEATS = 3
SEQUENCINGS = ("controller", "dataflow")
ERROR_GRACE_S = 15.0
"""After the first failure of an update, how long the controller keeps collecting the other
workers' errors (a dead proc is reported after about 10 s) before it raises."""


class _StepFailed(RuntimeError):
    """A controller-sequenced step failed on some worker; says which round and step."""


class TransferError(RuntimeError):
    """An update failed on some worker (a write timed out, a peer died or raised); the message
    names the failed step or workers and what happened."""


@dataclass(frozen=True, slots=True, kw_only=True)
class UpdateReport:
    """What one update did and how long it took (seconds, wall clock on the controller)."""

    version: int
    train_step_s: float
    """Trainers loading the new version (the stand-in optimizer step)."""
    transfer_s: float
    """First send to last assemble: the end-to-end weight transfer time."""
    verify_s: float
    rdma_bytes: int
    """Bytes written over RDMA in all stages."""
    num_params: int
    """Rollout parameters compared (over all rollout workers)."""
    mismatched: tuple[str, ...]
    """``rollout<i>:<param>`` of every parameter whose checksum differs from its loader's."""
    timing: UpdateTiming | None = None
    """Every worker's spans and stall windows (actor clocks; see controller/timing.py)."""
    ideal_s: float = 0.0
    """Eq. (1) from the link probe at connect."""

    def line(self) -> str:
        verdict = (f"all {self.num_params} rollout parameters bit-identical to their own "
                   f"load_weights(v{self.version})" if not self.mismatched else
                   f"MISMATCH in {len(self.mismatched)} of {self.num_params} parameters: "
                   f"{list(self.mismatched[:4])}")
        rate = self.rdma_bytes / self.transfer_s / 1e6 if self.transfer_s else 0.0
        return (f"update {self.version}: train_step {self.train_step_s:.3f}s  transfer "
                f"{self.transfer_s:.3f}s ({self.rdma_bytes / 1e6:.2f} MB over RDMA, "
                f"{rate:.0f} MB/s)  verify {self.verify_s:.3f}s  | {verdict}"
                + (f"\n  {self.timing_line()}" if self.timing is not None else ""))

    def timing_line(self) -> str:
        t = self.timing
        mean, peak = t.kernel_share()
        ratio = f"{t.ewtt_s / self.ideal_s:.2f}" if self.ideal_s > 0 else "n/a"
        return (f"EWTT {t.ewtt_s:.3f}s  AGST {t.agst_s:.3f}s  ideal {self.ideal_s:.4f}s  "
                f"EWTT/ideal {ratio}  pack+assemble {100 * mean:.1f}% of EWTT per worker "
                f"(busiest {100 * peak:.1f}%)")


class MeshTransfer:
    """Both meshes and the plan between them. A context manager: leaving it stops the meshes.

    Args:
        trainer, rollout: Mesh specs (validated against the model before anything spawns).
        model: A name in `meshes.qwen3_moe.SIZES`.

    Keyword Args:
        round_bytes: Round buffer capacity per worker.
        procs: (trainer procs, rollout procs) to spawn the actors on instead of spawning procs
            (each a one-dim mesh of the spec's worker count); they are then not stopped here.
        trainer_actor, rollout_actor: Actor classes (tests substitute faulty ones).
        link_rate: Bytes/s of every host link, when known (an emulated cluster's `tc` rate):
            Eq. (1) uses it and the link probe is skipped.
        reroute: A function applied to the plan before it is scattered (the P2P baseline in
            `controller.baselines` rewrites the forwarding stages this way).
        depth: Round arenas per worker (2, the paper's: round r + 2 is written into a peer
            only once round r was assembled there). 3 or more hide the control latency of that
            hand-over behind a round, at the cost of one more round buffer per worker: worth it
            where a control message costs a sizable part of a round (docs/performance.md).
        sequencing: ``"controller"`` (the controller issues every round's steps as their inputs
            complete) or ``"dataflow"`` (one ``run_update`` per actor per update; the actors
            sequence the rounds with peer ``landed`` / ``free`` notifications). Both move the
            same bytes; on Monarch's TCP fallback the controller's is faster (docs/performance.md).
        timeout_s: Bound of every wait in an update: one RDMA write, one peer's notification.
            A dead or stuck worker makes `update` raise `TransferError` within about this long
            (plus ``ERROR_GRACE_S``), never hang.
    """

    def __init__(self, trainer: TrainerSpec, rollout: RolloutSpec, model: str, *,
                 round_bytes: int = 256 << 10, procs=None, trainer_actor=TrainerActor,
                 rollout_actor=RolloutActor, link_rate: float | None = None, reroute=None,
                 depth: int = 2, timeout_s: float = WRITE_TIMEOUT_S,
                 sequencing: str = "controller"):
        if sequencing not in SEQUENCINGS:
            raise ValueError(f"sequencing must be one of {SEQUENCINGS}, got {sequencing!r}")
        if depth < 2:
            raise ValueError(f"depth must be >= 2 round arenas per worker, got {depth}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if model not in SIZES:
            raise ValueError(f"unknown model {model!r}; choose one of {sorted(SIZES)}")
        trainer.validate(SIZES[model])
        rollout.validate(SIZES[model])
        self.trainer_spec, self.rollout_spec, self.model = trainer, rollout, model
        self.round_bytes = round_bytes
        self._given_procs = procs
        self._actor_classes = (trainer_actor, rollout_actor)
        self._owned: list = []
        self._actors: list = []
        self.plan: TransferPlan | None = None
        self.spawn_s = 0.0
        self.num_handles = 0
        self._handles: dict = {}
        self.links: dict[str, float] = {}
        """Bytes/s of one RDMA write stream per probed link, measured at connect."""
        self.ideal_s = 0.0
        self.link_rate, self._reroute = link_rate, reroute
        self.timeout_s, self.depth, self.sequencing = float(timeout_s), depth, sequencing
        self._updates = 0

    @property
    def backend(self) -> str:
        """RDMA backend ("tcp" is Monarch's fallback where there is no RDMA NIC)."""
        return backend()

    # -- lifetime -------------------------------------------------------------------------------

    def __enter__(self) -> "MeshTransfer":
        try:
            self._spawn()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _spawn(self) -> None:
        t0 = time.perf_counter()
        if self._given_procs is None:
            configure_transport()  # before spawning: children read the config at start-up
            host = this_host()
            tp = host.spawn_procs(per_host={"worker": self.trainer_spec.num_workers},
                                  name="trainer")
            self._owned.append(tp)
            rp = host.spawn_procs(per_host={"worker": self.rollout_spec.num_workers},
                                  name="rollout")
            self._owned.append(rp)
        else:
            tp, rp = self._given_procs
        trainer_cls, rollout_cls = self._actor_classes
        self.trainers = tp.spawn("trainer", trainer_cls, self.model, _text(self.trainer_spec))
        self._actors.append(self.trainers)
        self.rollouts = rp.spawn("rollout", rollout_cls, self.model, _text(self.rollout_spec))
        self._actors.append(self.rollouts)
        self.trainers.initialized.get()
        self.rollouts.initialized.get()  # actors built their shards (children imported torch)
        self.spawn_s = time.perf_counter() - t0

    def close(self) -> None:
        """Stop the actors, and the procs if this object spawned them. Safe to call twice."""
        errors = []
        if not self._owned and self._handles:
            # Procs outlive this object: deregister the arenas so the rollout procs free them.
            try:
                drop_all(self._handles)
            except Exception as e:  # keep stopping the actors; re-raised below
                errors.append(e)
        self._handles = {}
        meshes = self._owned if self._owned else self._actors
        for mesh in meshes:
            try:
                mesh.stop().get(timeout=60)
            except Exception as e:  # keep stopping the others; re-raised below
                errors.append(e)
        self._owned, self._actors = [], []
        if errors:
            raise RuntimeError(f"stopping the meshes failed: {errors}; look for leftover "
                               f"bootstrap_main processes with ps") from errors[0]

    # -- connect --------------------------------------------------------------------------------

    def connect(self) -> TransferPlan:
        """Probe, plan, scatter plans, register buffers, hand out handles. Moves no weights.

        Raises:
            LayoutError: the two meshes load different checkpoints (checked first, before any
                probe), or the rollouts need elements no trainer holds (raised by the planner);
                either way before any actor allocates a buffer.
        """
        tspecs_f = self.trainers.checkpoint_spec.call()
        rspecs_f = self.rollouts.checkpoint_spec.call()
        _check_same_checkpoint(_by_rank(tspecs_f.get()), _by_rank(rspecs_f.get()))
        tmaps_f = self.trainers.source_map.call()
        rmaps_f = self.rollouts.source_map.call()
        tmaps, rmaps = _by_rank(tmaps_f.get()), _by_rank(rmaps_f.get())
        # One planning node per host of the specs: workers [h * gpus, (h + 1) * gpus) share
        # host h (on this machine the hosts are names; attached meshes are laid out the same).
        per_engine = self.rollout_spec.workers_per_engine
        t_gpus, r_gpus = self.trainer_spec.gpus, self.rollout_spec.gpus
        self.plan = plan_transfer(
            [(m, Placement(f"trainer-h{i // t_gpus}")) for i, m in enumerate(tmaps)],
            [(m, Placement(f"rollout-h{i // r_gpus}", engine=i // per_engine))
             for i, m in enumerate(rmaps)],
            round_bytes=self.round_bytes)
        if self._reroute is not None:
            self.plan = self._reroute(self.plan)
        plans = {w: self.plan.for_worker(w) for w in self.plan.workers}
        ranges = _incoming_ranges(plans.values(), self.depth)
        futures = [self.trainers.slice(worker=w.index).connect.call_one(plans[w], self.depth)
                   for w in self.plan.workers if w.side == "trainer"]
        rollouts = [w for w in self.plan.workers if w.side == "rollout"]
        handle_f = [self.rollouts.slice(worker=w.index).connect.call_one(
            plans[w], sorted(ranges.get(w, ())), self.depth) for w in rollouts]
        for f in futures:
            f.get()
        handles = {(w, key): h for w, f in zip(rollouts, handle_f) for key, h in f.get().items()}
        self.num_handles, self._handles = len(handles), handles
        scheds = self._schedules = schedules(plans.values(), self.depth)
        futures = []
        for w, p in plans.items():
            mesh = self.trainers if w.side == "trainer" else self.rollouts
            mine = {(wr.peer, (r.index % self.depth, wr.peer_offset, wr.nbytes))
                    for r in p.rounds for wr in r.writes}
            futures.append(mesh.slice(worker=w.index).set_peers.call_one(
                {k: handles[k] for k in mine}, scheds[w], self.trainers, self.rollouts,
                self.timeout_s))
        for f in futures:
            f.get()
        self._dests = write_dests(plans.values())
        self._active = _active_steps(plans.values())
        self.links = ({"configured": self.link_rate} if self.link_rate else
                      self._probe_links())
        egress = self.link_rate or self.links["trainer->rollout"]
        self.ideal_s = eq1(self.plan, trainer_node_bandwidth=egress,
                           rollout_node_bandwidth=self.link_rate or self.links.get(
                               "rollout->rollout", egress))
        return self.plan

    def _probe_links(self) -> dict[str, float]:
        """Write PROBE_BYTES into rollout 0 from trainer 0 and from a rollout of another engine
        (or the same engine if there is one), best of PROBE_REPEATS each: one stream per link."""
        handle = self.rollouts.slice(worker=0).probe_buffer.call_one(PROBE_BYTES).get()
        writers = {"trainer->rollout": self.trainers.slice(worker=0)}
        spec = self.rollout_spec
        peer = spec.workers_per_engine if spec.engines > 1 else 1
        if peer < spec.num_workers:
            writers["rollout->rollout"] = self.rollouts.slice(worker=peer)
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

    def update(self, version: int) -> UpdateReport:
        """Train step, transfer every round, verify every rollout parameter by checksum.

        Raises:
            TransferError: a worker failed, died or stalled during the transfer.
        """
        if self.plan is None:
            raise RuntimeError("call connect() before update()")
        t0 = time.perf_counter()
        self.trainers.train_step.call(version).get()
        t1 = time.perf_counter()
        self._transfer(version)
        t2 = time.perf_counter()
        span_f = [(side, mesh.timings.call()) for side, mesh in
                  (("trainer", self.trainers), ("rollout", self.rollouts))]
        check_f = self.rollouts.checksums.call(version)
        spans = {(side, p.rank): s for side, f in span_f for p, s in f.get().items()}
        results = _by_rank(check_f.get())
        t3 = time.perf_counter()
        bad, count = [], 0
        for i, (got, want) in enumerate(results):
            count += len(want)
            bad += [f"rollout{i}:{n}" for n in want if got.get(n) != want[n]]
        sent, _ = self.plan.stage_bytes()
        return UpdateReport(version=version, train_step_s=t1 - t0, transfer_s=t2 - t1,
                            verify_s=t3 - t2, rdma_bytes=int(sent.sum()), num_params=count,
                            mismatched=tuple(bad), timing=update_timing(spans, self._dests),
                            ideal_s=self.ideal_s)

    async def _sequence_rounds(self) -> None:
        """Controller-sequenced rounds: every step of every round is issued as soon as its inputs
        are done, not in lockstep.

        Per round r: ``send(r)`` (trainers pack and write RECEIVE into arena r % depth) once
        round r - depth was assembled everywhere (its arena is free again); then the rollouts'
        EXTERNAL, then INTERNAL forwards, then ``assemble(r)``. Trainers run their sends one at a
        time in the order issued, so round r + 1's send waits in the trainer's queue while round
        r's writes are on the link and starts the moment they landed, if its arena was free by
        then: with depth 2 that takes round r - 1's forwards and assemble plus three controller
        round trips, which a third arena hides. Rollouts forward and assemble concurrently,
        round r's forwards beside round r + 1's RECEIVE bytes.
        """
        depth, active = self.depth, self._active
        rounds: list[asyncio.Future] = []

        async def step(r: int, what: str, call) -> None:
            try:
                await call
            except Exception as e:
                cause = getattr(e, "exception", None) or e
                text = " ".join(f"{type(cause).__name__}: {cause}".split())
                raise _StepFailed(f"round {r}, {what}: {text[:600]}") from e

        async def run(r: int) -> None:
            if r >= depth:
                await rounds[r - depth]
            if (r, Stage.RECEIVE) in active:
                await step(r, "trainers' send", self.trainers.send.call(r))
            for stage in (Stage.EXTERNAL, Stage.INTERNAL):
                if (r, stage) in active:
                    await step(r, f"rollouts' {stage.value} forward",
                               self.rollouts.forward.call(r, stage))
            if (r, "assemble") in active:
                await step(r, "rollouts' assemble", self.rollouts.assemble.call(r))

        rounds.extend(asyncio.ensure_future(run(r)) for r in range(self.plan.num_rounds))
        try:
            await asyncio.gather(*rounds)
        finally:
            for task in rounds:
                task.cancel()

    def _transfer(self, version: int) -> None:
        """Every round of one update; returns once every rollout assembled its last round.

        Raises:
            TransferError: some worker failed, died or never finished (bounded wait).
        """
        if self.sequencing == "controller":
            # Each write is bounded by timeout_s on the actors and Monarch reports a dead proc;
            # this is the backstop for a step that neither finishes nor fails.
            deadline = self.timeout_s * (self.plan.num_rounds + 2)
            try:
                asyncio.run(asyncio.wait_for(self._sequence_rounds(), deadline))
            except (_StepFailed, asyncio.TimeoutError) as e:
                what = str(e) or f"did not finish within {deadline:g}s"
                raise TransferError(
                    f"update {version} failed: {what}\nthe meshes are in an unknown state: "
                    f"close this MeshTransfer and start again") from e
            return
        self._updates += 1
        update = self._updates
        # Rollouts first: they only wait for inputs, and the trainers' first writes should
        # find them ready.
        order = sorted(self.plan.workers, key=lambda w: w.side == "trainer")
        calls = {w: (self.trainers if w.side == "trainer" else self.rollouts).slice(
            worker=w.index).run_update.call_one(update) for w in order}
        # Each actor bounds each of its waits by timeout_s; this is the backstop for an actor
        # that neither finishes nor fails (a round can wait twice: inputs, then credits).
        deadline = self.timeout_s * (2 * self.plan.num_rounds + 2)
        errors = asyncio.run(_wait_all(calls, deadline))
        if errors:
            raise TransferError(_failure_message(version, errors, len(calls)))


def _by_rank(values) -> list:
    return [v for _, v in sorted(values.items(), key=lambda kv: kv[0].rank)]


def _check_same_checkpoint(trainer_specs: list, rollout_specs: list) -> None:
    """Every worker must read the same checkpoint: source-map regions are coordinates in it.

    Without this, a trainer of a bigger vocabulary (say) would hold every row a rollout needs,
    and the plan would silently move rows of a tensor the rollout does not have.
    """
    want = trainer_specs[0]
    for side, specs in (("trainer", trainer_specs), ("rollout", rollout_specs)):
        for i, spec in enumerate(specs):
            diff = want.differences(spec, ("trainer 0", f"{side} {i}"))
            if diff:
                more = f" and {len(diff) - 4} more" if len(diff) > 4 else ""
                raise LayoutError(
                    f"trainer worker 0 and {side} worker {i} load different checkpoints: "
                    f"{len(diff)} tensors differ: {'; '.join(diff[:4])}{more}. Both meshes must "
                    f"load the same checkpoint: build both sides from the same model config")


def _active_steps(plans) -> set:
    """(round, stage) pairs with at least one write, and (round, "assemble") with any copy."""
    active = set()
    for p in plans:
        for r in p.rounds:
            active |= {(r.index, w.stage) for w in r.writes}
            if r.assemble:
                active.add((r.index, "assemble"))
    return active


def _incoming_ranges(plans, depth: int) -> dict[WorkerId, set[tuple[int, int, int]]]:
    """Per receiver, every distinct (arena r % depth, offset, nbytes) some peer writes into."""
    out: dict[WorkerId, set] = {}
    for plan in plans:
        for rnd in plan.rounds:
            for w in rnd.writes:
                out.setdefault(w.peer, set()).add((rnd.index % depth, w.peer_offset, w.nbytes))
    return out


async def _wait_all(calls: dict, deadline_s: float) -> dict:
    """Await every call; {worker: exception} of those that failed or did not finish in time.

    After the first failure the others get ERROR_GRACE_S to report theirs (peers of a failed
    worker abort at once; a dead proc is reported by Monarch after about 10 s).
    """
    tasks = {asyncio.ensure_future(_result(f)): w for w, f in calls.items()}
    done, pending = await asyncio.wait(tasks, timeout=deadline_s,
                                       return_when=asyncio.FIRST_EXCEPTION)
    failed = any(t.exception() is not None for t in done)
    if failed and pending:
        more, pending = await asyncio.wait(pending, timeout=ERROR_GRACE_S)
        done |= more
    errors = {tasks[t]: t.exception() for t in done if t.exception() is not None}
    for t in pending:
        t.cancel()
        errors[tasks[t]] = TimeoutError(
            f"did not finish within {ERROR_GRACE_S if failed else deadline_s:g}s")
    return errors


async def _result(future):
    return await future


def _failure_message(version: int, errors: dict, num_workers: int) -> str:
    """The root causes first (workers that failed themselves), then who was aborted."""
    def cause(e: BaseException) -> BaseException:
        return getattr(e, "exception", None) or e

    def name(w: WorkerId) -> str:
        return f"{w.side} {w.index}"

    roots = {w: e for w, e in errors.items() if not isinstance(cause(e), UpdateAborted)}
    aborted = sorted((w for w in errors if w not in roots), key=lambda w: (w.side, w.index))
    lines = [f"update {version} failed on {len(errors)} of {num_workers} workers:"]
    for w in sorted(roots, key=lambda w: (w.side, w.index)):
        c = cause(roots[w])
        text = " ".join(f"{type(c).__name__}: {c}".split())
        lines.append(f"  {name(w)}: {text[:600]}")
    if aborted:
        lines.append(f"  aborted after that failure: {', '.join(name(w) for w in aborted)}")
    lines.append("the meshes are in an unknown state: close this MeshTransfer and start again")
    return "\n".join(lines)


def _text(spec) -> str:
    return ",".join(f"{f}={getattr(spec, f)}" for f in spec.__slots__)
