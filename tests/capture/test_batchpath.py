"""The batch path and the per-line path make identical tables and counts of the same files."""

from __future__ import annotations

import io
import json
import random
from collections import Counter
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path

import pyarrow as pa
import pytest

from capture import backend, batchpath
from capture import ingest as ingest_mod
from capture.ingest import FileOptions, process_file
from capture.records import make_capture_record, parse_time
from capture.sources import SourceObject, iter_blocks, iter_lines, list_objects
from capture.synth import FORMATS, PLAIN_MIX, TextPool, exchange, write_layout
from tests.capture_support import T0, VARIANTS, obj_of, write
from tests.paths import DATACAPTURE

CHAT = {"model": "m", "messages": [{"role": "user", "content": "q"}], "temperature": 0.2}
OK = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "a"}}]}
OPTS = FileOptions(redact=True, max_line_bytes=8 << 20)


def both(obj: SourceObject, opts: FileOptions = OPTS):
    """Run one file through both paths; assert they agree on everything; return the batch result."""
    fast, slow = process_file(obj, opts, batch=True), process_file(obj, opts, batch=False)
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


def declined(path: Path, hour=None) -> list[int]:
    lines = list(iter_lines(str(path)))
    return [i + 1 for i in batchpath.decode_chunk(lines, 1, 8 << 20, hour).declined]


def test_synthetic_traffic_of_every_format_is_decided_by_the_batch_path_alone(tmp_path):
    files = write_layout(tmp_path / "cap", 1200, per_file=400, seed=7, start=T0, mix=PLAIN_MIX)
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
    paths = sorted(DATACAPTURE.glob("*.jsonl"))
    assert len(paths) >= 4
    for p in paths:
        both(obj_of(p))
    assert declined(DATACAPTURE / "llm-jumpstart-llama31.jsonl") == []


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
    opts = FileOptions(redact=True, max_line_bytes=25_000)  # the line of 30,000 x is over the limit
    res = both(obj_of(p), opts)
    assert {q["reason"] for q in res.quarantine} >= {"invalid_json", "invalid_base64", "invalid_utf8", "nul_bytes",
                                                      "missing_field", "wrong_type", "too_deeply_nested", "line_too_large"}
    assert res.skips == {"empty_line": 2, "not_llm_traffic": 2, "no_output_captured": 1}
    assert declined(p, None) != [] and 1 not in declined(p, None)
    # With a layout hour the line without a time is kept, stamped with the hour.
    hour = both(obj_of(p, hour=T0), opts)
    assert hour.table.num_rows + hour.file_duplicates == res.table.num_rows + res.file_duplicates + 2


def test_declined_lines_interleave_in_line_order_across_chunks(tmp_path):
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
    res = both(obj_of(write(tmp_path / "mixed.jsonl", lines)), FileOptions(chunk_lines=7))
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
    off = both(obj_of(p), FileOptions(redact=False))
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
    p = tmp_path / "f.jsonl"
    p.write_bytes(b"\n".join(lines) + (b"\n" if lines else b""))
    res = both(obj_of(p), FileOptions(max_line_bytes=50))
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


# -- blocks of whole lines: the reader and the native decoder split lines as iter_lines does ----------


def _lines_of(content: bytes) -> list[bytes]:
    """The lines of a file, by definition: split at \\n, no empty line after a final newline."""
    lines = content.split(b"\n")
    if lines[-1] == b"":
        lines.pop()
    return lines


def _edge_file() -> bytes:
    """Small lines of every kind, CRLF, BOM and empty lines among them, and no final newline."""
    good = [make_capture_record(CHAT | {"messages": [{"role": "user", "content": f"q{i}"}]}, OK, event_id=f"e{i}",
                                inference_time=T0 + timedelta(seconds=i)).encode() for i in range(6)]
    lines = [
        good[0],
        b"",
        b"\xef\xbb\xbf" + good[1],  # BOM
        good[2] + b"\r",  # CRLF
        b"\r",
        good[3][:40],  # truncated JSON
        make_capture_record("1,2", "0.5", request_content_type="text/csv", request_encoding="CSV").encode(),
        good[0],  # a replay
        b"   ",
        good[4].replace(b"q4", b"q\xff4"),  # invalid UTF-8
        make_capture_record(CHAT, OK, inference_time="2025-02-30T00:00:00Z").encode(),  # no time, no hour
        good[5],
    ]
    return b"\n".join(lines)  # no final newline


@pytest.mark.parametrize("content", [b"", b"\n", b"a", b"a\n", b"\n\n", b"a\r\n\nb\n", b"\xef\xbb\xbfa\nb",
                                     b"x" * 3000 + b"\ny", _edge_file()])
def test_blocks_hold_whole_lines(tmp_path, content):
    p = tmp_path / "f.jsonl"
    p.write_bytes(content)
    for size in (1, 2, 7, 64, 1000, 1 << 20):
        blocks = [bytes(b) for b in iter_blocks(str(p), block_size=size)]
        assert b"".join(blocks) == content
        assert all(b.endswith(b"\n") for b in blocks[:-1]) and all(blocks)
        assert [x for b in blocks for x in _lines_of(b)] == _lines_of(content)
        assert list(iter_lines(str(p), chunk_size=size)) == _lines_of(content)


def _decode_blocks(blocks: list[bytes], max_lines: int, hour=None):
    """Every chunk decode_block makes of ``blocks``: rows, declined line numbers and lines, skips, lines read."""
    batches, declined, declined_lines, skips, line_no = [], [], [], Counter(), 0
    for block in blocks:
        pos = 0
        while pos < len(block):
            got = batchpath.decode_block(memoryview(block), pos, line_no + 1, max_lines, 8 << 20, hour)
            assert 0 < got.lines <= max_lines and got.end > pos
            batches.append(got.batch)
            declined += [line_no + 1 + i for i in got.declined]
            declined_lines += got.declined_lines
            skips.update(got.skips)
            line_no, pos = line_no + got.lines, got.end
    return pa.Table.from_batches(batches, schema=batchpath.ROW_SCHEMA), declined, declined_lines, skips, line_no


@pytest.mark.parametrize("native_on", [True, False])
def test_decode_block_cut_at_every_position_equals_decode_chunk(native_on):
    with nullcontext() if native_on else backend.python_fallback():
        _decode_block_cut_at_every_position(native_on)


def _decode_block_cut_at_every_position(native_on: bool) -> None:
    assert (backend.native() is not None) == native_on
    content = _edge_file()
    lines = _lines_of(content)
    ref = batchpath.decode_chunk(lines, 1, 8 << 20, None)
    want = (pa.Table.from_batches([ref.batch]), [i + 1 for i in ref.declined], [lines[i] for i in ref.declined],
            ref.skips, len(lines))
    assert want[1] and want[3] and want[0].num_rows
    for cut in range(0, len(content) + 1, 1 if native_on else 7):  # the msgspec loop is slower
        at = content.rfind(b"\n", 0, cut) + 1  # blocks end at a newline, as iter_blocks cuts them
        for max_lines in ((1, 3, 8192) if cut % 50 == 0 else (8192,)):
            got = _decode_blocks([content[:at], content[at:]], max_lines)
            assert got[0].equals(want[0]) and got[1:] == want[1:], (cut, max_lines)


def _reference(obj: SourceObject) -> ingest_mod.FileResult:
    """process_file(batch=False), but over the lines as defined by _lines_of: no block reader involved."""
    res = ingest_mod.FileResult(obj=obj)
    per_line = ingest_mod._PerLine()
    lines = _lines_of(Path(obj.uri).read_bytes())
    for i, line in enumerate(lines):
        per_line.decide(line, i + 1, obj, OPTS.max_line_bytes, res)
    res.read = len(lines)
    rows = pa.Table.from_batches([per_line.batch()], schema=batchpath.ROW_SCHEMA)
    res.table, res.row_redactions, res.file_duplicates = ingest_mod._finish(rows, obj, True)
    return res


def _same(a: ingest_mod.FileResult, b: ingest_mod.FileResult) -> None:
    for attr in ("read", "missing", "error", "file_duplicates", "skips", "quarantine", "row_redactions"):
        assert getattr(a, attr) == getattr(b, attr), attr
    assert a.table.equals(b.table)


def test_process_file_over_blocks_of_any_size_equals_the_line_by_line_path(tmp_path):
    pool = TextPool(random.Random(3))
    synth = [make_capture_record(event_id=f"s{i}", inference_time=T0, **exchange(FORMATS[i % len(FORMATS)], pool, i))
             for i in range(40)]
    p = tmp_path / "edge.jsonl"
    p.write_bytes(_edge_file() + b"\n" + "\n".join(synth).encode() + b"\r\n\n")
    obj = obj_of(p)
    want = _reference(obj)
    assert want.quarantine and want.skips and want.file_duplicates and want.table.num_rows > 30
    for size in (1, 100, 1000, 5000, 1 << 22):
        for chunk_lines in (1, 4, 8192):
            opts = FileOptions(block_bytes=size, chunk_lines=chunk_lines)
            _same(process_file(obj, opts), want)
            _same(process_file(obj, opts, batch=False), want)


def test_a_20_mb_line_spans_blocks(tmp_path):
    big = make_capture_record({"messages": [{"role": "user", "content": "x" * (20 << 20)}]}, OK,
                              inference_time=T0).encode()
    small = [make_capture_record(CHAT, OK, event_id=f"e{i}", inference_time=T0).encode() for i in range(2)]
    p = tmp_path / "big.jsonl"
    p.write_bytes(small[0] + b"\n" + big + b"\n" + small[1])
    res = process_file(obj_of(p), OPTS)  # max_line 8 MB: quarantined, by its line number
    assert res.read == 3 and [(q["line_no"], q["reason"]) for q in res.quarantine] == [(2, "line_too_large")]
    assert res.table["line_no"].to_pylist() == [1]  # the two small lines are replays of one exchange
    res = process_file(obj_of(p), FileOptions(max_line_bytes=32 << 20))
    assert res.read == 3 and not res.quarantine and res.table["line_no"].to_pylist() == [1, 2]
    assert len(res.table["conversations"][1].as_py()[0]["value"]) == 20 << 20


class _Body:
    """botocore's StreamingBody over bytes, reading short like a socket, optionally failing part-way."""

    def __init__(self, data: bytes, piece: int, fail_at: int | None = None) -> None:
        from botocore.response import StreamingBody

        outer = self

        class Raw(io.BytesIO):
            def read(self, amt=None):
                if fail_at is not None and self.tell() >= fail_at:
                    raise ConnectionResetError("peer went away")
                return super().read(piece if amt is None else min(amt, piece))

        self.stream = StreamingBody(Raw(data), len(data))
        self.closed = False
        outer.read = self.stream.read

    def close(self) -> None:
        self.closed = True


class _FakeS3:
    def __init__(self, objects: dict[str, bytes], piece: int = 1000, fail_at: int | None = None) -> None:
        self.objects, self.piece, self.fail_at, self.bodies = objects, piece, fail_at, []

    def get_object(self, Bucket, Key):
        from botocore.exceptions import ClientError

        if Key not in self.objects:
            raise ClientError({"Error": {"Code": "NoSuchKey", "Message": "gone"}}, "GetObject")
        self.bodies.append(_Body(self.objects[Key], self.piece, self.fail_at))
        return {"Body": self.bodies[-1]}


def test_s3_streams_split_and_decode_as_local_files(tmp_path):
    content = _edge_file() + b"\n" + b"y" * 70_000 + b"\n" + _edge_file()
    p = tmp_path / "f.jsonl"
    p.write_bytes(content)
    local = process_file(obj_of(p), OPTS)
    for piece in (1, 999, 1 << 20):
        fake = _FakeS3({"cap/f.jsonl": content}, piece=piece)
        opts = FileOptions(client=fake)
        obj = SourceObject("s3://b/cap/f.jsonl", len(content), "e", "ep", "AllTraffic", None)
        for size in (64, 5000, 1 << 22):
            assert [bytes(b) for b in iter_blocks(obj.uri, client=fake, block_size=size)] == \
                [bytes(b) for b in iter_blocks(str(p), block_size=size)]
        s3 = process_file(obj, opts)
        assert all(b.closed for b in fake.bodies)
        s3.table = s3.table.set_column(s3.table.schema.get_field_index("source_uri"), "source_uri",
                                       local.table["source_uri"])
        for q in s3.quarantine:
            q["source_uri"] = str(p)
        _same(s3, local)
    # Gone, and failing part-way: the file is left for the next run, nothing of it kept.
    gone = process_file(SourceObject("s3://b/cap/gone.jsonl", 1, "e", "ep", "AllTraffic", None), opts)
    assert gone.missing and gone.error is None and gone.table is None
    failing = FileOptions(client=_FakeS3({"cap/f.jsonl": content}, fail_at=len(content) // 2))
    broken = process_file(SourceObject("s3://b/cap/f.jsonl", len(content), "e", "ep", "AllTraffic", None), failing)
    assert broken.missing and "ConnectionResetError" in broken.error and broken.table is None
