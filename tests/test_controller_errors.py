"""What the controller's public calls raise (issue 44, item 10), in process: no plain
``TimeoutError``, ``AssertionError`` or ``asyncio.CancelledError`` escapes a `MeshTransfer`
call; each becomes the documented `WeightBridgeError` subclass that says what to do.

`serialized` wraps every public call of `MeshTransfer`; these tests drive it on a stand-in
object with the two attributes it reads (``calls``, ``closed``), and the controller's
streaming thread (`Streaming`) directly. The mesh cases (close() from another thread during
a real update) are in tests/test_controller_modes.py.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from controller.calls import serialized
from controller.streaming import Streaming
from weightbridge import (GroupClosed, LayoutError, TransferFailed, WeightBridgeError,
                          WorkersLost)


class _Calls:
    """What `serialized` reads of a `MeshTransfer`; ``raised`` is what ``call`` raises."""

    def __init__(self, raised: BaseException | None = None):
        self.calls, self.closed, self.raised = threading.RLock(), False, raised

    @serialized
    def update(self, close_first: bool = False) -> str:
        if close_first:
            self.closed = True  # (close() from another thread, as the call ran)
        if self.raised is not None:
            raise self.raised
        return "done"


class Dead(RuntimeError):
    """A subclass of RuntimeError, as Monarch's ``SupervisionError`` (a process died) is."""


@pytest.mark.parametrize("raised", [TimeoutError("peer did not answer"),
                                    AssertionError({0: (1, 0), 2: None}),
                                    asyncio.CancelledError(), Dead("R1's process exited")],
                         ids=["timeout", "assertion", "cancelled", "supervision"])
def test_a_plain_error_escaping_a_call_is_raised_as_transfer_failed_naming_it(raised):
    with pytest.raises(TransferFailed, match=r"update\(\) failed: .*close this MeshTransfer"
                       ) as failed:
        _Calls(raised).update()
    assert failed.value.__cause__ is raised
    assert type(raised).__name__ in str(failed.value)


@pytest.mark.parametrize("raised", [LayoutError("no trainer holds it"), ValueError("bad"),
                                    WorkersLost("engine 1 lost", frozenset({1})),
                                    RuntimeError("call connect() before update()")],
                         ids=["layout", "value", "lost", "call-order"])
def test_the_library_s_own_errors_and_bad_input_pass_as_they_are(raised):
    with pytest.raises(type(raised)) as failed:
        _Calls(raised).update()
    assert failed.value is raised


@pytest.mark.parametrize("raised", [asyncio.CancelledError(), TimeoutError("stopped"),
                                    TransferFailed("the peer's agent was stopped")],
                         ids=["cancelled", "timeout", "transfer"])
def test_a_call_that_close_ended_raises_group_closed(raised):
    """update() running while another thread called close() got Monarch's CancelledError."""
    calls = _Calls(raised)
    with pytest.raises(GroupClosed, match=r"update\(\) was ended by close\(\)") as failed:
        calls.update(close_first=True)
    assert failed.value.__cause__ is raised
    with pytest.raises(GroupClosed, match="this MeshTransfer was closed"):
        calls.update()  # every later call


def test_keyboard_interrupt_is_not_turned_into_a_library_error():
    with pytest.raises(KeyboardInterrupt):
        _Calls(KeyboardInterrupt()).update()


def test_a_streaming_transfer_past_its_deadline_raises_transfer_failed():
    """Was a plain TimeoutError from update(), wait(), poll_requests() and close()."""
    streaming, release = Streaming(), threading.Event()
    streaming.start(release.wait, 30)
    try:
        t0 = time.monotonic()
        with pytest.raises(TransferFailed, match="did not end within 0.2s") as failed:
            streaming.join(0.2)
        assert isinstance(failed.value, WeightBridgeError)
        assert time.monotonic() - t0 < 10
    finally:
        release.set()
    assert streaming.join(10) is True  # (what the call returned, once it ended)


def test_close_raises_an_uncollected_streamed_failure_as_itself_after_stopping():
    """Was RuntimeError("stopping the meshes failed: [ChecksumMismatch(...)]") from close(),
    though every mesh stopped: the last SS/async version's failure, named as a stop failure."""
    from controller.driver import MeshTransfer
    from weightbridge import ChecksumMismatch
    from weightbridge.specs import RolloutSpec, TrainerSpec

    mt = MeshTransfer(TrainerSpec.parse("nodes=1,gpus=1"),
                      RolloutSpec.parse("engines=1,nodes=1,gpus=1"), "tiny")
    failure = ChecksumMismatch("rollout0: MISMATCH in 1 of 21 parameters")

    def stream():
        raise failure

    mt._streaming.start(stream)  # (what update() starts in SS and async, failing)
    with pytest.raises(ChecksumMismatch) as raised:
        mt.close()
    assert raised.value is failure
    assert any("raised by close()" in n for n in raised.value.__notes__)
    assert mt.closed and mt.group is None
    mt.close()  # raised once: a second close is quiet


def test_leaving_a_block_on_an_error_keeps_that_error_and_notes_the_streamed_failure():
    from controller.driver import MeshTransfer
    from weightbridge import ChecksumMismatch
    from weightbridge.specs import RolloutSpec, TrainerSpec

    mt = MeshTransfer(TrainerSpec.parse("nodes=1,gpus=1"),
                      RolloutSpec.parse("engines=1,nodes=1,gpus=1"), "tiny")

    def stream():
        raise ChecksumMismatch("rollout0: MISMATCH in 1 of 21 parameters")

    mt._streaming.start(stream)
    bug = KeyError("the user's own bug")
    mt.__exit__(KeyError, bug, None)  # (a `with` block left on it; nothing was spawned)
    assert any("close() also found: ChecksumMismatch" in n for n in bug.__notes__)
    assert mt.closed
