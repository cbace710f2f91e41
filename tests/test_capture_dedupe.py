"""The run-wide content-hash set: the native table against a Python set of the strings."""
import hashlib
import random

import numpy as np
import pyarrow as pa
import pytest

from capture import dedupe, native


def _hashes(rng: random.Random, n: int, pool: int) -> list[str]:
    """n hashes drawn from `pool` distinct ones, so that many repeat."""
    distinct = [hashlib.blake2b(str(i).encode(), digest_size=16).hexdigest() for i in range(pool)]
    return [distinct[rng.randrange(pool)] for _ in range(n)]


def test_the_native_table_is_in_use():
    assert native.get() is not None
    assert dedupe.HashSet()._py is None


def test_native_set_equals_python_set_across_growth():
    rng = random.Random(7)
    hs, ref = dedupe.HashSet(), set()
    for size in (0, 1, 5, 300, 4000, 20000, 7):  # the table grows from 1,024 slots several times
        batch = _hashes(rng, size, 30000)
        got = hs.add_new(pa.array(batch, pa.string()))
        assert got.dtype == np.bool_ and got.tolist() == dedupe.first_seen(batch, ref)
        assert len(hs) == len(ref)
    assert hs._slots >= 2 * len(ref)


def test_sliced_and_chunked_arrays():
    rng = random.Random(3)
    batch = _hashes(rng, 500, 200)
    arr = pa.array(["0" * 31 + "x", *batch])  # the bad first string is sliced away
    ref: set[str] = set()
    assert dedupe.HashSet().add_new(arr.slice(1)).tolist() == dedupe.first_seen(batch, ref)
    chunked = pa.chunked_array([pa.array(batch[:100]), pa.array(batch[100:])])
    assert dedupe.HashSet().add_new(chunked).tolist() == dedupe.first_seen(batch, set())
    assert dedupe.HashSet().add_new(pa.chunked_array([], pa.string())).tolist() == []
    large = pa.array(batch, pa.large_string())
    assert dedupe.HashSet().add_new(large).tolist() == dedupe.first_seen(batch, set())


def test_the_all_zero_digest_is_a_member_like_any_other():
    zero, other = "0" * 32, "f" * 32
    hs = dedupe.HashSet()
    assert hs.add_new(pa.array([zero, other, zero])).tolist() == [True, True, False]
    assert hs.add_new(pa.array([other, zero])).tolist() == [False, False]
    assert len(hs) == 2


@pytest.mark.parametrize("bad", ["A" * 32, "0" * 31, "0" * 33, "g" + "0" * 31, "", None])
def test_anything_but_32_lowercase_hex_raises_and_adds_nothing(bad):
    good = hashlib.blake2b(b"x", digest_size=16).hexdigest()
    hs = dedupe.HashSet()
    with pytest.raises(ValueError, match="not 32 lowercase hex"):
        hs.add_new(pa.array([good, bad], pa.string()))
    assert len(hs) == 0
    assert hs.add_new(pa.array([good])).tolist() == [True]


def test_the_python_fallback_matches(monkeypatch):
    monkeypatch.setenv("DRAFTER_ADAPT_NATIVE", "0")
    monkeypatch.setattr(native, "_module", None)
    rng = random.Random(11)
    batch = _hashes(rng, 2000, 500)
    hs = dedupe.HashSet()
    assert hs._py is not None
    assert hs.add_new(pa.array(batch)).tolist() == dedupe.first_seen(batch, set())
    assert len(hs) == len(set(batch))


def test_a_full_table_is_refused_not_looped_on():
    nat = native.get()
    table = bytearray(16 * (2 + 1))
    args = native.utf8_args(pa.array(["1" * 32, "2" * 32, "3" * 32]))
    with pytest.raises(ValueError, match="full"):
        nat.digests_add_new(table, 2, *args)
    with pytest.raises(ValueError, match="power of two"):
        nat.digests_add_new(bytearray(16 * 4), 3, *args)
