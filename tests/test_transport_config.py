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


def test_a_batch_with_a_write_of_the_wrong_size_is_refused_before_anything_moves():
    """Issue 43, item 1: `write_batch` checks every range before it submits the action."""
    import torch

    arena = torch.zeros(64, dtype=torch.uint8)
    handles = transport.register_ranges([arena], [(0, 0, 32), (0, 32, 32)])
    try:
        with pytest.raises(ValueError, match="writes must cover exactly one registered range"):
            transport.write_batch([(handles[(0, 0, 32)], torch.full((32,), 7, dtype=torch.uint8)),
                                   (handles[(0, 32, 32)], torch.ones(16, dtype=torch.uint8))])
        assert torch.equal(arena, torch.zeros(64, dtype=torch.uint8))
    finally:
        transport.drop_all(handles)
