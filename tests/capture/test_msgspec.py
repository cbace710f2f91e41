"""The msgspec batch path agrees with the reference decoder on every line it decides.

(These were the per-line fast path's tests; that path is gone, and the batch path, which
applied the same typed decoders, is held to what it was held to.)
"""

from __future__ import annotations

import json
import random

import pytest

from capture import batchpath
from capture.records import make_capture_record
from capture.synth import FORMATS, TextPool, exchange
from tests.capture_support import CANONICAL_ACCEPTED, VARIANTS, decided, msgspec_chunk, same
from tests.paths import DATACAPTURE

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
OK = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "yo"}}]}


def test_msgspec_path_handles_every_synthetic_llm_format_identically():
    pool = TextPool(random.Random(11))
    handled = {}
    for fmt in FORMATS:
        for i in range(40):
            line = make_capture_record(**exchange(fmt, pool, i)).encode()
            assert same(line)
            handled[fmt] = handled.get(fmt, 0) + (decided(line) == "row")
            if fmt == "tabular_csv":
                assert decided(line) == "skip"  # decided, as the reference decides it: no row
    assert handled["tabular_csv"] == 0
    assert all(handled[f] == 40 for f in FORMATS if f != "tabular_csv"), handled


def test_msgspec_path_on_real_fixtures():
    for f in DATACAPTURE.glob("*.jsonl"):
        for line in f.read_bytes().splitlines():
            assert same(line)
    llm = (DATACAPTURE / "llm-jumpstart-llama31.jsonl").read_bytes().splitlines()
    assert all(decided(x) == "row" for x in llm)


@pytest.mark.parametrize("req, resp", VARIANTS, ids=range(len(VARIANTS)))
def test_edge_variants_agree_or_decline(req, resp):
    ct = "text/event-stream" if isinstance(resp, str) else "application/json"
    for enc in ("JSON", "BASE64"):
        assert same(make_capture_record(req, resp, response_content_type=ct, response_encoding=enc).encode())


def test_canonical_streams_take_the_one_replace_parse():
    pool = TextPool(random.Random(3))
    body = exchange("openai_chat_stream", pool, 0)["response"]
    assert batchpath.canonical_sse(body) is not None
    for i in CANONICAL_ACCEPTED:
        req, resp = VARIANTS[i]
        assert batchpath.canonical_sse(resp) is not None
        assert decided(make_capture_record(req, resp, response_content_type="text/event-stream").encode()) == "row"


def test_bad_lines_are_declined():
    good = make_capture_record(CHAT, OK).encode()
    bad = [
        b"\xef\xbb\xbf" + good, good[:-5], good.replace(b"hi", b"h\xffi"), good.replace(b"hi", b"h\x00i"),
        b"[" * 10_000 + b"]" * 10_000, b"", b"  ", json.dumps({"captureData": {"endpointInput": {"data": 1}}}).encode(),
        good.replace(b'"encoding":"JSON"', b'"encoding":"GZIP"', 1),
        # invalid UTF-8 in a field no struct reads (msgspec skips it unchecked; the reference quarantines)
        good.replace(b'"mode":"INPUT"', b'"mode":"I\xf4\x90\x80\x80NPUT"', 1),
    ]
    for line in bad:
        assert decided(line) == "declined", line[:80]
    # Tabular CSV makes no row either: the batch path skips it, as the reference does.
    csv = make_capture_record("1,2", "0.5", request_content_type="text/csv", request_encoding="CSV").encode()
    assert decided(csv) == "skip" and same(csv)
    assert decided(good + b"\r") == "row"  # CRLF is just trailing whitespace
    assert msgspec_chunk([good, *bad, good + b"\r"]).declined == list(range(1, len(bad) + 1))
