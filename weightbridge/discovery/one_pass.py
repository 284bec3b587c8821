"""One index pass where every parameter is one slice-copy; the verification load tells the rest.

A probe makes as many index passes as the checkpoint's indices have digits: two for a bf16
checkpoint of up to about 2^28 elements, three beyond. When the first pass finds every
parameter one run (a row-sharded or whole weight, `merge.one_run`'s case), each run's first
index is known modulo that pass's modulus only: the candidates are the checkpoint's
indices of that residue, a few thousand (`eligible` asks for few enough for the rank's
size). The verification pass's pseudo-random checkpoint, loaded next, tells them apart: the
candidate whose values at the run's first `PROBE_ELEMENTS` elements are the ones the
parameter holds. `decode` picks it; the probe then builds the map and checks it against every
element, as it checks any map (`verify.check_loaded`). A parameter that matches no candidate
or more than one gives None, and the probe goes on with its remaining index passes, so what
this saves (an index load and a scan of the rank) is never bought with a map checked less.

Typical usage (`probe._probe`)::

    runs = decode(live, scans, alpha_of, tindex, checkpoint)  # checkpoint loaded already
    if runs is not None: ...  # {param: (first index, index step)}, else the other passes
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from weightbridge.discovery.boxes import TensorIndex
from weightbridge.discovery.codec import NO_SOURCE, Alphabet
from weightbridge.discovery.merge import PassRuns
from weightbridge.discovery.verify import bits_dtype, flat_view, on_host

PROBE_ELEMENTS = 4
"""Elements of a run compared with each candidate: 64 bits of pseudo-random values for a
16-bit dtype, against a few million candidates at most (`ELEMENTS_PER_CANDIDATE`)."""
ELEMENTS_PER_CANDIDATE = 64
"""The decode takes about 60 ns per candidate here (parameters x checkpoint elements / the
first modulus), a probe pass about 1 ns per element of the rank: at most one candidate per
this many elements of the rank keeps the decode under one pass. (A rank of many parameters
of a large checkpoint, an FSDP2 shard of a 30B model, takes its index passes.)"""
BLOCK = 1 << 16
"""Candidates read at once (a few int64 temporaries of this many: 512 KiB each; a bigger
block measured no faster, each candidate's read of the ring being a cache miss)."""
MIN_NUMEL = 4 * PROBE_ELEMENTS
"""A smaller parameter is not decoded this way: the check after it would repeat the elements
its candidate was chosen by, and so check nothing more."""


def eligible(live: Mapping[str, torch.Tensor], scans: Mapping[str, list[PassRuns]],
             numel: int, alpha_of: Callable[[torch.dtype], Alphabet]) -> bool:
    """Every parameter one sourced run of a non-zero step in the first pass, none too small
    (`MIN_NUMEL`), empty parameters aside; and few enough candidates for the rank
    (`ELEMENTS_PER_CANDIDATE`) in a checkpoint of ``numel`` elements."""
    candidates, elements = 0, 0
    for name, p in live.items():
        if not p.numel():
            continue
        first = scans[name][0]
        if (p.numel() < MIN_NUMEL or first.start.numel() != 1
                or int(first.digit[0]) == NO_SOURCE or not int(first.stride[0])):
            return False
        candidates += -(-numel // alpha_of(p.dtype).moduli[0])
        elements += p.numel()
    return candidates * ELEMENTS_PER_CANDIDATE <= elements


def decode(live: Mapping[str, torch.Tensor], scans: Mapping[str, list[PassRuns]],
           alpha_of: Callable[[torch.dtype], Alphabet], tindex: TensorIndex,
           checkpoint: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, int]] | None:
    """Per parameter, (first global index, index step) of its one run, from its first pass
    (``scans``, `eligible`) and the values ``checkpoint`` (loaded: the verification pass's
    `random_checkpoint`, views into one ring per dtype) left in it; None when a parameter
    matches no candidate or more than one. The step is the pass's residue step, signed:
    a run whose true step differs from it by a multiple of the modulus matches nothing.
    The candidates of all parameters of a dtype are matched together (`_decode_group`)."""
    bases = torch.tensor(tindex.bases)
    names = [t.name for t in tindex.tensors]
    rings = _rings(names, checkpoint)
    out: dict[str, tuple[int, int]] = {}
    by_dtype: dict[torch.dtype, list[str]] = {}
    for name, p in live.items():
        if p.numel():
            by_dtype.setdefault(p.dtype, []).append(name)
    for dtype, group in by_dtype.items():
        if dtype not in rings:
            return None
        found = _decode_group([live[n] for n in group], [scans[n][0] for n in group],
                              alpha_of(dtype).moduli[0], bases, rings[dtype])
        if found is None:
            return None
        out.update(zip(group, found))
    return out


def _decode_group(params: list[torch.Tensor], firsts: list[PassRuns], modulus: int,
                  bases: torch.Tensor, ring: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
                  ) -> list[tuple[int, int]] | None:
    """`decode` of parameters of one dtype. Per checkpoint tensor, its part of the ring seen
    as rows of ``modulus`` values: a parameter's candidates in it are one column (their
    residue), so the first element's value is read for every parameter and a block of
    tensors at once (a few operations per `BLOCK` candidates). That leaves about one
    candidate in the alphabet's size; only those are checked further (in range, the first
    `PROBE_ELEMENTS` elements)."""
    bits, offsets, same_dtype = ring
    steps = [int(f.stride[0]) for f in firsts]
    steps = [s - modulus if s > modulus // 2 else s for s in steps]
    digits = torch.tensor([int(f.digit[0]) for f in firsts])
    seen = torch.stack([_first_bits(p) for p in params])
    found, owners = [], []
    tensors = torch.nonzero(same_dtype).squeeze(1)
    sizes = bases[1:] - bases[:-1]
    rows = int(-(-sizes[tensors].max() // modulus))
    block = max(1, BLOCK // (rows * len(params)))
    down = modulus * torch.arange(rows)
    for ts in torch.split(tensors, block):  # [block, rows, parameters] at a time
        column = (digits[None, :] - bases[ts][:, None]) % modulus  # residue in each tensor
        off = column[:, None, :] + down[None, :, None]
        at = (offsets[ts][:, None, None] + off).clamp(max=bits.numel() - 1)
        hit = (bits[at] == seen[None, None, :, 0]) & (off < sizes[ts][:, None, None])
        b, _, owner = torch.nonzero(hit, as_tuple=True)
        found.append(bases[ts][b] + off[hit])
        owners.append(owner)
    if not found:
        return None
    cand, owner = torch.cat(found), torch.cat(owners)
    order = torch.argsort(owner, stable=True)
    cand, owner = cand[order], owner[order]
    step = torch.tensor(steps)[owner]
    t = torch.searchsorted(bases, cand, right=True) - 1
    off = cand - bases[t]
    last = off + step * (torch.tensor([p.numel() for p in params])[owner] - 1)
    ok = (off < bases[t + 1] - bases[t]) & (last >= 0) & (last < bases[t + 1] - bases[t])
    cand, owner, step = cand[ok], owner[ok], step[ok]
    at = offsets[t[ok]] + off[ok]
    predicted = bits[at[:, None] + step[:, None] * torch.arange(PROBE_ELEMENTS)[None, :]]
    match = (predicted == seen[owner]).all(dim=1)
    if not torch.equal(torch.bincount(owner[match], minlength=len(params)),
                       torch.ones(len(params), dtype=torch.int64)):
        return None
    return list(zip(cand[match].tolist(), steps))  # (sorted by owner: one match each)


def _rings(names: list[str], checkpoint: Mapping[str, torch.Tensor]
           ) -> dict[torch.dtype, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per dtype: its ring's bits (the storage the checkpoint's tensors of that dtype view),
    each tensor's offset into it, and which tensors are of that dtype."""
    out = {}
    for dtype in {checkpoint[n].dtype for n in names}:
        views = [checkpoint[n] for n in names if checkpoint[n].dtype == dtype]
        storage = views[0].untyped_storage()
        assert all(v.untyped_storage().data_ptr() == storage.data_ptr() for v in views)
        ring = torch.as_strided(views[0], (storage.nbytes() // dtype.itemsize,), (1,), 0)
        same = torch.tensor([checkpoint[n].dtype == dtype for n in names])
        offsets = torch.tensor([checkpoint[n].storage_offset() for n in names])
        out[dtype] = (ring.view(bits_dtype(dtype)), offsets, same)
    return out


def _first_bits(p: torch.Tensor) -> torch.Tensor:
    """The bits of ``p``'s first `PROBE_ELEMENTS` elements in logical order, on the host (a
    contiguous parameter reads only those)."""
    p = p.detach()
    first = p.reshape(-1)[:PROBE_ELEMENTS] if p.is_contiguous() else flat_view(on_host(p))[
        :PROBE_ELEMENTS]
    return first.to("cpu", copy=True).view(bits_dtype(p.dtype))
