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
        served: list = [None] * len(peers)
        ended = [threading.Event() for _ in peers]

        def one(i: int, peer: WorkerId, a: tuple) -> None:
            try:
                self.target(peer)
                self._gate(peer)  # a stopped process answers once it goes on
                served[i] = call.serve(self.target(peer), *a)
            except Exception as e:  # noqa: BLE001  (handed to the caller below)
                served[i] = PeerFailed(e)
            finally:
                ended[i].set()
                with self._serving:
                    self._calls_in[peer] -= 1
                    self._serving.notify_all()

        with self._serving:
            for peer in peers:
                self._calls_in[peer] = self._calls_in.get(peer, 0) + 1
        for i, (peer, a) in enumerate(zip(peers, args)):
            threading.Thread(target=one, args=(i, peer, a), daemon=True,
                             name=f"local-{call.value}-{peer}").start()
        timeout = self.timeout(call)
        end = None if timeout is None else time.monotonic() + timeout
        out = []
        for i, peer in enumerate(peers):
            if ended[i].wait(None if end is None else max(0.0, end - time.monotonic())):
                out.append(served[i])
            else:
                out.append(PeerFailed(TimeoutError(
                    f"{call.value} to {peer} did not answer within {timeout:g}s "
                    f"(TransferConfig.timeout_s): a peer is stalled or its process died")))
        return gathered(out, return_errors)

    def call(self, peers: Sequence[WorkerId], call: PeerCall, *args,
             return_errors: bool = False) -> list:
        return self.call_each(peers, call, [args] * len(peers), return_errors=return_errors)

    async def call_async(self, peers: Sequence[WorkerId], call: PeerCall, *args) -> list:
        return await asyncio.to_thread(self.call, peers, call, *args)


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
