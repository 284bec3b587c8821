"""Value types: region intersection against brute force, piece properties, spec errors."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weightbridge import CheckpointSpec, TensorSpec, read_checkpoint_spec
from weightbridge.types import Piece, Region


def elements(r: Region) -> set:
    axes = [range(s, s + k * c, k) for s, c, k in zip(r.start, r.count, r.step)]
    return set(itertools.product(*axes))


progression = st.tuples(st.integers(0, 30), st.integers(1, 12), st.integers(1, 6))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(progression, progression), min_size=1, max_size=3))
def test_intersection_is_exactly_the_common_elements(dims):
    a = Region("t", *(tuple(d[0][i] for d in dims) for i in range(3)))
    b = Region("t", *(tuple(d[1][i] for d in dims) for i in range(3)))
    got = a.intersect(b)
    want = elements(a) & elements(b)
    assert (elements(got) if got else set()) == want
    if got:
        assert got.numel == len(want)


def test_regions_of_different_tensors_do_not_intersect():
    assert Region("a", (0,), (4,), (1,)).intersect(Region("b", (0,), (4,), (1,))) is None


def test_transposed_piece_is_detected():
    region = Region("w", (0, 0), (4, 8), (1, 1))
    assert not Piece(region, "p", 0, (8, 1)).transposed
    assert Piece(region, "p", 0, (1, 4)).transposed


def test_checkpoint_spec_rejects_duplicate_names_and_reports_missing_ones():
    with pytest.raises(ValueError, match="appears twice"):
        CheckpointSpec((TensorSpec("a", (1,), "bfloat16"), TensorSpec("a", (2,), "bfloat16")))
    spec = CheckpointSpec((TensorSpec("a", (2, 3), "bfloat16"),))
    assert spec.numel == 6 and "a" in spec
    with pytest.raises(KeyError, match="not a tensor of this checkpoint"):
        spec["b"]


def test_from_safetensors_reads_headers(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    tensors = {"a": torch.zeros(3, 4, dtype=torch.bfloat16), "s": torch.zeros(())}
    save_file(tensors, str(tmp_path / "m.safetensors"))
    spec = read_checkpoint_spec(str(tmp_path / "m.safetensors"))
    assert spec["a"] == TensorSpec("a", (3, 4), "bfloat16") and spec["s"].shape == ()
    with pytest.raises(ValueError, match="cannot read a safetensors header"):
        read_checkpoint_spec(str(tmp_path / "missing.safetensors"))
