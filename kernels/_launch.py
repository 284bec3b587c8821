"""Checks the launchers run before every launch: O(1), no device sync."""

import os

import torch

from kernels.descriptors import Descriptors


def check_launch(desc: Descriptors, buffer: torch.Tensor) -> None:
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
        raise ValueError(f"the buffer must be a 1-d contiguous torch.uint8 tensor, got dtype "
                         f"{buffer.dtype} and shape {tuple(buffer.shape)}; pass "
                         "buffer.view(torch.uint8).flatten()")
    if buffer.numel() < desc.nbytes:
        raise ValueError(f"the buffer has {buffer.numel()} bytes but the table needs "
                         f"{desc.nbytes}; allocate at least table.nbytes bytes")
    if desc.device is not None and buffer.device != desc.device:
        raise ValueError(f"the buffer is on {buffer.device} but the table's tensors are on "
                         f"{desc.device}; move the buffer or build the table for that device")
    if buffer.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"the Triton kernels run on CUDA tensors, got {buffer.device}; use "
                         "weightbridge.execution.cpu_kernels.CpuCopyKernels on the CPU (tests "
                         "may set TRITON_INTERPRET=1 before importing triton)")
