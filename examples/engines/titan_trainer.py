"""torchtitan trainers as WeightBridge workers: FSDP2 x TP x EP shards, loaded from HF safetensors.

`TitanWorker` builds one rank of a torchtitan 0.3.0 model (Qwen3-MoE or DeepSeek-V3, the tiny HF
configs of `models`) the way torchtitan's own ``Trainer`` does: model config -> meta-device build
-> the model's own ``parallelize_fn`` (TP / EP via ``model.parallelize``, FSDP2 via
``apply_fsdp_to_decoder``) -> ``to_empty`` on CPU -> ``init_weights``. Its ``load_weights`` is the
trainer's real HF checkpoint path, the steps of ``CheckpointManager.dcp_load(from_hf=True)``:
the (name, tensor) pairs are written as a safetensors file, the model's state dict is renamed to
HF names by the model's ``StateDictAdapter.to_hf`` (wq / wk / wv split from the fused wqkv by
torchtitan's state-dict hook, stacked experts cut into this rank's experts), filled by
``torch.distributed.checkpoint.load`` with a ``HuggingFaceStorageReader``, mapped back by
``from_hf`` and loaded with ``load_state_dict`` (which re-fuses wqkv, interleaved per kv group).
It is collective: every rank of the group calls it with the same weights.

``params`` are the LIVE local shards: for each DTensor parameter its local tensor, a view of the
storage FSDP2 and TP keep (writing into it changes the model; `tests/engines/test_titan_trainer.py`
checks it), plus the buffers the checkpoint fills (DeepSeek-V3's float32 ``expert_bias_E`` from
``e_score_correction_bias``). FSDP2 cuts dim 0 of the TP shard (a ``_StridedShard`` when TP cut
dim 0 first) with ``torch.chunk`` semantics: on uneven sizes the last ranks hold fewer rows and
may hold none. FSDP2 pads its storage to equal shards, but the local tensor is the unpadded
narrow view of it, so the probe sees no padding (a padded element would just be reported
unsourced). Stacked experts are the exception: torchtitan's HF adapter needs them in equal
blocks, so the degrees must split the routed experts evenly (checked up front).

Runs on CPU over gloo: torchtitan assumes an accelerator, so the worker points torchtitan's
device type at "cpu" in its process (`_use_cpu`) and uses ``spmd_backend="partial_dtensor"``
(DTensor for TP / EP, plain FSDP2), the backend under which the HF adapter's DTensor paths load.

Typical usage (one process per rank)::

    worker = TitanWorker("qwen3_moe", rank=r, world_size=4, master_port=port, dp_shard=2, tp=2)
    spec = models.checkpoint_spec("qwen3_moe")
    smap = weightbridge.extract_source_map(worker.params, worker.load_weights, spec)
    worker.load_weights(models.checkpoint("qwen3_moe", version=1).items())
    worker.close()
"""

from __future__ import annotations

import re
import tempfile
from types import SimpleNamespace
from typing import Any, Iterable

import torch

from weightbridge import CheckpointSpec, TensorSpec

from . import models
from .trainer_group import SharedCheckpointDir, close_group, init_group, local

_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight$")


class TitanWorker:
    """One rank of a torchtitan model under FSDP2 (``dp_shard``) x TP (``tp``) x EP (``ep``).

    Args:
        model: a name of `models.MODELS` ("qwen3_moe" or "deepseek_v3").
        rank, world_size: this process's place in the trainer group.
        master_port: TCP port on 127.0.0.1 for ``init_process_group`` (gloo) when no default
            group exists yet; an existing group is used as is (and must match rank and size).
        dp_shard: FSDP2 degree; -1 (default) takes what ``tp`` leaves of ``world_size``.
        tp: tensor-parallel degree. ``dp_shard * tp`` must equal ``world_size``.
        ep: expert-parallel degree; torchtitan carves the EP mesh out of ``dp_shard * tp``, so it
            must divide that product and the number of routed experts.
    """

    def __init__(self, model: str, *, rank: int, world_size: int, master_port: int,
                 dp_shard: int = -1, tp: int = 1, ep: int = 1) -> None:
        self.model_name = model
        self.rank, self.world_size = rank, world_size
        self.dp_shard, self.tp, self.ep = _check_degrees(model, world_size, dp_shard, tp, ep)
        self._own_group = init_group(rank, world_size, master_port)
        _use_cpu()
        from torchtitan.components.checkpointer.base import ModelWrapper
        from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
        from torchtitan.distributed import ParallelDims, utils as dist_utils

        parallelism = ParallelismConfig(
            data_parallel_shard_degree=self.dp_shard, tensor_parallel_degree=self.tp,
            expert_parallel_degree=self.ep, spmd_backend="partial_dtensor")
        dist_utils.set_spmd_backend(parallelism.spmd_backend)
        self.parallel_dims = ParallelDims.from_config(parallelism, world_size)
        config, parallelize, adapter_cls = _titan_model(model)
        _update_from_config(config, parallelism)
        training = TrainingConfig(dtype="bfloat16", mixed_precision_param="bfloat16")
        with torch.device("meta"), _default_dtype(torch.bfloat16):
            module = config.build()
        self.model = parallelize(module, parallel_dims=self.parallel_dims, training=training,
                                 parallelism=parallelism, compile_config=CompileConfig(),
                                 ac_config=None, dump_folder=tempfile.gettempdir())
        self.model.to_empty(device="cpu")
        with torch.no_grad():
            self.model.init_weights(buffer_device=None)
        self.adapter = adapter_cls(config, None)
        self._wrapper = ModelWrapper(self.model)
        self._num_experts = _num_experts(config)
        self._dir = SharedCheckpointDir(rank)
        self._spec = self.hf_spec()

    @property
    def params(self) -> dict[str, torch.Tensor]:
        """The live local shards by parameter FQN, and the buffers the HF checkpoint fills.

        Each access looks them up again. FSDP2 re-points a local tensor at new storage only
        when a load replaced the parameter's storage (an assigning ``load_state_dict``);
        ``load_weights`` copies into place, so tensors taken before a load stay live.
        """
        out = {name: local(p) for name, p in self.model.named_parameters()}
        loaded = set(self.adapter.from_hf_map.values())
        for name, b in self.model.named_buffers():
            if re.sub(r"\d+", "{}", name, count=1) in loaded:
                out[name] = local(b)
        return out

    # ----------------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors through torchtitan's HF checkpoint path (collective).

        Every rank passes the same tensors; rank 0 writes them as ``model.safetensors`` into a
        directory shared by the group, and all ranks load it. Any subset may be given, except
        that routed experts go in whole: torchtitan stacks a layer's expert projection only when
        every expert of it arrives in the same load. Names the model does not have are ignored.
        """
        import torch.distributed.checkpoint as dcp

        state = {name: t.detach() for name, t in weights}
        self._check_shapes(state)
        self._check_experts(state)
        with self._dir.written(state) as path:
            # CheckpointManager.dcp_load(from_hf=True), restricted to the tensors given.
            hf_state_dict = {k: v for k, v in self.adapter.to_hf(self._wrapper.state_dict()).items()
                             if k in state}
            if hf_state_dict:
                dcp.load(hf_state_dict, storage_reader=self.adapter.get_hf_storage_reader(path))
                self._wrapper.load_state_dict(self.adapter.from_hf(hf_state_dict))

    def hf_spec(self) -> CheckpointSpec:
        """The HF checkpoint this model reads, from torchtitan's own ``to_hf`` (collective).

        Global shapes: each state-dict entry is renamed as a meta tensor of its full shape, so
        stacked experts split into all experts whatever this rank holds.
        """
        state = {k: torch.empty(v.shape, dtype=v.dtype, device="meta")
                 for k, v in self.model.state_dict().items()}
        _, _, adapter_cls = _titan_model(self.model_name)
        hf = adapter_cls(self.adapter.model_config, None).to_hf(state)
        return CheckpointSpec(tuple(
            TensorSpec(n, tuple(t.shape), str(t.dtype).removeprefix("torch."))
            for n, t in hf.items()))

    def close(self) -> None:
        """Remove the shared checkpoint directory and tear down the group if this worker made it."""
        close_group(self._own_group, self._dir)

    # ----------------------------------------------------------------------------------------

    def _check_shapes(self, state: dict[str, torch.Tensor]) -> None:
        for name, t in state.items():
            if name in self._spec and tuple(t.shape) != self._spec[name].shape:
                raise ValueError(f"load_weights got {name!r} with shape {tuple(t.shape)}, but "
                                 f"this {self.model_name} model reads {self._spec[name].shape}; "
                                 f"pass the checkpoint of the same model config")

    def _check_experts(self, state: dict[str, torch.Tensor]) -> None:
        given: dict[tuple[str, str], set[int]] = {}
        for name in state:
            m = _EXPERT.match(name)
            if m:
                given.setdefault((m[1], m[3]), set()).add(int(m[2]))
        for (layer, proj), experts in sorted(given.items()):
            missing = sorted(set(range(self._num_experts)) - experts)
            if missing:
                raise ValueError(
                    f"load_weights got experts {sorted(experts)} of layer {layer}'s {proj} but "
                    f"not {missing}: torchtitan stacks a layer's experts only when all "
                    f"{self._num_experts} arrive in the same call (it would silently skip these). "
                    f"Pass every expert of a layer together.")


# --------------------------------------------------------------------------------------------
# Model configs: torchtitan's own builders, sized to the HF configs of `models`
# --------------------------------------------------------------------------------------------


def _titan_model(model: str) -> tuple[Any, Any, type]:
    """(torchtitan model config, its parallelize_fn, its StateDictAdapter class)."""
    cfg = models.hf_config(model)
    if cfg["model_type"] == "qwen3_moe":
        return _qwen3_moe(cfg)
    return _deepseek_v3(cfg)


def _qwen3_moe(cfg: dict) -> tuple[Any, Any, type]:
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.qwen3 import (_EMBEDDING_INIT, _LINEAR_INIT, Qwen3Model,
                                         Qwen3StateDictAdapter, _build_qwen3_moe_layers,
                                         _qwen3_norm, parallelize_qwen3)

    dim, vocab, hd = cfg["hidden_size"], cfg["vocab_size"], cfg["head_dim"]
    if cfg["mlp_only_layers"] or cfg["decoder_sparse_step"] != 1 or not cfg["norm_topk_prob"]:
        raise ValueError("torchtitan's Qwen3-MoE has an MoE in every layer with normalized "
                         "top-k scores; set mlp_only_layers=[], decoder_sparse_step=1, "
                         "norm_topk_prob=True")
    config = Qwen3Model.Config(
        vocab_size=vocab, dim=dim, norm=_qwen3_norm(dim),
        enable_weight_tying=cfg["tie_word_embeddings"],
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                        param_init=_EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_LINEAR_INIT),
        layers=_build_qwen3_moe_layers(
            n_layers=cfg["num_hidden_layers"], dim=dim, n_heads=cfg["num_attention_heads"],
            n_kv_heads=cfg["num_key_value_heads"], head_dim=hd,
            moe_hidden_dim=cfg["moe_intermediate_size"], num_experts=cfg["num_experts"],
            top_k=cfg["num_experts_per_tok"], fuse_qkv=True, attn_backend="flex",
            moe_comm_backend="standard",
            rope=CosSinRoPE.Config(dim=hd, max_seq_len=cfg["max_position_embeddings"],
                                   theta=cfg["rope_theta"])))
    return config, parallelize_qwen3, Qwen3StateDictAdapter


def _deepseek_v3(cfg: dict) -> tuple[Any, Any, type]:
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.deepseek_v3 import (_EMBEDDING_INIT, _NORM_INIT, DeepSeekV3Model,
                                               _build_dsv3_layers, _output_linear_init,
                                               parallelize_deepseekv3)
    from torchtitan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter

    dim, vocab, rope = cfg["hidden_size"], cfg["vocab_size"], cfg["qk_rope_head_dim"]
    if cfg["num_key_value_heads"] != cfg["num_attention_heads"] or cfg.get("rope_scaling"):
        raise ValueError("this tiny DeepSeek-V3 maps MLA without rope scaling; set "
                         "num_key_value_heads = num_attention_heads and rope_scaling=None")
    layers = _build_dsv3_layers(
        n_layers=cfg["num_hidden_layers"], n_dense_layers=cfg["first_k_dense_replace"], dim=dim,
        n_heads=cfg["num_attention_heads"], q_lora_rank=cfg["q_lora_rank"] or 0,
        kv_lora_rank=cfg["kv_lora_rank"], qk_nope_head_dim=cfg["qk_nope_head_dim"],
        qk_rope_head_dim=rope, v_head_dim=cfg["v_head_dim"], mscale=1.0,
        dense_hidden_dim=cfg["intermediate_size"], moe_hidden_dim=cfg["moe_intermediate_size"],
        num_experts=cfg["n_routed_experts"], num_shared_experts=cfg["n_shared_experts"],
        router_top_k=cfg["num_experts_per_tok"], router_score_func=cfg["scoring_func"],
        router_num_expert_groups=cfg["n_group"], router_num_limited_groups=cfg["topk_group"],
        router_route_scale=cfg["routed_scaling_factor"], router_route_norm=cfg["norm_topk_prob"],
        attn_backend="flex", moe_comm_backend="standard", non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=rope, max_seq_len=cfg["max_position_embeddings"],
                                theta=cfg["rope_theta"]))
    config = DeepSeekV3Model.Config(
        vocab_size=vocab, dim=dim,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                        param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab,
                              param_init=_output_linear_init(dim)),
        layers=layers, mtp_layers=[])
    return config, parallelize_deepseekv3, DeepSeekV3StateDictAdapter


def _update_from_config(config: Any, parallelism: Any) -> None:
    """What ``Decoder.Config.update_from_config`` does for a config that is not a trainer's.

    torchtitan's own method imports ``torchtitan.trainer`` (tensorboard, datasets, wandb) only to
    tell trainer configs apart; its remaining steps are these torchtitan functions (the TP
    divisibility checks are in `_check_degrees`).
    """
    from torchtitan.models.common.token_dispatcher import update_ep_token_dispatcher_config

    update_ep_token_dispatcher_config(config, SimpleNamespace(parallelism=parallelism))
    enable_ep = parallelism.expert_parallel_degree > 1
    if type(config).__qualname__.startswith("Qwen3Model"):
        from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

        set_qwen3_sharding_config(config, enable_sp=parallelism.enable_sequence_parallel,
                                  enable_ep=enable_ep)
    else:
        from torchtitan.models.deepseek_v3.sharding import set_deepseek_v3_sharding_config

        set_deepseek_v3_sharding_config(config, enable_sp=parallelism.enable_sequence_parallel,
                                        enable_ep=enable_ep)


def _num_experts(config: Any) -> int:
    return next(layer.moe.num_experts for layer in config.layers if layer.moe is not None)


# --------------------------------------------------------------------------------------------
# Process group, CPU device, small helpers
# --------------------------------------------------------------------------------------------


def _check_degrees(model: str, world_size: int, dp_shard: int, tp: int, ep: int
                   ) -> tuple[int, int, int]:
    cfg = models.hf_config(model)  # ValueError for an unknown model name
    if tp < 1 or ep < 1 or world_size < 1 or dp_shard == 0 or dp_shard < -1:
        raise ValueError(f"degrees must be >= 1 (dp_shard may be -1): got world_size="
                         f"{world_size}, dp_shard={dp_shard}, tp={tp}, ep={ep}")
    if dp_shard == -1:
        dp_shard = world_size // tp
    if dp_shard * tp != world_size:
        raise ValueError(f"dp_shard ({dp_shard}) x tp ({tp}) must equal world_size "
                         f"({world_size}); pipeline, context and replicate degrees are 1 here")
    experts = cfg.get("num_experts") or cfg["n_routed_experts"]
    if (dp_shard * tp) % ep or experts % ep:
        raise ValueError(f"ep ({ep}) must divide dp_shard x tp ({dp_shard * tp}), from which "
                         f"torchtitan carves the EP mesh, and the {experts} routed experts")
    # FSDP2 shards stacked experts on dim 0 over this many ranks (EP x expert-FSDP, or plain
    # FSDP without EP) unless they outnumber the experts; torchtitan's HF adapter then cuts
    # the experts into equal blocks and refuses a remainder.
    expert_shards = dp_shard * tp if ep > 1 else dp_shard
    if expert_shards <= experts and experts % expert_shards:
        raise ValueError(f"{model!r} has {experts} routed experts, which torchtitan's HF loader "
                         f"cannot split evenly over {expert_shards} expert shards "
                         f"({'dp_shard x tp' if ep > 1 else 'dp_shard'}); choose degrees whose "
                         f"product divides {experts} or exceeds it")
    for key in ("num_attention_heads", "num_key_value_heads"):
        if cfg[key] % tp:
            raise ValueError(f"tp ({tp}) must divide {key} ({cfg[key]}) of {model!r}")
    return dp_shard, tp, ep


def _use_cpu() -> None:
    """Point torchtitan's device type at "cpu": this worker keeps its shards in host memory
    and talks gloo, on any machine.

    torchtitan copies ``torchtitan.tools.utils.device_type`` (the accelerator's, or "cuda" when
    there is none) into several modules at import, and builds its meshes on that device type.
    """
    import importlib

    for name in ("torchtitan.tools.utils", "torchtitan.distributed.parallel_dims",
                 "torchtitan.distributed.utils", "torchtitan.models.common.token_dispatcher"):
        module = importlib.import_module(name)
        if hasattr(module, "device_type"):
            module.device_type = "cpu"


class _default_dtype:
    """``torch.set_default_dtype`` for a block (torchtitan builds under its training dtype)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __enter__(self) -> None:
        self.saved = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)

    def __exit__(self, *exc: object) -> None:
        torch.set_default_dtype(self.saved)
