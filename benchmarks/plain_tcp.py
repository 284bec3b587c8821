"""Plain TCP carrying a plan's bytes between the emulated cluster's hosts: the links' reference.

    .venv/bin/python benchmarks/bench_cluster.py --mechanisms plain-tcp plain-tcp-p2p

No Monarch, no rounds, no controller, no copies: one node process per host (in its namespace,
`controller.cluster`) opens one TCP connection for each pair of workers on different hosts
between which the plan writes, and sends that pair's bytes from one shared buffer. A trainer
sends its RECEIVE bytes at once; a rollout forwards its EXTERNAL bytes as its RECEIVE bytes
land, in the plan's proportions, 64 KiB at a time (the best pipelining any plan of these bytes
can have: no round barriers, no waits between stages). INTERNAL writes stay inside a host and
are left out. The time runs from one start until the last rollout worker holds every byte the
plan writes to it across hosts. Eq. (1)'s ideal assumes the links' full rate, so time / ideal
is what TCP under `tc` loses on that traffic, and the gap between it and a mechanism's
EWTT / ideal is, roughly, the mechanism's own. Not a strict bound: streaming every pair at once
is one schedule of these bytes, and rounds, which start fewer flows at a time, can beat it
(WeightBridge did at 4 replicas, 1.18x against 1.20x: docs/performance.md).
"""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

PORT = 5555
STEP = 64 << 10
"""Bytes per send, and the granularity at which a rollout forwards what it received."""
_HEADER = struct.Struct("!iiq")  # source worker, destination worker, bytes
_ZEROS = memoryview(bytes(1 << 20))


@dataclass(frozen=True)
class Pipe:
    """One connection: ``nbytes`` from worker ``src`` (on host ``src_host``) to ``dst``.
    Workers are numbered as `TransferPlan.workers` (trainers first)."""

    src: int
    src_host: int
    dst: int
    dst_host: int
    nbytes: int
    forwards: bool
    """A rollout's EXTERNAL bytes: sent as its RECEIVE bytes land."""


def pipes(plan) -> list[Pipe]:
    """The plan's writes between hosts, summed per pair of workers. Hosts are numbered by first
    appearance, trainers' nodes first (the order `bench_cluster.attached` gives them)."""
    from weightbridge.types.plans import Stage

    workers = plan.workers
    number = {w: i for i, w in enumerate(workers)}
    hosts: dict[str, int] = {}
    for p in (*plan.trainers, *plan.rollouts):
        hosts.setdefault(p.node, len(hosts))
    host = [hosts[p.node] for p in (*plan.trainers, *plan.rollouts)]
    total: dict[tuple[int, int, bool], int] = defaultdict(int)
    for rnd in plan.rounds:
        for t in rnd.transfers:
            s, d = number[t.src], number[t.dst]
            if host[s] != host[d]:
                assert t.stage is not Stage.INTERNAL
                total[s, d, t.stage is Stage.EXTERNAL] += t.nbytes
    return [Pipe(s, host[s], d, host[d], n, fwd) for (s, d, fwd), n in sorted(total.items())]


def measure(pipes_: list[Pipe], addresses: list[str], namespace: str,
            timeout_s: float = 120.0) -> float:
    """Seconds from a common start until every pipe's bytes have arrived; ``addresses[h]`` is
    host h's IP, ``namespace + str(h)`` its network namespace. Raises RuntimeError when a node
    fails or the run takes longer than ``timeout_s``; ValueError, before any process starts,
    for no pipes or a host without an address."""
    if not pipes_:
        raise ValueError("plain tcp: no pipes: the plan writes nothing between hosts (all its "
                         "workers on one node?)")
    missing = max(max(p.src_host, p.dst_host) for p in pipes_) + 1 - len(addresses)
    if missing > 0:
        raise ValueError(f"plain tcp: the pipes use {len(addresses) + missing} hosts but "
                         f"{len(addresses)} addresses were given; give one per host")
    used = sorted({p.src_host for p in pipes_} | {p.dst_host for p in pipes_})
    spec = json.dumps([p.__dict__ for p in pipes_])
    procs: dict[int, subprocess.Popen] = {}
    expired = threading.Event()

    def expire() -> None:
        expired.set()
        for p in procs.values():
            p.kill()

    timer = threading.Timer(timeout_s, expire)
    timer.start()
    try:
        for h in used:
            procs[h] = subprocess.Popen(
                ["ip", "netns", "exec", f"{namespace}{h}", sys.executable, __file__, "--node",
                 str(h), json.dumps(addresses)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                text=True)
            procs[h].stdin.write(spec + "\n")
            procs[h].stdin.flush()
        for phase in ("listening", "connected"):
            for h, p in procs.items():
                _expect(p.stdout.readline(), phase, h, expired, timeout_s)
            for p in procs.values():
                p.stdin.write("next\n")
                p.stdin.flush()
        start = time.monotonic()  # CLOCK_MONOTONIC is one clock for every namespace
        ends = [float(_expect(p.stdout.readline(), None, h, expired, timeout_s))
                for h, p in procs.items()]
        return max(ends) - start
    finally:
        timer.cancel()
        for p in procs.values():
            p.kill()
            p.wait()


def _expect(line: str, phase: str | None, host: int, expired: threading.Event,
            timeout_s: float) -> str:
    line = line.strip()
    if expired.is_set():
        raise RuntimeError(f"plain tcp: no result within {timeout_s:g}s (host {host}'s node "
                           f"was still running; its links may be down)")
    if not line or (phase is not None and line != phase):
        raise RuntimeError(f"plain tcp: host {host}'s node said {line!r} where it should say "
                           f"{phase or 'its end time'} (its error is on stderr above)")
    return line


def _node(me: int, addresses: list[str]) -> None:
    """One host's side of `measure`: listen, connect, then send and receive."""
    ps = [Pipe(**d) for d in json.loads(sys.stdin.readline())]
    inbound = [p for p in ps if p.dst_host == me]
    outbound = [p for p in ps if p.src_host == me]
    expected = sum(p.nbytes for p in inbound)
    received = 0
    # A forwarding rollout's credit: its RECEIVE bytes landed so far / all it will receive.
    landed: dict[int, int] = defaultdict(int)
    to_land = defaultdict(int)
    for p in inbound:
        if not p.forwards:
            to_land[p.dst] += p.nbytes
    cond = threading.Condition()
    done = threading.Event()

    server = socket.create_server((addresses[me], PORT), backlog=64)
    print("listening", flush=True)
    sys.stdin.readline()

    def receive(conn: socket.socket) -> None:
        nonlocal received
        src, dst, nbytes = _HEADER.unpack(conn.recv(_HEADER.size, socket.MSG_WAITALL))
        fwd = next(p.forwards for p in inbound if p.src == src and p.dst == dst)
        buf = bytearray(STEP)
        left = nbytes
        while left:
            n = conn.recv_into(buf, min(STEP, left))
            if not n:
                raise RuntimeError(f"connection {src}->{dst} closed with {left} bytes left")
            left -= n
            with cond:
                if not fwd:
                    landed[dst] += n
                received += n
                cond.notify_all()
                if received == expected:
                    done.set()

    def accept() -> None:
        for _ in inbound:
            conn, _ = server.accept()
            threading.Thread(target=receive, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    conns = []
    for p in outbound:
        c = socket.create_connection((addresses[p.dst_host], PORT))
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        c.sendall(_HEADER.pack(p.src, p.dst, p.nbytes))
        conns.append((p, c))
    print("connected", flush=True)
    sys.stdin.readline()

    def send(p: Pipe, c: socket.socket) -> None:
        sent = 0
        while sent < p.nbytes:
            if p.forwards and to_land[p.src]:
                with cond:
                    while True:
                        share = p.nbytes * landed[p.src] // to_land[p.src]
                        if share - sent >= min(STEP, p.nbytes - sent):
                            break
                        cond.wait()
            n = min(STEP, p.nbytes - sent)
            c.sendall(_ZEROS[:n])
            sent += n

    for p, c in conns:
        threading.Thread(target=send, args=(p, c), daemon=True).start()
    if expected:
        done.wait()
    print(time.monotonic(), flush=True)
    sys.stdin.readline()  # the parent kills us once every host has reported


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--node":
        _node(int(sys.argv[2]), json.loads(sys.argv[3]))
    else:
        raise SystemExit(f"{Path(__file__).name} runs inside benchmarks/bench_cluster.py "
                         f"(--mechanisms plain-tcp plain-tcp-p2p); --node HOST ADDRESSES is "
                         f"the per-host half that `measure` starts")
