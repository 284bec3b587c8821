"""The controller's version book and its streaming thread, without Monarch."""

from __future__ import annotations

import threading

import pytest

from weightbridge import TransferFailed

from controller.streaming import Streaming
from controller.versions import VersionBook


def test_a_full_update_then_deltas_hold_each_tensor_at_its_last_change():
    book = VersionBook(["a", "b", "c"])
    v1 = book.next(1, None)
    assert v1 == {"a": 1, "b": 1, "c": 1}
    book.sent(1, v1)
    assert book.needed() is None  # nothing held yet: everything moves
    book.installed(1)
    v2 = book.next(2, ["a"])
    assert v2 == {"a": 2, "b": 1, "c": 1}
    book.sent(2, v2)
    assert book.needed() == {"a"}


def test_a_landed_version_never_installed_rides_on_the_next_delta():
    book = VersionBook(["a", "b", "c"])
    book.sent(1, book.next(1, None))
    book.installed(1)
    book.sent(2, book.next(2, ["a"]))
    book.landed(2)
    book.sent(3, book.next(3, ["b"]))
    assert book.needed() == {"a", "b"}  # the rollouts hold 1
    book.landed(3)
    assert book.installed(3) == {"a": 2, "b": 3, "c": 1}
    assert book.held_version == 3 and book.needed() == frozenset()


def test_torn_parameters_make_the_next_transfer_full():
    book = VersionBook(["a", "b"])
    book.sent(1, book.next(1, None))
    book.installed(1)
    book.sent(2, book.next(2, ["a"]))
    book.torn()
    assert book.needed() is None and book.holds is None


@pytest.mark.parametrize("bad,match", [
    (1, "versions must increase"), (True, "positive int"), (2.0, "positive int"),
    (0, "positive int")])
def test_bad_versions_are_refused_before_anything_moves(bad, match):
    book = VersionBook(["a"])
    book.sent(1, book.next(1, None))
    with pytest.raises(ValueError, match=match):
        book.next(bad, None)


def test_bad_deltas_are_refused():
    book = VersionBook(["a", "b"])
    with pytest.raises(ValueError, match="first update must be full"):
        book.next(1, ["a"])
    book.sent(1, book.next(1, None))
    with pytest.raises(ValueError, match=r"got 'a'; pass \['a'\]"):
        book.next(2, "a")
    with pytest.raises(ValueError, match=r"not in the checkpoint: \['z'\]"):
        book.next(2, ["a", "z"])


def test_streaming_hands_its_result_to_the_joiner_and_raises_a_failure_once():
    s = Streaming()
    s.start(lambda x: x + 1, 1)
    assert s.join(5) == 2 and s.join(5) is None
    s.start(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        s.join(5)
    assert s.join(5) is None


def test_a_stream_that_never_ends_is_a_transfer_failure_not_a_hang():
    s, release = Streaming(), threading.Event()
    s.start(release.wait)
    with pytest.raises(TransferFailed, match="did not end within 0.1s"):
        s.join(0.1)
    release.set()
    assert s.join(5) is True
