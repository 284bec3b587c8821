"""The controller's version book and its streaming thread, without Monarch."""

from __future__ import annotations

import threading

import pytest

from weightbridge import TransferFailed

from controller.streaming import Streaming
from controller.versions import VersionBook
from weightbridge.coordination.delta import DeltaLog


class Driver:
    """The controller's books as `MeshTransfer.update` keeps them: the version labels
    (`VersionBook`) and what a transfer carries (the leader's `DeltaLog`)."""

    def __init__(self, tensors):
        self.book, self.log = VersionBook(tensors), DeltaLog(tensors)

    def send(self, version: int, changed) -> frozenset[str] | None:
        """update(version, changed) up to the transfer: the tensors it carries."""
        versions, previous = self.book.next(version, changed), self.book.version
        self.log.record(version, [previous], self.book.sent(version, versions))
        return self.log.needed(self.book.held_version)


def test_a_full_update_then_deltas_hold_each_tensor_at_its_last_change():
    d = Driver(["a", "b", "c"])
    assert d.book.next(1, None) == {"a": 1, "b": 1, "c": 1}
    assert d.send(1, None) is None  # nothing held yet: everything moves
    d.book.installed(1)
    assert d.book.next(2, ["a"]) == {"a": 2, "b": 1, "c": 1}
    assert d.send(2, ["a"]) == {"a"}


def test_a_landed_version_never_installed_rides_on_the_next_delta():
    d = Driver(["a", "b", "c"])
    d.send(1, None)
    d.book.installed(1)
    d.send(2, ["a"])
    d.book.landed(2)
    assert d.send(3, ["b"]) == {"a", "b"}  # the rollouts hold 1
    d.book.landed(3)
    assert d.book.installed(3) == {"a": 2, "b": 3, "c": 1}
    assert d.book.held_version == 3 and d.send(4, []) == frozenset()


def test_torn_parameters_make_the_next_transfer_full():
    d = Driver(["a", "b"])
    d.send(1, None)
    d.book.installed(1)
    d.send(2, ["a"])
    d.book.torn()
    assert d.book.holds is None and d.send(3, ["b"]) is None


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
