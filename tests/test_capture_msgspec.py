"""The msgspec fast path agrees with the reference decoder wherever it accepts a line."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from capture import fastpath
from capture.records import Reject, decode_line, make_capture_record
from capture.formats import to_conversation
from capture.synth import FORMATS, TextPool, exchange

FIXTURES = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures" / "datacapture"



def reference(line: bytes):
    try:
        rec = decode_line(line)
        return rec, to_conversation(rec.request, rec.response)
    except Reject as rej:
        return rej


def same(line: bytes) -> bool:
    """True if the fast path declined or produced exactly the reference result."""
    fast = fastpath.fast_decode(line)
    if fast is None:
        return True
    ref = reference(line)
    assert not isinstance(ref, Reject), f"fast path accepted a line the reference rejects ({ref}): {line[:200]!r}"
    (frec, fconv), (rrec, rconv) = fast, ref
    assert (frec.event_id, frec.inference_id, frec.inference_time) == (rrec.event_id, rrec.inference_id, rrec.inference_time)
    assert fconv == rconv, (fconv, rconv)
    return True


def test_msgspec_available_so_the_fast_path_runs():
    assert fastpath.AVAILABLE


def test_fast_path_handles_every_synthetic_llm_format_identically():
    pool = TextPool(random.Random(11))
    handled = {}
    for fmt in FORMATS:
        for i in range(40):
            line = make_capture_record(**exchange(fmt, pool, i)).encode()
            assert same(line)
            handled[fmt] = handled.get(fmt, 0) + (fastpath.fast_decode(line) is not None)
    assert handled["tabular_csv"] == 0
    assert all(handled[f] == 40 for f in FORMATS if f != "tabular_csv"), handled


def test_fast_path_on_real_fixtures():
    for f in FIXTURES.glob("*.jsonl"):
        for line in f.read_bytes().splitlines():
            assert same(line)
    llm = (FIXTURES / "llm-jumpstart-llama31.jsonl").read_bytes().splitlines()
    assert all(fastpath.fast_decode(x) is not None for x in llm)


CHAT = {"messages": [{"role": "user", "content": "hi"}]}
D_A, D_B = '{"choices":[{"delta":{"content":"a"}}]}', '{"choices":[{"delta":{"content":"b"}}],"model":"m"}'
OK = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "yo"}}]}

VARIANTS = [
    (CHAT | {"temperature": True}, OK),  # bool is not a number
    (CHAT | {"temperature": "0.5"}, OK),
    (CHAT | {"max_tokens": 12.0}, OK),
    (CHAT | {"model": 5}, OK),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, OK),
    ({"messages": [{"role": "robot", "content": "x"}]}, OK),
    ({"messages": [{"role": "user", "content": "a\u0000b"}]}, OK),
    ({"messages": []}, OK),
    ({"messages": None, "prompt": "x"}, {"choices": [{"text": "y"}]}),
    ({"prompt": ["one"]}, {"choices": [{"text": "y"}]}),
    ({"prompt": "x", "nested": {"messages": 1}}, {"choices": [{"text": "y"}]}),
    ({"inputs": "x", "parameters": {"max_new_tokens": 3}}, {"generated_text": None}),
    ({"inputs": "x"}, [{"generated_text": "y"}, "junk"]),
    ({"inputs": "x"}, [{"generation": None}]),
    ({"inputs": "x"}, {"error": None}),
    ({"inputs": [[{"role": "user", "content": "q"}], [{"role": "user", "content": "q2"}]]}, [{"generation": "a"}]),
    ({"inputs": [{"role": "user", "content": "q"}]}, [{"generation": {"role": "assistant", "content": "a"}}]),
    ({"inputs": []}, [{"generation": "a"}]),
    (CHAT, {"choices": [{"message": {"content": None, "tool_calls": [{"id": "1"}]}}]}),
    (CHAT, {"choices": [{"message": {"content": "   "}}]}),
    (CHAT, {"object": "error", "message": "x"}),
    (CHAT, {"choices": []}),
    (CHAT, 'data: {"choices":[{"index":1,"delta":{"content":"no"}}]}\n\ndata: {"choices":[{"delta":{"content":"yes"}}]}\n\n'),
    (CHAT, 'data: {"choices":[{"delta":{"content":"a data: b"}}]}\n\ndata: [DONE]\n\n'),
    (CHAT, 'event: message\ndata: {"choices":[{"delta":{"content":"x"}}]}\n\n'),
    (CHAT, 'data: {"choices":[{"delta":"x","text":"t"}]}\n\n'),
    (CHAT, 'data: {"choices":[{"delta":null,"text":"t"}]}\n\n'),
    (CHAT, 'data: {"token":{"text":"x"}}\n\n'),
    (CHAT, "data: 1,2\n\n"),
    (CHAT, 'data: {"choices":[{"delta":{"content":"x"}}]},{"choices":[]}\n\n'),
    (CHAT, "data: [DONE]\n\n"),
    # Keys spelled with \u escapes, which a substring dispatch would miss.
    ('{"m\\u0065ssages": [{"role": "user", "content": "q"}], "prompt": "p"}', {"choices": [{"text": "y"}]}),
    ('{"inputs": "x", "m\\u0065ssages": 1}', [{"generated_text": "y"}]),
    # Line breaks inside a chunk: the reference splits lines on every str.splitlines() break.
    (CHAT, 'data: {"choices":[{"delta":{"content":\n"x"}}]}\n\n'),
    (CHAT, 'data: {"choices":[{"delta":{"content":"x\u2028y"}}]}\n\n'),
    (CHAT, 'data: {"choices":[{"delta":{"content":"x\x85y"}}]}\n\n'),
    (CHAT, 'data: {"choices":[{"delta":{"content":"x"}}]}\r\n\r\ndata: [DONE]\r\n\r\n'),
] + [(CHAT, "data: " + body + "\n\ndata: [DONE]\n\n") for body in (
    # The canonical shape, which is parsed with one replace: its edge cases.
    D_A + "\n\ndata: [DONE]\n\ndata: " + D_B,  # [DONE] mid-stream: the rest is ignored
    D_A + "\n\ndata: \n\ndata: " + D_B,  # an empty event
    D_A + "\n\ndata: \t " + D_B + "  ",  # padded events
    D_A + "," + D_B,  # two objects in one event
    '{"choices":[{"delta":{"content":"a data: b"}}]}',
    D_A + "\ndata: " + D_B,  # events not separated by a blank line
    '{"choices":[{"delta":{"content":\r"a"}}]}',
    '{"choices":[{"delta":{"content":"a\u2029"}}]}',
    D_A + "\xa0",  # whitespace that str.strip() removes but JSON does not allow
    '{"choices":[{"delta":{"content":"a"}}],"error":null}',
)]
CANONICAL_ACCEPTED = (len(VARIANTS) - 8, len(VARIANTS) - 7, len(VARIANTS) - 6)


@pytest.mark.parametrize("req, resp", VARIANTS, ids=range(len(VARIANTS)))
def test_edge_variants_agree_or_decline(req, resp):
    ct = "text/event-stream" if isinstance(resp, str) else "application/json"
    for enc in ("JSON", "BASE64"):
        assert same(make_capture_record(req, resp, response_content_type=ct, response_encoding=enc).encode())


def test_canonical_streams_take_the_one_replace_parse():
    pool = TextPool(random.Random(3))
    body = exchange("openai_chat_stream", pool, 0)["response"]
    assert fastpath._canonical_sse(body) is not None
    for i in CANONICAL_ACCEPTED:
        req, resp = VARIANTS[i]
        assert fastpath._canonical_sse(resp) is not None
        assert fastpath.fast_decode(make_capture_record(req, resp, response_content_type="text/event-stream").encode())


def test_bad_lines_are_declined():
    good = make_capture_record(CHAT, OK).encode()
    bad = [
        b"\xef\xbb\xbf" + good, good[:-5], good.replace(b"hi", b"h\xffi"), good.replace(b"hi", b"h\x00i"),
        b"[" * 10_000 + b"]" * 10_000, b"", b"  ", json.dumps({"captureData": {"endpointInput": {"data": 1}}}).encode(),
        good.replace(b'"encoding":"JSON"', b'"encoding":"GZIP"', 1),
        make_capture_record("1,2", "0.5", request_content_type="text/csv", request_encoding="CSV").encode(),
    ]
    for line in bad:
        assert fastpath.fast_decode(line) is None, line[:80]
    assert fastpath.fast_decode(good + b"\r") is not None  # CRLF is just trailing whitespace
