"""A Monarch worker for one host: the controller attaches to it with `--attach-*` flags.

    python -m controller.worker tls://$HOST_ADDR:4444 --tls-dir certs/    # mutual TLS
    python -m controller.worker tcp://$HOST_ADDR:4444 --insecure          # trust-all, plaintext

Authenticated by default: it serves only controllers whose certificate its CA signed (files from
--tls-dir, --tls-ca/--tls-cert/--tls-key or Monarch's HYPERACTOR_TLS_* variables; see
controller/security.py), and refuses to start without them unless told ``--insecure``.
Its procs use ``HYPERACTOR_MESH_DEFAULT_TRANSPORT`` (``tls://$HOST_ADDR:0`` when unset).
Runs until killed. The controller spawns one proc per GPU on it and stops them when done.
"""

from __future__ import annotations

import argparse
import os
import sys

from controller.security import TRANSPORT_ENV, add_flags, insecure_warning, resolve


def prepare(argv: list[str] | None = None, env=os.environ) -> str:
    """Check the flags, put the TLS files and the transport in ``env`` (before Monarch reads
    them) and return the address to serve. SystemExit with the reason on bad input."""
    parser = argparse.ArgumentParser(prog="python -m controller.worker",
                                     description="a Monarch worker the controller attaches to")
    parser.add_argument("address", help="tls://HOST:PORT (or tcp://HOST:PORT with --insecure)")
    add_flags(parser)
    args = parser.parse_args(argv)
    if "://" not in args.address or ":" not in args.address.split("://", 1)[1]:
        raise SystemExit(f"error: address {args.address!r} should look like tls://HOST:PORT")
    host = args.address.split("://", 1)[1].rsplit(":", 1)[0]
    try:
        security = resolve(tls_dir=args.tls_dir, ca=args.tls_ca, cert=args.tls_cert,
                           key=args.tls_key, insecure=args.insecure, name=host, env=env)
        security.check_address(args.address, "worker address")
        security.check_named(host, "the worker address")
        env.setdefault(TRANSPORT_ENV, f"{security.scheme}://{host}:0")
        security.check_transport(env)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    env.update(security.env)
    if security.insecure:
        print(insecure_warning("worker"), file=sys.stderr, flush=True)
    return args.address


if __name__ == "__main__":
    address = prepare()
    from monarch.actor import run_worker_loop_forever  # after prepare: Monarch reads env once

    # Monarch 0.7.0 raises NotImplementedError for any other ca=; on a tls:// address the
    # channel itself enforces mutual TLS with the HYPERACTOR_TLS_* files (controller/security.py).
    run_worker_loop_forever(address=address, ca="trust_all_connections")
