"""Mesh specs: the layouts of a trainer mesh and a rollout mesh, in a compact text form.

    TrainerSpec.parse("nodes=2,gpus=2,tp=2,ep=2")         # 4 workers: TP2 x EP2 (x DP1)
    RolloutSpec.parse("engines=2,nodes=1,gpus=2,tp=2")     # two engines of 2 workers each

A trainer spec lays out ``nodes * gpus`` workers as DP x PP x EP x TP (TP fastest); a rollout
spec lays out ``engines`` replicas of ``nodes * gpus`` workers as EP x TP. ``fsdp=1`` makes the
trainer keep FSDP flat shards instead (its workers are the FSDP ranks); fsdp is a switch, 0 or 1.
``spec.validate()`` checks the layout alone (any worker factory); ``spec.validate(model)`` also
against a model config with ``heads``, ``kv_heads``, ``moe_intermediate``, ``experts``,
``vocab`` and ``layers`` (the demo's `meshes.qwen3_moe.MoEConfig`). A controller
(`controller.MeshTransfer`) spawns meshes of these layouts and hands each worker factory its
side's spec.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainerSpec:
    """Trainer layout: nodes x gpus workers, Megatron-like parallel degrees."""

    nodes: int = 1
    """Hosts of the trainer mesh."""
    gpus: int = 4
    """Workers per host."""
    tp: int = 1
    """Tensor parallel degree (attention heads, vocabulary)."""
    pp: int = 1
    """Pipeline stages (contiguous blocks of layers)."""
    ep: int = 1
    """Expert parallel degree (contiguous blocks of experts)."""
    fsdp: int = 0
    """1: FSDP flat shards over all workers instead of TP/PP/EP; 0: TP/PP/EP (a switch)."""

    @classmethod
    def parse(cls, text: str) -> "TrainerSpec":
        return cls(**_parse(cls, text))

    @property
    def num_workers(self) -> int:
        return self.nodes * self.gpus

    @property
    def dp(self) -> int:
        """Data-parallel replicas: what is left of the workers after TP, PP and EP."""
        return 1 if self.fsdp else self.num_workers // (self.tp * self.pp * self.ep)

    def validate(self, model=None) -> None:
        """Raise ValueError when the layout does not fit the workers or (if given) the model."""
        _positive(self)
        if self.fsdp not in (0, 1):
            raise ValueError(f"trainer spec {self}: fsdp is a switch, 0 or 1, got fsdp="
                             f"{self.fsdp}; fsdp=1 shards flat parameters over all nodes*gpus "
                             f"workers (there is no smaller FSDP degree): set fsdp=1 or drop it")
        if self.fsdp:
            if (self.tp, self.pp, self.ep) != (1, 1, 1):
                raise ValueError(f"trainer spec {self}: fsdp=1 shards flat parameters over all "
                                 f"workers; drop tp/pp/ep (or set fsdp=0)")
            return
        group = self.tp * self.pp * self.ep
        if self.num_workers % group:
            raise ValueError(f"trainer spec {self}: tp*pp*ep = {group} must divide the "
                             f"{self.num_workers} workers (nodes*gpus)")
        if model is None:
            return
        _check_model(self, model, self.tp, self.ep)
        if model.vocab % self.tp:
            raise ValueError(f"trainer spec {self}: tp={self.tp} must divide the model's "
                             f"vocabulary of {model.vocab} (the trainer does not pad it)")
        if model.layers % self.pp:
            raise ValueError(f"trainer spec {self}: pp={self.pp} must divide the model's "
                             f"{model.layers} layers")

    def coords(self, worker: int) -> dict[str, int]:
        """Parallel ranks of a worker: {"dp", "pp", "ep", "tp"} (TP fastest)."""
        tp, rest = worker % self.tp, worker // self.tp
        ep, rest = rest % self.ep, rest // self.ep
        pp, dp = rest % self.pp, rest // self.pp
        return {"dp": dp, "pp": pp, "ep": ep, "tp": tp}


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutSpec:
    """Rollout layout: engines (replicas) of nodes x gpus workers, TP x EP inside an engine."""

    engines: int = 1
    """Inference replicas; each holds a whole copy of the model."""
    nodes: int = 1
    """Hosts per engine."""
    gpus: int = 2
    """Workers per host."""
    tp: int = 1
    """Tensor parallel degree inside an engine."""
    ep: int = 1
    """Expert parallel degree inside an engine."""

    @classmethod
    def parse(cls, text: str) -> "RolloutSpec":
        return cls(**_parse(cls, text))

    @property
    def workers_per_engine(self) -> int:
        return self.nodes * self.gpus

    @property
    def num_workers(self) -> int:
        return self.engines * self.workers_per_engine

    def validate(self, model=None) -> None:
        """Raise ValueError when the layout does not fit the workers or (if given) the model."""
        _positive(self)
        if self.tp * self.ep != self.workers_per_engine:
            raise ValueError(f"rollout spec {self}: tp*ep = {self.tp * self.ep} must equal the "
                             f"{self.workers_per_engine} workers of an engine (nodes*gpus)")
        if model is not None:
            _check_model(self, model, self.tp, self.ep)

    def coords(self, worker: int) -> dict[str, int]:
        """Engine and ranks of a worker: {"engine", "ep", "tp"} (TP fastest)."""
        engine, local = divmod(worker, self.workers_per_engine)
        return {"engine": engine, "ep": local // self.tp, "tp": local % self.tp}


def _parse(cls: type, text: str) -> dict[str, int]:
    known = {f.name for f in fields(cls)}
    out: dict[str, int] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, eq, value = item.partition("=")
        if not eq or key.strip() not in known:
            raise ValueError(f"bad {cls.__name__} item {item!r} in {text!r}: expected "
                             f"key=value with key in {sorted(known)}")
        if key.strip() in out:
            raise ValueError(f"{cls.__name__} {text!r} sets {key.strip()} twice: give each "
                             f"key once")
        try:
            out[key.strip()] = int(value)
        except ValueError:
            raise ValueError(f"{cls.__name__} {key.strip()}={value!r}: not an integer") from None
    return out


def _positive(spec) -> None:
    for f in fields(spec):
        value = getattr(spec, f.name)
        if f.name != "fsdp" and value < 1:  # fsdp, a switch, is checked by its spec
            raise ValueError(f"{type(spec).__name__}.{f.name} must be >= 1, got {value}")


def _check_model(spec, model, tp: int, ep: int) -> None:
    name = type(spec).__name__
    for what, count in (("heads", model.heads), ("kv_heads", model.kv_heads),
                        ("moe_intermediate", model.moe_intermediate)):
        if count % tp:
            raise ValueError(f"{name} tp={tp} does not divide the model's {what}={count}")
    if model.experts % ep:
        raise ValueError(f"{name} ep={ep} does not divide the model's {model.experts} experts")
