"""`Streaming`: the one transfer a controller runs on a thread of its own (sender staging).

With SS and async, `MeshTransfer.update` returns once the trainers' staged copy is taken; the
rounds of that version then run here while the controller goes on (the next train step). At
most one runs at a time: the next version's staging waits for it (`join`). Its result, or
the exception it ended with, is handed to whichever call joins it first; a failure is raised
once.
"""

from __future__ import annotations

import contextvars
import threading

from weightbridge import TransferFailed


class Streaming:
    """At most one background call, its result and its failure (module doc)."""

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._result = None
        self._error: BaseException | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, fn, *args) -> None:
        """Run ``fn(*args)`` on a thread (none may be running: `join` first)."""
        assert not self.running, "join the running transfer before starting another"
        self._result, self._error = None, None

        def run() -> None:
            try:
                self._result = fn(*args)
            except BaseException as e:  # noqa: BLE001  (handed to the joiner)
                self._error = e

        # In a copy of this context: Monarch's client context lives in contextvars.
        ctx = contextvars.copy_context()
        self._thread = threading.Thread(target=ctx.run, args=(run,), daemon=True,
                                        name="weightbridge-streaming")
        self._thread.start()

    def join(self, timeout_s: float):
        """Wait for the running call (at most ``timeout_s``); return its result (None: no call
        since the last join) or raise its failure.

        Raises:
            TransferFailed: it is still running after ``timeout_s`` (a worker that neither
                finishes nor fails past every bound of the transfer).
        """
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
            if thread.is_alive():
                raise TransferFailed(f"the transfer streaming on the controller did not end "
                                   f"within {timeout_s:g}s (its rounds and a recovery are "
                                   f"each bounded by timeout_s: a worker is wedged); close "
                                   f"this MeshTransfer and start again")
            self._thread = None
        result, self._result = self._result, None
        self.raise_failure()
        return result

    def raise_failure(self) -> None:
        """Raise the failure of the last call once it ended (once)."""
        if self._thread is not None and self._thread.is_alive():
            return
        error, self._error = self._error, None
        if error is not None:
            raise error
