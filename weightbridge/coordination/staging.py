"""Host staging of one worker's rounds: a trainer's staged copy, a rollout's staging slots.

Both hold the bytes of every round of one plan back to back, in host memory (pinned next to a
real GPU), laid out by the round sizes of the executor they were made for::

    StagedCopy   (trainers, sender staging)   take(v): pack every round into its arena, copy it
                                              here; the rounds' RECEIVE writes then read it, so
                                              the parameters may change (the next train step)
                                              while the version streams
    SlotBuffers  (rollouts, receiver staging) land(slot, r): round r's arena -> the slot;
                                              install(slot): every round of the slot assembled
                                              into the parameters, with the executor (plan) it
                                              was laid out for; two slots per plan generation

Who decides which slot a version lands in and which one an engine installs is the group's
`GroupLeader` (its `StagingSlots` ledger); these classes only hold and move bytes. Every path
uses them: the controller's workers (`TransferWorker`) and the adapters.
"""

from __future__ import annotations

import mmap
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # (the executor's import chain reaches the adapters, which import this)
    from weightbridge.execution.executor import WorkerExecutor


def host_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """Host memory of ``nbytes`` for a worker whose parameters are on ``device``: pinned next
    to a GPU (a real one: the emulated device has no pinned memory), else with its pages
    already mapped (`populated`)."""
    from weightbridge.execution.executor import on_real_cuda

    if on_real_cuda(device):
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    return populated(nbytes)


def populated(nbytes: int) -> torch.Tensor:
    """``nbytes`` of fresh host memory whose pages the kernel maps in one call
    (``MAP_POPULATE``), not one page fault per 4 KiB at its first write: most of the time of
    a first copy into fresh memory (335 MiB on this host: 0.14 s against 0.16-0.18 s)."""
    if nbytes == 0 or not hasattr(mmap, "MAP_POPULATE"):  # (Linux only; an empty map is refused)
        return torch.empty(nbytes, dtype=torch.uint8)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
                      | mmap.MAP_POPULATE)
    return torch.frombuffer(pages, dtype=torch.uint8)  # (keeps the map alive)


def round_offsets(executor: WorkerExecutor, side: str) -> list[int]:
    """Where each round starts in a staging buffer of ``executor``'s rounds (and the total
    last): the bytes a trainer sends per round, or a rollout receives."""
    end = 0 if side == "trainer" else 1
    sizes = [executor.round_nbytes(r)[end] for r in range(executor.num_rounds)]
    return [sum(sizes[:r]) for r in range(len(sizes) + 1)]


class StagedCopy:
    """A trainer's staged copy of its rounds (sender staging); laid out anew by `reset`
    after every set-up (allocated at the first `take`)."""

    def __init__(self):
        self.buffer: torch.Tensor | None = None
        self.offsets: list[int] = [0]
        self.version: int | None = None
        """The version the copy holds (None: none since the last set-up)."""
        self.digest: tuple[int, ...] = ()
        """Per-parameter checksums of the parameters the copy was taken from (set by the
        worker with checksums on): what data-parallel replicas compare."""

    def reset(self, executor: WorkerExecutor) -> None:
        """A new plan: the old copy is laid out for the old one."""
        self.buffer, self.version, self.digest = None, None, ()
        self.offsets = round_offsets(executor, "trainer")

    def take(self, executor: WorkerExecutor, version: int) -> None:
        """Pack every round on the parameters' device into its round arena (free: with sender
        staging the rounds read this copy, never the arenas' packed bytes), then copy it here
        (device to host on GPUs)."""
        if self.buffer is None:
            self.buffer = host_buffer(self.offsets[-1], executor.device)
        for r in range(executor.num_rounds):
            executor.pack(r)
            view = self.view(r)
            view.copy_(executor.arena(r)[:view.numel()])
        self.version = version

    def view(self, r: int) -> torch.Tensor:
        return self.buffer[self.offsets[r]:self.offsets[r + 1]]


class SlotBuffers:
    """A rollout's staging slots (receiver staging): slot number -> the bytes of one version
    of every round it receives, with the executor that assembles them.

    A plan of generation g has slots ``2 g`` and ``2 g + 1``; slots of older generations stay
    (a version landed in one is still installable) until an install from a newer one retires
    them. Slot numbers are never reused (the generation strictly increases), so a slot never
    holds memory made anew under a version the leader's ledger records as landed there.
    """

    def __init__(self):
        self._slots: dict[int, tuple[torch.Tensor, WorkerExecutor, list[int]]] = {}
        self._scratch: torch.Tensor | None = None

    def __contains__(self, slot: int) -> bool:
        return slot in self._slots

    def add(self, generation: int, executor: WorkerExecutor) -> None:
        """Make the two slots of ``generation`` for ``executor``'s rounds."""
        offsets = round_offsets(executor, "rollout")
        largest = max((offsets[r + 1] - offsets[r] for r in range(executor.num_rounds)),
                      default=0)
        # Install copies a staged round to the parameters' device first (host to device on
        # GPUs): the arenas may be receiving the next version meanwhile.
        if self._scratch is None or self._scratch.numel() < largest \
                or self._scratch.device != executor.device:
            self._scratch = torch.empty(largest, dtype=torch.uint8, device=executor.device)
        for s in (2 * generation, 2 * generation + 1):
            self._slots[s] = (host_buffer(offsets[-1], executor.device), executor, offsets)

    def land(self, slot: int, r: int, arena: torch.Tensor) -> None:
        """Round r arrived in ``arena`` (checked): keep its bytes in ``slot``."""
        buf, _, offsets = self._slots[slot]
        view = buf[offsets[r]:offsets[r + 1]]
        view.copy_(arena[:view.numel()])

    def install(self, slot: int) -> None:
        """Assemble every round held in ``slot`` into the parameters, then drop the slots of
        older generations (never claimed again)."""
        if slot not in self._slots:
            raise ValueError(f"staging slot {slot} does not exist on this worker (it holds "
                             f"{sorted(self._slots)}): the install names a slot of a plan this "
                             f"worker was never set up with")
        buf, executor, offsets = self._slots[slot]
        for r in range(executor.num_rounds):
            view = buf[offsets[r]:offsets[r + 1]]
            scratch = self._scratch[:view.numel()]
            scratch.copy_(view)
            executor.assemble(r, scratch)
        first = slot - slot % 2
        for s in [s for s in self._slots if s < first]:
            del self._slots[s]
