"""Make the TLS files of a small cluster with the ``openssl`` tool: a CA, a key and certificate
per host and for the controller.

    python -m controller.certs make certs/ --hosts node0,node1,10.0.0.7 --controller 10.0.0.1

writes ``certs/ca.crt`` (every side's trust anchor), ``certs/ca.key`` (only for signing: keep it
off the cluster), and ``certs/<name>.crt`` + ``certs/<name>.key`` for each host and for the
controller (``controller.crt``/``controller.key``). Each certificate names its host (a DNS name or
an IP address, as a subjectAltName) because Monarch's ``tls://`` channel checks the name a peer
was dialled by; each is usable to serve and to dial (every process does both). Keys are EC P-256,
written readable by their owner only.

Copy ``ca.crt`` and a host's own ``.crt``/``.key`` to that host, and point the worker there at
them (docs/multihost.md, "Authenticated workers"). No crypto is done here: every step is one
``openssl`` command.

Typical usage::

    paths = make_cluster_certs("certs", hosts=["10.77.0.2", "10.77.0.3"], controller=["10.77.0.1"])
    paths["10.77.0.2"]   # Credentials(ca=..., cert=..., key=...)
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import secrets
import shutil
import subprocess
import tempfile
from pathlib import Path

from controller.security import Credentials

CONTROLLER = "controller"
"""The file name of the controller's certificate and key."""
DAYS = 365


class CertError(RuntimeError):
    """An ``openssl`` step failed (the message has its output)."""


def _openssl(*args: str) -> str:
    if shutil.which("openssl") is None:
        raise CertError("the `openssl` command-line tool is not installed; install it (e.g. "
                        "`apt-get install openssl`) or make the files with your own CA")
    done = subprocess.run(["openssl", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise CertError(f"`openssl {' '.join(args)}` failed: {done.stderr.strip()}")
    return done.stdout


def subject_alt_name(names: list[str]) -> str:
    """``IP:`` for addresses, ``DNS:`` for host names, in one subjectAltName value."""
    out = []
    for n in names:
        try:
            out.append(f"IP:{ipaddress.ip_address(n)}")
        except ValueError:
            out.append(f"DNS:{n}")
    return ",".join(out)


def _check_name(name: str) -> str:
    if not name or name in (".", "..") or "/" in name or name.startswith("-") or "," in name:
        raise ValueError(f"host name {name!r} cannot name a certificate file: give a DNS name "
                         f"or an IP address")
    return name


def make_ca(folder: Path, *, days: int = DAYS) -> None:
    """``ca.key`` and a self-signed ``ca.crt`` in ``folder``, its name unique (so two clusters'
    CAs never share a name and a peer of the other one reads as an unknown issuer)."""
    name = f"weightbridge cluster CA {secrets.token_hex(4)}"
    _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256",
             "-out", str(folder / "ca.key"))
    os.chmod(folder / "ca.key", 0o600)
    _openssl("req", "-x509", "-new", "-key", str(folder / "ca.key"), "-sha256",
             "-days", str(days), "-subj", f"/CN={name}", "-out", str(folder / "ca.crt"),
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign")


def make_cert(folder: Path, name: str, alt_names: list[str], *, days: int = DAYS) -> Credentials:
    """``name.key`` and ``name.crt`` signed by ``folder``'s CA, valid for ``alt_names``."""
    _check_name(name)
    key, cert = folder / f"{name}.key", folder / f"{name}.crt"
    _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256",
             "-out", str(key))
    os.chmod(key, 0o600)
    with tempfile.TemporaryDirectory() as tmp:
        csr, ext = Path(tmp) / "req.csr", Path(tmp) / "ext.cnf"
        _openssl("req", "-new", "-key", str(key), "-subj", f"/CN={name}", "-out", str(csr))
        ext.write_text("basicConstraints=critical,CA:FALSE\n"
                       "keyUsage=critical,digitalSignature\n"
                       "extendedKeyUsage=serverAuth,clientAuth\n"
                       f"subjectAltName={subject_alt_name(alt_names)}\n")
        _openssl("x509", "-req", "-in", str(csr), "-CA", str(folder / "ca.crt"),
                 "-CAkey", str(folder / "ca.key"), "-CAcreateserial", "-sha256",
                 "-days", str(days), "-extfile", str(ext), "-out", str(cert))
    return Credentials(ca=str(folder / "ca.crt"), cert=str(cert), key=str(key))


def make_cluster_certs(folder: str | os.PathLike, *, hosts: list[str], controller: list[str],
                       days: int = DAYS) -> dict[str, Credentials]:
    """A new CA in ``folder`` (created if missing; existing CA files are refused), one key and
    certificate per host (named and valid for that host name or address) and one for the
    controller (valid for ``controller``'s names). Returns each side's `Credentials`, the
    controller's under ``"controller"``."""
    if not hosts:
        raise ValueError("give at least one host (--hosts a,b,...)")
    if not controller:
        raise ValueError("give the controller's address or host name (--controller ADDR): "
                         "the workers' procs dial back to it and check its certificate")
    names = [_check_name(h) for h in hosts]
    if len(set(names)) != len(names) or CONTROLLER in names:
        raise ValueError(f"host names must be distinct and not {CONTROLLER!r}, got {hosts}")
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    if (out / "ca.key").exists() or (out / "ca.crt").exists():
        raise ValueError(f"{out} already holds a CA (ca.key/ca.crt); pick an empty folder, so "
                         f"that no certificate is signed by a CA you did not mean")
    make_ca(out, days=days)
    made = {h: make_cert(out, h, [h], days=days) for h in names}
    made[CONTROLLER] = make_cert(out, CONTROLLER, list(controller), days=days)
    return made


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m controller.certs",
                                     description="make a CA and per-host keys with openssl")
    sub = parser.add_subparsers(dest="cmd", required=True)
    make = sub.add_parser("make", help="a new CA, a key+certificate per host and controller")
    make.add_argument("folder")
    make.add_argument("--hosts", required=True,
                      help="comma-separated worker host names or IP addresses, as the "
                           "controller dials them (tcp://HOST:PORT -> HOST)")
    make.add_argument("--controller", required=True,
                      help="comma-separated names/addresses of the controller's host, as in "
                           "its HYPERACTOR_MESH_DEFAULT_TRANSPORT")
    make.add_argument("--days", type=int, default=DAYS)
    args = parser.parse_args(argv)
    split = lambda text: [p.strip() for p in text.split(",") if p.strip()]  # noqa: E731
    try:
        made = make_cluster_certs(args.folder, hosts=split(args.hosts),
                                  controller=split(args.controller), days=args.days)
    except (ValueError, CertError) as e:
        print(f"error: {e}")
        return 2
    print(f"CA: {made[CONTROLLER].ca} (its key {Path(args.folder) / 'ca.key'} signs only: keep "
          f"it off the cluster)")
    for name, c in made.items():
        print(f"{name}: {c.cert} {c.key}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
