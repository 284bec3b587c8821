"""Soak: many sync updates through the adapters on real meshes; memory per update, checksum cost.

    .venv/bin/python benchmarks/bench_soak.py                  # 1,000 updates per group
    .venv/bin/python benchmarks/bench_soak.py --updates 100    # a quick run

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
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from monarch.actor import Actor, current_rank, endpoint, this_host

from meshes.qwen3_moe import SIZES, RolloutShard, TrainerShard, checkpoint_spec
from weightbridge import TransferConfig, TransferGroup
from weightbridge.mesh.transport import configure_transport

TRAINER_TP, ENGINES, ENGINE_TP = 2, 2, 2


def checkpoint(model: str, version: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(9001 + version)
    return {t.name: torch.randn(t.shape, generator=gen).bfloat16()
            for t in checkpoint_spec(SIZES[model]).tensors}


def usage() -> tuple[float, int]:
    """(resident MB, open file descriptors) of this process."""
    with open("/proc/self/status") as f:
        rss_kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return rss_kb / 1024, len(os.listdir("/proc/self/fd"))


class SoakTrainer(Actor):
    def __init__(self, model: str):
        torch.set_num_threads(1)
        self.model = model
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
    def send(self, name: str, version: int, weights_version: int) -> float:
        """Load ``weights_version`` and send it as ``version``; seconds in send_weights."""
        with torch.no_grad():
            self.shard.load_weights(checkpoint(self.model, weights_version).items())
        start = time.perf_counter()
        self.senders[name].send_weights(version)
        return time.perf_counter() - start

    @endpoint
    def usage(self) -> tuple[float, int]:
        return usage()


class SoakRollout(Actor):
    def __init__(self, model: str):
        torch.set_num_threads(1)
        self.model = model
        self.receivers, self.shards = {}, {}

    @endpoint
    def setup(self, name: str, group) -> None:
        self.rank = current_rank().rank % ENGINE_TP
        shard = self.shards[name] = RolloutShard(SIZES[self.model], ENGINE_TP, self.rank, 1, 0)
        self.receivers[name] = group.receiver(shard.params, shard.load_weights,
                                              checkpoint_spec(SIZES[self.model]))

    @endpoint
    def receive(self, name: str, version: int, weights_version: int, check: bool) -> bool:
        """Wait until ``version`` is installed; with ``check``, True iff every parameter is
        bit-identical to this rank's own load_weights of ``weights_version``."""
        self.receivers[name].wait_for_version(version)
        if not check:
            return True
        ref = RolloutShard(SIZES[self.model], ENGINE_TP, self.rank, 1, 0)
        ref.load_weights(checkpoint(self.model, weights_version).items())
        params = self.shards[name].params
        return all(torch.equal(params[n].view(torch.uint8), p.view(torch.uint8))
                   for n, p in ref.params.items())

    @endpoint
    def usage(self) -> tuple[float, int]:
        return usage()


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
    args = parser.parse_args()
    if min(args.updates, args.sample_every, args.check_every) < 1 or args.warmup < 0 \
            or args.updates <= args.warmup:
        parser.error("--updates > --warmup >= 0, and --sample-every, --check-every >= 1")
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


if __name__ == "__main__":
    raise SystemExit(main())
