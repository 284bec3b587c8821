"""Layout discovery: probe a worker's own ``load_weights`` and return its `SourceMap`.

The loader is a black box. Each probe pass offers it the full checkpoint with every element set
to a digit of its own index (`codec`), reads the parameters back, and keeps only where runs of
indices begin (`runs`, `boxes`). A last pass loads a pseudo-random checkpoint of both signs
and checks that the map reproduces every parameter bit-exactly, so a loader that changes values
is refused here, before any transfer, instead of corrupting weights later.

Typical usage::

    spec = read_checkpoint_spec(paths)
    smap = extract_source_map(dict(model.named_parameters()), model.load_weights, spec)
    # the probe overwrote the parameters: load the real weights (or receive them) afterwards

The loader contract: ``load_weights(weights)`` takes an iterable of ``(name, tensor)`` pairs
(any order may be read, tensors may be read twice or skipped) and performs *every* step from
checkpoint tensors to the runtime parameters, post-load shuffles for kernels included, using
only copies that preserve values (slicing, concatenation, transposes, permutations, padding).
Value-changing steps (scaling, casting, quantizing, ``abs`` / ``relu``) are refused with a
`LayoutError` that names the parameter and, diagnosed afresh (`diagnose`), the checkpoint tensor.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, Mapping, NamedTuple, NoReturn

import torch

from weightbridge.discovery.boxes import TensorIndex, box_to_pieces, group_boxes
from weightbridge.discovery.codec import Alphabet, alphabet, digits_to_values, signed_values
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
        ValueError: an empty checkpoint spec, unsupported dtypes, parameters that change shape
            between passes.
        LayoutError: the loader changes values, or casts a checkpoint tensor to another dtype.
    """
    _check_spec(spec)
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
                _refuse(get, load_weights, spec, bad)
            pieces += _pieces(name, tuple(p.shape), runs, tindex)
            hole = runs.index < 0
            if hole.any():
                unsourced.append((name, int(runs.length[hole].sum())))
                holes[name] = (runs.start[hole], runs.length[hole])
        bad = _check_dtypes(pieces, live, spec)
        if bad:
            _refuse(get, load_weights, spec, bad)
        used = {p.region.tensor for p in pieces}
        smap = SourceMap(tuple(param_specs), tuple(pieces), tuple(unsourced),
                         tuple(t.name for t in spec.tensors if t.name not in used))
        if verify:
            bad = _verify(smap, get, load_weights, spec, ckpt_dtypes, holes)
            if bad:
                _refuse(get, load_weights, spec, bad)
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
    """Pseudo-random safe values of both signs: views into one random ring per dtype at
    scattered offsets. Negative values catch loaders that change only those (``abs``, ``relu``),
    which the all-positive index passes cannot see."""
    gen = torch.Generator().manual_seed(_VERIFY_SEED)
    rings: dict[torch.dtype, torch.Tensor] = {}
    out = {}
    for i, t in enumerate(spec.tensors):
        dtype = dtypes[t.name]
        if dtype not in rings:
            alpha = alphabet(dtype)
            largest = max(s.numel for s in spec.tensors if dtypes[s.name] == dtype)
            # One draw gives magnitude and sign: draws of size and above are negative.
            draws = torch.randint(0, 2 * alpha.size, (_RANDOM_PERIOD,), generator=gen)
            negative = draws >= alpha.size
            digits = draws - negative * alpha.size
            ring = _tiled(signed_values(digits, negative, alpha), largest + _RING_SPAN)
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


class Bad(NamedTuple):
    """A refused element and what the probe saw there."""

    param: str
    element: int
    """Logical flat index into the parameter."""
    seen: str
    """What is wrong at the element, as the probe saw it; `_refuse` adds the source and cause."""
    cast_from: str | None = None
    """The checkpoint tensor the probe decoded there, when its dtype differs from the param's."""


_VALUES_CHANGED = ("Likely cause: the loader changes values (scales, casts, quantizes, adds, or "
                   "depends on their sign: abs, clamp, relu) or writes values of its own. "
                   "load_weights must only copy checkpoint values: move value-changing steps out "
                   "of the probed loader.")


def _check_decoded(name: str, p: torch.Tensor, runs: Runs, tindex: TensorIndex) -> Bad | None:
    """Every decoded run must stay inside the checkpoint; else the loader changed values."""
    ok = runs.index >= 0
    last = runs.index + runs.stride * (runs.length - 1)
    bad = ok & ((runs.index >= tindex.numel) | (last < 0) | (last >= tindex.numel))
    if not bad.any():
        return None
    at = int(runs.start[bad][0])
    return Bad(name, at, f"parameter {name!r} ({_dtype_name(p.dtype)}, shape {tuple(p.shape)}): "
                         f"element {at} (index {_coords(at, p.shape)}) holds a value that is no "
                         f"checkpoint element's index after load_weights.")


def _check_dtypes(pieces: list[Piece], live: Params, spec: CheckpointSpec) -> Bad | None:
    for piece in pieces:
        p = live[piece.param]
        if spec[piece.region.tensor].dtype != _dtype_name(p.dtype):
            return Bad(piece.param, piece.offset,
                       f"parameter {piece.param!r} ({_dtype_name(p.dtype)}): element "
                       f"{piece.offset} (index {_coords(piece.offset, p.shape)}) decodes as an "
                       f"element of a {spec[piece.region.tensor].dtype} checkpoint tensor.",
                       piece.region.tensor)
    return None


def _refuse(get: Callable[[], Params], load_weights: LoadWeights, spec: CheckpointSpec,
            bad: Bad) -> NoReturn:
    """Raise the LayoutError for a bad element, naming the checkpoint tensor it comes from and a
    cast when that is what happened.

    The tensor is diagnosed afresh (`source_tensor`), never read off the probe's map: a loader
    that scales values turns every index into another valid one (doubling a bf16 value adds 128
    to its bits, so each pass's digit and the recombined index all shift by 128), and the map
    then names whichever tensor the shifted index falls in.
    """
    source = source_tensor(get, load_weights, spec, bad.param, bad.element)
    p = dict(get())[bad.param]
    tensor = source if source is not None else bad.cast_from
    if tensor is not None and spec[tensor].dtype != _dtype_name(p.dtype):
        raise LayoutError(_cast_message(tensor, spec, bad.param, p, bad.element))
    origin = "" if source is None else (
        f" Its value comes from checkpoint tensor {source!r}, which load_weights does not copy "
        f"unchanged.")
    raise LayoutError(f"{bad.seen}{origin} {_VALUES_CHANGED}")


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
            # The tensor the index probe decoded here is not named: when values changed, it
            # can be any tensor (see `_refuse`).
            return Bad(piece.param, bad,
                       f"parameter {piece.param!r} ({_dtype_name(p.dtype)}): element {bad} "
                       f"(index {_coords(bad, p.shape)}) does not hold the checkpoint value the "
                       f"probed map predicts after load_weights of a random checkpoint (values "
                       f"of both signs).")
    for name, (start, length) in holes.items():
        flat = _flat(live[name]).view(_bits_dtype(live[name].dtype))
        for s, n in zip(start.tolist(), length.tolist()):
            nonzero = torch.nonzero(flat[s:s + n] & _magnitude_mask(live[name].dtype))
            if nonzero.numel():
                at = s + int(nonzero[0])
                return Bad(name, at,
                           f"parameter {name!r}: element {at} (index "
                           f"{_coords(at, live[name].shape)}) takes no checkpoint value in the "
                           f"probe, but load_weights wrote a non-zero value there from a random "
                           f"checkpoint.")
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


def _check_spec(spec: CheckpointSpec) -> None:
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
