"""Who may attach: the TLS files' resolution (flags, --tls-dir, Monarch's HYPERACTOR_TLS_*
variables), the refusals and what they say, the --insecure warning, and the files
`controller.certs` makes. Pure: no Monarch, no namespaces (the handshakes themselves:
tests/test_cluster_tls.py)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from controller.certs import make_cluster_certs
from controller.security import (CA_ENV, CERT_ENV, KEY_ENV, TRANSPORT_ENV, Credentials, Security,
                                 insecure_warning, resolve)

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("openssl") is None,
                                reason="controller.certs makes its files with `openssl`")
NONE = dict(tls_dir=None, ca=None, cert=None, key=None, insecure=False)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("certs")
    make_cluster_certs(folder, hosts=["10.1.0.2", "node1"], controller=["10.1.0.1"])
    return folder


@pytest.fixture(scope="module")
def other(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("other")
    make_cluster_certs(folder, hosts=["10.1.0.2"], controller=["10.1.0.1"])
    return folder


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in (CA_ENV, CERT_ENV, KEY_ENV)}
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60, env={**clean, **(env or {})})


def test_without_files_a_side_is_refused_with_how_to_make_them():
    with pytest.raises(ValueError) as e:
        resolve(**NONE, name="controller", env={})
    for words in ("no TLS files", "python -m controller.certs make", "--insecure", "--tls-dir",
                  CA_ENV):
        assert words in str(e.value)


def test_missing_and_conflicting_flags_are_named():
    with pytest.raises(ValueError, match=r"missing --tls-key \(or \$HYPERACTOR_TLS_KEY\)"):
        resolve(**{**NONE, "ca": "a.crt", "cert": "b.crt"}, name="controller", env={})
    with pytest.raises(ValueError, match="--insecure turns TLS off, but --tls-ca"):
        resolve(**{**NONE, "ca": "a.crt", "insecure": True}, name="controller", env={})
    with pytest.raises(ValueError, match="drop --tls-cert or --tls-dir"):
        resolve(**{**NONE, "tls_dir": ".", "cert": "b.crt"}, name="controller", env={})
    with pytest.raises(ValueError, match="--tls-dir /nonexistent: no such folder"):
        resolve(**{**NONE, "tls_dir": "/nonexistent"}, name="controller", env={})


def test_files_come_from_the_dir_then_the_flags_then_the_environment(certs):
    by_dir = resolve(**{**NONE, "tls_dir": str(certs)}, name="node1", env={})
    assert by_dir.credentials == Credentials(str(certs / "ca.crt"), str(certs / "node1.crt"),
                                             str(certs / "node1.key"))
    mine = Credentials.from_dir(certs, "controller")
    env = {CA_ENV: mine.ca, CERT_ENV: mine.cert, KEY_ENV: mine.key}
    assert resolve(**NONE, name="controller", env=env).credentials == mine
    # A flag beats its variable; the others still come from the environment.
    host = Credentials.from_dir(certs, "10.1.0.2")
    mixed = resolve(**{**NONE, "cert": host.cert, "key": host.key}, name="x", env=env)
    assert mixed.credentials == Credentials(mine.ca, host.cert, host.key)
    assert mixed.env == {CA_ENV: mine.ca, CERT_ENV: host.cert, KEY_ENV: host.key}
    assert mixed.scheme == "tls" and not mixed.insecure


def test_insecure_is_plaintext_with_no_files_and_warns_what_it_exposes():
    security = resolve(**{**NONE, "insecure": True}, name="controller", env={CA_ENV: "x"})
    assert security == Security(None) and security.scheme == "tcp" and security.env == {}
    worker = insecure_warning("worker")
    assert "spawn processes that run their own code" in worker and "plaintext" in worker
    assert "impostor" in insecure_warning("controller")


def test_a_certificate_another_ca_signed_or_a_wrong_key_or_no_pem_is_refused(certs, other,
                                                                              tmp_path):
    foreign = Credentials(str(certs / "ca.crt"), str(other / "10.1.0.2.crt"),
                          str(other / "10.1.0.2.key"))
    with pytest.raises(ValueError, match="is not signed by a CA in .*peers would refuse it"):
        resolve(**{**NONE, "ca": foreign.ca, "cert": foreign.cert, "key": foreign.key},
                name="x", env={})
    with pytest.raises(ValueError, match="is not the key of certificate"):
        resolve(**{**NONE, "ca": str(certs / "ca.crt"), "cert": str(certs / "node1.crt"),
                   "key": str(certs / "controller.key")}, name="x", env={})
    junk = tmp_path / "junk.crt"
    junk.write_text("not a certificate")
    with pytest.raises(ValueError, match="holds no PEM BEGIN CERTIFICATE"):
        resolve(**{**NONE, "ca": str(junk), "cert": str(certs / "node1.crt"),
                   "key": str(certs / "node1.key")}, name="x", env={})
    with pytest.raises(ValueError, match="cannot read it"):
        resolve(**{**NONE, "tls_dir": str(certs)}, name="no-such-host", env={})


def test_addresses_and_transport_must_match_the_mode(certs):
    secure = resolve(**{**NONE, "tls_dir": str(certs)}, name="node1", env={})
    secure.check_address("tls://node1:4444", "worker address")
    with pytest.raises(ValueError, match="tcp:// is plaintext and lets anyone attach"):
        secure.check_address("tcp://node1:4444", "worker address")
    with pytest.raises(ValueError, match="an --insecure run uses plaintext tcp://"):
        Security(None).check_address("tls://node1:4444", "worker address")
    secure.check_transport({TRANSPORT_ENV: "tls://node1:0"})
    with pytest.raises(ValueError, match=f"needs export {TRANSPORT_ENV}=tls://"):
        secure.check_transport({TRANSPORT_ENV: "tcp://10.1.0.1:0"})


def test_made_files_name_their_hosts_sign_both_ways_and_keep_keys_private(certs):
    for name, alt in (("10.1.0.2", "IP Address:10.1.0.2"), ("node1", "DNS:node1"),
                      ("controller", "IP Address:10.1.0.1")):
        text = subprocess.run(["openssl", "x509", "-in", str(certs / f"{name}.crt"), "-noout",
                               "-text"], capture_output=True, text=True).stdout
        assert alt in text
        assert "TLS Web Server Authentication, TLS Web Client Authentication" in text
        assert (certs / f"{name}.key").stat().st_mode & 0o077 == 0
    assert (certs / "ca.key").stat().st_mode & 0o077 == 0
    with pytest.raises(ValueError, match="already holds a CA"):
        make_cluster_certs(certs, hosts=["a"], controller=["b"])
    with pytest.raises(ValueError, match="controller's address"):
        make_cluster_certs(certs / "new", hosts=["a"], controller=[])


def test_a_worker_refuses_to_start_without_files_before_monarch(certs):
    # A worker without files exits before it imports Monarch (which announces its log).
    done = _run("controller.worker", "tls://10.1.0.2:4444")
    assert done.returncode != 0 and "no TLS files" in done.stderr
    assert "Monarch" not in done.stdout + done.stderr
    done = _run("controller.worker", "tcp://10.1.0.2:4444", "--tls-dir", str(certs))
    assert done.returncode != 0 and "tcp:// is plaintext" in done.stderr
    # The controller's refusals: tests/test_controller_cli.py (BAD_INPUT).


def test_the_helper_makes_a_cluster_from_the_command_line(tmp_path):
    done = _run("controller.certs", "make", str(tmp_path / "c"), "--hosts", "a,b",
                "--controller", "10.1.0.1")
    assert done.returncode == 0, done.stdout + done.stderr
    for name in ("ca", "a", "b", "controller"):
        assert (tmp_path / "c" / f"{name}.crt").is_file()
    resolve(**{**NONE, "tls_dir": str(tmp_path / "c")}, name="b", env={})  # files check out


def test_a_certificate_must_name_the_host_peers_dial(certs):
    node1 = resolve(**{**NONE, "tls_dir": str(certs)}, name="node1", env={})
    node1.check_named("node1", "the worker address")
    with pytest.raises(ValueError, match="does not name node2 .*peers dialling node2 would"):
        node1.check_named("node2", "the worker address")
    controller = resolve(**{**NONE, "tls_dir": str(certs)}, name="controller", env={})
    controller.check_transport({TRANSPORT_ENV: "tls://10.1.0.1:0"})
    with pytest.raises(ValueError, match=f"does not name 10.1.0.9 \\(the host of {TRANSPORT_ENV}"):
        controller.check_transport({TRANSPORT_ENV: "tls://10.1.0.9:0"})
    # A worker refuses to serve under a certificate made for another host.
    done = _run("controller.worker", "tls://10.1.0.2:4444", "--tls-ca", str(certs / "ca.crt"),
                "--tls-cert", str(certs / "node1.crt"), "--tls-key", str(certs / "node1.key"))
    assert done.returncode != 0 and "does not name 10.1.0.2" in done.stderr


def test_a_cluster_run_checks_its_folder_names_every_emulated_host(certs):
    from controller.cli import build_parser, validate

    specs = ["--trainer", "nodes=1,gpus=2,tp=2", "--rollout", "engines=2,nodes=1,gpus=1"]
    with pytest.raises(ValueError, match=r"for emulated host 10\.77\.0\.2: TLS certificate "
                                         r".* cannot read it"):
        validate(build_parser().parse_args(["--cluster", "--tls-dir", str(certs), *specs]))
    with pytest.raises(ValueError, match="--cluster takes its files from --tls-dir DIR"):
        validate(build_parser().parse_args(["--cluster", "--tls-ca", "x", *specs]))
    run = validate(build_parser().parse_args(["--cluster", "--insecure", *specs]))
    assert run.security == Security(None)


def test_the_cluster_command_refuses_workers_without_files_or_insecure():
    done = _run("controller.cluster", "up", "--hosts", "2")
    assert done.returncode == 2
    assert ("give --tls-dir DIR (made by `python -m controller.certs make DIR --hosts "
            "10.77.0.2,10.77.0.3 --controller 10.77.0.1`) for authenticated workers, or "
            "--insecure") in done.stderr


def _signed(certs: Path, tmp_path: Path, name: str, *, ext: str, dates: tuple[str, str] | None
            = None, key_args: tuple[str, ...] = ()) -> Credentials:
    """A key and a certificate for ``name`` signed by ``certs``' CA with the extensions
    ``ext`` (and, with ``dates``, the validity (not before, not after) as openssl's
    ``YYYYMMDDHHMMSSZ``); ``key_args`` encrypt the key as written."""
    key, csr, crt = (tmp_path / f"{name}.{s}" for s in ("key", "csr", "crt"))
    plain = tmp_path / f"{name}.plain.key"
    ssl = lambda *a: subprocess.run(["openssl", *a], check=True, capture_output=True)  # noqa
    ssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out",
        str(plain))
    ssl("req", "-new", "-key", str(plain), "-subj", f"/CN={name}", "-out", str(csr))
    (tmp_path / "ext.cnf").write_text(ext)
    if dates is None:
        ssl("x509", "-req", "-in", str(csr), "-CA", str(certs / "ca.crt"), "-CAkey",
            str(certs / "ca.key"), "-CAcreateserial", "-days", "30", "-extfile",
            str(tmp_path / "ext.cnf"), "-out", str(crt))
    else:  # (openssl ca sets explicit dates; x509 -req cannot in 3.0)
        db = tmp_path / "db"
        db.mkdir(exist_ok=True)
        (db / "index.txt").write_text("")
        (db / "serial").write_text("1000\n")
        (tmp_path / "ca.cnf").write_text(
            f"[ca]\ndefault_ca=c\n[c]\ndatabase={db}/index.txt\nserial={db}/serial\n"
            f"new_certs_dir={db}\ndefault_md=sha256\npolicy=p\n[p]\ncommonName=supplied\n")
        ssl("ca", "-batch", "-config", str(tmp_path / "ca.cnf"), "-cert",
            str(certs / "ca.crt"), "-keyfile", str(certs / "ca.key"), "-in", str(csr),
            "-startdate", dates[0], "-enddate", dates[1], "-extfile",
            str(tmp_path / "ext.cnf"), "-out", str(crt), "-notext")
    if key_args:
        ssl("pkey", "-in", str(plain), "-out", str(key), *key_args)
    else:
        plain.rename(key)
    return Credentials(str(certs / "ca.crt"), str(crt), str(key))


BOTH = "extendedKeyUsage=serverAuth,clientAuth\nsubjectAltName=DNS:node9\n"


@pytest.mark.parametrize("case,expected", [
    ("expired", "expired on"),
    ("not-yet-valid", "is not valid before"),
    ("encrypted-key", "is encrypted"),
    ("no-client-auth", "has no clientAuth"),
])
def test_a_certificate_or_key_that_cannot_work_is_refused_naming_the_real_cause(
        certs, tmp_path, case, expected):
    """Issue 44, item 11: these got messages naming the wrong cause ("is not signed by a
    CA", "is not the key of")."""
    made = {"expired": lambda: _signed(certs, tmp_path, "node9", ext=BOTH,
                                       dates=("20200101000000Z", "20200201000000Z")),
            "not-yet-valid": lambda: _signed(certs, tmp_path, "node9", ext=BOTH,
                                             dates=("20990101000000Z", "20990201000000Z")),
            "encrypted-key": lambda: _signed(certs, tmp_path, "node9", ext=BOTH,
                                             key_args=("-aes256", "-passout", "pass:secret")),
            "no-client-auth": lambda: _signed(
                certs, tmp_path, "node9",
                ext="extendedKeyUsage=serverAuth\nsubjectAltName=DNS:node9\n")}[case]()
    with pytest.raises(ValueError, match=expected) as refused:
        resolve(**{**NONE, "ca": made.ca, "cert": made.cert, "key": made.key}, name="x",
                env={})
    assert "not signed by a CA" not in str(refused.value), refused.value
    assert "is not the key of" not in str(refused.value), refused.value


def test_a_fifo_given_as_a_tls_file_is_refused_at_once(certs, tmp_path):
    """Issue 44, item 11: a FIFO as the CA file hung worker and controller (reading it
    waits for a writer)."""
    fifo = tmp_path / "ca.fifo"
    os.mkfifo(fifo)
    refused: list = []

    def check():
        try:
            resolve(**{**NONE, "ca": str(fifo), "cert": str(certs / "node1.crt"),
                       "key": str(certs / "node1.key")}, name="x", env={})
        except ValueError as e:
            refused.append(e)

    import threading

    checking = threading.Thread(target=check, daemon=True)
    checking.start()
    checking.join(10)
    if checking.is_alive():  # (release the hung reader: open the FIFO for writing once)
        with open(fifo, "w"):
            pass
        checking.join(10)
        pytest.fail("resolve() waited on a FIFO given as the CA file")
    assert refused and "not a regular file" in str(refused[0]), refused
