"""Rank 0's failure handling: find the lost rollout workers, plan their engines out, re-send.

Mixed into `SenderAdapter` (it uses the adapter's control plane, config and group state); see
docs/integration.md, "Failures", for the guarantees.
"""

from __future__ import annotations

from weightbridge.coordination.adapter_base import TransferFailed
from weightbridge.coordination.control import PeerCall, rollouts
from weightbridge.coordination.session import unanswered
from weightbridge.coordination.worker import ReplicaMismatch


class SenderRecovery:
    """`_on_failure` and what it needs; rank 0 of a `SenderAdapter` group only."""

    def _on_failure(self, version: int, error: Exception, moved: bool) -> None:
        """A session call failed: find the workers that are gone (rollouts and trainers),
        exclude the lost engines and trainers, re-plan over the others (a lost trainer's
        regions from its replicas), re-send ``version`` where the trainers still hold it, tell
        every trainer; raise `TransferFailed`. Anything else is raised unchanged (the group is
        closed if bytes had moved: no engine's state is known)."""
        control, mode = self.control, self.config.mode
        live = self._live()
        gone = [w.index for w in unanswered(control, live)]
        gone_t = [t.index for t in unanswered(control, self._live_trainers()[1:])]
        size = control.engine_size
        cause = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        if not gone and not gone_t:
            # Every trainer waits in send_weights(version) (not SS): it fails the same way.
            kind = ("timeout" if isinstance(error, TimeoutError) else
                    "replica" if isinstance(error, ReplicaMismatch) else
                    "input" if isinstance(error, ValueError) else "transfer")
            self._tell_trainers(version, f"trainer 0: {type(error).__name__}: {cause}", kind)
            if moved:
                self._broken = (f"the transfer of version {version} failed after bytes moved "
                                f"({type(error).__name__}: {cause}) and every worker still "
                                f"answers, so no engine's weights are known; build a new "
                                f"group (new adapters, connect()) to go on")
                # No engine may run a step on what it holds now: every poll raises.
                control.call(live, PeerCall.FAIL, self._broken, return_errors=True)
            raise error
        lost = sorted({j // size for j in gone})
        survivors = sorted(set(self.leader.live_engines()) - set(lost))
        names = ([f"R{j} (engine {j // size})" for j in gone] + [f"T{i}" for i in gone_t])
        what = (f"{'workers' if len(names) > 1 else 'worker'} {', '.join(names)} failed during "
                f"the transfer of version {version} ({type(error).__name__}: {cause}).")
        if lost:
            what += (f" Engine{'s' if len(lost) > 1 else ''} {lost} "
                     f"{'are' if len(lost) > 1 else 'is'} excluded from this transfer group: "
                     f"nothing more is sent to it and its other workers' poll_requests() "
                     f"raise. To use it again, restart its workers on new procs and add them "
                     f"as a new engine (TransferGroup.add_engines, then add_engines() on every "
                     f"trainer).")
        if gone_t:
            what += (f" Trainer{'s' if len(gone_t) > 1 else ''} {gone_t} "
                     f"{'are' if len(gone_t) > 1 else 'is'} excluded: the trainers that hold "
                     f"the same regions (data-parallel replicas) send them from now on, and "
                     f"send_weights() is collective over the others.")
        self.leader.exclude(lost, gone_t, why=what,
                            unreachable=[w for w in rollouts(control) if w.index in gone])
        if not survivors:
            self._broken = what + " No engine is left."
            self._tell_trainers(version, self._broken)
            raise TransferFailed(self._broken) from error
        try:
            self.leader.replan()
            if not mode.sender_staging:  # the trainers' parameters still hold this version
                self._rejoin(moved)
                self._session(version, [False], release=False)
                state = (f"Version {version} was re-sent to the surviving engines {survivors} "
                         f"over a new plan: they "
                         + ("install it at their next poll_requests()." if mode.receiver_staging
                            else "installed it."))
            else:
                self._rejoin(moved)
                state = (f"The surviving engines {survivors} never saw version {version}: "
                         + ("they keep the version they run and install the next one you send."
                            if mode.receiver_staging else
                            "their poll_requests() wait (no inference step runs on a partial "
                            "update) for the next version you send, within 3 x timeout_s."))
        except Exception as e2:  # noqa: BLE001
            self._broken = (f"{what} Re-planning without it failed too ({type(e2).__name__}: "
                            f"{e2}); build a new group (new adapters, connect()) to go on.")
            self._tell_trainers(version, self._broken)
            # No engine gets another version: each learns it at its next poll.
            control.call(self._live(), PeerCall.FAIL, self._broken, return_errors=True)
            raise TransferFailed(self._broken) from e2
        message = f"{what} {state} send_weights() goes on with the surviving workers."
        self._tell_trainers(version, message)
        raise TransferFailed(message) from error

    def _rejoin(self, moved: bool) -> None:
        """RS off: the surviving rollouts that had joined the failed transfer still wait in
        poll_requests() for a version; count them in for the next transfer."""
        if self.config.receiver_staging or not moved:
            return  # before the bytes moved, `_joined` still holds who joined
        live = set(self._live())
        with self.cond:
            self._joined = self._joined | (self._session_joined & live)

    def _tell_trainers(self, version: int, message: str, kind: str = "transfer") -> None:
        others = self._live_trainers()[1:]
        self.control.call(others, PeerCall.FAILED, version, message, kind, return_errors=True)

