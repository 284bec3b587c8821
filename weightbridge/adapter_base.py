"""What both adapters share: options, the per-worker executor and staging layout, and the
group set-up rank 0's connect runs (probe everyone, plan once, hand out plans and handles).

The public entry point is `weightbridge.adapters`; see its docstring and docs/integration.md.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

import torch

from weightbridge.boxcopy import CopyKernels, default_kernels
from weightbridge.coordination import Mode
from weightbridge.executor import WorkerExecutor, incoming_ranges
from weightbridge.plan import TransferPlan, plan_transfer
from weightbridge.probe import extract_source_map
from weightbridge.types import CheckpointSpec, Placement, SourceMap, Stage, WorkerId

FORWARD_STAGES = (Stage.EXTERNAL, Stage.INTERNAL)
_SEQ = itertools.count()
"""Process-wide event order (itertools.count is atomic under the GIL): tests compare it."""
PEER_SHARE = 0.8
"""`AdapterOptions.peer_timeout_s` as a share of ``timeout_s``."""
LoadWeights = Callable[[Iterable[tuple[str, torch.Tensor]]], None]


@dataclass(frozen=True, slots=True, kw_only=True)
class AdapterOptions:
    """Switches and limits shared by every adapter of one transfer group.

    Example: ``AdapterOptions(sender_staging=True, receiver_staging=True, timeout_s=30)``
    """

    sender_staging: bool = False
    """SS: `send_weights` returns once the trainer's bytes are in host memory."""
    receiver_staging: bool = False
    """RS: bytes land in host staging while rollouts generate; installed at a later poll."""
    timeout_s: float = 60.0
    """Longest wait for a peer (a rollout that stops polling, a trainer that never sends), and
    the bound within which a lost rollout worker surfaces as `TransferFailed`."""
    round_bytes: int = 1 << 20
    """Round buffer capacity per worker (planner argument)."""

    def __post_init__(self):
        if not self.timeout_s > 0 or self.round_bytes < 1:
            raise ValueError(f"timeout_s ({self.timeout_s}) and round_bytes "
                             f"({self.round_bytes}) must be positive")

    @property
    def peer_timeout_s(self) -> float:
        """How long one write or call to a peer may take before the peer counts as lost:
        ``PEER_SHARE`` of ``timeout_s``, leaving the rest to find which worker is gone and
        re-plan without its engine. Give it to the transport and the control plane."""
        return PEER_SHARE * self.timeout_s

    @property
    def mode(self) -> Mode:
        return Mode.from_flags(sender_staging=self.sender_staging,
                               receiver_staging=self.receiver_staging)


class _Worker:
    """What both adapters share: the probe, the executor, a condition, the staging layout."""

    side = ""

    def __init__(self, params: Mapping[str, torch.Tensor], load_weights: LoadWeights,
                 spec: CheckpointSpec, *, rank: int, placement: Placement, control, transport,
                 options: AdapterOptions, kernels: CopyKernels | None = None):
        self.params, self.load_weights, self.spec = dict(params), load_weights, spec
        self.worker, self.placement = WorkerId(self.side, rank), placement
        self.control, self.transport, self.options = control, transport, options
        self.kernels = kernels
        self.executor: WorkerExecutor | None = None
        self.cond = threading.Condition()
        self.events: list[tuple[int, str, int]] = []
        """(sequence number, what, version): what this worker did, ordered process-wide."""

    def _log(self, event: tuple[str, int]) -> None:
        self.events.append((next(_SEQ), *event))

    def _source_map(self) -> SourceMap:
        """Probe this worker's own load_weights; the parameters are restored afterwards."""
        saved = {n: p.detach().clone() for n, p in self.params.items()}
        try:
            return extract_source_map(self.params, self.load_weights, self.spec)
        finally:
            with torch.no_grad():
                for n, p in self.params.items():
                    p.copy_(saved[n])

    def _wb_source_map(self) -> tuple[SourceMap, Placement]:
        return self._source_map(), self.placement

    def _wb_ping(self) -> bool:
        """Rank 0 asks who is still there after a transfer failed."""
        return True

    def _setup(self, plan) -> None:
        device = next(iter(self.params.values())).device
        self.executor = WorkerExecutor(plan, self.params,
                                       self.kernels or default_kernels(device))
        sizes = [self.executor.round_nbytes(r)[0 if self.side == "trainer" else 1]
                 for r in range(self.executor.num_rounds)]
        self._offsets = [sum(sizes[:r]) for r in range(len(sizes) + 1)]

    def _staged_view(self, buf: torch.Tensor, r: int) -> torch.Tensor:
        return buf[self._offsets[r]:self._offsets[r + 1]]

    def _wait(self, predicate, what: str) -> None:
        """Wait on ``self.cond`` (held) until ``predicate()``, at most ``timeout_s``."""
        if not self.cond.wait_for(predicate, timeout=self.options.timeout_s):
            raise TimeoutError(f"{self.worker}: {what} within timeout_s="
                               f"{self.options.timeout_s}s")

    def _poll_until(self, predicate, what: str, *, deadline: bool = True) -> None:
        """Wait for a condition on other workers (no shared condition variable to wait on)."""
        end = time.monotonic() + self.options.timeout_s
        while not predicate():
            if deadline and time.monotonic() > end:
                raise TimeoutError(f"{self.worker}: {what} within timeout_s="
                                   f"{self.options.timeout_s}s")
            time.sleep(getattr(self.control, "poll_interval_s", 0.0005))

    def _issue(self, r: int, stage: Stage, buffer: torch.Tensor | None = None) -> None:
        self.transport.wait([self.transport.write(peer, key, src)
                             for peer, key, src in self.executor.writes(r, stage, buffer)])


class TransferFailed(RuntimeError):
    """A rollout worker was lost during a transfer (its process died or stopped answering).

    The message names the worker, its engine and the version, says which engines were excluded
    and what the surviving engines hold, and how to bring the lost engine back (reconnect).
    """


@dataclass(frozen=True, slots=True)
class GroupMaps:
    """Rank 0's record of connect: every worker's source map, kept to re-plan without
    re-probing (a probe overwrites a worker's parameters for a moment: not while it generates)."""

    trainers: tuple
    """(SourceMap, Placement) per trainer."""
    receivers: tuple
    """(SourceMap, Placement) per rollout worker."""


def setup_group(control, round_bytes: int) -> tuple[GroupMaps, TransferPlan]:
    """Rank 0's connect: probe every worker, plan once, hand out plans and transport handles.
    Returns the maps (kept for re-planning) and the plan.

    Every worker is probed at once (`control.gather`): a real engine's load_weights may be
    collective over its ranks (a DCP load over the trainers), so probing one rank after
    another would deadlock. Only ``_wb_`` calls on the workers the control plane returns, so
    it runs the same over direct calls (`adapters_local.LocalControl`) and actor endpoints.
    """
    trainers, receivers = control.trainers(), control.receivers()
    found = control.gather(trainers + receivers, "_wb_source_map")
    maps = GroupMaps(tuple(found[:len(trainers)]), tuple(found[len(trainers):]))
    return maps, plan_group(control, maps, round_bytes)


def plan_group(control, maps: GroupMaps, round_bytes: int, *, excluded=frozenset(),
               generation: int = 0) -> TransferPlan:
    """Plan from ``maps``, set every worker up and return the plan, leaving out the rollout workers whose index
    is in ``excluded``: they get an empty source map, so no byte is routed to or through them,
    and they are not called. ``generation`` numbers the receivers' staging slots (a re-plan
    keeps a slot an engine is installing from until it is done)."""
    trainers, receivers = control.trainers(), control.receivers()
    rollout_maps = [(dataclasses.replace(m, pieces=(), unsourced=(), unused=()), p)
                    if j in excluded else (m, p) for j, (m, p) in enumerate(maps.receivers)]
    plan = plan_transfer(list(maps.trainers), rollout_maps, round_bytes=round_bytes)
    plans = {w: plan.for_worker(w) for w in plan.workers}
    ranges = incoming_ranges(plans.values())
    live = [(WorkerId("rollout", j), x) for j, x in enumerate(receivers) if j not in excluded]
    handles = {}
    for w, x in live:
        handles.update({(w, key): h for key, h in
                        x._wb_setup(plans[w], sorted(ranges.get(w, ())), generation).items()})
    for i, t in enumerate(trainers):
        t._wb_setup(plans[WorkerId("trainer", i)])
    for w, proxy in live + [(WorkerId("trainer", i), t) for i, t in enumerate(trainers)]:
        mine = {(wr.peer, (r.index % 2, wr.peer_offset, wr.nbytes))
                for r in plans[w].rounds for wr in r.writes}
        proxy._wb_set_peers({k: handles[k] for k in mine if k in handles})
    return plan


class PeerFailed:
    """A peer call's error, held among `gather`'s results until every peer has answered."""

    def __init__(self, error: BaseException):
        self.error = error


def gathered(out: list, return_errors: bool) -> list:
    """`gather`'s results in peer order: raise the first peer's error, or, with
    ``return_errors``, return the errors in place of results."""
    if not return_errors:
        for r in out:
            if isinstance(r, PeerFailed):
                raise r.error
    return [r.error if isinstance(r, PeerFailed) else r for r in out]


def _host_buffer(nbytes: int, like: torch.Tensor) -> torch.Tensor:
    """Host staging memory for a worker whose arenas are ``like``'s; pinned next to a GPU."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=like.device.type == "cuda")
