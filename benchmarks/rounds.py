"""Synthetic rounds for the kernel benchmarks: what a worker's pack or assemble moves per round.

Each builder returns ``(copies, tensors)``: `BoxCopy` descriptors over freshly allocated tensors
of random bits, with the boxes laid back to back in the buffer.
"""

from __future__ import annotations

import torch

from weightbridge.types import BoxCopy


def random_bits(dtype: torch.dtype, shape: tuple[int, ...], device: str = "cpu") -> torch.Tensor:
    n = torch.Size(shape).numel() * dtype.itemsize
    return torch.randint(0, 256, (n,), dtype=torch.uint8, device=device).view(dtype).view(shape)


def column_shard_round(region_bytes: int, round_bytes: int, device: str = "cpu"
                       ) -> tuple[list[BoxCopy], list[torch.Tensor]]:
    """``round_bytes`` of (rows, 1024)-column shards of (R, 4096) bf16 matrices, one shard of
    ``region_bytes`` per box (a TP-4 column split; 2-d strided boxes)."""
    cols, row_len = 1024, 4096
    rows = max(1, region_bytes // (2 * cols))
    per_matrix = 4 * max(1, (16 << 20) // (rows * row_len * 2))  # 4 column shards per row block
    tensors, copies = [], []
    for i in range(round_bytes // region_bytes):
        if i % per_matrix == 0:
            tensors.append(random_bits(torch.bfloat16, (rows * per_matrix // 4, row_len), device))
        k = i % per_matrix
        offset = (k // 4) * rows * row_len + (k % 4) * cols
        copies.append(BoxCopy(len(tensors) - 1, offset, (rows, cols), (row_len, 1),
                              i * region_bytes))
    return copies, tensors


def mixed_round(num_layers: int = 2, hidden: int = 2048, device: str = "cpu"
                ) -> tuple[list[BoxCopy], list[torch.Tensor]]:
    """Per layer: bf16 q/k/v/o column shards, a transposed shard, bf16 MLP row shards, an fp8
    weight, fp32 norms, 64 tiny bias pieces at unaligned offsets, and a reversed box."""
    tensors: list[torch.Tensor] = []
    copies: list[BoxCopy] = []
    pos = 0
    h, ffn = hidden, hidden * 11 // 4

    def add(dtype, shape, offset, box_shape, strides, gap=0):
        nonlocal pos
        if shape is not None:
            tensors.append(random_bits(dtype, shape, device))
        pos += gap
        copies.append(BoxCopy(len(tensors) - 1, offset, box_shape, strides, pos))
        pos += torch.Size(box_shape).numel() * dtype.itemsize

    for _ in range(num_layers):
        for _ in ("q", "k", "v", "o"):
            add(torch.bfloat16, (h, h), h // 2, (h, h // 2), (h, 1))
        add(torch.bfloat16, (h, h), 0, (h, h // 2), (1, h))  # transposed shard
        for _ in range(2):
            add(torch.bfloat16, (ffn, h), ffn // 2 * h, (ffn // 2, h), (h, 1))
        add(torch.float8_e4m3fn, (h, h), 0, (h, h // 2), (h, 1))
        for _ in range(2):
            add(torch.float32, (h,), 0, (h,), (1,))
        add(torch.bfloat16, (64 * 96,), 0, (32,), (1,))
        for j in range(1, 64):
            add(torch.bfloat16, None, j * 96, (32,), (1,), gap=j % 3)
        add(torch.bfloat16, (h // 2, h // 8), (h // 2 - 1) * (h // 8), (h // 2, h // 8),
            (-(h // 8), 1))  # reversed rows
    return copies, tensors


def plan_copies(num_copies: int) -> tuple[list[BoxCopy], list[torch.Tensor]]:
    """A plan-sized table: (16, 32) and transposed (32, 16) shards of 64 bf16 (256, 512) params."""
    tensors = [torch.empty((256, 512), dtype=torch.bfloat16) for _ in range(64)]
    copies = []
    for i in range(num_copies):
        offset = (i % 16) * 16 * 512
        if i % 5 == 0:
            copies.append(BoxCopy(i % 64, offset, (32, 16), (1, 512), i * 1024))
        else:
            copies.append(BoxCopy(i % 64, offset, (16, 32), (512, 1), i * 1024))
    return copies, tensors
