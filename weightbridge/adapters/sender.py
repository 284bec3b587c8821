"""`SenderAdapter`: a trainer worker's `connect` and `send_weights`; rank 0 sequences transfers.

See `weightbridge.adapters` for the whole picture and docs/integration.md for the
user's view.
"""

from __future__ import annotations

import threading


from weightbridge.config import WAIT_TIMEOUTS, TransferConfig
from weightbridge.adapters.base import AdapterWorker
from weightbridge.coordination.control import PeerCall, rollouts, trainers
from weightbridge.adapters.protocol import SenderStage, TrainerVersions
from weightbridge.coordination.version import check_version
from weightbridge.adapters.rank0 import TRAINER_0, GroupSequencer
from weightbridge.adapters.sender_delta import TrainerDelta
from weightbridge.adapters.sender_membership import TrainerMembership, call_name
from weightbridge.errors import TransferFailed, from_kind
from weightbridge.execution.boxcopy import CopyKernels
from weightbridge.types import Placement, WorkerId


class SenderAdapter(AdapterWorker):
    """A trainer worker's side: `connect` once, `send_weights(version)` after each step (a
    delta with ``changed``: ``changes``, `sender_delta`); `add_engines` / `remove_engine`
    between steps (``membership``, `sender_membership`). Trainer 0 sequences the group: its
    `GroupSequencer` (``rank0``, `weightbridge.adapters.rank0`) holds the group's state
    and runs every transfer."""

    side = "trainer"

    def __init__(self, params, load_weights, spec, *, rank: int, control, transport,
                 config: TransferConfig = TransferConfig(), placement: Placement | None = None,
                 kernels: CopyKernels | None = None):
        super().__init__(params, load_weights, spec, rank=rank,
                         placement=placement or Placement("trainer"), control=control,
                         transport=transport, config=config, kernels=kernels)
        self.stage = SenderStage()
        self.changes = TrainerDelta(self.params, spec, config, self.digest)
        """This trainer's side of delta updates (``changed=``)."""
        self.versions = TrainerVersions()
        """This trainer's versions as trainer 0 moves them (the live half; ``stage``: the
        staged half)."""
        self._calling: int | None = None  # the version of the send_weights call running now
        self._connected = threading.Event()
        self._connect_error: str | None = None
        self._planning = False  # rank 0, inside connect's probe and plan
        # Used on trainer 0 only: the group's sequencing and state.
        self.rank0 = GroupSequencer(self.worker, control, config,
                                    done=lambda: self.versions.done, pending=self.on_pending)
        self._broken: str | None = None
        """Why this trainer can send no more (trainer 0 lost; trainer 0: `rank0.broken`)."""
        self.membership = TrainerMembership(self.cond, config.timeout_s)
        # The mode, chosen once: where send_weights takes the version from and who releases
        # the parameters (SS, async: the staged copy, released once copied; sync, RS: the live
        # parameters, released when trainer 0 says the transfer finished).
        self._send, self._release = (
            (self._send_staged, _nothing) if config.mode.sends_staged_copy else
            (self._send_live, lambda v: self._log(("released", v))))

    # -- rank 0's view of the group (held by its `GroupLeader`) ---------------------------------

    @property
    def leader(self):
        """Trainer 0: the `GroupLeader`, the one owner of the group's state."""
        return self.rank0.leader

    @property
    def plan(self):
        """Rank 0, once connected: the `TransferPlan` in force (its ``summary()`` is the byte
        accounting); replaced by every re-plan."""
        return self.leader.plan

    @property
    def group(self):
        return self.leader.group

    @property
    def failed_engines(self) -> set[int]:
        """Rank 0: the engines out of the group (lost, removed, refused at a join)."""
        return self.leader.out_engines

    @property
    def failed_trainers(self) -> set[int]:
        """Rank 0: trainers lost mid-transfer; their replicas send what they held."""
        return self.leader.out_trainers

    # -- the user's calls -----------------------------------------------------------------------

    def connect(self) -> None:
        """Collective over the trainers: probe every worker, plan on rank 0, build executors.

        Rank 0 gathers every source map through the control plane, plans, and hands each worker
        its plan; the others wait for their plan. Moves no weights. The probe overwrites
        every worker's parameters: by default a trainer loads its weights after this returns
        (`TransferConfig.trainer_restore`; its first `send_weights` checks).
        """
        if self.worker.index == 0:
            self._planning = True
            try:
                self.leader.connect()
            except Exception as e:
                # The other trainers wait for a plan: tell them now rather than at timeout.
                self.control.call(trainers(self.control)[1:], PeerCall.CONNECT_FAILED,
                                  f"{type(e).__name__}: {e}", return_errors=True)
                raise
            finally:
                self._planning = False
        # Probing and planning grow with the model and may outlast timeout_s: wait on while
        # trainer 0 says it is still at it (a dead or absent trainer 0 ends the wait).
        while not self._connected.wait(self.config.timeout_s):
            try:
                planning = self._call_one(TRAINER_0, PeerCall.PLANNING)
            except Exception as e:  # noqa: BLE001  (reported below)
                planning = f"{type(e).__name__}: {e}"
            if planning is not True:
                why = "" if planning is False else f" (it did not answer: {planning})"
                raise TimeoutError(f"{self.worker}: no plan from trainer 0 within timeout_s and "
                                   f"trainer 0 is not probing or planning{why}; every trainer "
                                   f"must call connect()")
        if self._connect_error is not None:
            raise RuntimeError(f"{self.worker}: trainer 0's connect failed, so this group has "
                               f"no plan: {self._connect_error}")

    def send_weights(self, version: int, changed=None) -> None:
        """Collective over the trainers: move ``version`` (the weights in the parameters now).

        ``changed`` (sync and RS modes; `sender_delta`): a delta update. The checkpoint tensors
        whose values changed since this trainer's previous send_weights, the same on every
        trainer, or "auto" (each trainer compares per-parameter checksums with its previous
        call's); only what the rollouts lack moves, and they end bit-identical to a full
        update. None (default): a full update; the first one must be.

        Returns when (see `Mode.trainer_returns_when`): SS and async, once this trainer's bytes
        are copied to host staging; RS, once they landed in the rollouts' staging; sync, once
        every rollout installed them.

        Raises:
            ValueError: a version not newer than the last one sent; a ``changed`` that is not
                supported in this mode, names unknown tensors, comes before any full update, or
                differs between trainers (before any byte moves).
            ValueError: (the first send after connect) parameters that still hold the NaN
                the probe left: the weights were not loaded after connect
                (`TransferConfig.trainer_restore`; before any byte moves).
            ParameterRebound: a parameter of this trainer no longer uses the storage it was
                registered with (``p.data = new``; before any byte moves).
            TimeoutError: (sync) rollouts that do not poll within ``timeout_s``.
            TransferFailed: a rollout worker was lost during this transfer (sync, RS; on every
                trainer) or an earlier one (SS, async; on rank 0, after this version was
                staged: it still goes to the surviving engines). See docs/failures.md.
        """
        version = check_version(version)
        if self.executor is None:
            raise RuntimeError("call connect() before send_weights()")
        self.check_sendable()  # (the copy tables read the storage registered)
        with self.cond:
            if self._calling is not None:
                raise RuntimeError(
                    f"{self.worker}: send_weights({version}) while send_weights("
                    f"{self._calling}) is still running on this trainer in another thread; "
                    f"send_weights is called once per update, from one thread: wait for the "
                    f"running call to return first")
            self._calling = version
        try:
            self._send_weights(version, changed)
        finally:
            with self.cond:
                self._calling = None

    def _send_weights(self, version: int, changed) -> None:
        broken = self._broken or self.rank0.broken
        if broken is not None:
            raise TransferFailed(broken)
        self._send(version, self.changes.check(changed))

    def _send_staged(self, version: int, checked) -> None:
        """SS, async: copy into the staging buffer and return; trainer 0's drain sends it."""
        self._stage(version)
        with self.cond:
            self.changes.staged(version)
        if self.worker.index == 0:
            self.rank0.kick()
        self._log(("resume", version))
        self.rank0.raise_background_error()

    def _send_live(self, version: int, checked) -> None:
        """Sync, RS: wait inside until trainer 0 moved ``version`` out of the parameters."""
        with self.cond:
            self.versions.enter(version)
            self.changes.begin(version, checked, self.source_map)
            self._log(("ready", version))
            self.cond.notify_all()
        try:
            if self.worker.index == 0:
                self.rank0.run(version)
            # Rank 0 needs up to timeout_s to find a lost rollout, then re-plans and re-sends.
            self._await_rank0(lambda: (self.versions.outcome(version) is not None
                                       or self._broken is not None),
                              f"the transfer of version {version} did not finish")
            with self.cond:
                if self._broken is not None and self.versions.outcome(version) is None:
                    raise TransferFailed(f"{self.worker}: {self._broken}")
                kind, message, lost = self.versions.outcome(version)
                if kind != "done":
                    raise from_kind(kind, message, lost)
        finally:
            with self.cond:
                self.versions.leave()
        self._log(("resume", version))

    def _await_rank0(self, predicate, what: str) -> None:
        """Wait on ``self.cond`` for ``predicate`` (made true by trainer 0), at most
        ``config.wait_s``; every timeout_s, check that trainer 0 still answers. A lost trainer 0
        breaks the group: every rollout is told (their polls raise) and `TransferFailed`
        is raised here."""
        for _ in range(WAIT_TIMEOUTS):
            with self.cond:
                if self.cond.wait_for(predicate, timeout=self.config.timeout_s):
                    return
            self._check_rank0(what)
        raise TimeoutError(f"{self.worker}: {what} within {WAIT_TIMEOUTS} x timeout_s="
                           f"{self.config.timeout_s}s; trainer 0 answers, but is it still "
                           f"running the same calls (every trainer must make them)?")

    def _check_rank0(self, what: str) -> None:
        """Raise `TransferFailed` (every rollout told first) when trainer 0 does not answer."""
        if self.worker.index == 0:
            return
        try:
            if self._call_one(TRAINER_0, PeerCall.PING) is True:
                return
            error = "it did not answer a ping"
        except Exception as e:  # noqa: BLE001  (reported below)
            error = f"{type(e).__name__}: {e}"
        self._broken = (f"trainer 0, which sequences this transfer group, is lost ({error}): "
                        f"{what}. No version can reach the rollouts any more (their polls "
                        f"raise); build a new group (new adapters on every worker, "
                        f"connect()) to go on")
        self.control.call(rollouts(self.control), PeerCall.FAIL, self._broken,
                          return_errors=True)
        raise TransferFailed(f"{self.worker}: {self._broken}")

    def add_engines(self, group=None) -> None:
        """Collective over the trainers, between `send_weights` calls: plan in the rollout
        engines added to the group since connect (or the last join) and go on with them.

        ``group``: the grown `TransferGroup` that `TransferGroup.add_engines` returned (on
        meshes; the joining engines' actors build their receivers with it); None with a
        control plane that grows by itself (`LocalControl`). Only the new engines are
        probed; the engines already in keep their tables and buffers. The new engines'
        first `poll_requests` returns the next version sent, whole.

        Raises:
            ValueError: no engine was added, or a joining worker is in the wrong engine.
            LayoutError: a joining engine reads another checkpoint or needs what no trainer
                holds (before any of its buffers exist; the group goes on without it).
            WorkersLost: a joining worker died or stalled in its set-up, or a worker of the
                group was lost during the join: they are out, the group goes on.
            Every trainer raises the same class (the others' message says trainer 0 told them).
        """
        self._change(("add",), lambda: self._join(group), group)

    def remove_engine(self, engine: int) -> None:
        """Collective over the trainers, between `send_weights` calls: take rollout engine
        ``engine`` out of the group (to retire or restart it). No byte is sent to or through
        it afterwards; its workers' `poll_requests` raise `TransferFailed` saying it was
        removed. An engine nothing depends on (mirrored in by a join) just loses its rows:
        only the rollouts that forwarded to it take new writes. Otherwise the others are
        re-planned from the kept source maps (no probe); they keep the whole version they hold
        (a version landed in their staging but not installed yet is superseded by the next
        one).

        Raises:
            ValueError: no such engine, it is out already, or it is the last one.
            WorkersLost: a worker was lost during the change (it is out; what was made is
                said). Every trainer raises the same class.
        """
        self._change(("remove", engine), lambda: self._leave(engine))

    def _change(self, what: tuple, change, group=None) -> None:
        if self.executor is None:
            raise RuntimeError("call connect() before add_engines() or remove_engine()")
        use = getattr(self.control, "use", None)
        if group is not None and use is not None:
            use(group)  # (this trainer's calls go to the grown group too)
        def lead() -> None:  # trainer 0: make the change once every trainer is in
            self.rank0.change(what, change, call_name(what))
        self.membership.run(self.worker, what, lead if self.worker.index == 0 else None)

    def _join(self, group) -> None:
        self.leader.join()
        self.leader.joined_at = self.versions.done  # (delta updates: the new engines hold nothing)

    def _leave(self, engine: int) -> None:
        self.leader.leave(engine)

    # -- staging (SS) ---------------------------------------------------------------------------

    def _stage(self, version: int) -> None:
        what = "the previous transfer did not release the staging buffer"
        try:
            with self.cond:
                self._wait(lambda: not self.stage.busy, what)
                self._stage_locked(version)
        except TimeoutError:
            self._check_rank0(what)  # (a lost trainer 0 never releases it)
            raise

    def _stage_locked(self, version: int) -> None:
        """Copy the parameters into the staging buffer (``self.cond`` held, buffer free)."""
        self.take_staged(version)  # (and its digest: what replicas compare)
        self.stage.stage(version)
        self._log(("staged", version))
        # Released: logged under the lock the sequencer reads `pending` with, so before any
        # transfer of this version starts.
        self._log(("released", version))
        self.cond.notify_all()

    def wait_idle(self) -> None:
        """Rank 0, SS modes: wait until every staged version was transferred (end of a run)."""
        self.rank0.wait_idle()

    # -- the transfer (rank 0) ------------------------------------------------------------------

    # -- called by rank 0 (endpoints on a mesh) -------------------------------------------------

    def on_planning(self) -> bool:
        return self._planning

    def on_connect_failed(self, message: str) -> None:
        self._connect_error = message
        self._connected.set()

    def _setup(self, plan) -> None:
        super()._setup(plan)  # (the staged copy is laid out anew)
        self.stage.drop()  # (so no transfer reads a version staged for the old plan)

    def on_set_peers(self, handles: dict, addresses: dict | None = None) -> None:
        super().on_set_peers(handles, addresses)
        self._connected.set()

    def on_ready(self) -> int | None:
        """The version this trainer waits inside send_weights with (None: not inside it, or
        only still leaving a call whose version trainer 0 already finished or failed: trainer
        0 may ask for the next version before this thread ran again)."""
        with self.cond:
            return self.versions.waiting()

    def on_pending(self) -> int | None:
        with self.cond:
            return self.stage.pending

    def on_stage_start(self, version: int) -> bool:
        """Pin the staging buffer if it holds ``version`` (False: it moved on)."""
        with self.cond:
            if self.stage.pending != version:
                return False
            self.stage.start()
            return True

    def on_stage_cancel(self) -> None:
        with self.cond:
            self.stage.cancel()
            self.cond.notify_all()

    def on_stage_finish(self) -> None:
        with self.cond:
            self.stage.finish()
            self.cond.notify_all()

    def on_failed(self, version: int, message: str, kind: str = "transfer",
                  lost: tuple | None = None) -> None:
        """Rank 0 could not move ``version``: send_weights raises what ``kind`` names in
        `weightbridge.errors.KINDS` (`WorkersLost` for lost workers, ``lost`` naming every
        engine and trainer out)."""
        with self.cond:
            self.versions.failed(version, kind, message, lost)
            self.cond.notify_all()

    def on_fail(self, message: str) -> None:
        """The group was closed (`TransferGroup.close` releases every worker with this): a
        send_weights waiting here, trainer 0's sequencing, and every later call raise
        `TransferFailed` saying ``message``."""
        with self.cond:
            self._broken = self._broken or message
            self.cond.notify_all()
        self.rank0.end(message)

    def on_transferred(self, version: int) -> None:
        self._release(version)
        with self.cond:
            self.versions.transferred(version)
            self.cond.notify_all()

    def on_delta(self):
        """What this trainer's waiting send_weights said changed (`TrainerDelta.pending`)."""
        with self.cond:
            return self.changes.pending

    def on_unchanged(self, version: int) -> tuple[str, ...]:
        return self.changes.unchanged(version)

    def on_changing(self) -> tuple | None:
        return self.membership.on_changing()

    def on_changed(self, what: tuple, failure: tuple | None) -> None:
        self.membership.on_changed(what, failure)

    def on_join(self, worker: WorkerId) -> None:
        self.rank0.on_join(worker)

    def on_leave(self, worker: WorkerId, why: str | None = None) -> bool | str:
        return self.rank0.on_leave(worker, why)

    def on_claim(self, engine: int):
        return self.rank0.on_claim(engine)

    def on_status(self, engine: int) -> str | None:
        return self.rank0.on_status(engine)


def _nothing(version: int) -> None:
    """SS, async: the parameters were released when they were staged."""
