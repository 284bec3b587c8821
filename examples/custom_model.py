"""A model the controller has never seen, as a worker factory: ``--workers
examples.custom_model:mlp``.

    python -m controller --workers examples.custom_model:mlp \
        --trainer "nodes=1,gpus=2,tp=2" --rollout "engines=2,nodes=1,gpus=1" --updates 2

A stack of MLP blocks with an embedding. The checkpoint has separate ``gate``, ``up`` and
``down`` matrices per layer. Trainers hold Megatron-style TP shards: rows of gate and up,
columns of down, rows of the embedding. Rollout ranks hold vLLM-style fused ``gate_up`` (the
TP rows of gate, then those of up), ``down`` stored transposed, and the whole embedding.
The controller learns all of that by probing each rank's ``load_weights``: nothing here tells
it the layout.
"""

from __future__ import annotations

import torch

from weightbridge import CheckpointSpec, TensorSpec, WorkerParts

HIDDEN, FFN, VOCAB, LAYERS = 64, 192, 320, 3


def checkpoint_spec() -> CheckpointSpec:
    tensors = [TensorSpec("embed.weight", (VOCAB, HIDDEN), "bfloat16")]
    for i in range(LAYERS):
        tensors += [TensorSpec(f"layers.{i}.gate.weight", (FFN, HIDDEN), "bfloat16"),
                    TensorSpec(f"layers.{i}.up.weight", (FFN, HIDDEN), "bfloat16"),
                    TensorSpec(f"layers.{i}.down.weight", (HIDDEN, FFN), "bfloat16")]
    return CheckpointSpec(tuple(tensors))


def checkpoint(version: int, names=None):
    """Version ``version`` of the checkpoint (deterministic)."""
    for i, t in enumerate(checkpoint_spec().tensors):
        if names is None or t.name in names:
            gen = torch.Generator().manual_seed(97 * version + i)
            yield t.name, torch.randn(t.shape, generator=gen).bfloat16()


def mlp(side: str, spec, rank: int) -> WorkerParts:
    """Rank ``rank`` of the trainer (TP over ``spec.tp``) or rollout (TP inside an engine)."""
    tp = spec.tp
    tp_rank = rank % tp if side == "trainer" else spec.coords(rank)["tp"]
    if FFN % tp or VOCAB % tp:
        raise ValueError(f"tp={tp} must divide ffn={FFN} and vocab={VOCAB}")
    f, v = FFN // tp, VOCAB // tp
    rows = slice(tp_rank * f, (tp_rank + 1) * f)
    bf16 = torch.bfloat16
    if side == "trainer":
        params = {"embed": torch.zeros(v, HIDDEN, dtype=bf16)}
        for i in range(LAYERS):
            params |= {f"l{i}.gate": torch.zeros(f, HIDDEN, dtype=bf16),
                       f"l{i}.up": torch.zeros(f, HIDDEN, dtype=bf16),
                       f"l{i}.down": torch.zeros(HIDDEN, f, dtype=bf16)}

        def load_weights(weights):
            for name, w in weights:
                if name == "embed.weight":
                    params["embed"].copy_(w[tp_rank * v:(tp_rank + 1) * v])
                    continue
                _, i, kind, _ = name.split(".")
                dst = params[f"l{i}.{kind}"]
                dst.copy_(w[:, rows] if kind == "down" else w[rows])
    else:
        params = {"embed": torch.zeros(VOCAB, HIDDEN, dtype=bf16)}
        for i in range(LAYERS):
            params |= {f"l{i}.gate_up": torch.zeros(2 * f, HIDDEN, dtype=bf16),
                       f"l{i}.down_t": torch.zeros(f, HIDDEN, dtype=bf16)}

        def load_weights(weights):
            for name, w in weights:
                if name == "embed.weight":
                    params["embed"].copy_(w)
                    continue
                _, i, kind, _ = name.split(".")
                if kind == "down":
                    params[f"l{i}.down_t"].copy_(w[:, rows].t())
                else:
                    half = 0 if kind == "gate" else 1
                    params[f"l{i}.gate_up"][half * f:(half + 1) * f].copy_(w[rows])

    return WorkerParts(params=params, load_weights=load_weights, spec=checkpoint_spec(),
                       checkpoint=checkpoint)
