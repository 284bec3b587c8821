"""Checksums of round-buffer bytes, computed where the bytes are: the end-to-end check of an update.

Every write's source bytes are summed by the worker that writes them (a trainer's packed round,
a rollout's forwarded slice); every receiver sums the same range of its round buffer once the
round has landed, before it assembles anything, and compares. So a torn, short, misplaced or
overwritten write is caught before a byte of that round enters the parameters.

Two functions, chosen by where the writer's bytes are, so that neither side copies them:

- **Host memory: XXH3-64** (``xxhash``) over the bytes in place: several GB/s on one core and
  well under a microsecond for a small write, so the check costs little next to the write.
- **Device memory: a position-weighted sum** over 64-bit words, ``sum(word[i] * W[i]) mod
  2**64`` with fixed odd weights ``W``: two passes of torch on the device (no copy to the
  host). Any change to one word changes it (an odd weight is invertible mod 2**64).

The value says which function made it (device sums are tagged with bit 64), and `matches`
recomputes that one on the receiver's bytes, so a host writer and a device receiver (sender
staging into GPU arenas) still agree; only then does the receiver copy its range to the host.

Typical usage::

    h = checksum(arena[offset:offset + nbytes])          # writer, after packing
    if not matches(arena[offset:offset + nbytes], h): ...  # receiver, after the round landed
"""

from __future__ import annotations

import threading

import torch
import xxhash

DEVICE_TAG = 1 << 64
"""Set on device (weighted-sum) checksums; host (XXH3-64) ones are below it."""
_MASK = DEVICE_TAG - 1
_SEED = 0x5EED_B41D6E
_weights: dict[torch.device, torch.Tensor] = {}
_lock = threading.Lock()


def checksum(buf: torch.Tensor) -> int:
    """The checksum of a 1-d uint8 buffer's bytes: XXH3-64 on the host, the tagged
    position-weighted sum on a device."""
    assert buf.dtype == torch.uint8 and buf.dim() == 1, (buf.dtype, buf.shape)
    return host_checksum(buf) if buf.device.type == "cpu" else device_checksum(buf)


def matches(buf: torch.Tensor, want: int) -> bool:
    """Whether ``buf`` holds the bytes ``want`` was computed from, by the same function."""
    if want >= DEVICE_TAG:
        return device_checksum(buf) == want
    return host_checksum(buf if buf.device.type == "cpu" else buf.cpu()) == want


def host_checksum(buf: torch.Tensor) -> int:
    """XXH3-64 of a host buffer's bytes, read in place."""
    if not buf.is_contiguous():
        buf = buf.contiguous()
    return xxhash.xxh3_64_intdigest(memoryview(buf.numpy()))


def device_checksum(buf: torch.Tensor) -> int:
    """The position-weighted sum of a 1-d uint8 buffer's words, tagged with `DEVICE_TAG`.

    A buffer whose length is not a multiple of 8 is summed as if zero-padded to one (round
    buffers are 8-byte aligned: every write is). Runs on any device (tests run it on CPU).
    """
    n = buf.numel()
    if n % 8:
        buf = torch.cat([buf, buf.new_zeros(8 - n % 8)])
    if buf.storage_offset() % 8 or not buf.is_contiguous():
        buf = buf.clone()  # an int64 view needs 8-byte aligned storage
    words = buf.view(torch.int64)
    # int64 products and sums wrap mod 2**64: the hash is exact integer arithmetic.
    return (int((words * _weights_for(words.numel(), buf.device)).sum()) & _MASK) | DEVICE_TAG


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
