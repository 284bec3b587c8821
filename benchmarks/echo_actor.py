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
