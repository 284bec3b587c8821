"""The main job: one Monarch controller moves weights from a trainer mesh to a rollout mesh.

    bash scripts/dev.sh run                                    # default mesh run (below)
    python -m controller --trainer "nodes=1,gpus=4,tp=2,ep=2" \
        --rollout "engines=2,nodes=1,gpus=2,tp=2" --updates 3 --model tiny
    python -m controller --updates 2 --trace /tmp/update.json  # + timeline of the last update
    python -m controller --workers my_pkg.models:factory ...   # any model: a worker factory
    python -m controller --local                               # in-process demo, no meshes
    python -m controller --attach-trainers tls://t0:4444 \
        --attach-rollouts tls://r0:4444,tls://r1:4444 --tls-dir certs ...  # workers on other hosts
    python -m controller --cluster --tls-dir certs              # an emulated cluster (root)

The mesh run spawns both meshes on this host, probes every rank's own load_weights, plans the
three-stage transfer on the controller, registers the rollouts' round buffers for RDMA once, then
per update runs a stand-in train step, moves every round (pack, RDMA writes, forwards, assemble)
and checks every rollout parameter by checksum against its own load_weights of that version.
Multi-host runs (``--attach-*``, ``--cluster``) are mutual TLS unless told ``--insecure``
(controller/security.py). See docs/controller.md.

``--local`` runs the same discover/plan/transfer/verify pipeline in one process: the four ranks
of a Megatron-like trainer (TP2 x EP2) and the four ranks of two TP2 rollout engines, moved by
`run_plan_locally`.

Bad input (a flag out of range, a spec that does not fit, a flag the chosen run would ignore)
is refused by `controller.cli.validate` before anything spawns: one ``error: ...`` line on stderr,
exit 2.
Exit 1 means the weights did not match; 3 that workers were lost mid-run (each loss is printed,
and the remaining updates went to the surviving engines, verified).
"""

from __future__ import annotations

import os
import sys
import time

import torch

from controller.cli import BAD_INPUT, WORKERS_LOST, Run, build_parser, refuse, validate
from controller.security import insecure_warning
from meshes.qwen3_moe import SIZES, RolloutShard, TrainerShard, checkpoint_spec
from weightbridge import (ConfigMismatch, CpuCopyKernels, LayoutError, Placement, TransferConfig,
                          WorkersLost, correspond, extract_source_map, plan_transfer,
                          run_plan_locally)
from weightbridge.driver import surfaced


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        run = validate(args)
    except ValueError as e:
        refuse(str(e))
    if args.cluster is not None:
        raise SystemExit(cluster_run(args, run))
    if args.local:
        local_demo(args, run.config)
    else:
        raise SystemExit(mesh_run(args, run))


# -- the runs -----------------------------------------------------------------------------------

def mesh_run(args, run: Run) -> int:
    """Spawn (or attach), connect, update ``--updates`` times; 1 when any weight mismatched."""
    from controller.launch import WorkerRefused

    if run.security is not None:  # before Monarch is imported: it reads its TLS files once
        os.environ.update(run.security.env)
        if run.security.insecure:
            print(insecure_warning("controller"), file=sys.stderr, flush=True)
    from controller.driver import MeshTransfer  # imports monarch: only for the mesh run

    trainer, rollout, config, workers = run.trainer, run.rollout, run.config, run.workers
    procs, owners = None, ()
    if run.addresses is not None:
        try:
            owners, procs = attach(run.addresses, trainer, rollout, run.security)
        except (ValueError, WorkerRefused) as e:
            print(f"error: {e}", file=sys.stderr)
            return BAD_INPUT
    print(f"workers {workers}: trainer [{args.trainer}] {trainer.num_workers} procs, rollout "
          f"[{args.rollout}] {rollout.num_workers} procs; {config}", flush=True)
    failed = lost = False
    t_stop = None
    rate = args.link_mbit * 1e6 / 8 if getattr(args, "link_mbit", None) else None
    mt = MeshTransfer(trainer, rollout, workers, config=config, procs=procs, link_rate=rate)
    try:
        with mt:
            print(f"spawned meshes and actors in {mt.spawn_s:.2f}s", flush=True)
            t0 = time.perf_counter()
            try:
                with surfaced():  # a worker's own error, not Monarch's wrapper
                    mt.connect()
            except (LayoutError, ConfigMismatch) as e:
                print(f"error: {e}", file=sys.stderr)
                return BAD_INPUT
            print(f"connect {time.perf_counter() - t0:.2f}s: {mt.connect_steps}, link probe "
                  f"{mt.link_probe_s:.2f}s; {mt.num_handles} RDMA buffers registered, backend "
                  f"{mt.backend}")
            print(mt.summary(), flush=True)
            report = None
            for version in range(1, args.updates + 1):
                try:
                    report, bad = one_update(mt, version)
                except WorkersLost as e:  # left out; the group goes on with the others
                    print(f"update {version}: {e}", file=sys.stderr, flush=True)
                    report, bad = after_loss(mt)
                    lost = True
                failed |= bad
            if args.trace and report is not None:
                write_trace(args.trace, report.timing, label=f"update {report.version}")
                print(f"wrote the trace of update {report.version} to {args.trace}")
            t_stop = time.perf_counter()
    finally:
        for mesh in owners:  # attached procs are ours to stop; the workers keep running
            mesh.stop().get(timeout=60)
        if t_stop is not None:
            print(f"stopped meshes in {time.perf_counter() - t_stop:.2f}s")
    return 1 if failed else WORKERS_LOST if lost else 0


def one_update(mt, version: int):
    """Update ``version`` as a generation loop would take it; (its last report, mismatched)."""
    with surfaced():
        report = mt.update(version)
    print(report.line(), flush=True)
    if mt.mode.sends_staged_copy:  # the rounds streamed while update() had returned
        report = mt.wait()
        print(f"  streamed: {report.line()}", flush=True)
    return report, bool(report.mismatched) | _install(mt)


def _install(mt) -> bool:
    """`poll_requests` between generation steps (RS, async: it installs; its line printed);
    whether anything installed mismatched."""
    installed = mt.poll_requests()
    if installed is None or not mt.mode.lands_in_staging:
        return False
    print(f"  {installed.line()}", flush=True)
    return bool(installed.mismatched)


def after_loss(mt):
    """After a `WorkersLost`: the re-send of that version to the surviving engines (sync, RS;
    RS: installed here), or nothing (SS, async: the next update reaches them);
    (its report or None, mismatched)."""
    report = mt.wait()
    if report is None:
        return None, False
    print(f"  re-sent: {report.line()}", flush=True)
    return report, bool(report.mismatched) | (mt.mode.lands_in_staging and _install(mt))


def cluster_run(args, run: Run) -> int:
    """`mesh_run` on an emulated cluster: trainer nodes on the first hosts, then the rollout
    nodes engine by engine; the cluster is torn down on exit, errors and Ctrl-C."""
    import signal

    from controller.cluster import TRANSPORT_ENV, ClusterError, EmulatedCluster

    trainer = run.trainer
    hosts = trainer.nodes + run.rollout.engines * run.rollout.nodes  # validated: --cluster N
    args.link_mbit = args.link_mbit or 400.0
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        with EmulatedCluster(hosts, link_mbit=args.link_mbit, tls_dir=args.tls_dir,
                             insecure=args.insecure) as cluster:
            os.environ[TRANSPORT_ENV] = cluster.controller_transport  # before monarch starts
            addrs = cluster.addresses
            addresses = (addrs[:trainer.nodes], addrs[trainer.nodes:])
            print(f"emulated cluster: {hosts} hosts, {args.link_mbit:g} Mbit/s links "
                  f"(trainers {','.join(addresses[0])}; rollouts {','.join(addresses[1])})",
                  flush=True)
            return mesh_run(args, run._replace(addresses=addresses))
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        return BAD_INPUT


def attach(addresses: tuple[list[str], list[str]], trainer, rollout, security
           ) -> tuple[tuple, tuple]:
    """Proc meshes on remote Monarch workers, one address per node of each spec (checked by
    `attach_addresses`): ((trainer owner, rollout owner), (trainer workers, rollout workers))."""
    from controller.launch import attach_procs, check_workers

    t_addrs, r_addrs = addresses
    check_workers(t_addrs + r_addrs, security)  # every worker, before any proc spawns
    t_owner, tp = attach_procs(t_addrs, gpus=trainer.gpus, name="trainer", security=security,
                               probe=False)
    try:
        r_owner, rp = attach_procs(r_addrs, gpus=rollout.gpus, name="rollout",
                                   security=security, probe=False)
    except BaseException:
        t_owner.stop().get(timeout=60)
        raise
    return (t_owner, r_owner), (tp, rp)


def write_trace(path: str, timing, *, label: str) -> None:
    """Chrome trace JSON of one update (see controller/timing.py)."""
    import json

    from controller.timing import chrome_trace

    with open(path, "w") as f:
        json.dump(chrome_trace(timing, label=label), f)


def local_demo(args, transfer: TransferConfig) -> None:
    """Discover, plan, transfer (in one process) and verify, on fixed layouts, with the rounds
    of ``transfer`` (the flags' config: TransferConfig's default round unless --round-kib)."""
    config = SIZES[args.model]
    spec = checkpoint_spec(config)
    print(f"checkpoint: {len(spec)} tensors, {spec.numel:,} elements ({args.model} Qwen3-MoE)")
    workers = [(f"trainer tp{t} ep{e}", TrainerShard(config, 2, t, 2, e))
               for e in range(2) for t in range(2)]
    workers += [(f"rollout engine{g} tp{t}", RolloutShard(config, 2, t, 1, 0))
                for g in range(2) for t in range(2)]
    maps = []
    for label, worker in workers:
        t0 = time.perf_counter()
        maps.append(extract_source_map(worker.params, worker.load_weights, spec))
        print(f"{label:<22} {time.perf_counter() - t0:6.2f}s  {maps[-1].summary()}")

    corr = correspond(maps[:4], maps[4:])
    print(f"correspondence: {len(corr.overlaps)} overlaps, {corr.nbytes / 2**20:.2f} MiB of "
          f"unique needed weights")
    plan = plan_transfer([(m, Placement("trainer-node")) for m in maps[:4]],
                         [(m, Placement(f"rollout-node{i // 2}", engine=i // 2))
                          for i, m in enumerate(maps[4:])],
                         round_bytes=transfer.round_bytes)
    print(plan.summary())

    gen = torch.Generator().manual_seed(0)
    weights = {t.name: torch.randn(t.shape, generator=gen).bfloat16() for t in spec.tensors}
    for _, trainer in workers[:4]:
        trainer.load_weights(weights.items())
    received = [{n: torch.zeros_like(p) for n, p in w.params.items()} for _, w in workers[4:]]
    t0 = time.perf_counter()
    run_plan_locally(plan, [w.params for _, w in workers[:4]], received, kernels=CpuCopyKernels(),
                     depth=transfer.depth)
    elapsed = time.perf_counter() - t0
    mismatched = []
    for (label, rollout), got in zip(workers[4:], received):
        rollout.load_weights(weights.items())
        mismatched += [f"{label}: {n}" for n, want in rollout.params.items()
                       if not torch.equal(got[n].view(torch.uint8), want.view(torch.uint8))]
    print(f"transfer (in-process): {elapsed:.3f}s; verification: "
          + ("every rollout parameter is bit-identical to its own load_weights"
             if not mismatched else f"MISMATCH in {mismatched[:5]}"))
    if mismatched:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
