"""A plain PyTorch trainer as a WeightBridge worker: TP x FSDP2 over HF names, loaded by DCP.

`DcpWorker` is what a trainer without torchtitan looks like: a module whose parameter names are
the HF checkpoint's own (``nn.Linear`` per projection and per expert, as HF's modeling code has
them, built from `models.checkpoint_spec`), tensor parallelism from
``torch.distributed.tensor.parallel.parallelize_module`` (column-wise for q / k / v / gate / up
and the vocabulary of ``lm_head``, row-wise for o / down and the embedding, norms and routers
replicated), then FSDP2 ``fully_shard`` per decoder layer and at the root. Its ``load_weights``
is DCP's own HF path: the (name, tensor) pairs as a safetensors file, read into the sharded
state dict by ``torch.distributed.checkpoint.load`` with a ``HuggingFaceStorageReader``, then
``set_model_state_dict``. No renaming, no fusion: every checkpoint tensor lands in the parameter
of the same name, cut by TP and FSDP2 (``params`` are the local shards, as for `TitanWorker`).

It holds weights only (no forward): the layouts, not the model math, are what a transfer sees.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from . import models
from .trainer_group import SharedCheckpointDir, close_group, init_group, local

_COLWISE = ("q_proj", "k_proj", "v_proj", "q_b_proj", "kv_b_proj", "gate_proj", "up_proj",
            "lm_head")
_ROWWISE = ("o_proj", "down_proj", "embed_tokens")


class DcpWorker:
    """One rank of an HF-named model under FSDP2 (``dp_shard``) x TP (``tp``), DCP-loaded.

    Args:
        model: a name of `models.MODELS`.
        rank, world_size, master_port: as for `TitanWorker` (gloo on 127.0.0.1).
        dp_shard: FSDP2 degree; -1 (default) takes what ``tp`` leaves of ``world_size``.
        tp: tensor-parallel degree; it must divide every dimension it cuts.
    """

    def __init__(self, model: str, *, rank: int, world_size: int, master_port: int,
                 dp_shard: int = -1, tp: int = 1) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        self.model_name, self.rank, self.world_size = model, rank, world_size
        self.spec = models.checkpoint_spec(model)
        self.dp_shard, self.tp = _check_degrees(self.spec, world_size, dp_shard, tp)
        self._own_group = init_group(rank, world_size, master_port)
        mesh = init_device_mesh("cpu", (self.dp_shard, self.tp), mesh_dim_names=("dp", "tp"))
        with torch.device("meta"):
            self.model = _hf_named_module(self.spec)
        if self.tp > 1:
            _parallelize(self.model, mesh["tp"])
        if self.dp_shard > 1:
            for layer in self.model.model.layers.children():
                fully_shard(layer, mesh=mesh["dp"])
            fully_shard(self.model, mesh=mesh["dp"])
        self.model.to_empty(device="cpu")
        with torch.no_grad():
            for t in self.params.values():
                t.zero_()
        self._dir = SharedCheckpointDir(rank)

    @property
    def params(self) -> dict[str, torch.Tensor]:
        """Local shards by HF name (parameters), plus float32 buffers such as the router bias."""
        out = {name: local(p) for name, p in self.model.named_parameters()}
        out.update((name, local(b)) for name, b in self.model.named_buffers())
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors with ``dcp.load`` + ``HuggingFaceStorageReader`` (collective).

        Every rank passes the same tensors (any subset; names the model lacks are ignored).
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             get_model_state_dict,
                                                             set_model_state_dict)

        state = {name: t.detach() for name, t in weights}
        for name, t in state.items():
            if name in self.spec and tuple(t.shape) != self.spec[name].shape:
                raise ValueError(f"load_weights got {name!r} with shape {tuple(t.shape)}, but "
                                 f"this {self.model_name} model reads {self.spec[name].shape}; "
                                 f"pass the checkpoint of the same model config")
        with self._dir.written(state) as path:
            sharded = {k: v for k, v in get_model_state_dict(self.model).items() if k in state}
            if sharded:
                dcp.load(sharded, storage_reader=dcp.HuggingFaceStorageReader(path))
                set_model_state_dict(self.model, sharded, options=StateDictOptions(strict=False))

    def close(self) -> None:
        """Remove the shared checkpoint directory and tear down the group if this worker made it."""
        close_group(self._own_group, self._dir)


# --------------------------------------------------------------------------------------------


class _Norm(nn.Module):
    def __init__(self, size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype))


def _hf_named_module(spec) -> nn.Module:
    """Modules nested along the checkpoint names: ``embed_tokens`` an ``nn.Embedding``, other
    2-d weights ``nn.Linear``, 1-d weights norms, other 1-d tensors (float32 router biases)
    buffers of their module, as in HF's modeling code."""
    root = nn.Module()
    for t in spec.tensors:
        *path, leaf = t.name.split(".")
        dtype = getattr(torch, t.dtype)
        parent = root
        for part in path[:-1] if leaf == "weight" else path:
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        if leaf != "weight":
            parent.register_buffer(leaf, torch.empty(t.shape, dtype=dtype))
        elif path[-1] == "embed_tokens":
            parent.add_module(path[-1], nn.Embedding(*t.shape, dtype=dtype))
        elif len(t.shape) == 2:
            parent.add_module(path[-1], nn.Linear(t.shape[1], t.shape[0], bias=False, dtype=dtype))
        else:
            parent.add_module(path[-1], _Norm(t.shape[0], dtype))
    return root


def _parallelize(module: nn.Module, tp_mesh) -> None:
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    plan = {}
    for name, m in module.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(m, (nn.Linear, nn.Embedding)) and leaf in _COLWISE:
            plan[name] = ColwiseParallel()
        elif isinstance(m, (nn.Linear, nn.Embedding)) and leaf in _ROWWISE:
            plan[name] = RowwiseParallel()
    parallelize_module(module, tp_mesh, plan)


def _tp_dim(name: str) -> int | None:
    """The weight dim TP cuts: rows of column-wise linears and of the embedding (its vocabulary),
    columns of row-wise linears; None for what TP replicates."""
    module, leaf = name.rsplit(".", 2)[-2:]
    if leaf != "weight":
        return None
    if module in _COLWISE or module == "embed_tokens":
        return 0
    return 1 if module in _ROWWISE else None


def _check_degrees(spec, world_size: int, dp_shard: int, tp: int) -> tuple[int, int]:
    if tp < 1 or world_size < 1 or dp_shard == 0 or dp_shard < -1:
        raise ValueError(f"degrees must be >= 1 (dp_shard may be -1): got world_size="
                         f"{world_size}, dp_shard={dp_shard}, tp={tp}")
    if dp_shard == -1:
        dp_shard = world_size // tp
    if dp_shard * tp != world_size:
        raise ValueError(f"dp_shard ({dp_shard}) x tp ({tp}) must equal world_size ({world_size})")
    for t in spec.tensors:
        dim = _tp_dim(t.name)
        if dim is not None and t.shape[dim] % tp:
            raise ValueError(f"tp ({tp}) must divide dim {dim} of {t.name} {t.shape}, which TP "
                             f"cuts; choose a tp that divides it")
    return dp_shard, tp
