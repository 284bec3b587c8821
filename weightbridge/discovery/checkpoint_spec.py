"""Read tensor specs from safetensors headers without touching tensor data.

A safetensors file starts with an 8-byte little-endian header length and a JSON header mapping
each tensor name to its dtype code, shape and byte range.
"""

from __future__ import annotations

import json
import struct
from typing import Sequence

from weightbridge.types import CheckpointSpec, TensorSpec

_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64",
           "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I8": "int8", "U8": "uint8",
           "I16": "int16", "I32": "int32", "I64": "int64", "BOOL": "bool"}


def read_header_specs(path: str) -> list[TensorSpec]:
    """TensorSpecs of one .safetensors file, in file order."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read a safetensors header from {path!r}: {e}") from e
    specs = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        code = entry["dtype"]
        if code not in _DTYPES:
            raise ValueError(f"{path!r}: tensor {name!r} has safetensors dtype {code!r}, which "
                             f"weightbridge does not know")
        specs.append(TensorSpec(name, tuple(entry["shape"]), _DTYPES[code]))
    return specs


def read_checkpoint_spec(paths: str | Sequence[str]) -> CheckpointSpec:
    """The `CheckpointSpec` of one or more ``.safetensors`` files; reads the JSON headers only.

    Raises:
        ValueError: no path given, or a file that is not safetensors.
    """
    files = [paths] if isinstance(paths, str) else list(paths)
    if not files:
        raise ValueError("read_checkpoint_spec needs at least one .safetensors path")
    return CheckpointSpec(tuple(spec for f in files for spec in read_header_specs(f)))
