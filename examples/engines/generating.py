"""Generating vLLM engines on a Monarch rollout mesh, updated in place by WeightBridge.

Two user actors, as docs/integration.md describes them:

- `CheckpointTrainer`: a trainer rank that holds a whole HF checkpoint as its parameters (the
  simplest trainer; its "training step" loads checkpoint ``version``).
- `GeneratingRollout`: one TP rank of a generating `vllm_engine.VllmEngine` per proc (TP 1:
  one proc per engine; TP 2: two), behind ``group.receiver`` with the engine's hooks
  (``before_update``: drop the prefix cache; ``after_update``: rebuild lm_head's handle).

`run` drives both from the controller: connect, then per version a training step,
``send_weights``, ``poll_requests`` on every rollout rank until installed, and a generation on
fixed prompts. `reference_rank` generates the same prompts with a fresh engine that loaded the
same checkpoint from disk (run it in fresh processes). tests/engines/test_vllm_generate.py
compares the two.

    python -m examples.engines.generating --tp 2 --mode rs    # what each version generated
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time

import torch
from monarch.actor import Actor, current_rank, endpoint

from examples.engines import models
from examples.engines.actors import check_engine_size, close_all

PROMPTS = ((2, 3, 4, 5), (9, 8, 7), (40, 41, 42, 43, 44, 45), (100,))
"""Fixed token-id prompts of every check."""
MAX_TOKENS, TOP_K = 8, 5
TIMEOUT_S = 300.0


class CheckpointTrainer(Actor):
    """A trainer rank whose parameters are a whole HF checkpoint of ``model`` (bf16)."""

    def __init__(self, model: str):
        torch.set_num_threads(1)
        self.model = model
        self.params = {n: t.clone() for n, t in models.checkpoint(model, 0).items()}

    def _load(self, weights) -> None:
        with torch.no_grad():
            for name, tensor in weights:
                self.params[name].copy_(tensor)

    @endpoint
    def setup(self, group) -> None:
        self.adapter = group.sender(self.params, self._load, models.checkpoint_spec(self.model))

    @endpoint
    def connect(self) -> None:
        self.adapter.connect()

    @endpoint
    def step_and_send(self, version: int) -> float:
        """The stand-in training step (load checkpoint ``version``), then send_weights;
        returns send_weights' seconds."""
        self._load(models.checkpoint(self.model, version).items())
        start = time.monotonic()
        self.adapter.send_weights(version)
        if self.adapter.config.sender_staging:
            self.adapter.wait_idle()
        return time.monotonic() - start

    @endpoint
    def close(self) -> None:
        """Nothing to release: the group's close() drops the adapter's buffers."""


class GeneratingRollout(Actor):
    """One TP rank of a generating vLLM engine; engine e's ranks rendezvous on ports[e].
    ``spec``: the checkpoint the trainers send (default: the model's bf16 checkpoint; an fp32
    trainer's is float32, which vLLM's loaders cast)."""

    def __init__(self, model: str, model_dir: str, tp: int, ports: list[int], spec=None):
        self.model, self.model_dir, self.tp, self.ports = model, model_dir, tp, ports
        self.spec = spec or models.checkpoint_spec(model)
        self.engine = None

    @endpoint
    def setup(self, group=None) -> None:
        """Build this rank of its engine from ``model_dir`` (collective over the engine: call
        on the whole mesh), then its receiver with the engine's hooks (none without a group:
        an engine that only loaded from disk)."""
        from examples.engines.vllm_engine import VllmEngine

        if group is None:
            self.engine = VllmEngine(self.model_dir, rank=current_rank().rank % self.tp,
                                     world_size=self.tp, master_port=self.ports[0])
            return
        check_engine_size(group, self.tp)
        engine, rank = divmod(current_rank().rank, self.tp)
        self.engine = VllmEngine(self.model_dir, rank=rank, world_size=self.tp,
                                 master_port=self.ports[engine])
        self.adapter = group.receiver(self.engine.params, self.engine.load_weights, self.spec,
                                      before_update_hook=self.engine.before_update,
                                      after_update_hook=self.engine.after_update)

    @endpoint
    def serve(self, version: int, timeout_s: float) -> int:
        """poll_requests() (between generation steps, in a real loop) until ``version`` is
        installed; returns the version installed."""
        return self.adapter.wait_for_version(version, timeout_s=timeout_s)

    @endpoint
    def generate(self, prompts, max_tokens: int, top_k: int):
        """Greedy generation with the top-k logprobs at each position."""
        return self.engine.generate(prompts, max_tokens=max_tokens, logprobs=top_k)

    @endpoint
    def sample(self, prompts, max_tokens: int, seeds: list[int], poll: bool
               ) -> tuple[int, list[list[int]]]:
        """One sampled completion per prompt (temperature 1, ``seeds[i]`` for prompt i, so
        every TP rank samples alike). ``poll``: first ``poll_requests()``, the point between
        generation steps where the engine may switch version. Returns (version, tokens)."""
        if poll:
            self.adapter.poll_requests()
        outs = self.engine.generate(prompts, max_tokens=max_tokens, temperature=1.0, seed=seeds)
        return self.adapter.version, [list(o.token_ids) for o in outs]

    @endpoint
    def digest(self) -> dict[str, str]:
        """SHA-256 of every parameter's bytes, by name."""
        import hashlib

        return {n: hashlib.sha256(p.detach().contiguous().view(torch.uint8).numpy()).hexdigest()
                for n, p in self.engine.params.items()}

    @endpoint
    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None


@dataclasses.dataclass(frozen=True)
class GenerationRun:
    """Per version, rank 0's completions of `PROMPTS` (every rank's are checked equal)."""

    completions: dict[int, list]
    send_s: list[float]


def run(procs, *, model: str, tp: int, versions: int, config) -> GenerationRun:
    """Spawn the actors on (trainer procs, rollout procs), connect, send ``versions`` updates
    and generate after each; stops the actors (the procs stay the caller's)."""
    from examples.engines.transfer import free_ports
    from weightbridge import TransferGroup

    tprocs, rprocs = procs
    if rprocs.size() % tp:
        raise ValueError(f"{rprocs.size()} rollout procs do not make engines of TP {tp}")
    start_dir = tempfile.TemporaryDirectory(prefix="wb-vllm-v0-")
    models.write_checkpoint_dir(model, models.checkpoint(model, 0), start_dir.name)
    group = TransferGroup.spawn(tprocs, rprocs, engine_size=tp, config=config)
    meshes = []
    try:
        trainers = tprocs.spawn("ckpt", CheckpointTrainer, model)
        meshes.append(trainers)
        rollouts = rprocs.spawn("vllm", GeneratingRollout, model, start_dir.name, tp,
                                free_ports(rprocs.size() // tp))
        meshes.append(rollouts)
        for f in [trainers.setup.call(group), rollouts.setup.call(group)]:
            f.get()
        trainers.connect.call().get()
        completions, send_s = {}, []
        for v in range(1, versions + 1):
            served = rollouts.serve.call(v, TIMEOUT_S)
            send_s.append(max(trainers.step_and_send.call(v).get().values()))
            got = set(served.get().values())
            if got != {v}:
                raise AssertionError(f"version {v}: rollout ranks installed {got}")
            outs = list(rollouts.generate.call(PROMPTS, MAX_TOKENS, TOP_K).get().values())
            if any(o != outs[0] for o in outs):
                raise AssertionError(f"version {v}: the engine's TP ranks generated differently")
            completions[v] = outs[0]
        return GenerationRun(completions, send_s)
    finally:
        try:
            close_all(group, meshes)
        finally:
            start_dir.cleanup()


def reference_rank(rank: int, world_size: int, port: int, model: str, version: int):
    """One rank of a fresh engine that loaded checkpoint ``version`` from disk; its
    completions of `PROMPTS`. (For `tests.engines.conftest.run_ranks`: fresh processes.)"""
    from examples.engines.vllm_engine import VllmEngine

    with tempfile.TemporaryDirectory(prefix=f"wb-vllm-v{version}-") as d:
        models.write_checkpoint_dir(model, models.checkpoint(model, version), d)
        engine = VllmEngine(d, rank=rank, world_size=world_size, master_port=port)
        try:
            return engine.generate(PROMPTS, max_tokens=MAX_TOKENS, logprobs=TOP_K)
        finally:
            engine.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3_moe", choices=models.GENERATING)
    ap.add_argument("--tp", type=int, default=2, choices=(1, 2))
    ap.add_argument("--mode", default="sync", choices=("sync", "ss", "rs", "async"))
    ap.add_argument("--versions", type=int, default=3)
    args = ap.parse_args(argv)
    from monarch.actor import this_host

    from weightbridge import TransferConfig
    from weightbridge.mesh.transport import configure_transport

    configure_transport()
    config = TransferConfig(timeout_s=TIMEOUT_S, round_bytes=32 << 10,
                            sender_staging=args.mode in ("ss", "async"),
                            receiver_staging=args.mode in ("rs", "async"))
    host = this_host()
    tprocs = host.spawn_procs(per_host={"worker": 1}, name="ckpt")
    try:
        rprocs = host.spawn_procs(per_host={"worker": args.tp}, name="vllm")
        try:
            result = run((tprocs, rprocs), model=args.model, tp=args.tp,
                         versions=args.versions, config=config)
        finally:
            rprocs.stop().get(timeout=60)
    finally:
        tprocs.stop().get(timeout=60)
    for v, outs in result.completions.items():
        print(f"v{v}: send_weights {result.send_s[v - 1]:.2f}s | tokens "
              f"{[list(o.token_ids) for o in outs][:2]} ...")
    return 0


if __name__ == "__main__":
    sys.exit(main())
