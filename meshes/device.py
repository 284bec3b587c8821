"""Where a proc's worker keeps its parameters: its own GPU, chosen by its place on its host.

A proc mesh spawned with ``per_host={"gpus": N}`` (or any one per-host dimension: the
controller's ``"worker"``) puts N procs on each host; the proc at coordinate g of that last
dimension binds GPU ``g`` (``torch.cuda.set_device``), so the procs of a host never share a GPU.
Without CUDA every proc uses the CPU.

Typical usage (in an actor's ``__init__``, or a worker factory it calls)::

    device = bind_local_device()          # cuda:g bound where CUDA is available, else cpu
    shard = RolloutShard(config, tp, tp_rank, 1, 0, device=device)
"""

from __future__ import annotations

import torch


def local_rank(point) -> int:
    """This proc's place on its host: its coordinate along the mesh's last (per-host)
    dimension; 0 outside a mesh."""
    labels = list(point) if point is not None else []
    return point[labels[-1]] if labels else 0


def bind_local_device(point=None) -> torch.device:
    """Bind and return this proc's device: ``cuda:<local rank mod GPUs>`` where CUDA is
    available (set as the current device, so launches and allocations without an explicit
    device go there), else the CPU. ``point``: the proc's mesh position (default: the current
    actor's, `monarch.actor.current_rank`)."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    if point is None:
        from monarch.actor import current_rank  # only inside an actor
        point = current_rank()
    device = torch.device("cuda", local_rank(point) % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device
