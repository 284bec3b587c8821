"""`SenderAdapter`: a trainer worker's `connect` and `send_weights`; rank 0 sequences transfers.

See `weightbridge.adapters` for the whole picture and docs/integration.md for the user's view.
"""

from __future__ import annotations

import contextvars
import threading

import torch

from weightbridge.adapter_base import (FORWARD_STAGES, AdapterOptions, _host_buffer, _Worker,
                                       setup_group)
from weightbridge.boxcopy import CopyKernels
from weightbridge.coordination import SenderStage, StagingSlots
from weightbridge.types import Placement, Stage, WorkerId


class SenderAdapter(_Worker):
    """A trainer worker's side: `connect` once, `send_weights(version)` after each step."""

    side = "trainer"

    def __init__(self, params, load_weights, spec, *, rank: int, control, transport,
                 options: AdapterOptions = AdapterOptions(), placement: Placement | None = None,
                 kernels: CopyKernels | None = None):
        super().__init__(params, load_weights, spec, rank=rank,
                         placement=placement or Placement("trainer"), control=control,
                         transport=transport, options=options, kernels=kernels)
        self.stage = SenderStage()
        self._staging: torch.Tensor | None = None
        self._ready = 0  # non-SS: the version this trainer waits in send_weights with
        self._done = 0  # newest version whose transfer finished
        self._connected = threading.Event()
        # Rank 0 only: the engines' staging slots (RS) and the sequencing thread (SS).
        self.slots: StagingSlots | None = None
        self._session_lock = threading.Lock()
        self._slots_lock = threading.Lock()
        self._joined: set[WorkerId] = set()
        self._thread: threading.Thread | None = None
        self._kick_lock = threading.Lock()
        self.error: BaseException | None = None

    # -- the user's calls -----------------------------------------------------------------------

    def connect(self) -> None:
        """Collective over the trainers: probe every worker, plan on rank 0, build executors.

        Rank 0 gathers every source map through the control plane, plans, and hands each worker
        its plan; the others wait for their plan. Moves no weights.
        """
        if self.worker.index == 0:
            setup_group(self.control, self.options.round_bytes)
            self.slots = StagingSlots(self.control.num_engines)
        if not self._connected.wait(self.options.timeout_s):
            raise TimeoutError(f"{self.worker}: no plan from trainer 0 within timeout_s; every "
                               f"trainer must call connect()")

    def send_weights(self, version: int) -> None:
        """Collective over the trainers: move ``version`` (the weights in the parameters now).

        Returns when (see `Mode.trainer_returns_when`): SS and async, once this trainer's bytes
        are copied to host staging; RS, once they landed in the rollouts' staging; sync, once
        every rollout installed them.

        Raises:
            ValueError: a version not newer than the last one sent.
            TimeoutError: (sync) rollouts that do not poll within ``timeout_s``.
        """
        if self.executor is None:
            raise RuntimeError("call connect() before send_weights()")
        self._raise_background_error()
        if self.options.sender_staging:
            self._stage(version)
            if self.worker.index == 0:
                self._kick()
            self._log(("resume", version))
            return
        with self.cond:
            if version <= max(self._ready, self._done):
                raise ValueError(f"send_weights(version={version}) after version "
                                 f"{max(self._ready, self._done)}: versions must increase")
            self._ready = version
            self._log(("ready", version))
            self.cond.notify_all()
        if self.worker.index == 0:
            self._run_session(version)
        with self.cond:
            self._wait(lambda: self._done >= version,
                       f"the transfer of version {version} did not finish")
        self._log(("resume", version))

    # -- staging (SS) ---------------------------------------------------------------------------

    def _stage(self, version: int) -> None:
        with self.cond:
            self._wait(lambda: not self.stage.busy,
                       "the previous transfer did not release the staging buffer")
            if self._staging is None:
                self._staging = _host_buffer(self._offsets[-1], self.executor.arenas[0])
            for r in range(self.executor.num_rounds):
                # Pack on the device into a round arena (free: with SS the transfer reads the
                # staging copy), then copy to host memory (D2H on GPUs).
                self.executor.pack(r)
                view = self._staged_view(self._staging, r)
                view.copy_(self.executor.arenas[r % 2][:view.numel()])
            self.stage.stage(version)
            self._log(("staged", version))
            # Released: logged under the lock the sequencer reads `pending` with, so before any
            # transfer of this version starts.
            self._log(("released", version))
            self.cond.notify_all()

    def _kick(self) -> None:
        with self._kick_lock:  # _drain clears _thread under the same lock: no lost wake-up
            if self._thread is None:
                # Run in a copy of this thread's context: an actor's messaging context lives
                # in contextvars, and calls on peers from the thread need it.
                ctx = contextvars.copy_context()
                self._thread = threading.Thread(target=ctx.run, args=(self._drain,),
                                                daemon=True, name="weightbridge-sender")
                self._thread.start()

    def _drain(self) -> None:
        """Rank 0's SS sequencer: transfer staged versions until none is pending.

        Without RS the rollouts must join first; the staging buffers stay free meanwhile, so a
        rollout that stops polling never blocks the trainers: they keep staging newer versions
        (each superseding the last) and the transfer carries the newest one once all joined.
        """
        try:
            trainers = self.control.trainers()
            while True:
                with self._kick_lock:
                    first = self._wb_pending()
                    if first is None:
                        self._thread = None
                        return
                if not self.options.receiver_staging:
                    self._gather(first, deadline=False)
                # Every trainer stages each version; wait until they hold the same one.
                self._poll_until(lambda: len({t._wb_pending() for t in trainers}) == 1,
                                 "the trainers did not stage the same version")
                version = self._wb_pending()
                # Pin every staging buffer on that version; if one moved on meanwhile, retry.
                started = []
                for t in trainers:
                    if not t._wb_stage_start(version):
                        break
                    started.append(t)
                if len(started) < len(trainers):
                    for t in started:
                        t._wb_stage_cancel()
                    continue
                try:
                    self._run_session(version)
                finally:
                    for t in trainers:
                        t._wb_stage_finish()
        except BaseException as e:  # surfaced by the next send_weights / wait_idle
            self.error = e
            with self._kick_lock:
                self._thread = None

    def _raise_background_error(self) -> None:
        if self.error is not None:
            e, self.error = self.error, None
            raise RuntimeError(f"{self.worker}: a background transfer failed: {e}") from e

    def wait_idle(self) -> None:
        """Rank 0, SS modes: wait until every staged version was transferred (end of a run)."""
        self._poll_until(lambda: self._thread is None,
                         "staged versions were not all transferred")
        self._raise_background_error()

    # -- the transfer (rank 0) ------------------------------------------------------------------

    def _each(self, peers: list, name: str, *args) -> None:
        """The same call on every peer, all issued before any is awaited where the control
        plane can (``call_all``); a stage's calls never depend on each other."""
        call_all = getattr(self.control, "call_all", None)
        if call_all is not None:
            call_all(peers, name, *args)
        else:
            for p in peers:
                getattr(p, name)(*args)

    def _gather(self, version: int, *, deadline: bool = True) -> None:
        """RS off: offer ``version`` to every engine and wait until every rollout joined."""
        for r0 in self.control.engine_rank0s():
            r0._wb_offer(version)
        want = {WorkerId("rollout", j) for j in range(len(self.control.receivers()))}
        self._poll_until(lambda: want <= self._joined,
                         f"rollout workers {sorted(str(w) for w in want - self._joined)} did "
                         f"not poll_requests() for version {version}; in sync and SS modes "
                         f"every rollout must poll between inference steps", deadline=deadline)

    def _run_session(self, version: int) -> None:
        """Move ``version`` end to end; every other worker's part is called on it."""
        control, mode = self.control, self.options.mode
        with self._session_lock:
            trainers, receivers = control.trainers(), control.receivers()
            if not mode.sender_staging:  # every trainer is inside send_weights(version)
                self._poll_until(lambda: all(t._wb_ready() >= version for t in trainers),
                                 f"not every trainer called send_weights({version})")
            if mode.receiver_staging:
                with self._slots_lock:
                    slots = self.slots.begin(version)
            else:
                slots = {}
                if not mode.sender_staging:
                    self._gather(version)
                with self.cond:
                    self._joined = set()
            # TODO(perf): overlap round r's landing with round r+1's send, as the controller
            # path does (the two arenas allow it).
            for r in range(self.executor.num_rounds):
                self._each(trainers, "_wb_send_round", r)
                for stage in FORWARD_STAGES:
                    self._each(receivers, "_wb_forward", r, stage)
                self._each(receivers, "_wb_land", r, slots)
            if mode.receiver_staging:
                with self._slots_lock:
                    self.slots.complete(version)
                for t in trainers:  # landed: the trainers go on before any install
                    t._wb_transferred(version)
                for r0 in control.engine_rank0s():
                    r0._wb_offer(version)
            else:
                for x in receivers:
                    x._wb_session_done(version)
                for t in trainers:  # in every rollout's parameters
                    t._wb_transferred(version)

    # -- called by rank 0 (endpoints on a mesh) -------------------------------------------------

    def _wb_setup(self, plan, ranges=()) -> dict:
        self._setup(plan)
        return {}

    def _wb_set_peers(self, handles: dict) -> None:
        self.transport.set_peers(handles)
        self._connected.set()

    def _wb_ready(self) -> int:
        return self._ready

    def _wb_pending(self) -> int | None:
        with self.cond:
            return self.stage.pending

    def _wb_stage_start(self, version: int) -> bool:
        """Pin the staging buffer if it holds ``version`` (False: it moved on)."""
        with self.cond:
            if self.stage.pending != version:
                return False
            self.stage.start()
            return True

    def _wb_stage_cancel(self) -> None:
        with self.cond:
            self.stage.cancel()
            self.cond.notify_all()

    def _wb_stage_finish(self) -> None:
        with self.cond:
            self.stage.finish()
            self.cond.notify_all()

    def _wb_send_round(self, r: int) -> None:
        if self.options.sender_staging:
            buf = self._staged_view(self._staging, r)
            self._issue(r, Stage.RECEIVE, buf)
        else:
            self.executor.pack(r)
            self._issue(r, Stage.RECEIVE)

    def _wb_transferred(self, version: int) -> None:
        if not self.options.sender_staging:
            self._log(("released", version))
        with self.cond:
            self._done = max(self._done, version)
            self.cond.notify_all()

    def _wb_join(self, worker: WorkerId) -> None:
        with self.cond:
            self._joined.add(worker)
            self.cond.notify_all()

    def _wb_claim(self, engine: int):
        with self._slots_lock:  # a slot being filled holds no landed version: never claimed
            return self.slots.claim(engine)
