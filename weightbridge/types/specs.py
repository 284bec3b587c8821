"""Checkpoint and parameter specs: names, shapes and dtypes, no data."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)


class TensorSpec:
    """Name, shape and dtype of one tensor.

    Example: ``TensorSpec("model.layers.0.mlp.gate_proj.weight", (768, 2048), "bfloat16")``
    """

    name: str
    """Checkpoint FQN (or parameter FQN when used as a `ParamSpec`)."""
    shape: tuple[int, ...]
    """Logical shape; ``()`` for a 0-d tensor."""
    dtype: str
    """torch dtype name without the ``torch.`` prefix, e.g. ``"bfloat16"``."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


ParamSpec = TensorSpec
"""A runtime parameter's name, shape and dtype (same fields as a checkpoint tensor)."""


@dataclass(frozen=True, slots=True)


class CheckpointSpec:
    """The checkpoint both sides agree on: the common coordinate system of layout discovery.

    Build it from tensors (``CheckpointSpec.from_tensors(state_dict)``) or from safetensors
    headers (``weightbridge.read_checkpoint_spec("model.safetensors")``; no tensor data is read).

    Example: ``CheckpointSpec((TensorSpec("lm_head.weight", (151936, 2048), "bfloat16"), ...))``
    """

    tensors: tuple[TensorSpec, ...]
    """Every checkpoint tensor, in a fixed order (the order of global element indices)."""
    _by_name: dict[str, int] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        by_name: dict[str, int] = {}
        for i, t in enumerate(self.tensors):
            if t.name in by_name:
                raise ValueError(f"checkpoint tensor {t.name!r} appears twice; names must be "
                                 f"unique")
            by_name[t.name] = i
        object.__setattr__(self, "_by_name", by_name)

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, "torch.Tensor"]) -> "CheckpointSpec":
        """Spec of an in-memory checkpoint (a name -> tensor mapping)."""
        return cls(tuple(TensorSpec(n, tuple(t.shape), str(t.dtype).removeprefix("torch."))
                         for n, t in tensors.items()))

    def __getitem__(self, name: str) -> TensorSpec:
        try:
            return self.tensors[self._by_name[name]]
        except KeyError:
            raise KeyError(f"{name!r} is not a tensor of this checkpoint") from None

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __len__(self) -> int:
        return len(self.tensors)

    def index(self, name: str) -> int:
        """Position of a tensor in `tensors`."""
        return self._by_name[name]

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.tensors)

    def differences(self, other: "CheckpointSpec", labels: tuple[str, str] = ("this", "other")
                    ) -> tuple[str, ...]:
        """One line per tensor that is missing on one side or has another shape or dtype.

        Tensor order is ignored (source maps address tensors by name). Empty when both specs
        describe the same tensors.

        Example: ``("'lm_head.weight': trainer (1024, 128) bfloat16, rollout (1000, 128)
        bfloat16",)`` for ``labels=("trainer", "rollout")``.
        """
        out = []
        for t in self.tensors:
            if t.name not in other:
                out.append(f"{t.name!r}: only in {labels[0]}")
                continue
            o = other[t.name]
            if (t.shape, t.dtype) != (o.shape, o.dtype):
                out.append(f"{t.name!r}: {labels[0]} {t.shape} {t.dtype}, "
                           f"{labels[1]} {o.shape} {o.dtype}")
        out += [f"{t.name!r}: only in {labels[1]}" for t in other.tensors if t.name not in self]
        return tuple(out)


_ITEMSIZE = {"float64": 8, "int64": 8, "uint64": 8, "complex64": 8, "float32": 4, "int32": 4,
             "uint32": 4, "float16": 2, "bfloat16": 2, "int16": 2, "uint16": 2, "int8": 1,
             "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1,
             "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1, "complex128": 16}


def dtype_itemsize(dtype: str) -> int:
    """Bytes per element of a dtype name, e.g. 2 for ``"bfloat16"``."""
    try:
        return _ITEMSIZE[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; expected a torch dtype name such as "
                         f"'bfloat16'") from None


CONVERTIBLE_DTYPES = ("float32", "bfloat16", "float16")
"""Dtypes the copy kernels convert between on pack or assemble (any pair, round to nearest
even through float32, as torch casts). Other casts (to or from float8) are refused at connect."""

QUANT_DTYPE = "float8_e4m3fn"
"""Element dtype of block-quantized parameters and of their bytes on the wire
(`weightbridge.quant`)."""
SCALE_DTYPE = "float32"
"""Dtype of their block scales."""
