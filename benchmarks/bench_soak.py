"""Soak: many sync updates through the adapters on real meshes; memory per update, checksum cost.

    .venv/bin/python benchmarks/bench_soak.py                  # 1,000 updates per group
    .venv/bin/python benchmarks/bench_soak.py --updates 100    # a quick run
    .venv/bin/python benchmarks/bench_soak.py --modes all --updates 500   # memory per mode

One pair of proc meshes (2 trainer procs, 4 rollout procs: trainer TP2 -> two TP2 engines of
the tiny Qwen3-MoE) holds two transfer groups side by side, one with `TransferConfig.checksums`
on and one with it off, and runs their updates interleaved (update v on one, then on the
other), so both see the same machine. Each update: the trainers load version v (the stand-in
optimizer step) and call ``send_weights(v)``; the rollouts ``wait_for_version(v)``; every
``--check-every`` versions each rollout compares its parameters bit for bit with its own
``load_weights`` of v. Printed:

- per group, the median and p90 of trainer 0's ``send_weights`` time (sync mode: it returns
  once every rollout installed v, so it is the update's end-to-end time), and the ratio
  checksums-on / checksums-off: the cost of the built-in verification;
- per process, the resident memory and open file descriptors after the warm-up and at the
  end, and the growth per update from a least-squares fit over the samples.

With ``--modes`` (a comma list of sync, ss, rs, async, sync-delta, rs-delta, or "all") it
measures memory per mode instead: one group per mode on the same procs, one after another
(RSS is per process, so the modes must not overlap), each for ``--updates`` updates after
``--warmup``, then closed (once per way of ``--writes``: `TransferConfig.rdma_writes`).
The delta modes send ``changed=`` a different third of the checkpoint tensors each update
(rotating: every update re-plans). Printed per mode: each
process's RSS growth per update (least squares over the samples), the largest of the
rollouts' and the trainers', and the fds at the start and end of the mode; then, per
trainer and rollout rank 0 and 1 (of the first engine), the peer calls per update it sent
(Monarch messages), served, and made on itself (no message), from
`weightbridge.mesh.registry.calls`: Monarch keeps state for every message
(benchmarks/message_memory.py measures how much). The soak loop's own endpoint calls
(each leaves such state in the procs it reaches, about 0.6 KB) drive ``--per-call`` updates
each (default ``--sample-every``); ``--per-call 1`` makes one call per update on each side, as
a training loop would, and its state then counts in the growth. Every version is transferred
either way (under sender staging trainer 0 waits for each transfer before staging the next);
under receiver staging a rollout driven several updates per call may install fewer of them
(the newest landed when it polls). ``--trim`` runs ``malloc_trim(0)`` in every process before
each sample (what stays is live memory); ``--trace`` runs tracemalloc
in every process and prints the Python allocations that grew most in trainer 0 and rollout 0.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import gc
import os
import statistics
import time
import tracemalloc

import torch
from monarch.actor import Actor, current_rank, endpoint, this_host

from meshes.qwen3_moe import SIZES, RolloutShard, TrainerShard, checkpoint_spec
from weightbridge import TransferConfig, TransferGroup
from weightbridge.mesh import registry
from weightbridge.mesh.transport import configure_transport

TRAINER_TP, ENGINES, ENGINE_TP = 2, 2, 2


def checkpoint(model: str, version: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(9001 + version)
    return {t.name: torch.randn(t.shape, generator=gen).bfloat16()
            for t in checkpoint_spec(SIZES[model]).tensors}


def update_of(names: tuple[str, ...], mode: str, version: int
              ) -> tuple[int, list[str] | None]:
    """(the checkpoint the trainers load for ``version``: one of a few, generated in every
    actor; the tensors of ``names``, the checkpoint's, it changes, None: all). The delta modes
    change a different third of the tensors each update (rotating: every update re-plans);
    the first update is full."""
    changed = (list(names[version % 3::3]) if mode.endswith("delta") and version > 1
               else None)
    return version % 7 + 1, changed


def usage() -> tuple[float, int]:
    """(resident MB, open file descriptors) of this process; with ``WB_SOAK_TRIM`` set
    (``--trim``), after glibc's ``malloc_trim(0)``: what stays is live memory, not free heap
    memory glibc kept."""
    if os.environ.get("WB_SOAK_TRIM"):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/status") as f:
        rss_kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return rss_kb / 1024, len(os.listdir("/proc/self/fd"))


class Probe:
    """Endpoints both soak actors have: this process's peer-call counts and, with
    ``WB_SOAK_TRACE`` set (``--trace``), the Python heap's growth between two marks."""

    def _trace_start(self) -> None:
        if os.environ.get("WB_SOAK_TRACE") and not tracemalloc.is_tracing():
            tracemalloc.start(8)

    @endpoint
    def calls(self) -> dict:
        """("sent" | "served", PeerCall value) -> count in this process (`registry.calls`)."""
        return dict(registry.calls)

    @endpoint
    def heap_mark(self) -> None:
        self._mark = None
        if tracemalloc.is_tracing():
            gc.collect()
            gc.set_debug(gc.DEBUG_SAVEALL)  # (what the collections find is kept: counted below)
            self._mark = tracemalloc.take_snapshot()

    @endpoint
    def heap_growth(self, top: int = 6) -> list[str]:
        """The Python allocations that grew most since `heap_mark`, by traceback (live ones:
        after a full collection); first, the objects the collector found in reference
        cycles since the mark, by type. Those are freed by the collector only, not when the
        last reference goes: the ones that outlive a young collection stay resident until a
        full one, which CPython runs rarely in a process holding many objects."""
        if getattr(self, "_mark", None) is None:
            return []
        gc.collect()
        kinds = collections.Counter(type(o).__qualname__ for o in gc.garbage)
        gc.set_debug(0)
        gc.garbage.clear()
        gc.collect()
        diff = tracemalloc.take_snapshot().compare_to(self._mark, "traceback")
        return [f"{sum(kinds.values())} objects in reference cycles since the mark, most: "
                + ", ".join(f"{k} {n}" for k, n in kinds.most_common(8))] + [
            f"{d.size_diff / 1024:+.1f} KB in {d.count_diff:+d} blocks at "
            + " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno}"
                          for f in list(d.traceback)[::-1][:5]) for d in diff[:top]]


class SoakTrainer(Actor, Probe):
    def __init__(self, model: str):
        self._trace_start()
        torch.set_num_threads(1)
        self.model = model
        self.names = tuple(t.name for t in checkpoint_spec(SIZES[model]).tensors)
        self.senders = {}

    @endpoint
    def setup(self, name: str, group) -> None:
        if not hasattr(self, "shard"):
            self.shard = TrainerShard(SIZES[self.model], TRAINER_TP, current_rank().rank, 1, 0)
        self.senders[name] = group.sender(self.shard.params, self.shard.load_weights,
                                          checkpoint_spec(SIZES[self.model]))

    @endpoint
    def connect(self, name: str) -> None:
        self.senders[name].connect()

    @endpoint
    def send(self, name: str, version: int, weights_version: int,
             changed: list[str] | None = None) -> float:
        """Load ``weights_version`` (of the ``changed`` tensors only, if given) and send it as
        ``version``; seconds in send_weights."""
        return self._send(name, version, weights_version, changed)

    @endpoint
    def send_range(self, name: str, mode: str, first: int, last: int) -> None:
        """Send versions ``first`` to ``last``, each as `update_of` says, one after another.
        Sender staging: every trainer waits until each was transferred before staging the
        next (nothing superseded: every version is a transfer, as with a soak call per
        update, where the soak loop waited for the rollouts)."""
        sender = self.senders[name]
        for v in range(first, last + 1):
            self._send(name, v, *update_of(self.names, mode, v))
            if not sender.config.sender_staging:
                continue
            if current_rank().rank == 0:
                sender.wait_idle()  # (raises what the transfer failed with)
                continue
            end = time.monotonic() + 3 * sender.config.timeout_s
            while sender.stage.sent < v:  # (trainer 0 ends each transfer with STAGE_FINISH)
                if time.monotonic() > end:
                    raise TimeoutError(f"version {v} was not transferred within "
                                       f"{3 * sender.config.timeout_s:g}s")
                time.sleep(0.0005)

    def _send(self, name: str, version: int, weights_version: int,
              changed: list[str] | None) -> float:
        weights = checkpoint(self.model, weights_version)
        with torch.no_grad():
            self.shard.load_weights((n, t) for n, t in weights.items()
                                    if changed is None or n in changed)
        start = time.perf_counter()
        self.senders[name].send_weights(version, changed=changed)
        return time.perf_counter() - start

    @endpoint
    def wait_idle(self, name: str) -> None:
        if current_rank().rank == 0 and self.senders[name].config.sender_staging:
            self.senders[name].wait_idle()

    @endpoint
    def drop(self, name: str) -> None:
        self.senders.pop(name, None)

    @endpoint
    def usage(self) -> tuple[float, int]:
        return usage()


class SoakRollout(Actor, Probe):
    def __init__(self, model: str):
        self._trace_start()
        torch.set_num_threads(1)
        self.model = model
        self.names = tuple(t.name for t in checkpoint_spec(SIZES[model]).tensors)
        self.receivers, self.shards, self.held = {}, {}, {}

    @endpoint
    def setup(self, name: str, group) -> None:
        self.rank = current_rank().rank % ENGINE_TP
        shard = self.shards[name] = RolloutShard(SIZES[self.model], ENGINE_TP, self.rank, 1, 0)
        self.receivers[name] = group.receiver(shard.params, shard.load_weights,
                                              checkpoint_spec(SIZES[self.model]))

    @endpoint
    def receive(self, name: str, version: int, weights_version, check: bool) -> bool:
        """Wait until ``version`` is installed; with ``check``, True iff every parameter is
        bit-identical to this rank's own load_weights of ``weights_version`` (an int, or
        tensor -> the version it holds after delta updates)."""
        return self._receive(name, version, weights_version, check)

    @endpoint
    def receive_range(self, name: str, mode: str, first: int, last: int,
                      check_every: int) -> int:
        """`receive` versions ``first`` to ``last`` (each as `update_of` says), checking every
        ``check_every``-th; how many checks found a parameter that is not bit-identical."""
        held = self.held.setdefault(name, {})  # tensor -> the version it holds
        bad = 0
        for v in range(first, last + 1):
            weights, changed = update_of(self.names, mode, v)
            held.update(dict.fromkeys(changed or self.names, weights))
            bad += not self._receive(name, v, dict(held), v % check_every == 0)
        return bad

    def _receive(self, name: str, version: int, weights_version, check: bool) -> bool:
        self.receivers[name].wait_for_version(version)
        if not check:
            return True
        ref = RolloutShard(SIZES[self.model], ENGINE_TP, self.rank, 1, 0)
        if isinstance(weights_version, int):
            ref.load_weights(checkpoint(self.model, weights_version).items())
        else:
            ref.load_weights((n, checkpoint(self.model, v)[n])
                             for n, v in weights_version.items())
        params = self.shards[name].params
        return all(torch.equal(params[n].view(torch.uint8), p.view(torch.uint8))
                   for n, p in ref.params.items())

    @endpoint
    def usage(self) -> tuple[float, int]:
        return usage()

    @endpoint
    def drop(self, name: str) -> None:
        self.receivers.pop(name, None)
        self.shards.pop(name, None)
        self.held.pop(name, None)


def slope(xs: list[float], ys: list[float]) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--updates", type=int, default=1000, help="updates per group")
    parser.add_argument("--warmup", type=int, default=50, help="updates before the first sample")
    parser.add_argument("--sample-every", type=int, default=50)
    parser.add_argument("--check-every", type=int, default=100)
    parser.add_argument("--round-kib", type=int, default=256)
    parser.add_argument("--modes", help=f"memory per mode: a comma list of {MODES} or 'all'")
    parser.add_argument("--writes", default="per-range",
                        help="with --modes: TransferConfig.rdma_writes, or 'per-range,batched' "
                             "to run each mode once per way")
    parser.add_argument("--round-control", default="stages", choices=("stages", "rounds"),
                        help="with --modes: TransferConfig.round_control")
    parser.add_argument("--per-call", type=int,
                        help="with --modes: updates each endpoint call of the soak loop drives "
                             "(default --sample-every; 1: a call per update, as a training "
                             "loop makes, whose Monarch state then counts in the growth)")
    parser.add_argument("--series", action="store_true",
                        help="with --modes: print each process's RSS at every sample (a "
                             "slope made of a few jumps reads differently from a steady one)")
    parser.add_argument("--trim", action="store_true",
                        help="malloc_trim(0) in each process before each memory sample")
    parser.add_argument("--trace", action="store_true",
                        help="with --modes: print the Python heap's largest growth per mode "
                             "(tracemalloc in every process; slower)")
    args = parser.parse_args()
    if args.trim:
        os.environ["WB_SOAK_TRIM"] = "1"  # (the procs inherit it)
    if args.trace:
        os.environ["WB_SOAK_TRACE"] = "1"
    if args.per_call is None:
        args.per_call = args.sample_every
    if min(args.updates, args.sample_every, args.check_every, args.per_call) < 1 \
            or args.warmup < 0 \
            or args.updates <= args.warmup:
        parser.error("--updates > --warmup >= 0, and --sample-every, --check-every, --per-call "
                     ">= 1")
    if args.modes:
        modes = MODES if args.modes == "all" else tuple(args.modes.split(","))
        if not set(modes) <= set(MODES):
            parser.error(f"--modes: choose from {MODES}")
        return soak_modes(args, modes)
    configure_transport()
    host = this_host()
    tp = host.spawn_procs(per_host={"gpus": TRAINER_TP}, name="trainer")
    rp = host.spawn_procs(per_host={"replica": ENGINES, "gpus": ENGINE_TP}, name="rollout")
    groups = {}
    try:
        trainers = tp.spawn("soak_trainer", SoakTrainer, args.model)
        rollouts = rp.spawn("soak_rollout", SoakRollout, args.model)
        for name, sums in (("checksums on", True), ("checksums off", False)):
            config = TransferConfig(round_bytes=args.round_kib << 10, timeout_s=60,
                                    checksums=sums)
            groups[name] = TransferGroup.spawn(tp, rp, engine_size=ENGINE_TP, config=config)
            trainers.setup.call(name, groups[name]).get()
            rollouts.setup.call(name, groups[name]).get()
            trainers.connect.call(name).get()
        times = {name: [] for name in groups}
        samples: list[tuple[int, dict]] = []
        bad = 0
        t0 = time.perf_counter()
        for v in range(1, args.updates + 1):
            weights = v % 7 + 1  # a few distinct checkpoints, generated in every actor
            check = v % args.check_every == 0
            for name in (list(groups) if v % 2 else list(groups)[::-1]):  # neither always first
                received = rollouts.receive.call(name, v, weights, check)
                sent = trainers.send.call(name, v, weights).get()
                times[name].append(min(sent.items(), key=lambda kv: kv[0].rank)[1])
                bad += sum(not ok for _, ok in received.get().items())
            if v >= args.warmup and (v - args.warmup) % args.sample_every == 0 \
                    or v == args.updates:
                samples.append((v, {("trainer", p.rank): u for p, u in
                                    trainers.usage.call().get().items()}
                                | {("rollout", p.rank): u for p, u in
                                   rollouts.usage.call().get().items()}))
        wall = time.perf_counter() - t0
    finally:
        for group in groups.values():
            group.close()
        rp.stop().get(timeout=60)
        tp.stop().get(timeout=60)

    print(f"{args.updates} sync updates per group, {len(groups)} groups interleaved, tiny "
          f"Qwen3-MoE TP{TRAINER_TP} -> {ENGINES} x TP{ENGINE_TP}, {args.round_kib} KiB rounds, "
          f"{wall:.0f}s; bit-exact checks every {args.check_every} versions: "
          + ("all bit-exact" if not bad else f"{bad} MISMATCHED"))
    med = {}
    for name, ts in times.items():
        ts = ts[args.warmup:]
        med[name] = statistics.median(ts)
        p90 = sorted(ts)[int(0.9 * (len(ts) - 1))]
        print(f"  {name:<14} send_weights median {med[name] * 1e3:7.2f} ms  p90 "
              f"{p90 * 1e3:7.2f} ms")
    print(f"  checksum cost: on / off = {med['checksums on'] / med['checksums off']:.3f}x the "
          f"update's end-to-end time")
    xs = [v for v, _ in samples]
    for key in sorted(samples[0][1]):
        rss = [s[key][0] for _, s in samples]
        fds = [s[key][1] for _, s in samples]
        print(f"  {key[0]} {key[1]}: RSS {rss[0]:.1f} -> {rss[-1]:.1f} MB "
              f"({1024 * slope(xs, rss):+.2f} KB/update over updates {xs[0]}-{xs[-1]}), "
              f"fds {fds[0]} -> {fds[-1]}")
    return 1 if bad else 0


MODES = ("sync", "ss", "rs", "async", "sync-delta", "rs-delta")
STAGING = {"sync": (False, False), "ss": (True, False), "rs": (False, True),
           "async": (True, True)}


def soak_modes(args, modes: tuple[str, ...]) -> int:
    """One group per mode on the same procs, one mode after another: RSS growth per update."""
    configure_transport()
    host = this_host()
    tp = host.spawn_procs(per_host={"gpus": TRAINER_TP}, name="trainer")
    rp = host.spawn_procs(per_host={"replica": ENGINES, "gpus": ENGINE_TP}, name="rollout")
    lines, bad, worst = [], 0, {}
    try:
        trainers = tp.spawn("soak_trainer", SoakTrainer, args.model)
        rollouts = rp.spawn("soak_rollout", SoakRollout, args.model)
        for mode, writes in [(m, w) for m in modes for w in args.writes.split(",")]:
            name = mode if "," not in args.writes else f"{mode} {writes}"
            ss, rs = STAGING[mode.split("-")[0]]
            config = TransferConfig(round_bytes=args.round_kib << 10, timeout_s=60,
                                    sender_staging=ss, receiver_staging=rs, rdma_writes=writes,
                                    round_control=args.round_control)
            group = TransferGroup.spawn(tp, rp, engine_size=ENGINE_TP, config=config)
            try:
                trainers.setup.call(name, group).get()
                rollouts.setup.call(name, group).get()
                trainers.connect.call(name).get()
                samples: list[tuple[int, dict]] = []
                total = args.warmup + args.updates
                sampled = [v for v in range(args.warmup + 1, total + 1)
                           if (v - args.warmup) % args.sample_every == 0
                           or v == args.warmup + 1]
                # Each endpoint call drives a run of updates (at most --per-call, ending at
                # every sample): Monarch keeps state for each call in the procs it reaches,
                # which is the soak loop's, not the library's.
                ends = sorted(set(sampled) | set(range(args.per_call, total + 1, args.per_call))
                              | {total})
                t0 = time.perf_counter()
                for first, last in zip([1] + [e + 1 for e in ends[:-1]], ends):
                    received = rollouts.receive_range.call(name, mode, first, last,
                                                           args.check_every)
                    trainers.send_range.call(name, mode, first, last).get()
                    bad += sum(received.get().values())
                    if last in sampled:
                        samples.append((last, _usage(trainers, rollouts)))
                        if len(samples) == 1:
                            counted = _calls(trainers, rollouts)
                            trainers.heap_mark.call().get()
                            rollouts.heap_mark.call().get()
                trainers.wait_idle.call(name).get()
                wall = time.perf_counter() - t0
                counted = {k: _minus(c, counted[k]) for k, c in
                           _calls(trainers, rollouts).items()}
                heap = ({"t0": trainers.heap_growth.call().get().item(gpus=0),
                         "r0": rollouts.heap_growth.call().get().item(replica=0, gpus=0)}
                        if args.trace else {})
            finally:
                group.close()
                trainers.drop.call(name).get()
                rollouts.drop.call(name).get()
            xs = [v for v, _ in samples]
            growth = {k: 1024 * slope(xs, [s[k][0] for _, s in samples]) for k in samples[0][1]}
            for side in ("rollout", "trainer"):
                worst[(name, side)] = max(g for k, g in growth.items() if k[0] == side)
            per = "  ".join(f"{k[0][0]}{k[1]} {g:+.1f}" for k, g in sorted(growth.items()))
            fds = [s[k][1] for _, s in (samples[0], samples[-1]) for k in sorted(s)]
            half = len(fds) // 2
            lines.append(f"{name:>10}: RSS KB/update over updates {xs[0]}-{xs[-1]}: max rollout "
                         f"{worst[(name, 'rollout')]:+.1f}, max trainer "
                         f"{worst[(name, 'trainer')]:+.1f}  ({per}); fds {sum(fds[:half])} -> "
                         f"{sum(fds[half:])} over all procs; {wall:.0f}s")
            n = xs[-1] - xs[0]
            for side, name in (("trainer", "t"), ("rollout", "r")):
                for rank in (0, 1):
                    sent = sum(counted[(side, rank)]["sent"].values()) / n
                    posted = sum(counted[(side, rank)]["posted"].values()) / n
                    served = sum(counted[(side, rank)]["served"].values()) / n
                    local = sum(counted[(side, rank)]["local"].values()) / n
                    writes = sum(counted[(side, rank)]["write"].values()) / n
                    top = counted[(side, rank)]["sent"].most_common(3)
                    lines.append(f"{'':>12}{name}{rank} peer calls/update: sent {sent:.1f} "
                                 f"(messages), posted {posted:.1f} (one-way), served "
                                 f"{served:.1f}, on itself {local:.1f} (no "
                                 f"message); RDMA writes started {writes:.1f}; most sent: "
                                 + ", ".join(f"{c} {k / n:.1f}" for c, k in top))
            for who, grew in heap.items():
                lines += [f"{'':>12}{who} heap: {g}" for g in grew]
            series = ([f"{'':>12}{k[0][0]}{k[1]} RSS MB at updates {xs[0]}-{xs[-1]}: "
                       + " ".join(f"{s[k][0]:.1f}" for _, s in samples)
                       for k in sorted(samples[0][1])] if args.series else [])
            lines += series
            print("\n".join(lines[-4 - sum(map(len, heap.values())) - len(series) - 1:]),
                  flush=True)
    finally:
        rp.stop().get(timeout=60)
        tp.stop().get(timeout=60)
    print(f"{args.updates} updates per mode after {args.warmup} warm-up, tiny Qwen3-MoE "
          f"TP{TRAINER_TP} -> {ENGINES} x TP{ENGINE_TP}, {args.round_kib} KiB rounds, up to "
          f"{args.per_call} updates per soak call; "
          f"bit-exact checks every {args.check_every} versions: "
          + ("all bit-exact" if not bad else f"{bad} MISMATCHED"))
    print(f"largest growth: rollout {max(g for (m, s), g in worst.items() if s == 'rollout'):+.1f}"
          f" KB/update, trainer {max(g for (m, s), g in worst.items() if s == 'trainer'):+.1f}"
          f" KB/update (issue 43's target: <= 5)")
    return 1 if bad else 0


def _calls(trainers, rollouts) -> dict:
    """(side, rank) -> {"sent" | "posted" | "served" | "local" | "write": Counter
    (`registry.calls`)}."""
    out = {}
    for side, mesh in (("trainer", trainers), ("rollout", rollouts)):
        for p, counts in mesh.calls.call().get().items():
            by = out[(side, p.rank)] = {kind: collections.Counter()
                                        for kind in ("sent", "posted", "served", "local",
                                                     "write")}
            for (kind, call), k in counts.items():
                by[kind][call] += k
    return out


def _minus(now: dict, then: dict) -> dict:
    return {kind: now[kind] - then[kind] for kind in now}


def _usage(trainers, rollouts) -> dict:
    return ({("trainer", p.rank): u for p, u in trainers.usage.call().get().items()}
            | {("rollout", p.rank): u for p, u in rollouts.usage.call().get().items()})


if __name__ == "__main__":
    raise SystemExit(main())
