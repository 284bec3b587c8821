"""GRPO on Monarch: two FSDP2 trainer procs train a tiny Qwen3 policy (fp32) on a toy task; a
generating vLLM engine of TP 2 (two procs) samples the rollouts; after every optimizer step
WeightBridge moves the new weights into the engine's live parameters.

    bash scripts/dev.sh grpo                            # sync, then async: 30 steps each
    .venv/bin/python -m examples.grpo --modes async     # one mode

Prints one line per step (``step N reward R sync S ms of step T ms``: S is the trainers' time
in ``send_weights``, T the whole step), checks at the first and the last step that the engine
is bit-identical to a fresh vLLM engine that loaded the trainers' weights from disk (parameter
bytes on every rank, greedy tokens and top-5 logprobs), writes the reward and the sync share
per step as a PNG, and ends with ``reward A -> B`` (mean of the first and the last 5 steps).
Version 1 is the starting weights, which the trainers load right after connect (the probe
leaves test values in every parameter, and the trainers keep no copy by default) and send at
once, so the engine has them too; step N sends version N+1. Sync: step N samples with version N.
Async: the trainers stage their version and go on; the engine polls before each generation
and switches once a version has landed, so it may sample with an older one (the line says
which).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from examples.engines import generating, models
from examples.engines.actors import close_all
from examples.engines.transfer import free_ports
from examples.grpo import plot, task
from examples.grpo.trainer import MODEL, GrpoTrainer, fp32_spec

TRAINERS, ENGINE_TP = 2, 2
TIMEOUT_S = 120.0
WINDOW = 5  # steps averaged at each end of the reward line


def check_engine(rollouts, trainers, rprocs_factory, step: int) -> tuple[bool, str]:
    """Compare the engine with a fresh one that loaded the trainers' weights from disk."""
    with tempfile.TemporaryDirectory(prefix=f"grpo-v{step}-") as d:
        trainers.save.call(d).get()
        fresh_procs = rprocs_factory()
        try:
            fresh = fresh_procs.spawn("fresh", generating.GeneratingRollout, MODEL, d,
                                      ENGINE_TP, free_ports(1))
            try:
                fresh.setup.call().get()
                live_bits = list(rollouts.digest.call().get().values())
                fresh_bits = list(fresh.digest.call().get().values())
                args = (generating.PROMPTS, generating.MAX_TOKENS, generating.TOP_K)
                live_gen = list(rollouts.generate.call(*args).get().values())[0]
                fresh_gen = list(fresh.generate.call(*args).get().values())[0]
            finally:
                try:
                    fresh.close.call().get(timeout=60)
                finally:
                    fresh.stop().get(timeout=60)
        finally:
            fresh_procs.stop().get(timeout=60)
    differ = sorted(n for live, new in zip(live_bits, fresh_bits) for n in live
                    if live[n] != new[n])
    if differ or live_gen != fresh_gen:
        return False, (f"step {step}: MISMATCH against a fresh engine: parameters {differ[:4]}"
                       f"{'' if live_gen == fresh_gen else ', generations differ'}")
    count = sum(len(b) for b in live_bits)
    return True, (f"step {step}: bit-identical to a fresh vLLM engine loaded from the trainers' "
                  f"weights ({count} parameter tensors on {ENGINE_TP} ranks; greedy tokens and "
                  f"top-{generating.TOP_K} logprobs of {len(generating.PROMPTS)} prompts)")


def train(args, mode: str) -> int:
    """One GRPO run in ``mode``; 1 if a bit-identity check failed."""
    from monarch.actor import this_host

    from weightbridge import TransferConfig, TransferGroup
    from weightbridge.mesh.transport import configure_transport

    staged = mode == "async"
    # One line per step: vLLM's info and warnings (start-up, a chat-template warm-up that needs
    # a tokenizer) would bury them. The procs inherit it; VLLM_LOGGING_LEVEL=INFO shows them.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    config = TransferConfig(timeout_s=TIMEOUT_S, sender_staging=staged, receiver_staging=staged)
    configure_transport()
    host = this_host()
    began = time.monotonic()
    start_dir = tempfile.TemporaryDirectory(prefix="grpo-v0-")
    models.write_checkpoint_dir(MODEL, models.checkpoint(MODEL, 0), start_dir.name)
    tprocs = host.spawn_procs(per_host={"worker": TRAINERS}, name="grpo-trainer")
    rprocs = host.spawn_procs(per_host={"worker": ENGINE_TP}, name="grpo-vllm")
    group = TransferGroup.spawn(tprocs, rprocs, engine_size=ENGINE_TP, config=config)
    meshes, ok = [], True
    try:
        trainer_port, engine_port = free_ports(2)
        trainers = tprocs.spawn("policy", GrpoTrainer, trainer_port, args.lr)
        meshes.append(trainers)
        rollouts = rprocs.spawn("vllm", generating.GeneratingRollout, MODEL, start_dir.name,
                                ENGINE_TP, [engine_port], fp32_spec())
        meshes.append(rollouts)
        for f in [trainers.setup.call(group), rollouts.setup.call(group)]:
            f.get()
        trainers.connect.call().get()
        # The probe leaves the engine's parameters holding its test values: the trainers'
        # starting weights go out as version 1 before the first generation.
        served = rollouts.serve.call(1, TIMEOUT_S)
        trainers.send.call(1).get()
        served.get()
        print(f"[{mode}] {TRAINERS} FSDP2 trainers (fp32) -> 1 vLLM engine of TP "
              f"{ENGINE_TP} (bf16); connected in {time.monotonic() - began:.0f}s", flush=True)
        rewards, shares = [], []
        for step in range(1, args.steps + 1):
            t0 = time.monotonic()
            prompts = [p for p in task.prompts(step, args.prompts) for _ in range(args.samples)]
            seeds = [step * 100_000 + i for i in range(len(prompts))]
            version, completions = list(rollouts.sample.call(
                prompts, task.COMPLETION_LEN, seeds, staged).get().values())[0]
            r = torch.tensor([task.reward(c) for c in completions]).view(args.prompts,
                                                                          args.samples)
            adv = task.advantages(r).flatten().tolist()
            tokens = [p + c for p, c in zip(prompts, completions)]
            served = None if staged else rollouts.serve.call(step + 1, TIMEOUT_S)
            sent = trainers.train_and_send.call(tokens, adv, task.PROMPT_LEN, step + 1).get()
            if served is not None:
                served.get()
            step_s = time.monotonic() - t0
            sync_s = max(s for _, s in sent.values())
            rewards.append(float(r.mean()))
            shares.append(sync_s / step_s)
            lag = f" (sampled with v{version})" if staged else ""
            print(f"step {step} reward {rewards[-1]:.3f} sync {sync_s * 1e3:.0f} ms of step "
                  f"{step_s * 1e3:.0f} ms{lag}", flush=True)
            if step in (1, args.steps):
                if staged:
                    trainers.wait_sent.call().get()
                    rollouts.serve.call(step + 1, TIMEOUT_S).get()
                good, line = check_engine(rollouts, trainers, lambda: host.spawn_procs(
                    per_host={"worker": ENGINE_TP}, name="grpo-fresh"), step)
                ok &= good
                print(line, flush=True)
        png = plot.write_png(Path(args.out) / f"grpo-{mode}.png", rewards, shares,
                             f"GRPO, {mode} mode")
        n = min(WINDOW, len(rewards))
        print(f"sync {100 * sum(shares) / len(shares):.1f}% of a step on average; picture: "
              f"{png}", flush=True)
        print(f"reward {sum(rewards[:n]) / n:.2f} -> {sum(rewards[-n:]) / n:.2f} "
              f"(mean of the first and last {n} steps; {time.monotonic() - began:.0f}s)")
        return 0 if ok else 1
    finally:
        try:
            close_all(group, meshes)
        finally:
            rprocs.stop().get(timeout=60)
            tprocs.stop().get(timeout=60)
            start_dir.cleanup()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", nargs="+", default=["sync", "async"], choices=("sync", "async"),
                    help="run these sync modes one after the other (default: both)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per step")
    ap.add_argument("--samples", type=int, default=8, help="samples per prompt (a group)")
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--out", default="out/grpo", help="where the PNG goes")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.prompts < 1 or args.samples < 2:
        raise SystemExit("--steps and --prompts must be >= 1 and --samples >= 2 (a group)")
    failed = 0
    for mode in args.modes:
        failed |= train(args, mode)
    return failed


if __name__ == "__main__":
    sys.exit(main())
