"""Delta updates, pure: which checkpoint tensors a transfer must carry so that what a rollout
installs is bit-identical to a full update of that version.

No torch, no threads: the rank-0 sender (`weightbridge.adapters.sender_delta`) feeds it
what the trainers said changed in each version, and asks it what the next transfer needs given
the version the rollouts' parameters hold when they install it (the "base")::

    log = DeltaLog(tensors)                 # every checkpoint tensor some worker reads
    log.record(1, prevs=[0, 0], changed=None)        # a full update: every tensor is new
    log.record(2, prevs=[1, 1], changed={"a"})       # "a" changed since version 1
    log.needed(base=1)  -> frozenset({"a"})          # rollouts hold 1: send "a" only
    log.needed(base=0)  -> None                      # rollouts hold nothing yet: send it all

Why a base and not "the last version sent": a rollout does not always install every version
(receiver staging lets an engine skip versions that landed while it generated; a transfer can
fail before any byte moved). A tensor is needed when it changed after the base, so a skipped
version's changes ride on the next transfer.

``prevs``: each trainer's previous ``send_weights`` version. When one differs from the last
version recorded here, some version's changes never reached rank 0 (a call refused before the
trainers agreed, say), so this version counts as a full change: correct, if not minimal.
"""

from __future__ import annotations

from typing import Collection, Iterable


class DeltaLog:
    """Per checkpoint tensor, the newest version it changed in; rank 0 of an adapter group."""

    def __init__(self, tensors: Iterable[str]):
        self.tensors = frozenset(tensors)
        """Every checkpoint tensor some worker reads (a full update moves all of them)."""
        self.recorded = 0
        """Newest version recorded (0: none)."""
        self._changed_at: dict[str, int] = {}
        self._last: tuple[int, frozenset[str] | None] = (0, None)

    def record(self, version: int, prevs: Iterable[int], changed: Iterable[str] | None
               ) -> frozenset[str] | None:
        """The trainers agreed that ``changed`` (None: everything) changed in ``version``
        since their previous calls ``prevs``. Returns what was recorded (None: everything).

        Recording the same version again (rank 0 re-sends it after a lost worker) keeps the
        first record: the trainers' parameters have not moved since.
        """
        if version == self._last[0]:
            return self._last[1]
        if changed is not None and any(p != self.recorded for p in prevs):
            changed = None  # a version between went unrecorded: its changes are unknown
        tensors = None if changed is None else frozenset(changed) & self.tensors
        for t in self.tensors if tensors is None else tensors:
            self._changed_at[t] = version
        self.recorded = version
        self._last = (version, tensors)
        return tensors

    def needed(self, base: int) -> frozenset[str] | None:
        """The tensors a transfer must carry to rollouts whose parameters hold version
        ``base`` (0: none yet): those changed after it. None when that is every tensor (a full
        update)."""
        # A tensor never recorded (no full update yet) counts as changed: it must be sent.
        out = frozenset(t for t in self.tensors if self._changed_at.get(t, base + 1) > base)
        return None if out == self.tensors else out


AUTO = "auto"
"""``changed="auto"``: each trainer's parameters are compared with its previous call's
(per-parameter checksums), and the tensors the changed ones load from are sent."""


def check_changed(changed, known: Collection[str], *, first: bool, call: str
                  ) -> frozenset[str] | str | None:
    """A delta update's ``changed`` argument, checked before anything moves, the same on every
    path (the adapters' `send_weights` and the controller's `update`): None (a full update),
    `AUTO`, or the checkpoint tensors it names. ``known``: the checkpoint's tensor names;
    ``first``: no full update went before (``"auto"`` is full then: nothing to compare with).

    Raises:
        ValueError: a string other than "auto" or a non-collection; names not in ``known``;
            names on the first call.
    """
    if changed is None or (isinstance(changed, str) and changed == AUTO):
        return changed
    if isinstance(changed, str) or not isinstance(changed, Collection):
        raise ValueError(f"changed must be None, \"auto\" or a collection of checkpoint "
                         f"tensor names, got {changed!r}"
                         + (f"; pass [{changed!r}]" if isinstance(changed, str) else ""))
    unknown = sorted(str(n) for n in changed if n not in known)
    if unknown:
        raise ValueError(f"changed names {len(unknown)} tensors that are not in the "
                         f"checkpoint: {unknown[:4]}{' and more' if len(unknown) > 4 else ''}; "
                         f"name checkpoint tensors (e.g. {sorted(known)[:2]})")
    if first:
        raise ValueError(f"the first {call} must be full (changed=None): the rollouts hold no "
                         f"version of the trainers' weights yet")
    return frozenset(changed)


def changed_params(names: Iterable[str], old: Iterable[int], new: Iterable[int]
                   ) -> frozenset[str]:
    """The parameters whose checksums differ between two calls (``names``: the parameters in
    checksum order)."""
    return frozenset(n for n, a, b in zip(names, old, new) if a != b)


def tensors_loaded_by(params: Iterable[str], tensors_of: dict[str, frozenset[str]]
                      ) -> frozenset[str]:
    """``changed="auto"``: the checkpoint tensors some of ``params`` load from (``tensors_of``:
    per parameter, from its source map; a fused parameter names all of its tensors)."""
    out: set[str] = set()
    for name in params:
        out |= tensors_of.get(name, frozenset())
    return frozenset(out)
