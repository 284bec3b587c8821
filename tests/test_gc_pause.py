"""The collector's pause (`weightbridge.gc_pause`): nested and overlapping pauses, and the
caller's own setting, come back as they were."""

import gc
import threading

import pytest

from weightbridge.gc_pause import gc_paused, with_gc_paused


@pytest.fixture(autouse=True)
def _collector_back_on():
    yield
    gc.enable()


def test_nested_pauses_turn_the_collector_back_on_only_after_the_outermost():
    gc.enable()
    with gc_paused():
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_caller_that_had_disabled_the_collector_keeps_it_disabled():
    gc.disable()
    with gc_paused():
        pass
    assert not gc.isenabled()


def test_an_error_inside_still_ends_the_pause():
    gc.enable()

    @with_gc_paused
    def fails():
        assert not gc.isenabled()
        raise ValueError("inside")

    with pytest.raises(ValueError, match="inside"):
        fails()
    assert gc.isenabled()


def test_overlapping_pauses_on_two_threads_end_after_the_last():
    gc.enable()
    entered, release = threading.Event(), threading.Event()

    def other():
        with gc_paused():
            entered.set()
            release.wait(10)

    thread = threading.Thread(target=other)
    thread.start()
    assert entered.wait(10)
    with gc_paused():
        pass
    assert not gc.isenabled()  # (the other thread's pause is still on)
    release.set()
    thread.join(10)
    assert gc.isenabled()
