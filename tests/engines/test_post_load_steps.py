"""vLLM's post-load steps and WeightBridge: included when they copy, refused when they change
values.

- A value-changing step inside the probed loader (DeepSeek's routed scaling folded into the
  experts' ``w2``, as engines do to save a multiply; or an exact power-of-two rescale) is refused
  by the probe with a `LayoutError` that says what to do, before any byte moves.
- The value-preserving steps vLLM really runs (CPU MoE prepacking, MLA's W_UK_T / W_UV) are part
  of the probed loader: weights written into ``params`` by the map alone, without running any
  loader, make the engine's MLP / MoE blocks and projections compute bit-identical outputs to an
  engine that loaded the same checkpoint at start-up.
- vLLM 0.32's own in-place reload on CPU skips the MoE repack on reloads (see
  `examples.engines.vllm_steps._forget_moe_kernels`): its MoE outputs are wrong exactly when
  the CPU kernel prepacks, which `VllmWorker` fixes.
"""

from __future__ import annotations

import pytest
import torch

from examples.engines import models
from weightbridge import LayoutError, extract_source_map
from weightbridge.discovery.replay import replay

pytestmark = pytest.mark.engines

MODULES = {
    "qwen3_moe": ["model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.o_proj",
                  "model.layers.0.mlp", "model.layers.1.mlp"],
    "deepseek_v3": ["model.layers.1.self_attn.fused_qkv_a_proj",
                    "model.layers.1.self_attn.q_b_proj", "model.layers.1.self_attn.o_proj",
                    "model.layers.0.mlp", "model.layers.1.mlp"],
}
MOE_BLOCK = "model.layers.1.mlp"


# --------------------------------------------------------------------------------------------
# Rank bodies (spawned processes)
# --------------------------------------------------------------------------------------------


def refused_steps(rank: int, world_size: int, port: int) -> dict[str, str]:
    """Probe DeepSeek-V3 through loaders with value-changing post-load steps; the errors."""
    from examples.engines.vllm_rollout import VllmWorker

    model = "deepseek_v3"
    scale = models.hf_config(model)["routed_scaling_factor"]
    worker = VllmWorker(model, rank=rank, world_size=world_size, master_port=port)
    w2 = [p for n, p in worker.params.items() if n.endswith("w2_weight")]

    def folded(factor: float):
        def load_weights(weights) -> None:
            worker.load_weights(weights)
            with torch.no_grad():
                for p in w2:
                    p.mul_(factor)  # fold the routed scaling into the experts' down projection
        return load_weights

    errors = {}
    try:
        for label, factor in (("routed_scaling_factor", scale), ("power_of_two", 2.0)):
            try:
                extract_source_map(worker.params, folded(factor), models.checkpoint_spec(model))
                errors[label] = "no error"
            except LayoutError as e:
                errors[label] = f"LayoutError: {e}"
    finally:
        worker.close()
    return errors


def _call(worker, name: str) -> torch.Tensor:
    """The module's output for 5 fixed pseudo-random tokens (a linear layer's own input width,
    the hidden size for MLP blocks)."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    module = worker.model.get_submodule(name)
    width = getattr(module, "input_size", models.hf_config(worker.model_name)["hidden_size"])
    x = torch.randn(5, width, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with set_current_vllm_config(worker.vllm_config), \
            set_forward_context(None, worker.vllm_config), torch.no_grad():
        y = module(x)
    return y[0] if isinstance(y, tuple) else y


def transferred_outputs(rank: int, world_size: int, port: int, model: str) -> dict:
    """Serve v1, write v3 by replaying the map (no loader), compare outputs with a fresh v3."""
    from examples.engines import vllm_steps
    from examples.engines.vllm_rollout import VllmWorker

    v1, v3 = models.checkpoint(model, 1), models.checkpoint(model, 3)
    worker = VllmWorker(model, rank=rank, world_size=world_size, master_port=port,
                        weights=v1.items())
    fresh = VllmWorker(model, rank=rank, world_size=world_size, master_port=port,
                       weights=v3.items())
    try:
        smap = extract_source_map(worker.params, worker.load_weights, models.checkpoint_spec(model))
        worker.load_weights(v1.items())  # the probe overwrote the weights: serve v1 again
        before = {n: _call(worker, n) for n in MODULES[model]}
        replay(smap, worker.params, v3)  # what a transfer does: bytes into params, nothing else
        out = {"transferred": {n: torch.equal(_call(worker, n), _call(fresh, n))
                               for n in MODULES[model]},
               "changed": {n: not torch.equal(before[n], _call(fresh, n))
                           for n in MODULES[model]}}
        # vLLM's reload alone, without the worker's MoE fix
        fix = vllm_steps._forget_moe_kernels
        vllm_steps._forget_moe_kernels = lambda model: None
        try:
            worker.load_weights(v3.items())
        finally:
            vllm_steps._forget_moe_kernels = fix
        out["unfixed_reload_moe_equal"] = torch.equal(_call(worker, MOE_BLOCK),
                                                      _call(fresh, MOE_BLOCK))
        w13 = fresh.params[MOE_BLOCK + ".experts.routed_experts.w13_weight"]
        e = MOE_BLOCK + ".experts.{}.{}_proj.weight"
        plain = torch.stack([torch.cat([v3[e.format(i, "gate")], v3[e.format(i, "up")]])
                             for i in range(w13.shape[0])])
        out["cpu_prepacks_moe"] = not torch.equal(w13.detach(), plain)
        return out
    finally:
        fresh.close()
        worker.close()


# --------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------


def test_value_changing_post_load_step_is_refused_with_what_to_do(spawn_ranks):
    (errors,) = spawn_ranks(refused_steps, 1)
    for label, message in errors.items():
        print(f"{label}: {message}")
        assert message.startswith("LayoutError: "), (label, message)
        assert "w2_weight" in message, (label, message)  # names the parameter
        assert "move value-changing steps out of the probed loader" in message, (label, message)


@pytest.mark.parametrize("model", list(MODULES))
def test_transferred_params_serve_like_a_fresh_engine(model, spawn_ranks):
    (res,) = spawn_ranks(transferred_outputs, 1, model)
    assert all(res["changed"].values()), res["changed"]  # v1 and v3 outputs differ: not vacuous
    assert all(res["transferred"].values()), res["transferred"]
    # vLLM's own reload is right exactly when this CPU's MoE kernel does not prepack
    assert res["unfixed_reload_moe_equal"] == (not res["cpu_prepacks_moe"])
