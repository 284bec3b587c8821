"""The main job. For now: layout discovery on a toy MoE, printed as source-map summaries.

    bash scripts/dev.sh run                 # default: tiny model
    bash scripts/dev.sh run --model small   # ~200M elements

It builds the four ranks of a Megatron-like trainer (TP2 x EP2) and the four ranks of two
rollout engines (TP2 each, fused qkv / stacked experts / padded vocabulary), probes every rank's
own load_weights, and prints what each map says. The Monarch controller replaces this demo once
meshes and the transfer executor exist.
"""

from __future__ import annotations

import argparse
import time

from meshes.qwen3_moe import SIZES, RolloutShard, TrainerShard, checkpoint_spec
from weightbridge import extract_source_map


def main() -> None:
    parser = argparse.ArgumentParser(description="WeightBridge layout-discovery demo")
    parser.add_argument("--model", choices=sorted(SIZES), default="tiny")
    args = parser.parse_args()
    config = SIZES[args.model]
    spec = checkpoint_spec(config)
    print(f"checkpoint: {len(spec)} tensors, {spec.numel:,} elements ({args.model} Qwen3-MoE)")
    workers = [(f"trainer tp{t} ep{e}", TrainerShard(config, 2, t, 2, e))
               for e in range(2) for t in range(2)]
    workers += [(f"rollout engine{g} tp{t}", RolloutShard(config, 2, t, 1, 0))
                for g in range(2) for t in range(2)]
    for label, worker in workers:
        t0 = time.perf_counter()
        smap = extract_source_map(worker.params, worker.load_weights, spec)
        print(f"{label:<22} {time.perf_counter() - t0:6.2f}s  {smap.summary()}")


if __name__ == "__main__":
    main()
