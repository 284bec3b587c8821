"""Per-range RDMA writes against one `RDMAAction` per step, on this host's backend.

    PYTHONPATH=. .venv/bin/python benchmarks/rdma_batch.py                # a few shapes
    PYTHONPATH=. .venv/bin/python benchmarks/rdma_batch.py --reps 30 --ranges 4 16

One writer proc and ``--peers`` receiver procs; each receiver registers ``ranges / peers``
buffers over one arena (as `weightbridge.mesh.transport.register_ranges` does). A step writes
``--step-kib`` KiB split into ``ranges`` equal ranges, three ways, interleaved rep by rep:
``per-range`` (a ``write_from`` per range, all started, then each waited: the transport's
fallback), ``batched`` (one action of every range, one future) and ``per-peer`` (one action per
receiver). Prints each way's median step time and its ratio to per-range's, measured in the
same run, and checks that every receiver holds the last step's bytes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from monarch.actor import Actor, endpoint, this_host

WAYS = ("per-range", "batched", "per-peer")


class Receiver(Actor):
    """Owns one arena and registers ``n`` equal ranges of it."""

    @endpoint
    def ranges(self, n: int, nbytes: int) -> list:
        from monarch.rdma import RDMABuffer

        self.arena = torch.zeros(n * nbytes, dtype=torch.uint8)
        return [RDMABuffer(self.arena[i * nbytes:(i + 1) * nbytes]) for i in range(n)]

    @endpoint
    def holds(self, expected: torch.Tensor) -> bool:
        return torch.equal(self.arena, expected)


class Writer(Actor):
    """Writes one step into the receivers' ranges, one of `WAYS`; returns seconds."""

    @endpoint
    def step(self, handles: list[list], way: str, fill: int) -> float:
        from monarch.rdma import RDMAAction

        n = sum(len(h) for h in handles)
        size = handles[0][0].size()
        src = torch.full((n * size,), fill, dtype=torch.uint8)
        src[::4097] = torch.arange(len(src[::4097])).to(torch.uint8)
        pieces = [src[i * size:(i + 1) * size] for i in range(n)]
        flat = [h for peer in handles for h in peer]
        t0 = time.perf_counter()
        if way == "per-range":
            for f in [h.write_from(p, timeout=60) for h, p in zip(flat, pieces)]:
                f.get()
        elif way == "batched":
            action = RDMAAction()
            for h, p in zip(flat, pieces):
                action.write_remote(h, p)
            action.submit(timeout=60).get()
        else:
            futures, k = [], 0
            for peer in handles:
                action = RDMAAction()
                for h in peer:
                    action.write_remote(h, pieces[k])
                    k += 1
                futures.append(action.submit(timeout=60))
            for f in futures:
                f.get()
        return time.perf_counter() - t0


def main() -> int:
    import benchmarks.rdma_batch as me  # the actors by module name (the procs import it)
    from monarch.rdma import get_rdma_backend

    from weightbridge.mesh.transport import configure_transport

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=2)
    parser.add_argument("--ranges", type=int, nargs="+", default=[2, 8, 32],
                        help="ranges per step (a multiple of --peers)")
    parser.add_argument("--step-kib", type=int, nargs="+", default=[512, 8192])
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    configure_transport()
    writer_procs = this_host().spawn_procs(per_host={"w": 1}, name="writer")
    recv_procs = this_host().spawn_procs(per_host={"r": args.peers}, name="receivers")
    ok = True
    try:
        writer = writer_procs.spawn("writer", me.Writer)
        receivers = recv_procs.spawn("receivers", me.Receiver)
        print(f"backend {get_rdma_backend()}, 1 writer proc -> {args.peers} receiver procs, "
              f"load {os.getloadavg()[0]:.2f}", flush=True)
        for kib in args.step_kib:
            for n in args.ranges:
                size = (kib << 10) // n
                per_peer = n // args.peers
                handles = [receivers.slice(r=p).ranges.call_one(per_peer, size).get()
                           for p in range(args.peers)]
                times: dict[str, list[float]] = {w: [] for w in WAYS}
                for rep in range(args.reps + 1):
                    for k, way in enumerate(WAYS[rep % 3:] + WAYS[:rep % 3]):
                        fill = (rep * 3 + k) % 251
                        t = writer.step.call_one(handles, way, fill).get()
                        if rep:  # the first rep warms each way up
                            times[way].append(t)
                src = torch.full((n * size,), fill, dtype=torch.uint8)
                src[::4097] = torch.arange(len(src[::4097])).to(torch.uint8)
                for p in range(args.peers):
                    part = src[p * per_peer * size:(p + 1) * per_peer * size]
                    ok &= receivers.slice(r=p).holds.call_one(part).get()
                base = statistics.median(times["per-range"])
                line = "  ".join(f"{w} {statistics.median(times[w]) * 1e3:.2f} ms "
                                 f"({statistics.median(times[w]) / base:.2f}x)" for w in WAYS)
                print(f"step {kib} KiB in {n} ranges of {size >> 10} KiB, {args.reps} reps: "
                      f"{line}", flush=True)
    finally:
        writer_procs.stop().get(timeout=60)
        recv_procs.stop().get(timeout=60)
    print(f"bytes {'bit-exact' if ok else 'MISMATCH'}; load {os.getloadavg()[0]:.2f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
