"""`benchmarks.machine`: the cores a benchmark's own process tree kept busy, apart from everything
else on the machine, and how fast a core was while it ran."""

import subprocess
import sys
import time

import pytest

from benchmarks.machine import TICKS, PROBE_PERIOD_S, CoreProbe, CpuMeter, _tree_ticks, load

SPIN = "import time\nend = time.process_time() + {s}\nwhile time.process_time() < end: pass"


def test_a_child_spinning_counts_as_ours():
    meter, started = CpuMeter(), time.monotonic()
    child = subprocess.Popen([sys.executable, "-c", SPIN.format(s=30)])
    try:
        time.sleep(1.0)
        use = meter.read()  # read while the child still runs: an exited one is not seen
        # What the child itself was given (on a loaded machine, less than a core), counted
        # from its own /proc entry just after the meter's read.
        child_cores = _tree_ticks(child.pid)[child.pid] / TICKS / (time.monotonic() - started)
    finally:
        child.kill()
        child.wait()
    assert child_cores > 0.05, child_cores  # it ran
    # The meter saw the child's time as ours (up to the tick just read after it), and little
    # else: this test's own process sleeps.
    assert child_cores - 0.1 <= use.ours <= min(1.2, child_cores + 0.3), (use, child_cores)
    assert use.others >= 0 and use.steal >= 0
    assert str(use).startswith("cores: ours ")


def test_idle_waiting_is_not_ours():
    meter = CpuMeter()
    time.sleep(0.5)
    assert meter.read().ours < 0.2


def test_load_reads_uptime():
    assert load().startswith("load ") and load().count(",") == 2


def test_core_probe_samples_an_interval_every_period():
    with CoreProbe() as probe:
        deadline = time.monotonic() + 30
        while not probe.samples(0.0, time.monotonic()):  # the child runs: its first sample
            assert time.monotonic() < deadline, "the core probe took no sample within 30 s"
            time.sleep(0.01)
        start = time.monotonic()
        time.sleep(10 * PROBE_PERIOD_S)
        end = time.monotonic()
        samples = probe.samples(start, end)
        later = probe.samples(end, end + 3600)
    # about one a period (a loaded machine may delay a few)
    assert 5 <= len(samples) <= 11, samples
    assert all(start <= s.at <= end for s in samples)
    assert [s.at for s in samples] == sorted(s.at for s in samples)
    assert all(s.interp_ms > 0 and s.copy_ms > 0 for s in samples)
    assert len(later) <= 1


def test_a_dead_probe_is_reported_not_read_as_no_samples():
    probe = CoreProbe()
    try:
        probe._child.kill()
        probe._child.wait()
        with pytest.raises(RuntimeError, match="probe exited"):
            probe.samples(0.0, time.monotonic())
    finally:
        probe.close()
