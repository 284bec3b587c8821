"""Delta updates: bytes moved and transfer time when only a tenth of the model changes.

    .venv/bin/python benchmarks/bench_delta.py                 # "medium" model
    .venv/bin/python benchmarks/bench_delta.py --model tiny --share 0.1

One pair of proc meshes on this host (trainer TP2 x EP2 -> two TP2 engines, the controller
path): a full update, then ``--updates`` delta updates (``MeshTransfer.update(v, changed=...)``)
of the checkpoint tensors that make up about ``--share`` of the bytes (whole layers' experts,
taken in checkpoint order: a fine-tuned block, say), then as many full updates again, in the
same run. Every update is verified bit-exact on every rollout against its own load_weights of
what each tensor holds. Prints the median bytes moved and transfer time of each kind and the
ratios delta / full; the first delta update (which re-plans) is reported on its own.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from monarch.actor import this_host

from controller.driver import MeshTransfer
from meshes.qwen3_moe import SIZES, checkpoint_spec
from meshes.spec import RolloutSpec, TrainerSpec
from weightbridge import TransferConfig
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
    args = parser.parse_args()
    if not 0 < args.share < 1 or args.updates < 1 or args.round_kib < 1:
        parser.error("--share must be in (0, 1), --updates and --round-kib at least 1")
    changed, share = changed_tensors(args.model, args.share)
    configure_transport()
    host = this_host()
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
    med = {k: (statistics.median(r.rdma_bytes for r in rs),
               statistics.median(r.transfer_s for r in rs)) for k, rs in reports.items() if rs}
    for kind, (nbytes, secs) in med.items():
        print(f"  {kind:<12} {nbytes / 1e6:8.2f} MB moved ({nbytes / med['full'][0]:.3f}x full)"
              f"  transfer {secs * 1e3:8.1f} ms ({secs / med['full'][1]:.2f}x full)"
              f"  [{len(reports[kind])} update{'s' if len(reports[kind]) > 1 else ''}]")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
