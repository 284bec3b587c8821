"""Delta updates through the adapters: ``send_weights(version, changed=...)``.

Mixed into `SenderAdapter`. Every trainer checks its ``changed`` argument before anything
moves and keeps what it said for rank 0 (`on_delta`); rank 0, once every trainer is inside
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
one before any newer one), the oldest over the engines. Sender staging (SS, async) refuses
``changed``: a staged copy is packed for the plan in force when send_weights is called, which
a later re-plan could not read (docs/integration.md, "Delta updates").
"""

from __future__ import annotations

from typing import Collection

from weightbridge.coordination.control import PeerCall
from weightbridge.coordination.delta import DeltaLog
from weightbridge.coordination.worker import param_digest

AUTO = "auto"


class SenderDelta:
    """``changed`` on every trainer (`_delta_check`, `_delta_begin`, `on_delta`) and the
    restricted re-plan on rank 0 (`_plan_delta`)."""

    _delta_prev = 0
    """The version of this trainer's previous send_weights call (sync, RS)."""
    _delta: tuple | None = None
    """(version, previous version, kind, names) of the send_weights call waiting now."""
    _digests: tuple[int, tuple[int, ...]] | None = None
    """(version, per-parameter checksums) at the last ``changed="auto"`` call."""
    _param_tensors: dict[int, dict[str, frozenset[str]]] | None = None

    # -- every trainer --------------------------------------------------------------------------

    def _delta_check(self, changed) -> tuple:
        """Check ``changed`` before anything moves; (kind, names or checksums) for
        `_delta_begin`: kind "full", "set" or "auto".

        Raises:
            ValueError: with sender staging; a string or a non-collection; names that are not
                tensors of this trainer's checkpoint; a set before any full update.
        """
        if changed is None:
            return "full", None
        if self.config.sender_staging:
            raise ValueError(
                "send_weights(changed=...) is not supported with sender_staging (SS and async "
                "modes): each send_weights packs its staged copy for the plan in force while an "
                "earlier transfer may still be reading, so the plan cannot change under it. Use "
                "sync or RS mode (sender_staging=False) for delta updates, or call "
                "send_weights(version) without changed")
        if isinstance(changed, str) and changed == AUTO:
            # Checksummed here, outside any lock: the parameters are this version's now.
            return "auto", param_digest(self.params)
        if isinstance(changed, str) or not isinstance(changed, Collection):
            raise ValueError(f"changed must be None, \"auto\" or a collection of checkpoint "
                             f"tensor names, got {changed!r}"
                             + (f"; pass [{changed!r}]" if isinstance(changed, str) else ""))
        known = {t.name for t in self.spec.tensors}
        unknown = sorted(str(n) for n in changed if n not in known)
        if unknown:
            raise ValueError(f"changed names {len(unknown)} tensors that are not in the "
                             f"checkpoint: {unknown[:4]}{' and more' if len(unknown) > 4 else ''}"
                             f"; name checkpoint tensors (e.g. {sorted(known)[:2]})")
        if self._delta_prev == 0:
            raise ValueError("the first send_weights must be full (changed=None): the rollouts "
                             "hold no version of the trainers' weights yet")
        return "set", frozenset(changed)

    def _delta_begin(self, version: int, checked: tuple) -> None:
        """This call is accepted (``self.cond`` held): keep what rank 0 asks for (`on_delta`)."""
        kind, value = checked
        names = value
        if kind == "auto":
            # Only against the previous call's own checksums: a parameter that changed and
            # changed back since an older one would look unchanged.
            last = self._digests
            self._digests = (version, value)
            names = None
            if last is not None and last[0] == self._delta_prev:
                order = sorted(self.params)
                names = frozenset(n for n, a, b in zip(order, last[1], value) if a != b)
        self._delta = (version, self._delta_prev, kind, names)
        self._delta_prev = version

    def on_delta(self):
        """(version, previous version, kind, names) of the send_weights call waiting here:
        names are checkpoint tensors ("set"), this trainer's changed parameters ("auto"; None
        without checksums of the previous call) or None ("full")."""
        with self.cond:
            return self._delta

    # -- rank 0 ---------------------------------------------------------------------------------

    def _plan_delta(self, ts: list, version: int) -> None:
        """Every trainer in ``ts`` is inside send_weights(version): agree on what changed,
        record it, and put in force a plan of the tensors the rollouts need.

        Raises:
            ValueError: the trainers passed different ``changed`` (nothing was sent).
        """
        answers = self.control.call(ts, PeerCall.DELTA)
        kinds = {kind for _, _, kind, _ in answers}
        if len(kinds) > 1 or ("set" in kinds and len({n for *_, n in answers}) > 1):
            said = "; ".join(f"{t} changed={_shown(kind, names)}"
                             for t, (_, _, kind, names) in zip(ts, answers))
            raise ValueError(f"the trainers passed different changed= to send_weights({version}) "
                             f"({said}); every trainer must pass the same changed (None, "
                             f"\"auto\" or the same tensor names). Nothing was sent: call "
                             f"send_weights again with one changed on every trainer")
        kind = kinds.pop()
        if kind == "set":
            changed = answers[0][3]
        elif kind == "auto" and all(names is not None for *_, names in answers):
            changed = self._auto_tensors(ts, answers)
        else:
            changed = None
        leader = self.leader
        if leader.delta_log is None:
            leader.delta_log = DeltaLog(p.region.tensor for m, _ in
                                        leader.maps.trainers + leader.maps.rollouts
                                        for p in m.pieces)
        leader.delta_log.record(version, [prev for _, prev, _, _ in answers], changed)
        leader.restrict(leader.delta_log.needed(self._delta_base()))

    def _delta_base(self) -> int:
        """The version every live rollout's parameters hold when it installs this transfer,
        or an older one (never newer: then a change would be missed)."""
        if not self.config.receiver_staging:
            # Sync: every live rollout took part in that transfer, unless it joined since.
            joined = self.leader.joined_at
            return 0 if joined is not None and self._done <= joined else self._done
        return min(self.leader.claimed().values())

    def _auto_tensors(self, ts: list, answers: list) -> frozenset[str]:
        """The checkpoint tensors any of the trainers' changed parameters load from."""
        if self._param_tensors is None:
            self._param_tensors = {}
            for i, (smap, _) in enumerate(self.leader.maps.trainers):
                by_param: dict[str, set] = {}
                for p in smap.pieces:
                    by_param.setdefault(p.param, set()).add(p.region.tensor)
                self._param_tensors[i] = {n: frozenset(s) for n, s in by_param.items()}
        out: set[str] = set()
        for t, (*_, params) in zip(ts, answers):
            for n in params:
                out |= self._param_tensors[t.index].get(n, frozenset())
        return frozenset(out)


def _shown(kind: str, names) -> str:
    if kind == "full":
        return "None"
    if kind == "auto":
        return '"auto"'
    shown = sorted(names)
    return f"{shown[:3]}{' and more' if len(shown) > 3 else ''} ({len(shown)} tensors)"
