"""The main job. For now, in one process: discover, plan, transfer and verify on a toy MoE.

    bash scripts/dev.sh run                 # default: tiny model
    bash scripts/dev.sh run --model small   # ~200M elements

It builds the four ranks of a Megatron-like trainer (TP2 x EP2) and the four ranks of two
rollout engines (TP2 each, fused qkv / stacked experts / padded vocabulary), probes every rank's
own load_weights, intersects the maps, plans the three-stage transfer, runs it in-process
(`run_plan_locally`, the same pack / write / assemble steps the mesh executor runs) and checks
every rollout parameter bit for bit against its own loader. The Monarch controller, with real
process meshes and RDMA writes, replaces this demo in a later issue.
"""

from __future__ import annotations

import argparse
import time

import torch

from meshes.qwen3_moe import SIZES, RolloutShard, TrainerShard, checkpoint_spec
from weightbridge import (CpuCopyKernels, Placement, correspond, extract_source_map,
                          plan_transfer, run_plan_locally)


def main() -> None:
    parser = argparse.ArgumentParser(description="WeightBridge in-process demo")
    parser.add_argument("--model", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--round-kib", type=int, default=256, help="bytes per round buffer")
    args = parser.parse_args()
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
                         round_bytes=args.round_kib << 10)
    print(plan.summary())

    gen = torch.Generator().manual_seed(0)
    weights = {t.name: torch.randn(t.shape, generator=gen).bfloat16() for t in spec.tensors}
    for _, trainer in workers[:4]:
        trainer.load_weights(weights.items())
    received = [{n: torch.zeros_like(p) for n, p in w.params.items()} for _, w in workers[4:]]
    t0 = time.perf_counter()
    run_plan_locally(plan, [w.params for _, w in workers[:4]], received, kernels=CpuCopyKernels())
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
