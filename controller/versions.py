"""The controller's version labels, pure: which version each tensor of the trainers and of
the rollouts holds, for the checks after an update.

No Monarch, no torch. `MeshTransfer` asks it before an update moves anything (is the version
new, is the delta well formed, what does each tensor hold afterwards) and tells it what
happened (sent, landed, installed)::

    book = VersionBook(["a", "b"])
    v1 = book.next(1, None)            # 1: a full update (every tensor of version 1)
    book.sent(1, v1); book.installed(1)
    v2 = book.next(2, ["a"])           # {"a": 2, "b": 1}: a delta
    book.sent(2, v2); book.landed(2)   # receiver staging: in the slots, not installed yet
    book.holds -> {"a": 1, "b": 1} until book.installed(2)

Per tensor and not per update: after delta updates the tensors of one version carry the
versions they last changed in, and the verification loads exactly those. What a transfer must
carry is not decided here: `sent` says what changed, and the group leader's delta log
(`weightbridge.coordination.delta.DeltaLog`, the adapters' too) answers from
`held_version`.
"""

from __future__ import annotations

from typing import Collection, Iterable

from weightbridge.driver import AUTO, check_changed, check_version

Versions = dict[str, int]
"""Checkpoint tensor -> the version it holds."""


class VersionBook:
    """Sent, landed and installed versions of one controller-driven group (module doc)."""

    def __init__(self, tensors: Iterable[str], checkpoint: Iterable[str] = ()):
        self.tensors = sorted(set(tensors))
        """The checkpoint tensors some worker reads (what each version is tracked for)."""
        self.known = frozenset(checkpoint) | set(self.tensors)
        """Every name ``changed`` may use: the checkpoint's tensors."""
        self.last_sent: Versions | None = None
        """Per tensor, the version the newest update sent (None before the first)."""
        self.version = 0
        """The newest version sent (0: none)."""
        self.holds: Versions | None = None
        """Per tensor, what the live rollouts' parameters hold (None: nothing yet)."""
        self.held_version = 0
        """The version the live rollouts' parameters hold whole (0: none, or torn): the base
        of the next delta (`DeltaLog.needed`)."""
        self.partial: int | None = None
        """The version a transfer into the parameters failed part-way in (`torn`), until the
        next install: the parameters may hold part of it."""
        self._landed: dict[int, Versions] = {}
        """Versions landed whole in staging and not installed, and what each tensor holds in
        them (receiver staging; older ones are dropped when a newer one is installed)."""

    def next(self, version, changed: Collection[str] | None) -> Versions:
        """What each tensor holds once ``version`` is trained and sent; nothing changes here.

        Raises:
            ValueError: a version that is not a positive int newer than the last one; a
                ``changed`` that is a string other than "auto", names tensors not in the
                checkpoint, or names some before any full update (`delta.check_changed`).
        """
        version = check_version(version, "update")
        if version <= self.version:
            raise ValueError(f"update({version}) after update({self.version}): versions must "
                             f"increase from one update to the next")
        changed = check_changed(changed, self.known, first=self.last_sent is None,
                                call="update")
        return self.holding(version, None if changed == AUTO else changed)

    def holding(self, version: int, changed: frozenset[str] | None) -> Versions:
        """What each tensor holds once ``version`` changed ``changed`` (checked by `next`, or
        found by ``changed="auto"``'s checksums; None: every tensor)."""
        if changed is None:
            return dict.fromkeys(self.tensors, version)
        return {t: version if t in changed else v for t, v in self.last_sent.items()}

    def sent(self, version: int, versions: Versions) -> frozenset[str] | None:
        """The trainers hold ``version`` (``versions`` per tensor) and are sending it; returns
        the tensors that changed in it (None: all of them), for the delta log."""
        self.version, self.last_sent = version, dict(versions)
        changed = frozenset(t for t, v in versions.items() if v == version)
        return None if changed == frozenset(self.tensors) else changed

    def landed(self, version: int) -> None:
        """Every byte of ``version`` is in the live engines' staging slots (which slots, and
        whether a newer landing overwrote it since, is the leader's ledger)."""
        self._landed[version] = dict(self.last_sent)

    def installed(self, version: int) -> Versions:
        """The live rollouts' parameters hold ``version`` now; returns what each tensor holds."""
        holds = self._landed.pop(version, None)
        if holds is None:
            assert version == self.version, (version, self.version)  # (in place: the newest)
            holds = dict(self.last_sent)
        self.holds, self.held_version, self.partial = holds, version, None
        self._landed = {v: t for v, t in self._landed.items() if v > version}
        return holds

    def torn(self) -> None:
        """A transfer into the parameters failed part-way: they hold no whole version until
        the next one is installed (the next transfer must carry every tensor)."""
        self.holds, self.held_version, self.partial = None, 0, self.version
        self._landed.clear()
