"""Proc meshes on remote Monarch workers: the multi-host path of the controller.

On a cluster, each host runs a Monarch worker (`python -m controller.worker ADDRESS`, or any
process calling `run_worker_loop_forever`), and the controller attaches to them instead of
spawning processes on its own host. The controller and the workers must use a TCP transport:
export ``HYPERACTOR_MESH_DEFAULT_TRANSPORT=tcp://<this host's address>:0`` before starting either
(plain ``tcp`` fails on hosts whose name resolves only to loopback).

Typical usage::

    owner, procs = attach_procs(["tcp://node0:4444", "tcp://node1:4444"], gpus=8, name="trainer")
    ...  # spawn actors on procs; owner.stop() when done (the workers keep running)
"""

from __future__ import annotations

import os

TRANSPORT_ENV = "HYPERACTOR_MESH_DEFAULT_TRANSPORT"


def attach_procs(addresses: list[str], *, gpus: int, name: str) -> tuple:
    """One proc per GPU on every worker host: (the proc mesh, to stop it when done; the same
    procs as a one-dim ``worker`` mesh, host-major, to spawn actors on)."""
    if not addresses:
        raise ValueError(f"no worker addresses given for the {name} mesh")
    transport = os.environ.get(TRANSPORT_ENV, "")
    if not transport.startswith("tcp://"):
        raise ValueError(
            f"attaching to remote workers needs a TCP transport: export "
            f"{TRANSPORT_ENV}=tcp://<this host's address>:0 (got {transport!r}) before starting "
            f"the controller and the workers")
    from monarch.actor import attach_to_workers

    from weightbridge.mesh.transport import configure_transport

    configure_transport()  # before the procs start: they read the RDMA config at start-up
    hosts = attach_to_workers(workers=addresses, ca="trust_all_connections", name=name)
    procs = hosts.spawn_procs(per_host={"gpus": gpus})
    return procs, procs.flatten("worker")


def parse_addresses(text: str) -> list[str]:
    """``tcp://a:4444,tcp://b:4444`` -> a list, checked for the scheme."""
    out = [a.strip() for a in text.split(",") if a.strip()]
    for a in out:
        if "://" not in a:
            raise ValueError(f"worker address {a!r} should look like tcp://HOST:PORT")
    return out
