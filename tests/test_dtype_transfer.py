"""Dtype conversion inside the plan: fp32 trainers updating rollouts whose loaders cast.

The trainers write (and hold) a float32 checkpoint; each rollout's own ``load_weights`` casts it
to its dtype with ``copy_``. The probe records the cast, the plan sends the narrower dtype (its
bytes, rounds and Eq. (1) ideal in that dtype) and the trainers' pack converts; after every
update each rollout parameter must equal, bit for bit, its own loader's result. A widening
rollout (bf16 checkpoint, fp32 parameters) gets bf16 bytes and converts in its assemble.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from meshes.fp8_rollout import Fp8RolloutShard
from meshes.qwen3_moe import SIZES, RolloutShard, TrainerShard, checkpoint_spec
from moegroup import dtype_name, probed_workers
from weightbridge import (CpuCopyKernels, run_plan_locally)
from weightbridge.planning.ideal import eq1

CONFIG = SIZES["tiny"]


def _checkpoint(spec, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {t.name: (torch.randn(t.shape, generator=gen) * 3).to(getattr(torch, t.dtype))
            for t in spec.tensors}


def _update_and_check(spec, trainers, rollouts, plan, kernels, seeds) -> None:
    received = [{n: torch.zeros_like(p) for n, p in w.params.items()} for w in rollouts]
    for seed in seeds:  # several versions through the same plan and buffers
        weights = _checkpoint(spec, seed)
        for w in trainers:
            w.load_weights(weights.items())
        run_plan_locally(plan, [w.params for w in trainers], received, kernels=kernels)
        for w, got in zip(rollouts, received):
            for p in w.params.values():
                p.zero_()
            w.load_weights(weights.items())  # the rollout's own cast of the same checkpoint
            for name, want in w.params.items():
                assert torch.equal(got[name].view(torch.uint8), want.view(torch.uint8)), \
                    (seed, name)


@pytest.mark.parametrize("rollout_dtype, kernels", [
    (torch.bfloat16, None), (torch.bfloat16, CpuCopyKernels()), (torch.float16, CpuCopyKernels()),
], ids=["bf16-reference", "bf16-cpu", "fp16-cpu"])
@pytest.mark.slow
def test_fp32_trainers_update_narrower_rollouts_bit_exactly(rollout_dtype, kernels):
    spec, trainers, rollouts, rmaps, plan = probed_workers(torch.float32, rollout_dtype)
    assert {p.cast_from for m in rmaps for p in m.pieces} == {"float32"}
    overlaps = plan.correspondence.overlaps
    assert {(o.dtype, o.source_dtype, o.target_dtype) for o in overlaps} == {
        (dtype_name(rollout_dtype), "float32", None)}
    _update_and_check(spec, trainers, rollouts, plan, kernels, seeds=(3, 4, 5))


@pytest.mark.slow
def test_plan_bytes_and_eq1_are_in_the_wire_dtype():
    """The converted plan moves half the bytes of the same layout sent as fp32 (fp32 rollouts,
    planned in the same test), in fewer rounds, and its Eq. (1) ideal halves with them."""
    *_, rmaps, converted = probed_workers(torch.float32, torch.bfloat16)
    *_, fp32 = probed_workers(torch.float32, torch.float32)
    needed = sum(o.region.numel for o in converted.correspondence.overlaps)
    assert needed == sum(o.region.numel for o in fp32.correspondence.overlaps)
    assert converted.correspondence.nbytes == 2 * needed
    assert fp32.correspondence.nbytes == 4 * needed
    assert converted.num_rounds < fp32.num_rounds
    rates = dict(trainer_node_bandwidth=1e9, rollout_node_bandwidth=1e9)
    assert eq1(converted, **rates) * 2 == pytest.approx(eq1(fp32, **rates))
    sent = sum(w.nbytes for r in converted.rounds for w in r.transfers
               if w.stage.value == "receive")
    assert sent >= converted.correspondence.nbytes  # every element leaves the trainers once
    assert sent < fp32.correspondence.nbytes


@pytest.mark.parametrize("kernels", [None, CpuCopyKernels()], ids=["reference", "cpu"])
@pytest.mark.slow
def test_widening_rollouts_receive_the_narrow_dtype_and_convert_on_assemble(kernels):
    """bf16 trainers and checkpoint, fp32 rollouts (their loaders widen): bf16 on the wire."""
    spec, trainers, rollouts, rmaps, plan = probed_workers(torch.bfloat16, torch.float32)
    assert {(o.dtype, o.source_dtype, o.target_dtype)
            for o in plan.correspondence.overlaps} == {("bfloat16", None, "float32")}
    _update_and_check(spec, trainers, rollouts, plan, kernels, seeds=(6, 7))


@pytest.mark.slow
def test_fp32_master_trainers_of_a_bf16_checkpoint_send_bf16():
    """Trainers widen a bf16 checkpoint into fp32 parameters (exact), rollouts load it as is:
    the trainers' pack narrows back, exactly."""
    spec, trainers, rollouts, _, plan = probed_workers(torch.float32, torch.bfloat16,
                                                 ckpt_dtype=torch.bfloat16)
    assert {(o.dtype, o.source_dtype) for o in plan.correspondence.overlaps} == {
        ("bfloat16", "float32")}
    _update_and_check(spec, trainers, rollouts, plan, CpuCopyKernels(), seeds=(8, 9))


_ADAPTER_CASES = {
    "fp32-to-bf16": (torch.float32, lambda k: RolloutShard(CONFIG, 2, k, 1, 0),
                     {("bfloat16", "float32")}),
    "bf16-to-fp8": (torch.bfloat16, lambda k: Fp8RolloutShard(CONFIG, 2, k, 1, 0, block=(32, 32)),
                    {("float8_e4m3fn", "bfloat16"), ("float32", "bfloat16"), ("bfloat16", None)}),
}
"""trainer dtype, rollout shard of rank k, the plan's (wire dtype, trainer dtype) pairs."""


@pytest.mark.parametrize("case", sorted(_ADAPTER_CASES))
@pytest.mark.parametrize("staging", [(False, False), (True, True)], ids=["sync", "async"])
@pytest.mark.slow
def test_adapters_install_bit_exact_converted_versions(staging, case):
    """The user-actor path (SenderAdapter / ReceiverAdapter, in one process): fp32 trainers
    send, bf16 rollouts install (or bf16 trainers, block-scaled FP8 rollouts: their pack
    quantizes); with staging on both sides the converted bytes go through the host staging
    copies too."""
    from weightbridge import ReceiverAdapter, SenderAdapter, TransferConfig
    from weightbridge.coordination.local_control import LocalControl

    trainer_dtype, rollout_shard, wire = _ADAPTER_CASES[case]
    spec = checkpoint_spec(CONFIG, dtype_name(trainer_dtype))
    versions = {v: _checkpoint(spec, 50 + v) for v in range(3)}
    config = TransferConfig(sender_staging=staging[0], receiver_staging=staging[1],
                            round_bytes=96 << 10, timeout_s=30)
    control = LocalControl()
    trainers, rollouts = [], []
    for i in range(2):
        shard = TrainerShard(CONFIG, 2, i, 1, 0, dtype=trainer_dtype)
        shard.load_weights(versions[0].items())
        trainers.append((shard, control.add(SenderAdapter(
            shard.params, shard.load_weights, spec, rank=i, control=control,
            transport=control.transport, config=config))))
    for k in range(2):
        shard = rollout_shard(k)
        shard.load_weights(versions[0].items())
        rollouts.append((shard, control.add(ReceiverAdapter(
            shard.params, shard.load_weights, spec, rank=k, engine=0, engine_rank=k,
            engine_size=2, control=control, transport=control.transport, config=config))))
    reference = {}
    for v, ckpt in versions.items():
        for k in range(2):
            ref = rollout_shard(k)
            ref.load_weights(ckpt.items())
            reference[v, k] = ref.params
    errors: list[BaseException] = []
    done = [False]
    barrier = threading.Barrier(2, action=lambda: done.__setitem__(
        0, all(a.version == 2 for _, a in rollouts)))

    def connect(adapter):
        try:
            adapter.connect()
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    def train(shard, adapter):
        try:
            for v in (1, 2):
                shard.load_weights(versions[v].items())  # the optimizer step
                adapter.send_weights(v)
            if adapter.worker.index == 0 and config.sender_staging:
                adapter.wait_idle()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    def serve(shard, adapter):
        try:
            deadline = time.monotonic() + 60  # async polls return at once: bound by time
            while time.monotonic() < deadline:
                v = adapter.poll_requests()
                if v is not None:
                    want = reference[v, adapter.engine_rank]
                    for name, p in shard.params.items():
                        assert torch.equal(p.view(torch.uint8), want[name].view(torch.uint8)), \
                            (v, name)
                barrier.wait(timeout=30)
                if done[0]:
                    return
        except threading.BrokenBarrierError:
            pass
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            barrier.abort()

    _join([threading.Thread(target=connect, args=(a,)) for _, a in trainers])  # probes all
    assert not errors, errors
    _join([threading.Thread(target=train, args=t) for t in trainers]
          + [threading.Thread(target=serve, args=r) for r in rollouts])
    assert not errors, errors
    assert all(a.version == 2 for _, a in rollouts)
    assert {(o.dtype, o.source_dtype) for o in trainers[0][1].plan.correspondence.overlaps} \
        == wire


def _join(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a worker hung"
