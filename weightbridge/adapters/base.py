"""What both adapters share: a `TransferWorker` with a control plane and bounded waits.

The public entry point is `weightbridge.adapters`; see its docstring and
docs/integration.md.
"""

from __future__ import annotations

import collections
import time

from weightbridge.config import TransferConfig
from weightbridge.coordination.control import ControlPlane, PeerCall, WorkerId
from weightbridge.coordination.worker import TransferWorker

POLL_BACKOFF = 10
"""`AdapterWorker._poll_until`'s longest interval, in units of the first."""
ADAPTER_SPANS = 128
"""Spans an adapter worker keeps (nothing reads them per update, as the controller does with
`TransferWorker.take_spans`): the steps of the last update or few (a round takes one to three
per worker), about 20 KB. Full within the first updates, so the log stops growing the
process early: 4,096 took hundreds of updates to fill, adding about 1.5 KB per update of
the soak's trainers and rollouts (benchmarks/bench_soak.py --trace)."""


class AdapterWorker(TransferWorker):
    """A `TransferWorker` that reaches its peers itself: the control plane, bounded waits."""

    side = ""
    poll_interval_s = 0.0005
    """How often a wait on other workers' state asks them again (local calls are cheap)."""

    def __init__(self, params, load_weights, spec, *, rank: int, placement, control: ControlPlane,
                 transport, config: TransferConfig, kernels=None):
        super().__init__(self.side, params, load_weights, spec, rank=rank, placement=placement,
                         transport=transport, config=config, kernels=kernels,
                         control=control)
        self.spans = collections.deque(maxlen=ADAPTER_SPANS)

    @property
    def options(self) -> TransferConfig:
        return self.config

    def _call_one(self, peer: WorkerId, call: PeerCall, *args):
        return self.control.call([peer], call, *args)[0]

    def _wait(self, predicate, what: str) -> None:
        """Wait on ``self.cond`` (held) until ``predicate()``, at most ``timeout_s``."""
        if not self.cond.wait_for(predicate, timeout=self.config.timeout_s):
            raise TimeoutError(f"{self.worker}: {what} within timeout_s="
                               f"{self.config.timeout_s}s")

    def _poll_until(self, predicate, what, *, deadline: bool = True) -> None:
        """Wait for a condition on other workers (no shared condition variable to wait on).
        ``what``: the timeout message, or a function making it at the timeout.

        The interval starts at the control plane's ``poll_interval_s`` and grows to
        `POLL_BACKOFF` times it: a long wait (a trainer that comes late) costs a few peer
        calls a second, not 100 (on meshes every call leaves Monarch state behind,
        docs/failures.md, "Memory over many updates"). Between polls it waits on
        ``self.cond``, so a predicate on this worker's own state, which its handlers change
        under that lock with notify_all, ends the wait at once."""
        poll_until(self, self.cond, predicate, what, deadline=deadline)


def poll_until(who, cond, predicate, what, *, deadline: bool = True) -> None:
    """`AdapterWorker._poll_until` for any holder of ``worker``, ``control`` and ``config``
    (``who``), waiting on ``cond`` between polls."""
    end = time.monotonic() + who.config.timeout_s
    first = getattr(who.control, "poll_interval_s", AdapterWorker.poll_interval_s)
    interval = first
    while not predicate():
        if deadline and time.monotonic() > end:
            raise TimeoutError(f"{who.worker}: {what() if callable(what) else what} "
                               f"within timeout_s={who.config.timeout_s}s")
        with cond:
            cond.wait(interval)
        interval = min(interval * 1.5, first * POLL_BACKOFF)

