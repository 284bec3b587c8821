"""Who may attach to a worker, and who a controller trusts: mutual TLS by default, trust-all only
when asked (``--insecure``). Pure: reads files and the environment, imports no Monarch.

Monarch 0.7.0's ``tls://`` channel does the work: a process whose transport is ``tls://HOST:PORT``
serves only peers presenting a certificate signed by its CA file, and dials only peers whose
certificate that CA signed and names the host it dialled (rustls, TLS 1.3). It reads its files
from ``HYPERACTOR_TLS_CA``, ``HYPERACTOR_TLS_CERT`` and ``HYPERACTOR_TLS_KEY`` when it starts, so
`Security.env` must be in the environment before Monarch is imported, and children inherit it.
(The ``private_key=``/``ca=`` arguments of ``attach_to_workers`` and ``run_worker_loop_forever``
raise ``NotImplementedError`` in 0.7.0 for anything but ``ca="trust_all_connections"``; with a
``tls://`` address that value only skips that unimplemented check: the channel still verifies.)

Where the files come from, first match wins: ``--tls-dir DIR`` (a folder made by
``python -m controller.certs``: ``DIR/ca.crt``, ``DIR/<name>.crt``, ``DIR/<name>.key``, where
``<name>`` is ``controller`` or the worker's host), ``--tls-ca/--tls-cert/--tls-key``, then the
three environment variables above.

Typical usage::

    security = resolve(tls_dir=None, ca=None, cert=None, key=None, insecure=False,
                       name="controller")      # ValueError saying how to make the files
    os.environ.update(security.env)             # before importing monarch
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

CA_ENV, CERT_ENV, KEY_ENV = "HYPERACTOR_TLS_CA", "HYPERACTOR_TLS_CERT", "HYPERACTOR_TLS_KEY"
"""Monarch's own variables: its ``tls://`` channel reads its files from them."""
TRANSPORT_ENV = "HYPERACTOR_MESH_DEFAULT_TRANSPORT"
CONTROLLER = "controller"
MAKE_HINT = ("make them with `python -m controller.certs make DIR --hosts HOST1,HOST2,... "
             "--controller CONTROLLER_ADDR` (docs/controller.md, \"Authenticated workers\")")


@dataclass(frozen=True)
class Credentials:
    """One side's TLS files: the CA it trusts, its certificate (signed by that CA), its key."""

    ca: str
    cert: str
    key: str

    @classmethod
    def from_dir(cls, folder: str | os.PathLike, name: str) -> "Credentials":
        """The files `controller.certs` made for ``name`` (a host, or ``controller``)."""
        d = Path(folder)
        return cls(ca=str(d / "ca.crt"), cert=str(d / f"{name}.crt"), key=str(d / f"{name}.key"))


@dataclass(frozen=True)
class Security:
    """Mutual TLS with ``credentials``, or (None) trust-all plaintext TCP."""

    credentials: Credentials | None

    @property
    def insecure(self) -> bool:
        return self.credentials is None

    @property
    def scheme(self) -> str:
        """The Monarch channel scheme of addresses and transports: ``tls`` or ``tcp``."""
        return "tcp" if self.insecure else "tls"

    @property
    def env(self) -> dict[str, str]:
        """The variables Monarch reads its TLS files from (nothing when insecure)."""
        c = self.credentials
        return {} if c is None else {CA_ENV: c.ca, CERT_ENV: c.cert, KEY_ENV: c.key}

    def check_address(self, address: str, what: str) -> None:
        """``address`` must use this mode's scheme (ValueError saying which)."""
        scheme = address.split("://", 1)[0] if "://" in address else ""
        if scheme == self.scheme:
            return
        if self.insecure:
            raise ValueError(f"{what} {address!r}: an --insecure run uses plaintext tcp://"
                             f"HOST:PORT addresses; for tls:// give the TLS files instead of "
                             f"--insecure")
        raise ValueError(f"{what} {address!r}: an authenticated run uses tls://HOST:PORT "
                         f"(mutual TLS); tcp:// is plaintext and lets anyone attach. Write "
                         f"tls://, or pass --insecure on a network only you can reach")

    def check_transport(self, env: Mapping[str, str] = os.environ) -> None:
        """``HYPERACTOR_MESH_DEFAULT_TRANSPORT`` must be ``<scheme>://<this host>:0``, and this
        side's certificate must name that host (peers dial back to it and check the name)."""
        transport = env.get(TRANSPORT_ENV, "")
        if not transport.startswith(f"{self.scheme}://"):
            raise ValueError(f"this {'--insecure' if self.insecure else 'authenticated'} run "
                             f"needs export {TRANSPORT_ENV}={self.scheme}://<this host's "
                             f"address>:0 before it starts (got {transport!r})")
        self.check_named(transport.split("://", 1)[1].rsplit(":", 1)[0], TRANSPORT_ENV)

    def check_named(self, host: str, what: str) -> None:
        """This side's certificate names ``host`` (with ``openssl`` on PATH): a peer that dials
        ``host`` refuses a certificate that does not (ValueError saying so)."""
        if self.credentials is None or shutil.which("openssl") is None:
            return
        try:
            ipaddress.ip_address(host)
            kind = "-checkip"
        except ValueError:
            kind = "-checkhost"
        done = subprocess.run(["openssl", "x509", "-in", self.credentials.cert, "-noout", kind,
                               host], capture_output=True, text=True)
        if "does match" not in done.stdout:
            raise ValueError(f"TLS certificate {self.credentials.cert} does not name {host} "
                             f"(the host of {what}); peers dialling {host} would refuse it: "
                             f"make it for {host} (controller.certs --hosts/--controller)")


def insecure_warning(role: str) -> str:
    """What trust-all exposes, for the ``role`` (``worker`` / ``controller``) running it."""
    what = ("anyone who can reach this worker's port can attach to it, spawn processes that "
            "run their own code on this host, and read or overwrite the weights"
            if role == "worker" else
            "the controller attaches to whatever answers at the worker addresses (an impostor "
            "receives the weights and the code it is asked to run)")
    return (f"WARNING: --insecure: {what}; every message and weight byte crosses the network "
            f"in plaintext (tcp://). Use it only on a network that only you can reach, such as "
            f"the local emulated cluster.")


def add_flags(parser: argparse.ArgumentParser) -> None:
    """``--tls-dir``, ``--tls-ca``, ``--tls-cert``, ``--tls-key``, ``--insecure``."""
    parser.add_argument("--tls-dir", metavar="DIR",
                        help="folder made by `python -m controller.certs make`: uses "
                             "DIR/ca.crt and this side's DIR/<name>.crt, DIR/<name>.key")
    parser.add_argument("--tls-ca", metavar="PEM",
                        help=f"CA certificate(s) to trust (default ${CA_ENV})")
    parser.add_argument("--tls-cert", metavar="PEM",
                        help=f"this side's certificate, signed by the CA (default ${CERT_ENV})")
    parser.add_argument("--tls-key", metavar="PEM",
                        help=f"this side's private key (default ${KEY_ENV})")
    parser.add_argument("--insecure", action="store_true",
                        help="trust every connection, plaintext tcp:// (prints what it exposes)")


def resolve(*, tls_dir: str | None, ca: str | None, cert: str | None, key: str | None,
            insecure: bool, name: str, env: Mapping[str, str] = os.environ) -> Security:
    """The security of one side (``name``: ``controller`` or the worker's host) from its flags,
    then the environment; its files checked. Raises ValueError saying what to fix."""
    explicit = {"--tls-ca": ca, "--tls-cert": cert, "--tls-key": key}
    given = [flag for flag, value in explicit.items() if value]
    if insecure:
        if tls_dir or given:
            raise ValueError(f"--insecure turns TLS off, but {', '.join(given or ['--tls-dir'])} "
                             f"gives TLS files: drop one of them")
        return Security(None)
    if tls_dir and given:
        raise ValueError(f"--tls-dir names all three files; drop {', '.join(given)} or "
                         f"--tls-dir")
    if tls_dir:
        if not Path(tls_dir).is_dir():
            raise ValueError(f"--tls-dir {tls_dir}: no such folder; {MAKE_HINT}")
        creds = Credentials.from_dir(tls_dir, name)
    else:
        from_env = {"--tls-ca": env.get(CA_ENV), "--tls-cert": env.get(CERT_ENV),
                    "--tls-key": env.get(KEY_ENV)}
        values = {flag: explicit[flag] or from_env[flag] for flag in explicit}
        missing = [flag for flag, value in values.items() if not value]
        if len(missing) == 3:
            raise ValueError(f"no TLS files: multi-host runs are authenticated (mutual TLS) "
                             f"unless told --insecure. Give --tls-dir DIR, or --tls-ca, "
                             f"--tls-cert and --tls-key (or export {CA_ENV}, {CERT_ENV}, "
                             f"{KEY_ENV}); {MAKE_HINT}")
        if missing:
            envs = {"--tls-ca": CA_ENV, "--tls-cert": CERT_ENV, "--tls-key": KEY_ENV}
            raise ValueError(f"incomplete TLS files: missing "
                             f"{', '.join(f'{m} (or ${envs[m]})' for m in missing)}; each "
                             f"side needs the CA, its certificate and its key")
        creds = Credentials(ca=values["--tls-ca"], cert=values["--tls-cert"],
                            key=values["--tls-key"])
    check_files(creds)
    return Security(creds)


def check_files(creds: Credentials) -> None:
    """Each file is a regular file (a FIFO would wait for a writer) holding PEM of its kind,
    the key not encrypted; with ``openssl`` on PATH, the certificate is in its validity
    period, signed by a CA of the CA file, usable by a client (mutual TLS: clientAuth), and
    the key is the certificate's. ValueError naming the cause otherwise."""
    for what, path, marker in (("CA file", creds.ca, "-----BEGIN CERTIFICATE-----"),
                               ("certificate", creds.cert, "-----BEGIN CERTIFICATE-----"),
                               ("key", creds.key, "PRIVATE KEY-----")):
        if Path(path).exists() and not Path(path).is_file():
            raise ValueError(f"TLS {what} {path} is not a regular file (a FIFO, a device or a "
                             f"folder): give the PEM file `python -m controller.certs` makes")
        try:
            text = Path(path).read_text(errors="replace")
        except OSError as e:
            raise ValueError(f"TLS {what} {path}: cannot read it ({e.strerror}); "
                             f"{MAKE_HINT}") from None
        if marker not in text:
            raise ValueError(f"TLS {what} {path} holds no PEM {marker.strip('-')}; give the "
                             f"PEM file `python -m controller.certs` makes")
        if what == "key" and ("ENCRYPTED" in text):
            raise ValueError(f"TLS key {path} is encrypted (it needs a passphrase, which no "
                             f"worker can type): give it unencrypted (`openssl pkey -in "
                             f"{path} -out plain.key`, kept readable by its owner only)")
    if shutil.which("openssl") is None:
        return
    _check_dates(creds.cert)
    done = _run("verify", "-CAfile", creds.ca, creds.cert)
    if done.returncode != 0:
        detail = (done.stdout + done.stderr).strip().splitlines()
        raise ValueError(f"TLS certificate {creds.cert} is not signed by a CA in {creds.ca} "
                         f"({detail[-1] if detail else 'openssl verify failed'}); peers would "
                         f"refuse it: give the certificate your cluster's CA signed")
    usage = _run("x509", "-in", creds.cert, "-noout", "-ext", "extendedKeyUsage").stdout
    if "Extended Key Usage" in usage and "TLS Web Client Authentication" not in usage:
        raise ValueError(f"TLS certificate {creds.cert} has no clientAuth extended key usage "
                         f"({usage.strip().splitlines()[-1].strip()}): in mutual TLS every side "
                         f"is also a client, and its peers refuse it; {MAKE_HINT}")
    pub = [_run(*args).stdout for args in
           (("x509", "-in", creds.cert, "-noout", "-pubkey"),
            ("pkey", "-in", creds.key, "-pubout", "-passin", "pass:"))]
    if not pub[0] or pub[0] != pub[1]:
        raise ValueError(f"TLS key {creds.key} is not the key of certificate {creds.cert}: "
                         f"give the .key made with that .crt")


def _run(*args: str) -> subprocess.CompletedProcess:
    """``openssl *args``, never waiting on a terminal (no passphrase prompt)."""
    return subprocess.run(["openssl", *args], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=60)


def _check_dates(cert: str) -> None:
    """The certificate is valid now (``openssl x509 -checkend 0``; its dates named)."""
    dates = dict(line.split("=", 1) for line in _run(
        "x509", "-in", cert, "-noout", "-startdate", "-enddate").stdout.splitlines()
        if "=" in line)
    if _run("x509", "-in", cert, "-noout", "-checkend", "0").returncode != 0:
        raise ValueError(f"TLS certificate {cert} expired on {dates.get('notAfter', '?')}: "
                         f"peers refuse it; make new files ({MAKE_HINT})")
    start = dates.get("notBefore")
    if start and _not_yet(start):
        raise ValueError(f"TLS certificate {cert} is not valid before {start} (check this "
                         f"host's clock, or wait): peers refuse it until then")


def _not_yet(stamp: str) -> bool:
    """``stamp`` (openssl's ``Jan  1 00:00:00 2099 GMT``) is later than now."""
    when = datetime.datetime.strptime(" ".join(stamp.split()), "%b %d %H:%M:%S %Y %Z")
    return when.replace(tzinfo=datetime.timezone.utc) > datetime.datetime.now(
        datetime.timezone.utc)
