"""WeightBridge vs the baselines users run (gloo broadcast, bucketed P2P) and the same-data-plane
ablations (in-house broadcast and P2P) on an emulated cluster whose links are the bottleneck.

    .venv/bin/python benchmarks/bench_cluster.py            # needs root (network namespaces)
    .venv/bin/python benchmarks/bench_cluster.py --link-mbit 100 --updates 3
    .venv/bin/python benchmarks/bench_cluster.py --rollout-procs 2   # 2 procs per rollout node
    .venv/bin/python benchmarks/bench_cluster.py --depth 2 --model tiny --fifo-links
    .venv/bin/python benchmarks/bench_cluster.py --points replicas=4   # one point only

One emulated cluster of 8 hosts (controller/cluster.py: a namespace per host, every host link
shaped by tc to --link-mbit each direction); per configuration the controller attaches to the
hosts it needs, and runs every mechanism on the same procs, model and links, one after the
other (`controller/baselines/`): WeightBridge (``weightbridge-rounds``: with one controller
message per worker per round, `TransferConfig.round_control` "rounds"); ``gloo-broadcast``
(``dist.broadcast``, gloo's binomial tree), ``ring-broadcast`` (NCCL's ring pattern from
gloo send/recv) and ``bucketed-p2p``, through torch.distributed gloo over the hosts' links
(``--bucket-kib`` buckets of full tensors, each rollout runs its own load_weights per
bucket); ``broadcast``
and ``p2p``, printed as ablations: WeightBridge's own data plane (Monarch RDMA) and plans with
the baselines' traffic patterns (broadcast's head in one more proc on the first trainer host);
and, not mechanisms, ``plain-tcp`` and ``plain-tcp-p2p``: the links' own reference,
WeightBridge's plan's bytes between hosts (and the P2P pattern's: every byte straight from its
trainer) over plain TCP with no Monarch, no rounds and no controller (`benchmarks/plain_tcp.py`),
so that EWTT / ideal splits into what TCP under ``tc`` loses on that traffic and what the
mechanism adds:

- rollout replicas 1, 2, 4 (one trainer node: TP2 over 2 procs; one TP1 engine per node);
- trainer nodes 1, 2, 4 (one proc per node, EP over the nodes; four one-proc rollout nodes).

Defaults: the ``medium`` model (18 MB per replica, 36 rounds of up to 512 KiB, so pipeline
fill and drain are a few percent, as for a real model) and 3 round arenas per worker
(``--depth``): a control message costs 5-10 ms here against 80 ms rounds, and the third arena
hides that latency (two suffice where it costs microseconds; docs/performance.md).
``--rollout-procs 2`` makes every rollout node a TP2
engine of two procs on its host, so the INTERNAL stage (inside a node, unshaped loopback) runs
too; ``--fifo-links`` queues control messages behind bulk data (controller/cluster.py: control
priority).

Prints EWTT, AGST, the ideal EWTT of Eq. (1) from the configured rate and the ratios (the last
update of each run; every update is verified bit-exact), the controller's messages per round
that drive the rounds (WeightBridge's), its per-round timeline where one trainer node's link
is the bound (every point but 2 and 4 trainer nodes), and writes
out/cluster/bench_cluster.csv, out/cluster/bench_cluster.png and the Chrome trace of one
WeightBridge update at 4 replicas.
"""

from __future__ import annotations

import argparse
import collections
import csv
import dataclasses
import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from controller.cluster import TRANSPORT_ENV, EmulatedCluster, unavailable_reason  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "out" / "cluster"


def configs(rollout_procs: int) -> list[tuple[str, int, str, str]]:
    """(sweep, x, trainer spec, rollout spec) of every point."""
    g = rollout_procs
    node = f"nodes=1,gpus={g}" + (f",tp={g}" if g > 1 else "")
    return ([("replicas", e, "nodes=1,gpus=2,tp=2", f"engines={e},{node}") for e in (1, 2, 4)]
            + [("trainer nodes", n, f"nodes={n},gpus=1" + (f",ep={n}" if n > 1 else ""),
                f"engines=4,{node}") for n in (1, 2, 4)])


MODES = {"weightbridge-ss": "ss", "weightbridge-rs": "rs", "weightbridge-async": "async"}
"""WeightBridge in the staging modes (``weightbridge`` is sync): the same rounds, with the
trainers' stall the staged copy (SS, async) and the rollouts' the install (RS, async)."""
ROUNDS = "weightbridge-rounds"
"""WeightBridge (sync) with one controller message per worker per round, the writers telling
their readers (`TransferConfig.round_control` "rounds"); ``weightbridge`` runs the default,
the controller starting every stage ("stages")."""
PLAIN_TCP = {"plain-tcp": "WeightBridge's plan", "plain-tcp-p2p": "P2P traffic"}
"""Not mechanisms: the links' own reference (`benchmarks/plain_tcp.py`), a traffic pattern's bytes
between hosts over plain TCP, pipelined without rounds, the median of ``PLAIN_TCP_RUNS``:
WeightBridge's plan, and the same plan with every byte sent straight from its trainer
(`p2p_plan`: the traffic of bucketed P2P and of the p2p ablation)."""
PLAIN_TCP_RUNS = 3
MECHANISMS = ("weightbridge", ROUNDS, *MODES, "gloo-broadcast", "ring-broadcast",
              "bucketed-p2p", "broadcast", "p2p", *PLAIN_TCP)
STEP_CALLS = ("send_round", "forward", "land", "round")
"""The controller's calls that drive the rounds (`weightbridge.coordination.session`)."""
LABELS = {"broadcast": "broadcast (ablation)", "p2p": "p2p (ablation)"}
"""Printed names where not the mechanism's: the in-house broadcast and P2P run on WeightBridge's
own data plane (Monarch RDMA, its plans), so they are same-data-plane ablations, not the
baselines users run."""
TRANSPORTS = {"gloo-broadcast": "gloo TCP", "ring-broadcast": "gloo TCP",
              "bucketed-p2p": "gloo TCP"}
"""Where the bytes travel, when not Monarch RDMA (its TCP fallback here)."""


@contextmanager
def attached(addrs, tspec, rspec, *, head: bool = False):
    """(trainer procs, rollout procs) on the hosts one point needs: trainer nodes first, then
    the rollout nodes engine by engine; with ``head``, a third item: one proc on the first
    trainer host (the broadcast head's). Stopped on exit."""
    from controller.launch import attach_procs
    from controller.security import Security

    insecure = Security(None)  # the local emulation: EmulatedCluster(..., insecure=True)

    owners = []
    try:
        t_owner, tp = attach_procs(addrs[:tspec.nodes], gpus=tspec.gpus, name="trainer",
                                   security=insecure)
        owners.append(t_owner)
        r_addrs = addrs[tspec.nodes:tspec.nodes + rspec.engines * rspec.nodes]
        r_owner, rp = attach_procs(r_addrs, gpus=rspec.gpus, name="rollout", security=insecure)
        owners.append(r_owner)
        if not head:
            yield tp, rp
            return
        h_owner, hp = attach_procs(addrs[:1], gpus=1, name="bcast_head", security=insecure)
        owners.append(h_owner)
        yield tp, rp, hp
    finally:
        for o in owners:
            o.stop().get(timeout=60)


def run_config(addrs, tspec_text, rspec_text, args) -> dict:
    """{"ideal": WeightBridge's Eq. (1) seconds, mechanism: its last `UpdateReport`} for every
    mechanism in ``args.mechanisms``, run one after another on the same procs (``args``: the
    parsed command line; ``bucket_kib`` defaults to 512 when absent)."""
    from controller.baselines import (Broadcast, BucketedP2P, GlooBroadcast, RingBroadcast,
                                      p2p_plan)
    from controller.driver import MeshTransfer
    from weightbridge.specs import RolloutSpec, TrainerSpec
    from weightbridge import TransferConfig
    from weightbridge.config import Mode

    from weightbridge.mesh.registry import calls

    tspec, rspec = TrainerSpec.parse(tspec_text), RolloutSpec.parse(rspec_text)
    messages: dict[str, float] = {}
    rate = args.link_mbit * 1e6 / 8
    config = TransferConfig(round_bytes=args.round_kib << 10, depth=args.depth)
    with attached(addrs, tspec, rspec, head="broadcast" in args.mechanisms) as procs:
        results, ideal, plan = {}, 0.0, None  # weightbridge runs first: it sets both
        for mech in args.mechanisms:
            if mech in PLAIN_TCP:
                results[mech] = _plain_tcp(p2p_plan(plan) if mech == "plain-tcp-p2p" else plan)
                continue
            kw = dict(procs=procs[:2], config=config, link_rate=rate)
            if mech == "broadcast":
                runner = Broadcast(tspec, rspec, args.model, head_procs=procs[2], **kw)
            elif mech in TRANSPORTS:
                cls = {"gloo-broadcast": GlooBroadcast, "ring-broadcast": RingBroadcast,
                       "bucketed-p2p": BucketedP2P}[mech]
                runner = cls(tspec, rspec, args.model, procs=procs[:2],
                             bucket_bytes=getattr(args, "bucket_kib", 512) << 10)
            else:
                if mech in MODES:
                    mode = Mode(MODES[mech])
                    kw["config"] = dataclasses.replace(
                        config, sender_staging=mode.sender_staging,
                        receiver_staging=mode.receiver_staging)
                if mech == ROUNDS:
                    kw["config"] = dataclasses.replace(config, round_control="rounds")
                runner = MeshTransfer(tspec, rspec, args.model,
                                      reroute=p2p_plan if mech == "p2p" else None, **kw)
            with runner:
                rounds = runner.connect().num_rounds if isinstance(runner, MeshTransfer) else 0
                if mech == "weightbridge":
                    ideal, plan = runner.ideal_s, runner.plan
                reports = []
                for v in range(1, args.updates + 1):
                    before = collections.Counter(calls)
                    reports.append(_one_update(runner, v))
                if rounds:  # the last update's messages from the controller, per round
                    messages[mech] = sum(calls["sent", c] - before["sent", c]
                                         for c in STEP_CALLS) / rounds
            bad = [r for r, _ in reports if r.mismatched]
            if bad:
                raise SystemExit(f"{mech}: {bad[0].line()}")
            results[mech] = reports[-1]
        return {"ideal": ideal, "messages": messages, **results}


def _plain_tcp(plan) -> tuple[float, int]:
    """(the median seconds of `PLAIN_TCP_RUNS` plain-TCP runs of ``plan``'s bytes between
    hosts, those bytes)."""
    from controller.cluster import NS_PREFIX, host_address
    from benchmarks.plain_tcp import measure, pipes

    flows = pipes(plan)
    hosts = [host_address(i) for i in range(1 + max(max(p.src_host, p.dst_host) for p in flows))]
    times = sorted(measure(flows, hosts, NS_PREFIX) for _ in range(PLAIN_TCP_RUNS))
    return times[len(times) // 2], sum(p.nbytes for p in flows)


def _one_update(runner, version: int):
    """(the update's report, its AGST): in a staging mode the rounds' report (`wait`) and
    the install (`poll_requests`), with the stalls of that mode (`UpdateTiming.mode_agst_s`)."""
    report = runner.update(version)
    config = getattr(runner, "config", None)
    if config is None or not (config.sender_staging or config.receiver_staging):
        return report, report.timing.agst_s
    stall = report.stall_s
    if config.sender_staging:
        report = runner.wait()
    installed = runner.poll_requests()
    install_s = installed.install_s if installed is not None else 0.0
    if installed is not None and installed.mismatched:
        raise SystemExit(f"{installed.line()}")
    return report, report.timing.mode_agst_s(config.mode, trainer_stall_s=stall,
                                             install_s=install_s)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--link-mbit", type=float, default=50)
    parser.add_argument("--round-kib", type=int, default=512)
    parser.add_argument("--bucket-kib", type=int, default=512,
                        help="bucket size of the gloo baselines (full tensors per message)")
    parser.add_argument("--updates", type=int, default=2)
    parser.add_argument("--model", default="medium", help="a name in meshes.qwen3_moe.SIZES")
    parser.add_argument("--rollout-procs", type=int, default=1,
                        help="procs per rollout node (one TP engine per node)")
    parser.add_argument("--depth", type=int, default=3, help="round arenas per worker")
    parser.add_argument("--mechanisms", nargs="+", default=list(MECHANISMS),
                        choices=MECHANISMS, help="weightbridge is always run (the reference)")
    parser.add_argument("--fifo-links", action="store_true",
                        help="no control priority on the links: one FIFO queue each")
    parser.add_argument("--points", nargs="+", metavar="SWEEP=X",
                        help="run only these points, e.g. replicas=4 'trainer nodes=2' "
                             "(default: every point)")
    args = parser.parse_args()
    every = [f"{sweep}={x}" for sweep, x, _, _ in configs(args.rollout_procs)]
    if args.points and set(args.points) - set(every):
        parser.error(f"--points: no such point {sorted(set(args.points) - set(every))}; "
                     f"the points are {every}")
    args.mechanisms = ["weightbridge"] + [m for m in args.mechanisms if m != "weightbridge"]
    reason = unavailable_reason()
    if reason:
        print(f"skipped: cannot emulate a cluster here: {reason}")
        return 0
    OUT.mkdir(parents=True, exist_ok=True)
    rows = []
    t0 = time.perf_counter()
    with EmulatedCluster(8, link_mbit=args.link_mbit, insecure=True,
                         control_priority=not args.fifo_links) as cluster:
        os.environ[TRANSPORT_ENV] = cluster.controller_transport  # before monarch starts
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        from controller.timing import chrome_trace, write_timeline

        print(f"load average at start: {os.getloadavg()[0]:.2f}; torchstore: not run "
              f"(docs/performance.md: torchstore 0.1.2 does not run beside torchmonarch 0.7)")
        print(f"emulated cluster: 8 hosts, {args.link_mbit:g} Mbit/s links "
              f"({'FIFO' if args.fifo_links else 'control priority'}); model {args.model}, "
              f"rounds of {args.round_kib} KiB, depth {args.depth}, {args.rollout_procs} procs "
              f"per rollout node, {args.updates} updates per run (figures: the last update)",
              flush=True)
        for sweep, x, tspec, rspec in configs(args.rollout_procs):
            if args.points and f"{sweep}={x}" not in args.points:
                continue
            res = run_config(cluster.addresses, tspec, rspec, args)
            ideal, wb = res["ideal"], res["weightbridge"][0].timing
            wb_row: dict = {}  # weightbridge's row, the first
            for mech in args.mechanisms:
                if mech in PLAIN_TCP:
                    _print_plain_tcp(sweep, x, mech, res[mech], ideal, wb_row, rows)
                    continue
                report, agst = res[mech]
                t = report.timing
                rows.append({"sweep": sweep, "x": x, "trainer": tspec, "rollout": rspec,
                             "mechanism": mech, "ewtt_s": round(t.ewtt_s, 4),
                             "agst_s": round(agst, 4), "ideal_s": round(ideal, 4),
                             "ewtt_over_ideal": round(t.ewtt_s / ideal, 3),
                             "speedup_of_weightbridge": round(t.ewtt_s / wb.ewtt_s, 2),
                             "rdma_mb": round(report.rdma_bytes / 1e6, 2),
                             "depth": args.depth, "rollout_procs": args.rollout_procs,
                             "links": "fifo" if args.fifo_links else "control priority",
                             "transport": TRANSPORTS.get(mech, "monarch rdma")})
                if mech == "weightbridge":
                    wb_row = rows[-1]
                ring = res["ring-broadcast"][1] if "ring-broadcast" in res else None
                vs_ring = f"  AGST/ring {agst / ring:.2f}" if ring else ""
                if mech in res["messages"]:
                    vs_ring += (f"  controller messages/round "
                                f"{res['messages'][mech]:.1f}")
                print(f"[{sweep}={x}] {LABELS.get(mech, mech):<20} EWTT {t.ewtt_s:.3f}s  "
                      f"AGST {agst:.3f}s  ideal {ideal:.3f}s  EWTT/ideal {t.ewtt_s / ideal:.2f}"
                      f"  vs WeightBridge {t.ewtt_s / wb.ewtt_s:.2f}x{vs_ring}  "
                      f"({report.rdma_bytes / 1e6:.1f} MB over "
                      f"{TRANSPORTS.get(mech, 'RDMA')}, bit-exact)", flush=True)
            if sweep == "replicas" and x == 4:
                path = OUT / "trace_weightbridge_4replicas.json"
                path.write_text(json.dumps(chrome_trace(wb, label="WeightBridge, 4 replicas")))
            # The timeline reads the trainers' writes as one link's: true where every trainer
            # is on one node (at 2 and 4 trainer nodes the rollouts' links bound the update,
            # and the trainers wait on them by design).
            for mech in ("weightbridge", ROUNDS):
                if mech not in res or (sweep == "trainer nodes" and x > 1):
                    continue
                tl = write_timeline(res[mech][0].timing, args.depth)
                print(f"[{sweep}={x}] {mech} timeline: trainers' writes {tl.writes_s:.3f}s "
                      f"(ideal {ideal:.3f}s), the link idle {tl.idle_s:.3f}s of it "
                      f"({tl.buffer_wait_s:.3f}s before round r-{args.depth} had landed, "
                      f"{tl.idle_s - tl.buffer_wait_s:.3f}s from then to the next write); "
                      f"after the last write {tl.drain_s:.3f}s (forwards, assembly)",
                      flush=True)
    with open(OUT / "bench_cluster.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    plot(rows, OUT / "bench_cluster.png", args.link_mbit, args.mechanisms, args.model)
    print(f"wrote {OUT}/bench_cluster.csv, bench_cluster.png, trace_weightbridge_4replicas.json "
          f"in {time.perf_counter() - t0:.0f}s")
    return 0


def _print_plain_tcp(sweep, x, mech: str, measured: tuple[float, int], ideal: float,
                     wb_row: dict, rows) -> None:
    seconds, nbytes = measured
    rows.append({**wb_row, "mechanism": mech, "ewtt_s": round(seconds, 4), "agst_s": "",
                 "ewtt_over_ideal": round(seconds / ideal, 3),
                 "speedup_of_weightbridge": round(seconds / wb_row["ewtt_s"], 2),
                 "rdma_mb": round(nbytes / 1e6, 2), "transport": "plain TCP"})
    print(f"[{sweep}={x}] {mech:<20} time {seconds:.3f}s  ideal {ideal:.3f}s  "
          f"time/ideal {seconds / ideal:.2f}  vs WeightBridge {seconds / wb_row['ewtt_s']:.2f}x"
          f"  ({nbytes / 1e6:.1f} MB of {PLAIN_TCP[mech]} between hosts over plain TCP, "
          f"no rounds; median of {PLAIN_TCP_RUNS})", flush=True)


def plot(rows, path: Path, mbit: float, mechanisms, model: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, sweep in zip(axes, ("replicas", "trainer nodes")):
        sub = [r for r in rows if r["sweep"] == sweep]
        xs = sorted({r["x"] for r in sub})
        for mech in mechanisms:
            ax.plot(xs, [next(r["ewtt_s"] for r in sub if r["x"] == x and r["mechanism"] == mech)
                         for x in xs], marker="o", label=mech)
        ax.plot(xs, [next(r["ideal_s"] for r in sub if r["x"] == x) for x in xs], "k--",
                label="ideal (Eq. 1)")
        ax.set_xlabel("rollout replicas (1 trainer node)" if sweep == "replicas" else
                      "trainer nodes (4 rollout nodes)")
        ax.set_xticks(xs)
        ax.set_ylabel("EWTT (s)")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"Emulated cluster, {mbit:g} Mbit/s host links, {model} model")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
