"""`benchmarks.machine`: the cores a benchmark's own process tree kept busy, apart from everything
else on the machine, and how fast one core is right now."""

import os
import subprocess
import sys
import time

from benchmarks.machine import CpuMeter, core_ms, load

SPIN = "import time\nend = time.process_time() + {s}\nwhile time.process_time() < end: pass"


def test_a_child_spinning_counts_as_ours():
    meter = CpuMeter()
    child = subprocess.Popen([sys.executable, "-c", SPIN.format(s=30)])
    try:
        time.sleep(1.0)
        use = meter.read()  # read while the child still runs: an exited one is not seen
    finally:
        child.kill()
        child.wait()
    # about one core: at least half of it even where the machine is busy
    assert 0.5 <= use.ours <= 1.2, use
    assert use.others >= 0 and use.steal >= 0
    assert str(use).startswith("cores: ours ")


def test_idle_waiting_is_not_ours():
    meter = CpuMeter()
    time.sleep(0.5)
    assert meter.read().ours < 0.2


def test_load_reads_uptime():
    assert load().startswith("load ") and load().count(",") == 2


def test_core_ms_is_slower_with_the_cores_taken():
    idle = core_ms()
    assert idle > 0
    # Every core spun by another process: the probe's core is shared, so its work takes longer.
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN.format(s=30)])
                for _ in range(2 * (os.cpu_count() or 1))]
    try:
        time.sleep(0.5)
        busy = core_ms()
    finally:
        for child in spinners:
            child.kill()
            child.wait()
    assert busy > 1.3 * idle, (idle, busy)
