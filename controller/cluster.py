"""An emulated cluster on this machine: hosts are network namespaces behind shaped links.

    python -m controller.certs make certs --hosts 10.77.0.2,10.77.0.3,10.77.0.4 \
        --controller 10.77.0.1                                    # once: a CA, a key per host
    python -m controller.cluster up --hosts 3 --link-mbit 400 --tls-dir certs  # prints addresses
    python -m controller.cluster down                            # removes everything it made
    python -m controller.cluster status
    python -m controller.cluster run --hosts 3 --insecure -- CMD ...  # up, CMD, down

Layout (root only; names and addresses are ours alone, so teardown finds them by name):

    root namespace: bridge wb-br0, 10.77.0.1/24 (the controller's address)
    host i:         namespace wb-h{i}; veth wb-v{i} (on the bridge) <-> eth0 (10.77.0.{i+2}/24)
                    tc tbf at the link rate on both ends: wb-v{i} shapes what the host receives,
                    eth0 shapes what it sends; no default route, so nothing leaves the bridge;
                    under each tbf a two-band priority queue (htb + u32): the controller's
                    connections and TCP segments without payload (ACKs) go before the rest
                    a Monarch worker: python -m controller.worker tls://10.77.0.{i+2}:4444
                    (its own TLS files; tcp:// and --insecure when the cluster is insecure)

Each host's link is a full-duplex link of the given rate, so transfers between hosts are bound
by the links, as on a real cluster, while every process still shares this machine's CPUs and
memory. Procs that the controller spawns on a worker run inside that worker's namespace.

Control priority: on a cluster, actor messages travel on the frontend network and RDMA on the
backend NICs, so a control message never waits behind bulk RDMA data. Here Monarch's RDMA
fallback and its actor messages share one shaped link, and a plain FIFO queue of 200 ms would
hold a 300-byte notification behind up to 1.25 MB of data (tens of ms at 50 Mbit/s). The
control band restores the separation for the controller's own connections, and lets ACKs pass
the bulk, without changing the link rate (tbf still shapes all of it). It never splits a
stream's data segments between the bands: served out of order, they draw TCP's spurious
retransmissions. ``control_priority=False`` gives the plain FIFO.

`EmulatedCluster` is a context manager: leaving it (also on errors and Ctrl-C) kills every
process in its namespaces and deletes the links, the namespaces and the bridge.
``python -m controller.cluster down`` does the same for a cluster left by a killed process.

Typical usage::

    with EmulatedCluster(3, link_mbit=400, tls_dir="certs") as cluster:
        os.environ[TRANSPORT_ENV] = cluster.controller_transport
        os.environ.update(cluster.controller_security.env)    # before importing monarch
        procs = attach_procs(cluster.addresses, gpus=1, name="trainer",
                             security=cluster.controller_security)

Authenticated like a real cluster (controller/security.py): each worker serves ``tls://`` with
its own files, from ``tls_dir`` (made by ``python -m controller.certs make DIR --hosts
10.77.0.2,... --controller 10.77.0.1``: `certs_command` prints it) or ``credentials`` (one per
host); ``insecure=True`` runs plaintext trust-all ``tcp://`` workers instead. One of them is
required.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

from controller.security import CONTROLLER, Credentials, Security, check_files

TRANSPORT_ENV = "HYPERACTOR_MESH_DEFAULT_TRANSPORT"
NS_PREFIX = "wb-h"
VETH_PREFIX = "wb-v"
BRIDGE = "wb-br0"
SUBNET = "10.77.0"
"""A private /24 of our own; .1 is the bridge (the controller), .2.. the hosts."""
CONTROLLER_ADDRESS = f"{SUBNET}.1"
WORKER_PORT = 4444
QUEUE_S = 0.2
"""Each link's queue holds this much traffic (TCP sees few drops)."""
PURE_ACKS = tuple(
    ("ip", "protocol", "6", "0xff", "match", "u8", "0x45", "0xff", "at", "0",
     "match", "u16", f"{20 + 4 * doff:#06x}", "0xffff", "at", "2",
     "match", "u8", f"{doff << 4:#04x}", "0xf0", "at", "32")
    for doff in range(5, 16))
"""u32 matches of the TCP segments that carry no payload (ACKs, with or without SACK blocks;
also SYN and FIN): IP total length equal to the IP header (20 bytes: version 4, IHL 5) plus
the TCP header (its data offset, ``doff`` 32-bit words). They are the only packets of another
connection the control band takes: a cut by size alone also takes a stream's own short data
segments (Monarch sends a message's frames as packets of their own, down to a few bytes) ahead
of the full segments queued before them, and TCP takes the reordering for loss. A cut at 1408
bytes (before 7 Dec 2026) retransmitted 4.2 MB of one 72 MB update at 4 trainer nodes, one at
64 bytes 0.41 MB, none of it dropped (docs/notes/emulated-cluster.md, "Plain TCP and the
control band, 7 Dec 2026")."""
MAX_HOSTS = 200
REPO = Path(__file__).resolve().parents[1]


class ClusterError(RuntimeError):
    """The emulated cluster could not be brought up (the message says why)."""


def netns_run(*args: str, ns: str | None = None,
              check: bool = True) -> subprocess.CompletedProcess:
    """Run a command (``ip ...``), inside network namespace ``ns`` if given."""
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise ClusterError(f"`{' '.join(cmd)}` failed: {done.stderr.strip() or done.stdout}")
    return done


def link_burst_bytes(bytes_per_s: float) -> int:
    """The token bucket of a link shaped to ``bytes_per_s``: about 5 ms of traffic, at least
    64 KB; small enough that bursts do not beat the rate, large enough for the kernel's timer
    resolution. A link that idled sends this much unshaped (the simulator models it:
    `Cluster.link_burst_bytes`)."""
    return max(64 << 10, int(bytes_per_s * 0.005))


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here (not root, no iproute2, no CAP_NET_ADMIN), or None."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (`ip`, `tc`) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"{NS_PREFIX}probe{os.getpid()}"
    done = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if done.returncode != 0:
        return f"`ip netns add` failed: {done.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def host_address(i: int) -> str:
    return f"{SUBNET}.{i + 2}"


def certs_command(hosts: int, folder: str = "DIR") -> str:
    """The `controller.certs` command that makes the files of a ``hosts``-host cluster."""
    return (f"python -m controller.certs make {folder} --hosts "
            f"{','.join(host_address(i) for i in range(hosts))} --controller {CONTROLLER_ADDRESS}")


class EmulatedCluster:
    """``hosts`` namespaces on a bridge, links shaped to ``link_mbit``, a worker in each.

    Args:
        hosts: Number of emulated hosts.

    Keyword Args:
        link_mbit: Rate of every host link, each direction, Mbit/s.
        start_workers: Start a Monarch worker per host (False: only the network).
        tls_dir: A folder made by `certs_command`: each host's worker serves mutual TLS with
            its own files, and `controller_security` holds the controller's.
        credentials: Instead of ``tls_dir``: each host's worker's files, host 0 first
            (`controller_security` is then None: give the controller its own files).
        insecure: Plaintext trust-all ``tcp://`` workers (the workers warn what it exposes).
        log_dir: Where the workers' output goes (a temporary folder by default).
        control_priority: Serve the controller's connections and TCP ACKs before bulk data on
            every link (see the module doc); False: one FIFO queue per link.
    """

    def __init__(self, hosts: int, *, link_mbit: float, tls_dir: str | None = None,
                 credentials: Sequence[Credentials] | None = None, insecure: bool = False,
                 start_workers: bool = True, log_dir: str | None = None,
                 control_priority: bool = True):
        if not 1 <= hosts <= MAX_HOSTS:
            raise ValueError(f"hosts must be in [1, {MAX_HOSTS}], got {hosts}")
        if link_mbit <= 0:
            raise ValueError(f"link_mbit must be positive, got {link_mbit}")
        chosen = (tls_dir is not None) + (credentials is not None) + bool(insecure)
        if chosen > 1 or (start_workers and chosen == 0):
            raise ValueError(f"give the workers' TLS files (tls_dir=DIR made by "
                             f"`{certs_command(hosts)}`, or credentials=[...] per host) or "
                             f"insecure=True, exactly one")
        if tls_dir is not None:
            credentials = [Credentials.from_dir(tls_dir, host_address(i)) for i in range(hosts)]
        if credentials is not None:
            if len(credentials) != hosts:
                raise ValueError(f"credentials: {len(credentials)} given for {hosts} hosts")
            for c in credentials:
                check_files(c)
        self.worker_credentials = list(credentials) if credentials is not None else None
        # The controller's side: from tls_dir, or insecure; None with credentials= (the caller
        # brings the controller's own files then).
        self.controller_security: Security | None = (
            Security(None) if insecure else
            Security(Credentials.from_dir(tls_dir, CONTROLLER)) if tls_dir is not None else None)
        self.hosts, self.link_mbit = hosts, float(link_mbit)
        self.start_workers = start_workers
        self.control_priority = control_priority
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="wb-cluster-"))
        self.workers: list[subprocess.Popen] = []

    @property
    def link_bytes_per_s(self) -> float:
        return self.link_mbit * 1e6 / 8

    @property
    def scheme(self) -> str:
        """``tls`` (mutual TLS) or ``tcp`` (insecure)."""
        return "tcp" if self.worker_credentials is None else "tls"

    @property
    def addresses(self) -> list[str]:
        """Monarch worker addresses, host 0 first."""
        return [f"{self.scheme}://{host_address(i)}:{WORKER_PORT}" for i in range(self.hosts)]

    @property
    def controller_transport(self) -> str:
        """The transport the controller (root namespace) must use to reach the workers."""
        return f"{self.scheme}://{CONTROLLER_ADDRESS}:0"

    def __enter__(self) -> "EmulatedCluster":
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> None:
        """Bridge, namespaces, shaped veths, workers; returns once every worker listens."""
        reason = unavailable_reason()
        if reason:
            raise ClusterError(f"cannot emulate a cluster here: {reason}")
        if existing():
            raise ClusterError(f"a cluster is already up ({', '.join(existing())}); tear it "
                               f"down with `python -m controller.cluster down`")
        netns_run("ip", "link", "add", BRIDGE, "type", "bridge")
        netns_run("ip", "addr", "add", f"{SUBNET}.1/24", "dev", BRIDGE)
        netns_run("ip", "link", "set", BRIDGE, "up")
        for i in range(self.hosts):
            self._add_host(i)
        if self.start_workers:
            for i in range(self.hosts):
                self._start_worker(i)
            self._wait_listening()

    def _add_host(self, i: int) -> None:
        ns, veth = f"{NS_PREFIX}{i}", f"{VETH_PREFIX}{i}"
        netns_run("ip", "netns", "add", ns)
        netns_run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        netns_run("ip", "link", "set", veth, "master", BRIDGE)
        netns_run("ip", "link", "set", veth, "up")
        netns_run("ip", "link", "set", "lo", "up", ns=ns)
        netns_run("ip", "addr", "add", f"{host_address(i)}/24", "dev", "eth0", ns=ns)
        netns_run("ip", "link", "set", "eth0", "up", ns=ns)
        for dev, where in ((veth, None), ("eth0", ns)):  # host ingress, host egress
            netns_run("tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", *self._tbf(),
                      ns=where)
            if self.control_priority:
                self._add_priority_bands(dev, where)

    def _add_priority_bands(self, dev: str, ns: str | None) -> None:
        # htb here only orders (its classes' rates are far above the link's); tbf shapes. Band 1
        # (prio 0): every packet to or from the controller (whole connections, so nothing in a
        # stream is reordered) and segments without payload (PURE_ACKS); band 2: everything
        # else, in a byte FIFO as long as tbf's was.
        tc = lambda *a: netns_run("tc", *a, ns=ns)  # noqa: E731
        tc("qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", "htb", "default", "2")
        for band in (1, 2):
            tc("class", "add", "dev", dev, "parent", "10:", "classid", f"10:{band}", "htb",
               "rate", "10gbit", "quantum", "65536", "prio", str(band - 1))
        tc("qdisc", "add", "dev", dev, "parent", "10:2", "bfifo", "limit",
           str(int(self.link_bytes_per_s * QUEUE_S)))
        for match in (*PURE_ACKS, ("ip", "src", f"{CONTROLLER_ADDRESS}/32"),
                      ("ip", "dst", f"{CONTROLLER_ADDRESS}/32")):
            tc("filter", "add", "dev", dev, "parent", "10:", "protocol", "ip", "prio", "1",
               "u32", "match", *match, "flowid", "10:1")

    def _tbf(self) -> list[str]:
        burst = link_burst_bytes(self.link_bytes_per_s)
        return ["tbf", "rate", f"{self.link_mbit:g}mbit", "burst", str(burst),
                "latency", f"{QUEUE_S * 1000:g}ms"]

    def _start_worker(self, i: int) -> None:
        addr = host_address(i)
        env = dict(os.environ, **{TRANSPORT_ENV: f"{self.scheme}://{addr}:0"})
        env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in sys.path if p])
        if self.worker_credentials is None:
            tls = ["--insecure"]
        else:
            c = self.worker_credentials[i]
            tls = ["--tls-ca", c.ca, "--tls-cert", c.cert, "--tls-key", c.key]
        log = open(self.log_dir / f"worker-h{i}.log", "w")
        self.workers.append(subprocess.Popen(
            ["ip", "netns", "exec", f"{NS_PREFIX}{i}", sys.executable, "-m", "controller.worker",
             self.addresses[i], *tls], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True))
        log.close()

    def _wait_listening(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        pending = set(range(self.hosts))
        while pending:
            for i in sorted(pending):
                if self.workers[i].poll() is not None:
                    raise ClusterError(f"the worker of host {i} exited with "
                                       f"{self.workers[i].returncode}; see "
                                       f"{self.log_dir / f'worker-h{i}.log'}")
                with socket.socket() as s:
                    s.settimeout(0.5)
                    if s.connect_ex((host_address(i), WORKER_PORT)) == 0:
                        pending.discard(i)
            if pending and time.monotonic() > deadline:
                raise ClusterError(f"workers of hosts {sorted(pending)} did not listen within "
                                   f"{timeout_s:.0f}s; see {self.log_dir}")
            if pending:
                time.sleep(0.2)

    def down(self) -> None:
        """Kill our processes, delete our links, namespaces and bridge. Safe to call twice."""
        for w in self.workers:
            _kill_group(w.pid)
        teardown()
        for w in self.workers:
            try:
                w.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.workers = []


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def existing() -> list[str]:
    """Our namespaces and bridge that exist now (found by name)."""
    names = [line.split()[0] for line in
             netns_run("ip", "netns", "list", check=False).stdout.splitlines() if line.strip()]
    found = [n for n in names if n.startswith(NS_PREFIX)]
    if netns_run("ip", "link", "show", BRIDGE, check=False).returncode == 0:
        found.append(BRIDGE)
    return found


def leftovers() -> list[str]:
    """Anything teardown should have removed: namespaces, links, processes in our namespaces."""
    out = existing()
    links = netns_run("ip", "-o", "link", "show", check=False).stdout
    out += [f"link {tok.split('@')[0]}" for tok in links.split()
            if tok.startswith(VETH_PREFIX) and tok.rstrip(":").split("@")[0][len(VETH_PREFIX):]
            .isdigit()]
    return out


def teardown() -> None:
    """Remove every namespace, veth and bridge of ours, killing the processes inside first."""
    for ns in [n for n in existing() if n.startswith(NS_PREFIX)]:
        for _ in range(3):  # a dying worker may spawn nothing new, but check again
            pids = netns_run("ip", "netns", "pids", ns, check=False).stdout.split()
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            time.sleep(0.1)
        netns_run("ip", "link", "del", f"{VETH_PREFIX}{ns[len(NS_PREFIX):]}", check=False)
        netns_run("ip", "netns", "del", ns, check=False)
    links = netns_run("ip", "-o", "link", "show", check=False).stdout.split()
    for tok in links:
        name = tok.rstrip(":").split("@")[0]
        if name.startswith(VETH_PREFIX) and name[len(VETH_PREFIX):].isdigit():
            netns_run("ip", "link", "del", name, check=False)
    netns_run("ip", "link", "del", BRIDGE, check=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="emulated cluster: namespaces + shaped links")
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in ("up", "run"):
        p = sub.add_parser(name)
        p.add_argument("--hosts", type=int, default=3)
        p.add_argument("--link-mbit", type=float, default=400)
        p.add_argument("--tls-dir", metavar="DIR",
                       help="the files `python -m controller.certs make` made for these hosts")
        p.add_argument("--insecure", action="store_true",
                       help="plaintext trust-all tcp:// workers instead")
        if name == "run":
            p.add_argument("command", nargs=argparse.REMAINDER)
    sub.add_parser("down")
    sub.add_parser("status")
    args = parser.parse_args(argv)
    if args.cmd == "down":
        teardown()
        left = leftovers()
        print("removed the emulated cluster" if not left else f"left behind: {left}")
        return 1 if left else 0
    if args.cmd == "status":
        print("\n".join(existing()) or "no emulated cluster")
        return 0
    if (args.tls_dir is None) == (not args.insecure):
        parser.error(f"give --tls-dir DIR (made by `{certs_command(args.hosts)}`) for "
                     f"authenticated workers, or --insecure, exactly one")
    try:
        cluster = EmulatedCluster(args.hosts, link_mbit=args.link_mbit, tls_dir=args.tls_dir,
                                  insecure=args.insecure)
    except ValueError as e:
        parser.error(str(e))
    if args.cmd == "up":
        with_cleanup = cluster.__enter__  # tears down itself if bringing up fails
        with_cleanup()
        print(f"export {TRANSPORT_ENV}={cluster.controller_transport}")
        for k, v in (cluster.controller_security or Security(None)).env.items():
            print(f"export {k}={v}")
        print(f"workers ({args.link_mbit:g} Mbit/s links): {','.join(cluster.addresses)}")
        print(f"worker logs: {cluster.log_dir}; tear down: python -m controller.cluster down")
        return 0
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("run needs a command after --")
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    with cluster:
        env = dict(os.environ, WB_CLUSTER_WORKERS=",".join(cluster.addresses),
                   WB_CLUSTER_LINK_MBIT=f"{args.link_mbit:g}",
                   **{TRANSPORT_ENV: cluster.controller_transport},
                   **cluster.controller_security.env)
        try:
            return subprocess.run(command, env=env).returncode
        except KeyboardInterrupt:
            return 130


if __name__ == "__main__":
    raise SystemExit(main())
