"""Faults of the library's own meshes are the library's (`own_faults`): a dead proc under them
no longer ends the controller's process.

Monarch hands every supervision fault that no one handled to ``monarch.actor
.unhandled_fault_hook``, whose default exits the process (a ``KeyboardInterrupt`` in the main
thread). The library finds a lost worker by itself (a step that times out, then a ping within
`TransferConfig.notice_timeout_s`) and raises `WorkersLost` or `TransferFailed` saying which
engines hold what; with the default hook the process died before (or while) it could. So the
meshes the library spawns are registered here, and a fault on one of them is logged and
recorded (`seen`) instead; a fault on any other mesh goes on to the hook that was in place
before (the user's, or Monarch's default), so a user's own meshes keep their policy.

Typical usage::

    own_faults(actor_mesh)      # after spawning it (the controller's actors, the group's agents)
    disown_faults(actor_mesh)   # once it is stopped
"""

from __future__ import annotations

import logging
import threading

import monarch.actor

from weightbridge.mesh.monarch_api import mesh_name

log = logging.getLogger(__name__)

_lock = threading.Lock()
_owned: set[str] = set()
_before = None
"""The hook in place when `own_faults` first installed this module's (other meshes go to it)."""
seen: list[str] = []
"""The faults of owned meshes, as Monarch reported them (newest last; at most 100 kept)."""


def _names(meshes) -> set[str]:
    names = set()
    for m in meshes:
        try:
            names.add(mesh_name(m))
        except Exception:  # noqa: BLE001  (a mesh that failed to start: its spawn raises)
            continue
    return names


def own_faults(*meshes) -> None:
    """Faults on these actor meshes are the library's (logged, recorded, not fatal)."""
    global _before
    names = _names(meshes)
    with _lock:
        _owned.update(names)
        if monarch.actor.unhandled_fault_hook is not _hook:
            _before = monarch.actor.unhandled_fault_hook
            monarch.actor.unhandled_fault_hook = _hook


def disown_faults(*meshes) -> None:
    """Hand these meshes' faults back to the hook in place before (they are stopped)."""
    names = _names(meshes)
    with _lock:
        _owned.difference_update(names)


SYSTEM_PREFIXES = ("logger-",)
"""Monarch's own per-proc meshes (the log forwarder), whose name no handle gives: a dead proc
reports on them too, beside every actor mesh on it. Dropped while the library owns meshes;
a user's actor mesh on the same proc still reports on its own, to the hook before."""


def owns(name: str) -> bool:
    with _lock:
        return name in _owned or (bool(_owned) and name.startswith(SYSTEM_PREFIXES))


def _hook(failure) -> None:
    if owns(failure.mesh_name):
        report = str(failure)
        log.warning("weightbridge: a fault on one of its meshes (the transfer finds the lost "
                    "worker and raises for it): %s", report)
        with _lock:
            seen.append(report)
            del seen[:-100]
        return
    (_before or _default)(failure)


def _default(failure) -> None:
    from monarch._src.actor.supervision import unhandled_fault_hook

    unhandled_fault_hook(failure)
