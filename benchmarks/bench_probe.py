"""Layout-discovery benchmark: probe a Qwen3-MoE-shaped rollout worker (TP2 x EP2).

    .venv/bin/python benchmarks/bench_probe.py            # ~200M-element bf16 model
    .venv/bin/python benchmarks/bench_probe.py --layers 2 # quicker

Prints, measured in one run: probe time / one plain load_weights call (target <= 6), peak extra
memory during the probe / parameter bytes (target <= 1.0), source-map bytes (target <= 1 MB) and
the number of copy operations (pieces). The loader is written in the vLLM style: fused qkv and
gate_up shards, experts stacked into 3-D params on their expert-parallel rank, vocabulary padded
to a multiple of 64.
"""

from __future__ import annotations

import argparse
import pickle
import threading
import time
from dataclasses import dataclass

import torch

from weightbridge import CheckpointSpec, TensorSpec, extract_source_map


@dataclass(frozen=True)
class MoEConfig:
    hidden: int = 1024
    layers: int = 6
    heads: int = 16
    kv_heads: int = 4
    head_dim: int = 64
    experts: int = 16
    moe_intermediate: int = 512
    vocab: int = 16384


def checkpoint_spec(c: MoEConfig) -> CheckpointSpec:
    """HF names and shapes of a Qwen3-MoE checkpoint."""
    t = [("model.embed_tokens.weight", (c.vocab, c.hidden))]
    for i in range(c.layers):
        p = f"model.layers.{i}."
        t += [(p + "input_layernorm.weight", (c.hidden,)),
              (p + "post_attention_layernorm.weight", (c.hidden,)),
              (p + "self_attn.q_proj.weight", (c.heads * c.head_dim, c.hidden)),
              (p + "self_attn.k_proj.weight", (c.kv_heads * c.head_dim, c.hidden)),
              (p + "self_attn.v_proj.weight", (c.kv_heads * c.head_dim, c.hidden)),
              (p + "self_attn.o_proj.weight", (c.hidden, c.heads * c.head_dim)),
              (p + "self_attn.q_norm.weight", (c.head_dim,)),
              (p + "self_attn.k_norm.weight", (c.head_dim,)),
              (p + "mlp.gate.weight", (c.experts, c.hidden))]
        for e in range(c.experts):
            q = f"{p}mlp.experts.{e}."
            t += [(q + "gate_proj.weight", (c.moe_intermediate, c.hidden)),
                  (q + "up_proj.weight", (c.moe_intermediate, c.hidden)),
                  (q + "down_proj.weight", (c.hidden, c.moe_intermediate))]
    t += [("model.norm.weight", (c.hidden,)), ("lm_head.weight", (c.vocab, c.hidden))]
    return CheckpointSpec(tuple(TensorSpec(n, s, "bfloat16") for n, s in t))


class RolloutWorker:
    """One rank of a TP x EP rollout engine, parameters in the inference layout."""

    def __init__(self, c: MoEConfig, tp: int, tp_rank: int, ep: int, ep_rank: int):
        self.c, self.tp, self.tp_rank, self.ep_rank = c, tp, tp_rank, ep_rank
        self.local_experts = c.experts // ep
        vocab_padded = -(-c.vocab // (64 * tp)) * 64 * tp
        q, kv, inter = c.heads * c.head_dim // tp, c.kv_heads * c.head_dim // tp, \
            c.moe_intermediate // tp
        shapes = {"model.embed_tokens.weight": (vocab_padded // tp, c.hidden),
                  "lm_head.weight": (vocab_padded // tp, c.hidden),
                  "model.norm.weight": (c.hidden,)}
        for i in range(c.layers):
            p = f"model.layers.{i}."
            shapes |= {p + "input_layernorm.weight": (c.hidden,),
                       p + "post_attention_layernorm.weight": (c.hidden,),
                       p + "self_attn.qkv_proj.weight": (q + 2 * kv, c.hidden),
                       p + "self_attn.o_proj.weight": (c.hidden, q),
                       p + "self_attn.q_norm.weight": (c.head_dim,),
                       p + "self_attn.k_norm.weight": (c.head_dim,),
                       p + "mlp.gate.weight": (c.experts, c.hidden),
                       p + "mlp.experts.w13_weight": (self.local_experts, 2 * inter, c.hidden),
                       p + "mlp.experts.w2_weight": (self.local_experts, c.hidden, inter)}
        self.params = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in shapes.items()}

    def load_weights(self, weights) -> None:
        c, tp, r = self.c, self.tp, self.tp_rank
        for name, w in weights:
            if ".experts." in name:
                layer, rest = name.split(".mlp.experts.")
                expert, proj = int(rest.split(".")[0]), rest.split(".")[1]
                local = expert - self.ep_rank * self.local_experts
                if not 0 <= local < self.local_experts:
                    continue
                inter = c.moe_intermediate // tp
                if proj == "down_proj":
                    dst = self.params[f"{layer}.mlp.experts.w2_weight"][local]
                    dst.copy_(w.narrow(1, r * inter, inter))
                else:
                    half = 0 if proj == "gate_proj" else 1
                    dst = self.params[f"{layer}.mlp.experts.w13_weight"][local]
                    dst[half * inter:(half + 1) * inter].copy_(w.narrow(0, r * inter, inter))
            elif name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
                q, kv = c.heads * c.head_dim // tp, c.kv_heads * c.head_dim // tp
                kind = name.split(".")[-2][0]
                offset, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[kind]
                dst = self.params[name.rsplit(".", 2)[0] + ".qkv_proj.weight"]
                dst[offset:offset + size].copy_(w.narrow(0, r * size, size))
            elif name.endswith("o_proj.weight"):
                size = c.heads * c.head_dim // tp
                self.params[name].copy_(w.narrow(1, r * size, size))
            elif name in ("model.embed_tokens.weight", "lm_head.weight"):
                dst = self.params[name]
                rows = dst.shape[0]
                lo, hi = r * rows, min((r + 1) * rows, c.vocab)
                dst[:hi - lo].copy_(w[lo:hi])
                dst[hi - lo:].zero_()
            else:
                self.params[name].copy_(w)


class PeakRss:
    """Samples this process's resident memory in a thread; `peak` is the high-water mark."""

    def __init__(self):
        self.peak = self.now()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def now() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self.now())

    def __enter__(self) -> "PeakRss":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.now())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=MoEConfig.layers)
    parser.add_argument("--repeats", type=int, default=3, help="plain-load timing repeats")
    args = parser.parse_args()
    config = MoEConfig(layers=args.layers)
    spec = checkpoint_spec(config)
    worker = RolloutWorker(config, tp=2, tp_rank=1, ep=2, ep_rank=1)
    param_bytes = sum(p.numel() * p.element_size() for p in worker.params.values())
    print(f"model: {spec.numel / 1e6:.1f}M elements in {len(spec)} tensors; worker TP2 x EP2 "
          f"rank (tp 1, ep 1): {len(worker.params)} params, {param_bytes / 2**20:.1f} MiB")

    torch.set_num_threads(torch.get_num_threads())
    base = PeakRss.now()
    with PeakRss() as rss:
        t0 = time.perf_counter()
        smap = extract_source_map(worker.params, worker.load_weights, spec)
        probe_s = time.perf_counter() - t0
    extra = rss.peak - base

    gen = torch.Generator().manual_seed(1)
    checkpoint = {t.name: torch.randn(t.shape, generator=gen).bfloat16() for t in spec.tensors}
    load_s = min(_timed(lambda: worker.load_weights(checkpoint.items()))
                 for _ in range(args.repeats))
    map_bytes = len(pickle.dumps(smap))
    print(smap.summary())
    print(f"probe time {probe_s:.2f} s / plain load_weights {load_s:.3f} s = "
          f"{probe_s / load_s:.2f} (target <= 6)")
    print(f"peak extra memory {extra / 2**20:.1f} MiB / parameter bytes "
          f"{param_bytes / 2**20:.1f} MiB = {extra / param_bytes:.2f} (target <= 1.0)")
    print(f"source map {map_bytes / 1024:.1f} KiB pickled (target <= 1024 KiB); "
          f"copy operations (pieces): {len(smap.pieces)}")


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
