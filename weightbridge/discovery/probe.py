"""Layout discovery: probe a worker's own ``load_weights`` and return its `SourceMap`.

The loader is a black box. Each probe pass offers it the full checkpoint with every element set
to a digit of its own index (`codec`), reads the parameters back, and keeps only where runs of
indices begin (`runs`, `boxes`). A last pass loads a pseudo-random checkpoint and checks that the map
reproduces every parameter bit-exactly, so a loader that changes values is refused here, before
any transfer, instead of corrupting weights later.

Typical usage::

    spec = read_checkpoint_spec(paths)
    smap = extract_source_map(dict(model.named_parameters()), model.load_weights, spec)
    # the probe overwrote the parameters: load the real weights (or receive them) afterwards

The loader contract: ``load_weights(weights)`` takes an iterable of ``(name, tensor)`` pairs
(any order may be read, tensors may be read twice or skipped) and performs *every* step from
checkpoint tensors to the runtime parameters, post-load shuffles for kernels included, using
only copies that preserve values (slicing, concatenation, transposes, permutations, padding).
Value-changing steps (scaling, casting, quantizing) are refused with a `LayoutError`.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, Mapping

import torch

from weightbridge.discovery.boxes import TensorIndex, box_to_pieces, group_boxes
from weightbridge.discovery.codec import Alphabet, alphabet, digits_to_values
from weightbridge.discovery.diagnose import source_tensor
from weightbridge.discovery.runs import CHUNK, PassRuns, Runs, merge_passes, scan_pass
from weightbridge.errors import LayoutError
from weightbridge.types import CheckpointSpec, ParamSpec, Piece, SourceMap
from weightbridge.views import memory_order, without_aliases

Params = Mapping[str, torch.Tensor]
LoadWeights = Callable[[Iterable[tuple[str, torch.Tensor]]], object]

_VERIFY_SEED = 0x5EED
_MAX_RING_PERIOD = 1 << 20
_RING_SPAN = 65_521
"""Random verification tensors are views into one random ring at offsets below this."""
_RANDOM_PERIOD = (1 << 20) + 7
"""Period of the random ring: odd, so rows of power-of-two tensors never line up with it."""


def extract_source_map(params: Params | Callable[[], Params], load_weights: LoadWeights,
                       spec: CheckpointSpec, *, verify: bool = True) -> SourceMap:
    """Discover which checkpoint element every parameter element of this worker comes from.

    Args:
        params: the worker's parameters by name, or a zero-argument callable returning the live
            mapping (for loaders that replace parameter tensors instead of copying into them).
            A transposed view of a contiguous tensor is mapped in its memory order, and a
            view into another parameter's memory is left out of the map (`weightbridge.views`).
        load_weights: the engine's loader, ``load_weights(Iterable[(name, tensor)])``.
        spec: the checkpoint's names, shapes and dtypes.

    Keyword Args:
        verify: load a pseudo-random checkpoint and check the map against it (default True).

    Returns:
        The worker's `SourceMap`. The parameters' contents are overwritten by the probe.

    Raises:
        ValueError: unsupported dtypes, parameters that change shape between passes.
        LayoutError: the loader changes values, or casts a checkpoint tensor to another dtype.
    """
    get = _in_memory_order(params if callable(params) else (lambda: params))
    tindex = TensorIndex(spec.tensors)
    ckpt_dtypes = {t.name: _torch_dtype(t.dtype, f"checkpoint tensor {t.name!r}")
                   for t in spec.tensors}
    with torch.no_grad():
        first = _checked_params(get(), None)
        dtypes = set(ckpt_dtypes.values()) | {p.dtype for p in first.values()}
        num_passes = {dt: alphabet(dt).num_passes(tindex.numel) for dt in dtypes}
        scans: dict[str, list[PassRuns]] = {name: [] for name in first}
        shapes = None
        for k in range(max(num_passes.values())):
            _fill_zero(get())
            load_weights(_index_checkpoint(spec, tindex, ckpt_dtypes, num_passes, k))
            live = _checked_params(get(), shapes)
            shapes = {n: (tuple(p.shape), p.dtype) for n, p in live.items()}
            for name, p in live.items():
                alpha = alphabet(p.dtype)
                if k < num_passes[p.dtype] and p.numel():
                    scans[name].append(scan_pass(_flat(p), alpha, alpha.moduli[k]))
        param_specs, pieces, unsourced, holes = [], [], [], {}
        bases = torch.tensor(tindex.bases)
        for name, p in live.items():
            param_specs.append(ParamSpec(name, tuple(p.shape), _dtype_name(p.dtype)))
            if not p.numel():
                continue
            alpha = alphabet(p.dtype)
            dims = [d for d in p.shape if d > 1]  # unit dims carry no row structure
            row = dims[-1] if len(dims) >= 2 else max(p.numel(), 1)
            runs = merge_passes(scans[name], alpha.moduli[:num_passes[p.dtype]], bases, row)
            bad = _check_decoded(name, p, runs, tindex)
            if bad:
                _refuse(get, load_weights, spec, *bad)
            pieces += _pieces(name, tuple(p.shape), runs, tindex)
            hole = runs.index < 0
            if hole.any():
                unsourced.append((name, int(runs.length[hole].sum())))
                holes[name] = (runs.start[hole], runs.length[hole])
        bad = _check_dtypes(pieces, live, spec)
        if bad:
            _refuse(get, load_weights, spec, *bad)
        used = {p.region.tensor for p in pieces}
        smap = SourceMap(tuple(param_specs), tuple(pieces), tuple(unsourced),
                         tuple(t.name for t in spec.tensors if t.name not in used))
        if verify:
            bad = _verify(smap, get, load_weights, spec, ckpt_dtypes, holes)
            if bad:
                _refuse(get, load_weights, spec, *bad)
    return smap


# --------------------------------------------------------------------------------------------
# Probe passes
# --------------------------------------------------------------------------------------------


def _index_checkpoint(spec: CheckpointSpec, tindex: TensorIndex,
                      dtypes: dict[str, torch.dtype], num_passes: dict[torch.dtype, int],
                      k: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass k's checkpoint: element g of the concatenated checkpoint holds digit g mod p_k.

    For 8- and 16-bit dtypes the digits repeat with period p_k, so every tensor is a view into
    one ring of p_k + (largest tensor) values: the pass costs one ring, not one checkpoint.
    """
    rings: dict[torch.dtype, tuple[torch.Tensor, int]] = {}
    for t, base in zip(spec.tensors, tindex.bases):
        dtype = dtypes[t.name]
        alpha = alphabet(dtype)
        p = alpha.moduli[min(k, num_passes[dtype] - 1)]
        if p > _MAX_RING_PERIOD:  # float32: too long a period for a ring, build per tensor
            yield t.name, _encoded(base, t.numel, alpha, p).view(t.shape)
            continue
        if dtype not in rings:
            largest = max(s.numel for s in spec.tensors if dtypes[s.name] == dtype)
            rings[dtype] = (_tiled(_encoded(0, p, alpha, p), p + largest), p)
        ring, _ = rings[dtype]
        start = base % p
        yield t.name, ring[start:start + t.numel].view(t.shape)


def _tiled(period: torch.Tensor, length: int) -> torch.Tensor:
    """``length`` elements repeating ``period`` (one memcpy-speed pass)."""
    return period.repeat(-(-length // period.numel()))[:length]


def _encoded(start: int, num: int, alpha: Alphabet, modulus: int) -> torch.Tensor:
    """Digits of start..start+num-1, built chunk by chunk (no int64 tensor of size num)."""
    out = torch.empty(num, dtype=alpha.dtype)
    for lo in range(0, num, CHUNK):
        hi = min(num, lo + CHUNK)
        digits = torch.arange(start + lo, start + hi, dtype=torch.int64) % modulus
        out[lo:hi] = digits_to_values(digits, alpha)
    return out


def _random_checkpoint(spec: CheckpointSpec, dtypes: dict[str, torch.dtype]
                       ) -> dict[str, torch.Tensor]:
    """Pseudo-random safe values: views into one random ring per dtype at scattered offsets."""
    gen = torch.Generator().manual_seed(_VERIFY_SEED)
    rings: dict[torch.dtype, torch.Tensor] = {}
    out = {}
    for i, t in enumerate(spec.tensors):
        dtype = dtypes[t.name]
        if dtype not in rings:
            alpha = alphabet(dtype)
            largest = max(s.numel for s in spec.tensors if dtypes[s.name] == dtype)
            digits = torch.randint(0, alpha.size, (_RANDOM_PERIOD,), generator=gen)
            ring = _tiled(digits_to_values(digits, alpha), largest + _RING_SPAN)
            rings[dtype] = ring
        start = (i * 40_503 + 17) % _RING_SPAN
        out[t.name] = rings[dtype][start:start + t.numel].view(t.shape)
    return out


# --------------------------------------------------------------------------------------------
# Decoding checks and pieces
# --------------------------------------------------------------------------------------------


def _pieces(name: str, shape: tuple[int, ...], runs: Runs, tindex: TensorIndex) -> list[Piece]:
    boxes = group_boxes(runs, shape)
    out: list[Piece] = []
    rows = zip(boxes.pos.tolist(), boxes.index.tolist(), boxes.shape.tolist(),
               boxes.cstride.tolist(), boxes.pstride.tolist())
    for pos, index, shape, cs, ps in rows:
        out += box_to_pieces(name, pos, index, list(zip(shape, cs, ps)), tindex)
    return out


Bad = tuple[str, int, str]
"""A refused element: (parameter, logical flat element, what is wrong and what to do)."""

_VALUES_CHANGED = ("Likely cause: the loader changes values (scales, casts, quantizes, adds) or "
                   "writes values of its own. load_weights must only copy checkpoint values: "
                   "move value-changing steps out of the probed loader.")


def _check_decoded(name: str, p: torch.Tensor, runs: Runs, tindex: TensorIndex) -> Bad | None:
    """Every decoded run must stay inside the checkpoint; else the loader changed values."""
    ok = runs.index >= 0
    last = runs.index + runs.stride * (runs.length - 1)
    bad = ok & ((runs.index >= tindex.numel) | (last < 0) | (last >= tindex.numel))
    if not bad.any():
        return None
    at = int(runs.start[bad][0])
    return name, at, (f"parameter {name!r} ({_dtype_name(p.dtype)}, shape {tuple(p.shape)}): "
                      f"element {at} (index {_coords(at, p.shape)}) holds a value that is no "
                      f"checkpoint element's index after load_weights. {_VALUES_CHANGED}")


def _check_dtypes(pieces: list[Piece], live: Params, spec: CheckpointSpec) -> Bad | None:
    for piece in pieces:
        if spec[piece.region.tensor].dtype != _dtype_name(live[piece.param].dtype):
            return piece.param, piece.offset, _cast_message(
                piece.region.tensor, spec, piece.param, live[piece.param], piece.offset)
    return None


def _refuse(get: Callable[[], Params], load_weights: LoadWeights, spec: CheckpointSpec,
            param: str, element: int, message: str) -> None:
    """Raise the LayoutError for a bad element, naming a cast when that is what happened."""
    source = source_tensor(get, load_weights, spec, param, element)
    p = dict(get())[param]
    if source is not None and spec[source].dtype != _dtype_name(p.dtype):
        message = _cast_message(source, spec, param, p, element)
    raise LayoutError(message)


def _cast_message(tensor: str, spec: CheckpointSpec, param: str, p: torch.Tensor,
                  element: int) -> str:
    return (f"checkpoint tensor {tensor!r} is {spec[tensor].dtype} but lands in parameter "
            f"{param!r}, which is {_dtype_name(p.dtype)} (element {element}, index "
            f"{_coords(element, p.shape)}): the loader casts values, which a weight transfer "
            f"cannot reproduce from the trainer's bytes. Give the checkpoint tensor and the "
            f"parameter the same dtype, or cast outside load_weights.")


# --------------------------------------------------------------------------------------------
# Verification
# --------------------------------------------------------------------------------------------


def _verify(smap: SourceMap, get: Callable[[], Params], load_weights: LoadWeights,
            spec: CheckpointSpec, dtypes: dict[str, torch.dtype],
            holes: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> Bad | None:
    """Load a pseudo-random checkpoint through load_weights; the map must reproduce it."""
    checkpoint = _random_checkpoint(spec, dtypes)
    _fill_zero(get())
    load_weights(iter(checkpoint.items()))
    live = get()
    from weightbridge.discovery.replay import first_mismatch

    for piece in smap.pieces:
        bad = first_mismatch(piece, live[piece.param], checkpoint[piece.region.tensor])
        if bad is not None:
            p = live[piece.param]
            return piece.param, bad, (
                f"parameter {piece.param!r} ({_dtype_name(p.dtype)}): element {bad} (index "
                f"{_coords(bad, p.shape)}) should hold an element of {piece.region.tensor!r}, "
                f"where the probe found it, but load_weights of a random checkpoint put another "
                f"value there. {_VALUES_CHANGED}")
    for name, (start, length) in holes.items():
        flat = _flat(live[name]).view(_bits_dtype(live[name].dtype))
        for s, n in zip(start.tolist(), length.tolist()):
            nonzero = torch.nonzero(flat[s:s + n] & _magnitude_mask(live[name].dtype))
            if nonzero.numel():
                at = s + int(nonzero[0])
                return name, at, (
                    f"parameter {name!r}: element {at} (index {_coords(at, live[name].shape)}) "
                    f"takes no checkpoint value in the probe, but load_weights wrote a non-zero "
                    f"value there from a random checkpoint. {_VALUES_CHANGED}")
    return None


# --------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------


def _in_memory_order(get: Callable[[], Params]) -> Callable[[], Params]:
    """The parameters as every later step sees them: views into another parameter's memory
    left out (written with it), transposed views in memory order."""
    aliases = None

    def live():
        nonlocal aliases
        params = get()
        if not isinstance(params, Mapping):
            return params  # _checked_params refuses it
        params = dict(params)
        if aliases is None:
            # Decided on the engine's own tensors, before any probe load: a loader that assigns
            # checkpoint tensors would make the probe's overlapping ring views look like aliases.
            aliases = set(params) - set(without_aliases(params))
        return {n: memory_order(p) if isinstance(p, torch.Tensor) else p
                for n, p in params.items() if n not in aliases}
    return live


def _checked_params(params: Params, shapes: dict | None) -> dict[str, torch.Tensor]:
    if not isinstance(params, Mapping):
        raise ValueError(f"params must be a Mapping[str, Tensor] or a callable returning one; "
                         f"got {type(params).__name__}")
    live = dict(params)
    if not live:
        raise ValueError("params is empty: pass the worker's parameters by name")
    for name, p in live.items():
        if not isinstance(p, torch.Tensor):
            raise ValueError(f"params[{name!r}] is a {type(p).__name__}, not a tensor")
        _torch_dtype(_dtype_name(p.dtype), f"parameter {name!r}")
    if shapes is not None:
        now = {n: (tuple(p.shape), p.dtype) for n, p in live.items()}
        if now != shapes:
            changed = sorted(set(now.items()) ^ set(shapes.items()))[:3]
            raise ValueError(f"the parameters changed between probe passes ({changed}): each "
                             f"load_weights call must leave the same names, shapes and dtypes")
    return live


def _torch_dtype(name: str, what: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{what} has unknown dtype {name!r}")
    try:
        alphabet(dtype)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None
    return dtype


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _flat(p: torch.Tensor) -> torch.Tensor:
    """Elements in logical row-major order (a view when contiguous)."""
    return p.detach().reshape(-1)


def _fill_zero(params: Params) -> None:
    for p in dict(params).values():
        p.detach().zero_()


def _bits_dtype(dtype: torch.dtype) -> torch.dtype:
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32}[dtype.itemsize]


def _magnitude_mask(dtype: torch.dtype) -> int:
    """All bits but the sign: zero and negative zero both pass as 'no value written'."""
    return {1: 0x7F, 2: 0x7FFF, 4: 0x7FFFFFFF}[dtype.itemsize]


def _coords(flat: int, shape: torch.Size) -> tuple[int, ...]:
    out = []
    for size in reversed(tuple(shape)):
        out.append(flat % size)
        flat //= size
    return tuple(reversed(out))
