"""`TransferAgent`: the library's actor on every proc of a transfer group, serving the peer
calls of the workers built in its process (`weightbridge.mesh.registry`).

The library's peer calls never go through the user's actors: a sync actor blocked in
``send_weights`` or ``poll_requests`` still serves its peers through the agent of its process
(a sync actor handles one message at a time, and Monarch refuses an actor that mixes sync and
async endpoints, so the library could not add an endpoint to it).
"""

from __future__ import annotations

import contextvars
from monarch.actor import Actor, ActorError, endpoint

from weightbridge.coordination.control import PeerCall
from weightbridge.mesh import monarch_api, registry
from weightbridge.mesh.mailbox import Mailbox, MailboxClosed


class TransferAgent(Actor):
    """Serves the `PeerCall`s of the workers built in its proc (one per transfer group):
    bounded calls through its `Mailbox` (`inbox`), probing and setup through ``serve``.

    A sync actor whose endpoint hands each call to a thread and answers through the call's
    response port from there, so it serves many calls at once. Not an async actor: Monarch
    0.7 never closes a stopped async actor's event loop, and each stopped agent left 5 file
    descriptors (epoll, self-pipe, waker pipe) and its executor's threads in the process,
    once per session (docs/failures.md, "Memory over many updates").
    """

    def __init__(self):
        monarch_api.check()
        self._groups: set[str] = set()
        self._released: set[str] = set()
        """Groups this proc left (`release`): asking for their inbox fails at once."""

    @endpoint(explicit_response_port=True)
    def serve(self, port, group: str, call: PeerCall, *args) -> None:
        """Run ``call`` on this proc's worker of ``group``, on the group's threads
        (`registry.submit`): a worker serves its peers while its own thread is inside
        send_weights or poll_requests."""
        registry.calls["served", call.value] += 1
        try:
            self._groups.add(group)
            # The thread needs this actor's context (Monarch's current actor, in contextvars).
            context = contextvars.copy_context()
            future = registry.submit(group, call, context.run, _serve, group, call, args)
        except Exception as e:  # noqa: BLE001  (an explicit port's caller only hears the port)
            _fail(port, e, call)
            return
        future.add_done_callback(lambda f: _answer(port, f, call))

    @endpoint
    def inbox(self, group: str):
        """The inbox port of this proc's `Mailbox` of ``group`` (opened on the first ask, in
        this actor's context): peers send their bounded calls there, one message each."""
        if group in self._released:  # (a new mailbox would serve nobody: the worker is gone)
            raise MailboxClosed(f"this proc left transfer group {group} (its agent released "
                                f"it): nothing here answers its calls any more")
        self._groups.add(group)
        return registry.mailbox(group, lambda: Mailbox(group, serve=True)).inbox

    @endpoint
    def release(self, group: str, closed: str | None = None) -> None:
        """Forget this proc's worker of ``group``, deregister its RDMA buffers and end this
        agent's threads. With ``closed`` (why), the worker is failed first: a rollout's wait
        in ``poll_requests`` / ``wait_for_version`` or a trainer's in ``send_weights`` ends,
        and every later call raises `TransferFailed` saying ``closed``."""
        self._released.add(group)
        worker = registry.take(group)
        on_fail = getattr(worker, "on_fail", None)
        if closed is not None and on_fail is not None:
            on_fail(closed)
        release = getattr(getattr(worker, "transport", None), "release", None)
        if release is not None:
            release()
        self._groups.add(group)
        self._shutdown("its agent released it")

    def _shutdown(self, why: str) -> None:
        groups, self._groups = self._groups, set()
        for group in groups:
            registry.shutdown(group, why)

    def _handle_undeliverable_message(self, message) -> bool:
        """A message this agent sent for a worker of its process (`Mailbox.as_owner`) to a
        peer that stopped: dropped. The worker's call fails by itself (Monarch's supervision
        error, or its bounded wait), and the transfer reports the lost peer; left to Monarch,
        this agent, and every later call of its process, would fail."""
        return True

    def __cleanup__(self, exc) -> None:
        # Stopped without release: an actor that failed (Monarch fails one whose message
        # came back undeliverable in some races), or stopped with its proc.
        self._shutdown("its agent stopped" + (f": {exc}" if exc is not None else ""))


def _serve(group: str, call: PeerCall, args: tuple):
    return call.serve(registry.lookup(group), *args)


def _answer(port, future, call: PeerCall) -> None:
    """Send a served call's result or error to its caller, as Monarch answers an endpoint."""
    try:
        monarch_api.answer(port, future.result())
    except Exception as e:  # noqa: BLE001  (the caller's future raises it)
        _fail(port, e, call)


def _fail(port, error: Exception, call: PeerCall) -> None:
    port.exception(ActorError(error, f"Actor call TransferAgent.serve({call.value}) failed."))
