"""`GroupSequencer`: trainer 0's part of an adapter group, one object beside its worker.

Trainer 0 sequences every transfer of the group: it waits until every trainer is inside
``send_weights(v)`` (or holds ``v`` staged), agrees on a delta, compares replicas, gathers the
rollouts that take part, runs the rounds, tells everyone how it went, recovers from a lost
worker and makes membership changes between transfers. All of that is here; the group's state
is its `GroupLeader` (``leader``), trainer 0's own version state stays on its `SenderAdapter`,
which hands two views of it in (``done``, ``pending``) and forwards its peers' calls (JOIN,
LEAVE, CLAIM) here.

The mode is read once, at construction, as two strategies::

    source     _LiveParams (sync, RS): every trainer waits inside send_weights(v); the delta
               contract (`sender_delta`) before the rounds, "did the parameters change?" after
               _Staged (SS, async): each trainer's staged copy of v; the SS drain thread
    landing    _IntoParams (sync, SS): gather the rollouts (they poll), SESSION_DONE after
               _IntoStaging (RS, async): a staging slot per engine (the leader's ledger), OFFER
"""

from __future__ import annotations

import contextvars
import threading
import time
from typing import Callable

from weightbridge.config import TransferConfig
from weightbridge.adapters import recovery, sender_delta
from weightbridge.adapters.base import poll_until
from weightbridge.coordination.control import ControlPlane, PeerCall, rollouts
from weightbridge.coordination.leader import GroupLeader
from weightbridge.coordination.session import check_replicas, run_update, unanswered
from weightbridge.errors import TransferFailed, WorkersLost, describe, failure_kind, told
from weightbridge.types import WorkerId

TRAINER_0 = WorkerId("trainer", 0)


class _Disagree(Exception):
    """Internal: a trainer is inside send_weights with another version."""


class GroupSequencer:
    """Trainer 0's sequencing (module doc). ``done()``: the newest version whose transfer
    finished on trainer 0; ``pending()``: the version trainer 0 holds staged, not yet read."""

    def __init__(self, worker: WorkerId, control: ControlPlane, config: TransferConfig, *,
                 done: Callable[[], int], pending: Callable[[], int | None]):
        self.worker, self.control, self.config = worker, control, config
        self.leader = GroupLeader(control, config)
        self.source = _Staged() if config.mode.sends_staged_copy else _LiveParams()
        self.landing = _IntoStaging() if config.mode.lands_in_staging else _IntoParams()
        self.done, self.pending = done, pending
        self.cond = threading.Condition()
        """Guards ``joined``; notified when a rollout joins or leaves."""
        self.joined: set[WorkerId] = set()
        """Rollouts inside a poll that joins the next transfer (RS off)."""
        self.session_joined: set[WorkerId] = set()
        """Who had joined the transfer under way (or the last one)."""
        self.session_lock = threading.Lock()
        """One transfer or membership change at a time."""
        self.broken: str | None = None
        """Why the group can send no more (None while it can)."""
        self.thread: threading.Thread | None = None  # the SS drain
        self._kick_lock = threading.Lock()
        self.error: BaseException | None = None
        """What the SS drain failed with (raised by the next send_weights or wait_idle)."""

    # -- who is in (the leader's) ---------------------------------------------------------------

    def live(self) -> list[WorkerId]:
        return self.leader.live_rollouts()

    def live_trainers(self) -> list[WorkerId]:
        return self.leader.live_trainers()

    def poll_until(self, predicate, what, *, deadline: bool = True) -> None:
        """Wait for ``predicate``; `TransferFailed` once the group can send no more (`end`)."""
        poll_until(self, self.cond, lambda: self.broken is not None or predicate(), what,
                   deadline=deadline)
        if self.broken is not None:
            raise TransferFailed(self.broken)

    def end(self, why: str) -> None:
        """The group was closed (`TransferGroup.close`): every wait here ends, raising
        `TransferFailed` saying ``why``, and no transfer starts again."""
        with self.cond:
            self.broken = self.broken or why
            self.cond.notify_all()

    def call_one(self, peer: WorkerId, call: PeerCall, *args):
        return self.control.call([peer], call, *args)[0]

    # -- one transfer ---------------------------------------------------------------------------

    def run(self, version: int, *, release: bool = True) -> None:
        """Move ``version`` end to end. A failure goes to `recovery.recover`, which raises
        `WorkersLost` when a worker was lost (after re-planning without it) and re-raises
        anything else."""
        with self.session_lock:
            if self.broken is not None:  # (a transfer staged before the group ended)
                raise TransferFailed(self.broken)
            moved = [False]
            try:
                self.session(version, moved, release)
            except TransferFailed:
                raise
            except sender_delta.ChangedDuringSend as e:  # (rollouts told when they must be)
                self.tell_trainers(version, str(e), "input")
                raise ValueError(f"{self.worker}: {e}") from None
            except Exception as e:  # noqa: BLE001  (classified, then raised again)
                recovery.recover(self, version, e, moved[0])

    def session(self, version: int, moved: list, release: bool) -> None:
        self.leader.retell()  # (excluded workers that stalled when told: again, off-thread)
        if self.leader.asked_out:  # engines that went out by themselves: planned out first
            recovery.exclude_lost(self, f"the time before the transfer of version {version}")
        ts = self.live_trainers()
        self.source.before(self, ts, version)
        check_replicas(self.control, self.leader.group, version)  # (SS: staged copies)
        slots = self.landing.before(self, version)
        moved[0] = True
        run_update(self.control, self.leader.group, slots=slots)  # the rounds
        self.source.after(self, ts, version)
        self.landing.after(self, ts, version, release)

    def gather(self, version: int, *, deadline: bool = True) -> None:
        """RS off: offer ``version`` to every engine and wait until every rollout joined.
        Without ``deadline`` (SS: a rollout may poll late) it waits on while every rollout
        it waits for answers a ping (checked every ``timeout_s``); raises `TimeoutError`
        when one does not (dead or stalled: recovery excludes it)."""
        self.control.call(self.leader.live_rank0s(), PeerCall.OFFER, version)
        want = self.live()
        missing = lambda: [w for w in want if w not in self.joined]  # noqa: E731
        while True:
            try:
                # The message is made at the timeout: it names the rollouts not polling then.
                self.poll_until(lambda: not missing(), lambda: (
                    f"rollout workers {[str(w) for w in missing()]} did not poll_requests() "
                    f"for version {version}; in sync and SS modes every rollout must poll "
                    f"between inference steps"))
                return
            except TimeoutError:
                if deadline or self.leader.asked_out or unanswered(self.control, missing()):
                    raise

    def wait_for_trainers(self, ts: list[WorkerId], version: int) -> None:
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
            self.poll_until(same, f"not every trainer called send_weights({version})")
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

    def close(self, why: str) -> None:
        """The group can send no more: every rollout not out already (engines added but not
        joined included) is told ``why`` (their polls raise `TransferFailed`), and so is any
        that asks later (`on_status`)."""
        self.broken = why
        out = self.leader.out_engines
        told = [w for w in rollouts(self.control) if w.index // self.control.engine_size
                not in out]
        self.control.call(told, PeerCall.FAIL, why, return_errors=True)
        # Nothing more is sent, so no transfer will tell the untold again: do it now (a
        # stalled one hears it once it goes on; its engine's rank 0 may be the dead one).
        self.leader.retell()

    def rejoin(self, moved: bool) -> None:
        """After a loss, RS off: the surviving rollouts that had joined the failed transfer
        still wait in poll_requests() for a version; count them in for the next transfer."""
        if self.config.mode.lands_in_staging or not moved:
            return  # before the bytes moved, ``joined`` still holds who joined
        live = set(self.live())
        with self.cond:
            self.joined = self.joined | (self.session_joined & live)

    def tell_trainers(self, version: int, message: str, kind: str = "transfer",
                      lost: tuple | None = None) -> None:
        """Every other live trainer's send_weights(version) raises what ``kind`` names
        (`weightbridge.errors.from_kind`; ``lost``: (engines, trainers) out, for "lost")."""
        others = self.live_trainers()[1:]
        self.control.call(others, PeerCall.FAILED, version, message, kind, lost,
                          return_errors=True)

    # -- the SS drain ---------------------------------------------------------------------------

    def kick(self) -> None:
        """A version was staged on trainer 0: make sure the drain thread runs."""
        with self._kick_lock:  # drain clears ``thread`` under the same lock: no lost wake-up
            if self.thread is None:
                # In a copy of this thread's context: an actor's messaging context lives in
                # contextvars, and calls on peers from the thread need it.
                ctx = contextvars.copy_context()
                self.thread = threading.Thread(target=ctx.run, args=(self._drain,),
                                               daemon=True, name="weightbridge-sender")
                self.thread.start()

    def _drain(self) -> None:
        """Transfer staged versions until none is pending.

        Without RS the rollouts must join first; the staging buffers stay free meanwhile, so a
        rollout that stops polling never blocks the trainers: they keep staging newer versions
        (each superseding the last) and the transfer carries the newest one once all joined.
        """
        try:
            while True:
                with self._kick_lock:
                    first = self.pending()
                    if first is None:
                        self.thread = None
                        return
                try:
                    try:
                        version = self._pin(first)
                    except Exception as e:  # noqa: BLE001  (a lost worker: excluded, raised)
                        with self.session_lock:
                            recovery.recover(self, first, e, False)
                    if version is None:
                        continue
                    try:
                        self.run(version)
                    finally:  # (a trainer lost in the session is not asked)
                        self.control.call(self.live_trainers(), PeerCall.STAGE_FINISH,
                                          return_errors=True)
                except TransferFailed as e:
                    if self.broken is not None:
                        raise
                    # Lost workers were excluded and the group re-planned (which dropped
                    # the copies staged for the old plan, `SenderStage.drop`): the survivors
                    # take the next version staged; the next send_weights or wait_idle
                    # raises the error.
                    self.error = e
        except BaseException as e:  # surfaced by the next send_weights / wait_idle
            self.error = e
            with self._kick_lock:
                self.thread = None

    def _pin(self, first: int) -> int | None:
        """The drain's preparation of a transfer: the rollouts joined (RS off), every
        trainer holds one staged version, pinned; that version (None: a trainer staged a
        newer one meanwhile, try again)."""
        ts = self.live_trainers()
        if not self.config.mode.lands_in_staging:
            self.gather(first, deadline=False)
        # Every trainer stages each version (a newer one supersedes an older one): wait
        # until they hold the same one.
        held: list = []

        def same() -> bool:
            held[:] = self.control.call(ts, PeerCall.PENDING)
            return len(set(held)) == 1

        self.poll_until(same, lambda: (
            "the trainers hold different staged versions ("
            + ", ".join(f"{t} holds version {v}" for t, v in zip(ts, held))
            + "); every trainer must call send_weights with the same versions, so "
              "nothing was sent"))
        version = self.pending()
        # Pin every staging buffer on that version; if one moved on meanwhile, retry.
        started = []
        try:
            for t in ts:
                if not self.call_one(t, PeerCall.STAGE_START, version):
                    break
                started.append(t)
        finally:
            if len(started) < len(ts):
                self.control.call(started, PeerCall.STAGE_CANCEL, return_errors=True)
        return version if len(started) == len(ts) else None

    def raise_background_error(self) -> None:
        if self.error is not None:
            e, self.error = self.error, None
            if isinstance(e, TransferFailed):
                raise e
            raise TransferFailed(f"{self.worker}: a background transfer failed: {e}") from e

    def wait_idle(self) -> None:
        """Wait until every staged version was transferred (SS modes)."""
        # A lost rollout takes up to timeout_s to find, then a re-plan: 3 x, as send_weights.
        end = time.monotonic() + self.config.wait_s
        while self.thread is not None:
            if time.monotonic() > end:
                raise TimeoutError(f"{self.worker}: staged versions were not all transferred "
                                   f"within wait_s={self.config.wait_s:g}s (3 x timeout_s)")
            time.sleep(getattr(self.control, "poll_interval_s", 0.0005))
        self.raise_background_error()

    # -- membership changes ---------------------------------------------------------------------

    def change(self, what: tuple, change: Callable[[], None], name: str) -> None:
        """Wait until every other trainer is inside the same change (none stages meanwhile)
        and every staged version was transferred; make the change between transfers; tell
        the others how it went.

        Workers lost since the last transfer (they do not answer a ping) are excluded first
        (`recovery.exclude_lost`), so the change goes on without them; one lost during the
        change is excluded after it, and `WorkersLost` says what was made."""
        others = self.live_trainers()[1:]
        failure = None
        try:
            if self.broken is not None:  # (engines added since are told too)
                self.close(self.broken)
                raise TransferFailed(self.broken)
            # (A trainer whose call fails is gone, or not: the ping below decides.)
            self.poll_until(lambda: all(
                a == what or isinstance(a, Exception)
                for a in self.control.call(others, PeerCall.CHANGING, return_errors=True)),
                f"not every trainer called the same {name}")
            if self.config.mode.sends_staged_copy:
                self.wait_idle()
            with self.session_lock:
                recovery.exclude_lost(self, f"the time before {name}")
                out_before = set(self.leader.out_engines)
                try:
                    change()
                except Exception as e:
                    loss = recovery.exclude_lost(self, name, e)
                    if loss is not None:
                        raise loss.lost(_made(what, self.leader)) from e
                    lost = self.leader.out_engines - out_before
                    if (what[0] != "add" or not lost
                            or failure_kind(e) in ("input", "layout", "config")):
                        raise
                    # Joining workers that died or stalled in their set-up: the join took
                    # them out itself (`GroupLeader.join`); a loss like any other.
                    raise WorkersLost(f"engines {sorted(lost)} could not join this transfer "
                                      f"group ({describe(e)}); {_made(what, self.leader)}",
                                      frozenset(lost), frozenset()) from e
        except Exception as e:
            failure = told(e)  # (each other trainer raises the same class)
            raise
        finally:
            self.control.call(others, PeerCall.CHANGED, what, failure, return_errors=True)

    # -- the peers' calls -----------------------------------------------------------------------

    def on_join(self, worker: WorkerId) -> None:
        with self.cond:
            self.joined.add(worker)
            self.cond.notify_all()

    def on_leave(self, worker: WorkerId, why: str | None = None) -> bool | str:
        """A rollout that joined gives up waiting (its poll timed out): True when it is out
        before any byte moved toward it; False when the running transfer already counts it
        (its bytes are on their way: it must wait for the end of the transfer); why its
        engine is out of the group when it is (excluded while it stalled: it was not told).
        With ``why``: its engine went out by itself (it can run no more steps); it is
        excluded before the next transfer (`GroupLeader.ask_out`)."""
        engine = worker.index // self.control.engine_size
        if why is not None:
            self.leader.ask_out(engine, why)
            return why
        why = self.leader.why_out(engine)
        if why is not None:
            return why
        with self.cond:
            if worker in self.joined:
                self.joined.discard(worker)
                return True
            return False

    def on_status(self, engine: int) -> str | None:
        """Why ``engine`` can take no more versions (out of the group, or the group ended);
        None while it can (an engine's rank 0 asks every ``timeout_s``)."""
        return self.leader.why_out(engine) or self.broken

    def on_claim(self, engine: int):
        """(version, slot) of the newest version landed for ``engine``, None, or why the
        engine is out of the group (a string)."""
        return self.leader.why_out(engine) or self.leader.claim(engine)


def _made(what: tuple, leader: GroupLeader) -> str:
    """What a membership change that met a lost worker made, for its `WorkersLost`."""
    goes_on = f"the group goes on with engines {leader.live_engines()} over a new plan."
    if what[0] == "remove":
        made = "was made" if what[1] in leader.out_engines else "was not made"
        return f"remove_engine({what[1]}) {made}; {goes_on}"
    return (f"add_engines() was not made: the joining engines are out (their polls raise; "
            f"restart their workers and add them as new engines); {goes_on}")


class _LiveParams:
    """Sync, RS: the trainers' parameters are read by the rounds themselves."""

    def before(self, seq: GroupSequencer, ts: list, version: int) -> None:
        seq.wait_for_trainers(ts, version)  # every trainer is inside send_weights(version)
        sender_delta.plan_delta(seq, ts, version)  # the plan of the tensors rollouts need

    def after(self, seq: GroupSequencer, ts: list, version: int) -> None:
        sender_delta.check_unchanged(seq, ts, version)  # (an optimizer step overlapping)


class _Staged:
    """SS, async: the rounds read each trainer's staged copy (pinned by the drain)."""

    def before(self, seq: GroupSequencer, ts: list, version: int) -> None:
        pass

    def after(self, seq: GroupSequencer, ts: list, version: int) -> None:
        pass


class _IntoParams:
    """Sync, SS: the rollouts take part from inside their polls; bytes go into parameters."""

    def before(self, seq: GroupSequencer, version: int) -> dict:
        while True:  # a rollout may leave (its poll timed out) until the swap below
            seq.gather(version, deadline=not seq.config.mode.sends_staged_copy)
            with seq.cond:  # on_leave takes the same lock: out before, or in for good
                if set(seq.live()) <= seq.joined:
                    seq.session_joined, seq.joined = seq.joined, set()
                    return {}

    def after(self, seq: GroupSequencer, ts: list, version: int, release: bool) -> None:
        # Every round landed: the version is whole in every rollout's parameters. Released
        # from here on (a recovery must not count them in the next transfer), and a worker
        # lost meanwhile is found by the next transfer, not by these notices.
        seq.session_joined = set()
        seq.control.call(list(seq.leader.group.live_rollouts), PeerCall.SESSION_DONE, version,
                         return_errors=True)
        if release:
            seq.control.call(ts, PeerCall.TRANSFERRED, version, return_errors=True)


class _IntoStaging:
    """RS, async: each engine lands the version in a staging slot and installs it later."""

    def before(self, seq: GroupSequencer, version: int) -> dict:
        return seq.leader.begin_landing(version)

    def after(self, seq: GroupSequencer, ts: list, version: int, release: bool) -> None:
        seq.leader.landed(version)
        if release:  # landed: the trainers go on before any install (a lost one: as above)
            seq.control.call(ts, PeerCall.TRANSFERRED, version, return_errors=True)
        seq.control.call(seq.leader.live_rank0s(), PeerCall.OFFER, version)
