"""Weights from a torchtitan trainer to vLLM engines, on Monarch meshes, checked bit for bit.

    python -m examples.engines.transfer --model qwen3_moe --trainer dp_shard=2,tp=2 \\
        --engines 2 --engine-tp 2 --expert-parallel --updates 2

The trainer mesh runs `TitanWorker` ranks (FSDP2 x TP x EP, one gloo group), the rollout mesh
runs ``--engines`` vLLM engines of ``--engine-tp`` ranks each (one gloo group per engine). After
``connect`` (every rank probes its own engine's loader; trainer 0 plans), each update loads a new
checkpoint into the trainer through torchtitan's HF path and sends it with ``send_weights`` in
sync mode; then every rollout rank compares its transferred parameters, bit for bit, with vLLM
loading the same checkpoint itself. Needs `bash scripts/dev.sh engines`.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
from dataclasses import dataclass

from examples.engines import models
from weightbridge.config import TransferConfig

TIMEOUT_S = 300.0


@dataclass(frozen=True)
class EnginesReport:
    """What one run did: the plan's accounting and, per update, the mismatches found."""

    plan_summary: str
    connect_s: float
    send_s: list[float]
    params_checked: int
    mismatched: list[list[str]]
    """Per update: ``rollout<rank>:<param>`` of every parameter that differs from vLLM's own
    load."""

    def lines(self) -> list[str]:
        out = [f"connect {self.connect_s:.1f}s (probe every rank's own loader, plan)",
               *self.plan_summary.splitlines()]
        for v, (s, bad) in enumerate(zip(self.send_s, self.mismatched), start=1):
            verdict = (f"all {self.params_checked} rollout parameters bit-identical to vLLM "
                       f"loading checkpoint v{v} itself" if not bad else
                       f"MISMATCH in {len(bad)} parameters: {bad[:4]}")
            out.append(f"update {v}: send_weights {s:.2f}s | {verdict}")
        return out


def parse_degrees(text: str) -> dict[str, int]:
    """``"dp_shard=2,tp=2"`` -> ``{"dp_shard": 2, "tp": 2}`` (TitanWorker's keywords)."""
    out = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in ("dp_shard", "tp", "ep") or not value.lstrip("-").isdigit():
            raise ValueError(f"bad trainer degree {item!r} in {text!r}; write e.g. "
                             f"'dp_shard=2,tp=2' or 'dp_shard=2,ep=2' (keys dp_shard, tp, ep)")
        out[key] = int(value)
    return out


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def run(procs, *, model: str, trainer: dict[str, int], engines: int, engine_tp: int,
        expert_parallel: bool, updates: int, round_bytes: int = 256 << 10) -> EnginesReport:
    """Spawn the actors on (trainer procs, rollout procs), connect, run ``updates`` updates,
    and stop the actors (the procs stay the caller's)."""
    from examples.engines.actors import EngineRollout, EngineTrainer, close_all
    from weightbridge.mesh.group import TransferGroup

    if model not in models.MODELS:
        raise ValueError(f"unknown model {model!r}; choose one of {models.MODELS}")
    tprocs, rprocs = procs
    num_rollouts = rprocs.size()
    if num_rollouts != engines * engine_tp:
        raise ValueError(f"{num_rollouts} rollout procs for {engines} engines of TP "
                         f"{engine_tp}; spawn engines * engine_tp procs")
    trainer_port, *engine_ports = free_ports(1 + engines)
    config = TransferConfig(timeout_s=TIMEOUT_S, round_bytes=round_bytes)
    group = TransferGroup.spawn(tprocs, rprocs, engine_size=engine_tp, config=config)
    meshes = []
    try:
        trainers = tprocs.spawn("titan", EngineTrainer, model, trainer, trainer_port)
        meshes.append(trainers)
        rollouts = rprocs.spawn("vllm", EngineRollout, model, engine_tp, expert_parallel,
                                engine_ports)
        meshes.append(rollouts)
        # Both sides at once, on the whole meshes: building an engine is collective over its
        # ranks, and each actor's rank in the group is its flat rank in its mesh.
        setups = [trainers.setup.call(group), rollouts.setup.call(group)]
        for f in setups:
            f.get()
        connect_s = max(trainers.connect.call().get().values())
        summary = next(s for s in trainers.plan_summary.call().get().values() if s is not None)
        send_s, mismatched, checked = [], [], 0
        for v in range(1, updates + 1):
            served = rollouts.serve.call(v, TIMEOUT_S)
            send_s.append(max(trainers.train_and_send.call(v).get().values()))
            served.get()
            bad, checked = [], 0
            for point, (n, names) in rollouts.check.call(v).get().items():
                checked += n
                bad += [f"rollout{point.rank}:{name}" for name in names]
            mismatched.append(bad)
        return EnginesReport(summary, connect_s, send_s, checked, mismatched)
    finally:
        close_all(group, meshes)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3_moe", choices=models.MODELS)
    ap.add_argument("--trainer", default="dp_shard=2,tp=2",
                    help="TitanWorker degrees over the trainer procs (default dp_shard=2,tp=2)")
    ap.add_argument("--trainers", type=int, default=4, help="trainer procs (default 4)")
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--engine-tp", type=int, default=2)
    ap.add_argument("--expert-parallel", action="store_true")
    ap.add_argument("--updates", type=int, default=2)
    args = ap.parse_args(argv)
    degrees = parse_degrees(args.trainer)

    from monarch.actor import this_host

    from weightbridge.mesh.transport import configure_transport
    configure_transport()
    host = this_host()
    start = time.monotonic()
    tprocs = host.spawn_procs(per_host={"worker": args.trainers}, name="titan")
    try:
        rprocs = host.spawn_procs(per_host={"worker": args.engines * args.engine_tp},
                                  name="vllm")
        try:
            report = run((tprocs, rprocs), model=args.model, trainer=degrees,
                         engines=args.engines, engine_tp=args.engine_tp,
                         expert_parallel=args.expert_parallel, updates=args.updates)
        finally:
            rprocs.stop().get(timeout=60)
    finally:
        tprocs.stop().get(timeout=60)
    print(f"[{args.model}: torchtitan {args.trainer} on {args.trainers} procs -> "
          f"{args.engines} x vLLM TP{args.engine_tp}{' EP' if args.expert_parallel else ''}]")
    for line in report.lines():
        print("  " + line)
    print(f"  total {time.monotonic() - start:.0f}s")
    return 0 if not any(report.mismatched) else 1


if __name__ == "__main__":
    sys.exit(main())
