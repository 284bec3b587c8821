"""Capture what crosses the emulated cluster's links (root only) and check that it is TLS.

A packet socket (AF_PACKET) on each host's bridge-side veth sees every frame the host sends or
receives. TCP payloads are reassembled per connection from its SYN on (so only connections opened
while capturing count), and each stream is parsed as TLS records: content type 20..23, version
3.x, length <= 2^14 + 2048, the first one a handshake. A stream that is not TLS from its first byte
is plaintext.

Typical usage::

    with LinkCapture([f"wb-v{i}" for i in range(3)]) as cap:
        ...  # run something on the cluster
    report = cap.report()   # Report(tls_bytes, plaintext_flows, other_ipv4_bytes, ...)
"""

from __future__ import annotations

import select
import socket
import struct
import threading
from dataclasses import dataclass

ETH_P_ALL = 0x0003
ETH_P_IP = 0x0800
MAX_RECORD = (1 << 14) + 2048


@dataclass(frozen=True)
class Report:
    """What the links carried while capturing."""

    tls_flows: int
    tls_bytes: int
    """TCP payload bytes of connections that parse as TLS records from their first byte."""
    plaintext_flows: list[str]
    """Connections with payload that is not TLS (``src:port->dst:port: first bytes``)."""
    other_ipv4_bytes: int
    """IPv4 payload bytes that were not TCP (UDP, ...)."""


class LinkCapture:
    """Context manager: captures on ``interfaces`` from enter to exit."""

    def __init__(self, interfaces: list[str]):
        self.interfaces = interfaces
        self._socks: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._isn: dict[tuple, int] = {}
        self._segments: dict[tuple, dict[int, bytes]] = {}
        self._other = 0

    def __enter__(self) -> "LinkCapture":
        for name in self.interfaces:
            s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 << 20)
            s.bind((name, 0))
            self._socks.append(s)
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        for s in self._socks:
            s.close()

    def _loop(self) -> None:
        while not self._stop.is_set():
            ready, _, _ = select.select(self._socks, [], [], 0.2)
            for s in ready:
                self._parse(s.recv(1 << 18))

    def _parse(self, frame: bytes) -> None:
        if len(frame) < 34 or struct.unpack("!H", frame[12:14])[0] != ETH_P_IP:
            return
        ip = frame[14:]
        ihl, total, proto = (ip[0] & 0xF) * 4, struct.unpack("!H", ip[2:4])[0], ip[9]
        ip = ip[:total]
        if proto != 6:
            self._other += max(0, total - ihl)
            return
        tcp = ip[ihl:]
        sport, dport, seq = struct.unpack("!HHI", tcp[:8])
        flags, offset = tcp[13], (tcp[12] >> 4) * 4
        flow = (socket.inet_ntoa(ip[12:16]), sport, socket.inet_ntoa(ip[16:20]), dport)
        if flags & 0x02:  # SYN: the stream starts at seq + 1
            self._isn.setdefault(flow, (seq + 1) % (1 << 32))
        payload = tcp[offset:]
        if payload and flow in self._isn:
            rel = (seq - self._isn[flow]) % (1 << 32)
            self._segments.setdefault(flow, {})[rel] = payload

    def report(self) -> Report:
        tls_flows, tls_bytes, plain = 0, 0, []
        for flow, segments in self._segments.items():
            stream = _contiguous(segments)
            if _is_tls(stream):
                tls_flows += 1
                tls_bytes += sum(len(p) for p in segments.values())
            else:
                plain.append(f"{flow[0]}:{flow[1]}->{flow[2]}:{flow[3]}: {stream[:24]!r}")
        return Report(tls_flows, tls_bytes, plain, self._other)


def _contiguous(segments: dict[int, bytes]) -> bytes:
    """The stream from its first byte up to the first gap (a frame the capture missed)."""
    out, at = bytearray(), 0
    for rel in sorted(segments):
        if rel > at:
            break
        out += segments[rel][at - rel:]
        at = max(at, rel + len(segments[rel]))
    return bytes(out)


def _is_tls(stream: bytes) -> bool:
    """Every complete record header of ``stream`` is a TLS record; the first a handshake."""
    if len(stream) < 5 or stream[0] != 22:
        return False
    at = 0
    while at + 5 <= len(stream):
        kind, major, minor, length = stream[at], stream[at + 1], stream[at + 2], \
            struct.unpack("!H", stream[at + 3:at + 5])[0]
        if kind not in (20, 21, 22, 23) or major != 3 or minor > 4 or length > MAX_RECORD:
            return False
        at += 5 + length
    return True
