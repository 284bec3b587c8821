"""The index codec: digits survive copies, passes recombine exactly, patterns stay safe."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from weightbridge.discovery import codec, verify

DTYPES = codec.SUPPORTED_DTYPES


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_digit_is_a_finite_positive_normal_number(dtype):
    alpha = codec.alphabet(dtype)
    p = alpha.moduli[0]
    values = codec.encode(0, min(p, 1 << 16), alpha, p).float()
    assert torch.isfinite(values).all()
    assert (values >= torch.finfo(dtype).tiny).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_encode_decode_round_trips_through_a_copy(dtype):
    alpha = codec.alphabet(dtype)
    for p in alpha.moduli[:3]:
        values = codec.encode(987_654, 50_001, alpha, p)
        copied = torch.empty_like(values).copy_(values)
        assert torch.equal(codec.decode(copied, alpha, p), torch.arange(987_654, 1_037_655) % p)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_zero_nan_inf_and_negatives_decode_as_no_source(dtype):
    alpha = codec.alphabet(dtype)
    specials = torch.tensor([0.0, -0.0, float("nan"), -1.0]).to(dtype)
    if dtype != torch.float8_e4m3fn:  # e4m3fn has no infinity
        specials = torch.cat([specials, torch.tensor([float("inf")]).to(dtype)])
    assert (codec.decode(specials, alpha, alpha.moduli[0]) == codec.NO_SOURCE).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_moduli_are_distinct_primes_below_the_alphabet_size(dtype):
    alpha = codec.alphabet(dtype)
    assert len(set(alpha.moduli)) == len(alpha.moduli)
    assert all(codec._is_prime(p) and p < alpha.size for p in alpha.moduli)


@pytest.mark.parametrize("dtype,num,passes", [
    (torch.bfloat16, 10**6, 2), (torch.bfloat16, 2 * 10**8, 2), (torch.bfloat16, 10**12, 3),
    (torch.float32, 10**8, 1), (torch.float8_e4m3fn, 10**6, 4)], ids=str)
def test_number_of_passes_covers_four_times_the_checkpoint(dtype, num, passes):
    alpha = codec.alphabet(dtype)
    assert alpha.num_passes(num) == passes
    assert math.prod(alpha.moduli[:passes]) > 4 * num


def test_unsupported_dtype_is_a_clear_error():
    with pytest.raises(ValueError, match="supports.*int64"):
        codec.alphabet(torch.int64)


@settings(max_examples=50, deadline=None)
@given(st.sampled_from(DTYPES), st.lists(st.integers(0, 10**9), min_size=1, max_size=20))
def test_crt_recovers_values_below_the_moduli_product(dtype, values):
    alpha = codec.alphabet(dtype)
    k = alpha.num_passes(10**9 // 4)
    moduli = alpha.moduli[:k]
    x = torch.tensor(values) % math.prod(moduli)
    assert torch.equal(codec.crt([x % p for p in moduli], moduli), x)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_signed_values_are_finite_normal_numbers_negated_where_asked(dtype):
    """The verification checkpoint's values: both signs, every one still a safe pattern."""
    alpha = codec.alphabet(dtype)
    digits = torch.tensor([0, 1, alpha.size // 2, alpha.size - 1] * 2)
    negative = torch.tensor([False] * 4 + [True] * 4)
    values = codec.signed_values(digits, negative, alpha).float()
    positive = codec.digits_to_values(digits, alpha).float()
    assert torch.equal(values, torch.where(negative, -positive, positive))
    assert torch.isfinite(values).all()
    assert (values.abs() >= torch.finfo(dtype).tiny).all()


@pytest.mark.parametrize("negative", [False, True], ids=["both signs", "negative"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_verification_draw_gives_signed_values_of_its_words(dtype, negative):
    """`verify._draw`: value ``j`` is `signed_values` of the draw its word
    ``a[j mod 1021] ^ b[j mod q]`` scales to (8- and 16-bit values looked up in a table, bit
    for bit the same), one draw giving magnitude and sign."""
    alpha = codec.alphabet(dtype)
    size = verify.random_period(1)
    got = verify._draw(torch.empty(size, dtype=dtype), alpha, negative,
                       torch.Generator().manual_seed(7))
    gen, wide = torch.Generator().manual_seed(7), alpha.size > verify._TABLE_MAX
    q = size // 1021
    a, b = (torch.randint(0, 1 << (32 if wide else 16), (n,), generator=gen) for n in (1021, q))
    j = torch.arange(size)
    words = a[j % 1021] ^ b[j % q]
    span = 2 * alpha.size
    draws = (words >> 2) * span >> 30 if wide else words * span >> 16
    below = draws >= alpha.size
    want = codec.signed_values(draws - below * alpha.size,
                               torch.ones_like(below) if negative else below, alpha)
    bits = alpha.bits_dtype
    assert torch.equal(got.view(bits), want.view(bits))
    assert bool((got.float() < 0).all()) if negative else bool((got.float() > 0).any())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_the_verification_ring_shows_a_wrong_offset_at_almost_every_element(dtype):
    """A map off by any offset but a multiple of the period predicts another value at all but
    about one element in 2^16 (the short rings' own periods and a power of two included), and
    the ring takes every value of both signs."""
    alpha = codec.alphabet(dtype)
    size = verify.random_period(1 << 22)
    ring = verify._draw(torch.empty(size, dtype=dtype), alpha, False,
                        torch.Generator().manual_seed(3)).view(alpha.bits_dtype)
    assert ring.unique().numel() == 2 * alpha.size
    q = size // 1021
    for shift in (1, 2, 1021, q, 4096, 2 * 1021, 1021 * 7 + 3):
        same = (ring == ring.roll(shift)).float().mean().item()
        assert same < 1e-3, (shift, same)
