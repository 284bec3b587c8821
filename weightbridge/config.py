"""`TransferConfig`: the one validated set of knobs every path shares.

The controller (`controller.MeshTransfer`), the adapters (`SenderAdapter`, `ReceiverAdapter`)
and the in-process path (`run_plan_locally`) all take it; one object describes one transfer
group, so every worker of the group must be given an equal one.

Typical usage::

    config = TransferConfig(round_bytes=8 << 20, depth=2, timeout_s=60,
                            sender_staging=True, receiver_staging=False)
    config.wait_s                      # 180.0: how long a whole transfer may be waited for
    config.differences(other)          # the fields two configs disagree on (checked at connect)
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field

DEFAULT_ROUND_BYTES = 8 << 20
"""Per-round fixed costs (a control message per step, one pack and one assemble launch) dominate
rounds under a few MiB (`benchmarks/round_size.py`); bigger rounds cost `depth` x this much
buffer per worker and, where links bound the transfer, a longer pipeline fill. Not a measured
optimum: on one host larger rounds kept winning, on slow emulated links 512 KiB at depth 3
did (docs/performance.md, "Round size")."""
DEFAULT_DEPTH = 2
"""Round buffers per worker unless told otherwise (the paper's double buffering): the default of
`TransferConfig.depth` and of every function that takes a ``depth``."""
WAIT_TIMEOUTS = 3
"""`TransferConfig.wait_s` in units of ``timeout_s``."""
MAX_TIMEOUT_S = 86_400
"""The longest `TransferConfig.timeout_s`, one day: waits are bounded (a lost peer must
surface) and a deadline is a few hundred timeouts (``timeout_s`` x rounds), which Python's
timed waits must still take."""
ARENAS = ("device", "host")
"""`TransferConfig.arenas` choices."""
TRAINER_RESTORES = ("host-copy", "none")
"""`TransferConfig.trainer_restore` choices."""
RDMA_WRITES = ("per-range", "batched")
"""`TransferConfig.rdma_writes` choices."""
ROUND_CONTROLS = ("stages", "rounds")
"""`TransferConfig.round_control` choices."""
DEFAULT_ROUND_CONTROL = "stages"
DEFAULT_SOURCE_MAP_CACHE = "~/.cache/weightbridge/source-maps"
"""`TransferConfig.source_map_cache` unless told otherwise: the user's cache directory, on each
host (``~`` is the home of the user each worker runs as)."""
DEFAULT_PLAN_CACHE = "~/.cache/weightbridge/plans"
"""`TransferConfig.plan_cache` unless told otherwise: the user's cache directory on the host
where connect runs (the controller, or the adapters' trainer 0)."""
PEER_SHARE = 0.7
"""`TransferConfig.peer_timeout_s` as a share of ``timeout_s``."""
NOTICE_SHARE = 0.1
"""`TransferConfig.notice_timeout_s` as a share of ``timeout_s``. With `PEER_SHARE` and the
drain (a quarter of this), 0.825 of ``timeout_s`` is waiting; the rest (1.75 s of 10) is
finding the lost worker, re-planning and, in sync mode, re-sending, which on a host loaded by
other jobs took up to 1.2 s (a share of 0.8 left 0.75 s, and the error came up to 0.5 s
late)."""


class Mode(enum.Enum):
    """The four synchronization modes: sender staging (SS) x receiver staging (RS)."""

    SYNC = "sync"
    """SS off, RS off: the trainer and the rollouts block until the update is installed."""
    SS = "ss"
    """Trainer resumes once its data is copied to host staging; rollouts block in the transfer."""
    RS = "rs"
    """Rollouts keep generating while bytes land in host staging; install at the next poll.
    The trainer blocks until its bytes have left (landed in the rollouts' staging)."""
    ASYNC = "async"
    """Both: the trainer resumes after staging, the rollouts install at a later poll."""

    @classmethod
    def from_flags(cls, *, sender_staging: bool, receiver_staging: bool) -> "Mode":
        return {(False, False): cls.SYNC, (True, False): cls.SS,
                (False, True): cls.RS, (True, True): cls.ASYNC}[
                    (bool(sender_staging), bool(receiver_staging))]

    # The two switches, for building a `TransferConfig` from a mode. Code that runs a
    # transfer asks the policy questions below instead, so each answer has one owner.

    @property
    def sender_staging(self) -> bool:
        return self in (Mode.SS, Mode.ASYNC)

    @property
    def receiver_staging(self) -> bool:
        return self in (Mode.RS, Mode.ASYNC)

    @property
    def sends_staged_copy(self) -> bool:
        """Whether the rounds read each trainer's host copy, taken when it called
        `send_weights` (or the controller's `update`) and packed for the plan in force then,
        rather than its live parameters: the trainer may change its parameters once the call
        returned, and nothing checks them against what was sent."""
        return self.sender_staging

    @property
    def lands_in_staging(self) -> bool:
        """Whether the rounds land in the rollouts' host staging slots, installed into the
        parameters at a later poll (all of an engine's workers at the same one), rather than
        in the parameters themselves."""
        return self.receiver_staging

    @property
    def trainer_returns_when(self) -> str:
        """What `send_weights` waits for: "staged" (its own host copy), "landed" (every byte in
        the rollouts' staging buffers) or "installed" (every rollout runs the new version)."""
        if self.sends_staged_copy:
            return "staged"
        return "landed" if self.lands_in_staging else "installed"

    @property
    def resends_after_loss(self) -> bool:
        """Whether a version that lost workers part-way is re-sent to the surviving engines:
        the trainers' parameters still hold it without sender staging; with it, the staged
        copy was laid out for the plan that lost them, and the next version reaches them."""
        return not self.sends_staged_copy

    @property
    def rollout_blocks_for_transfer(self) -> bool:
        """Whether a rollout's poll that takes an update waits for the bytes to move (True) or
        only copies already staged bytes into its parameters (False)."""
        return not self.lands_in_staging

    @property
    def checks_params_unchanged(self) -> bool:
        """Whether a trainer's parameters are hashed when the call starts and after the rounds
        (with `TransferConfig.checksums`): the rounds read them live, so a change during the
        send would mix two states in the rollouts."""
        return not self.sends_staged_copy


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferConfig:
    """Round size, pipeline depth, timeouts and the synchronization mode of one transfer group.

    Example: ``TransferConfig(round_bytes=1 << 20, depth=3, sender_staging=True)`` is the SS
    mode with 1 MiB rounds and three round buffers per worker.
    """

    round_bytes: int = DEFAULT_ROUND_BYTES
    """Round buffer capacity per worker (the planner packs at most this much per link end)."""
    depth: int = DEFAULT_DEPTH
    """Round buffers per worker: round r uses buffer r % depth, so round r + depth may enter a
    worker only once round r was assembled there (2 in the paper; 3 hides a control round
    trip per round where control messages are slow against a round; 4 also absorbs rounds
    whose forwards run slow on shared links: docs/performance.md, "With a fourth round
    buffer"). Each buffer is ``round_bytes`` of device memory per worker."""
    timeout_s: float = 60.0
    """Longest wait for a peer (a write, a peer's answer, a rollout that stops polling); a lost
    worker surfaces within about this long. Finite, at most `MAX_TIMEOUT_S` (a day)."""
    sender_staging: bool = False
    """SS: `send_weights` returns once the trainer's bytes are in host memory."""
    receiver_staging: bool = False
    """RS: bytes land in host staging while rollouts generate; installed at a later poll."""
    arenas: str = "device"
    """Where each worker's round buffers (the memory RDMA reads and writes) live:
    ``"device"`` (default): on the parameters' device, GPU memory that RDMA reaches directly
    where GPUDirect RDMA is set up (Monarch's ibverbs backend), so a round costs no PCIe hop;
    ``"host"``: in host memory (pinned next to a real GPU), which every RDMA backend registers,
    with one round of device scratch for pack and assemble and a copy across PCIe per round.
    For GPU parameters only: CPU parameters' arenas are host memory either way."""
    checksums: bool = True
    """Every write's bytes are checksummed by its writer and again by its receiver once the
    round landed, before anything is assembled; a mismatch fails the update closed, naming
    the worker, the round and the parameters (`weightbridge.execution.checksum`)."""

    rdma_writes: str = "per-range"
    """How a worker starts one step's RDMA writes (`weightbridge.mesh.transport`):
    ``"per-range"`` (default): a ``write_from`` per byte range, all in flight at once, each
    bounded by `peer_timeout_s`; ``"batched"``: one `monarch.rdma.RDMAAction` of the step's
    ranges, one future bounded by `peer_timeout_s`. Monarch 0.7.0's TCP fallback runs an
    action's ranges one after another, and it did not measure faster there
    (docs/performance.md, "Batched RDMA writes"); for an ibverbs NIC, measure it."""

    round_control: str = DEFAULT_ROUND_CONTROL
    """How the controller drives an update's rounds (`weightbridge.coordination.sequencer`):
    ``"stages"`` (default): it starts each stage of a round on its workers and hears it end
    (send, the forwards between and within nodes, land: up to four trips through it per
    round, a message per worker per stage); ``"rounds"``: one message per worker per round,
    and the writers of a stage tell their readers directly when their bytes landed
    (`weightbridge.coordination.signals`): one trip through the controller per round and
    fewer messages through it, but not a faster update on this project's emulated cluster
    (docs/performance.md, "Trips through the controller"); measure it where the controller
    drives many workers. The controller's path and the adapters both run it."""

    source_map_cache: str | None = DEFAULT_SOURCE_MAP_CACHE
    """Directory where connect keeps each worker's source map across restarts
    (`weightbridge.discovery.cache`; a few KiB per worker), or None to probe every time. A
    later connect of the same workers, checkpoint, parameters and loaders runs only the probe's
    verification pass on the kept maps (one load instead of the probe's two to four) when
    every worker holds one, and every worker probes again if any lacks one or fails. On by
    default: a map is never trusted unverified, and the entries are small, named by a digest
    of what decides them. Give a node-local directory
    where the home directory is shared by many nodes or not writable (it is then skipped with
    a `weightbridge.discovery.cache.SourceMapCacheWarning`)."""

    plan_cache: str | None = DEFAULT_PLAN_CACHE
    """Directory where connect keeps the plan across restarts
    (`weightbridge.coordination.plan_cache`), on the host where connect runs, or None to plan
    every time. A later connect whose gathered source maps, placements, ``round_bytes`` and
    ``depth`` are the same, on the same library code, reads the plan and every worker's plan
    instead of building them: at the paper's largest deployment about 12 of the controller's
    15 s of connect here. On by default: a plan is a function of what its key digests. The
    three most recently used entries stay (Kimi-K2's is about 200 MiB); an entry is read only
    from a file of this user's, in a directory no other user can write."""

    trainer_restore: str = "none"
    """How a trainer gets its weights back after connect's probe, which overwrites them.
    ``"none"`` (default): no copy and no memory; the trainer connects before it loads its
    real weights, or loads them again through its own loader after connect (one load of its
    checkpoint). Its first send refuses, before any byte moves, parameters that still hold
    the probe's values (a ``ValueError`` naming them). ``"host-copy"``: copied to host memory
    before the probe and back after it, at 1.0x the trainer's parameter bytes of host memory
    (pinned next to a real GPU) for the probe's duration, one device-to-host and one
    host-to-device copy. Rollouts keep no copy either way."""

    mode: Mode = field(init=False, repr=False, compare=False)
    """SYNC, SS, RS or ASYNC, from the two staging switches (derived; not an argument)."""

    def __post_init__(self) -> None:
        if isinstance(self.round_bytes, bool) or not isinstance(self.round_bytes, int) \
                or self.round_bytes < 1:
            raise ValueError(f"round_bytes must be a positive int (bytes per round buffer), "
                             f"got {self.round_bytes!r}")
        if isinstance(self.depth, bool) or not isinstance(self.depth, int) or self.depth < 2:
            raise ValueError(f"depth must be an int >= 2 (round buffers per worker: one fills "
                             f"while another drains), got {self.depth!r}")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) \
                or not 0 < self.timeout_s <= MAX_TIMEOUT_S:
            raise ValueError(f"timeout_s must be a number of seconds in (0, {MAX_TIMEOUT_S}] "
                             f"(the longest wait for a peer; at most a day), got "
                             f"{self.timeout_s!r}")
        if self.arenas not in ARENAS:
            raise ValueError(f"arenas must be one of {ARENAS} (where round buffers live), got "
                             f"{self.arenas!r}")
        if self.trainer_restore not in TRAINER_RESTORES:
            raise ValueError(f"trainer_restore must be one of {TRAINER_RESTORES} (how a trainer "
                             f"gets its weights back after the probe), got "
                             f"{self.trainer_restore!r}")
        if self.rdma_writes not in RDMA_WRITES:
            raise ValueError(f"rdma_writes must be one of {RDMA_WRITES} (how a step's RDMA "
                             f"writes are started), got {self.rdma_writes!r}")
        if self.round_control not in ROUND_CONTROLS:
            raise ValueError(f"round_control must be one of {ROUND_CONTROLS} (how the "
                             f"controller drives the rounds), got {self.round_control!r}")
        for name in ("source_map_cache", "plan_cache"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a directory path (str) or None (no cache), "
                                 f"got {value!r}")
        for name in ("sender_staging", "receiver_staging", "checksums"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        # Read once per round per worker by the policy questions: built here, once.
        object.__setattr__(self, "mode", Mode.from_flags(
            sender_staging=self.sender_staging, receiver_staging=self.receiver_staging))

    @property
    def peer_timeout_s(self) -> float:
        """How long one write or call to a peer may take before the peer counts as lost:
        ``PEER_SHARE`` of ``timeout_s``, leaving the rest to find which worker is gone and
        re-plan without its engine."""
        return PEER_SHARE * self.timeout_s

    @property
    def notice_timeout_s(self) -> float:
        """How long a liveness check (`PeerCall.PING`) or a failure notice (``FAIL``,
        ``FAILED``) may take: `NOTICE_SHARE` of ``timeout_s``. A step that timed out is
        followed by one round of these, so a stall still surfaces, with the lost worker named,
        within ``timeout_s``; what `peer_timeout_s`, this and the drain leave is for
        re-planning."""
        return NOTICE_SHARE * self.timeout_s

    @property
    def drain_timeout_s(self) -> float:
        """How long `run_update` waits, after an update failed, for the steps of it still
        running to end on every worker (`PeerCall.DRAIN`): a quarter of
        `notice_timeout_s`. The steps it waits for end within milliseconds once told; a
        worker that does not answer (stalled) costs the whole wait, and a stall must still
        surface, after the pings that follow a failure, within ``timeout_s``."""
        return self.notice_timeout_s / 4

    @property
    def wait_s(self) -> float:
        """How long a caller waits for a whole transfer it joined or started (`send_weights`
        for rank 0's sequencing, a poll for the transfer to start, `wait_for_version`,
        `wait_idle`, a membership change): ``WAIT_TIMEOUTS`` (3) x ``timeout_s``. A lost peer
        takes up to ``timeout_s`` to find, then a re-plan and a re-send, so a transfer that
        lost a worker still finishes within it."""
        return WAIT_TIMEOUTS * self.timeout_s

    def differences(self, other: "TransferConfig") -> list[str]:
        """``field: mine != theirs`` for every field ``other`` sets differently (empty when
        equal): what connect names when workers of one group were given different configs."""
        return [f"{f.name}: {getattr(self, f.name)!r} != {getattr(other, f.name)!r}"
                for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(other, f.name)]
