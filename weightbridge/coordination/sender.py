"""`SenderAdapter`: a trainer worker's `connect` and `send_weights`; rank 0 sequences transfers.

See `weightbridge.coordination.adapters` for the whole picture and docs/integration.md for the
user's view.
"""

from __future__ import annotations

import contextvars
import threading
import time

import torch

from weightbridge.config import TransferConfig
from weightbridge.coordination.adapter_base import AdapterWorker, TransferFailed, host_buffer
from weightbridge.coordination.control import PeerCall, rollouts, trainers
from weightbridge.coordination.leader import GroupLeader
from weightbridge.coordination.protocol import SenderStage, check_version
from weightbridge.coordination.sender_delta import ChangedDuringSend, SenderDelta
from weightbridge.coordination.sender_membership import SenderMembership
from weightbridge.coordination.sender_recovery import SenderRecovery
from weightbridge.coordination.session import check_replicas, run_update
from weightbridge.coordination.worker import ReplicaMismatch, param_digest
from weightbridge.execution.boxcopy import CopyKernels
from weightbridge.types import Placement, Stage, WorkerId

TRAINER_0 = WorkerId("trainer", 0)


_FAILURES = {"input": ValueError, "timeout": TimeoutError, "transfer": TransferFailed,
             "replica": ReplicaMismatch}
"""What send_weights raises on a trainer that rank 0 tells of a failed version (`on_failed`)."""


class _Disagree(Exception):
    """Internal: a trainer is inside send_weights with another version."""


class SenderAdapter(SenderDelta, SenderMembership, SenderRecovery, AdapterWorker):
    """A trainer worker's side: `connect` once, `send_weights(version)` after each step (a
    delta with ``changed``: `sender_delta`); `add_engines` / `remove_engine` between steps
    (`sender_membership`)."""

    side = "trainer"

    def __init__(self, params, load_weights, spec, *, rank: int, control, transport,
                 config: TransferConfig = TransferConfig(), placement: Placement | None = None,
                 kernels: CopyKernels | None = None):
        super().__init__(params, load_weights, spec, rank=rank,
                         placement=placement or Placement("trainer"), control=control,
                         transport=transport, config=config, kernels=kernels)
        self.stage = SenderStage()
        self._staging: torch.Tensor | None = None
        self._staged_digest: tuple[int | None, tuple[int, ...]] = (None, ())
        """(version, per-parameter checksums) of the staged copy (SS): replicas compare it."""
        self._ready = 0  # non-SS: the newest version send_weights was called with
        self._sending: int | None = None  # non-SS: the version send_weights is waiting on now
        self._calling: int | None = None  # the version of the send_weights call running now
        self._done = 0  # newest version whose transfer finished
        self._connected = threading.Event()
        self._connect_error: str | None = None
        self._planning = False  # rank 0, inside connect's probe and plan
        # Rank 0 only: the group's state (`GroupLeader`) and the sequencing thread (SS).
        self.leader = GroupLeader(control, config)
        self._session_lock = threading.Lock()
        self._joined: set[WorkerId] = set()
        self._session_joined: set[WorkerId] = set()  # who had joined the running transfer
        self._thread: threading.Thread | None = None
        self._kick_lock = threading.Lock()
        self.error: BaseException | None = None
        # Rank 0 only: why the group can no longer send (None while it can).
        self._broken: str | None = None
        # Any rank: version -> the failure rank 0 reported for it (send_weights raises it).
        self._failures: dict[int, tuple[str, str]] = {}
        self._init_membership()

    # -- rank 0's view of the group (held by its `GroupLeader`) ---------------------------------

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
        its plan; the others wait for their plan. Moves no weights.
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

        ``changed`` (sync and RS modes; `SenderDelta`): a delta update. The checkpoint tensors
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
            TimeoutError: (sync) rollouts that do not poll within ``timeout_s``.
            TransferFailed: a rollout worker was lost during this transfer (sync, RS; on every
                trainer) or an earlier one (SS, async; on rank 0, after this version was
                staged: it still goes to the surviving engines). See docs/integration.md,
                "Failures".
        """
        version = check_version(version)
        if self.executor is None:
            raise RuntimeError("call connect() before send_weights()")
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
        if self._broken is not None:
            raise TransferFailed(self._broken)
        checked = self._delta_check(changed)
        if self.config.sender_staging:
            self._stage(version)
            if self.worker.index == 0:
                self._kick()
            self._log(("resume", version))
            self._raise_background_error()
            return
        with self.cond:
            if version <= max(self._ready, self._done):
                raise ValueError(f"send_weights(version={version}) after version "
                                 f"{max(self._ready, self._done)}: versions must increase")
            self._delta_begin(version, checked)
            self._ready = self._sending = version
            self._log(("ready", version))
            self.cond.notify_all()
        try:
            if self.worker.index == 0:
                self._run_session(version)
            # Rank 0 needs up to timeout_s to find a lost rollout, then re-plans and re-sends.
            self._await_rank0(lambda: self._done >= version or version in self._failures,
                              f"the transfer of version {version} did not finish")
            with self.cond:
                if version in self._failures:
                    kind, message = self._failures.pop(version)
                    raise _FAILURES.get(kind, TransferFailed)(message)
        finally:
            with self.cond:
                self._sending = None
        self._log(("resume", version))

    def _await_rank0(self, predicate, what: str) -> None:
        """Wait on ``self.cond`` for ``predicate`` (made true by trainer 0), at most 3 x
        timeout_s; every timeout_s, check that trainer 0 still answers. A lost trainer 0
        breaks the group: every rollout is told (their polls raise) and `TransferFailed`
        is raised here."""
        for _ in range(3):
            with self.cond:
                if self.cond.wait_for(predicate, timeout=self.config.timeout_s):
                    return
            self._check_rank0(what)
        raise TimeoutError(f"{self.worker}: {what} within 3 x timeout_s="
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
        if self._staging is None:
            self._staging = host_buffer(self._offsets[-1], self.executor.arenas[0])
        for r in range(self.executor.num_rounds):
            # Pack on the device into a round arena (free: with SS the transfer reads the
            # staging copy), then copy to host memory (D2H on GPUs).
            self.executor.pack(r)
            view = self._staged_view(self._staging, r)
            view.copy_(self.executor.arena(r)[:view.numel()])
        if self.config.checksums:  # what replicas compare: the parameters staged now
            self._staged_digest = (version, param_digest(self.params))
        self.stage.stage(version)
        self._log(("staged", version))
        # Released: logged under the lock the sequencer reads `pending` with, so before any
        # transfer of this version starts.
        self._log(("released", version))
        self.cond.notify_all()

    def _kick(self) -> None:
        with self._kick_lock:  # _drain clears _thread under the same lock: no lost wake-up
            if self._thread is None:
                # Run in a copy of this thread's context: an actor's messaging context lives
                # in contextvars, and calls on peers from the thread need it.
                ctx = contextvars.copy_context()
                self._thread = threading.Thread(target=ctx.run, args=(self._drain,),
                                                daemon=True, name="weightbridge-sender")
                self._thread.start()

    def _drain(self) -> None:
        """Rank 0's SS sequencer: transfer staged versions until none is pending.

        Without RS the rollouts must join first; the staging buffers stay free meanwhile, so a
        rollout that stops polling never blocks the trainers: they keep staging newer versions
        (each superseding the last) and the transfer carries the newest one once all joined.
        """
        try:
            while True:
                ts = self._live_trainers()
                with self._kick_lock:
                    first = self.on_pending()
                    if first is None:
                        self._thread = None
                        return
                if not self.config.receiver_staging:
                    self._gather(first, deadline=False)
                # Every trainer stages each version (a newer one supersedes an older one):
                # wait until they hold the same one.
                held: list = []

                def same() -> bool:
                    held[:] = self.control.call(ts, PeerCall.PENDING)
                    return len(set(held)) == 1

                self._poll_until(same, lambda: (
                    "the trainers hold different staged versions ("
                    + ", ".join(f"{t} holds version {v}" for t, v in zip(ts, held))
                    + "); every trainer must call send_weights with the same versions, so "
                      "nothing was sent"))
                version = self.on_pending()
                # Pin every staging buffer on that version; if one moved on meanwhile, retry.
                started = []
                for t in ts:
                    if not self._call_one(t, PeerCall.STAGE_START, version):
                        break
                    started.append(t)
                if len(started) < len(ts):
                    self.control.call(started, PeerCall.STAGE_CANCEL)
                    continue
                try:
                    self._run_session(version)
                finally:  # (a trainer lost in the session is not asked)
                    self.control.call(self._live_trainers(), PeerCall.STAGE_FINISH)
        except BaseException as e:  # surfaced by the next send_weights / wait_idle
            self.error = e
            with self._kick_lock:
                self._thread = None

    def _raise_background_error(self) -> None:
        if self.error is not None:
            e, self.error = self.error, None
            if isinstance(e, TransferFailed):
                raise e
            raise RuntimeError(f"{self.worker}: a background transfer failed: {e}") from e

    def wait_idle(self) -> None:
        """Rank 0, SS modes: wait until every staged version was transferred (end of a run)."""
        # A lost rollout takes up to timeout_s to find, then a re-plan: 3 x, as send_weights.
        end = time.monotonic() + 3 * self.config.timeout_s
        while self._thread is not None:
            if time.monotonic() > end:
                raise TimeoutError(f"{self.worker}: staged versions were not all transferred "
                                   f"within 3 x timeout_s={self.config.timeout_s}s")
            time.sleep(getattr(self.control, "poll_interval_s", self.poll_interval_s))
        self._raise_background_error()

    # -- the transfer (rank 0) ------------------------------------------------------------------

    def _live(self) -> list[WorkerId]:
        return self.leader.live_rollouts()

    def _live_trainers(self) -> list[WorkerId]:
        return self.leader.live_trainers()

    def _live_rank0s(self) -> list[WorkerId]:
        return self.leader.live_rank0s()

    def _gather(self, version: int, *, deadline: bool = True) -> None:
        """RS off: offer ``version`` to every engine and wait until every rollout joined."""
        self.control.call(self._live_rank0s(), PeerCall.OFFER, version)
        want = set(self._live())
        # The message is made at the timeout: it names the rollouts that had not polled then.
        self._poll_until(lambda: want <= self._joined, lambda: (
            f"rollout workers {sorted(str(w) for w in want - self._joined)} did not "
            f"poll_requests() for version {version}; in sync and SS modes every rollout must "
            f"poll between inference steps"), deadline=deadline)

    def _wait_for_trainers(self, ts: list[WorkerId], version: int) -> None:
        """Non-SS: wait until every trainer is inside send_weights(version). A trainer inside
        send_weights with another version fails the update on every trainer, before any
        byte moves: rollouts would otherwise install a mix of two versions under one label."""
        sending: list = []

        def same() -> bool:
            sending[:] = self.control.call(ts, PeerCall.READY)
            if any(v is not None and v != version for v in sending):
                raise _Disagree()
            return all(v == version for v in sending)

        try:
            self._poll_until(same, f"not every trainer called send_weights({version})")
        except _Disagree:
            calls = ", ".join(f"{t} send_weights({version if t == TRAINER_0 else v})"
                              for t, v in zip(ts, sending) if v is not None or t == TRAINER_0)
            message = (f"the trainers are sending different versions ({calls}); every "
                       f"trainer must call send_weights with the same version in each update. "
                       f"Nothing was sent: call send_weights again with one version on every "
                       f"trainer")
            waiting = [(t, v) for t, v in zip(ts, sending) if v is not None and t != TRAINER_0]
            self.control.call_each([t for t, _ in waiting], PeerCall.FAILED,
                                   [(v, message, "input") for _, v in waiting],
                                   return_errors=True)
            raise ValueError(f"{self.worker}: {message}") from None

    def _run_session(self, version: int, *, release: bool = True) -> None:
        """Move ``version`` end to end; every other worker's part is called on it.

        A failure is handed to `_on_failure`, which raises `TransferFailed` when a rollout
        worker was lost (after re-planning without its engine) and re-raises anything else.
        """
        with self._session_lock:
            moved = [False]
            try:
                self._session(version, moved, release)
            except TransferFailed:
                raise
            except ChangedDuringSend as e:  # (the rollouts were told when they must be)
                self._tell_trainers(version, str(e), "input")
                raise ValueError(f"{self.worker}: {e}") from None
            except Exception as e:  # noqa: BLE001  (classified, then raised again)
                self._on_failure(version, e, moved[0])

    def _session(self, version: int, moved: list, release: bool) -> None:
        control, mode = self.control, self.config.mode
        self.leader.retell()  # (excluded workers that stalled when told: again, off-thread)
        ts = self._live_trainers()
        if not mode.sender_staging:  # every trainer is inside send_weights(version)
            self._wait_for_trainers(ts, version)
            self._plan_delta(ts, version)  # the plan of the tensors the rollouts need
        check_replicas(control, self.group, version)  # (SS: each staged copy's digest)
        if mode.receiver_staging:
            slots = self.leader.begin_landing(version)
        else:
            slots = {}
            while True:  # a rollout may leave (its poll timed out) until the swap below
                self._gather(version, deadline=not mode.sender_staging)
                with self.cond:  # on_leave takes the same lock: out before, or in for good
                    if set(self._live()) <= self._joined:
                        self._session_joined, self._joined = self._joined, set()
                        break
        moved[0] = True
        run_update(control, self.group, slots=slots)  # the rounds, sequenced from here
        self._check_unchanged(ts, version)  # (an optimizer step overlapping the send)
        if mode.receiver_staging:
            self.leader.landed(version)
            if release:  # landed: the trainers go on before any install
                control.call(ts, PeerCall.TRANSFERRED, version)
            control.call(self._live_rank0s(), PeerCall.OFFER, version)
        else:
            control.call(list(self.group.live_rollouts), PeerCall.SESSION_DONE, version)
            if release:  # in every rollout's parameters
                control.call(ts, PeerCall.TRANSFERRED, version)

    # -- called by rank 0 (endpoints on a mesh) -------------------------------------------------

    def on_planning(self) -> bool:
        return self._planning

    def on_connect_failed(self, message: str) -> None:
        self._connect_error = message
        self._connected.set()

    def _setup(self, plan) -> None:
        super()._setup(plan)
        self._staging = None  # the old copy is laid out for the old plan

    def on_set_peers(self, handles: dict) -> None:
        super().on_set_peers(handles)
        self._connected.set()

    def on_digest(self, version: int) -> tuple[int, ...]:
        if not self.config.sender_staging:
            return super().on_digest(version)
        staged, digest = self._staged_digest
        assert staged == version, (staged, version)  # pinned by STAGE_START before the update
        return digest

    def on_ready(self) -> int | None:
        """The version this trainer waits inside send_weights with (None: not inside it)."""
        with self.cond:
            return self._sending

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

    def on_send_round(self, r: int) -> dict:
        if self.config.sender_staging and not self.beyond(r):  # the copy packed at send_weights
            return self._write(r, Stage.RECEIVE, self._staged_view(self._staging, r))
        return super().on_send_round(r)

    def on_failed(self, version: int, message: str, kind: str = "transfer") -> None:
        """Rank 0 could not move ``version``: send_weights raises what ``kind`` names in
        `_FAILURES` (`TransferFailed` for a lost rollout worker)."""
        with self.cond:
            self._failures[version] = (kind, message)
            self.cond.notify_all()

    def on_transferred(self, version: int) -> None:
        if not self.config.sender_staging:
            self._log(("released", version))
        with self.cond:
            self._done = max(self._done, version)
            self.cond.notify_all()

    def on_join(self, worker: WorkerId) -> None:
        with self.cond:
            self._joined.add(worker)
            self.cond.notify_all()

    def on_leave(self, worker: WorkerId) -> bool | str:
        """A rollout that joined gives up waiting (its poll timed out): True when it is out
        before any byte moved toward it; False when the running transfer already counts it
        (its bytes are on their way: it must wait for the end of the transfer); why its
        engine is out of the group when it is (excluded while it stalled: it was not told)."""
        why = self.leader.why_out(worker.index // self.control.engine_size)
        if why is not None:
            return why
        with self.cond:
            if worker in self._joined:
                self._joined.discard(worker)
                return True
            return False

    def on_claim(self, engine: int):
        """(version, slot) of the newest version landed for ``engine``, None, or why the
        engine is out of the group (a string)."""
        return self.leader.why_out(engine) or self.leader.claim(engine)
