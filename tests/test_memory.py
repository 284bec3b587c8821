"""Memory over many updates, in one process: what the library's own code keeps per update.

A group that runs for days must not grow with every update (docs/failures.md, "Memory over
many updates"). These tests drive 120 updates through the adapters on
`LocalControl` (no Monarch: what a mesh adds per message is measured by
benchmarks/bench_soak.py and benchmarks/message_memory.py) and compare the Python heap
allocated by `weightbridge` code between two points after a warm-up: every per-update
structure (logs, records per version, futures, registry entries) must be full or empty by
then, so nothing made by the library's code stays behind per update.
"""

import gc
import tracemalloc

import pytest
import torch
from tinygroup import MODES, build, checkpoint, connect, in_threads, send

from weightbridge import TransferConfig
from weightbridge.adapters.base import ADAPTER_SPANS
from weightbridge.coordination.worker import MAX_EVENTS

WARMUP, MEASURED = 80, 40
"""Updates before the first heap snapshot, and between each two of the three snapshots. The
bounded logs (`MAX_EVENTS`, `ADAPTER_SPANS`) fill within the warm-up: a worker logs 3 events
and, with `ROUND_BYTES`, 2-6 spans per update."""
ROUND_BYTES = 24
"""tinygroup's 74 bytes in rounds of at most 24: several rounds per update, as on a real
model, so the span logs fill as they would there."""


def _updates(trainers, rollouts, versions: range, ss: bool) -> None:
    """``versions`` one after another, each moved to every rollout before the next is sent
    (so every version is a transfer, in the staged modes too)."""
    for v in versions:
        got = in_threads(*send(trainers, v, ss=ss), *[
            lambda a=a: a.wait_for_version(v, poll_interval_s=0.0002) for _, a in rollouts])
        assert got == [None] * len(trainers) + [v] * len(rollouts), (v, got)


def _library_heap() -> int:
    """Bytes of live Python objects allocated by weightbridge's own code, after a full
    collection (garbage in reference cycles is not what a structure keeps)."""
    gc.collect()
    snapshot = tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.Filter(True, "*/weightbridge/*")])
    return sum(stat.size for stat in snapshot.statistics("filename"))


@pytest.mark.parametrize("mode", [
    "sync", "rs",  # (the staged senders' take as long again: the full suite runs them)
    pytest.param("ss", marks=pytest.mark.slow), pytest.param("async", marks=pytest.mark.slow)])
def test_the_library_keeps_nothing_per_update_after_warm_up(mode):
    ss, rs = MODES[mode]
    config = TransferConfig(sender_staging=ss, receiver_staging=rs, round_bytes=ROUND_BYTES,
                            timeout_s=30)
    _, trainers, rollouts = build(config)
    connect(trainers)
    tracemalloc.start(1)
    try:
        _updates(trainers, rollouts, range(1, WARMUP + 1), ss)
        heaps = [_library_heap()]
        for first in (WARMUP + 1, WARMUP + MEASURED + 1):
            _updates(trainers, rollouts, range(first, first + MEASURED), ss)
            heaps.append(_library_heap())
    finally:
        tracemalloc.stop()
    last_version = WARMUP + 2 * MEASURED
    for _, a in trainers + rollouts:
        assert len(a.events) <= MAX_EVENTS and len(a.spans) <= ADAPTER_SPANS
    # The checkpoint's last version is in every rollout, bit for bit.
    last = checkpoint(last_version)
    for model, a in rollouts:
        assert a.version == last_version
        assert all(torch.equal(p.view(torch.uint8), last[n].view(torch.uint8))
                   for n, p in model.params.items())
    # Nothing of the library's should stay per update. What stays grows over both stretches;
    # a snapshot also catches a few KB that happen to be alive then (the bounded logs' mix of
    # entries, a frame): up to about 100 B per update of a stretch with the other xdist
    # worker loading the CPU, under 16 B quiet. The logs this test was written for kept
    # 2.3-2.7 KB per update.
    grown = min(b - a for a, b in zip(heaps, heaps[1:]))
    assert grown / MEASURED < 128, (f"the library's Python heap grew {heaps[1] - heaps[0]} B "
                                   f"and {heaps[2] - heaps[1]} B over two stretches of "
                                   f"{MEASURED} updates ({grown / MEASURED:.0f} B per update "
                                   f"at least)")
