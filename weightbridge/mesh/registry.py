"""The workers of this process, by transfer group: where a `TransferAgent` finds the worker a
peer call is for.

A user's actor builds its worker through the group handle (`TransferGroup.sender`, ...), which
registers it here; the agent of the same process looks it up for every call it serves, and
forgets it when the group closes (`take`). One worker per process and group.

The calls on a worker run on its group's threads here (`submit`): those the agent serves and
those the worker makes on itself, which `MeshControl` runs here without a Monarch message. A
worker's sends and rounds run on one thread, in order.

`calls` counts the peer calls this process issued and served, per `PeerCall`: Monarch keeps
state for every message (docs/failures.md, "Memory over many updates"), so the counts are
what a soak divides its memory growth by (benchmarks/bench_soak.py).
"""

from __future__ import annotations

import collections
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from weightbridge.coordination.control import PeerCall

REGISTER_WAIT_S = 600.0
"""How long an agent waits for its proc's worker to be built (a peer may probe first)."""

_registry: dict[str, object] = {}
_registered = threading.Condition()

calls: collections.Counter = collections.Counter()
"""(kind, what) -> count, in this process: ("sent", call value) the Monarch messages
`MeshControl` sent (one per run of consecutive peers), ("served", call value) the calls the
agent served, ("local", call value) the calls a worker made on itself (no message),
("write", side) the RDMA submissions `MeshTransport` started into peers of that side (a
``write_from`` per range, or one action of a step's ranges: `TransferConfig.rdma_writes`)."""


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


def local(group: str):
    """This process's worker of ``group``, or None (not built yet, or another process)."""
    with _registered:
        return _registry.get(group)


_mailboxes: dict[str, object] = {}
"""Each group's `weightbridge.mesh.mailbox.Mailbox` in this process (its agent's)."""


def mailbox(group: str, make=None):
    """This process's mailbox of ``group``; made with ``make()`` when there is none and
    ``make`` is given, else None."""
    with _registered:
        box = _mailboxes.get(group)
        if box is None and make is not None:
            box = _mailboxes[group] = make()
        return box


_pools: dict[str, dict[bool, ThreadPoolExecutor]] = {}
_pools_lock = threading.Lock()


def submit(group: str, call: PeerCall, fn, *args) -> Future:
    """Run ``fn(*args)`` on ``group``'s threads for ``call``: one thread for the calls a worker
    serves in order (`PeerCall.ordered`: sends and rounds; a queued one starts the moment
    the one before it ended), a pool for every other call."""
    ordered = call.ordered
    with _pools_lock:
        pools = _pools.setdefault(group, {})
        pool = pools.get(ordered)
        if pool is None:
            pool = pools[ordered] = (ThreadPoolExecutor(1, "weightbridge-send") if ordered else
                                     ThreadPoolExecutor(thread_name_prefix="weightbridge-agent"))
    return pool.submit(fn, *args)


def shutdown(group: str, why: str) -> None:
    """End ``group``'s threads (those running finish their call) and close its mailbox
    (``why``: what ended them, for the calls it fails)."""
    with _registered:
        box = _mailboxes.pop(group, None)
    if box is not None:
        box.close(why)
    with _pools_lock:
        pools = _pools.pop(group, {})
    for pool in pools.values():
        pool.shutdown(wait=False)


def take(group: str):
    """Forget this process's worker of ``group`` and return it (None: none was built)."""
    with _registered:
        return _registry.pop(group, None)
