"""Built-in verification: writers checksum what they write, receivers what landed (issue 14).

The checksum itself against a plain-Python reference; then, in one process (`tinygroup`), a
transport that corrupts one byte of one write: the update fails closed (the trainers' and the
rollouts' calls raise, naming the worker, the round and the parameters), and nothing of that
round is assembled. With ``checksums=False`` the same corruption goes through: the switch is
real, and the check is what catches it.
"""

import pytest
import torch
from tinygroup import build, connect, in_threads, send

from weightbridge import TransferConfig, TransferFailed
from weightbridge.coordination.local_control import LocalTransport
from weightbridge.execution.checksum import _weights_for, checksum


def _reference(data: bytes) -> int:
    data = data + bytes(-len(data) % 8)
    words = [int.from_bytes(data[i:i + 8], "little", signed=True)
             for i in range(0, len(data), 8)]
    weights = _weights_for(len(words), torch.device("cpu")).tolist()
    total = sum(w * x for w, x in zip(weights, words)) % 2**64
    return total - 2**64 if total >= 2**63 else total


@pytest.mark.parametrize("n", [0, 8, 13, 4096, 50_001])
def test_checksum_is_the_position_weighted_sum_of_words_mod_2_64(n):
    buf = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    assert checksum(buf) == _reference(bytes(buf.tolist()))


def test_checksum_changes_with_any_byte_and_with_word_order():
    buf = torch.randint(0, 256, (4096,), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(1))
    base = checksum(buf)
    for i in (0, 7, 8, 2047, 4095):
        flipped = buf.clone()
        flipped[i] ^= 0x80
        assert checksum(flipped) != base, i
    swapped = buf.view(torch.int64).clone()
    swapped[[3, 4]] = swapped[[4, 3]]
    assert checksum(swapped.view(torch.uint8)) != base
    assert checksum(buf[8:]) == checksum(buf.clone()[8:])  # an offset view sums the same


class FlipsOneByte(LocalTransport):
    """Once armed, corrupts one byte of the next write into rollout 1 (a torn write)."""

    armed = False

    def write(self, peer, key, src):
        super().write(peer, key, src)
        if self.armed and peer.index == 1 and peer.side == "rollout":
            self.armed = False
            index, offset, nbytes = key
            self.control.target(peer).executor.arenas[index][offset + nbytes // 2] ^= 1


def _update_with_a_flipped_byte(checksums: bool):
    """Versions 1 and 2; one byte of one write of version 2 flipped in flight."""
    config = TransferConfig(timeout_s=5, checksums=checksums)
    control, trainers, rollouts = build(config, transport=FlipsOneByte)
    connect(trainers)
    got = []
    for v in (1, 2):
        control.transport.armed = v == 2
        got.append(in_threads(*send(trainers, v, ss=False),
                              *[lambda a=a: a.wait_for_version(v) for _, a in rollouts]))
    return got, rollouts


def test_a_corrupted_write_fails_the_update_before_its_round_is_assembled():
    (first, second), rollouts = _update_with_a_flipped_byte(checksums=True)
    assert first == [None, None, 1, 1], first
    t0, t1, r0, r1 = second
    assert "ChecksumMismatch: R1: the" in str(t0) and "in round 0 differ from what their " \
        "writer sent" in str(t0) and "Nothing of round 0 was assembled" in str(t0), t0
    assert isinstance(t1, TransferFailed), t1
    for r in (r0, r1):  # no engine runs a step on this update
        assert isinstance(r, TransferFailed) and "failed after bytes moved" in str(r), r
    (m1, a1) = rollouts[1]
    assert a1.version == 1 and m1.holds(1)  # the round was never assembled into R1


def test_with_checksums_off_the_same_corruption_is_installed():
    (first, second), rollouts = _update_with_a_flipped_byte(checksums=False)
    assert first == [None, None, 1, 1] and second == [None, None, 2, 2], (first, second)
    # Labelled version 2, not version 2 (R1 forwards what it received, so both may differ).
    assert [a.version for _, a in rollouts] == [2, 2]
    assert not all(m.holds(2) for m, _ in rollouts)


def test_checksums_is_a_bool():
    with pytest.raises(ValueError, match="checksums must be True or False, got 'yes'"):
        TransferConfig(checksums="yes")
