"""Block-scaled FP8 in the correspondence: which tensors the trainers' pack quantizes, and which
trainers can compute which scales.

A rollout piece with a block (`Piece.block`) holds float8 values of a checkpoint tensor; a piece
of its `scale_tensor` holds the scales. On the wire both travel as the rollouts hold them
(float8 values, float32 scales: fewer bytes than the trainers' bf16), so the trainers' pack must
quantize, and quantizing a block needs the whole block: a trainer counts as holding an element
of a quantized tensor, and the scale of its block, only when it holds that whole block in one
piece. A block no trainer holds whole (every trainer's shard cuts it) is refused before any
byte moves; sending bf16 and quantizing on the rollouts is not implemented.
"""

from __future__ import annotations

from typing import Callable, Sequence

from weightbridge.errors import LayoutError
from weightbridge.types import (QUANT_DTYPE, SCALE_DTYPE, Region, SourceMap, scale_tensor,
                                scaled_tensor)

Regions = dict[str, dict[Region, list[int]]]


def quantized_tensors(rollout_maps: Sequence[SourceMap]) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor -> block shape, for every tensor some rollout holds block-quantized;
    LayoutError if rollouts quantize one tensor in two block shapes, or load it unquantized too."""
    blocks: dict[str, tuple[int, ...]] = {}
    plain: set[str] = set()
    for smap in {id(m): m for m in rollout_maps}.values():
        for piece in smap.pieces:
            tensor = piece.region.tensor
            if scaled_tensor(tensor) is not None:
                continue
            if not piece.block:
                plain.add(tensor)
            elif blocks.setdefault(tensor, piece.block) != piece.block:
                raise LayoutError(f"rollouts quantize checkpoint tensor {tensor!r} in blocks "
                                  f"{blocks[tensor]} and {piece.block}; every rollout must use "
                                  f"one block shape per tensor")
    both = sorted(plain & set(blocks))
    if both:
        raise LayoutError(f"rollouts load {len(both)} checkpoint tensors both block-quantized and "
                          f"unquantized ({', '.join(map(repr, both[:4]))}); the wire carries one "
                          f"form per tensor: quantize them on every rollout or on none")
    return blocks


def extents(rollout_maps: Sequence[SourceMap], blocks: dict[str, tuple[int, ...]]
            ) -> dict[str, tuple[int, ...]]:
    """The shape of each quantized tensor, as far as the rollouts read it (they read all of it
    wherever a shard ends off a block boundary: the probe allows that only at the tensor end)."""
    out: dict[str, tuple[int, ...]] = {}
    for smap in {id(m): m for m in rollout_maps}.values():
        for piece in smap.pieces:
            r = piece.region
            if r.tensor in blocks:
                have = out.get(r.tensor, (0,) * len(r.start))
                out[r.tensor] = tuple(max(h, s) for h, s in zip(have, r.stop))
    return out


def trainer_scales(held: Regions, blocks: dict[str, tuple[int, ...]],
                   shape: dict[str, tuple[int, ...]]) -> None:
    """Keep, of each trainer region of a quantized tensor, only its whole blocks (a trainer
    quantizes only blocks it holds whole), and add the scale regions of those blocks to
    ``held``. Elements no trainer holds a whole block of are then missing (`missing_message`)."""
    for tensor, block in blocks.items():
        kept: dict[Region, list[int]] = {}
        for region, workers in held.get(tensor, {}).items():
            whole = _whole_blocks(region, block, shape[tensor])
            if whole is None:
                continue
            kept.setdefault(whole, []).extend(workers)
            grid = Region(scale_tensor(tensor), tuple(s // b for s, b in zip(whole.start, block)),
                          tuple(-(-c // b) for c, b in zip(whole.count, block)),
                          (1,) * len(block))
            held.setdefault(grid.tensor, {}).setdefault(grid, []).extend(workers)
        held[tensor] = kept


def _whole_blocks(region: Region, block: tuple[int, ...], full: tuple[int, ...]
                  ) -> Region | None:
    """The part of ``region`` that is whole blocks (blocks cut at the tensor's end count as
    whole), or None when it holds no whole block (or is strided)."""
    if any(k != 1 for k in region.step):
        return None
    start, count = [], []
    for s, c, b, n in zip(region.start, region.count, block, full):
        lo = -(-s // b) * b
        hi = s + c if s + c == n else (s + c) // b * b
        if hi <= lo:
            return None
        start.append(lo), count.append(hi - lo)
    return Region(region.tensor, tuple(start), tuple(count), region.step)


def missing_message(missing: dict[str, int], blocks: dict[str, tuple[int, ...]]) -> str | None:
    """The LayoutError message when elements of quantized tensors are missing, else None."""
    cut = {t: n for t, n in missing.items() if t in blocks}
    if not cut:
        return None
    listed = ", ".join(f"{t!r} ({n:,} elements, {blocks[t]} blocks)"
                       for t, n in sorted(cut.items(), key=lambda kv: -kv[1])[:6])
    return (f"rollouts hold {len(cut)} checkpoint tensors block-quantized, but no single trainer "
            f"holds some of their blocks whole: {listed}. A block is quantized whole by the one "
            f"trainer that packs it, so each needs a trainer whose piece covers it (the "
            f"trainers' shards cut these blocks, or no trainer holds them). Shard the trainers "
            f"on multiples of the block (sending bf16 and quantizing on the rollouts is not "
            f"implemented yet), or load these tensors unquantized on the rollouts")


def wire(blocks: dict[str, tuple[int, ...]], trainer_dtypes: dict[str, tuple[str, str]],
         rollout_dtypes: dict[str, tuple[str, str]], exact_cast: Callable[[str, str], bool]
         ) -> dict[str, tuple[str, str | None, str | None, tuple[int, ...]]]:
    """(wire dtype, trainer dtype, None, block) of each quantized tensor and of its scales;
    LayoutError when the sides disagree on the checkpoint dtype or the trainers hold a rounded
    copy of it (their bytes would not determine the rollouts' values)."""
    out = {}
    for tensor, block in blocks.items():
        if tensor not in trainer_dtypes:
            continue  # correspond reports the missing elements
        t_dtype, t_ckpt = trainer_dtypes[tensor]
        r_ckpt = rollout_dtypes[tensor][1]
        if t_ckpt != r_ckpt or (t_dtype != t_ckpt and not exact_cast(t_ckpt, t_dtype)):
            raise LayoutError(
                f"rollouts block-quantize checkpoint tensor {tensor!r} from {r_ckpt}, but the "
                f"trainers hold it as {t_dtype} (from a {t_ckpt} checkpoint): the trainers' pack "
                f"quantizes their own values, which must be the checkpoint's exactly. Probe both "
                f"sides with the trainer's checkpoint spec, and keep the trainer parameters in "
                f"its dtype (or a wider one)")
        out[tensor] = (QUANT_DTYPE, t_dtype, None, block)
        out[scale_tensor(tensor)] = (SCALE_DTYPE, t_dtype, None, block)
    return out
