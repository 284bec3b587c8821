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
(the fail-closed tests).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
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

    def kill(self, worker: WorkerId) -> None:
        """Stand-in for a process that died: every later call or write to it fails."""
        self.dead.add(worker)

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
        returns the errors in place of results)."""
        def one(peer_args):
            peer, a = peer_args
            try:
                return call.serve(self.target(peer), *a)
            except Exception as e:  # noqa: BLE001  (handed to the caller below)
                return PeerFailed(e)

        if len(peers) == 1:
            out = [one((peers[0], args[0]))]
        else:
            with ThreadPoolExecutor(max_workers=max(1, len(peers))) as pool:
                out = list(pool.map(one, zip(peers, args)))
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

    def write(self, peer: WorkerId, key: Range, src) -> None:
        index, offset, nbytes = key
        if peer in self.control.dead:
            raise WorkerGone(f"writing {nbytes} bytes into {peer}: it is gone (killed)")
        self.control.target(peer).executor.arenas[index][offset:offset + nbytes].copy_(src)
        self.bytes_written += nbytes

    def wait(self, futures) -> None:
        pass

    def register(self, arenas, ranges) -> dict:
        return {}  # peers' arenas are reached directly

    def set_peers(self, handles) -> None:
        pass
