"""`Mailbox`: one process's Monarch ports for a transfer group's peer calls, opened once.

Monarch 0.7 keeps state for every reply port an endpoint call opens, and never frees it:
about 1.5 KB in the caller and 0.6 KB in the callee per call (`benchmarks/message_memory.py`),
most of a worker's memory growth over many updates. A mailbox opens two ports, once: peers
send their calls to its inbox as plain messages naming the caller's reply port, and it answers
each through that port, so a call costs tens of bytes (docs/failures.md, "Memory over many
updates"). A message names the reply port by its address (`monarch_api.reply_address`, about
250 bytes pickled; a Port itself pickles to about 1.6 KB).

    caller's MeshControl                              peer's TransferAgent
    ---------------------                             --------------------
    box.send(inbox, call, args) -- (id, call, args, reply) -->  inbox: serve on the group's
    pending[id] <------------------- (id, ok, value) ---------  threads, answer through reply

Every port is sent through with ``return_undeliverable`` off: a message to a process that
stopped is dropped. Monarch 0.7 returns an undeliverable message to the sending *actor* and
fails it, so a dead peer would otherwise take the user's actor down. The caller's wait is
bounded (`MeshControl._timeout`), as for every bounded peer call; calls that may take
unbounded time (probing, setup) stay endpoint calls, whose failure Monarch reports.
"""

from __future__ import annotations

import contextvars
import itertools
import threading
import time
from concurrent.futures import Future, InvalidStateError

from monarch.actor import ActorError, Channel

from weightbridge.coordination.control import PeerCall
from weightbridge.errors import describe
from weightbridge.mesh import monarch_api, registry


CLOSED_CHECK_S = 0.1
"""How often `Mailbox.wait` looks whether the mailbox closed while it waits."""


class Mailbox:
    """The ports of one group's calls in this process: ``inbox`` (with ``serve``: calls from
    peers, served here) and a reply port (answers to this process's calls).

    Open it in the actor context that should own the ports (the process's `TransferAgent`,
    or the controller's client): each port lives as long as that actor, and the threads
    reading them run in its context. `close` ends both threads.
    """

    def __init__(self, group: str, *, serve: bool):
        self.group = group
        self.inbox = None
        self._pending: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._closed: str | None = None
        """Why this mailbox was closed (`close`); None while it is open."""
        self._sending = threading.Lock()
        """Held while a message goes out (`send`, `post`): a Monarch 0.7 port cannot be sent
        through from two threads at once (the second send fails, "RuntimeError: Already
        borrowed"), and a peer's inbox port is shared by every thread of this process that
        calls that peer: a leading trainer's sequencer sends the rounds while its own round
        tells the rollouts what it wrote (`bench_soak.py --round-control rounds` lost such
        messages and hung)."""
        self._owner = contextvars.copy_context()  # Monarch's current actor: the ports' owner
        self._reply, replies = Channel.open()
        self._reply_address = monarch_api.reply_address(self._reply)
        self._ports = [self._reply]
        self._start(f"weightbridge-replies-{group}", self._read_replies, replies)
        if serve:
            self.inbox, requests = Channel.open()
            self._ports.append(self.inbox)
            self._start(f"weightbridge-inbox-{group}", self._serve, requests)

    # -- calling ------------------------------------------------------------------------------

    def as_owner(self, fn, *args):
        """``fn(*args)`` as the actor that owns this mailbox (its process's agent): a message
        it sends comes back to that actor if it cannot be delivered. Monarch 0.7 fails the
        sending actor on an undeliverable message, so a peer's agent stopping as a user's
        actor called it (a group closed during a poll) failed the user's actor; the agent
        drops such messages (`TransferAgent._handle_undeliverable_message`) and the caller's
        wait reports the lost peer."""
        return self._owner.copy().run(fn, *args)

    def _start(self, name: str, target, *args) -> None:
        """A thread reading one of the ports, as their owner (Monarch's current actor)."""
        threading.Thread(target=self.as_owner, args=(target, *args), name=name,
                         daemon=True).start()

    def send(self, inbox, call: PeerCall, args: tuple) -> "Pending":
        """Send ``call`` to the peer whose mailbox's inbox is ``inbox``; its answer arrives on
        the returned `Pending` (forgotten here once it is done or given up on)."""
        future: Future = Future()
        with self._lock:
            if self._closed is not None:  # (nothing would read the answer)
                future.set_exception(MailboxClosed(self._closed))
                return Pending(future, call)
            key = next(self._ids)
            self._pending[key] = future
        future.add_done_callback(lambda _: self._forget(key))
        registry.calls["sent", call.value] += 1
        try:
            with self._sending:
                inbox.send((key, call, args, self._reply_address))
        except BaseException:
            future.cancel()
            raise
        return Pending(future, call)

    def post(self, inbox, call: PeerCall, args: tuple) -> None:
        """Send ``call`` (a `PeerCall.posted` one) to the peer whose inbox is ``inbox``; no
        answer comes back, and the peer serves it on its inbox's thread, at once."""
        registry.calls["posted", call.value] += 1
        with self._sending:
            inbox.send((None, call, args, None))

    def _forget(self, key: int) -> None:
        with self._lock:
            self._pending.pop(key, None)

    def _read_replies(self, replies) -> None:
        while (message := replies.recv().get()) is not None:
            key, ok, value = message
            with self._lock:
                future = self._pending.get(key)
            if future is None:  # given up on (timed out): nothing waits for it
                continue
            try:
                future.set_result(value) if ok else future.set_exception(value)
            except InvalidStateError:  # cancelled meanwhile
                pass

    # -- serving --------------------------------------------------------------------------------

    def _serve(self, requests) -> None:
        while (message := requests.recv().get()) is not None:
            key, call, args, reply = message
            group = self.group
            registry.calls["served", call.value] += 1
            if reply is None:  # posted (`post`): only records and wakes; nothing answers it
                try:
                    call.serve(registry.lookup(group), *args)
                except Exception:  # noqa: BLE001  (its sender asked for no answer)
                    pass
                continue
            reply = monarch_api.reply_port(reply)
            reply.return_undeliverable = False  # a caller that stopped: the answer is dropped
            try:
                # The call's thread runs in this one's context (Monarch's current actor).
                context = contextvars.copy_context()
                future = registry.submit(group, call, context.run, _serve_one, group, call,
                                         args)
            except Exception as e:  # noqa: BLE001  (the caller hears it as the call's error)
                _answer(reply, key, call, False, e)
                continue
            future.add_done_callback(lambda f, r=reply, k=key, c=call: _answered(r, k, c, f))

    def wait(self, future, timeout: float):
        """``future.get(timeout)`` (a Monarch future: an endpoint call this process made),
        failing at once if this mailbox is closed meanwhile, as its own calls do."""
        end = time.monotonic() + timeout
        while True:
            left = end - time.monotonic()
            try:
                return future.get(timeout=max(0.0, min(left, CLOSED_CHECK_S)))
            except TimeoutError:  # (a timeout never consumes a Monarch future)
                if self._closed is not None:
                    raise MailboxClosed(self._closed) from None
                if left <= CLOSED_CHECK_S:
                    raise

    def close(self, why: str) -> None:
        """End the threads reading the ports; every call still waiting, and every later one,
        fails with `MailboxClosed` saying ``why`` (the process left the group: its agent
        released it at `TransferGroup.close` or an engine's retirement, or the agent
        stopped), at once rather than after its timeout."""
        with self._lock:
            self._closed = (f"this process left transfer group {self.group} ({why}) while the "
                            f"call was waiting for its answer")
            pending, self._pending = list(self._pending.values()), {}
        with self._sending:
            for port in self._ports:
                port.send(None)
        for future in pending:
            try:
                future.set_exception(MailboxClosed(self._closed))
            except InvalidStateError:  # answered or given up on meanwhile
                pass


class MailboxClosed(ConnectionError):
    """A peer call of a process whose mailbox closed (it left the group) while it waited."""


class Pending:
    """A call sent through a `Mailbox`: ``get`` as a Monarch future's."""

    def __init__(self, future: Future, call: PeerCall):
        self.future, self.call = future, call

    @classmethod
    def failed(cls, error: Exception, call: PeerCall) -> "Pending":
        """A call that could not be sent: ``get`` raises ``error``."""
        future: Future = Future()
        future.set_exception(error)
        return cls(future, call)

    def get(self, timeout: float | None = None):
        """The peer's answer; its error as a served call's (`ActorError`). On a timeout the
        call is given up on (a late answer is dropped)."""
        try:
            return self.future.result(timeout)
        except TimeoutError:
            self.future.cancel()
            raise


def _serve_one(group: str, call: PeerCall, args: tuple):
    try:
        return call.serve(registry.lookup(group), *args)
    except Exception as e:  # noqa: BLE001  (the same error a call through the agent raises)
        raise served_error(e, call) from e


def served_error(error: Exception, call: PeerCall) -> ActorError:
    """``error`` as the caller of an endpoint call sees a served call's error."""
    return ActorError(error, f"Actor call TransferAgent.serve({call.value}) failed.")


def _answered(reply, key: int, call: PeerCall, future: Future) -> None:
    error = future.exception()
    _answer(reply, key, call, error is None, future.result() if error is None else error)


def _answer(reply, key: int, call: PeerCall, ok: bool, value) -> None:
    if not ok and not isinstance(value, ActorError):
        value = served_error(value, call)
    try:
        reply.send((key, ok, value))
    except Exception as e:  # noqa: BLE001  (a result or error that does not pickle)
        reply.send((key, False, served_error(RuntimeError(
            f"the answer to {call.value} could not be sent back: {describe(e)}"), call)))
