"""What Monarch keeps per message, in the caller and in the callee, measured in isolation.

    .venv/bin/python benchmarks/message_memory.py            # 4 x 5,000 calls per way
    .venv/bin/python benchmarks/message_memory.py --ways call --config enable_otel_metrics=false

One `benchmarks.echo_actor.Caller` in one proc calls one `Echo` in another proc, ``--calls``
calls one after another, ``--reps`` times, each way:

- ``call``: an endpoint call with its own reply port (``call_one(...).get()``), answered from a
  pool thread through the call's response port: what `MeshControl` did for every peer call;
- ``port``: a fire-and-forget message (``broadcast``) carrying a reply port the caller opened
  once, answered through that port;
- ``mailbox``: a `PeerCall` through the library's mailboxes (`weightbridge.mesh.mailbox`:
  one plain message to the callee's inbox, answered through the caller's reply port, both
  opened once), as `MeshControl` sends every bounded call;
- ``write``: an RDMA write (``write_from``, 4 KiB) into a buffer the callee registered, as a
  round's writes (over the TCP fallback where there is no RDMA NIC);
- ``batch``: one `monarch.rdma.RDMAAction` of ``--ops`` 4 KiB writes into as many buffers the
  callee registered, as `TransferConfig.rdma_writes` "batched" submits a step's writes (a
  message here is one action: divide by ``--ops`` for the cost per write).

Printed per way: each process's RSS growth per message (least squares over the reps, after
one warm-up rep).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def slope(xs, ys) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def _config(kv: str) -> tuple[str, object]:
    key, _, value = kv.partition("=")
    low = value.lower()
    return key, (low == "true") if low in ("true", "false") else value


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--ways", default="call,port,mailbox,write")
    parser.add_argument("--ops", type=int, default=4, help='writes per action ("batch")')
    parser.add_argument("--config", action="append", default=[], metavar="KEY=VALUE",
                        help="a monarch.configure key for the procs (repeatable), e.g. "
                             "enable_otel_metrics=false")
    args = parser.parse_args()
    from monarch.actor import this_host

    from benchmarks.echo_actor import Caller, Echo
    from weightbridge.mesh.transport import configure_transport

    configure_transport()
    if args.config:
        import monarch

        monarch.configure(**dict(_config(kv) for kv in args.config))
    for how in args.ways.split(","):
        procs = [this_host().spawn_procs(per_host={"p": 1}, name=n) for n in ("caller", "echo")]
        try:
            caller = procs[0].spawn("caller", Caller)
            echo = procs[1].spawn("echo", Echo)
            target = (echo.buffer.call_one(4096).get() if how == "write" else
                      echo.buffers.call_one(4096, args.ops).get() if how == "batch" else
                      echo.mailbox.call_one().get() if how == "mailbox" else echo)
            caller.run.call_one(target, how, args.calls).get()  # warm-up
            xs, mine, theirs = [], [], []
            for rep in range(1, args.reps + 1):
                mine.append(caller.run.call_one(target, how, args.calls).get())
                theirs.append(echo.rss_kb.call_one().get())
                xs.append(rep * args.calls)
            print(f"{how:>5}: RSS per message: caller {1024 * slope(xs, mine):+.0f} B, callee "
                  f"{1024 * slope(xs, theirs):+.0f} B ({args.reps} x {args.calls} messages)",
                  flush=True)
        finally:
            for p in procs:
                p.stop().get(timeout=60)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
