"""The controller attaches to Monarch workers on other hosts (here: worker processes on
loopback ports) instead of spawning procs itself, and leaves nothing behind."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(port: int, procs, timeout_s: float = 60.0) -> None:
    """Until a socket listens on ``port`` (read from /proc/net/tcp: no connection is made)."""
    deadline = time.monotonic() + timeout_s
    local = f":{port:04X}"
    while not any(f[1].endswith(local) and f[3] == "0A"  # TCP_LISTEN
                  for f in (line.split() for line in
                            Path("/proc/net/tcp").read_text().splitlines()[1:])):
        assert all(p.poll() is None for p in procs), "a worker exited before it listened"
        assert time.monotonic() < deadline, f"nothing listens on port {port}"
        time.sleep(0.05)


@pytest.mark.mesh
def test_controller_attaches_to_remote_workers_and_verifies_updates(tmp_path):
    # Mutual TLS, as by default: one CA, the loopback "host" and the controller keys.
    make = subprocess.run([sys.executable, "-m", "controller.certs", "make", str(tmp_path),
                           "--hosts", "127.0.0.1", "--controller", "127.0.0.1"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert make.returncode == 0, make.stdout + make.stderr
    env = dict(os.environ, HYPERACTOR_MESH_DEFAULT_TRANSPORT="tls://127.0.0.1:0")
    addrs = [f"tls://127.0.0.1:{_free_port()}" for _ in range(3)]
    workers = [subprocess.Popen([sys.executable, "-m", "controller.worker", a, "--tls-dir",
                                 str(tmp_path)], cwd=REPO, env=env, start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
               for a in addrs]
    try:
        for a in addrs:  # each worker has bound its port
            _wait_listening(int(a.rsplit(":", 1)[1]), workers)
        done = subprocess.run(
            [sys.executable, "-m", "controller", "--trainer", "nodes=1,gpus=2,tp=2",
             "--rollout", "engines=2,nodes=1,gpus=1", "--updates", "2",
             "--attach-trainers", addrs[0], "--attach-rollouts", ",".join(addrs[1:]),
             "--tls-dir", str(tmp_path)],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert done.stdout.count("bit-identical to their own load_weights") == 2
    finally:
        for w in workers:  # each worker and the procs it spawned share a process group
            try:
                os.killpg(w.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            w.wait(timeout=30)


@pytest.mark.slow
def test_attach_needs_both_sides_and_one_address_per_node_and_depth_two_arenas():
    base = [sys.executable, "-m", "controller", "--trainer", "nodes=1,gpus=2,tp=2",
            "--rollout", "engines=2,nodes=1,gpus=1"]
    for extra, message in (
            (["--depth", "1"], "--depth must be >= 2"),
            (["--attach-trainers", "tcp://127.0.0.1:1"], "go together"),
            (["--attach-trainers", "tcp://127.0.0.1:1,tcp://127.0.0.1:2",
              "--attach-rollouts", "tcp://127.0.0.1:3,tcp://127.0.0.1:4"], "nodes=1")):
        done = subprocess.run(base + extra, cwd=REPO, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 2 and message in done.stderr, done.stderr
