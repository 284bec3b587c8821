"""Engines joining and leaving a running adapter group: `add_engines`, `remove_engine`.

`SenderAdapter.add_engines` and `remove_engine` hold one `TrainerMembership` (which change
this trainer is inside, how trainer 0 said each went). Both are collective over the trainers,
called between `send_weights` calls (as `send_weights` itself is collective): while every
trainer is inside the call none of them stages a version, so the trainers' tables can change
under rank 0, which does the work once every trainer is in (after the staged versions were
transferred, in the sender-staging modes; never during a transfer)::

    join:   probe only the new engines -> extend the plan in force (appended rounds,
            `weightbridge.planning.extend`) -> set up only them and the trainers
    leave:  tell the engine's workers (their poll_requests() raise) -> drop its rows when
            nothing depends on it (a mirrored engine: its forwarders take new writes), else
            re-plan the others from the kept source maps (no probe, every live worker set up)

A joining engine's first `poll_requests` returns the first version sent after the join,
whole; the engines already in keep what they run and never see a partial version.
"""

from __future__ import annotations

import threading
from typing import Callable

from weightbridge.config import WAIT_TIMEOUTS
from weightbridge.errors import from_kind
from weightbridge.types import WorkerId


class TrainerMembership:
    """One trainer's side of a membership change: which change it is inside (trainer 0 asks,
    `PeerCall.CHANGING`) and how trainer 0 said each went (`PeerCall.CHANGED`)."""

    def __init__(self, cond: threading.Condition, timeout_s: float):
        self.cond, self.timeout_s = cond, timeout_s
        self.changing: tuple | None = None
        """The change this trainer is inside (("add",), ("remove", engine)), None outside."""
        self.changed: dict[tuple, tuple | None] = {}
        """Change -> None (done) or how it failed, (kind, message, lost), as trainer 0 told
        this trainer."""

    def run(self, worker: WorkerId, what: tuple, lead: Callable[[], None] | None) -> None:
        """Be inside ``what`` until it is done: on trainer 0 ``lead()`` makes it (once every
        trainer is in); elsewhere (``lead`` None) wait for trainer 0 to say how it went.

        Raises:
            TimeoutError: trainer 0 did not finish it within 3 x timeout_s.
            Exception: trainer 0's change failed: what trainer 0 raised, of the same class
                (`weightbridge.errors.from_kind`; `WorkersLost` names the same workers out).
        """
        with self.cond:
            self.changing = what
            self.changed.pop(what, None)
            self.cond.notify_all()
        try:
            if lead is not None:
                lead()
                return
            with self.cond:
                if not self.cond.wait_for(lambda: what in self.changed,
                                          timeout=WAIT_TIMEOUTS * self.timeout_s):
                    raise TimeoutError(f"{worker}: trainer 0 did not finish the membership "
                                       f"change within {WAIT_TIMEOUTS} x timeout_s="
                                       f"{self.timeout_s}s; "
                                       f"every trainer must call it, trainer 0 included")
                failure = self.changed.pop(what)
            if failure is not None:
                kind, message, lost = failure
                raise from_kind(kind, f"{worker}: trainer 0's {call_name(what)} failed: "
                                      f"{message}", lost)
        finally:
            with self.cond:
                self.changing = None

    def on_changing(self) -> tuple | None:
        with self.cond:
            return self.changing

    def on_changed(self, what: tuple, failure: tuple | None) -> None:
        with self.cond:
            self.changed[what] = failure
            self.cond.notify_all()


def call_name(what: tuple) -> str:
    return "add_engines()" if what[0] == "add" else f"remove_engine({what[1]})"
