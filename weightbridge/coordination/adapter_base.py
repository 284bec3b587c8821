"""What both adapters share: a `TransferWorker` with a control plane, staging layout and waits.

The public entry point is `weightbridge.coordination.adapters`; see its docstring and
docs/integration.md.
"""

from __future__ import annotations

import time

import torch

from weightbridge.config import TransferConfig
from weightbridge.coordination.control import ControlPlane, PeerCall, WorkerId
from weightbridge.coordination.worker import TransferWorker


class TransferFailed(RuntimeError):
    """A rollout worker was lost during a transfer (its process died or stopped answering).

    The message names the worker, its engine and the version, says which engines were excluded
    and what the surviving engines hold, and how to bring the lost engine back (reconnect).
    """


class AdapterWorker(TransferWorker):
    """A `TransferWorker` that reaches its peers itself: the control plane, the staging layout
    of its rounds, bounded waits."""

    side = ""
    poll_interval_s = 0.0005
    """How often a wait on other workers' state asks them again (local calls are cheap)."""

    def __init__(self, params, load_weights, spec, *, rank: int, placement, control: ControlPlane,
                 transport, config: TransferConfig, kernels=None):
        super().__init__(self.side, params, load_weights, spec, rank=rank, placement=placement,
                         transport=transport, config=config, kernels=kernels)
        self.control = control

    @property
    def options(self) -> TransferConfig:
        return self.config

    def _setup(self, plan) -> None:
        super()._setup(plan)
        sizes = [self.executor.round_nbytes(r)[0 if self.side == "trainer" else 1]
                 for r in range(self.executor.num_rounds)]
        self._offsets = [sum(sizes[:r]) for r in range(len(sizes) + 1)]

    def _staged_view(self, buf: torch.Tensor, r: int) -> torch.Tensor:
        return buf[self._offsets[r]:self._offsets[r + 1]]

    def _call_one(self, peer: WorkerId, call: PeerCall, *args):
        return self.control.call([peer], call, *args)[0]

    def _wait(self, predicate, what: str) -> None:
        """Wait on ``self.cond`` (held) until ``predicate()``, at most ``timeout_s``."""
        if not self.cond.wait_for(predicate, timeout=self.config.timeout_s):
            raise TimeoutError(f"{self.worker}: {what} within timeout_s="
                               f"{self.config.timeout_s}s")

    def _poll_until(self, predicate, what: str, *, deadline: bool = True) -> None:
        """Wait for a condition on other workers (no shared condition variable to wait on)."""
        end = time.monotonic() + self.config.timeout_s
        interval = getattr(self.control, "poll_interval_s", self.poll_interval_s)
        while not predicate():
            if deadline and time.monotonic() > end:
                raise TimeoutError(f"{self.worker}: {what} within timeout_s="
                                   f"{self.config.timeout_s}s")
            time.sleep(interval)


def host_buffer(nbytes: int, like: torch.Tensor) -> torch.Tensor:
    """Host staging memory for a worker whose arenas are ``like``'s; pinned next to a GPU."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=like.device.type == "cuda")
