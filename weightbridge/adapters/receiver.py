"""`ReceiverAdapter`: a rollout worker's `poll_requests`, and its part of every transfer.

See `weightbridge.adapters` for the whole picture and docs/integration.md for the
user's view.
"""

from __future__ import annotations

import threading
import time


from weightbridge.config import TransferConfig
from weightbridge.adapters.base import AdapterWorker
from weightbridge.coordination.control import PeerCall, engine_workers
from weightbridge.adapters.protocol import EngineCoordinator, Relay, WorkerVersions
from weightbridge.coordination.version import check_version
from weightbridge.coordination.session import unanswered
from weightbridge.errors import TransferFailed
from weightbridge.execution.boxcopy import CopyKernels
from weightbridge.types import Placement, WorkerId

SEQUENCER = WorkerId("trainer", 0)
"""The rank-0 sender: it sequences every transfer of an adapter group."""


class _Out(Exception):
    """Internal: this worker's engine is out of the group (the message says why)."""


class ReceiverAdapter(AdapterWorker):
    """A rollout worker's side: `poll_requests()` between inference steps."""

    side = "rollout"

    def __init__(self, params, load_weights, spec, *, rank: int, engine: int, engine_rank: int,
                 engine_size: int, control, transport, config: TransferConfig = TransferConfig(),
                 placement: Placement | None = None, before_update_hook=None,
                 after_update_hook=None, kernels: CopyKernels | None = None):
        super().__init__(params, load_weights, spec, rank=rank,
                         placement=placement or Placement(f"rollout-e{engine}", engine=engine),
                         control=control, transport=transport, config=config, kernels=kernels)
        if self.placement.engine != engine:
            raise ValueError(f"placement {self.placement} is not in engine {engine}")
        if not 0 <= engine_rank < engine_size or rank != engine * engine_size + engine_rank:
            raise ValueError(f"rollout worker {rank} is given engine {engine}, engine_rank "
                             f"{engine_rank}, engine_size {engine_size}: rollout ranks are "
                             f"numbered engine by engine, rank = engine * engine_size + "
                             f"engine_rank, with 0 <= engine_rank < engine_size")
        self.engine_size = engine_size
        self.engine, self.engine_rank = engine, engine_rank
        for name, hook in (("before_update_hook", before_update_hook),
                           ("after_update_hook", after_update_hook)):
            if hook is not None and not callable(hook):
                raise ValueError(f"{name} must be a callable taking the version (or None), "
                                 f"got {type(hook).__name__}")
        self.before_update_hook = before_update_hook
        self.after_update_hook = after_update_hook
        self.versions = WorkerVersions()
        self.coordinator = EngineCoordinator(engine_size) if engine_rank == 0 else None
        self.step = 0
        self._session_done = 0
        self._failure: str | None = None
        """Set when this worker's engine lost a worker: every poll_requests() raises it."""
        self._passed_on = False  # rank 0: its failure was passed on to its engine's others
        self._asked_at: float | None = None
        """Rank 0: when it last asked trainer 0 whether its engine is in (`_check_in`)."""
        self._polling = threading.Lock()

    @property
    def version(self) -> int:
        """The version the parameters hold (0 until the first install)."""
        return self.versions.installed

    def poll_requests(self) -> int | None:
        """Call between inference steps, on every worker of the engine: installs the version the
        engine agreed on for this step, if any, and returns it (None: nothing installed).

        Rank 0 turns the sender's newest offer into a relay for the next step. The install is
        a join of the running transfer (sync, SS: blocks until the bytes are in the parameters)
        or a local copy out of a staging slot (RS, async). ``before_update_hook(version)`` runs
        first (drop what the old weights computed: a prefix cache); ``after_update_hook(
        version)`` runs once the version is whole in the parameters, before this call returns
        (rebuild what the engine derives from its weights: packed copies, scales). If the
        after-hook raises, the error propagates with the version already installed
        (``version`` says so): run no inference step before that derived state is rebuilt.

        Bytes enter the parameters only inside this call (or `wait_for_version`): a poll that
        gives up waiting for a transfer leaves it before any byte moves toward this worker,
        and the next poll joins again.

        Raises:
            TransferFailed: this worker's engine lost a worker during a transfer; the engine
                is out of the group (docs/failures.md).
            TimeoutError: the transfer this poll joined did not start within 3 x timeout_s
                (nothing was written; poll again to join again), or started and did not finish
                (the parameters may hold part of it).
            RuntimeError: another thread of this rank is inside poll_requests.
        """
        if not self._polling.acquire(blocking=False):
            raise RuntimeError(f"{self.worker}: poll_requests() is already running on this rank "
                               f"in another thread; an engine rank polls from one thread, "
                               f"between its inference steps")
        try:
            return self._poll()
        finally:
            self._polling.release()

    def _poll(self) -> int | None:
        if self._failure is not None and self.coordinator is not None and not self._passed_on:
            # Rank 0 was told its engine is out: so is every other worker of it (one that
            # was stalled when trainer 0 told the engine heard nothing), once.
            self._passed_on = True
            self._fail_engine(self._failure)
        self._check_failed()
        step, self.step = self.step, self.step + 1
        if self.coordinator is not None:
            self._check_in()
            claim = self._claim if self.config.mode.lands_in_staging else None
            try:
                with self.cond:
                    relay = self.coordinator.decide(step, claim=claim)
            except _Out as out:
                self._fail_engine(str(out))
                self._check_failed()
            if relay is not None:  # acked by every rank of the engine before this step runs
                self._call_engine(engine_workers(self.control, self.engine), PeerCall.RELAY,
                                  relay)
        with self.cond:
            due = self.versions.due(step)
        if due is None:
            return None
        if self.before_update_hook is not None:
            self.before_update_hook(due.version)
        if due.slot is None:
            version = self._join(due)
        else:
            with self.cond:
                self.slots.install(due.slot)
            version = due.version
            self._log(("in_params", version))
        with self.cond:
            self.versions.done(Relay(version, due.at_step, due.slot))
        self._log(("installed", version))
        self._call_engine(engine_workers(self.control, self.engine)[:1], PeerCall.INSTALLED,
                          self.engine_rank, version)
        if self.after_update_hook is not None:
            self.after_update_hook(version)
        return version

    def _join(self, due: Relay) -> int:
        """Take part in the transfer that carries ``due.version`` (or a newer one); returns
        the version it put into the parameters."""
        self._log(("join", due.version))
        try:
            self._call_one(SEQUENCER, PeerCall.JOIN, self.worker)
        except Exception as e:
            lost = self._sequencer_lost(e, None)
            if lost is not None:
                self._fail_engine(lost)
                self._check_failed()
            with self.cond:  # (not joined: nothing was written)
                self.versions.retry(due)
            raise
        limit = self.config.wait_s
        done = lambda: self._session_done >= due.version or self._failure  # noqa: E731
        with self.cond:
            # Rank 0 needs up to timeout_s to find a lost worker, then re-plans and re-sends.
            if self.cond.wait_for(done, timeout=limit):
                self._check_failed()
                return self._session_done
        try:  # out of the transfer, unless it already counts this worker
            left = self._call_one(SEQUENCER, PeerCall.LEAVE, self.worker)
        except Exception as e:  # noqa: BLE001  (trainer 0 unreachable: state unknown)
            left, why = False, f"; trainer 0 did not answer ({type(e).__name__}: {e})"
            lost = self._sequencer_lost(e, due.version)
            if lost is not None:
                self._fail_engine(lost)
                self._check_failed()
        else:
            why = ""
        if isinstance(left, str):  # its engine was excluded while this worker stalled
            self._fail_engine(left)
            self._check_failed()
        if left:
            with self.cond:
                self.versions.retry(due)
            raise TimeoutError(f"{self.worker}: the transfer of version {due.version} did not "
                               f"start within 3 x timeout_s={limit / 3:g}s (trainer 0 is "
                               f"waiting for other workers); nothing was written into this "
                               f"worker's parameters, and its next poll_requests() joins again")
        with self.cond:
            if self.cond.wait_for(done, timeout=limit if not why else 0):
                self._check_failed()
                return self._session_done
            # Part of the version may be in the parameters: no later poll may return as if
            # they held a whole version.
            self._failure = (f"a transfer of version {due.version} into this worker did not "
                             f"finish, so its parameters may hold part of it; run no "
                             f"inference step with them: restart the engine's workers and add "
                             f"them as a new engine (add_engines())")
        raise TimeoutError(f"{self.worker}: the transfer of version {due.version} did not finish "
                           f"within {3 if why else 6} x timeout_s={limit / 3:g}s{why}; the "
                           f"parameters may hold part of it: run no inference step with them, "
                           f"and reconnect")

    def wait_for_version(self, version: int, *, timeout_s: float | None = None,
                         poll_interval_s: float = 0.005) -> int:
        """Poll until the parameters hold ``version`` or newer; returns the version installed.

        Call it on every worker of the engine, as `poll_requests` (it is a loop of polls, so
        every rank of the engine installs at the same step). For a rollout that must not run
        a step on older weights, e.g. before its first generation.

        Raises:
            TimeoutError: ``version`` was not installed within ``timeout_s`` (default: 3 x the
                group's ``timeout_s``).
            TransferFailed: as `poll_requests`.
        """
        version = check_version(version, "wait_for_version")
        limit = self.config.wait_s if timeout_s is None else timeout_s
        end = time.monotonic() + limit
        while self.version < version:
            if time.monotonic() > end:
                raise TimeoutError(f"{self.worker}: version {version} was not installed within "
                                   f"{limit:g}s (it holds {self.version}); is the trainer "
                                   f"sending it (send_weights({version}))?")
            if self.poll_requests() is None:
                time.sleep(poll_interval_s)
        return self.version

    # -- called by peers (endpoints on a mesh) --------------------------------------------------

    def on_source_map(self, how: str = "probe"):
        """`TransferWorker.on_source_map` (connect); first check that this worker's engine is
        the group's."""
        if self.engine_size != self.control.engine_size:
            raise ValueError(f"{self.worker} was built with engine_size={self.engine_size}, but "
                             f"its transfer group has engines of {self.control.engine_size} "
                             f"workers; give every ReceiverAdapter of the group the same "
                             f"engine_size")
        return super().on_source_map(how)

    def on_offer(self, version: int) -> None:
        with self.cond:
            self.coordinator.offer(version)

    def on_relay(self, relay: Relay) -> None:
        with self.cond:
            self.versions.relay(relay)

    def on_installed(self, engine_rank: int, version: int) -> None:
        with self.cond:
            self.coordinator.installed(engine_rank, version)

    def on_land(self, r: int, slots: dict[int, int] | None = None,
                expected: tuple[int, ...] | None = None) -> None:
        if (self.config.mode.lands_in_staging and not self.beyond(r)
                and (slots or {}).get(self.engine) is None):
            # (Bytes enter the parameters only inside a poll: never straight from a round.)
            raise RuntimeError(f"{self.worker}: round {r} landed with no staging slot for "
                               f"engine {self.engine} (slots {slots}): it is not in the "
                               f"transfer it is part of")
        super().on_land(r, slots, expected)

    def on_fail(self, message: str) -> None:
        """Rank 0: this worker's engine lost a worker and is out of the group."""
        with self.cond:
            self._failure = message
            self.cond.notify_all()

    def _claim(self):
        """RS: CLAIM the newest version landed for this engine at trainer 0 (for
        `EngineCoordinator.decide`); raises `_Out` when the engine is out of the group or
        trainer 0 is lost."""
        try:
            got = self._call_one(SEQUENCER, PeerCall.CLAIM, self.engine)
        except Exception as e:
            lost = self._sequencer_lost(e, None)
            if lost is None:
                raise
            raise _Out(lost) from e
        if isinstance(got, str):  # excluded while this worker did not answer
            raise _Out(got)
        return got

    def _check_in(self) -> None:
        """Rank 0, set up, at most once per ``timeout_s``: ask trainer 0 whether this engine
        is still in the group (`PeerCall.STATUS`). An engine can be out without hearing of it
        (its notice was lost, or it was excluded while it stalled), or the whole group can
        have ended (trainer 0 lost, or closed after a failure) while no version is offered:
        this poll then raises `TransferFailed` saying why, and so do the engine's others."""
        now = time.monotonic()
        if self.executor is None or (self._asked_at is not None
                                     and now - self._asked_at < self.config.timeout_s):
            return
        self._asked_at = now
        try:
            why = self._call_one(SEQUENCER, PeerCall.STATUS, self.engine)
        except Exception as e:  # noqa: BLE001  (lost, or the call's own failure: below)
            why = self._sequencer_lost(e, None)
        if why is not None:
            self._fail_engine(why)
            self._check_failed()

    def _call_engine(self, peers: list[WorkerId], call: PeerCall, *args) -> None:
        """``call`` on workers of this engine. A relay that did not reach every one of them
        (a rank stalled or gone), or another call that failed on a worker that does not
        answer a ping (gone), takes the engine out: its workers could no longer install a
        version at the same step. Raises `TransferFailed` then (`_leave_group`); a call that
        only timed out is raised as it is (the worker may be stalled for a moment)."""
        try:
            self.control.call(peers, call, *args)
            return
        except Exception as e:
            error = e
            if call is PeerCall.RELAY:
                why = (f"rank 0's relay of version {args[0].version} did not reach every "
                       f"worker of engine {self.engine} ({type(e).__name__}: {e}), so its "
                       f"workers can no longer install a version at the same step")
            else:
                gone = ([] if isinstance(e, TimeoutError) else
                        unanswered(self.control, [p for p in peers if p != self.worker]))
                if not gone:
                    raise
                why = (f"engine {self.engine} lost {'workers' if len(gone) > 1 else 'worker'}"
                       f" {', '.join(map(str, gone))} ({type(e).__name__}: {e})")
        self._leave_group(f"{why}. The engine can run no more steps; its parameters hold "
                          f"version {self.version}, whole. To use it again, restart its "
                          f"workers on new procs and add them as a new engine "
                          f"(add_engines() on every trainer)", error)

    def _leave_group(self, why: str, error: Exception) -> None:
        """This engine goes out of the group by itself: every worker of it is told (their
        polls raise `TransferFailed` with ``why``), and so is trainer 0, which excludes it
        before its next transfer (`PeerCall.LEAVE` with ``why``). Raises `TransferFailed`."""
        self._fail_engine(why)
        try:
            self._call_one(SEQUENCER, PeerCall.LEAVE, self.worker, why)
        except Exception:  # noqa: BLE001  (trainer 0 lost: the engine is out anyway)
            pass
        try:
            self._check_failed()
        except TransferFailed as told:
            raise told from error

    def _sequencer_lost(self, error: Exception, version: int | None) -> str | None:
        """After a call on trainer 0 failed: why this engine can go on no more when trainer 0
        does not answer a ping either (None: it does; the failure was the call's own)."""
        try:
            if self._call_one(SEQUENCER, PeerCall.PING) is True:
                return None
        except Exception:  # noqa: BLE001  (lost: said below)
            pass
        at = "" if version is None else f" while this worker waited for version {version}"
        return (f"trainer 0, which sequences this transfer group, is lost ({type(error).__name__}"
                f": {error}){at}; no version can reach this engine any more"
                + ("" if version is None else ", and its parameters may hold part of one")
                + ": build a new group (new adapters on every worker, connect()) to go on")

    def _fail_engine(self, why: str) -> None:
        """This engine is out of the group (it learned it itself): every poll of each of its
        workers raises `TransferFailed` saying ``why``."""
        with self.cond:
            self._failure = self._failure or why
            self.cond.notify_all()
        others = [w for w in engine_workers(self.control, self.engine) if w != self.worker]
        self.control.call(others, PeerCall.FAIL, why, return_errors=True)

    def _check_failed(self) -> None:
        if self._failure is not None:
            raise TransferFailed(f"{self.worker} (engine {self.engine}): {self._failure}")

    def on_session_done(self, version: int) -> None:
        self._log(("in_params", version))  # the last round was assembled into the parameters
        with self.cond:
            self._session_done = version
            self.cond.notify_all()
