"""The emulated cluster: hosts in network namespaces behind tc-shaped links, a Monarch worker in
each; the controller runs verified updates over it, and teardown leaves nothing behind, also
after a failure or Ctrl-C."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from controller.cluster import (SUBNET, EmulatedCluster, certs_command, existing, leftovers,
                                unavailable_reason)

REPO = Path(__file__).resolve().parents[1]
REASON = unavailable_reason()
pytestmark = [pytest.mark.skipif(REASON is not None,
                                 reason=f"no emulated cluster here: {REASON}"),
              pytest.mark.emulated_cluster]


def _our_processes() -> list[str]:
    """Command lines of live processes that mention our subnet (workers and their procs)."""
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in ps.splitlines() if f"{SUBNET}." in line and "ps -eo" not in line]


def _assert_clean() -> None:
    assert leftovers() == []
    assert _our_processes() == []


@pytest.mark.mesh
def test_controller_runs_verified_updates_on_the_emulated_cluster(tmp_path):
    # Authenticated, as by default: the files for the emulated hosts, made as the refusal of a
    # run without them says (mutual TLS itself: tests/test_cluster_tls.py).
    make = subprocess.run([sys.executable, "-m", *certs_command(3, str(tmp_path)).split()[2:]],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert make.returncode == 0, make.stdout + make.stderr
    done = subprocess.run(
        [sys.executable, "-m", "controller", "--cluster", "3", "--link-mbit", "100",
         "--trainer", "nodes=1,gpus=2,tp=2", "--rollout", "engines=2,nodes=1,gpus=1",
         "--updates", "2", "--tls-dir", str(tmp_path)], cwd=REPO, capture_output=True,
        text=True, timeout=180)
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
    assert "emulated cluster: 3 hosts, 100 Mbit/s links" in out
    assert "configured 12 MB/s" in out  # Eq. (1) from the tc rate, not a probe
    assert out.count("bit-identical to their own load_weights") == 2
    ideal = float(out.split("ideal EWTT (Eq. 1, a link per planning node): ")[1].split("s")[0])
    assert 0.15 < ideal < 0.22  # 2.29 MB over one 12.5 MB/s trainer link
    _assert_clean()


@pytest.mark.mesh
def test_cluster_is_torn_down_after_an_error():
    cluster = EmulatedCluster(2, link_mbit=200, insecure=True)
    with pytest.raises(RuntimeError, match="boom"):
        with cluster:
            assert len(existing()) == 3  # two namespaces and the bridge
            assert len(_our_processes()) >= 2  # the workers
            raise RuntimeError("boom")
    _assert_clean()


@pytest.mark.mesh
def test_cluster_run_is_torn_down_on_ctrl_c():
    # As from a terminal: a run started from a background job inherits SIGINT ignored (and
    # Python then installs no KeyboardInterrupt handler), so give the child the default.
    proc = subprocess.Popen([sys.executable, "-m", "controller.cluster", "run", "--hosts", "2",
                             "--link-mbit", "200", "--insecure", "--", "sleep", "120"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 60
        while not any("sleep 120" in p for p in subprocess.run(
                ["ps", "-eo", "args"], capture_output=True, text=True).stdout.splitlines()):
            assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read()
            time.sleep(0.2)
        # Ctrl-C in a terminal signals the whole foreground process group, the command too.
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    _assert_clean()


def test_down_with_nothing_up_is_a_no_op():
    done = subprocess.run([sys.executable, "-m", "controller.cluster", "down"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "removed" in done.stdout, done.stdout + done.stderr


_STREAM = """
import socket, sys, time
if sys.argv[1] == "recv":
    srv = socket.create_server((sys.argv[2], 5600))
    print("ready", flush=True)
    conn, _ = srv.accept()
    while conn.recv(1 << 16):
        pass
else:
    c = socket.create_connection((sys.argv[2], 5600))
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for _ in range(100):  # a message's bulk, then short frames of their own (as Monarch's are)
        c.sendall(bytes(8000))
        c.sendall(bytes(100))
        c.sendall(bytes(8))
        time.sleep(0.002)
    c.close()
"""


def _band_bytes_and_packets(ns: str, band: int) -> tuple[int, int]:
    out = subprocess.run(["ip", "netns", "exec", ns, "tc", "-s", "class", "show", "dev", "eth0"],
                         capture_output=True, text=True, check=True).stdout
    block = out.split(f"class htb 10:{band} ")[1]
    sent = block.split("Sent ")[1].split()
    return int(sent[0]), int(sent[2])


def test_the_control_band_never_takes_a_streams_data_segments():
    """Bug (7 Dec 2026): the control band took every packet shorter than a full segment, so a
    stream's short tail segments overtook its full ones, and TCP retransmitted 4.2 MB of one
    72 MB update spuriously; cut at 64 bytes, it still took frames of a few bytes (0.41 MB
    retransmitted). Only the controller's connections and segments without payload go first."""
    with EmulatedCluster(2, link_mbit=200, start_workers=False):
        peer = f"{SUBNET}.3"
        recv = subprocess.Popen(["ip", "netns", "exec", "wb-h1", sys.executable, "-c", _STREAM,
                                 "recv", peer], stdout=subprocess.PIPE, text=True)
        try:
            assert recv.stdout.readline().strip() == "ready"
            before = {ns: _band_bytes_and_packets(ns, 1) for ns in ("wb-h0", "wb-h1")}
            subprocess.run(["ip", "netns", "exec", "wb-h0", sys.executable, "-c", _STREAM,
                            "send", peer], check=True, timeout=60)
            recv.wait(timeout=60)
        finally:
            recv.kill()
        sent = [a - b for a, b in zip(_band_bytes_and_packets("wb-h0", 1), before["wb-h0"])]
        acks = [a - b for a, b in zip(_band_bytes_and_packets("wb-h1", 1), before["wb-h1"])]
        bulk, _ = _band_bytes_and_packets("wb-h0", 2)
    assert bulk >= 100 * 8108  # the data went through the bulk band
    # The sender's own band carries no data: its SYN, handshake ACK, FIN and last ACK at most.
    assert sent[1] <= 4, f"{sent[1]} packets ({sent[0]} bytes) of the stream took the band"
    assert acks[1] > 0 and acks[0] / acks[1] < 80 + 14  # the receiver's ACKs went first
    _assert_clean()
