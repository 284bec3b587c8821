"""Proc meshes for the mesh tests: a trainer and a rollout proc mesh on this host.

    with proc_pair(4, 4) as (trainer_procs, rollout_procs):          # one "worker" axis each
        ...
    with proc_meshes(("trainer", {"gpus": 2}), ("rollout", {"replica": 2, "tp": 2})) as (t, r):
        ...                                                          # any axes

The RDMA transport is configured before anything spawns (the children read it at start-up),
and every mesh is stopped on exit, also when the test fails. `bootstrap_children` lists the
proc processes a test left behind.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def proc_meshes(*specs: tuple[str, dict[str, int]]):
    """One proc mesh per (name, per_host axes) in ``specs``, in order; those spawned before a
    failing spawn are stopped too."""
    from monarch.actor import this_host

    from weightbridge.mesh.transport import configure_transport

    configure_transport()
    meshes = []
    try:
        for name, per_host in specs:
            meshes.append(this_host().spawn_procs(per_host=dict(per_host), name=name))
        yield tuple(meshes)
    finally:
        errors = []
        for mesh in reversed(meshes):  # a mesh that fails to stop does not keep the others
            try:
                mesh.stop().get(timeout=60)
            except Exception as e:  # noqa: BLE001  (raised below, once all were stopped)
                errors.append(e)
        if errors:
            raise errors[0]


@contextmanager
def proc_pair(trainers: int, rollouts: int, names: tuple[str, str] = ("trainer", "rollout")):
    """(trainer procs, rollout procs) of ``trainers`` and ``rollouts`` workers."""
    with proc_meshes((names[0], {"worker": trainers}), (names[1], {"worker": rollouts})) as pair:
        yield pair


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


def close_group(group, *meshes) -> None:
    """Teardown of a test's transfer group: close it, then stop its actor meshes (those not
    None), also when closing raised."""
    try:
        group.close()
    finally:
        for mesh in meshes:
            if mesh is not None:
                mesh.stop().get(timeout=60)
