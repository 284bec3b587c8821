"""The emulated CUDA device's own rules (`weightbridge.testing.emulated_cuda`): what it refuses
and allows as real CUDA does, that it keeps real values, and its allocation counts."""

import gc
import threading

import pytest
import torch

from weightbridge.execution.cpu_kernels import CpuCopyKernels
from weightbridge.execution.executor import default_kernels
from weightbridge.testing import emulated_cuda


@pytest.fixture(autouse=True)
def emulated():
    with emulated_cuda.active():
        yield


def _device(*shape, dtype=torch.float32):
    return torch.arange(int(torch.tensor(shape).prod()), dtype=dtype, device="cuda").view(shape)


def test_tensors_report_cuda_and_keep_values():
    a = _device(3, 4)
    assert a.device == torch.device("cuda", 0) and a.is_cuda
    assert emulated_cuda.is_emulated(a) and emulated_cuda.is_emulated(a + 1)
    assert torch.equal((a * 2).cpu(), torch.arange(12.).view(3, 4) * 2)
    assert a[1, 2].item() == 6.0 and a.tolist()[2] == [8.0, 9.0, 10.0, 11.0]


@pytest.mark.parametrize("op", [
    lambda a: a + torch.ones(3, 4),                                    # host matrix operand
    lambda a: torch.ones(3, 4) * a,
    lambda a: a.index_select(0, torch.tensor([0, 1])),                 # host index, not indexing
    lambda a: torch.where(a > 2, a, torch.zeros(3, 4)),
    lambda a: torch.cat([a, torch.zeros(1, 4)]),
])
def test_an_op_mixing_a_host_tensor_is_refused(op):
    with pytest.raises(RuntimeError, match="same device"):
        op(_device(3, 4))


def test_out_on_the_host_is_refused():
    a = _device(3, 4)
    with pytest.raises(RuntimeError, match="Expected out tensor to have device cuda:0"):
        torch.ne(a[1:], a[:-1], out=torch.empty(2, 4, dtype=torch.bool))


def test_numpy_is_refused():
    with pytest.raises(TypeError, match="cpu"):
        _device(4).numpy()


def test_what_cuda_allows():
    a = _device(3, 4)
    host = torch.zeros(3, 4)
    host.copy_(a)                                                      # device -> host
    assert torch.equal(host, a.cpu())
    a.copy_(torch.ones(3, 4))                                          # host -> device
    assert torch.equal(a.cpu(), torch.ones(3, 4))
    assert (a + 2).is_cuda and (a + torch.tensor(2.0)).is_cuda         # scalars, 0-d host
    assert torch.equal(a[torch.tensor([0, 2])].cpu(), torch.ones(2, 4))  # host index tensor
    a[0:1] = torch.full((1, 4), 5.0)                                   # basic setitem: a copy
    assert a[0, 0].item() == 5.0
    assert torch.ones(2).to("cuda").is_cuda and torch.ones(2).cuda().is_cuda
    assert a.to(torch.bfloat16).is_cuda and not a.to("cpu").is_cuda


def test_views_share_the_device_values():
    a = _device(4, 4)
    a.t()[0].copy_(torch.full((4,), -1.0))                             # a column, in place
    assert torch.equal(a.cpu()[:, 0], torch.full((4,), -1.0))
    bits = a.view(torch.uint8)
    assert bits.is_cuda and bits.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
    assert not a.t().is_contiguous() and a.t().contiguous().is_contiguous()


def test_allocations_are_counted_once_per_storage_and_freed():
    gc.collect()
    base = emulated_cuda.memory.current
    emulated_cuda.memory.reset_peak()
    a = torch.zeros(1000, dtype=torch.uint8, device="cuda")
    views = [a[10:], a.view(torch.int32), a.view(10, 100)]             # no new memory
    assert emulated_cuda.memory.current - base == 1000
    b = a + 1                                                          # new memory
    assert emulated_cuda.memory.current - base == 2000
    del b, views
    gc.collect()
    assert emulated_cuda.memory.current - base == 1000
    assert emulated_cuda.memory.peak - base == 2000
    host = a.cpu()                                                     # host copies are free
    assert emulated_cuda.memory.current - base == 1000 and host.numel() == 1000


def test_activation_reaches_every_thread():
    seen = []
    t = threading.Thread(target=lambda: seen.append(torch.zeros(2, device="cuda").is_cuda))
    t.start()
    t.join(timeout=30)
    assert not t.is_alive() and seen == [True]


def test_kernels_stay_the_torch_path_on_the_emulated_device():
    # Kernel choice is by device; Triton needs real CUDA, which torch says is not here.
    assert not torch.cuda.is_available()
    assert isinstance(default_kernels(_device(2).device), CpuCopyKernels)


def test_deactivate_restores_torch():
    emulated_cuda.deactivate()
    try:
        with pytest.raises((RuntimeError, AssertionError)):
            torch.zeros(2, device="cuda")
    finally:
        emulated_cuda.activate()


def test_a_composite_op_making_tensors_of_its_own_runs_whole_on_the_values():
    # scaled_dot_product_attention allocates on the CUDA backend inside; it runs whole.
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=gen) for _ in range(3))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    got = torch.nn.functional.scaled_dot_product_attention(q.cuda(), k.cuda(), v.cuda(),
                                                           is_causal=True)
    assert got.is_cuda and torch.equal(got.cpu(), want)
    with pytest.raises(RuntimeError, match="same device"):
        torch.nn.functional.scaled_dot_product_attention(q.cuda(), k, v.cuda())


def test_the_demo_forward_runs_on_device_parameters():
    from meshes.forward import rank_forward
    from meshes.qwen3_moe import SIZES, RolloutShard

    host, dev = (RolloutShard(SIZES["tiny"], 1, 0, 1, 0, device=d) for d in ("cpu", "cuda"))
    gen = torch.Generator().manual_seed(0)
    for n, p in host.params.items():
        p.copy_(torch.randn(p.shape, generator=gen).to(p.dtype) * 0.02)
        dev.params[n].copy_(p)
    tokens = torch.randint(0, SIZES["tiny"].vocab, (1, 4), generator=gen)
    assert torch.equal(rank_forward(dev, tokens.cuda()).cpu(), rank_forward(host, tokens))
