"""`ReceiverAdapter`: a rollout worker's `poll_requests`, and its part of every transfer.

See `weightbridge.adapters` for the whole picture and docs/integration.md for the user's view.
"""

from __future__ import annotations

import torch

from weightbridge.adapter_base import AdapterOptions, TransferFailed, _host_buffer, _Worker
from weightbridge.boxcopy import CopyKernels
from weightbridge.coordination import EngineCoordinator, Relay, WorkerVersions
from weightbridge.types import Placement, Stage


class ReceiverAdapter(_Worker):
    """A rollout worker's side: `poll_requests()` between inference steps."""

    side = "rollout"

    def __init__(self, params, load_weights, spec, *, rank: int, engine: int, engine_rank: int,
                 engine_size: int, control, transport, options: AdapterOptions = AdapterOptions(),
                 placement: Placement | None = None, before_update_hook=None,
                 kernels: CopyKernels | None = None):
        super().__init__(params, load_weights, spec, rank=rank,
                         placement=placement or Placement(f"rollout-e{engine}", engine=engine),
                         control=control, transport=transport, options=options, kernels=kernels)
        if self.placement.engine != engine:
            raise ValueError(f"placement {self.placement} is not in engine {engine}")
        self.engine, self.engine_rank = engine, engine_rank
        self.before_update_hook = before_update_hook
        self.versions = WorkerVersions()
        self.coordinator = EngineCoordinator(engine_size) if engine_rank == 0 else None
        self.step = 0
        self._session_done = 0
        # Staging slot number -> (host buffer, the executor and round offsets it was laid out
        # for, install scratch). A re-plan adds new slots; the old ones go once unused.
        self._slots: dict[int, tuple] = {}
        self._failure: str | None = None
        """Set when this worker's engine lost a worker: every poll_requests() raises it."""

    @property
    def version(self) -> int:
        """The version the parameters hold (0 until the first install)."""
        return self.versions.installed

    def poll_requests(self) -> int | None:
        """Call between inference steps, on every worker of the engine: installs the version the
        engine agreed on for this step, if any, and returns it (None: nothing installed).

        Rank 0 turns the sender's newest offer into a relay for the next step. The install is
        a join of the running transfer (sync, SS: blocks until the bytes are in the parameters)
        or a local copy out of a staging slot (RS, async). ``before_update_hook(version)`` runs
        first.

        Raises:
            TransferFailed: this worker's engine lost a worker during a transfer; the engine
                is out of the group (docs/integration.md, "Failures").
            TimeoutError: a transfer this poll joined did not finish within 3 x timeout_s.
        """
        self._check_failed()
        step, self.step = self.step, self.step + 1
        if self.coordinator is not None:
            claim = None
            if self.options.receiver_staging:
                seq = self.control.sequencer()
                claim = lambda: seq._wb_claim(self.engine)  # noqa: E731
            with self.cond:
                relay = self.coordinator.decide(step, claim=claim)
            if relay is not None:
                for peer in self.control.engine(self.engine):  # acked before this step runs
                    peer._wb_relay(relay)
        with self.cond:
            due = self.versions.due(step)
        if due is None:
            return None
        if self.before_update_hook is not None:
            self.before_update_hook(due.version)
        if due.slot is None:
            self._log(("join", due.version))
            self.control.sequencer()._wb_join(self.worker)
            with self.cond:
                # Rank 0 needs up to timeout_s to find a lost worker, then re-plans and
                # re-sends; meanwhile this worker's parameters may hold part of the update.
                if not self.cond.wait_for(
                        lambda: self._session_done >= due.version or self._failure,
                        timeout=3 * self.options.timeout_s):
                    raise TimeoutError(
                        f"{self.worker}: the transfer of version {due.version} did not finish "
                        f"within 3 x timeout_s={self.options.timeout_s}s; the parameters may "
                        f"hold part of it: run no inference step with them, and reconnect")
                self._check_failed()
                version = self._session_done
        else:
            with self.cond:
                buf, executor, offsets, install_buf = self._slots[due.slot]
            for r in range(executor.num_rounds):
                view = buf[offsets[r]:offsets[r + 1]]
                scratch = install_buf[:view.numel()]
                scratch.copy_(view)
                executor.assemble(r, scratch)
            with self.cond:  # slots of older plans are never claimed again
                first = due.slot - due.slot % 2
                for s in [s for s in self._slots if s < first]:
                    del self._slots[s]
            version = due.version
            self._log(("in_params", version))
        with self.cond:
            self.versions.done(Relay(version, due.at_step, due.slot))
        self._log(("installed", version))
        self.control.engine(self.engine)[0]._wb_installed(self.engine_rank, version)
        return version

    # -- called by peers (endpoints on a mesh) --------------------------------------------------

    def _wb_setup(self, plan, ranges=(), generation: int = 0) -> dict:
        """Build tables, arenas and staging slots (numbers ``2 * generation`` and the next);
        register ``ranges`` (the arena ranges peers write into) with the transport and return
        their handles. Called again after a re-plan: an install under way keeps its slot."""
        with self.cond:
            self._setup(plan)
            if self.options.receiver_staging:
                arena = self.executor.arenas[0]
                # Install copies a staged round here first (H2D on GPUs): the arenas may be
                # receiving the next version meanwhile.
                largest = max((self._offsets[r + 1] - self._offsets[r]
                               for r in range(self.executor.num_rounds)), default=0)
                install_buf = torch.empty(largest, dtype=torch.uint8, device=arena.device)
                for s in (2 * generation, 2 * generation + 1):
                    self._slots[s] = (_host_buffer(self._offsets[-1], arena), self.executor,
                                      self._offsets, install_buf)
        return self.transport.register(self.executor.arenas, ranges)

    def _wb_set_peers(self, handles: dict) -> None:
        self.transport.set_peers(handles)

    def _wb_offer(self, version: int) -> None:
        with self.cond:
            self.coordinator.offer(version)

    def _wb_relay(self, relay: Relay) -> None:
        with self.cond:
            self.versions.relay(relay)

    def _wb_installed(self, engine_rank: int, version: int) -> None:
        with self.cond:
            self.coordinator.installed(engine_rank, version)

    def _wb_forward(self, r: int, stage: Stage) -> None:
        self._issue(r, stage)

    def _wb_land(self, r: int, slots: dict[int, int]) -> None:
        """Round r landed (every stage): into the parameters, or into this engine's slot."""
        slot = slots.get(self.engine)
        if slot is None:
            self.executor.assemble(r)  # straight into the parameters (this worker waits)
        else:
            n = self._offsets[r + 1] - self._offsets[r]
            self._staged_view(self._slots[slot][0], r).copy_(self.executor.arenas[r % 2][:n])

    def _wb_fail(self, message: str) -> None:
        """Rank 0: this worker's engine lost a worker and is out of the group."""
        with self.cond:
            self._failure = message
            self.cond.notify_all()

    def _check_failed(self) -> None:
        if self._failure is not None:
            raise TransferFailed(f"{self.worker} (engine {self.engine}): {self._failure}")

    def _wb_session_done(self, version: int) -> None:
        self._log(("in_params", version))  # the last round was assembled into the parameters
        with self.cond:
            self._session_done = version
            self.cond.notify_all()
