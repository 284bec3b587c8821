"""The workers of this process, by transfer group: where a `TransferAgent` finds the worker a
peer call is for.

A user's actor builds its worker through the group handle (`TransferGroup.sender`, ...), which
registers it here; the agent of the same process looks it up for every call it serves, and
forgets it when the group closes (`take`). One worker per process and group.

`calls` counts the peer calls this process issued and served, per `PeerCall`: Monarch keeps
state for every message (docs/integration.md, "Memory over many updates"), so the counts are
what a soak divides its memory growth by (benchmarks/bench_soak.py).
"""

from __future__ import annotations

import collections
import threading

REGISTER_WAIT_S = 600.0
"""How long an agent waits for its proc's worker to be built (a peer may probe first)."""

_registry: dict[str, object] = {}
_registered = threading.Condition()

calls: collections.Counter = collections.Counter()
"""("issued" | "served" | "messages", call value) -> count, in this process: "messages" counts
the Monarch messages issued (one per run of consecutive peers, `MeshControl`)."""


def register(group: str, worker) -> None:
    with _registered:
        if group in _registry:
            raise ValueError(f"this process already has a worker in transfer group {group!r}: "
                             f"build one worker per process and group (group.sender() or "
                             f"group.receiver() once per rank)")
        _registry[group] = worker
        _registered.notify_all()


def lookup(group: str, timeout_s: float = REGISTER_WAIT_S):
    with _registered:
        if not _registered.wait_for(lambda: group in _registry, timeout=timeout_s):
            raise TimeoutError(f"no worker of transfer group {group!r} was built in this "
                               f"process within {timeout_s:g}s: every rank must call "
                               f"group.sender(...) or group.receiver(...)")
        return _registry[group]


def take(group: str):
    """Forget this process's worker of ``group`` and return it (None: none was built)."""
    with _registered:
        return _registry.pop(group, None)
