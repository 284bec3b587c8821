"""Proc meshes on remote Monarch workers: the multi-host path of the controller.

On a cluster, each host runs a Monarch worker (`python -m controller.worker ADDRESS`, or any
process calling `run_worker_loop_forever`), and the controller attaches to them instead of
spawning processes on its own host. Both ends authenticate each other with mutual TLS
(controller/security.py: ``tls://`` addresses, the HYPERACTOR_TLS_* files); plaintext
trust-all ``tcp://`` only with ``Security(None)`` (``--insecure``). Export
``HYPERACTOR_MESH_DEFAULT_TRANSPORT=tls://<this host's address>:0`` (``tcp://`` when insecure)
before starting either (plain ``tls``/``tcp`` fails on hosts whose name resolves only to
loopback).

Before Monarch dials, `probe_workers` runs one TLS handshake per worker with this side's files
(Python's ``ssl``): a worker that refuses this controller's certificate, or whose certificate
the CA did not sign, is reported by name within seconds, and no proc is spawned. An
``--insecure`` controller sends each worker a TLS hello instead (`probe_plaintext`): a worker
that answers it runs mutual TLS and would never accept a plaintext controller, so it is named
at once too. Monarch's own attach, which retries a refused handshake for as long as it is let,
is bounded by ``timeout_s``.

Typical usage::

    security = resolve(...)                  # controller/security.py; env applied before monarch
    owner, procs = attach_procs(["tls://node0:4444", "tls://node1:4444"], gpus=8,
                                name="trainer", security=security)
    ...  # spawn actors on procs; owner.stop() when done (the workers keep running)
"""

from __future__ import annotations

import os
import socket
import ssl
from concurrent.futures import ThreadPoolExecutor

from controller.security import Credentials, Security, resolve

ATTACH_TIMEOUT_S = 60.0
"""Monarch retries a refused TLS handshake until its delivery timeout; this bounds the wait."""
PROBE_WAIT_S = 1.0
"""After the handshake, how long to wait for a worker's alert refusing our certificate (TLS 1.3
clients learn of it only on their first read)."""


class WorkerRefused(RuntimeError):
    """A worker refused this controller, or this controller refused a worker (message: which)."""


def attach_procs(addresses: list[str], *, gpus: int, name: str,
                 security: Security | None = None, timeout_s: float = ATTACH_TIMEOUT_S,
                 probe: bool = True) -> tuple:
    """One proc per GPU on every worker host: (the proc mesh, to stop it when done; the same
    procs as a one-dim ``worker`` mesh, host-major, to spawn actors on).

    ``security`` None: this process's HYPERACTOR_TLS_* files (ValueError without them; pass
    ``Security(None)`` to trust all). Raises `WorkerRefused` when a handshake is refused or the
    workers do not come up within ``timeout_s``; nothing is spawned then."""
    if not addresses:
        raise ValueError(f"no worker addresses given for the {name} mesh")
    if security is None:
        security = resolve(tls_dir=None, ca=None, cert=None, key=None, insecure=False,
                           name="controller")
    for a in addresses:
        security.check_address(a, f"{name} worker address")
    security.check_transport(os.environ)
    if any(os.environ.get(k) != v for k, v in security.env.items()):
        raise ValueError(f"the {name} mesh's TLS files are not this process's "
                         f"({', '.join(security.env)}): export them before Monarch is imported "
                         f"(os.environ.update(security.env))")
    if probe:
        check_workers(addresses, security)
    from monarch.actor import attach_to_workers

    from weightbridge.driver import configure_transport

    configure_transport()  # before the procs start: they read the RDMA config at start-up
    # Monarch 0.7.0 raises NotImplementedError for any other ca=; on tls:// addresses the
    # channel enforces mutual TLS with the HYPERACTOR_TLS_* files itself.
    hosts = attach_to_workers(workers=addresses, ca="trust_all_connections", name=name)
    _bounded(hosts.initialized, timeout_s, name, addresses, "accept the controller")
    procs = hosts.spawn_procs(per_host={"gpus": gpus})
    _bounded(procs.initialized, timeout_s, name, addresses, "start their procs")
    return procs, procs.flatten("worker")


def _bounded(future, timeout_s: float, name: str, addresses: list[str], what: str) -> None:
    try:
        future.get(timeout=timeout_s)
    except TimeoutError:
        raise WorkerRefused(
            f"the {name} workers {', '.join(addresses)} did not {what} within {timeout_s:g}s: a "
            f"refused TLS handshake (a certificate the other side's CA did not sign, or a "
            f"tls/tcp mismatch) or an unreachable host; Monarch's log (/tmp/$USER/"
            f"monarch_log.log) has the handshake errors") from None


def check_workers(addresses: list[str], security: Security) -> None:
    """Before Monarch dials: `WorkerRefused` naming every worker that will not take this
    controller (a refused handshake, or a TLS worker for an ``--insecure`` controller)."""
    if security.credentials is not None:
        probe_workers(addresses, security.credentials)
    else:
        probe_plaintext(addresses)


def probe_workers(addresses: list[str], creds: Credentials,
                  timeout_s: float = 10.0) -> None:
    """One mutual-TLS handshake per worker, in parallel; `WorkerRefused` naming every worker
    that refused us or that we refuse, and why."""
    _each(addresses, lambda a: _probe(a, creds, timeout_s))


def _probe(address: str, creds: Credentials, timeout_s: float) -> str | None:
    host, port = _host_port(address)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies the worker's cert and host name
    ctx.load_verify_locations(creds.ca)
    ctx.load_cert_chain(creds.cert, creds.key)
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as raw:
            with ctx.wrap_socket(raw, server_hostname=host) as s:
                s.settimeout(PROBE_WAIT_S)
                try:
                    s.recv(1)  # an accepted client reads nothing; a refused one, the alert
                except (socket.timeout, TimeoutError):
                    return None
                return None
    except ssl.SSLCertVerificationError as e:
        return (f"worker {address} presented a certificate this controller does not trust "
                f"({e.verify_message}; the CA file is {creds.ca})")
    except ssl.SSLError as e:
        return (f"worker {address} refused this controller's certificate {creds.cert} "
                f"({e.reason or e}: its CA did not sign it), or does not speak TLS")
    except (socket.timeout, TimeoutError):
        return (f"worker {address} did not complete a TLS handshake within {timeout_s:g}s (a "
                f"plaintext tcp:// worker started with --insecure?)")
    except OSError as e:
        return f"worker {address} is unreachable ({e})"


def probe_plaintext(addresses: list[str], timeout_s: float = 10.0) -> None:
    """An ``--insecure`` controller's check: `WorkerRefused` naming every worker that answers a
    TLS hello (it runs mutual TLS and would let Monarch's plaintext attach time out) or that
    cannot be reached. A plaintext worker drops the hello as a bad frame."""
    _each(addresses, lambda a: _speaks_tls(a, timeout_s))


def _each(addresses: list[str], check) -> None:
    """``check`` every worker address in parallel; `WorkerRefused` with every refusal."""
    with ThreadPoolExecutor(max_workers=min(32, len(addresses))) as pool:
        errors = [e for e in pool.map(check, addresses) if e]
    if errors:
        raise WorkerRefused("; ".join(errors) + " (nothing was attached or spawned)")


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.split("://", 1)[1].rpartition(":")
    return host, int(port)


def _speaks_tls(address: str, timeout_s: float) -> str | None:
    host, port = _host_port(address)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE  # only the first reply counts
    hello = ssl.MemoryBIO()
    tls = ctx.wrap_bio(ssl.MemoryBIO(), hello, server_hostname=host)
    try:
        tls.do_handshake()
    except ssl.SSLWantReadError:
        pass  # the ClientHello is in ``hello`` now
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as raw:
            raw.sendall(hello.read())
            raw.settimeout(PROBE_WAIT_S)
            try:
                reply = raw.recv(3)
            except (socket.timeout, TimeoutError, ConnectionResetError):
                return None  # a plaintext Monarch worker waits for the rest of a frame, or drops it
    except OSError as e:
        return f"worker {address} is unreachable ({e})"
    # A TLS server answers with a handshake record (0x16) of TLS 1.x (0x03, minor).
    if len(reply) >= 2 and reply[0] == 0x16 and reply[1] == 0x03:
        return (f"worker {address} runs mutual TLS and does not accept an --insecure "
                f"controller: give this controller the cluster's TLS files (--tls-dir, or "
                f"--tls-ca/--tls-cert/--tls-key) and tls:// addresses, or start that worker "
                f"with --insecure")
    return None


def parse_addresses(text: str) -> list[str]:
    """``tls://a:4444,tls://b:4444`` -> a list, checked for the scheme."""
    out = [a.strip() for a in text.split(",") if a.strip()]
    for a in out:
        if "://" not in a or ":" not in a.split("://", 1)[1]:
            raise ValueError(f"worker address {a!r} should look like tls://HOST:PORT")
    return out
