"""run_plan_locally: each rollout parameter ends bit-identical to its own load of the checkpoint."""

import pytest
import torch
from planning_layouts import (checkpoint, fsdp_trainer, fused_rollout, loaded, params_of,
                              same_bytes, tp_trainer)

from weightbridge import Placement, plan_transfer, run_plan_locally
from weightbridge.execution.boxcopy import TorchCopyKernels


def _check(trainers, rollouts, round_bytes, *, kernels=None, strided=False):
    ckpt = checkpoint(seed=len(trainers) * 31 + len(rollouts))
    plan = plan_transfer(trainers, rollouts, round_bytes=round_bytes)
    tparams = [loaded(m, ckpt) for m, _ in trainers]
    # Rollout params start as NaN-ish garbage so untouched (unsourced) bytes are checkable.
    rparams = [params_of(m, fill=7.0) for m, _ in rollouts]
    if strided:  # rollout params no dim order makes dense: rows padded by one element
        rparams = [{k: (_padded_rows(v) if v.dim() == 2 else v) for k, v in p.items()}
                   for p in rparams]
    run_plan_locally(plan, tparams, rparams, kernels=kernels)
    for (m, _), got in zip(rollouts, rparams):
        want = loaded(m, ckpt, fill=7.0)
        for name in want:
            assert same_bytes(got[name], want[name]), name
    return plan


def _padded_rows(v: torch.Tensor) -> torch.Tensor:
    out = torch.empty(v.shape[0], v.shape[1] + 1, dtype=v.dtype)[:, :v.shape[1]]
    return out.copy_(v)


def _engines(num_engines, tp, *, ep=1, gpus_per_node=2):
    return [(fused_rollout(r, tp, ep=ep), Placement(f"r{(e * tp + r) // gpus_per_node}", engine=e))
            for e in range(num_engines) for r in range(tp)]


@pytest.mark.parametrize("round_bytes", [64, 200, 1 << 20])
def test_tp_mismatch_with_replicated_engines_is_bit_exact(round_bytes):
    trainers = [(tp_trainer(r, 2), Placement("t0")) for r in range(2)]
    _check(trainers, _engines(3, 3, ep=3), round_bytes)


def test_dp_replicated_trainers_and_single_rollout_is_bit_exact():
    tmap = tp_trainer(0, 1)
    trainers = [(tmap, Placement(f"t{i}")) for i in range(3)]
    _check(trainers, _engines(1, 1), 128)


def test_fsdp_flat_trainer_pieces_crossing_tensor_boundaries_is_bit_exact():
    trainers = [(fsdp_trainer(r, 5), Placement(f"t{r // 2}")) for r in range(5)]
    _check(trainers, _engines(2, 2, ep=2), 96)


def test_pipeline_and_expert_split_trainers_to_ep_rollouts_is_bit_exact():
    # PP-like: experts 0-1 on one trainer, 2-3 on another; attn/mlp on a TP4 group.
    trainers = [(tp_trainer(r, 4, experts=range(2 * (r % 2), 2 * (r % 2) + 2)),
                 Placement(f"t{r}")) for r in range(4)]
    _check(trainers, _engines(2, 2, ep=2, gpus_per_node=4), 160)


def test_strided_rollout_params_are_written_back():
    trainers = [(tp_trainer(r, 2), Placement("t0")) for r in range(2)]
    _check(trainers, _engines(2, 2), 256, strided=True)


def test_injected_kernels_are_used():
    calls = []

    class Counting(TorchCopyKernels):
        def pack(self, table, buffer):
            calls.append("pack")
            super().pack(table, buffer)

        def assemble(self, table, buffer):
            calls.append("assemble")
            super().assemble(table, buffer)

    trainers = [(tp_trainer(0, 1), Placement("t0"))]
    _check(trainers, _engines(1, 2), 1 << 20, kernels=Counting())
    assert "pack" in calls and "assemble" in calls


def test_wrong_number_of_param_mappings_is_rejected():
    trainers = [(tp_trainer(0, 1), Placement("t0"))]
    rollouts = _engines(1, 1)
    plan = plan_transfer(trainers, rollouts, round_bytes=1 << 20)
    with pytest.raises(ValueError, match="rollout parameter mappings"):
        run_plan_locally(plan, [params_of(trainers[0][0])], [])


def test_param_of_wrong_shape_is_rejected():
    trainers = [(tp_trainer(0, 1), Placement("t0"))]
    rollouts = _engines(1, 1)
    plan = plan_transfer(trainers, rollouts, round_bytes=1 << 20)
    bad = params_of(rollouts[0][0])
    bad["mlp_t"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="mlp_t"):
        run_plan_locally(plan, [params_of(trainers[0][0])], [bad])


def test_probed_rollout_with_a_transposed_view_parameter_is_bit_exact():
    """A rollout parameter held as a transposed view (an engine keeping o_proj column-major) is
    probed in memory order; run_plan_locally must hand the executor that same view, not a
    logical-order contiguous copy of it (which its map does not describe)."""
    from weightbridge import CheckpointSpec, extract_source_map

    ckpt = {"o_proj.weight": torch.randn(32, 64).bfloat16(), "norm": torch.randn(64).bfloat16()}
    spec = CheckpointSpec.from_tensors(ckpt)

    def worker(transposed: bool):
        o = torch.zeros(64, 32, dtype=torch.bfloat16).t() if transposed else \
            torch.zeros(32, 64, dtype=torch.bfloat16)
        params = {"o_proj.weight": o, "norm": torch.zeros(64, dtype=torch.bfloat16)}

        @torch.no_grad()
        def load_weights(weights):
            for name, w in weights:
                params[name].copy_(w)

        return params, load_weights

    tparams, tload = worker(transposed=False)
    rparams, rload = worker(transposed=True)
    tmap = extract_source_map(tparams, tload, spec)
    rmap = extract_source_map(rparams, rload, spec)
    plan = plan_transfer([(tmap, Placement("t0"))], [(rmap, Placement("r0", engine=0))],
                         round_bytes=1 << 10)
    tload(ckpt.items())
    for p in rparams.values():
        p.zero_()
    run_plan_locally(plan, [tparams], [rparams])
    for name, want in ckpt.items():
        assert same_bytes(rparams[name], want), name
    assert rparams["o_proj.weight"].stride() == (1, 32)  # still the engine's own view
