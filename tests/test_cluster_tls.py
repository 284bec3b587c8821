"""Mutual TLS on the emulated cluster: a run with the CA and keys `controller.certs` made moves
versions bit-exact and every connection on the links is TLS from its first byte; a controller
whose certificate the CA did not sign is refused by the workers, and a worker with a foreign
certificate by the controller, each with a clear error, in bounded time, and with no proc spawned;
``--insecure`` still runs (and its links carry plaintext)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from controller.cluster import (CONTROLLER_ADDRESS, NS_PREFIX, EmulatedCluster, certs_command,
                                host_address, unavailable_reason)
from controller.launch import ATTACH_TIMEOUT_S
from controller.security import Credentials
from linkcapture import LinkCapture

REPO = Path(__file__).resolve().parents[1]
REASON = unavailable_reason()
pytestmark = [pytest.mark.skipif(REASON is not None,
                                 reason=f"no emulated cluster here: {REASON}"),
              pytest.mark.emulated_cluster]
SPECS = ["--trainer", "nodes=1,gpus=2,tp=2", "--rollout", "engines=2,nodes=1,gpus=1"]
BIT_EXACT = "bit-identical to their own load_weights"
RDMA_MB = 4.57
"""What one update of SPECS moves over RDMA (the controller prints it: "4.57 MB over RDMA")."""


def _certs(folder: Path, hosts: int) -> Path:
    """A CA and keys for ``hosts`` emulated hosts and the controller, made as a user would."""
    cmd = certs_command(hosts, str(folder)).split()
    done = subprocess.run([sys.executable, "-m", *cmd[2:]], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return folder


def _controller(cluster: EmulatedCluster, creds: Credentials | None, *extra: str,
                updates: int = 1) -> subprocess.CompletedProcess:
    """``python -m controller --attach-*`` on the cluster (host 0: trainer; 1, 2: rollouts);
    ``creds`` None: ``--insecure``, dialling tcp:// whatever the workers run."""
    plain = (lambda a: "tcp://" + a.split("://", 1)[1]) if creds is None else (lambda a: a)
    addrs = [plain(a) for a in cluster.addresses]
    tls = ["--insecure"] if creds is None else ["--tls-ca", creds.ca, "--tls-cert", creds.cert,
                                                 "--tls-key", creds.key]
    env = dict(os.environ, HYPERACTOR_MESH_DEFAULT_TRANSPORT=plain(cluster.controller_transport))
    return subprocess.run(
        [sys.executable, "-m", "controller", *SPECS, "--updates", str(updates),
         "--attach-trainers", addrs[0], "--attach-rollouts", ",".join(addrs[1:3]), *tls,
         *extra], cwd=REPO, env=env, capture_output=True, text=True, timeout=240)


def _pids(hosts: int) -> list[int]:
    """How many processes run in each host's namespace (the worker, and any procs it spawned)."""
    return [len(subprocess.run(["ip", "netns", "pids", f"{NS_PREFIX}{i}"], capture_output=True,
                               text=True).stdout.split()) for i in range(hosts)]


def _attach_without_probe(cluster: EmulatedCluster, creds: Credentials, addresses: list[str]
                          ) -> subprocess.CompletedProcess:
    """Monarch's own attach (tests/attach_once.py), bounded at 10 s."""
    env = dict(os.environ, HYPERACTOR_MESH_DEFAULT_TRANSPORT=cluster.controller_transport,
               HYPERACTOR_TLS_CA=creds.ca, HYPERACTOR_TLS_CERT=creds.cert,
               HYPERACTOR_TLS_KEY=creds.key, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, str(REPO / "tests" / "attach_once.py"),
                           ",".join(addresses), "10"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)


def _foreign(tmp_path: Path, trusted_ca: str, name: str) -> Credentials:
    """A certificate for ``name`` from another CA, with a CA file trusting both CAs (so this
    side's own check passes and only the peer can refuse it)."""
    other = tmp_path / "foreign"
    done = subprocess.run([sys.executable, "-m", "controller.certs", "make", str(other),
                           "--hosts", host_address(0), "--controller", CONTROLLER_ADDRESS],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    both = tmp_path / "both-cas.crt"
    both.write_text(Path(trusted_ca).read_text() + (other / "ca.crt").read_text())
    made = Credentials.from_dir(other, name)
    return Credentials(ca=str(both), cert=made.cert, key=made.key)


@pytest.mark.mesh
def test_authenticated_run_moves_versions_bit_exact_and_the_links_carry_only_tls(tmp_path):
    certs = _certs(tmp_path / "certs", 3)
    with EmulatedCluster(3, link_mbit=200, tls_dir=str(certs)) as cluster:
        assert all(a.startswith("tls://") for a in cluster.addresses)
        with LinkCapture([f"wb-v{i}" for i in range(3)]) as capture:
            done = _controller(cluster, Credentials.from_dir(certs, "controller"), updates=2)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert done.stdout.count(BIT_EXACT) == 2
    report = capture.report()
    print(report)  # with -s: the connections and bytes the check covered
    assert report.plaintext_flows == []
    assert report.other_ipv4_bytes < 1 << 16  # no bulk data outside TCP (stray ICMP at most)
    assert report.tls_flows >= 3  # the controller to each worker, at least
    # Both updates' RDMA bytes (the TCP fallback) crossed the links, inside TLS connections.
    assert report.tls_bytes > 2 * RDMA_MB * 1e6


@pytest.mark.mesh
def test_insecure_run_still_works_on_the_emulation_and_its_links_carry_plaintext():
    with EmulatedCluster(3, link_mbit=200, insecure=True) as cluster:
        assert all(a.startswith("tcp://") for a in cluster.addresses)
        with LinkCapture([f"wb-v{i}" for i in range(3)]) as capture:
            done = _controller(cluster, None)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert done.stdout.count(BIT_EXACT) == 1
        assert "WARNING: --insecure" in done.stderr and "plaintext" in done.stderr
        log = (cluster.log_dir / "worker-h0.log").read_text()
        assert "WARNING: --insecure" in log and "spawn processes" in log
    # The capture's negative control: the same check finds the plaintext connections.
    report = capture.report()
    print(report)
    assert report.plaintext_flows


@pytest.mark.mesh
def test_an_insecure_controller_is_refused_by_tls_workers_at_once(tmp_path):
    certs = _certs(tmp_path / "certs", 3)
    with EmulatedCluster(3, link_mbit=200, tls_dir=str(certs)) as cluster:
        before = _pids(3)
        start = time.monotonic()
        done = _controller(cluster, None)
        took = time.monotonic() - start
        assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
        for address in cluster.addresses:
            plain = "tcp://" + address.split("://", 1)[1]
            assert (f"worker {plain} runs mutual TLS and does not accept an --insecure "
                    f"controller") in done.stderr
        assert "nothing was attached or spawned" in done.stderr
        # Named by the probe, not after Monarch's attach timed out (60 s: ATTACH_TIMEOUT_S).
        assert took < ATTACH_TIMEOUT_S / 2, took
        assert _pids(3) == before


@pytest.mark.mesh
def test_a_controller_the_ca_did_not_sign_is_refused_by_the_workers(tmp_path):
    certs = _certs(tmp_path / "certs", 3)
    intruder = _foreign(tmp_path, str(certs / "ca.crt"), "controller")
    with EmulatedCluster(3, link_mbit=200, tls_dir=str(certs)) as cluster:
        before = _pids(3)
        done = _controller(cluster, intruder)
        assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
        for address in cluster.addresses:
            assert f"worker {address} refused this controller's certificate" in done.stderr
        assert "nothing was attached or spawned" in done.stderr
        assert "update 1" not in done.stdout
        # Monarch's own channel refuses it too (not only the probe), within the bound.
        raw = _attach_without_probe(cluster, intruder, cluster.addresses[:1])
        assert raw.returncode == 3, raw.stdout[-3000:] + raw.stderr[-3000:]
        assert "REFUSED: the probe_off workers" in raw.stdout
        assert "did not accept the controller within 10s" in raw.stdout
        assert _pids(3) == before  # no proc was spawned on any worker


@pytest.mark.mesh
def test_a_worker_with_a_foreign_certificate_is_refused_by_the_controller(tmp_path):
    certs = _certs(tmp_path / "certs", 3)
    impostor = _foreign(tmp_path, str(certs / "ca.crt"), host_address(0))
    workers = [impostor] + [Credentials.from_dir(certs, host_address(i)) for i in (1, 2)]
    with EmulatedCluster(3, link_mbit=200, credentials=workers) as cluster:
        before = _pids(3)
        controller = Credentials.from_dir(certs, "controller")
        done = _controller(cluster, controller)
        assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
        assert (f"worker {cluster.addresses[0]} presented a certificate this controller does "
                f"not trust") in done.stderr
        assert cluster.addresses[1] not in done.stderr  # the genuine workers are not blamed
        assert "update 1" not in done.stdout
        raw = _attach_without_probe(cluster, controller, cluster.addresses[:1])
        assert raw.returncode == 3, raw.stdout[-3000:] + raw.stderr[-3000:]
        assert "did not accept the controller within 10s" in raw.stdout
        assert _pids(3) == before
