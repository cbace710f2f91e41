"""The batch path and the per-line path make identical tables and counts of the same files."""

from __future__ import annotations

import json
import random
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pyarrow as pa
import pytest

from capture import batchpath
from capture import ingest as ingest_mod
from capture.ingest import process_file
from capture.records import make_capture_record, parse_time
from capture.sources import SourceObject, iter_lines, list_objects
from capture.synth import FORMATS, TextPool, exchange, write_layout
from tests.test_capture_fastpath import VARIANTS

FIXTURES = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures" / "datacapture"
T0 = datetime(2025, 5, 1, 10, 0, tzinfo=timezone.utc)
CHAT = {"model": "m", "messages": [{"role": "user", "content": "q"}], "temperature": 0.2}
OK = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "a"}}]}


@pytest.fixture(autouse=True)
def worker(monkeypatch):
    monkeypatch.setattr(ingest_mod, "_WORKER", {})
    ingest_mod._init_worker(None, True, 8 << 20)


def obj_of(path: Path, hour: datetime | None = None) -> SourceObject:
    size = path.stat().st_size
    return SourceObject(str(path), size, str(size), "ep", "AllTraffic", hour)


def both(obj: SourceObject):
    """Run one file through both paths; assert they agree on everything; return the batch result."""
    fast, slow = process_file(obj, batch=True), process_file(obj, batch=False)
    for attr in ("read", "missing", "error", "file_duplicates"):
        assert getattr(fast, attr) == getattr(slow, attr), attr
    assert fast.skips == slow.skips
    assert fast.quarantine == slow.quarantine
    assert fast.row_redactions == slow.row_redactions
    assert fast.table.schema == slow.table.schema
    for name in fast.table.column_names:
        assert fast.table[name].to_pylist() == slow.table[name].to_pylist(), name
    assert fast.table.equals(slow.table)
    assert fast.read == fast.table.num_rows + fast.file_duplicates + len(fast.quarantine) + sum(fast.skips.values())
    return fast


def declined(path: Path, hour: datetime | None = None) -> list[int]:
    lines = list(iter_lines(str(path)))
    return [i + 1 for i in batchpath.decode_chunk(lines, 1, 8 << 20, hour).declined]


def write(path: Path, lines: list[str | bytes]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join((x.encode() if isinstance(x, str) else x) + b"\n" for x in lines))
    return path


def test_synthetic_traffic_of_every_format_is_decided_by_the_batch_path_alone(tmp_path):
    files = write_layout(tmp_path / "cap", 1200, per_file=400, seed=7, start=T0)
    formats = set()
    for p in files:
        assert declined(p) == []  # the batch path decides every line itself (CSV included: skipped)
        res = both(next(o for o in list_objects(str(tmp_path / "cap")) if o.uri == str(p)))
        formats |= set(res.table["format"].to_pylist())
        assert res.skips["not_llm_traffic"] > 0
    assert formats == {"openai_chat", "openai_completion", "tgi", "jumpstart_chat"}


def test_each_synthetic_format_alone(tmp_path):
    pool = TextPool(random.Random(2))
    for fmt in FORMATS:
        p = write(tmp_path / f"{fmt}.jsonl", [make_capture_record(event_id=f"e{i}", inference_time=T0 + timedelta(seconds=i),
                                                                   **exchange(fmt, pool, i)) for i in range(60)])
        res = both(obj_of(p))
        assert res.table.num_rows == (0 if fmt == "tabular_csv" else 60)


def test_real_fixtures(tmp_path):
    paths = sorted(FIXTURES.glob("*.jsonl"))
    assert len(paths) >= 4
    for p in paths:
        both(obj_of(p))
    assert declined(FIXTURES / "llm-jumpstart-llama31.jsonl") == []


def test_bad_input_goes_to_the_per_line_path_by_line_number(tmp_path):
    good = [make_capture_record(CHAT | {"messages": [{"role": "user", "content": f"q{i}"}]}, OK, event_id=f"e{i}",
                                inference_time=T0) for i in range(12)]
    bad_b64 = json.loads(good[3])
    bad_b64["captureData"]["endpointOutput"].update(encoding="BASE64", data="%%%")
    csv_bad_out = json.loads(make_capture_record("1,2", "0.5", request_content_type="text/csv", request_encoding="CSV"))
    csv_bad_out["captureData"]["endpointOutput"].update(encoding="BASE64", data="%%%")
    no_out = json.loads(good[5])
    del no_out["captureData"]["endpointOutput"]
    csv_no_out = json.loads(make_capture_record("1,2", "0.5", request_content_type="text/csv", request_encoding="CSV"))
    del csv_no_out["captureData"]["endpointOutput"]
    no_time = json.loads(good[6])
    del no_time["eventMetadata"]["inferenceTime"]
    lines = [
        good[0],
        b"\xef\xbb\xbf" + good[1].encode(),  # BOM
        good[2][: len(good[2]) // 2],  # truncated JSON
        json.dumps(bad_b64),
        b"",  # empty
        b"   ",  # blank
        good[4].encode().replace(b"q4", b"q\xff4"),  # invalid UTF-8
        good[4].replace("q4", "q\\u00004"),  # NUL through a JSON escape
        json.dumps(csv_bad_out),
        json.dumps(no_out),
        json.dumps(csv_no_out),  # tabular without output: skipped
        make_capture_record("1,2", "0.5", request_content_type="Text/CSV; charset=utf-8"),  # CSV by content type only
        json.dumps(no_time),  # no time, and the file has no layout hour: quarantined
        json.dumps({"captureData": {"endpointInput": {"data": 1}}}),
        "[" * 10_000 + "]" * 10_000,
        good[7] + "\r",  # CRLF
        good[8] + "  ",
        good[9] + ' {"x": 1}',  # two documents on a line
        make_capture_record(CHAT, OK, inference_time="2025-02-30T00:00:00Z"),  # no such day: no time
        make_capture_record(CHAT, OK, inference_time="2025-05-01T10:00:00.250+02:00"),  # not SageMaker's format
        good[10],
        make_capture_record(CHAT | {"messages": [{"role": "user", "content": "x" * 30_000}]}, OK, inference_time=T0),
        good[11],
    ]
    p = write(tmp_path / "bad.jsonl", lines)
    ingest_mod._init_worker(None, True, 25_000)  # the line of 30,000 x is over the limit
    res = both(obj_of(p))
    assert {q["reason"] for q in res.quarantine} >= {"invalid_json", "invalid_base64", "invalid_utf8", "nul_bytes",
                                                      "missing_field", "wrong_type", "too_deeply_nested", "line_too_large"}
    assert res.skips == {"empty_line": 2, "not_llm_traffic": 2, "no_output_captured": 1}
    assert declined(p, None) != [] and 1 not in declined(p, None)
    # With a layout hour the line without a time is kept, stamped with the hour.
    hour = both(obj_of(p, hour=T0))
    assert hour.table.num_rows + hour.file_duplicates == res.table.num_rows + res.file_duplicates + 2


def test_declined_lines_interleave_in_line_order_across_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(ingest_mod, "CHUNK_LINES", 7)
    pool = TextPool(random.Random(5))
    lines = []
    for i in range(60):
        kw = exchange(FORMATS[i % len(FORMATS)], pool, i)
        line = make_capture_record(event_id=f"e{i}", inference_time=T0 + timedelta(seconds=i), **kw)
        lines.append(line if i % 4 else line.replace('"eventVersion"', '"eventVersion":1,"eventVersion"'))
    lines[10] = lines[10][:-3]  # a broken line among them
    # Content parts: the reference path decodes them, the batch path declines them.
    for i in (3, 17, 33):
        lines[i] = make_capture_record({"messages": [{"role": "user", "content": [{"type": "text", "text": f"p{i}"}]}]}, OK,
                                       event_id=f"parts{i}", inference_time=T0)
    res = both(obj_of(write(tmp_path / "mixed.jsonl", lines)))
    nos = res.table["line_no"].to_pylist()
    assert nos == sorted(nos) and {4, 18, 34} <= set(nos)


@pytest.mark.parametrize("encoding", ["JSON", "BASE64"])
def test_edge_variants_of_the_fast_path(tmp_path, encoding):
    lines = []
    for req, resp in VARIANTS:
        ct = "text/event-stream" if isinstance(resp, str) else "application/json"
        lines.append(make_capture_record(req, resp, response_content_type=ct, response_encoding=encoding,
                                         inference_time=T0))
    both(obj_of(write(tmp_path / "variants.jsonl", lines)))


def test_redaction_counts_and_switch(tmp_path):
    pii = "mail bob@example.com, card 4111 1111 1111 1111, key AKIAIOSFODNN7EXAMPLE"
    lines = [make_capture_record(CHAT | {"messages": [{"role": "user", "content": f"{i} {pii if i % 3 == 0 else 'plain'}"}]},
                                 OK, inference_time=T0) for i in range(30)]
    p = write(tmp_path / "pii.jsonl", lines)
    res = both(obj_of(p))
    assert len(res.row_redactions) == 10 and res.row_redactions[0][1] == {"EMAIL": 1, "CARD": 1, "AWS_ACCESS_KEY": 1}
    assert "[REDACTED_EMAIL]" in res.table["conversations"][0].as_py()[0]["value"]
    ingest_mod._init_worker(None, False, 8 << 20)
    off = both(obj_of(p))
    assert off.row_redactions == [] and "bob@example.com" in off.table["conversations"][0].as_py()[0]["value"]


@pytest.mark.parametrize("content", [b"", b"a", b"a\n", b"a\nb", b"\n\n", b"a\r\n\nb\n", b"x" * 3000 + b"\ny"])
def test_local_files_are_split_on_newlines_across_read_blocks(tmp_path, content):
    p = tmp_path / "f.jsonl"
    p.write_bytes(content)
    expected = content.split(b"\n")
    if expected[-1] == b"":
        expected.pop()
    for block in (1, 7, 1 << 20):
        assert list(iter_lines(str(p), chunk_size=block)) == expected


def test_parse_times_matches_parse_time():
    values = ["2025-01-01T00:00:00Z", "2024-02-29T23:59:59Z", "2023-02-29T00:00:00Z", "2024-04-31T00:00:00Z",
              "2024-01-01T23:59:60Z", "2024-01-01T24:00:00Z", "0000-01-01T00:00:00Z", "0999-01-01T00:00:00Z",
              "2024-01-01T10:00:00+02:00", "2024-01-01T10:00:00.123Z", "{%s}", "", None, " 2024-01-01T10:00:00Z ",
              "2024-01-01", "2024-13-01T00:00:00Z", "2024-01-01T10:00:00z", "2024-01-01 10:00:00Z"]
    assert batchpath.parse_times(values).to_pylist() == [parse_time(v) for v in values]


@pytest.mark.parametrize("lines", [[], [b""], [b"not json", b"{}"], [b"x" * 100]],
                         ids=["no lines", "one empty", "all bad", "one long"])
def test_files_without_a_single_row(tmp_path, lines):
    ingest_mod._init_worker(None, True, 50)
    p = tmp_path / "f.jsonl"
    p.write_bytes(b"\n".join(lines) + (b"\n" if lines else b""))
    res = both(obj_of(p))
    assert res.table.num_rows == 0 and res.read == len(lines)


def test_content_hashes_equal_content_hash_of_each_row():
    """Stored hashes must not change: later runs dedupe against the ones already stored."""
    rng = random.Random(4)
    alphabet = ["a", "Z", " ", ":", "0", "é", "😀", "\n", "中"]
    rows = [[(rng.choice(["system", "human", "gpt"]), "".join(rng.choices(alphabet, k=rng.randrange(0, 40))))
             for _ in range(rng.randrange(1, 5))] for _ in range(300)]
    rows.append([("human", "x" * 100_000), ("gpt", "")])
    offsets, t_from, t_value = [0], [], []
    for turns in rows:
        for frm, value in turns:
            t_from.append(frm)
            t_value.append(value)
        offsets.append(len(t_from))
    got = ingest_mod.content_hashes(pa.array(offsets, pa.int32()), pa.array(t_from), pa.array(t_value))
    assert got.to_pylist() == [ingest_mod.content_hash(turns) for turns in rows]
    # The definition itself, pinned: a change here would split replays across runs.
    assert ingest_mod.content_hash([("human", "hi"), ("gpt", "yo")]) == "f3c4e63129a60f7ac077c2c8b0bbb3b2"


def test_token_counts_beyond_int64_are_dropped_not_fatal(tmp_path):
    resp = {"choices": [{"message": {"content": "a"}}]}
    lines = [make_capture_record({"messages": [{"role": "user", "content": "q"}], "max_tokens": 10**20}, resp,
                                 inference_time=T0),
             make_capture_record({"inputs": "q2", "parameters": {"max_new_tokens": -(2**64), "max_tokens": 7}},
                                 [{"generated_text": "a"}], inference_time=T0)]
    res = both(obj_of(write(tmp_path / "big.jsonl", lines)))
    assert res.table["max_tokens"].to_pylist() == [None, 7]


def test_lone_surrogates_are_quarantined_not_fatal(tmp_path):
    resp = {"choices": [{"message": {"content": "a"}}]}
    lines = [make_capture_record('{"messages": [{"role": "user", "content": "q\\ud800"}]}', resp, inference_time=T0),
             make_capture_record('{"model": "m\\udfff", "messages": [{"role": "user", "content": "q2"}]}', resp,
                                 inference_time=T0),
             make_capture_record({"messages": [{"role": "user", "content": "ok \U0001F600"}]}, resp, inference_time=T0)]
    res = both(obj_of(write(tmp_path / "s.jsonl", lines)))
    assert [q["reason"] for q in res.quarantine] == ["invalid_utf8", "invalid_utf8"] and res.table.num_rows == 1
