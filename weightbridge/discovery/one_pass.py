"""One index pass where every parameter is one slice-copy; the verification load tells the rest.

A probe makes as many index passes as the checkpoint's indices have digits: two for a bf16
checkpoint of up to about 2^28 elements, three beyond. When the first pass finds every
parameter one run (a row-sharded or whole weight, `merge.one_run`'s case), each run's first
index is known modulo that pass's modulus only: a few thousand candidates, one per residue
class. The verification pass's pseudo-random checkpoint, loaded next, tells them apart: the
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
16-bit dtype, against at most a few hundred thousand candidates."""
MAX_CANDIDATES = 1 << 20
"""Candidates per run at most (the checkpoint's elements over the first modulus): each is a
few int64 temporaries; a checkpoint of more elements (beyond some 3 * 10^10 for a 16-bit
dtype) takes its index passes."""
MIN_NUMEL = 4 * PROBE_ELEMENTS
"""A smaller parameter is not decoded this way: the check after it would repeat the elements
its candidate was chosen by, and so check nothing more."""


def eligible(live: Mapping[str, torch.Tensor], scans: Mapping[str, list[PassRuns]]) -> bool:
    """Every parameter one sourced run of a non-zero step in the first pass, and none too
    small (`MIN_NUMEL`); empty parameters aside."""
    for name, p in live.items():
        if not p.numel():
            continue
        first = scans[name][0]
        if (p.numel() < MIN_NUMEL or first.start.numel() != 1
                or int(first.digit[0]) == NO_SOURCE or not int(first.stride[0])):
            return False
    return True


def decode(live: Mapping[str, torch.Tensor], scans: Mapping[str, list[PassRuns]],
           alpha_of: Callable[[torch.dtype], Alphabet], tindex: TensorIndex,
           checkpoint: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, int]] | None:
    """Per parameter, (first global index, index step) of its one run, from its first pass
    (``scans``, `eligible`) and the values ``checkpoint`` (loaded: the verification pass's
    `random_checkpoint`, views into one ring per dtype) left in it; None when a parameter
    matches no candidate or more than one. The step is the pass's residue step, signed:
    a run whose true step differs from it by a multiple of the modulus matches nothing."""
    bases = torch.tensor(tindex.bases)
    sizes = bases[1:] - bases[:-1]
    names = [t.name for t in tindex.tensors]
    rings = _rings(names, checkpoint)
    out = {}
    for name, p in live.items():
        if not p.numel():
            continue
        first = scans[name][0]
        modulus = alpha_of(p.dtype).moduli[0]
        step = int(first.stride[0])
        step = step - modulus if step > modulus // 2 else step
        if p.dtype not in rings:
            return None
        ring, offsets, same_dtype = rings[p.dtype]
        cand = torch.arange(int(first.digit[0]), tindex.numel, modulus)
        t = torch.searchsorted(bases, cand, right=True) - 1
        off = cand - bases[t]
        last = off + step * (p.numel() - 1)
        ok = same_dtype[t] & (last >= 0) & (last < sizes[t])
        cand, at = cand[ok], offsets[t[ok]] + off[ok]
        span = step * torch.arange(PROBE_ELEMENTS)
        predicted = ring[at[:, None] + span[None, :]]
        match = (predicted == _first_bits(p)[None, :]).all(dim=1)
        if int(match.sum()) != 1:
            return None
        out[name] = (int(cand[match][0]), step)
    return out


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
