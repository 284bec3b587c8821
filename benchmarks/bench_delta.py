"""Delta updates: bytes moved and transfer time when only a tenth of the model changes.

    .venv/bin/python benchmarks/bench_delta.py                 # "medium" model
    .venv/bin/python benchmarks/bench_delta.py --model tiny --share 0.1
    .venv/bin/python benchmarks/bench_delta.py --path adapters --mode rs

Controller path (default): one pair of proc meshes on this host (trainer TP2 x EP2 -> two TP2
engines): a full update, then ``--updates`` delta updates (``MeshTransfer.update(v, changed=...)``)
of the checkpoint tensors that make up about ``--share`` of the bytes (whole layers' experts,
taken in checkpoint order: a fine-tuned block, say), then as many full updates again, in the
same run. Every update is verified bit-exact on every rollout against its own load_weights of
what each tensor holds. Prints the median bytes moved and transfer time of each kind and the
ratios delta / full; the first delta update (which re-plans) is reported on its own.

Adapters path (``--path adapters``): the user's own actors (`meshes.adapter_actors`, trainer
TP2 -> two TP2 engines) with a `SenderAdapter` / `ReceiverAdapter` each, in ``--mode`` sync or
rs: the same sequence through ``send_weights(v, changed=...)``. Bytes moved: the RDMA bytes of
the plan rank 0 used; time: how long ``send_weights`` took on the trainers (RS: until the
bytes landed in the rollouts' staging; sync: until every rollout installed them, which also
waits for their polls). Every rank then installs the version and checks it bit-exact against
its own load_weights of what the trainers held.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from monarch.actor import this_host

from controller.driver import MeshTransfer
from meshes.adapter_actors import RLRollout, RLTrainer
from meshes.qwen3_moe import SIZES, checkpoint_spec
from weightbridge.specs import RolloutSpec, TrainerSpec
from weightbridge import TransferConfig, TransferGroup
from weightbridge.mesh.transport import configure_transport


def changed_tensors(model: str, share: float) -> tuple[list[str], float]:
    """Expert tensors in checkpoint order until ``share`` of the bytes; (names, their share)."""
    tensors = checkpoint_spec(SIZES[model]).tensors
    total = sum(t.numel for t in tensors)
    names, size = [], 0
    for t in tensors:
        if ".mlp.experts." in t.name and size + t.numel <= share * total:
            names.append(t.name)
            size += t.numel
    return names, size / total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="medium", choices=sorted(SIZES))
    parser.add_argument("--share", type=float, default=0.10, help="share of bytes that change")
    parser.add_argument("--updates", type=int, default=4, help="delta (and full) updates")
    parser.add_argument("--round-kib", type=int, default=1024)
    parser.add_argument("--path", default="controller", choices=["controller", "adapters"])
    parser.add_argument("--mode", default="rs", choices=["sync", "rs"],
                        help="adapters path: sync or receiver staging (the modes of changed=)")
    args = parser.parse_args()
    if not 0 < args.share < 1 or args.updates < 1 or args.round_kib < 1:
        parser.error("--share must be in (0, 1), --updates and --round-kib at least 1")
    changed, share = changed_tensors(args.model, args.share)
    configure_transport()
    host = this_host()
    if args.path == "adapters":
        return adapters(args, changed, share, host)
    procs = (host.spawn_procs(per_host={"worker": 4}, name="trainer"),
             host.spawn_procs(per_host={"worker": 4}, name="rollout"))
    try:
        with MeshTransfer(TrainerSpec.parse("nodes=1,gpus=4,tp=2,ep=2"),
                          RolloutSpec.parse("engines=2,nodes=1,gpus=2,tp=2"), args.model,
                          config=TransferConfig(round_bytes=args.round_kib << 10),
                          procs=procs) as mt:
            mt.connect()
            reports = {"full": [mt.update(1)], "delta": [], "first delta": []}
            v = 1
            for kind in ("delta", "full"):
                for _ in range(args.updates):
                    v += 1
                    r = mt.update(v, changed=changed if kind == "delta" else None)
                    first = kind == "delta" and not reports["delta"] and not reports["first delta"]
                    reports["first delta" if first else kind].append(r)
    finally:
        for p in procs:
            p.stop().get(timeout=60)
    bad = [r for rs in reports.values() for r in rs if r.mismatched]
    print(f"{args.model} model, trainer TP2xEP2 -> 2 x TP2 engines, rounds of {args.round_kib} "
          f"KiB; changed: {len(changed)} expert tensors, {share:.1%} of the checkpoint's "
          f"elements; every update verified: {'MISMATCH' if bad else 'all bit-exact'}")
    _print({k: [(r.rdma_bytes, r.transfer_s) for r in rs] for k, rs in reports.items()})
    return 1 if bad else 0


def adapters(args, changed: list[str], share: float, host) -> int:
    """The same sequence through the adapters (see the module docstring)."""
    tp = host.spawn_procs(per_host={"worker": 2}, name="trainer")
    rp = host.spawn_procs(per_host={"worker": 4}, name="rollout")
    config = TransferConfig(receiver_staging=args.mode == "rs", round_bytes=args.round_kib << 10,
                            timeout_s=120)
    reports: dict[str, list[tuple[int, float]]] = {"full": [], "delta": [], "first delta": []}
    bad = []
    group = trainers = rollouts = None
    try:
        group = TransferGroup.spawn(tp, rp, engine_size=2, config=config)
        trainers = tp.spawn("trainer_bench", RLTrainer, args.model, 2)
        rollouts = rp.spawn("rollout_bench", RLRollout, args.model, 2)
        for f in [trainers.setup.call(group), rollouts.setup.call(group)]:
            f.get()
        trainers.connect.call().get()
        history: dict = {}
        kinds = ["full"] + ["delta"] * args.updates + ["full"] * args.updates
        for v, kind in enumerate(kinds, start=1):
            history[v] = None if kind == "full" else changed
            sent = (trainers.train_and_send.call(v) if kind == "full" else
                    trainers.train_and_send_delta.call(v, changed))
            installed = rollouts.wait_version.call(v, dict(history))
            secs = max(stall for _, (_, stall) in sent.get().items())
            bad += [(v, held) for _, held in installed.get().items() if held != (v, True)]
            nbytes = next(b for _, b in trainers.plan_bytes.call().get().items() if b is not None)
            first = kind == "delta" and not reports["delta"] and not reports["first delta"]
            reports["first delta" if first else kind].append((nbytes, secs))
    finally:  # the group's workers first (they hold the actors' parameters), then the meshes
        try:
            if group is not None:
                group.close()
        finally:
            for mesh in (trainers, rollouts, tp, rp):
                if mesh is not None:
                    mesh.stop().get(timeout=60)
    print(f"{args.model} model, adapters ({args.mode}), trainer TP2 -> 2 x TP2 engines, rounds "
          f"of {args.round_kib} KiB; changed: {len(changed)} expert tensors, {share:.1%} of the "
          f"checkpoint's elements; every install verified: "
          f"{f'MISMATCH {bad}' if bad else 'all bit-exact'}")
    _print(reports, "send_weights")
    return 1 if bad else 0


def _print(reports: dict[str, list[tuple[int, float]]], timed: str = "transfer") -> None:
    """Median bytes and seconds per kind of update, and their ratios to the full updates'."""
    med = {k: (statistics.median(b for b, _ in rs), statistics.median(s for _, s in rs))
           for k, rs in reports.items() if rs}
    for kind, (nbytes, secs) in med.items():
        print(f"  {kind:<12} {nbytes / 1e6:8.2f} MB moved ({nbytes / med['full'][0]:.3f}x full)"
              f"  {timed} {secs * 1e3:8.1f} ms ({secs / med['full'][1]:.2f}x full)"
              f"  [{len(reports[kind])} update{'s' if len(reports[kind]) > 1 else ''}]")


if __name__ == "__main__":
    sys.exit(main())
