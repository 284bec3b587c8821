"""Triton pack and assemble kernels: one launch per round per worker.

It imports torch, triton and, from weightbridge, only the copy validation every implementation
shares (`weightbridge.execution.boxcopy`); weightbridge imports it only when parameters live on
a GPU.
`TritonKernels` satisfies weightbridge's `CopyKernels` protocol structurally and reads
`BoxCopy` descriptors by attribute. Importing compiles nothing; kernels compile on their first
launch.

Typical usage::

    kernels = TritonKernels()
    table = kernels.build_table(copies, tensors)   # once per plan (validates; ValueError)
    kernels.pack(table, send_buffer)               # one launch
    kernels.assemble(table, recv_buffer)           # one launch
"""

from typing import Any, Sequence

import torch

from kernels.assemble import assemble
from kernels.descriptors import BLOCK_COLS, BLOCK_ROWS, MAX_RANK, Descriptors, build_descriptors
from kernels.pack import pack

__all__ = ["Descriptors", "MAX_RANK", "TritonKernels", "assemble", "build_descriptors", "pack"]


class TritonKernels:
    """`CopyKernels` on Triton: build_table builds `Descriptors`, pack/assemble launch once."""

    def __init__(self, *, block_rows: int = BLOCK_ROWS, block_cols: int = BLOCK_COLS,
                 num_warps: int = 4) -> None:
        self.block_rows, self.block_cols, self.num_warps = block_rows, block_cols, num_warps

    def build_table(self, copies: Sequence[Any], tensors: Sequence[torch.Tensor]) -> Descriptors:
        return build_descriptors(copies, tensors, block_rows=self.block_rows,
                                 block_cols=self.block_cols)

    def pack(self, table: Descriptors, buffer: torch.Tensor) -> None:
        pack(table, buffer, num_warps=self.num_warps)

    def assemble(self, table: Descriptors, buffer: torch.Tensor) -> None:
        assemble(table, buffer, num_warps=self.num_warps)
