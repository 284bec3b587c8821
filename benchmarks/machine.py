"""What this machine's CPUs were doing while a benchmark ran (it is shared and noisy).

`load` is ``uptime``'s load averages. `CpuMeter` splits the cores busy over an interval into
this benchmark's own processes (it and every process it started: the emulated cluster's
workers and their procs), every other process, and steal (time the hypervisor gave another
guest): a point measured while others used the cores is not one to fit or judge a model on.
`core_ms` times a fixed piece of work on one core: a core that runs slower without being
stolen (its clock, a neighbour guest) shows there and nowhere in `CpuUse`.

Typical usage::

    meter = CpuMeter()
    ...                                   # the measured work
    print(meter.read())                   # "cores: ours 1.83, others 0.02, steal 0.00"
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")


def core_ms(repeats: int = 5) -> float:
    """Median ms one core takes for a fixed piece of interpreter work (about 15 ms on this
    machine idle): how fast a core is right now (its clock, a neighbour guest on the same
    physical core), which `CpuUse` does not see. Take it while the measured work is not
    running."""
    took = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        total = 0
        for i in range(200_000):
            total += i * i % 7
        took.append(time.perf_counter() - t0)
    return 1e3 * sorted(took)[repeats // 2]


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
