"""What the trainer workers share: their gloo group and the safetensors directory they load from.

A trainer's HF load is collective: every rank calls ``load_weights`` with the same tensors, rank 0
writes them as one safetensors file into a directory all ranks know (`SharedCheckpointDir`), and
every rank reads its shards from it with ``torch.distributed.checkpoint``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from datetime import timedelta
from typing import Iterator, Mapping

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from . import models


def init_group(rank: int, world_size: int, master_port: int) -> bool:
    """Initialize the default gloo group unless one exists; True when this call made it."""
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
            raise ValueError(f"a process group already exists as rank {dist.get_rank()} of "
                             f"{dist.get_world_size()}, not rank {rank} of {world_size}: pass "
                             f"the existing group's rank and size")
        return False
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{master_port}", rank=rank,
                            world_size=world_size, timeout=timedelta(minutes=5))
    return True


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view of its storage) or the tensor itself, detached."""
    return (t._local_tensor if isinstance(t, DTensor) else t).detach()


class SharedCheckpointDir:
    """A temporary directory rank 0 creates and every rank of the group learns (collective)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        name = [tempfile.mkdtemp(prefix="trainer-ckpt-") if rank == 0 else None]
        dist.broadcast_object_list(name, src=0)
        self.path = os.fspath(name[0])

    @contextlib.contextmanager
    def written(self, state: Mapping[str, torch.Tensor]) -> Iterator[str]:
        """Rank 0 writes ``state`` as ``model.safetensors``; all ranks read inside the block.

        The barriers keep a rank from reading before the file is complete, and rank 0 from
        rewriting it while another rank still reads.
        """
        if self.rank == 0:  # clones: safetensors refuses tensors that share storage
            models.write_safetensors({n: t.clone() for n, t in state.items()}, self.path)
        dist.barrier()
        try:
            yield self.path
        finally:
            dist.barrier()

    def remove(self) -> None:
        if self.rank == 0:
            shutil.rmtree(self.path, ignore_errors=True)


def close_group(own_group: bool, shared: SharedCheckpointDir) -> None:
    """A trainer's teardown: wait for every rank, remove the shared checkpoint directory, and
    destroy the process group if the worker created it."""
    if dist.is_initialized():
        dist.barrier()
    shared.remove()
    if own_group and dist.is_initialized():
        dist.destroy_process_group()
