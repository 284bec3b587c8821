"""Layout discovery: probe a worker's own ``load_weights`` and return its `SourceMap`.

The loader is a black box. Each probe pass offers it the full checkpoint with every element set
to a digit of its own index (`codec`), reads the parameters back, and keeps only where runs of
indices begin (`runs`, `boxes`); parameters on a GPU are read back with one device-to-host copy
per pass and decoded on the host, so the probe adds no device memory (but for reads of a few
dozen elements, `one_pass`). Where every parameter is one slice of one tensor, the first pass
and the last tell the map (`one_pass`). A last pass loads a
pseudo-random checkpoint of negative values (the index passes' are positive) and checks that
the map reproduces every parameter bit-exactly, so a loader that changes values is refused
here, before any transfer, instead of corrupting weights later.

Typical usage::

    spec = read_checkpoint_spec(paths)
    smap = extract_source_map(dict(model.named_parameters()), model.load_weights, spec)
    # the probe overwrote the parameters: load the real weights (or receive them) afterwards

The loader contract: ``load_weights(weights)`` takes an iterable of ``(name, tensor)`` pairs
(any order may be read, tensors may be read twice or skipped) and performs *every* step from
checkpoint tensors to the runtime parameters, post-load shuffles for kernels included, using
only copies that preserve values (slicing, concatenation, transposes, permutations, padding),
and casts between float dtypes that round to nearest even (``param.copy_(tensor)`` of an fp32
tensor into a bf16 parameter). A cast is recorded on the piece (`Piece.cast_from`) and the
verification pass checks its rounding (`verify`); the trainer's pack then converts (docs/layout.md).
Other value-changing steps (scaling, quantizing with scales, ``abs`` / ``relu``) are refused with
a `LayoutError` that names the parameter and, diagnosed afresh (`diagnose`), the checkpoint tensor.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Callable, Iterator, NoReturn

import torch
import torch.distributed

from weightbridge.discovery.boxes import (Boxes, TensorIndex, box_to_pieces, group_boxes,
                                          run_box)
from weightbridge.discovery.codec import (NO_SOURCE, Alphabet, alphabet, cast_alphabet,
                                          digits_to_values)
from weightbridge.discovery.diagnose import source_tensor
from weightbridge.discovery.quantized import ALPHABET as QUANT_ALPHABET
from weightbridge.discovery.quantized import (SignDecoder, block_pieces, quantizing, scale_params,
                                              sign_bits, sign_checkpoint)
from weightbridge.discovery.inputs import (LoadWeights, Params, check_spec, checked_params,
                                           in_memory_order, threads, torch_dtype,
                                           with_threads)
from weightbridge.discovery.merge import PassRuns, Runs, merge_passes, one_run
from weightbridge.discovery.runs import CHUNK, Rings, scan_pass
from weightbridge.discovery import one_pass
from weightbridge.discovery.verify import (Bad, Before, check_loaded, coords,
                                           dtype_name, fill_zero, flat_view, on_host,
                                           random_checkpoint, repeat_period, ring_buffer)
from weightbridge.discovery.verify import verify as verify_map
from weightbridge.errors import LayoutError
from weightbridge.quant import QUANT_DTYPE
from weightbridge.types import CheckpointSpec, ParamSpec, Piece, SourceMap

_MAX_RING_PERIOD = 1 << 20


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
        The worker's `SourceMap`. The parameters' contents are overwritten by the probe. A
        loader that casts a checkpoint tensor into a parameter of another float dtype (round to
        nearest even, as ``copy_`` does) is mapped, the cast recorded on its pieces
        (`Piece.cast_from`).

    Raises:
        ValueError: an empty checkpoint spec, unsupported dtypes, parameters that change shape
            between passes.
        LayoutError: the loader changes values beyond a round-to-nearest-even cast.
    """
    return probe(params, load_weights, spec, verify=verify).source_map


@dataclass(frozen=True, slots=True)
class Probed:
    """What a probe found: the map, and where it found no source (what `reverify` checks
    stays zero). Plain ints and strs: it is kept on disk across restarts (`cache`).

    Example: ``Probed(smap, (("embed", ((64000, 512),)),))``: elements 64000..64511 of
    ``embed`` (vocabulary padding) take no checkpoint value.
    """

    source_map: SourceMap
    holes: tuple[tuple[str, tuple[tuple[int, int], ...]], ...] = ()
    """Per parameter with unsourced elements: its (first element, count) ranges."""


def probe(params: Params | Callable[[], Params], load_weights: LoadWeights,
          spec: CheckpointSpec, *, verify: bool = True) -> Probed:
    """`extract_source_map`, keeping the unsourced ranges a later `reverify` needs."""
    check_spec(spec)
    load = with_threads(load_weights, torch.get_num_threads())  # the caller's threads
    with threads(1):  # the probe's own work
        return _extract(params, load, spec, verify)


def reverify(probed: Probed, params: Params | Callable[[], Params], load_weights: LoadWeights,
             spec: CheckpointSpec) -> bool:
    """The verification pass alone, for a map probed earlier (`cache`): load a pseudo-random
    checkpoint and check the map reproduces every parameter bit for bit and the unsourced
    elements stay zero. False when the parameters' names, shapes or dtypes are not the map's,
    or the loader does anything else now: probe again then. Overwrites the parameters, as a
    probe does."""
    check_spec(spec)
    load = with_threads(load_weights, torch.get_num_threads())
    with threads(1), torch.no_grad():
        get = in_memory_order(params if callable(params) else (lambda: params))
        live = checked_params(get(), None)
        now = tuple(ParamSpec(n, tuple(p.shape), dtype_name(p.dtype)) for n, p in live.items())
        if now != probed.source_map.params:
            return False
        dtypes = {t.name: torch_dtype(t.dtype, f"checkpoint tensor {t.name!r}")
                  for t in spec.tensors}
        holes = {name: tuple(torch.tensor(v, dtype=torch.int64) for v in zip(*ranges))
                 for name, ranges in probed.holes}
        return verify_map(probed.source_map, get, load, spec, dtypes, holes,
                          Before.ANYTHING) is None


def _extract(params: Params | Callable[[], Params], load_weights: LoadWeights,
             spec: CheckpointSpec, verify: bool) -> Probed:
    get = in_memory_order(params if callable(params) else (lambda: params))
    ckpt_dtypes = {t.name: torch_dtype(t.dtype, f"checkpoint tensor {t.name!r}")
                   for t in spec.tensors}
    with torch.no_grad():
        first = checked_params(get(), None)
        dtypes = set(ckpt_dtypes.values()) | {p.dtype for p in first.values()}
        # A loader that casts usually shows as dtypes present on one side only; one that casts
        # between dtypes both sides have is found by the plain probe, which then starts over.
        casting = {p.dtype for p in first.values()} != set(ckpt_dtypes.values())
        if quantizing(first, ckpt_dtypes):
            return _probe(get, load_weights, spec, ckpt_dtypes, dtypes, True, verify,
                          scales=scale_params(first))
        try:
            return _probe(get, load_weights, spec, ckpt_dtypes, dtypes, casting, verify)
        except _CastSeen:
            return _probe(get, load_weights, spec, ckpt_dtypes, dtypes, True, verify)


class _CastSeen(LayoutError):
    """The plain probe saw a cast: probe again with the cast alphabet."""


def _probe(get: Callable[[], Params], load_weights: LoadWeights, spec: CheckpointSpec,
           ckpt_dtypes: dict[str, torch.dtype], dtypes: set[torch.dtype], casting: bool,
           verify: bool, scales: dict[str, str] | None = None) -> Probed:
    """Every pass of the probe. ``casting``: encode indices in `cast_alphabet` (values every
    dtype holds exactly) instead of each dtype's own alphabet. ``scales`` (a block-quantizing
    loader: float8 parameter -> its scale parameter): sign passes instead (`quantized`)."""
    tindex = TensorIndex(spec.tensors)
    if scales is not None:
        alpha_of = lambda dt: QUANT_ALPHABET  # noqa: E731
    else:
        common = cast_alphabet(tuple(sorted(dtypes, key=str))) if casting else None
        alpha_of = (lambda dt: common) if casting else alphabet  # noqa: E731
    num_passes = {dt: alpha_of(dt).num_passes(tindex.numel) for dt in dtypes}
    skip = set(scales.values()) if scales else set()  # scale parameters: no index decoded
    if scales is not None:
        live, scans = _sign_passes(get, load_weights, spec, tindex, ckpt_dtypes,
                                   max(num_passes.values()), skip)
    else:
        passes = _IndexPasses(get, load_weights, spec, tindex, ckpt_dtypes, num_passes,
                              alpha_of, verify)
        if verify and not casting and passes.count > 1 and not _in_lockstep():
            probed = _one_pass(get, load_weights, spec, tindex, ckpt_dtypes, alpha_of, passes)
            if probed is not None:
                return probed
        for k in range(passes.scanned, passes.count):
            passes.run(k)
        live, scans = passes.live, passes.scans
    param_specs, pieces, unsourced, holes = [], [], [], {}
    bases = torch.tensor(tindex.bases)
    refuse = (functools.partial(_refuse, get, load_weights, spec, casting) if scales is None
              else _refuse_quantized)
    for name, p in live.items():
        param_specs.append(ParamSpec(name, tuple(p.shape), dtype_name(p.dtype)))
        if not p.numel() or name in skip:
            continue
        alpha = alpha_of(p.dtype)
        row = _row(p)
        moduli = alpha.moduli[:num_passes[p.dtype]]
        one = one_run(scans[name], moduli, bases)
        if one is not None:  # one slice-copy: its box directly, no per-row runs to group
            pieces += _pieces(name, run_box(*one, p.numel(), row), tindex)
            continue
        runs = merge_passes(scans[name], moduli, bases, row)
        bad = _check_decoded(name, p, runs, tindex)
        if bad:
            refuse(bad)
        pieces += _pieces(name, group_boxes(runs, tuple(p.shape)), tindex)
        hole = runs.index < 0
        if hole.any():
            unsourced.append((name, int(runs.length[hole].sum())))
            holes[name] = (runs.start[hole], runs.length[hole])
    if casting:
        pieces = _record_casts(pieces, live, spec)
        if scales:
            pieces = block_pieces(pieces, live, spec, scales)
    else:
        bad = _check_dtypes(pieces, live, spec)
        if bad:
            refuse(bad)
    used = {p.region.tensor for p in pieces}
    smap = SourceMap(tuple(param_specs), tuple(pieces), tuple(unsourced),
                     tuple(t.name for t in spec.tensors if t.name not in used))
    if verify:
        bad = verify_map(smap, get, load_weights, spec, ckpt_dtypes, holes,
                         Before.INDEX_DIGITS if scales is None else Before.SIGN_PASSES,
                         buffers=None if scales is not None else passes.buffers)
        if bad:
            refuse(bad)
    return Probed(smap, tuple((name, tuple(zip(start.tolist(), length.tolist())))
                              for name, (start, length) in holes.items()))


def _in_lockstep() -> bool:
    """Whether this process is in a torch.distributed group of two or more ranks. Its loader
    may then be collective (torchtitan's loads redistribute DTensors), and every rank must
    make the same loads in the same order; whether the one-pass decode applies
    (`one_pass.guess`, a decode) is each rank's own finding, so such a probe takes its index
    passes, whose number follows the checkpoint alone. (A group of one, vLLM's worker at TP
    1, has no other rank to differ from.)"""
    return (torch.distributed.is_available() and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() > 1)


def _row(p: torch.Tensor) -> int:
    """A parameter's row length for its boxes (unit dims carry no row structure)."""
    dims = [d for d in p.shape if d > 1]
    return dims[-1] if len(dims) >= 2 else max(p.numel(), 1)


# --------------------------------------------------------------------------------------------
# Probe passes
# --------------------------------------------------------------------------------------------


class _IndexPasses:
    """The index passes, one `run` (a `load` and its `scan`) at a time: the live parameters
    and, per parameter, its scanned passes' runs."""

    def __init__(self, get, load_weights, spec, tindex, ckpt_dtypes, num_passes, alpha_of,
                 verify):
        self.get, self.load_weights, self.spec, self.tindex = get, load_weights, spec, tindex
        self.ckpt_dtypes, self.num_passes, self.alpha_of = ckpt_dtypes, num_passes, alpha_of
        self.verify = verify
        self.scans: dict[str, list[PassRuns]] = {name: [] for name in checked_params(get(),
                                                                                      None)}
        self.shapes, self.rings, self.holes = None, Rings(), True
        self.buffers: dict[torch.dtype, torch.Tensor] = {}  # each dtype's ring, every pass
        self.live: Params = {}
        self.scanned = 0

    @property
    def count(self) -> int:
        return max(self.num_passes.values())

    def run(self, k: int) -> None:
        self.load(k)
        self.scan(k)

    def load(self, k: int) -> None:
        if self.holes or not self.verify:
            # Zero shows where the loader writes nothing. Once the first pass found it writes
            # every element, later index passes skip the fill: an element a later load leaves
            # alone would decode wrongly, and the verification pass refuses the map then;
            # without that pass, every load is zeroed first.
            fill_zero(self.get())
        self.load_weights(_index_checkpoint(self.spec, self.tindex, self.ckpt_dtypes,
                                            self.num_passes, k, self.alpha_of, self.buffers))
        self.live = checked_params(self.get(), self.shapes)
        self.shapes = {n: (tuple(p.shape), p.dtype) for n, p in self.live.items()}

    def scan(self, k: int) -> None:
        """Scan pass ``k``, loaded last (`load`)."""
        assert k == self.scanned, (k, self.scanned)
        for name, p in self.live.items():
            alpha = self.alpha_of(p.dtype)
            if k < self.num_passes[p.dtype] and p.numel():
                # Read back chunk by chunk (device-to-host per chunk), decoded on the host.
                self.scans[name].append(scan_pass(_scanned(p), alpha, alpha.moduli[k],
                                                  self.rings))
        self.holes = any(bool((runs.digit == NO_SOURCE).any())
                         for passes in self.scans.values() for runs in passes[-1:])
        self.scanned += 1


def _scanned(p: torch.Tensor) -> torch.Tensor:
    """A parameter's elements in logical order, on its device when that is a view (the scan
    copies chunks to the host); a non-contiguous one is copied to the host whole instead, so
    the probe never allocates device memory."""
    p = p.detach()
    return p.reshape(-1) if p.is_contiguous() else flat_view(on_host(p))


def _one_pass(get, load_weights, spec, tindex, ckpt_dtypes, alpha_of, passes: _IndexPasses
              ) -> Probed | None:
    """The first index load, and where every parameter is one box there (`one_pass.guess`,
    read at a few elements, no scan): load the verification pass's checkpoint, pick each box's
    first index by the values it left, and check the map against every element. None when the
    probe must take its index passes: with pass 0 scanned when a parameter is no box, else
    with nothing scanned (a box matches no candidate or several, a piece joins two dtypes, or
    the check fails: the verification load has overwritten the first pass's digits)."""
    if not one_pass.few_candidates(checked_params(get(), None), tindex.numel, alpha_of):
        return None
    passes.load(0)
    boxes = one_pass.guess(passes.live, alpha_of)
    if boxes is None:
        passes.scan(0)
        return None
    checkpoint = random_checkpoint(spec, ckpt_dtypes, negative=True, buffers=passes.buffers)
    load_weights(iter(checkpoint.items()))
    live = checked_params(get(), passes.shapes)
    found = one_pass.decode(live, boxes, alpha_of, tindex, checkpoint)
    if found is None:
        return None
    pieces = []
    for name in live:
        if name in found:
            pieces += _pieces(name, boxes[name].boxes(found[name]), tindex)
    if _check_dtypes(pieces, live, spec) is not None:
        return None
    used = {p.region.tensor for p in pieces}
    smap = SourceMap(tuple(ParamSpec(n, tuple(p.shape), dtype_name(p.dtype))
                           for n, p in live.items()), tuple(pieces), (),
                     tuple(t.name for t in spec.tensors if t.name not in used))
    if check_loaded(smap, live, checkpoint, {}, negative=True) is not None:
        return None
    return Probed(smap)


def _sign_passes(get, load_weights, spec, tindex, ckpt_dtypes, num_passes, skip):
    """A block-quantizing loader's passes (`quantized`): per modulus, its sign passes decoded
    into one float8 pass. ``skip``: the scale parameters (nothing to decode there)."""
    scans: dict = {name: [] for name in checked_params(get(), None)}
    shapes = None
    for k in range(num_passes):
        modulus = QUANT_ALPHABET.moduli[k]
        decoders: dict[str, SignDecoder] = {}
        for bit in range(sign_bits(modulus)):
            fill_zero(get())
            load_weights(sign_checkpoint(spec, tindex, ckpt_dtypes, modulus, bit))
            live = checked_params(get(), shapes)
            shapes = {n: (tuple(p.shape), p.dtype) for n, p in live.items()}
            for name, p in live.items():
                if name not in skip and p.numel():
                    decoders.setdefault(name, SignDecoder(p.numel())).add(
                        flat_view(on_host(p)), bit)
        for name, d in decoders.items():
            values = d.values(modulus)
            if d.bad is not None:
                p = live[name]
                raise LayoutError(
                    f"parameter {name!r} ({dtype_name(p.dtype)}, shape {tuple(p.shape)}): "
                    f"element {d.bad} (index {coords(d.bad, p.shape)}) holds a value that is "
                    f"neither +-448 nor 0 after load_weights of a checkpoint whose every value "
                    f"is +-448 (a block-quantizing loader keeps them, its scales become 1). "
                    f"{_VALUES_CHANGED}")
            scans[name].append(scan_pass(values, QUANT_ALPHABET, modulus))
    return live, scans


def _refuse_quantized(bad: Bad) -> NoReturn:
    raise LayoutError(
        f"{bad.seen} The loader quantizes to {QUANT_DTYPE} with block scales, but not bit for "
        f"bit as weightbridge.quant does (vLLM's per_block_cast_to_fp8: amax per block in "
        f"float32 clamped at 1e-4, scale = amax / 448, value = fp8(x * (1 / scale)), blocks "
        f"anchored at the checkpoint tensor's origin), so the trainer's pack cannot reproduce "
        f"it. Quantize with that formula in load_weights, or load these weights unquantized")


def _index_checkpoint(spec: CheckpointSpec, tindex: TensorIndex,
                      dtypes: dict[str, torch.dtype], num_passes: dict[torch.dtype, int],
                      k: int, alpha_of: Callable[[torch.dtype], Alphabet],
                      buffers: dict[torch.dtype, torch.Tensor]
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass k's checkpoint: element g of the concatenated checkpoint holds digit g mod p_k.

    For 8- and 16-bit alphabets the digits repeat with period p_k, so every tensor is a view
    into one ring of p_k + (largest tensor) values: the pass costs one ring, not one checkpoint.
    A tensor of another dtype than its alphabet's holds the same values in its own dtype. The
    ring is written into ``buffers[dtype]`` (`verify.ring_buffer`), kept from pass to pass
    (moduli only shrink): a fresh one each pass cost about one more plain load of a small
    rank in page faults. A
    loader that made the last pass's views its parameters sees them rewritten when it asks
    for this pass's first tensor; it replaces them in this pass, or the parameters it leaves
    alone decode wrongly and the verification pass refuses the map (as for any element a pass
    leaves alone).
    """
    rings: dict[torch.dtype, torch.Tensor] = {}
    for t, base in zip(spec.tensors, tindex.bases):
        dtype = dtypes[t.name]
        alpha = alpha_of(dtype)
        p = alpha.moduli[min(k, num_passes[dtype] - 1)]
        if p > _MAX_RING_PERIOD:  # float32: too long a period for a ring, build per tensor
            yield t.name, _encoded(base, t.numel, alpha, p).to(dtype).view(t.shape)
            continue
        if dtype not in rings:
            largest = max(s.numel for s in spec.tensors if dtypes[s.name] == dtype)
            ring = ring_buffer(buffers, dtype, largest, p + largest)
            ring[:p] = _encoded(0, p, alpha, p)
            rings[dtype] = repeat_period(ring, p)
        start = base % p
        yield t.name, rings[dtype][start:start + t.numel].view(t.shape)


def _encoded(start: int, num: int, alpha: Alphabet, modulus: int) -> torch.Tensor:
    """Digits of start..start+num-1, built chunk by chunk (no int64 tensor of size num)."""
    out = torch.empty(num, dtype=alpha.dtype)
    for lo in range(0, num, CHUNK):
        hi = min(num, lo + CHUNK)
        digits = torch.arange(start + lo, start + hi, dtype=torch.int64) % modulus
        out[lo:hi] = digits_to_values(digits, alpha)
    return out


# --------------------------------------------------------------------------------------------
# Decoding checks and pieces
# --------------------------------------------------------------------------------------------


def _pieces(name: str, boxes: Boxes, tindex: TensorIndex) -> list[Piece]:
    out: list[Piece] = []
    rows = zip(boxes.pos.tolist(), boxes.index.tolist(), boxes.shape.tolist(),
               boxes.cstride.tolist(), boxes.pstride.tolist())
    for pos, index, shape, cs, ps in rows:
        out += box_to_pieces(name, pos, index, list(zip(shape, cs, ps)), tindex)
    return out


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
    return Bad(name, at, f"parameter {name!r} ({dtype_name(p.dtype)}, shape {tuple(p.shape)}): "
                         f"element {at} (index {coords(at, p.shape)}) holds a value that is no "
                         f"checkpoint element's index after load_weights.")


def _check_dtypes(pieces: list[Piece], live: Params, spec: CheckpointSpec) -> Bad | None:
    """The plain probe's check: a piece between two dtypes is a cast it cannot decode."""
    for piece in pieces:
        p = live[piece.param]
        if spec[piece.region.tensor].dtype != dtype_name(p.dtype):
            return Bad(piece.param, piece.offset,
                       f"parameter {piece.param!r} ({dtype_name(p.dtype)}): element "
                       f"{piece.offset} (index {coords(piece.offset, p.shape)}) decodes as an "
                       f"element of a {spec[piece.region.tensor].dtype} checkpoint tensor.",
                       piece.region.tensor)
    return None


def _record_casts(pieces: list[Piece], live: Params, spec: CheckpointSpec) -> list[Piece]:
    """The cast probe's pieces, each between two dtypes marked with its checkpoint dtype (the
    verification pass then checks the loader rounds as that cast does)."""
    out = []
    for piece in pieces:
        source = spec[piece.region.tensor].dtype
        out.append(piece if source == dtype_name(live[piece.param].dtype)
                   else replace(piece, cast_from=source))
    return out


def _refuse(get: Callable[[], Params], load_weights: LoadWeights, spec: CheckpointSpec,
            casting: bool, bad: Bad) -> NoReturn:
    """Raise the LayoutError for a bad element, naming the checkpoint tensor it comes from and a
    cast when that is involved; the plain probe raises `_CastSeen` for a cast instead, so that
    the probe starts over with the cast alphabet.

    The tensor is diagnosed afresh (`source_tensor`), never read off the probe's map: a loader
    that scales values turns every index into another valid one (doubling a bf16 value adds 128
    to its bits, so each pass's digit and the recombined index all shift by 128), and the map
    then names whichever tensor the shifted index falls in.
    """
    source = source_tensor(get, load_weights, spec, bad.param, bad.element)
    p = dict(get())[bad.param]
    tensor = source if source is not None else bad.cast_from
    if tensor is not None and spec[tensor].dtype != dtype_name(p.dtype):
        if not casting:
            raise _CastSeen(bad.seen)
        raise LayoutError(_cast_message(tensor, spec, bad, p))
    origin = "" if source is None else (
        f" Its value comes from checkpoint tensor {source!r}, which load_weights does not copy "
        f"unchanged.")
    raise LayoutError(f"{bad.seen}{origin} {_VALUES_CHANGED}")


def _cast_message(tensor: str, spec: CheckpointSpec, bad: Bad, p: torch.Tensor) -> str:
    return (f"checkpoint tensor {tensor!r} is {spec[tensor].dtype} and lands in parameter "
            f"{bad.param!r}, which is {dtype_name(p.dtype)}, but not as a round-to-nearest-even "
            f"cast (what param.copy_(tensor) does): {bad.seen} The loader changes values beyond "
            f"the cast (scales, quantizes with scales, rounds another way, flushes subnormals, "
            f"or depends on the sign), which a weight transfer cannot reproduce from the "
            f"trainer's bytes. Cast with copy_ / .to(dtype) only, and move other value-changing "
            f"steps out of load_weights.{_FP8_HINT if p.dtype.itemsize == 1 else ''}")


_FP8_HINT = (" Quantizing to float8 is mapped only as block-scaled FP8 (a float8 weight plus a "
             "float32 scale parameter named weight_scale_inv, from a checkpoint that is not "
             "float8; see docs/layout.md): load other float8 weights unquantized, or quantize "
             "after each transfer.")
