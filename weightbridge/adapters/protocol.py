"""Worker coordination, pure: versions, supersession, engine-consistent installs.

No torch, no Monarch, no threads: every class here is a small state machine whose methods are
called by the adapters (`weightbridge.adapters`) when a control message arrives or
a worker polls. The tests drive them directly (`tests/test_coordination.py`).

The protocol (paper section 3.3)::

    rank-0 sender                 rank-0 receiver of engine e          other receivers of e
    -------------                 ---------------------------          --------------------
    offer(v)  ------------------> EngineCoordinator.offer(v)
                                  poll(step s): decide(s) -> Relay?
                                  [RS: claim(e) at the sender: the
                                   staging slot of v is pinned]
                                  Relay(v, at_step=s+1, slot) ------->  WorkerVersions.relay
                                  (acked before rank 0 runs step s)
                                  poll(s+1): due(s+1) -> install v      poll(s+1): due(s+1) -> v
                                  installed(rank, v) <----------------  installed(rank, v)

Why ``at_step = s + 1``: the workers of one engine run their inference steps in lockstep (the
engine's collectives), so while rank 0 sits in its poll of step s the others have at most reached
their poll of step s; some may already be past it. Once they have all acked the relay, every one
of them meets it at its poll of step s + 1, so the whole engine installs at the same step.

Typical usage::

    coord = EngineCoordinator(num_ranks=2)            # on an engine's rank-0 receiver
    coord.offer(3); relay = coord.decide(step=10)     # -> Relay(3, at_step=11)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Relay:
    """Rank-0 receiver -> every receiver of its engine: install ``version`` at ``at_step``.

    Example: ``Relay(version=4, at_step=11, slot=1)``: at the poll of inference step 11, install
    version 4 from staging slot 1 (``slot=None``: the bytes come straight into the parameters,
    so the poll joins the transfer).
    """

    version: int
    """Model version; strictly increasing along the relays of one engine."""
    at_step: int
    """Inference step at whose poll every worker of the engine installs it."""
    slot: int | None = None
    """Receiver staging slot that holds it (RS and async modes), None when not staged."""


class EngineCoordinator:
    """The rank-0 receiver's view of its engine: offers from the sender, the pinned install.

    A new version is decided only when every rank has installed the previous decision: until
    then the slot it was staged in stays pinned (see `StagingSlots`), and at most one decision
    is outstanding, so an engine never holds two half-installed versions.
    """

    def __init__(self, num_ranks: int):
        if num_ranks < 1:
            raise ValueError(f"an engine has at least one worker, got num_ranks={num_ranks}")
        self.num_ranks = num_ranks
        self.offered = 0
        """Newest version offered by the sender (0: none yet)."""
        self.decided = 0
        """Newest version relayed to the engine."""
        self._installed: dict[int, int] = {r: 0 for r in range(num_ranks)}

    def offer(self, version: int) -> None:
        """The sender has a version ready; an older or repeated offer is ignored (superseded)."""
        self.offered = max(self.offered, version)

    @property
    def idle(self) -> bool:
        """Every rank installed the last decision (a new one may be made)."""
        return all(v >= self.decided for v in self._installed.values())

    def decide(self, step: int, claim=None) -> Relay | None:
        """At rank 0's poll of ``step``: the relay to send (for ``at_step = step + 1``), or None
        (nothing newer offered, or the previous decision not yet installed everywhere).

        ``claim``: in RS modes, a call to the sender's `StagingSlots.claim` for this engine,
        returning (version, slot) of the newest landed version or None; the relay carries the
        version it returns (possibly newer than any offer seen yet).
        """
        if self.offered <= self.decided or not self.idle:
            return None
        version, slot = self.offered, None
        if claim is not None:
            got = claim()
            if got is None or got[0] <= self.decided:
                return None
            version, slot = got
        self.decided = version
        self.offered = max(self.offered, version)
        return Relay(version, step + 1, slot)

    def installed(self, rank: int, version: int) -> None:
        """Rank ``rank`` of the engine now runs ``version``."""
        if rank not in self._installed:
            raise ValueError(f"rank {rank} is not in this engine of {self.num_ranks} ranks")
        self._installed[rank] = max(self._installed[rank], version)
        # A transfer may carry a newer version than the offer it answered (sender staging
        # superseded it meanwhile): older offers are then stale.
        self.decided = max(self.decided, version)


class WorkerVersions:
    """One receiver's relays and installed version: what its poll of a step must install."""

    def __init__(self):
        self.installed = 0
        """Version the worker's parameters hold (0: what the engine started from)."""
        self._relays: list[Relay] = []

    def relay(self, relay: Relay) -> None:
        """Record a relay from rank 0.

        Raises:
            ValueError: versions out of order (a relay not newer than the last one).
        """
        last = max(self._relays[-1].version if self._relays else 0, self.installed)
        if relay.version <= last:
            raise ValueError(f"relay of version {relay.version} after version {last}: versions "
                             f"must reach a worker in increasing order")
        self._relays.append(relay)

    def due(self, step: int) -> Relay | None:
        """The relay to install at the poll of ``step``: the newest one due. Older due relays are
        dropped: a newer decided version supersedes them. Call `done` once installed."""
        ready = [r for r in self._relays if r.at_step <= step]
        if not ready:
            return None
        self._relays = [r for r in self._relays if r.at_step > step]
        return ready[-1]

    def done(self, relay: Relay) -> None:
        self.installed = relay.version

    def retry(self, relay: Relay) -> None:
        """Put back a relay `due` returned whose install never started (the poll gave up
        before any byte moved): the next poll meets it again."""
        self._relays.insert(0, relay)


class SenderStage:
    """One trainer's host staging buffer (SS modes): which version it holds, and whether a
    transfer is reading it.

    Staging a newer version overwrites one not yet sent (it supersedes it); while a transfer
    reads the buffer, staging must wait for it to finish (`busy`), which needs no rollout to
    poll: a transfer only starts once every receiver takes part or stages.
    """

    def __init__(self):
        self.version = 0
        """Version held (0: none)."""
        self.sent = 0
        """Newest version a transfer has read out of the buffer."""
        self.busy = False

    def stage(self, version: int) -> None:
        """Record that ``version`` was copied in.

        Raises:
            ValueError: not newer than the version held or sent (versions go in order).
            RuntimeError: a transfer is reading the buffer (wait until `busy` clears).
        """
        if version <= max(self.version, self.sent):
            raise ValueError(f"send_weights(version={version}) after version "
                             f"{max(self.version, self.sent)}: versions must increase")
        if self.busy:
            raise RuntimeError("staging while a transfer reads the staging buffer; wait for "
                               "the transfer to finish first")
        self.version = version

    @property
    def pending(self) -> int | None:
        """A staged version no transfer has read yet."""
        return self.version if self.version > self.sent and not self.busy else None

    def start(self) -> int:
        """A transfer starts reading the buffer: the version it carries."""
        assert self.pending is not None, "start() without a pending staged version"
        self.busy = True
        return self.version

    def finish(self) -> None:
        self.busy, self.sent = False, self.version

    def drop(self) -> None:
        """The staged copy is laid out for a plan no longer in force (a re-plan): the version
        it holds is never sent (the next one staged supersedes it). A transfer reading it
        (`busy`) ends with `finish` anyway."""
        if not self.busy:
            self.sent = max(self.sent, self.version)

    def cancel(self) -> None:
        """The transfer did not start after all (another trainer staged a newer version)."""
        self.busy = False


class TrainerVersions:
    """One trainer's versions as trainer 0 moves them: the live half (sync, RS: the trainer
    waits inside ``send_weights(v)`` while its parameters are read), as `SenderStage` is the
    staged half (SS, async).

    ``enter(v)`` when send_weights(v) starts waiting, ``leave()`` when it returns; trainer 0's
    word arrives as ``transferred(v)`` or ``failed(v, kind, message)``; the waiting call reads
    ``outcome(v)``. A failure is kept only while a call waits for that version (nothing else
    reads it: in the staged modes trainer 0 raises it itself), so nothing grows per update.
    """

    def __init__(self):
        self.done = 0
        """Newest version whose transfer finished (any mode)."""
        self.ready = 0
        """Newest version send_weights waited with."""
        self.sending: int | None = None
        """The version send_weights waits with now (None: not inside it)."""
        self._failure: tuple[int, str, str, tuple | None] | None = None
        """(version, kind, message) trainer 0 reported for ``sending``."""

    def enter(self, version: int) -> None:
        """send_weights(``version``) starts waiting.

        Raises:
            ValueError: not newer than a version entered or transferred before.
        """
        newest = max(self.ready, self.done)
        if version <= newest:
            raise ValueError(f"send_weights(version={version}) after version {newest}: "
                             f"versions must increase")
        self.ready = self.sending = version
        self._failure = None

    def waiting(self) -> int | None:
        """The version trainer 0 may run with this trainer (`PeerCall.READY`): None when not
        inside send_weights, or still inside a call whose version already finished or failed
        (trainer 0 may ask for the next one before the waiting thread ran again)."""
        if self.sending is None or self.sending <= self.done or self._failure is not None:
            return None
        return self.sending

    def transferred(self, version: int) -> None:
        self.done = max(self.done, version)

    def failed(self, version: int, kind: str, message: str, lost: tuple | None = None) -> None:
        """Trainer 0 could not move ``version``: ``kind`` names the error class
        (`weightbridge.errors.KINDS`; ``lost``: the engines and trainers out, for
        `WorkersLost`). Dropped unless a call waits for ``version``."""
        if version == self.sending:
            self._failure = (version, kind, message, lost)

    def outcome(self, version: int) -> tuple[str, str, tuple | None] | None:
        """None while ``version`` is open; ("done", "", None) once transferred; (kind,
        message, lost) once failed (`weightbridge.errors.from_kind` makes the error)."""
        if self._failure is not None and self._failure[0] == version:
            return self._failure[1:]
        return ("done", "", None) if self.done >= version else None

    def leave(self) -> None:
        self.sending, self._failure = None, None
