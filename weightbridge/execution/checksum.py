"""Checksums of round-buffer bytes, computed where the bytes are: the end-to-end check of an update.

Every write's source bytes are summed by the worker that writes them (a trainer's packed round,
a rollout's forwarded slice); every receiver sums the same range of its round buffer once the
round has landed, before it assembles anything, and compares. So a torn, short, misplaced or
overwritten write is caught before a byte of that round enters the parameters.

The sum is position-weighted over 64-bit words: ``sum(word[i] * W[i]) mod 2**64`` with fixed
odd weights ``W``. Any change to one word changes it (an odd weight is invertible mod 2**64);
two changes cancel only by accident (about 2**-64 for unrelated data). It is two passes of
torch over the bytes on their own device (a multiply and a sum; no copy to the host).

Typical usage::

    h = checksum(arena[offset:offset + nbytes])     # writer, after packing
    if checksum(arena[offset:offset + nbytes]) != h: ...   # receiver, after the round landed
"""

from __future__ import annotations

import threading

import torch

_SEED = 0x5EED_B41D6E
_weights: dict[torch.device, torch.Tensor] = {}
_lock = threading.Lock()


def _weights_for(n: int, device: torch.device) -> torch.Tensor:
    """The first ``n`` fixed odd weights on ``device`` (grown by doubling, kept per device)."""
    with _lock:
        w = _weights.get(device)
        if w is None or w.numel() < n:
            size = max(n, 2 * (0 if w is None else w.numel()), 1 << 12)
            gen = torch.Generator().manual_seed(_SEED)
            host = torch.randint(-2**62, 2**62, (size,), dtype=torch.int64, generator=gen) | 1
            w = _weights[device] = host.to(device)
        return w[:n]


def checksum(buf: torch.Tensor) -> int:
    """The position-weighted sum of a 1-d uint8 buffer's bytes, as a Python int.

    A buffer whose length is not a multiple of 8 is summed as if zero-padded to one (round
    buffers are 8-byte aligned: every write is).
    """
    assert buf.dtype == torch.uint8 and buf.dim() == 1, (buf.dtype, buf.shape)
    n = buf.numel()
    if n % 8:
        buf = torch.cat([buf, buf.new_zeros(8 - n % 8)])
    if buf.storage_offset() % 8 or not buf.is_contiguous():
        buf = buf.clone()  # an int64 view needs 8-byte aligned storage
    words = buf.view(torch.int64)
    # int64 products and sums wrap mod 2**64: the hash is exact integer arithmetic.
    return int((words * _weights_for(words.numel(), buf.device)).sum())
