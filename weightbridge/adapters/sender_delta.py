"""Delta updates through the adapters: ``send_weights(version, changed=...)``.

Every trainer checks its ``changed`` argument before anything moves and keeps what it said
for rank 0 (`TrainerDelta`, answered with `PeerCall.DELTA`); rank 0 (`plan_delta`, run by its
`weightbridge.adapters.rank0.GroupSequencer`), once every trainer is inside
send_weights(version), gathers those answers, refuses a disagreement on every trainer, records
the version's changes in a `weightbridge.coordination.delta.DeltaLog`, and re-plans restricted
to the tensors the rollouts need (`plan_group(tensors=...)`, the one restricted plan of the
controller path too) when that set differs from the plan in force. The receivers assemble the
restricted rounds over their current parameters, so the tensors left out keep their bytes.

    trainer i                                    rank 0 (in its session of version v)
    send_weights(v, changed)                     READY: every trainer is inside send_weights(v)
      check changed (ValueError, nothing moved)  DELTA: (v, previous version, kind, names) each
      [auto: per-parameter checksums vs the        disagree? -> ValueError on every trainer
       previous call's]                          DeltaLog.record; needed(base) -> tensors
                                                 tensors != plan in force -> re-plan
                                                 the session, as for a full update

The base (what the rollouts' parameters hold when they install this transfer): in sync mode
the last version whose transfer finished (every live rollout took part in it); with receiver
staging, per live engine the version of the staging slot it claimed last (it installs that
one before any newer one), the oldest over the engines. With sender staging (SS, async)
``changed`` is checked as everywhere and every tensor moves: a staged copy is packed for the
plan in force when send_weights is called, which a later re-plan could not read
(docs/delta-elastic.md, "Delta updates").
"""

from __future__ import annotations

from weightbridge.adapters.sequencing import Sequencing
from weightbridge.coordination.control import PeerCall
from weightbridge.coordination.delta import (AUTO, changed_params, check_changed,
                                             tensors_loaded_by)


class TrainerDelta:
    """One trainer's side of delta updates (its `SenderAdapter` holds one as ``changes``):
    `check` a ``changed`` argument before anything moves, `begin` an accepted call (keeping
    what rank 0 asks for with `PeerCall.DELTA`: ``pending``), and say which parameters
    changed since a call (`unchanged`). No lock of its own: the adapter calls `begin` and
    reads ``pending`` under its ``cond``."""

    def __init__(self, params, spec, config, digest):
        self.params, self.spec, self.config = params, spec, config
        self.known = frozenset(t.name for t in spec.tensors)
        self.digest = digest
        """Per-parameter checksums of the parameters now, padding left out
        (`TransferWorker.digest`)."""
        self.prev = 0
        """The version of this trainer's previous send_weights call (sync, RS)."""
        self.pending: tuple | None = None
        """(version, previous version, kind, names, undeclared) of the call waiting now:
        names are checkpoint tensors ("set"), this trainer's changed parameters ("auto"; None
        without checksums of the previous call) or None ("full"); undeclared, the parameters
        that changed but load from no tensor named ("set", checksums on)."""
        self.digests: tuple[int, tuple[int, ...]] | None = None
        """(version, per-parameter checksums) at the last accepted call (``changed="auto"``,
        or any call with checksums on: the contract checks)."""

    def check(self, changed) -> tuple:
        """Check ``changed`` before anything moves (`delta.check_changed`, as the controller
        does); (kind, value) for `begin`: kind "full", "set" or "auto". With sender staging
        every call is full: the staged copy is packed for the plan in force when it is taken,
        whatever a later re-plan would restrict to, so every tensor moves (`staged` keeps
        the previous version for the next call's check).

        Raises:
            ValueError: a string other than "auto" or a non-collection; names that are not
                tensors of this trainer's checkpoint; names before any full update.
        """
        changed = check_changed(changed, self.known, first=self.prev == 0, call="send_weights")
        if changed is None or self.config.mode.sends_staged_copy:
            return "full", self._entry_digest()
        if changed == AUTO:
            # Checksummed here, outside any lock: the parameters are this version's now.
            return "auto", self.digest()
        return "set", (changed, self._entry_digest())

    def staged(self, version: int) -> None:
        """Sender staging: ``version`` was staged (no `begin`: rank 0 asks nothing)."""
        self.prev = version

    def _entry_digest(self) -> tuple[int, ...] | None:
        """With checksums on (sync, RS): per-parameter checksums of what this call sends, for
        the delta contract (`_undeclared`) and `unchanged`; None otherwise."""
        if self.config.checksums and self.config.mode.checks_params_unchanged:
            return self.digest()
        return None

    def begin(self, version: int, checked: tuple, source_map) -> None:
        """The call of ``version`` is accepted: keep what rank 0 asks for (``pending``).
        ``source_map``: this trainer's (which tensors each parameter loads)."""
        kind, value = checked
        names, digest = (value if kind == "set" else (None, value))
        # Only against the previous call's own checksums: a parameter that changed and
        # changed back since an older one would look unchanged.
        last = self.digests if self.digests and self.digests[0] == self.prev else None
        changed = (None if last is None or digest is None else
                   changed_params(sorted(self.params), last[1], digest))
        if digest is not None:
            self.digests = (version, digest)
        undeclared = ()
        if kind == "auto":
            names = changed
        elif kind == "set" and changed:
            undeclared = _undeclared(source_map, changed, names)
        self.pending = (version, self.prev, kind, names, undeclared)
        self.prev = version

    def unchanged(self, version: int) -> tuple[str, ...]:
        """The parameters whose bytes differ now from when send_weights(``version``) was
        called (checksums on, sync and RS): changed while the transfer read them."""
        last = self.digests
        if last is None or last[0] != version:
            return ()
        return tuple(sorted(changed_params(sorted(self.params), last[1], self.digest())))


def _undeclared(smap, changed: frozenset[str], names: frozenset[str]) -> tuple[str, ...]:
    """The parameters in ``changed`` that load from none of the tensors ``names``: a
    ``changed=`` that leaves them out would install their old bytes under the new label.
    (A parameter with padding is in ``changed`` only if an element a checkpoint element
    lands in changed: its digest leaves the padding out.)"""
    loads: dict[str, set[str]] = {}
    for p in smap.pieces:
        loads.setdefault(p.param, set()).add(p.region.tensor)
    return tuple(sorted(n for n in changed if n in loads and not loads[n] & names))


def plan_delta(seq: Sequencing, ts: list, version: int) -> None:
    """Every trainer in ``ts`` is inside send_weights(version): agree on what changed,
    record it, and put in force a plan of the tensors the rollouts need.

    Raises:
        ValueError: the trainers passed different ``changed`` (nothing was sent).
    """
    answers = seq.control.call(ts, PeerCall.DELTA)
    undeclared = [(t, u) for t, (*_, u) in zip(ts, answers) if u]
    answers = [a[:4] for a in answers]
    kinds = {kind for _, _, kind, _ in answers}
    if len(kinds) > 1 or ("set" in kinds and len({n for *_, n in answers}) > 1):
        said = "; ".join(f"{t} changed={_shown(kind, names)}"
                         for t, (_, _, kind, names) in zip(ts, answers))
        raise ValueError(f"the trainers passed different changed= to send_weights({version}) "
                         f"({said}); every trainer must pass the same changed (None, "
                         f"\"auto\" or the same tensor names). Nothing was sent: call "
                         f"send_weights again with one changed on every trainer")
    if undeclared:
        said = "; ".join(f"{t}: {list(u[:4])}{' and more' if len(u) > 4 else ''}"
                         for t, u in undeclared)
        raise ValueError(
            f"send_weights({version}, changed=...) leaves out parameters that changed "
            f"since send_weights({answers[0][1]}) ({said}): the tensors they load are not "
            f"in changed, so the rollouts would keep their old bytes under version "
            f"{version}. Nothing was sent: name every tensor that changed in changed= "
            f"(or pass changed=\"auto\", or None for a full update)")
    kind = kinds.pop()
    if kind == "set":
        changed = answers[0][3]
    elif kind == "auto" and all(names is not None for *_, names in answers):
        changed = _auto_tensors(seq, ts, answers)
    else:
        changed = None
    seq.leader.record_delta(version, [prev for _, prev, _, _ in answers], changed)
    seq.leader.restrict(seq.leader.delta_log.needed(_delta_base(seq)))

def check_unchanged(seq: Sequencing, ts: list, version: int) -> None:
    """After the rounds of ``version`` (sync, RS; checksums on): every trainer's parameters
    still hold what send_weights(``version``) was called with. If not (an optimizer step
    overlapped the send), what the rollouts received mixes two states: with receiver
    staging it is never offered (the engines keep what they run); in sync mode it is in
    the rollouts' parameters already, so the group fails closed (every poll raises).

    Raises:
        ChangedDuringSend: parameters changed (the message says which, and what to do).
    """
    if not (seq.config.checksums and seq.config.mode.checks_params_unchanged):
        return
    moved = [(t, names) for t, names in zip(ts, seq.control.call(
        ts, PeerCall.UNCHANGED, version)) if names]
    if not moved:
        return
    said = "; ".join(f"{t}: {list(n[:4])}{' and more' if len(n) > 4 else ''}"
                     for t, n in moved)
    what = (f"parameters changed while send_weights({version}) was sending them ({said}), "
            f"so what the rollouts received mixes two states of them. Change no parameter "
            f"until send_weights returns")
    if seq.config.mode.lands_in_staging:
        raise ChangedDuringSend(
            f"{what}. Nothing of version {version} is installed (the engines keep the "
            f"version they run): send again, a full update (changed=None) or a delta "
            f"naming every tensor changed since the last version sent")
    seq.close(f"{what}. The rollouts' parameters hold that mix (no poll returns it: they "
              f"raise); build a new group (new adapters, connect()) to go on")
    raise ChangedDuringSend(seq.broken)

def _delta_base(seq: Sequencing) -> int:
    """The version every live rollout's parameters hold when it installs this transfer,
    or an older one (never newer: then a change would be missed)."""
    if not seq.config.mode.lands_in_staging:
        # Sync: every live rollout took part in that transfer, unless it joined since.
        joined = seq.leader.joined_at
        return 0 if joined is not None and seq.done() <= joined else seq.done()
    return min(seq.leader.claimed().values())

def _auto_tensors(seq: Sequencing, ts: list, answers: list) -> frozenset[str]:
    """The checkpoint tensors any of the trainers' changed parameters load from."""
    return frozenset().union(*(tensors_loaded_by(params, seq.leader.tensors_of(t.index))
                               for t, (*_, params) in zip(ts, answers)))


class ChangedDuringSend(ValueError):
    """Internal: a trainer's parameters changed while its send read them (`_check_unchanged`);
    every trainer's send_weights raises ValueError with the message."""


def _shown(kind: str, names) -> str:
    if kind == "full":
        return "None"
    if kind == "auto":
        return '"auto"'
    shown = sorted(names)
    return f"{shown[:3]}{' and more' if len(shown) > 3 else ''} ({len(shown)} tensors)"
