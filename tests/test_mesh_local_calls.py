"""`MeshControl`: a worker's calls on itself run in its own process, on its group's threads,
with no Monarch message (each leaves state behind: docs/failures.md, "Memory over many
updates"), and behave as calls through its agent: same answers, same order, same errors."""

import asyncio
import threading
import types

import pytest
from monarch.actor import ActorError

from weightbridge.config import TransferConfig
from weightbridge.coordination.control import PeerCall
from weightbridge.mesh import registry
from weightbridge.mesh.control import MeshControl
from weightbridge.types import WorkerId

ME = WorkerId("trainer", 0)


class Worker:
    worker = ME

    def __init__(self):
        self.sent, self.threads = [], set()

    def on_ping(self):
        return True

    def on_ready(self):
        raise ValueError("not ready")

    def on_send_round(self, r: int):
        self.threads.add(threading.current_thread().name)
        self.sent.append(r)
        return (r,)


@pytest.fixture
def control():
    name = f"local-{id(object())}"
    group = types.SimpleNamespace(name=name, engine_size=1, num_trainers=1, num_engines=1,
                                  trainer_agents=None, rollout_agents=None, joined=(),
                                  config=TransferConfig(timeout_s=10))
    worker = Worker()
    registry.register(name, worker)
    try:
        yield MeshControl(group), worker
    finally:
        registry.take(name)
        registry.shutdown(name, "the test ended")


def _sent() -> int:
    return sum(k for (kind, _), k in registry.calls.items() if kind == "sent")


def test_calls_on_itself_send_no_message(control):
    mesh, worker = control
    before = _sent()
    assert mesh.call([ME], PeerCall.PING) == [True]
    assert mesh.call_each([ME], PeerCall.PING, [()]) == [True]
    answers = asyncio.run(mesh.call_async([ME], PeerCall.SEND_ROUND, 3))
    assert answers == [(3,)]
    assert _sent() == before  # (no agent mesh exists here: a message would have failed)


def test_sends_to_itself_run_in_order_on_one_thread(control):
    mesh, worker = control

    async def rounds():
        return await asyncio.gather(*(mesh.call_async([ME], PeerCall.SEND_ROUND, r)
                                      for r in range(20)))

    assert asyncio.run(rounds()) == [[(r,)] for r in range(20)]
    assert worker.sent == list(range(20)) and len(worker.threads) == 1


def test_an_error_on_itself_is_raised_as_through_the_agent(control):
    mesh, _ = control
    # The library's own error, as a peer's through its agent (`weightbridge.errors.surfaced`),
    # chained to Monarch's wrapper.
    with pytest.raises(ValueError, match="not ready") as e:
        mesh.call([ME], PeerCall.READY)
    assert isinstance(e.value.__cause__, ActorError)
    [error] = mesh.call([ME], PeerCall.READY, return_errors=True)
    assert isinstance(error, ValueError) and str(error) == "not ready"
