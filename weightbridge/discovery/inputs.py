"""What the probe takes in, checked and put in the form every pass reads it in.

The worker's parameters (a mapping, or a callable returning the live one) in memory order with
views into other parameters left out (`in_memory_order`), checked for names, tensors and dtypes
(`checked_params`); the checkpoint spec refused when it offers the loader nothing
(`check_spec`); and the torch threads the probe's own work and the loader run on (`threads`,
`with_threads`).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Iterator, Mapping

import torch

from weightbridge.discovery.codec import alphabet
from weightbridge.discovery.verify import dtype_name
from weightbridge.types import CheckpointSpec
from weightbridge.views import memory_order, without_aliases

Params = Mapping[str, torch.Tensor]
LoadWeights = Callable[[Iterable[tuple[str, torch.Tensor]]], object]


def in_memory_order(get: Callable[[], Params]) -> Callable[[], Params]:
    """The parameters as every later step sees them: views into another parameter's memory
    left out (written with it), transposed views in memory order."""
    aliases = None

    def live():
        nonlocal aliases
        params = get()
        if not isinstance(params, Mapping):
            return params  # checked_params refuses it
        params = dict(params)
        if aliases is None:
            # Decided on the engine's own tensors, before any probe load: a loader that assigns
            # checkpoint tensors would make the probe's overlapping ring views look like aliases.
            aliases = set(params) - set(without_aliases(params))
        return {n: memory_order(p) if isinstance(p, torch.Tensor) else p
                for n, p in params.items() if n not in aliases}
    return live


@contextlib.contextmanager
def threads(num: int) -> Iterator[None]:
    """Run torch's intra-op work on ``num`` threads for a while.

    The probe's own steps are many small, memory-bound ops over chunks of a few MB: a parallel
    region per op gains little there, and where another process holds a core it waits for a
    time slice every time (the probe ran 4-7x slower on two threads than on one on a 2-core
    machine with one core busy). ``torch.set_num_threads`` sets the calling thread's OpenMP
    count, so other threads of the process keep theirs.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(num)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def with_threads(load_weights: LoadWeights, num: int) -> LoadWeights:
    """The loader, run on the caller's ``num`` threads (its copies are big and gain from
    them)."""
    def load(weights):
        with threads(num):
            return load_weights(weights)
    return load


def check_spec(spec: CheckpointSpec) -> None:
    """Refuse a spec that offers the loader nothing, before any probe load: every parameter would
    come out unsourced, and transfers would silently never update them."""
    if not isinstance(spec, CheckpointSpec):
        raise ValueError(f"spec must be a CheckpointSpec, got {type(spec).__name__}: build it "
                         f"with weightbridge.read_checkpoint_spec(paths) or "
                         f"CheckpointSpec.from_tensors(state_dict)")
    if spec.numel:
        return
    what = ("has no tensors" if not spec.tensors else
            f"has only tensors of zero elements ({len(spec)})")
    raise ValueError(f"the checkpoint spec {what}, so layout discovery has no checkpoint element "
                     f"to offer load_weights and could map no parameter: build the spec from the "
                     f"checkpoint that load_weights reads, with "
                     f"weightbridge.read_checkpoint_spec(paths) or "
                     f"CheckpointSpec.from_tensors(state_dict)")


def checked_params(params: Params, shapes: dict | None) -> dict[str, torch.Tensor]:
    if not isinstance(params, Mapping):
        raise ValueError(f"params must be a Mapping[str, Tensor] or a callable returning one; "
                         f"got {type(params).__name__}")
    live = dict(params)
    if not live:
        raise ValueError("params is empty: pass the worker's parameters by name")
    for name, p in live.items():
        if not isinstance(p, torch.Tensor):
            raise ValueError(f"params[{name!r}] is a {type(p).__name__}, not a tensor")
        torch_dtype(dtype_name(p.dtype), f"parameter {name!r}")
    if shapes is not None:
        now = {n: (tuple(p.shape), p.dtype) for n, p in live.items()}
        if now != shapes:
            changed = sorted(set(now.items()) ^ set(shapes.items()))[:3]
            raise ValueError(f"the parameters changed between probe passes ({changed}): each "
                             f"load_weights call must leave the same names, shapes and dtypes")
    return live


def torch_dtype(name: str, what: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{what} has unknown dtype {name!r}")
    try:
        alphabet(dtype)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None
    return dtype


