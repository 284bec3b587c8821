"""Engines joining and leaving a running adapter group: `add_engines`, `remove_engine`.

Mixed into `SenderAdapter`. Both are collective over the trainers, called between
`send_weights` calls (as `send_weights` itself is collective): while every trainer is inside
the call none of them stages a version, so the trainers' tables can change under rank 0,
which does the work once every trainer is in (after the staged versions were transferred,
in the sender-staging modes; never during a transfer)::

    join:   probe only the new engines -> extend the plan in force (appended rounds,
            `weightbridge.planning.extend`) -> set up only them and the trainers
    leave:  tell the engine's workers (their poll_requests() raise) -> drop its rows when
            nothing depends on it (a mirrored engine: its forwarders take new writes), else
            re-plan the others from the kept source maps (no probe, every live worker set up)

A joining engine's first `poll_requests` returns the first version sent after the join,
whole; the engines already in keep what they run and never see a partial version.
"""

from __future__ import annotations

from weightbridge.coordination.control import PeerCall


class SenderMembership:
    """`add_engines` and `remove_engine` of a `SenderAdapter` group."""

    def _init_membership(self) -> None:
        self._changing: tuple | None = None
        """The membership change this trainer is inside (("add",), ("remove", engine)), None
        outside."""
        self._changed: dict[tuple, str | None] = {}
        """Change -> None (done) or why it failed, as rank 0 told this trainer."""

    def add_engines(self, group=None) -> None:
        """Collective over the trainers, between `send_weights` calls: plan in the rollout
        engines added to the group since connect (or the last join) and go on with them.

        ``group``: the grown `TransferGroup` that `TransferGroup.add_engines` returned (on
        meshes; the joining engines' actors build their receivers with it); None with a
        control plane that grows by itself (`LocalControl`). Only the new engines are
        probed; the engines already in keep their tables and buffers. The new engines'
        first `poll_requests` returns the next version sent, whole.

        Raises:
            ValueError: no engine was added, or a joining worker is in the wrong engine.
            LayoutError: a joining engine reads another checkpoint or needs what no trainer
                holds (before any of its buffers exist; the group goes on without it).
        """
        self._change(("add",), lambda: self._join(group), group)

    def remove_engine(self, engine: int) -> None:
        """Collective over the trainers, between `send_weights` calls: take rollout engine
        ``engine`` out of the group (to retire or restart it). No byte is sent to or through
        it afterwards; its workers' `poll_requests` raise `TransferFailed` saying it was
        removed. An engine nothing depends on (mirrored in by a join) just loses its rows:
        only the rollouts that forwarded to it take new writes. Otherwise the others are
        re-planned from the kept source maps (no probe); they keep the whole version they hold
        (a version landed in their staging but not installed yet is superseded by the next
        one).

        Raises:
            ValueError: no such engine, it is out already, or it is the last one.
        """
        self._change(("remove", engine), lambda: self._leave(engine))

    # -- every trainer ------------------------------------------------------------------------

    def _change(self, what: tuple, change, group=None) -> None:
        if self.executor is None:
            raise RuntimeError("call connect() before add_engines() or remove_engine()")
        use = getattr(self.control, "use", None)
        if group is not None and use is not None:
            use(group)  # (this trainer's calls go to the grown group too)
        with self.cond:
            self._changing = what
            self._changed.pop(what, None)
            self.cond.notify_all()
        try:
            if self.worker.index == 0:
                self._lead(what, change)
                return
            with self.cond:
                if not self.cond.wait_for(lambda: what in self._changed,
                                          timeout=3 * self.config.timeout_s):
                    raise TimeoutError(f"{self.worker}: trainer 0 did not finish the membership "
                                       f"change within 3 x timeout_s={self.config.timeout_s}s; "
                                       f"every trainer must call it, trainer 0 included")
                failure = self._changed.pop(what)
            if failure is not None:
                raise RuntimeError(f"{self.worker}: trainer 0's membership change failed, "
                                   f"nothing changed for this trainer: {failure}")
        finally:
            with self.cond:
                self._changing = None

    def on_changing(self) -> tuple | None:
        with self.cond:
            return self._changing

    def on_changed(self, what: tuple, failure: str | None) -> None:
        with self.cond:
            self._changed[what] = failure
            self.cond.notify_all()

    # -- rank 0 ---------------------------------------------------------------------------------

    def _lead(self, what: tuple, change) -> None:
        """Wait until every other trainer is inside the same change (none stages meanwhile)
        and every staged version was transferred; make the change between transfers; tell
        the others how it went."""
        others = self._live_trainers()[1:]
        failure = None
        try:
            self._poll_until(lambda: all(
                a == what for a in self.control.call(others, PeerCall.CHANGING)),
                f"not every trainer called the same {_call(what)}")
            if self.config.sender_staging:
                self.wait_idle()
            with self._session_lock:
                change()
        except Exception as e:
            failure = f"{type(e).__name__}: {e}"
            raise
        finally:
            self.control.call(others, PeerCall.CHANGED, what, failure, return_errors=True)

    def _join(self, group) -> None:
        self.leader.join()
        self.leader.joined_at = self._done  # (delta updates: the new engines hold nothing)

    def _leave(self, engine: int) -> None:
        self.leader.leave(engine)


def _call(what: tuple) -> str:
    return "add_engines()" if what[0] == "add" else f"remove_engine({what[1]})"
