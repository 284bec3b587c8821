"""What this machine's CPUs were doing while a benchmark ran (it is shared and noisy).

`load` is ``uptime``'s load averages. `CpuMeter` splits the cores busy over an interval into
this benchmark's own processes (it and every process it started: the emulated cluster's
workers and their procs), every other process, and steal (time the hypervisor gave another
guest): a point measured while others used the cores is not one to fit or judge a model on.
`CoreProbe` times a fixed piece of work, every 0.1 s in a child process of its own, in the
CPU time of the thread that ran it: a core that runs slower without being stolen (a neighbour
guest on the same physical core, its clock) shows there and nowhere in `CpuUse`. Waiting for
a core does not count, but how busy the cores are still moves the reading: the work takes
about 1.0 ms on a core woken from idle and 0.55-0.7 ms on busy ones (4 Dec), so compare
readings taken under the same load (the same point of two runs).

Typical usage::

    meter = CpuMeter()
    with CoreProbe() as probe:
        t0 = time.monotonic()
        ...                               # the measured work
        samples = probe.samples(t0, time.monotonic())
    print(meter.read())                   # "cores: ours 1.83, others 0.02, steal 0.00"
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")


PROBE_PERIOD_S = 0.1
"""How often `CoreProbe` runs its work: about 1% of one core."""


@dataclass(frozen=True)
class CoreSample:
    """One run of `CoreProbe`'s fixed work, in CPU ms of the thread that ran it."""

    at: float
    """When it ran (``time.monotonic()``, the same clock in every process)."""
    interp_ms: float
    """A fixed interpreter loop (what the controller and the actors' Python spend)."""
    copy_ms: float
    """A copy of 4 MiB, past the core's own caches (what packs and assembles spend)."""


class CoreProbe:
    """A child process that runs a fixed piece of work every `PROBE_PERIOD_S` until closed;
    `samples` gives those that ran in an interval. Each costs about 1 ms of one core."""

    def __init__(self) -> None:
        # The child appends to the log; this handle reads on from where it last stopped.
        self._log = tempfile.NamedTemporaryFile("r", prefix="core-probe-", suffix=".txt")
        self._child = subprocess.Popen([sys.executable, __file__, self._log.name],
                                       stdin=subprocess.DEVNULL)
        self._taken: list[CoreSample] = []
        self._partial = ""  # a line the child had not finished writing

    def samples(self, start: float, end: float) -> list[CoreSample]:
        """The samples taken between ``start`` and ``end`` (``time.monotonic()``)."""
        if self._child.poll() is not None:
            raise RuntimeError(f"the core probe exited with {self._child.returncode}")
        *lines, self._partial = (self._partial + self._log.read()).split("\n")
        self._taken += [CoreSample(*map(float, line.split())) for line in lines]
        return [s for s in self._taken if start <= s.at <= end]

    def close(self) -> None:
        self._child.kill()
        self._child.wait()
        self._log.close()

    def __enter__(self) -> CoreProbe:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _probe(path: str) -> None:
    """`CoreProbe`'s child: append a `CoreSample` to ``path`` every `PROBE_PERIOD_S`."""
    src, dst = bytearray(4 << 20), bytearray(4 << 20)
    parent = os.getppid()
    with open(path, "a") as out:
        while os.getppid() == parent:  # not left running by a parent that died unclosed
            t0 = time.thread_time_ns()
            total = 0
            for i in range(10_000):
                total += i * i % 7
            t1 = time.thread_time_ns()
            dst[:] = src
            t2 = time.thread_time_ns()
            out.write(f"{time.monotonic():.4f} {(t1 - t0) / 1e6:.4f} {(t2 - t1) / 1e6:.4f}\n")
            out.flush()
            time.sleep(PROBE_PERIOD_S)


def load() -> str:
    """``"load 1.2, 0.8, 0.5"``: the machine's load averages over 1, 5 and 15 minutes."""
    out = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    return "load " + out.split("load average:")[-1].strip()


@dataclass(frozen=True)
class CpuUse:
    """Cores busy on average over an interval, by whom."""

    ours: float
    """This process and its descendants."""
    others: float
    """Every other process on the machine (and the kernel's own work)."""
    steal: float
    """Time the hypervisor ran another guest on this machine's cores."""

    def __str__(self) -> str:
        return f"cores: ours {self.ours:.2f}, others {self.others:.2f}, steal {self.steal:.2f}"


class CpuMeter:
    """Started on construction; `read` gives the `CpuUse` since then. A descendant that
    exited in between is not seen (read while the measured processes still run)."""

    def __init__(self) -> None:
        self._t0 = time.monotonic()
        self._busy0, self._steal0 = _machine_ticks()
        self._ours0 = _tree_ticks(os.getpid())

    def read(self) -> CpuUse:
        seconds = time.monotonic() - self._t0
        busy, steal = _machine_ticks()
        ours = _tree_ticks(os.getpid())
        used = sum(t - self._ours0.get(pid, 0) for pid, t in ours.items()) / TICKS
        total = (busy - self._busy0) / TICKS
        return CpuUse(ours=used / seconds, others=max(0.0, total - used) / seconds,
                      steal=(steal - self._steal0) / TICKS / seconds)


def _machine_ticks() -> tuple[int, int]:
    """(busy, steal) clock ticks of all cores since boot (/proc/stat; busy excludes idle,
    iowait and steal)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(fields[:8]) - fields[3] - fields[4] - fields[7], fields[7]


def _tree_ticks(root: int) -> dict[int, int]:
    """pid -> user + system clock ticks of ``root`` and every live descendant."""
    parent, ticks = {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # it exited meanwhile
            continue
        pid = int(entry.name)
        parent[pid], ticks[pid] = int(fields[1]), int(fields[11]) + int(fields[12])
    children: dict[int, list[int]] = {}
    for pid, ppid in parent.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid in ticks:
            out[pid] = ticks[pid]
            todo += children.get(pid, [])
    return out


if __name__ == "__main__":
    _probe(sys.argv[1])
