"""`Echo`: an actor that answers like `TransferAgent.serve` and does nothing else.

Its own module so the workers import it by name (`benchmarks/control_scaling.py` imports it
only once the controller's transport is set: Monarch reads it when first imported).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from monarch.actor import Actor, endpoint


class Echo(Actor):
    """Answers from a pool thread through the call's response port (as `TransferAgent`)."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(thread_name_prefix="echo")

    @endpoint(explicit_response_port=True)
    def serve(self, port, r: int) -> None:
        self._pool.submit(port._resolve_and_send_blocking, r)

    @endpoint
    def serve_to(self, reply, r: int) -> None:
        """Answer ``r`` through ``reply``, a port the caller opened once (no reply port per
        call: ``benchmarks/message_memory.py``)."""
        self._pool.submit(reply.send, r)

    @endpoint
    def mailbox(self) -> object:
        """The inbox of a `weightbridge.mesh.mailbox.Mailbox` in this proc serving a worker
        that answers `PeerCall.PING` (for `Caller.run` "mailbox")."""
        from weightbridge.mesh import registry
        from weightbridge.mesh.mailbox import Mailbox

        if registry.local(MAILBOX_GROUP) is None:
            registry.register(MAILBOX_GROUP, _Pinged())
        return registry.mailbox(MAILBOX_GROUP, lambda: Mailbox(MAILBOX_GROUP, serve=True)).inbox

    @endpoint
    def rss_kb(self) -> int:
        return _rss_kb()

    @endpoint
    def buffer(self, nbytes: int):
        """A registered RDMA buffer of ``nbytes`` in this process, for `Caller.run` "write"."""
        import torch
        from monarch.rdma import RDMABuffer

        self._arena = torch.zeros(nbytes, dtype=torch.uint8)
        return RDMABuffer(self._arena)

    @endpoint
    def buffers(self, nbytes: int, k: int) -> list:
        """``k`` registered RDMA buffers of ``nbytes`` each, for `Caller.run` "batch"."""
        import torch
        from monarch.rdma import RDMABuffer

        self._arenas = [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(k)]
        return [RDMABuffer(a) for a in self._arenas]


class Caller(Actor):
    """Calls an `Echo` from inside a proc (as one worker calls another), ``n`` times."""

    @endpoint
    def run(self, echo, how: str, n: int) -> int:
        """Issue ``n`` calls one after another, each waited for; this process's RSS (KB)
        after."""
        from monarch.actor import Channel

        if how == "call":
            for r in range(n):
                echo.serve.call_one(r).get()
        elif how == "mailbox":  # ``echo`` is an inbox (`Echo.mailbox`): the library's calls
            from weightbridge.coordination.control import PeerCall
            from weightbridge.mesh.mailbox import Mailbox

            if not hasattr(self, "_box"):
                self._box = Mailbox("caller", serve=False)
                echo.return_undeliverable = False
            for _ in range(n):
                assert self._box.send(echo, PeerCall.PING, ()).get(timeout=60) is True
        elif how == "write":  # ``echo`` is a registered buffer (`Echo.buffer`)
            import torch

            src = torch.ones(echo.size(), dtype=torch.uint8)
            for _ in range(n):
                echo.write_from(src, timeout=60).get()
        elif how == "batch":  # ``echo`` is a list of registered buffers (`Echo.buffers`)
            import torch
            from monarch.rdma import RDMAAction

            srcs = [torch.ones(b.size(), dtype=torch.uint8) for b in echo]
            for _ in range(n):  # one action (submission) writing every buffer
                action = RDMAAction()
                for b, src in zip(echo, srcs):
                    action.write_remote(b, src)
                action.submit(timeout=60).get()
        else:  # "port": fire-and-forget calls, answered through one port opened once
            if not hasattr(self, "_reply"):
                self._reply = Channel.open()
            port, receiver = self._reply
            for r in range(n):
                echo.serve_to.broadcast(port, r)
                assert receiver.recv().get() == r
        return _rss_kb()


MAILBOX_GROUP = "echo"


class _Pinged:
    def on_ping(self) -> bool:
        return True


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
