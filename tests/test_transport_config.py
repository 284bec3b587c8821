"""`configure_transport` sets what the procs spawned after it inherit."""

import os

import pytest

from weightbridge.mesh import transport


def test_spawned_procs_map_large_buffers_on_their_own(monkeypatch):
    """Issue 23, item 8: buffers made anew at every re-plan stayed resident under glibc's
    sliding mmap threshold (rollouts +80-115 KB per update under RS with delta updates)."""
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    transport.configure_transport()
    assert os.environ["MALLOC_MMAP_THRESHOLD_"] == str(128 << 10)


@pytest.mark.parametrize("given", ["65536", "0"])
def test_a_threshold_the_user_set_is_kept(monkeypatch, given):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", given)
    transport.configure_transport()
    assert os.environ["MALLOC_MMAP_THRESHOLD_"] == given
