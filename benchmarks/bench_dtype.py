"""fp32 trainers, bf16 rollouts: bytes moved and time per update, converted in the plan vs the
two ways around it, all measured in the same run on the same layout.

- ``converted``: the trainers hold and write fp32; the rollouts' loaders cast to bf16; the plan
  sends bf16 and the trainers' pack converts (one pack call per round).
- ``send-fp32``: the source dtype on the wire (what the rollouts would receive if they kept the
  trainer's dtype: fp32 rollout parameters), the baseline for bytes.
- ``bf16-copy``: the workaround before the plan converted: each trainer keeps a bf16 copy of
  its shard (refreshed by a cast every update, counted in the time) and declares a bf16
  checkpoint spec; bytes as converted, plus the copy's memory and cast.

A second table, bf16 trainers and block-scaled FP8 rollouts (`meshes.fp8_rollout`, attention
projections and experts in ``--fp8-block`` blocks):

- ``send-bf16``: bf16 rollouts, the source dtype on the wire (the baseline);
- ``fp8-block``: the rollouts' loaders quantize; the plan sends float8 values and float32
  scales, quantized in the trainers' pack.

Runs in one process (`run_plan_locally`, `CpuCopyKernels`; the bytes are the plan's writes, the
same a mesh moves). Every update is checked bit-exact against the rollouts' own loaders first.

    PYTHONPATH=. python benchmarks/bench_dtype.py --size medium --updates 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from meshes.fp8_rollout import Fp8RolloutShard
from meshes.qwen3_moe import SIZES, RolloutShard, TrainerShard, checkpoint_spec
from weightbridge import (CpuCopyKernels, Placement, extract_source_map, plan_transfer,
                          run_plan_locally)


def _setup(config, trainer_dtype, rollout_dtype, ckpt_dtype, args, fp8_block=None):
    spec = checkpoint_spec(config, str(ckpt_dtype).removeprefix("torch."))
    trainers = [TrainerShard(config, args.tp, r % args.tp, args.ep, r // args.tp,
                             dtype=trainer_dtype) for r in range(args.tp * args.ep)]
    rollouts = [RolloutShard(config, args.rollout_tp, r, 1, 0, dtype=rollout_dtype)
                if fp8_block is None else
                Fp8RolloutShard(config, args.rollout_tp, r, 1, 0, block=fp8_block)
                for _ in range(args.engines) for r in range(args.rollout_tp)]
    tmaps = [extract_source_map(w.params, w.load_weights, spec) for w in trainers]
    rmaps = [extract_source_map(w.params, w.load_weights, spec) for w in rollouts]
    per = args.rollout_tp
    plan = plan_transfer([(m, Placement("t0")) for m in tmaps],
                         [(m, Placement(f"r{i // per}", engine=i // per))
                          for i, m in enumerate(rmaps)], round_bytes=args.round_bytes)
    return spec, trainers, rollouts, plan


def _checkpoint(spec, seed):
    gen = torch.Generator().manual_seed(seed)
    return {t.name: torch.randn(t.shape, generator=gen).to(getattr(torch, t.dtype))
            for t in spec.tensors}


def _check(rollouts, received, weights, label):
    for w, got in zip(rollouts, received):
        for p in w.params.values():
            p.zero_()
        w.load_weights(weights.items())
        for name, want in w.params.items():
            if not torch.equal(got[name].view(torch.uint8), want.view(torch.uint8)):
                raise SystemExit(f"{label}: {name} differs from the rollout's own loader")


def _run(label, config, args, trainer_dtype, rollout_dtype, *, bf16_copy=False):
    ckpt = torch.bfloat16 if bf16_copy else torch.float32
    spec, trainers, rollouts, plan = _setup(config, torch.bfloat16 if bf16_copy else trainer_dtype,
                                            rollout_dtype, ckpt, args)
    fp32_spec = checkpoint_spec(config, "float32")
    # The trainer's own fp32 weights (for bf16-copy: what it trains; the plan sees the copy).
    masters = [TrainerShard(config, args.tp, r % args.tp, args.ep, r // args.tp,
                            dtype=torch.float32) for r in range(args.tp * args.ep)]
    received = [{n: torch.zeros_like(p) for n, p in w.params.items()} for w in rollouts]
    kernels = CpuCopyKernels()
    times = []
    for u in range(args.updates + 1):  # update 0 warms up and is checked
        weights = _checkpoint(fp32_spec, seed=100 + u)
        for m in masters:
            m.load_weights(weights.items())
        if not bf16_copy:
            for w, m in zip(trainers, masters):
                for name, p in w.params.items():
                    p.copy_(m.params[name])
        t0 = time.perf_counter()
        if bf16_copy:  # the workaround's cast, every update, before the transfer
            for w, m in zip(trainers, masters):
                for name, p in w.params.items():
                    p.copy_(m.params[name])
        run_plan_locally(plan, [w.params for w in trainers], received, kernels=kernels)
        times.append(time.perf_counter() - t0)
        if u == 0:
            _check(rollouts, received, weights, label)
    moved = sum(t.nbytes for r in plan.rounds for t in r.transfers)
    extra = (sum(p.numel() * 2 for w in trainers for p in w.params.values()) if bf16_copy
             else 0)
    return label, moved, statistics.median(times[1:]), plan.num_rounds, extra


def _run_bf16(label, config, args, fp8_block):
    """bf16 trainers and checkpoint; bf16 rollouts, or fp8 ones quantizing in ``fp8_block``."""
    spec, trainers, rollouts, plan = _setup(config, torch.bfloat16, torch.bfloat16,
                                            torch.bfloat16, args, fp8_block)
    received = [{n: torch.zeros_like(p) for n, p in w.params.items()} for w in rollouts]
    kernels = CpuCopyKernels()
    times = []
    for u in range(args.updates + 1):  # update 0 warms up and is checked
        weights = _checkpoint(spec, seed=200 + u)
        for w in trainers:
            w.load_weights(weights.items())
        t0 = time.perf_counter()
        run_plan_locally(plan, [w.params for w in trainers], received, kernels=kernels)
        times.append(time.perf_counter() - t0)
        if u == 0:
            _check(rollouts, received, weights, label)
    moved = sum(t.nbytes for r in plan.rounds for t in r.transfers)
    quantized = [o for o in plan.correspondence.overlaps if o.block]
    as_bf16 = 2 * sum(o.region.numel for o in quantized if o.dtype == "float8_e4m3fn")
    return (label, moved, statistics.median(times[1:]), plan.num_rounds,
            (sum(o.nbytes for o in quantized), as_bf16))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="medium", choices=sorted(SIZES))
    ap.add_argument("--updates", type=int, default=5)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--rollout-tp", type=int, default=2)
    ap.add_argument("--round-bytes", type=int, default=4 << 20)
    ap.add_argument("--fp8-block", type=int, default=32,
                    help="FP8 block edge (the rollouts' TP shards must be multiples of it)")
    args = ap.parse_args()
    config = SIZES[args.size]
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows = [_run("send-fp32", config, args, torch.float32, torch.float32),
            _run("converted", config, args, torch.float32, torch.bfloat16),
            _run("bf16-copy", config, args, torch.float32, torch.bfloat16, bf16_copy=True)]
    base_bytes, base_time = rows[0][1], rows[0][2]
    print(f"bench_dtype: {args.size} model, trainers TP{args.tp} x EP{args.ep} fp32, "
          f"{args.engines} x TP{args.rollout_tp} bf16 engines, rounds of "
          f"{args.round_bytes / 2**20:g} MiB, median of {args.updates} updates (bit-exact checked)")
    for label, moved, t, rounds, extra in rows:
        print(f"  {label:9s}: {moved / 1e6:8.2f} MB moved ({moved / base_bytes:.2f}x send-fp32), "
              f"{rounds:3d} rounds, {t * 1e3:8.1f} ms/update ({t / base_time:.2f}x send-fp32)"
              + (f", +{extra / 1e6:.2f} MB trainer bf16 copy" if extra else ""))
    fp8_main(args, config)


def fp8_main(args, config) -> None:
    block = (args.fp8_block, args.fp8_block)
    rows = [_run_bf16("send-bf16", config, args, None),
            _run_bf16("fp8-block", config, args, block)]
    base_bytes, base_time = rows[0][1], rows[0][2]
    print(f"bench_dtype fp8: {args.size} model, trainers TP{args.tp} x EP{args.ep} bf16, "
          f"{args.engines} x TP{args.rollout_tp} engines (fp8-block: attention and experts in "
          f"{block[0]}x{block[1]} blocks), median of {args.updates} updates (bit-exact checked)")
    for label, moved, t, rounds, (fp8, as_bf16) in rows:
        print(f"  {label:9s}: {moved / 1e6:8.2f} MB moved ({moved / base_bytes:.2f}x send-bf16), "
              f"{rounds:3d} rounds, {t * 1e3:8.1f} ms/update ({t / base_time:.2f}x send-bf16)"
              + (f"; its quantized tensors: {fp8 / 1e6:.2f} MB of fp8 values and scales for "
                 f"{as_bf16 / 1e6:.2f} MB of bf16 ({fp8 / as_bf16:.2f}x)" if as_bf16 else ""))


if __name__ == "__main__":
    main()
