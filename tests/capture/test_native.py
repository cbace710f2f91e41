"""The native decoder and hash (capture/_native) agree with the msgspec batch path, the reference and hashlib.

Every line both fast paths decide must come out alike; the C decoder may decline more (they
only go the slower per-line way). Whole exchanges (reasoning, tool calls, token ids) the msgspec
path declines and the C decoder decides: those must come out as the reference decoder makes
them (tests.capture_support.check). A seeded corpus of mutated lines probes the strictness rules.
"""

from __future__ import annotations

import base64
import hashlib
import json
import random
from datetime import timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from capture import backend, batchpath, dedupe, native
from capture import ingest as ingest_mod
from capture.ingest import FileOptions, process_file
from capture.records import make_capture_record
from capture.sources import SourceObject, iter_lines
from capture.synth import EXCHANGE_FORMATS, FORMATS, PLAIN_MIX, TextPool, exchange, write_layout
from tests.capture_support import (
    CONTENT_TYPES,
    ENCODINGS,
    EXCHANGE_VARIANTS,
    MAX_LINE,
    NUMBERS,
    RAW_ESCAPES,
    ROLES,
    T0,
    TEXTS,
    VARIANTS,
    check,
    msgspec_chunk,
    mutated_line,
    native_chunk,
    reference_row,
    same_file_result,
)
from tests.paths import DATACAPTURE

# -- the module itself -----------------------------------------------------------------


def test_native_module_is_built_and_used(monkeypatch):
    """CI must not fall back silently: the module loads, and decode_chunk goes through it."""
    mod = native.load()
    assert backend.native() is mod and Path(mod.__file__).exists()

    def boom(*a, **k):
        raise AssertionError("msgspec path used")

    monkeypatch.setattr(batchpath, "decode_chunk_msgspec", boom)
    line = make_capture_record(**exchange("openai_chat", TextPool(random.Random(0)), 0)).encode()
    assert batchpath.decode_chunk([line], 1, MAX_LINE, None).batch.num_rows == 1


def test_missing_compiler_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "_module", None)
    monkeypatch.setattr(native, "_build_roots", lambda: [tmp_path / "build"])
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    monkeypatch.delenv("CC", raising=False)
    with pytest.raises(native.NativeUnavailable, match="no C compiler"):
        native.load()
    # Production code falls back (after one warning), and keeps the reason.
    chooser = backend.Backend(load=native.load)
    assert chooser.native() is None and "no C compiler" in chooser.failure


def test_a_build_in_the_checkout_removes_the_builds_of_older_sources(monkeypatch, tmp_path):
    """The checkout's build directory keeps one build; the shared one under the home keeps all."""
    src = tmp_path / "_native"
    src.mkdir()
    (src / "m.c").write_text("int answer(void) { return 42; }\n")
    monkeypatch.setattr(native, "SOURCE_DIR", src)
    home = tmp_path / "home" / "native"
    monkeypatch.setattr(native, "_build_roots", lambda: [src / "build", home])
    built = []
    monkeypatch.setattr(native, "_compile", lambda sources, out: (built.append(out), out.write_bytes(b"so")))
    for root in (src / "build", home):
        (root / "0123456789abcdef").mkdir(parents=True)
        (root / "keep-me").mkdir()
    target = native._build(native._sources(), "fedcba9876543210")
    assert built == [target] and target.parent == src / "build" / "fedcba9876543210"
    assert sorted(p.name for p in (src / "build").iterdir()) == ["fedcba9876543210", "keep-me"]
    monkeypatch.setattr(native, "_build_roots", lambda: [home])
    native._build(native._sources(), "fedcba9876543210")
    assert sorted(p.name for p in home.iterdir()) == ["0123456789abcdef", "fedcba9876543210", "keep-me"]


@pytest.mark.parametrize("size", [0, 1, 3, 111, 127, 128, 129, 255, 256, 257, 1000, 70_000])
def test_blake2b_matches_hashlib(size):
    data = random.Random(size).randbytes(size)
    assert native.load().blake2b16_many([data]) == hashlib.blake2b(data, digest_size=16).digest()


def test_blake2b16_many_matches_hashlib():
    """The vector path: lanes that finish at different blocks take the next message."""
    rng = random.Random(5)
    sizes = [0, 1, 127, 128, 129, 255, 256, 257, 1000, 70_000]
    for count in (0, 1, 7, 8, 9, 17, 64):
        msgs = [rng.randbytes(rng.choice(sizes + [rng.randrange(3000)])) for _ in range(count)]
        want = b"".join(hashlib.blake2b(m, digest_size=16).digest() for m in msgs)
        assert native.load().blake2b16_many(msgs) == want


def test_isspace_matches_python_for_every_code_point():
    isspace = native.load().isspace
    assert [c for c in range(0x110000) if isspace(c)] == [c for c in range(0x110000) if chr(c).isspace()]


def test_native_content_hashes_equal_hashlib():
    rng = random.Random(9)
    alphabet = ["a", "Z", " ", ":", "0", "é", "ß", "😀", "\U0010FFFF", "\n", "中", "\u2028", "\x00"]
    rows = [[(rng.choice(["system", "human", "gpt"]), "".join(rng.choices(alphabet, k=rng.choice([0, 1, 5, 60, 400]))))
             for _ in range(rng.randrange(0, 6))] for _ in range(2000)]
    rows.append([("human", "x" * 100_000), ("gpt", "")])
    offsets, t_from, t_value = [0], ["pad"], ["pad"]
    for turns in rows:
        for frm, value in turns:
            t_from.append(frm)
            t_value.append(value)
        offsets.append(len(t_from) - 1)
    # Sliced arrays (non-zero array offsets), as the turns of a ListArray slice are.
    f, v = pa.array(t_from).slice(1), pa.array(t_value).slice(1)
    got = ingest_mod.content_hashes(pa.array(offsets, pa.int32()), f, v)
    assert got.to_pylist() == [ingest_mod.content_hash(turns) for turns in rows]
    # ... which is the native hash's (called here directly, so that it is sure to be the one tested)
    direct = native.load().content_hashes(np.asarray(offsets, np.int32), *native.utf8_args(f)[:4],
                                          *native.utf8_args(v)[:4])
    assert direct == "".join(got.to_pylist()).encode()
    with backend.python_fallback():  # hashlib does it
        assert ingest_mod.content_hashes(pa.array(offsets, pa.int32()), f, v).to_pylist() == got.to_pylist()
    assert ingest_mod.content_hashes(pa.array([0, 2], pa.int32()), pa.array(["human", "gpt"]),
                                     pa.array(["hi", "yo"])).to_pylist() == ["f3c4e63129a60f7ac077c2c8b0bbb3b2"]


def test_content_hashes_reject_inconsistent_buffers():
    nat = native.load()
    offs = pa.array([0, 1], pa.int32())
    s = pa.array(["ab"])
    with pytest.raises(ValueError):  # a row reaching past the turns
        nat.content_hashes(pa.array([0, 2], pa.int32()).buffers()[1], 0, 1, s.buffers()[1], s.buffers()[2],
                           0, 1, s.buffers()[1], s.buffers()[2])
    with pytest.raises(ValueError):  # offsets past the data
        nat.content_hashes(offs.buffers()[1], 0, 1, s.buffers()[1], b"a", 0, 1, s.buffers()[1], s.buffers()[2])


def test_native_range_hashes_reject_bad_ranges():
    nat = native.load()
    s = pa.array(["human", "gpt"])
    args = (0, 2, s.buffers()[1], s.buffers()[2], 0, 2, s.buffers()[1], s.buffers()[2])
    got = nat.range_hashes(np.array([0, 0, 1], np.int32), np.array([1, 2, 2], np.int32), *args).decode()
    turns = [("human", "human"), ("gpt", "gpt")]
    assert [got[i:i + 32] for i in (0, 32, 64)] == [ingest_mod.content_hash(t) for t in (turns[:1], turns, turns[1:])]
    for starts, ends in (([0], [3]), ([2], [1]), ([-1], [1]), ([0, 0], [1])):
        with pytest.raises(ValueError):
            nat.range_hashes(np.array(starts, np.int32), np.array(ends, np.int32), *args)


# -- agreement with the msgspec batch path -----------------------------------------------


def test_synthetic_traffic_of_every_format_is_identical(tmp_path):
    for p in write_layout(tmp_path / "cap", 1500, per_file=500, seed=11, start=T0, mix=PLAIN_MIX):
        lines = list(iter_lines(str(p)))
        assert check(lines, exact=True) == (len(lines), len(lines))
        check(lines, hour=T0, exact=True)
    pool = TextPool(random.Random(3))
    for fmt in FORMATS:
        for enc in ("JSON", "BASE64"):
            kw = exchange(fmt, pool, 1) | {"response_encoding": enc, "request_encoding": enc}
            lines = [make_capture_record(inference_time=T0, **kw).encode()]
            assert check(lines, exact=True) == (1, 1), fmt


def test_real_fixtures_are_identical():
    paths = sorted(DATACAPTURE.glob("*.jsonl"))
    assert len(paths) >= 4
    for p in paths:
        check(list(iter_lines(str(p))), exact=True)
        check(list(iter_lines(str(p))), hour=T0, exact=True)


@pytest.mark.parametrize("encoding", ["JSON", "BASE64"])
def test_fast_path_edge_variants(encoding):
    lines = []
    for req, resp in VARIANTS:
        ct = "text/event-stream" if isinstance(resp, str) else "application/json"
        lines.append(make_capture_record(req, resp, response_content_type=ct, response_encoding=encoding,
                                         inference_time=T0).encode())
    check(lines)


# -- whole exchanges: the C decoder against the reference ----------------------------------------


def test_whole_exchanges_are_decided_natively():
    """The reasoning and tool-call traffic vLLM writes is the C decoder's, not the reference's
    (the ingest benchmark's mix holds 40% of it): none declined, each equal to the reference's row."""
    pool = TextPool(random.Random(8))
    lines = [make_capture_record(inference_time=T0, **exchange(fmt, pool, i)).encode()
             for i in range(60) for fmt in EXCHANGE_FORMATS]
    got = native_chunk(lines)
    assert got.declined == [] and got.batch.num_rows == len(lines)
    rows = got.batch.to_pylist()
    assert all(r["messages"] is not None for r in rows)
    assert any(r["prompt_token_ids"] for r in rows) and any(r["output_token_ids"] for r in rows)
    assert any(r["tools"] for r in rows) and any(r["chat_template_kwargs"] for r in rows)
    for row, line in zip(rows, lines):
        want = reference_row(line)
        assert {k: row[k] for k in want} == want
    check(lines)


@pytest.mark.parametrize("encoding", ["JSON", "BASE64"])
def test_exchange_edge_variants(encoding, tmp_path):
    """Whole exchanges at the edges of the reference's rules: each line the C decoder decides is the
    reference's row, byte for byte in the JSON columns; what it cannot reproduce exactly it declines."""
    lines = []
    for k, (req, resp) in enumerate(EXCHANGE_VARIANTS):
        ct = "text/event-stream" if isinstance(resp, str) else "application/json"
        lines.append(make_capture_record(req, resp, response_content_type=ct, response_encoding=encoding,
                                         request_encoding=encoding, inference_time=T0 + timedelta(seconds=k)).encode())
    decided, _ = check(lines)
    nat = native_chunk(lines)
    accepted = [reference_row(line) is not None for line in lines]
    # Most of the variants the reference keeps are decided natively (floats, repeated keys, lists
    # of content parts, \u0000 and deep nesting are declined).
    assert decided >= 0.7 * sum(accepted), (decided, sum(accepted))
    assert {i for i in range(len(lines)) if not accepted[i]} <= set(nat.declined)
    p = tmp_path / "variants.jsonl"
    p.write_bytes(b"".join(line + b"\n" for line in lines))
    same_file_result(SourceObject(str(p), p.stat().st_size, "e", "ep", "AllTraffic", None))


def test_canonical_json_is_json_dumps():
    """The C writer's text of a value is json.dumps(json.loads(text), ensure_ascii=False, separators=(",", ":"))
    (and with json.dumps' default separators for a tool call's turn)."""
    rng = random.Random(12)
    # No NUL (\\u0000 is declined: the reference quarantines it) nor DEL (its \\u007f escape is one
    # of printable ASCII's, which the key dispatch declines); keys plain ASCII (a key written with
    # an escape is declined by the scanner).
    alphabet = ["a", "\"", "\\", "\n", "\r", "\t", "\b", "\f", "\x01", "\x1f", "é", "😀", "\u2028",
                "/", "<", " ", "\ud7ff", "\ue000", "\uffff"]

    def value(depth=0):
        k = rng.randrange(6 if depth < 4 else 3)
        if k == 0:
            return "".join(rng.choices(alphabet, k=rng.randrange(6)))
        if k == 1:
            return rng.choice([0, -1, 7, 2 ** 31, -(10 ** 25), True, False, None])
        if k == 2:
            return "x"
        if k == 3:
            return [value(depth + 1) for _ in range(rng.randrange(4))]
        return {"".join(rng.choices("ab_-Z ", k=rng.randrange(1, 4))) + str(i): value(depth + 1)
                for i in range(rng.randrange(4))}

    lines, wants = [], []
    for i in range(300):
        v = value()
        args = json.dumps(v, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 1]))
        call = {"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": args}, "x": v}
        req = {"messages": [{"role": "user", "content": "q", "v": v}], "tool_choice": v}
        text = json.dumps(req, ensure_ascii=rng.random() < 0.5)
        lines.append(make_capture_record(text, {"choices": [{"message": {"content": None, "tool_calls": [call]}}]},
                                         inference_time=T0).encode())
        wants.append((v, call))
    got = native_chunk(lines)
    assert got.declined == []
    for row, (v, call) in zip(got.batch.to_pylist(), wants):
        assert row["tool_choice"] == (None if v is None else json.dumps(v, ensure_ascii=False, separators=(",", ":")))
        assert row["conversations"][-1]["value"] == json.dumps([call], ensure_ascii=False)
    check(lines)


# -- a seeded corpus of mutated lines (tests.capture_support.mutated_line) ------------------------


def test_every_value_of_the_alphabets_in_every_field():
    """Each number, role, text, encoding and content type in each place it matters (the corpus is random)."""
    chat = '{"messages": [{"role": "user", "content": "q"}], "temperature": 0.5, "max_tokens": 9}'
    ok = {"choices": [{"message": {"content": "a"}}]}
    lines = []

    def add(req, resp, **kw):
        lines.append(make_capture_record(req, resp, inference_time=T0, **kw).encode("utf-8", "surrogatepass"))

    for num in NUMBERS:
        for key in ("temperature", "top_p", "max_tokens", "max_completion_tokens", "max_new_tokens"):
            add('{"messages": [{"role": "user", "content": "q"}], "%s": %s}' % (key, num), ok)
            add('{"inputs": "q", "parameters": {"%s": %s, "max_tokens": 3}}' % (key, num), [{"generated_text": "a"}])
            add('{"prompt": "q", "max_tokens": 5, "%s": %s}' % (key, num), {"choices": [{"text": "a"}]})
        add(chat, 'data: {"choices":[{"index":%s,"delta":{"content":"a"}}]}\n\ndata: {"choices":[{"delta":{"content":"b"}}]}'
                  '\n\ndata: [DONE]\n\n' % num, response_content_type="text/event-stream")
    for role in ROLES:
        add('{"messages": [{"role": "%s", "content": "q"}, {"role": "user", "content": "q2"}]}' % role, ok)
        add('{"inputs": [[{"role": "%s", "content": "q"}]]}' % role, [{"generation": {"content": "a"}}])
    for text in TEXTS + [e + "x" for e in RAW_ESCAPES]:
        body = json.dumps(text)[1:-1] if "\\" not in text else text
        add('{"messages": [{"role": "user", "content": "%s"}]}' % body, '{"choices": [{"message": {"content": "%s"}}]}' % body)
        add('{"inputs": "%s"}' % body, '[{"generated_text": "%sa"}]' % body)
        add('{"inputs": "%s"}' % body, '{"generated_text": "%s"}' % body)
        add('{"prompt": "%s", "model": "%s"}' % (body, body), '{"model": "m", "choices": [{"text": "%s"}]}' % body)
        add(chat, "data: " + json.dumps({"choices": [{"delta": {"content": text}}], "model": text}) + "\n\ndata: [DONE]\n\n",
            response_content_type=None)
    for enc in ENCODINGS:
        for ct in CONTENT_TYPES:
            for req_enc in (enc, "JSON"):
                line = json.loads(make_capture_record(chat, ok, inference_time=T0, request_content_type=ct,
                                                      response_content_type=ct))
                for side, e in (("endpointInput", req_enc), ("endpointOutput", enc)):
                    if e is not None and e.upper() == "BASE64":
                        d = line["captureData"][side]
                        d["data"] = base64.b64encode(d["data"].encode()).decode()
                    line["captureData"][side]["encoding"] = e
                lines.append(json.dumps(line, ensure_ascii=False).encode())
    check(lines)
    check(lines, hour=T0)


# Sampling values no sampler takes (issue #23: NaN and 1e999 were stored, a 400-digit number
# was quarantined as internal_error), and edge values that are fine.
BAD_SAMPLING = [("temperature", v) for v in ("NaN", "Infinity", "-Infinity", "1e999", "-0.5", "-1e-300", "1" + "0" * 400)]
BAD_SAMPLING += [("top_p", v) for v in ("NaN", "1e400", "1.5", "1.0000001", "-0.1", "9" * 400)]
GOOD_SAMPLING = [("temperature", v) for v in ("0", "-0.0", "0.7", "2", "1e30")]
GOOD_SAMPLING += [("top_p", v) for v in ("0", "1", "1.0", "0.95", "1e-300")]


def _sampling_lines(key: str, num: str) -> list[bytes]:
    """The value in each place a sampling parameter is read: chat, completion, TGI and JumpStart parameters."""
    q = f"q {key}={num[:20]}"  # each line its own conversation (else they are replays of one)
    ok = {"choices": [{"message": {"content": "a"}}]}
    reqs = [('{"messages": [{"role": "user", "content": "%s"}], "%s": %s}' % (q, key, num), ok),
            ('{"prompt": "%s", "%s": %s}' % (q, key, num), {"choices": [{"text": "a"}]}),
            ('{"inputs": "%s", "parameters": {"%s": %s}}' % (q, key, num), [{"generated_text": "a"}]),
            ('{"inputs": [[{"role": "user", "content": "%s"}]], "parameters": {"%s": %s}}' % (q, key, num),
             [{"generation": {"content": "a"}}])]
    return [make_capture_record(req.replace(q, f"{q} #{k}"), resp, inference_time=T0).encode()
            for k, (req, resp) in enumerate(reqs)]


def test_sampling_values_out_of_range_are_quarantined_on_every_path(tmp_path):
    bad = [line for key, num in BAD_SAMPLING for line in _sampling_lines(key, num)]
    good = [line for key, num in GOOD_SAMPLING for line in _sampling_lines(key, num)]
    lines = bad + good
    check(lines, exact=True)  # the native and msgspec paths decline the same lines
    got = msgspec_chunk(lines)  # ... the bad ones, and only those
    assert got.declined == list(range(len(bad))) and got.batch.num_rows == len(good)
    p = tmp_path / "sampling.jsonl"
    p.write_bytes(b"".join(line + b"\n" for line in lines))
    obj = SourceObject(str(p), p.stat().st_size, "e", "ep", "AllTraffic", None)
    same_file_result(obj)  # and the per-line reference decides them alike
    res = process_file(obj, FileOptions())
    reasons = {q["line_no"]: q["reason"] for q in res.quarantine}
    assert reasons == {i: "invalid_sampling_param" for i in range(1, len(bad) + 1)}, res.quarantine[:3]
    assert res.table.num_rows == len(good)
    stored = res.table.column("temperature").to_pylist() + res.table.column("top_p").to_pylist()
    assert all(v is None or (v == v and 0 <= v < float("inf")) for v in stored)


def test_mutated_corpus_agrees_with_the_msgspec_path():
    rng = random.Random(20240501)
    pool = TextPool(random.Random(1))
    lines = [mutated_line(rng, pool, i) for i in range(4000)]
    decided, reference_decided = 0, 0
    for start in range(0, len(lines), 500):
        chunk = lines[start:start + 500]
        a, b = check(chunk)
        decided += a
        reference_decided += b
        check(chunk, hour=T0)
    # The corpus must exercise acceptance, not only declines (of which the whole exchanges, 40% of
    # the synthetic mix, are many).
    assert decided > 0.2 * len(lines) and decided > 0.8 * reference_decided, (decided, reference_decided)


def test_a_missing_separator_anywhere_is_declined():
    """Each ',' between members or elements, and each ':', removed in turn: never decided natively."""
    good = make_capture_record(**exchange("openai_chat", TextPool(random.Random(4)), 0)).encode()
    req = json.loads(json.loads(good)["captureData"]["endpointInput"]["data"])
    lines = []
    # Separators of the outer document (keys and strings are plain, so each ", " and ": " is one).
    for sep in (b", ", b": "):
        at = -1
        while (at := good.find(sep, at + 1)) >= 0:
            lines.append(good[:at] + b" " + good[at + 1:])
    # ... and of the payload inside it.
    body = json.dumps(req)
    for sep in (", ", ": "):
        at = -1
        while (at := body.find(sep, at + 1)) >= 0:
            bad = body[:at] + " " + body[at + 1:]
            lines.append(make_capture_record(bad, {"choices": [{"message": {"content": "a"}}]},
                                             inference_time=T0).encode())
    assert len(lines) > 20
    nat = native_chunk(lines)
    assert nat.batch.num_rows == 0 and not nat.skips, nat.batch.column("line_no").to_pylist()
    check(lines)


def test_hostile_lines_are_declined_safely():
    good = make_capture_record(**exchange("openai_chat_stream", TextPool(random.Random(2)), 0)).encode()
    b64 = make_capture_record(**exchange("jumpstart_chat", TextPool(random.Random(2)), 1)).encode()
    lines = [good[:i] for i in range(0, len(good), 3)] + [b64[:i] for i in range(0, len(b64), 7)]
    lines += [
        b"[" * 10_000 + b"]" * 10_000,
        b'{"captureData": {"endpointInput": {"data": "' + b"[" * 10_000 + b'"}}}',
        b'{"captureData": {"endpointInput": ' + b'{"x": ' * 5_000 + b"1" + b"}" * 5_000 + b"}}",
        b'{"captureData": {"endpointInput": {"data": "\\ud800"}}}',
        b'{"captureData": {"endpointInput": {"data": "\\udc00\\ud800"}}}',
        b'{"captureData": {"endpointInput": {"data": "\\u12"}}}',
        b'{"captureData": {"endpointInput": {"data": "\\',
        b"\x00" * 100,
        b"",
        b"{",
        b'{"captureData"',
        good.replace(b'"data"', b'"d\\u0061ta"', 1),
    ]
    check(lines)
    big = make_capture_record({"messages": [{"role": "user", "content": "x" * (20 << 20)}]},
                              {"choices": [{"message": {"content": "y"}}]}, inference_time=T0).encode()
    assert check([big], max_line=32 << 20) == (1, 1)
    assert native_chunk([big], max_line=len(big) - 1).declined == [0]


# -- end to end ----------------------------------------------------------------------------


def test_process_file_identical_with_the_native_path_on_and_off(tmp_path):
    for p in write_layout(tmp_path / "cap", 600, per_file=300, seed=5, start=T0):
        same_file_result(SourceObject(str(p), p.stat().st_size, "e", "ep", "AllTraffic", None))
    for p in sorted(DATACAPTURE.glob("*.jsonl")):
        same_file_result(SourceObject(str(p), p.stat().st_size, "e", "ep", "AllTraffic", T0))
    rng = random.Random(77)
    pool = TextPool(random.Random(7))
    p = tmp_path / "mutated.jsonl"
    p.write_bytes(b"".join(mutated_line(rng, pool, i).replace(b"\n", b" ") + b"\n" for i in range(1500)))
    for hour in (None, T0):
        same_file_result(SourceObject(str(p), p.stat().st_size, "e", "ep", "AllTraffic", hour))


def test_native_parse_times_equal_the_arrow_path():
    rng = random.Random(4)
    values = []
    for i in range(30_000):
        year = rng.choice([999, 1000, 1600, 1900, 1970, 2000, 2023, 2024, 2100, 9999, rng.randint(1000, 9999)])
        v = (f"{year:04d}-{rng.randint(0, 13):02d}-{rng.randint(0, 32):02d}T{rng.randint(0, 24):02d}:"
             f"{rng.randint(0, 60):02d}:{rng.randint(0, 60):02d}Z")
        values.append(rng.choice([v, v, v, v[:-1] + "+01:00", v[:-1], " " + v, v.replace("T", " "), None, "", "{%s}"]))
    arr = pa.array(values, pa.string())
    for part in (arr, arr.slice(777, 5000)):
        got = batchpath.parse_times(part)
        with backend.python_fallback():
            want = batchpath.parse_times(part)
        assert got.equals(want)
    assert got.null_count and got.null_count < len(got)


def test_first_in_file_equals_first_seen():
    rng = random.Random(6)
    for n in (0, 1, 2, 50, 3000):
        hashes = [f"{rng.randint(0, n // 3 + 1):032x}" for _ in range(n)]
        arr = pa.array(hashes, pa.string())
        assert ingest_mod._first_in(arr).tolist() == dedupe.first_seen(hashes, set())
        if n > 4:
            assert ingest_mod._first_in(arr.slice(3)).tolist() == dedupe.first_seen(hashes[3:], set())


def test_no_pandas_import_on_the_native_path(tmp_path):
    """pa.array, pa.scalar and to_numpy import pandas, ~0.14 s of CPU in every worker process."""
    import subprocess
    import sys

    # The plain mix: the reference's rows (reasoning and tool calls among them) are built with pa.array.
    write_layout(tmp_path / "cap", 300, per_file=300, seed=5, start=T0, mix=PLAIN_MIX)
    # Files that yield no rows at all: all tabular (skipped), and empty.
    hour = tmp_path / "cap" / "ep" / "AllTraffic" / T0.strftime("%Y/%m/%d/%H")
    (hour / "tabular.jsonl").write_bytes((DATACAPTURE / "tabular-csv-sdk-fixture.jsonl").read_bytes())
    (hour / "empty.jsonl").write_bytes(b"")
    code = ("import sys\nfrom capture import ingest as m\nfrom capture.sources import list_objects\n"
            f"res = [m.process_file(o, m.FileOptions()) for o in list_objects({str(tmp_path / 'cap')!r}, endpoint='')]\n"
            "empty = [r for r in res if r.table.num_rows == 0]\n"
            "assert len(empty) == 2 and sum(r.read for r in empty) > 0, [(r.obj.uri, r.read) for r in res]\n"
            "assert 'pandas' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_no_pandas_import_in_the_ingest_parent(tmp_path):
    """The parent runs alone while it writes and commits: pandas would cost it ~0.4 s of CPU a run.
    Several days, replays across files, quarantine and skips: every commit path runs."""
    import subprocess
    import sys

    write_layout(tmp_path / "cap", 400, per_file=50, seed=5, start=T0 - timedelta(hours=30), mix=PLAIN_MIX)
    first = sorted((tmp_path / "cap").rglob("*.jsonl"))[0]
    with open(first, "a") as f:
        f.write('{"captureData": truncated\n')
    code = ("import sys\nfrom settings.config import load_config\nfrom capture.ingest import ingest\n"
            f"cfg = load_config(overrides={{'state_dir': {str(tmp_path / 'state')!r}}})\n"
            f"r = ingest(cfg, source={str(tmp_path / 'cap')!r}, endpoint='', workers=1)\n"
            "assert r.quarantined == 1 and r.skipped and r.duplicates and r.normalized, r\n"
            "assert 'pandas' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
