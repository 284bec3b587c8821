"""Proc meshes for the mesh tests: a trainer and a rollout proc mesh on this host.

    with proc_pair(4, 4) as (trainer_procs, rollout_procs):
        ...

One ``worker`` axis each; the RDMA transport is configured before anything spawns (the
children read it at start-up), and both meshes are stopped on exit, also when the test fails.
`bootstrap_children` lists the proc processes a test left behind.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def proc_pair(trainers: int, rollouts: int, names: tuple[str, str] = ("trainer", "rollout")):
    """(trainer procs, rollout procs) of ``trainers`` and ``rollouts`` workers."""
    from monarch.actor import this_host

    from weightbridge.monarch_transport import configure_transport

    configure_transport()
    meshes = []
    try:
        for workers, name in zip((trainers, rollouts), names):
            meshes.append(this_host().spawn_procs(per_host={"worker": workers}, name=name))
        yield tuple(meshes)
    finally:
        for mesh in reversed(meshes):
            mesh.stop().get(timeout=60)


def bootstrap_children() -> set[int]:
    """Monarch proc processes descended from this test process."""
    me, found = os.getpid(), set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if b"bootstrap_main" not in (entry / "cmdline").read_bytes():
                continue
            pid = int(entry.name)
            while pid > 1:  # walk up to us, or to init
                stat = (Path("/proc") / str(pid) / "stat").read_text()
                pid = int(stat.rsplit(")", 1)[1].split()[1])
                if pid == me:
                    found.add(int(entry.name))
                    break
        except (OSError, ValueError, IndexError):
            continue  # the process exited while we looked
    return found
