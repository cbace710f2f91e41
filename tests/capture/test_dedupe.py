"""The run-wide content-hash set: the native table against a Python set of the strings."""
import contextlib
import hashlib
import random

import numpy as np
import pyarrow as pa
import pytest

from capture import backend, dedupe, native


def _hashes(rng: random.Random, n: int, pool: int) -> list[str]:
    """n hashes drawn from `pool` distinct ones, so that many repeat."""
    distinct = [hashlib.blake2b(str(i).encode(), digest_size=16).hexdigest() for i in range(pool)]
    return [distinct[rng.randrange(pool)] for _ in range(n)]


def test_the_native_table_is_in_use():
    assert backend.native() is not None
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
    monkeypatch.setenv("DRAFTER_ADAPT_NATIVE", "0")  # as a machine without the module runs
    rng = random.Random(11)
    batch = _hashes(rng, 2000, 500)
    hs = dedupe.HashSet()
    assert hs._py is not None
    assert hs.add_new(pa.array(batch)).tolist() == dedupe.first_seen(batch, set())
    assert len(hs) == len(set(batch))


def test_a_full_table_is_refused_not_looped_on():
    nat = native.load()
    table = bytearray(16 * (2 + 1))
    args = native.utf8_args(pa.array(["1" * 32, "2" * 32, "3" * 32]))
    with pytest.raises(ValueError, match="full"):
        nat.digests_add_new(table, 2, *args)
    with pytest.raises(ValueError, match="power of two"):
        nat.digests_add_new(bytearray(16 * 4), 3, *args)


# ---- in-file replays dropped by the native decoder ---------------------------------------

from contextlib import nullcontext  # noqa: E402
from datetime import datetime, timedelta, timezone  # noqa: E402

from capture import batchpath, ingest  # noqa: E402
from capture.records import make_capture_record  # noqa: E402
from capture.sources import SourceObject  # noqa: E402

T0 = datetime(2025, 5, 1, 10, 0, tzinfo=timezone.utc)
# canonical; no such day (quarantined without a layout hour); parsed only by Python; none at all
TIMES = [T0, "2025-02-30T00:00:00Z", "2025-05-01T10:00:00.250+02:00", ""]


def _exchange(k: int, email: str = "") -> dict:
    return {"request": {"messages": [{"role": "user", "content": f"question {k % 7} {email}"}]},
            "response": {"choices": [{"message": {"role": "assistant", "content": f"answer {k % 5} ünïcödé"}}]}}


def _replays_file(tmp_path, rng: random.Random, declined: float, n: int = 400):
    """Lines that replay few exchanges, with every kind of time, PII that redaction makes alike,
    and lines the native decoder declines (an escaped key) so that the per-line path mixes in."""
    lines = []
    for i in range(n):
        kw = _exchange(rng.randrange(12), email=rng.choice(["", "", f"mail{i}@example.com"]))
        line = make_capture_record(kw["request"], kw["response"], event_id=f"e{i}",
                                   inference_time=rng.choice(TIMES + [T0 + timedelta(seconds=i)] * 3))
        if rng.random() < declined:
            line = line.replace('"captureData"', '"\\u0063aptureData"', 1)  # declined natively, same meaning
        lines.append(line)
    p = tmp_path / f"replays-{rng.random()}.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def _result(p, hour, native_on: bool):
    with nullcontext() if native_on else backend.python_fallback():
        return ingest.process_file(SourceObject(str(p), p.stat().st_size, "e", "ep", "AllTraffic", hour),
                                   ingest.FileOptions(max_line_bytes=1 << 26))


@pytest.mark.parametrize("hour", [None, T0])
@pytest.mark.parametrize("declined", [0.0, 0.05])
@pytest.mark.parametrize("seed", [1, 2])
def test_replays_dropped_while_decoding_leave_the_same_file_result(tmp_path, hour, declined, seed):
    p = _replays_file(tmp_path, random.Random(seed), declined)
    on, off = _result(p, hour, True), _result(p, hour, False)
    for attr in ("read", "file_duplicates", "skips", "quarantine", "row_redactions"):
        assert getattr(on, attr) == getattr(off, attr), attr
    assert on.table.to_pylist() == off.table.to_pylist()
    assert on.file_duplicates > 100 and len(on.quarantine) > (0 if hour is None else -1)
    assert on.read == on.table.num_rows + on.file_duplicates + len(on.quarantine) + sum(on.skips.values())


def test_the_decoder_drops_copies_and_hashes_what_it_keeps(tmp_path):
    rng = random.Random(9)
    lines = []
    for i in range(300):
        kw = _exchange(rng.randrange(20))
        lines.append(make_capture_record(kw["request"], kw["response"], event_id=f"e{i}",
                                         inference_time=T0 + timedelta(seconds=i)))
    block = ("\n".join(lines) + "\n").encode()
    seen = dedupe.HashSet()
    got = batchpath.decode_block(block, 0, 1, 8192, 1 << 26, None, seen)
    plain = batchpath.decode_block(block, 0, 1, 8192, 1 << 26, None)
    convs = plain.batch.column("conversations")
    want = [ingest.content_hash((t["from"], t["value"]) for t in c) for c in convs.to_pylist()]
    first = [h not in want[:i] for i, h in enumerate(want)]
    assert got.duplicates == first.count(False) > 200
    assert got.hashes.to_pylist() == [h for h, f in zip(want, first) if f] and len(seen) == len(set(want))
    assert got.batch.column("line_no").to_pylist() == [i + 1 for i, f in enumerate(first) if f]
    # a second block of the same file: every row is a copy now
    again = batchpath.decode_block(block, 0, 301, 8192, 1 << 26, None, seen)
    assert again.batch.num_rows == 0 and again.duplicates == 300


def test_a_full_table_stops_dropping_but_keeps_every_row(tmp_path):
    kw = _exchange(1)
    block = ("\n".join(make_capture_record(kw["request"], kw["response"], event_id=f"e{i}", inference_time=T0)
                       for i in range(50)) + "\n").encode()
    odd = block.replace(b"2025-05-01T10:00:00Z", b"2025-05-01T10:00:00+00:00")
    nat = native.load()
    table = bytearray(16 * (1024 + 1))
    out = nat.decode_block(block, 0, 8192, 1 << 26, table, 1024, 0, True)  # no room: nothing goes in
    assert (out["rows"], out["duplicates"], out["inserted"], out["unchecked"]) == (50, 0, 0, 50)
    out = nat.decode_block(block, 0, 8192, 1 << 26, table, 1024, 1, True)
    assert (out["rows"], out["duplicates"], out["inserted"], out["unchecked"]) == (1, 49, 1, 0)
    out = nat.decode_block(odd, 0, 8192, 1 << 26, bytearray(16 * 1025), 1024, 9, False)  # times not canonical
    assert (out["rows"], out["duplicates"], out["inserted"], out["unchecked"]) == (50, 0, 0, 50)
    with pytest.raises(ValueError, match="half full"):
        nat.decode_block(block, 0, 8192, 1 << 26, table, 1024, 513, True)


@pytest.mark.parametrize("fallback", [False, True])
def test_contains_answers_membership_and_adds_nothing(fallback):
    rng = random.Random(8)
    with backend.python_fallback() if fallback else contextlib.nullcontext():
        hs = dedupe.HashSet()
        assert hs.contains(pa.array(["0" * 32], pa.string())).tolist() == [False]
        members = [f"{rng.getrandbits(128):032x}" for _ in range(3000)] + ["0" * 32]
        hs.add_new(pa.array(members, pa.string()))
        probe = members[::7] + [f"{rng.getrandbits(128):032x}" for _ in range(500)]
        arr = pa.array(["pad"] + probe, pa.string()).slice(1)
        assert hs.contains(arr).tolist() == [p in set(members) for p in probe]
        assert len(hs) == len(members)  # nothing was added
        assert hs.contains(pa.chunked_array([], pa.string())).tolist() == []
