"""In-process control plane and transport: tests, single-process demos, `run_plan_locally`.

`LocalControl` holds every worker of one group and turns a `PeerCall` into a direct call of the
worker's handler, one thread per peer (on a mesh, each is an actor endpoint call);
`LocalTransport` moves a write by copying into the peer's round buffer (on a mesh, an RDMA
write).

Typical usage::

    control = LocalControl()
    t = control.add(SenderAdapter(params, load_weights, spec, rank=0, control=control,
                                  transport=control.transport, config=config))
    r = control.add(ReceiverAdapter(..., rank=0, engine=0, engine_rank=0, engine_size=1, ...))
    t.connect(); t.send_weights(1)    # with rollout threads calling r.poll_requests()

`LocalControl.kill(worker)` makes a worker's calls and writes fail as a dead process's would
(the fail-closed tests); `LocalControl.stall(worker)` makes them wait as a stopped process's
would (SIGSTOP: a call is answered once `resume` is called, its caller long gone). Every call
but probing and set-up is bounded as on a mesh (`TransferConfig.peer_timeout_s`, the notices
`notice_timeout_s`): a worker that never answers surfaces as a `TimeoutError` in its caller.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from typing import Sequence

from weightbridge.coordination.control import PeerCall, PeerFailed, gathered
from weightbridge.types import Range, WorkerId


class WorkerGone(ConnectionError):
    """A call or write to a worker that `LocalControl.kill` marked dead."""


class LocalControl:
    """Every worker of one group, by side (a `weightbridge.coordination.control.ControlPlane`)."""

    def __init__(self):
        self._workers: dict[WorkerId, object] = {}
        self.transport = LocalTransport(self)
        self.dead: set[WorkerId] = set()
        """Workers `kill` stopped: their calls and the writes into them raise `WorkerGone`."""
        self._stalled: dict[WorkerId, threading.Event] = {}
        self._serving = threading.Condition()
        self._calls_in: dict[WorkerId, int] = {}
        """Worker -> calls to it not yet answered (waiting on its stall, or being served)."""
        self._ordered: dict[WorkerId, collections.deque] = {}
        """Worker -> the calls it serves in order (`PeerCall.ordered`) not yet ended, served
        one at a time in this order (a mesh's agent serves them so) by one daemon thread
        while any is queued."""

    def kill(self, worker: WorkerId) -> None:
        """Stand-in for a process that died: every later call or write to it fails."""
        self.dead.add(worker)
        self.resume(worker)  # (calls waiting on a stalled worker now fail)

    def stall(self, worker: WorkerId) -> None:
        """Stand-in for a stopped process (SIGSTOP): calls to it wait until `resume` and are
        served then (their callers gave up after the peer timeout), writes into it wait up
        to the peer timeout and are lost."""
        self._stalled.setdefault(worker, threading.Event())

    def resume(self, worker: WorkerId) -> None:
        """A stalled worker goes on (SIGCONT): the calls that waited for it are served."""
        gate = self._stalled.pop(worker, None)
        if gate is not None:
            gate.set()

    def stalled(self, worker: WorkerId) -> bool:
        return worker in self._stalled

    def settle(self, worker: WorkerId, timeout: float = 30.0) -> None:
        """Wait until every call made to ``worker`` so far was answered, e.g. the ones a
        stalled worker serves once resumed (tests: what it was told has reached it)."""
        with self._serving:
            if not self._serving.wait_for(lambda: not self._calls_in.get(worker), timeout):
                raise TimeoutError(f"calls to {worker} still unanswered after {timeout:g}s")

    def _gate(self, worker: WorkerId, timeout: float | None = None) -> bool:
        """Wait while ``worker`` is stalled (at most ``timeout``); False if it still is."""
        gate = self._stalled.get(worker)
        return gate is None or gate.wait(timeout)

    def timeout(self, call: PeerCall | None) -> float | None:
        """How long ``call`` (None: a write) may take, from the group's `TransferConfig`
        (every worker of a group holds an equal one); None: unbounded."""
        config = next((getattr(w, "config", None) for w in self._workers.values()), None)
        if config is None or (call is not None and call.unbounded):
            return None
        return config.notice_timeout_s if call is not None and call.notice \
            else config.peer_timeout_s

    def add(self, worker):
        """Add a worker (`TransferWorker` or an adapter); returns it."""
        if worker.worker in self._workers:
            raise ValueError(f"{worker.worker} was added twice")
        self._workers[worker.worker] = worker
        return worker

    def _count(self, side: str) -> int:
        return sum(w.side == side for w in self._workers)

    @property
    def num_trainers(self) -> int:
        return self._count("trainer")

    @property
    def engine_size(self) -> int:
        first = self._workers.get(WorkerId("rollout", 0))
        return getattr(first, "engine_size", 1)

    @property
    def num_engines(self) -> int:
        count, size = self._count("rollout"), self.engine_size
        if count % size:
            raise ValueError(f"{count} rollout workers do not make whole engines of "
                             f"engine_size={size} (rollout 0's); add every worker of each "
                             f"engine, all with the same engine_size")
        return count // size

    def target(self, worker: WorkerId):
        """The worker object itself (raises `WorkerGone` once killed)."""
        if worker in self.dead:
            raise WorkerGone(f"{worker} is gone (its process was killed)")
        return self._workers[worker]

    def call_each(self, peers: Sequence[WorkerId], call: PeerCall, args: Sequence[tuple],
                  *, return_errors: bool = False) -> list:
        """``call`` with ``args[i]`` on ``peers[i]``, all at once (a thread each); the results
        in order. Raises the first peer's error once all have ended (``return_errors``:
        returns the errors in place of results). A peer that does not answer within
        `timeout` (``call``) counts as failed with a `TimeoutError`; its thread is left to
        end by itself (daemon), as a mesh leaves an unanswered message."""
        return self._collect(self._issue(peers, call, args), return_errors)

    def _issue(self, peers: Sequence[WorkerId], call: PeerCall, args: Sequence[tuple],
               failed=None):
        """Start ``call`` on every peer (an ordered one joins its peer's queue here, in the
        order of these calls); `_collect` waits for the answers. ``failed(error)`` is
        called as soon as a peer's call raised (the caller need not wait for the others)."""
        served: list = [None] * len(peers)
        ended = [threading.Event() for _ in peers]
        started: list = [None] * len(peers)

        def one(i: int, peer: WorkerId, a: tuple) -> None:
            started[i] = time.monotonic()
            try:
                self.target(peer)
                self._gate(peer)  # a stopped process answers once it goes on
                served[i] = call.serve(self.target(peer), *a)
            except Exception as e:  # noqa: BLE001  (handed to the caller below)
                served[i] = PeerFailed(e)
                if failed is not None:
                    failed(served[i])
            finally:
                ended[i].set()
                with self._serving:
                    self._calls_in[peer] -= 1
                    self._serving.notify_all()

        with self._serving:
            for peer in peers:
                self._calls_in[peer] = self._calls_in.get(peer, 0) + 1
        for i, (peer, a) in enumerate(zip(peers, args)):
            if call.ordered:
                self._in_order(peer, call, one, (i, peer, a))
            else:
                threading.Thread(target=one, args=(i, peer, a), daemon=True,
                                 name=f"local-{call.value}-{peer}").start()
        return peers, call, served, ended, started, time.monotonic()

    def _collect(self, issued, return_errors: bool) -> list:
        peers, call, served, ended, started, at = issued
        timeout = self.timeout(call)

        def clock(i: int) -> float:
            """When call i's time started: an ordered call's when its peer started serving
            it (the ones before it in its queue are bounded themselves), as on a mesh."""
            return started[i] if started[i] is not None and call.ordered else at

        out = []
        for i, peer in enumerate(peers):
            while True:
                begun = clock(i)
                left = None if timeout is None else begun + timeout - time.monotonic()
                if ended[i].wait(None if left is None else max(0.0, left)):
                    out.append(served[i])
                    break
                if clock(i) != begun:
                    continue  # (it started meanwhile: its own clock)
                out.append(PeerFailed(TimeoutError(
                    f"{call.value} to {peer} did not answer within {timeout:g}s "
                    f"(TransferConfig.timeout_s): a peer is stalled or its process died")))
                break
        return gathered(out, return_errors)

    def call(self, peers: Sequence[WorkerId], call: PeerCall, *args,
             return_errors: bool = False) -> list:
        return self.call_each(peers, call, [args] * len(peers), return_errors=return_errors)

    async def call_async(self, peers: Sequence[WorkerId], call: PeerCall, *args) -> list:
        # Issued here, in the caller's order (an ordered call queues behind the ones issued
        # before it), and awaited on a daemon thread of its own: not the loop's executor,
        # whose few threads would queue the waits of many calls in flight, and which
        # `asyncio.run` waits for at its end (a call given up on would hold it).
        loop = asyncio.get_running_loop()
        answered = loop.create_future()

        def failed(error: PeerFailed) -> None:  # the first error, at once (as on a mesh)
            try:
                gathered([error], False)
            except BaseException as e:  # noqa: BLE001  (raised in the awaiting task)
                try:
                    loop.call_soon_threadsafe(_settle, answered, None, e)
                except RuntimeError:  # the loop ended: nobody awaits it any more
                    pass

        issued = self._issue(peers, call, [args] * len(peers), failed)

        def collect() -> None:
            try:
                out, error = self._collect(issued, False), None
            except BaseException as e:  # noqa: BLE001  (raised in the awaiting task)
                out, error = None, e
            try:
                loop.call_soon_threadsafe(_settle, answered, out, error)
            except RuntimeError:  # the loop ended: nobody awaits it any more
                pass

        threading.Thread(target=collect, daemon=True, name=f"local-{call.value}-wait").start()
        return await answered

    def post(self, peers: Sequence[WorkerId], call: PeerCall, *args) -> None:
        """Serve ``call`` on each of ``peers`` here and now, or, on a stalled one, once it
        goes on; a dead one drops it. Nothing is answered, no error raised."""
        for peer in peers:
            if peer in self.dead:
                continue
            if self.stalled(peer):
                threading.Thread(target=self._post_later, args=(peer, call, args),
                                 daemon=True, name=f"local-{call.value}-{peer}").start()
                continue
            try:
                call.serve(self.target(peer), *args)
            except Exception:  # noqa: BLE001  (a posted message has no answer to carry it)
                pass

    def addresses(self, peers: Sequence[WorkerId]) -> dict:
        return {}  # (every worker is reached directly)

    def learn(self, addresses) -> None:
        pass

    def _post_later(self, peer: WorkerId, call: PeerCall, args: tuple) -> None:
        self._gate(peer)
        self.post([peer], call, *args)

    def _in_order(self, peer: WorkerId, call: PeerCall, fn, args: tuple) -> None:
        with self._serving:
            queue = self._ordered.setdefault(peer, collections.deque())
            queue.append((fn, args))
            if len(queue) > 1:  # the thread serving the ones before takes it
                return
        threading.Thread(target=self._serve_in_order, args=(peer,), daemon=True,
                         name=f"local-{call.value}-{peer}").start()

    def _serve_in_order(self, peer: WorkerId) -> None:
        while True:
            with self._serving:
                fn, args = self._ordered[peer][0]
            fn(*args)
            with self._serving:
                queue = self._ordered[peer]
                queue.popleft()
                if not queue:
                    return


def _settle(future: asyncio.Future, out, error) -> None:
    if future.done():  # (cancelled: its awaiting task was)
        return
    future.set_exception(error) if error is not None else future.set_result(out)


class LocalTransport:
    """Writes are copies into the peer's round buffer; needs the control to find the peer."""

    def __init__(self, control: LocalControl):
        self.control = control
        self.bytes_written = 0

    def write(self, writes) -> list:
        """Copies every write at once (nothing to wait for)."""
        for peer, key, src in writes:
            self.write_range(peer, key, src)
        return []

    def write_range(self, peer: WorkerId, key: Range, src) -> None:
        index, offset, nbytes = key
        if peer in self.control.dead:
            raise WorkerGone(f"writing {nbytes} bytes into {peer}: it is gone (killed)")
        timeout = self.control.timeout(None)
        if not self.control._gate(peer, timeout):
            raise TimeoutError(f"writing {nbytes} bytes into {peer}: it did not take them "
                               f"within {timeout:g}s (TransferConfig.peer_timeout_s): it is "
                               f"stalled")
        self.control.target(peer).executor.arenas[index][offset:offset + nbytes].copy_(src)
        self.bytes_written += nbytes

    def wait(self, futures) -> None:
        pass

    def register(self, arenas, ranges) -> dict:
        return {}  # peers' arenas are reached directly

    def set_peers(self, handles) -> None:
        pass
