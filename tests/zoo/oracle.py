"""The replay oracle: a source map must fill params exactly as the loader does, bit for bit.

``check_replay`` loads one pseudo-random checkpoint through the loader into one build of a
worker (A) and replays the map into another build (B) that started from the same contents, then
compares the bytes of every element:

- sourced elements (some piece writes them): A == B;
- unsourced elements: B is untouched, and A is untouched too unless the loader overwrites them
  with constants (``Expect.filled``: zero-padded vocab rows).

Workers whose params are a callable (loaders that replace tensors) are first loaded once with
another checkpoint, as an engine is at start-up, so B has the post-load tensors the map names.
"""

from __future__ import annotations

import math
from typing import Callable, Mapping

import torch

from weightbridge import CheckpointSpec, SourceMap, replay
from weightbridge.types import Piece
from weightbridge.views import memory_order

from .common import INT_VIEW, Worker

Params = Mapping[str, torch.Tensor]


def element_bits(t: torch.Tensor) -> torch.Tensor:
    """The logical (row-major) elements of ``t`` as same-width integers, 1-d."""
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(INT_VIEW[t.element_size()])


def piece_targets(piece: Piece) -> torch.Tensor:
    """Param logical flat indices the piece writes, in region row-major order."""
    idx = torch.tensor(piece.offset, dtype=torch.int64)
    for count, stride in zip(piece.region.count, piece.strides):
        idx = idx[..., None] + torch.arange(count, dtype=torch.int64) * stride
    return idx.reshape(-1)


def piece_sources(piece: Piece, shape: tuple[int, ...]) -> torch.Tensor:
    """Checkpoint-tensor flat indices the piece reads, in region row-major order."""
    r = piece.region
    idx = torch.tensor(0, dtype=torch.int64)
    for start, count, step, dim_stride in zip(r.start, r.count, r.step, _row_major(shape)):
        idx = idx[..., None] + (start + step * torch.arange(count, dtype=torch.int64)) * dim_stride
    return idx.reshape(-1)


def _row_major(shape: tuple[int, ...]) -> list[int]:
    return [math.prod(shape[d + 1:]) for d in range(len(shape))]


def check_well_formed(smap: SourceMap, spec: CheckpointSpec, params: Params
                      ) -> dict[str, torch.Tensor]:
    """Assert every piece is in bounds and no param element has two sources; return, per param,
    how many pieces write each element (0 or 1)."""
    cover = {name: torch.zeros(p.numel(), dtype=torch.int32) for name, p in params.items()}
    for piece in smap.pieces:
        r = piece.region
        assert piece.param in params, f"{piece}: no such param"
        assert r.tensor in spec, f"{piece}: no such checkpoint tensor"
        shape = spec[r.tensor].shape
        ndim = len(shape)
        assert len(r.start) == len(r.count) == len(r.step) == len(piece.strides) == ndim, piece
        assert all(c >= 1 for c in r.count) and all(k >= 1 for k in r.step), piece
        inside = all(0 <= s and s + k * (c - 1) < n
                     for s, c, k, n in zip(r.start, r.count, r.step, shape))
        assert inside, f"{piece}: region outside checkpoint shape {shape}"
        targets = piece_targets(piece)
        numel = cover[piece.param].numel()
        assert int(targets.min()) >= 0 and int(targets.max()) < numel, (
            f"{piece}: writes outside param {piece.param!r} of {numel} elements")
        cover[piece.param].index_add_(0, targets, torch.ones_like(targets, dtype=torch.int32))
    for name, c in cover.items():
        if c.numel() and int(c.max()) > 1:
            i = int((c > 1).nonzero()[0])
            raise AssertionError(f"param {name!r} element {i} is written by {int(c[i])} pieces")
    return cover


def check_params_listed(smap: SourceMap, params: Params) -> None:
    """SourceMap.params names every live param with its logical shape and dtype."""
    listed = {p.name: (tuple(p.shape), p.dtype) for p in smap.params}
    live = {n: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in params.items()}
    assert listed == live


def check_unsourced_report(smap: SourceMap, cover: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """``smap.unsourced`` agrees with the pieces; returns it as a dict (params with any)."""
    from_pieces = {n: int((c == 0).sum()) for n, c in cover.items() if int((c == 0).sum())}
    reported = dict(smap.unsourced)
    assert reported == from_pieces, f"unsourced reported {reported}, pieces leave {from_pieces}"
    return reported


def compare(a: Params, b: Params, before: Params, cover: Mapping[str, torch.Tensor],
            filled: frozenset[str] = frozenset()) -> None:
    """A (loader) vs B (replay) vs B's contents before the replay, element by element."""
    for name in a:
        ab, bb, ref = element_bits(a[name]), element_bits(b[name]), element_bits(before[name])
        sourced = cover[name] > 0
        for bad, what in (
            ((ab != bb) & sourced, "the loader and the replayed map disagree"),
            ((bb != ref) & ~sourced, "the replay changed an element the map calls unsourced"),
            ((ab != ref) & ~sourced if name not in filled else None,
             "the loader wrote an element the map calls unsourced"),
        ):
            if bad is not None and bool(bad.any()):
                i = int(bad.nonzero()[0])
                index = tuple(int(x) for x in torch.unravel_index(torch.tensor(i), a[name].shape)) \
                    if a[name].dim() else ()
                raise AssertionError(
                    f"param {name!r} {tuple(a[name].shape)} {a[name].dtype}, element {index} "
                    f"(flat {i}): {what}: loader bits {int(ab[i]):#x}, replay bits "
                    f"{int(bb[i]):#x}, before {int(ref[i]):#x}; {int(bad.sum())} such elements")


def check_replay(build: Callable[[], Worker], smap: SourceMap, seed: int = 1234) -> None:
    """Loader into build A vs ``replay(smap, ...)`` into build B, bit-exactly (see module
    docstring)."""
    a, b = build(), build()
    checkpoint = a.checkpoint(seed)
    if callable(b.params):
        b.load_weights(iter(b.checkpoint(seed + 1).items()))
    before = {n: memory_order(t.detach()).clone() for n, t in b.live().items()}
    a.load_weights((n, t.clone()) for n, t in checkpoint.items())
    replay(smap, b.live(), checkpoint)
    # The map describes transposed-view parameters in memory order, as the library sees them.
    seen_a = {n: memory_order(t) for n, t in a.live().items()}
    seen_b = {n: memory_order(t) for n, t in b.live().items()}
    cover = check_well_formed(smap, a.spec, seen_a)
    compare(seen_a, seen_b, before, cover, a.expect.filled)
