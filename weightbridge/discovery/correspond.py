"""Intersect trainer and rollout source maps in checkpoint coordinates.

The checkpoint is the common coordinate system: every source-map region names checkpoint
elements, so the elements a rollout needs and the trainers that hold them fall out of region
arithmetic, with no knowledge of either side's parallelism.

Typical usage::

    corr = correspond(trainer_maps, rollout_maps)   # raises LayoutError before anything moves
    corr.overlaps[0].holders, corr.overlaps[0].needers

Scale: maps of replicas share regions, so work is per *distinct* region and per checkpoint
tensor, never per element or per worker pair. A tensor whose needed part is one region held as
one region (an expert under EP on both sides) takes a dict lookup; others are refined on a
per-dim grid with numpy.
"""

from __future__ import annotations

import functools
import itertools
from typing import Sequence

import numpy as np
import torch

from weightbridge.discovery import blockwire
from weightbridge.errors import LayoutError
from weightbridge.types import (CONVERTIBLE_DTYPES, Correspondence, Overlap, ParamSpec, Region,
                               SourceMap, dtype_itemsize)

# tensor -> {distinct region: worker indices}
_Regions = dict[str, dict[Region, list[int]]]


def correspond(trainer_maps: Sequence[SourceMap], rollout_maps: Sequence[SourceMap]
               ) -> Correspondence:
    """Partition every element some rollout needs into overlaps, each naming its holders.

    Args:
        trainer_maps: One source map per trainer worker.
        rollout_maps: One source map per rollout worker.

    Returns:
        A `Correspondence`; overlaps index workers by position in the two sequences.

    Raises:
        ValueError: either side is empty.
        LayoutError: a rollout parameter takes no checkpoint element at all (no transfer would
            ever update it), a rollout needs elements no trainer holds (the message names the
            tensors and element counts), the two sides' dtypes of a checkpoint tensor cannot
            be converted into each other exactly (`wire_dtypes`), or no trainer holds whole a
            block of a tensor rollouts hold block-quantized (`blockwire`).
    """
    if not trainer_maps or not rollout_maps:
        raise ValueError(f"correspond needs at least one trainer and one rollout source map, got "
                         f"{len(trainer_maps)} and {len(rollout_maps)}")
    _check_sourced(rollout_maps)
    held, trainer_dtypes = _distinct_regions(trainer_maps, "trainer")
    needed, rollout_dtypes = _distinct_regions(rollout_maps, "rollout")
    blocks = blockwire.quantized_tensors(rollout_maps)
    quantized = blockwire.wire(blocks, trainer_dtypes, rollout_dtypes, exact_cast)
    if blocks:
        blockwire.trainer_scales(held, blocks, blockwire.extents(rollout_maps, blocks))
    wire = wire_dtypes(trainer_dtypes, {t: d for t, d in rollout_dtypes.items()
                                        if t not in quantized})
    wire |= {t: w[:3] for t, w in quantized.items()}
    overlaps: list[Overlap] = []
    missing: dict[str, int] = {}
    for tensor, wanted in needed.items():
        cells, num_missing = _refine(held.get(tensor, {}), wanted)
        if num_missing:
            missing[tensor] = num_missing
        dtype, source, target = wire.get(tensor, (rollout_dtypes[tensor][0], None, None))
        block = quantized[tensor][3] if tensor in quantized else ()
        overlaps.extend(Overlap(region, dtype, holders, needers, source, target, block)
                        for region, holders, needers in cells)
    if missing:
        raise LayoutError(blockwire.missing_message(missing, blocks) or _missing_message(missing))
    return Correspondence(tuple(overlaps), len(trainer_maps), len(rollout_maps))


def _distinct_regions(maps: Sequence[SourceMap], side: str
                      ) -> tuple[_Regions, dict[str, tuple[str, str]]]:
    """Group every piece's region by tensor, with the workers that have it; and per tensor
    (parameter dtype, checkpoint dtype: the piece's ``cast_from`` or the parameter's).

    Replicas usually pass the same map object, so each distinct object is walked once.
    """
    by_object: dict[int, tuple[SourceMap, list[int]]] = {}
    for worker, smap in enumerate(maps):
        by_object.setdefault(id(smap), (smap, []))[1].append(worker)
    regions: _Regions = {}
    dtypes: dict[str, tuple[str, str]] = {}
    for smap, workers in by_object.values():
        param_dtype = {p.name: p.dtype for p in smap.params}
        seen_param = None
        for piece in smap.pieces:
            region = piece.region
            if piece.param is not seen_param:
                seen_param, dtype = piece.param, param_dtype.get(piece.param)
                if dtype is None:
                    raise LayoutError(f"{side} worker {workers[0]} has a piece into parameter "
                                      f"{piece.param!r}, which its SourceMap.params does not "
                                      f"list; rebuild the map with extract_source_map")
            pair = (dtype, piece.cast_from or dtype)
            known = dtypes.setdefault(region.tensor, pair)
            if known != pair:
                raise LayoutError(f"{side} workers load checkpoint tensor {region.tensor!r} into "
                                  f"both {_as(known)} and {_as(pair)} parameters; each tensor "
                                  f"needs one dtype on each side (one wire dtype per tensor)")
            regions.setdefault(region.tensor, {}).setdefault(region, []).extend(workers)
    return regions, dtypes


def _check_sourced(rollout_maps: Sequence[SourceMap]) -> None:
    """Every rollout parameter must take at least one checkpoint element on some rollout worker.

    A parameter no piece writes on any worker is never updated: load_weights found nothing for it
    in the checkpoint spec (its tensor is missing there, or it is state the engine computes
    itself), so the rollouts would keep serving its initial values. Refused here, before any byte
    moves. The rule is per parameter name over all rollout workers, not per worker: one TP rank's
    shard of a padded vocabulary can lie wholly in the padding (no element sourced there) while
    the other ranks source the same parameter. Partly sourced parameters (padding rows) are fine,
    and so are trainer parameters no rollout needs.
    """
    by_object: dict[int, tuple[SourceMap, list[int]]] = {}
    for worker, smap in enumerate(rollout_maps):  # replicas share one map object
        by_object.setdefault(id(smap), (smap, []))[1].append(worker)
    sourced: set[str] = set()
    empty: dict[str, tuple[ParamSpec, list[int]]] = {}
    for smap, workers in by_object.values():
        written = {piece.param for piece in smap.pieces}
        sourced |= written
        for p in smap.params:
            if p.numel and p.name not in written:
                empty.setdefault(p.name, (p, []))[1].extend(workers)
    never = [(p, sorted(workers)) for name, (p, workers) in empty.items() if name not in sourced]
    if never:
        raise LayoutError(_unsourced_message(never))


def _unsourced_message(never: list[tuple[ParamSpec, list[int]]]) -> str:
    listed = ", ".join(f"{p.name!r} ({p.shape} {p.dtype}, {_workers(w)})" for p, w in never[:8])
    more = f" and {len(never) - 8} more" if len(never) > 8 else ""
    what = "1 rollout parameter" if len(never) == 1 else f"{len(never)} rollout parameters"
    return (f"no element of the checkpoint spec lands in {what} on any rollout worker, so no "
            f"transfer would ever update {'it' if len(never) == 1 else 'them'}: {listed}{more}. "
            f"Pass extract_source_map only the parameters load_weights fills from the checkpoint "
            f"(leave out state the engine computes itself), or add the checkpoint tensors they "
            f"load from to the checkpoint spec")


def _workers(workers: list[int]) -> str:
    shown = ", ".join(map(str, workers[:4]))
    return f"worker{'s' if len(workers) > 1 else ''} {shown}{'...' if len(workers) > 4 else ''}"


def wire_dtypes(trainer: dict[str, tuple[str, str]], rollout: dict[str, tuple[str, str]]
                ) -> dict[str, tuple[str, str | None, str | None]]:
    """Per checkpoint tensor whose two sides' parameter dtypes differ: (wire dtype, trainer dtype
    if the trainers' pack converts, rollout dtype if the rollouts' assemble converts).

    Both sides give (parameter dtype, checkpoint dtype). A rollout's value is its loader's cast
    of the checkpoint value; the trainers' value is that checkpoint value itself when they load
    it without a cast or widen it exactly, so converting the trainers' value rounds exactly as
    the rollout's loader does. The wire dtype is the narrower one (the fewest bytes; equal
    widths convert on the trainers, so rollouts only copy): float32 trainers send bfloat16 to
    bfloat16 rollouts. Raises LayoutError when the sides name different checkpoint dtypes,
    when the trainers hold a rounded copy (a lossy cast), or for a conversion the kernels do not
    implement (`CONVERTIBLE_DTYPES`).
    """
    out: dict[str, tuple[str, str | None, str | None]] = {}
    differ, lossy, unsupported = [], [], []
    for tensor, (r_dtype, r_ckpt) in rollout.items():
        if tensor not in trainer:
            continue
        t_dtype, t_ckpt = trainer[tensor]
        if t_ckpt != r_ckpt:
            differ.append(f"{tensor!r} (trainer {_as(trainer[tensor])}, rollout "
                          f"{_as(rollout[tensor])})")
        elif t_dtype == r_dtype:
            continue  # the same bytes on both sides (both copy, or both cast alike)
        elif t_ckpt != t_dtype and not exact_cast(t_ckpt, t_dtype):
            lossy.append(f"{tensor!r} ({_as(trainer[tensor])}, rollout {r_dtype})")
        elif t_dtype not in CONVERTIBLE_DTYPES or r_dtype not in CONVERTIBLE_DTYPES:
            unsupported.append(f"{tensor!r} (trainer {t_dtype}, rollout {r_dtype})")
        elif dtype_itemsize(r_dtype) <= dtype_itemsize(t_dtype):
            out[tensor] = (r_dtype, t_dtype, None)
        else:
            out[tensor] = (t_dtype, None, r_dtype)
    if differ:
        raise LayoutError(f"trainer and rollout source maps disagree on the dtype of "
                          f"{len(differ)} checkpoint tensors: {_listed(differ)}. Neither side "
                          f"records a cast that explains it, so they were probed with different "
                          f"checkpoint specs: probe both sides with the spec of the checkpoint "
                          f"the trainer writes (a rollout loader that casts it is mapped, its "
                          f"pieces record cast_from)")
    if lossy:
        raise LayoutError(f"trainer parameters hold a rounded cast of {len(lossy)} checkpoint "
                          f"tensors that rollouts load in another dtype: {_listed(lossy)}. The "
                          f"trainers' bytes no longer determine the rollouts' values; give the "
                          f"trainer parameters the checkpoint's dtype (or the rollouts' dtype)")
    if unsupported:
        raise LayoutError(f"the copy kernels convert only between {', '.join(CONVERTIBLE_DTYPES)}"
                          f", but {len(unsupported)} checkpoint tensors need another conversion: "
                          f"{_listed(unsupported)}. Load those tensors in the same dtype on both "
                          f"sides (a float8 rollout tensor needs a block-scaled loader with a "
                          f"float32 `<name>_scale_inv` parameter beside it; docs/layout.md)")
    return out


@functools.cache
def exact_cast(source: str, target: str) -> bool:
    """Whether every finite value of dtype ``source`` is exactly a value of ``target``."""
    src, dst = getattr(torch, source), getattr(torch, target)
    if src.itemsize > 2:
        return src == dst or (src.itemsize <= dst.itemsize and dst.is_floating_point
                              and torch.finfo(dst).eps <= torch.finfo(src).eps
                              and torch.finfo(dst).max >= torch.finfo(src).max)
    bits = torch.arange(2 ** (8 * src.itemsize), dtype=torch.int32)
    values = bits.to({1: torch.uint8, 2: torch.int16}[src.itemsize]).view(src)
    values = values[torch.isfinite(values.float())]
    back = values.to(dst).to(src)
    return bool(torch.equal(back.float(), values.float()))


def _as(pair: tuple[str, str]) -> str:
    dtype, ckpt = pair
    return dtype if dtype == ckpt else f"{dtype} cast from {ckpt}"


def _listed(items: list[str]) -> str:
    return ", ".join(items[:5]) + (f" and {len(items) - 5} more" if len(items) > 5 else "")


def _missing_message(missing: dict[str, int]) -> str:
    worst = sorted(missing.items(), key=lambda kv: -kv[1])
    listed = ", ".join(f"{t!r} ({n:,} elements)" for t, n in worst[:8])
    more = f" and {len(worst) - 8} more" if len(worst) > 8 else ""
    return (f"rollout workers need {sum(missing.values()):,} checkpoint elements that no trainer "
            f"holds, in {len(missing)} tensors: {listed}{more}. Check that every trainer's source "
            f"map was gathered (all pipeline stages, all expert ranks) and that both sides use "
            f"the same checkpoint names")


def _refine(held: dict[Region, list[int]], wanted: dict[Region, list[int]]
            ) -> tuple[list[tuple[Region, tuple[int, ...], tuple[int, ...]]], int]:
    """Cells of one tensor: (region, holders, needers) covering every wanted element once.

    Returns the cells and the number of wanted elements no trainer holds.
    """
    if len(held) == 1 and len(wanted) == 1:  # the common case: one region each side
        (h_region, h_workers), = held.items()
        (w_region, w_workers), = wanted.items()
        if h_region == w_region or h_region.intersect(w_region) == w_region:
            return [(w_region, _ids(h_workers), _ids(w_workers))], 0
    return _refine_grid(list(held.items()), list(wanted.items()))


def _ids(workers: list[int]) -> tuple[int, ...]:
    return tuple(sorted(set(workers)))


def _refine_grid(held: list[tuple[Region, list[int]]], wanted: list[tuple[Region, list[int]]]
                 ) -> tuple[list[tuple[Region, tuple[int, ...], tuple[int, ...]]], int]:
    """General case: cut the tensor on a per-dim grid so every region is a union of cells.

    Along each dim, coordinates that every region either contains or not form an atom; a cell is
    a product of atoms, so membership in a region is the AND of per-dim memberships.
    """
    regions = [r for r, _ in held] + [r for r, _ in wanted]
    num_held = len(held)
    tensor = regions[0].tensor
    ndim = len(regions[0].start)
    per_dim = [_dim_atoms([(r.start[d], r.count[d], r.step[d]) for r in regions], num_held)
               for d in range(ndim)]
    cells: list[tuple[Region, tuple[int, ...], tuple[int, ...]]] = []
    num_missing = 0
    if ndim == 0:
        member = np.ones((1, len(regions)), dtype=bool)
        progs: list[tuple[tuple[int, int, int], ...]] = [()]
    else:
        member = per_dim[0][1]
        for _, m in per_dim[1:]:
            member = (member[:, None, :] & m[None, :, :]).reshape(-1, len(regions))
        progs = list(itertools.product(*(atoms for atoms, _ in per_dim)))
    needed = member[:, num_held:].any(axis=1)
    signatures, inverse = np.unique(member[needed], axis=0, return_inverse=True)
    owners = []
    for sig in signatures:
        holders = _ids([w for i in np.flatnonzero(sig[:num_held]) for w in held[i][1]])
        needers = _ids([w for i in np.flatnonzero(sig[num_held:]) for w in wanted[i][1]])
        owners.append((holders, needers))
    for cell, sig in zip(np.flatnonzero(needed), inverse.reshape(-1)):
        prog = progs[cell]
        region = Region(tensor, tuple(p[0] for p in prog), tuple(p[1] for p in prog),
                        tuple(p[2] for p in prog))
        holders, needers = owners[sig]
        if holders:
            cells.append((region, holders, needers))
        else:
            num_missing += region.numel
    return cells, num_missing


def _dim_atoms(progs: list[tuple[int, int, int]], num_held: int
               ) -> tuple[list[tuple[int, int, int]], np.ndarray]:
    """Atoms of one dim, as progressions (start, count, step), and their region memberships."""
    if all(step == 1 or count == 1 for _, count, step in progs):
        cuts = sorted({s for s, _, _ in progs} | {s + c for s, c, _ in progs})
        lo = np.array(cuts[:-1])
        hi = np.array(cuts[1:])
        starts = np.array([s for s, _, _ in progs])
        stops = np.array([s + c for s, c, _ in progs])
        member = (starts[None, :] <= lo[:, None]) & (hi[:, None] <= stops[None, :])
        keep = member[:, num_held:].any(axis=1)
        atoms = [(int(a), int(b - a), 1) for a, b in zip(lo[keep], hi[keep])]
        return atoms, member[keep]
    # Strided regions (e.g. a rotary de-interleave): label every coordinate by membership.
    extent = max(s + k * (c - 1) + 1 for s, c, k in progs)
    coord_member = np.zeros((extent, len(progs)), dtype=bool)
    for i, (s, c, k) in enumerate(progs):
        coord_member[s:s + k * (c - 1) + 1:k, i] = True
    useful = coord_member[:, num_held:].any(axis=1)
    signatures, inverse = np.unique(coord_member[useful], axis=0, return_inverse=True)
    coords = np.flatnonzero(useful)
    atoms, member = [], []
    for label, sig in enumerate(signatures):
        for prog in _progressions(coords[inverse.reshape(-1) == label].tolist()):
            atoms.append(prog)
            member.append(sig)
    return atoms, np.array(member, dtype=bool).reshape(len(atoms), len(progs))


def _progressions(coords: list[int]) -> list[tuple[int, int, int]]:
    """Split sorted coordinates into maximal arithmetic progressions, greedily from the left."""
    out, i = [], 0
    while i < len(coords):
        if i + 1 == len(coords):
            out.append((coords[i], 1, 1))
            break
        step, j = coords[i + 1] - coords[i], i + 1
        while j + 1 < len(coords) and coords[j + 1] - coords[j] == step:
            j += 1
        out.append((coords[i], j - i + 1, step))
        i = j + 1
    return out


def needed_bytes(corr: Correspondence) -> list[int]:
    """Bytes each rollout worker needs (once per element, whatever its pieces do with it)."""
    need = [0] * corr.num_rollouts
    for o in corr.overlaps:
        n = o.nbytes
        for w in o.needers:
            need[w] += n
    return need

