"""Decoding capture lines, payload formats → conversations, redaction."""

from __future__ import annotations

import base64
import json
import random

import pytest

from capture.formats import to_conversation
from capture.records import Reject, decode_line, make_capture_record
from capture.redact import Redactor, luhn_ok, redact_text, redact_values
from capture.synth import TextPool, exchange


def conv_of(line: str | bytes):
    rec = decode_line(line.encode() if isinstance(line, str) else line)
    return rec, to_conversation(rec.request, rec.response)


def reject_of(line: bytes) -> Reject:
    with pytest.raises(Reject) as ei:
        rec = decode_line(line)
        to_conversation(rec.request, rec.response)
    return ei.value


CHAT_REQ = {"model": "m1", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}],
            "temperature": 0.3, "top_p": 0.8, "max_tokens": 64}
CHAT_RESP = {"model": "m1", "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello."}}]}


def test_openai_chat_roundtrip_keeps_metadata_and_params():
    line = make_capture_record(CHAT_REQ, CHAT_RESP, event_id="e1", inference_id="inf-1",
                               inference_time="2025-03-04T05:06:07Z")
    raw = json.loads(line)
    assert raw["eventVersion"] == "0" and raw["captureData"]["endpointInput"]["mode"] == "INPUT"
    assert raw["captureData"]["endpointOutput"]["mode"] == "OUTPUT"
    rec, conv = conv_of(line)
    assert (rec.event_id, rec.inference_id) == ("e1", "inf-1")
    assert rec.inference_time.isoformat() == "2025-03-04T05:06:07+00:00"
    assert conv.turns == [("system", "Be brief."), ("human", "Hi?"), ("gpt", "Hello.")]
    assert (conv.format, conv.raw, conv.model) == ("openai_chat", False, "m1")
    assert (conv.temperature, conv.top_p, conv.max_tokens) == (0.3, 0.8, 64)


def test_openai_chat_content_parts_and_base64_with_null_content_type():
    req = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Look "},
                                                     {"type": "image_url", "image_url": {"url": "x"}},
                                                     {"type": "text", "text": "here"}]}]}
    line = make_capture_record(req, CHAT_RESP, request_encoding="BASE64", response_encoding="BASE64",
                               response_content_type=None)
    assert json.loads(line)["captureData"]["endpointOutput"]["observedContentType"] is None
    _, conv = conv_of(line)
    assert conv.turns == [("human", "Look here"), ("gpt", "Hello.")]


def test_openai_chat_stream_joins_deltas_until_done():
    sse = (
        'data: {"choices":[{"index":0,"delta":{"role":"assistant"}}],"model":"m2"}\n\n'
        'data: {"choices":[{"index":0,"delta":{"content":"Hel"}}]}\n\n'
        ': keep-alive comment\n\n'
        'data: {"choices":[{"index":0,"delta":{"content":"lo!"}}]}\n\n'
        "data: [DONE]\n\n"
        'data: {"choices":[{"index":0,"delta":{"content":"after done"}}]}\n\n'
    )
    req = {"messages": [{"role": "user", "content": "Say hello"}], "stream": True}
    _, conv = conv_of(make_capture_record(req, sse, response_content_type="text/event-stream"))
    assert conv.turns[-1] == ("gpt", "Hello!")
    assert conv.model == "m2"


def test_openai_completion_is_raw_and_streamed_completion_joins_text():
    req = {"model": "m3", "prompt": "Once upon", "temperature": 1.0, "max_tokens": 5}
    _, conv = conv_of(make_capture_record(req, {"choices": [{"index": 0, "text": " a time"}]}))
    assert conv.turns == [("human", "Once upon"), ("gpt", " a time")]
    assert (conv.format, conv.raw, conv.model, conv.max_tokens) == ("openai_completion", True, "m3", 5)
    sse = 'data: {"choices":[{"index":0,"text":" a"}]}\n\ndata: {"choices":[{"index":0,"text":" time"}]}\n\ndata: [DONE]\n\n'
    _, conv = conv_of(make_capture_record(req, sse, response_content_type="text/event-stream"))
    assert conv.turns[-1] == ("gpt", " a time")


@pytest.mark.parametrize(
    "response",
    [{"generated_text": " world"}, [{"generated_text": " world"}], [{"generated_text": "Hello world"}]],
    ids=["dict", "list", "full_text_echo"],
)
def test_tgi_raw_prompt_variants(response):
    req = {"inputs": "Hello", "parameters": {"max_new_tokens": 9, "temperature": 0.5, "top_p": 0.95}}
    _, conv = conv_of(make_capture_record(req, response))
    assert conv.turns == [("human", "Hello"), ("gpt", " world")]
    assert (conv.format, conv.raw, conv.max_tokens, conv.temperature, conv.top_p) == ("tgi", True, 9, 0.5, 0.95)


def test_tgi_stream_of_tokens():
    sse = "".join(f'data:{json.dumps({"token": {"text": t, "special": False}, "generated_text": None})}\n\n'
                  for t in (" A", " B")) + 'data:{"token":{"text":"</s>","special":true},"generated_text":" A B"}\n\n'
    _, conv = conv_of(make_capture_record({"inputs": "x"}, sse, response_content_type="text/event-stream"))
    assert conv.turns[-1] == ("gpt", " A B")


def test_jumpstart_chat_dialog_base64_generation():
    req = {"inputs": [[{"role": "system", "content": "S"}, {"role": "user", "content": "Q1"},
                       {"role": "assistant", "content": "A1"}, {"role": "user", "content": "Q2"}]],
           "parameters": {"max_new_tokens": 7, "top_p": 0.9}}
    resp = [{"generation": {"role": "assistant", "content": "A2"}}]
    line = make_capture_record(req, resp, response_encoding="BASE64", response_content_type=None)
    _, conv = conv_of(line)
    assert conv.turns == [("system", "S"), ("human", "Q1"), ("gpt", "A1"), ("human", "Q2"), ("gpt", "A2")]
    assert (conv.format, conv.raw, conv.max_tokens) == ("jumpstart_chat", False, 7)


def test_every_synthetic_format_decodes():
    pool = TextPool(random.Random(1))
    for fmt in ("openai_chat", "openai_chat_stream", "openai_completion", "tgi", "jumpstart_chat"):
        kw = exchange(fmt, pool, 7)
        _, conv = conv_of(make_capture_record(**kw))
        assert conv.turns[-1][0] == "gpt" and conv.turns[-1][1].strip()
        assert any(f == "human" and v.startswith("[7] ") for f, v in conv.turns)
    rej = reject_of(make_capture_record(**exchange("tabular_csv", pool, 8)).encode())
    assert (rej.kind, rej.reason) == ("skip", "not_llm_traffic")


@pytest.mark.parametrize(
    "request_, response, reason",
    [
        ({"instances": [{"features": [1, 2]}]}, {"predictions": [{"score": 0.5}]}, "not_llm_traffic"),
        ([1, 2, 3], [0.4], "not_llm_traffic"),
        (CHAT_REQ, {"error": {"message": "overloaded"}}, "error_response"),
        (CHAT_REQ, {"choices": [{"index": 0, "message": {"role": "assistant", "content": "  "}}]}, "empty_response"),
    ],
)
def test_not_llm_or_unusable_is_skipped(request_, response, reason):
    rej = reject_of(make_capture_record(request_, response).encode())
    assert (rej.kind, rej.reason) == ("skip", reason)


def _line(inp_data: str, enc: str = "JSON", out_data: str | None = None, out_enc: str = "JSON") -> bytes:
    out = {"observedContentType": "application/json", "mode": "OUTPUT",
           "data": out_data if out_data is not None else json.dumps(CHAT_RESP), "encoding": out_enc}
    rec = {"captureData": {"endpointInput": {"observedContentType": "application/json", "mode": "INPUT",
                                             "data": inp_data, "encoding": enc}, "endpointOutput": out},
           "eventMetadata": {"eventId": "e", "inferenceTime": "2025-01-01T00:00:00Z"}, "eventVersion": "0"}
    return json.dumps(rec).encode()


GOOD = _line(json.dumps(CHAT_REQ))


@pytest.mark.parametrize(
    "line, reason",
    [
        (GOOD[: len(GOOD) // 2], "invalid_json"),
        (_line("!!!not base64!!!", enc="BASE64"), "invalid_base64"),
        (_line(base64.b64encode(b"\xff\xfe{bad").decode(), enc="BASE64"), "invalid_utf8"),
        (GOOD.replace(b"Be brief.", b"Be \xff brief."), "invalid_utf8"),
        (GOOD.replace(b"Be brief.", b"Be \x00 brief."), "nul_bytes"),
        (_line(json.dumps({"messages": [{"role": "user", "content": "a\u0000b"}]})), "nul_bytes"),
        (_line("{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}"), "invalid_request_json"),
        (json.dumps({"eventMetadata": {}}).encode(), "missing_field"),
        (json.dumps({"captureData": {"endpointInput": {"data": 5, "encoding": "JSON"}}}).encode(), "wrong_type"),
        (json.dumps({"captureData": "nope"}).encode(), "wrong_type"),
        (b"[1, 2]", "wrong_type"),
        (_line(json.dumps({"messages": "hi"})), "wrong_type"),
        (_line(json.dumps({"messages": [{"role": "user", "content": 42}]})), "wrong_type"),
        (_line(json.dumps({"messages": [{"content": "no role"}]})), "missing_field"),
        (_line(json.dumps(CHAT_REQ), out_data='{"choices": "x"}'), "wrong_type"),
        (_line(json.dumps(CHAT_REQ), enc="GZIP"), "unknown_encoding"),
        (b"[" * 10_000 + b"]" * 10_000, "too_deeply_nested"),
        (_line("[" * 10_000 + "]" * 10_000), "too_deeply_nested"),
    ],
    ids=["truncated", "bad_base64", "bad_utf8_base64", "bad_utf8_line", "raw_nul", "escaped_nul", "bad_payload_json",
         "no_capturedata", "data_not_str", "capturedata_not_obj", "line_is_list", "messages_str", "content_int",
         "no_role", "choices_str", "unknown_encoding", "deep_line", "deep_payload"],
)
def test_bad_input_is_quarantined_with_reason(line, reason):
    rej = reject_of(line)
    assert (rej.kind, rej.reason) == ("quarantine", reason), rej


def test_empty_line_is_skipped_and_bom_crlf_are_tolerated():
    assert reject_of(b"   ").reason == "empty_line"
    assert reject_of(b"\r").reason == "empty_line"
    _, conv = conv_of(b"\xef\xbb\xbf" + GOOD + b"\r")
    assert conv.turns[-1] == ("gpt", "Hello.")


def test_csv_encoded_capture_is_skipped_even_with_json_response():
    line = make_capture_record("1,2,3", {"x": 1}, request_content_type="text/csv", request_encoding="CSV")
    rej = reject_of(line.encode())
    assert (rej.kind, rej.reason) == ("skip", "not_llm_traffic")


def test_inference_time_placeholder_is_none():
    line = GOOD.replace(b"2025-01-01T00:00:00Z", b"{%s}")
    assert decode_line(line).inference_time is None


# -- redaction -------------------------------------------------------------------------

PII = {
    "EMAIL": "write to jane.doe+x@mail.example.co.uk today",
    "PHONE": "call (555) 123-4567 or +44 20 7946 0958",
    "CARD": "card 4111 1111 1111 1111 exp 12/29",
    "AWS_ACCESS_KEY": "key AKIAIOSFODNN7EXAMPLE here",
    "AWS_SECRET_KEY": "aws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
    "BEARER_TOKEN": "Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.abc.def",
    "API_KEY": "OPENAI_API_KEY=sk-proj-abcdefghijklmnopqrstuvwx and ghp_abcdefghijklmnopqrstuvwxyz0123456789",
}


@pytest.mark.parametrize("kind", sorted(PII))
def test_each_pii_type_is_replaced_by_typed_placeholder(kind):
    out, counts = redact_text(PII[kind])
    assert f"[REDACTED_{kind}]" in out
    assert counts.get(kind, 0) >= 1
    # The values themselves are gone.
    for secret in ("jane.doe", "123-4567", "7946", "4111 1111", "AKIAIOSFODNN7", "wJalrXUtn", "eyJhbGci", "sk-proj", "ghp_abc"):
        assert secret not in out


def test_counts_per_type_and_prose_untouched():
    text = "mail a@b.io and c@d.org, card 4111-1111-1111-1111"
    out, counts = redact_text(text)
    assert counts == {"EMAIL": 2, "CARD": 1}
    assert out == "mail [REDACTED_EMAIL] and [REDACTED_EMAIL], card [REDACTED_CARD]"
    prose = ("In 2024 the model served 1500 requests at 12:30 with p99 of 250 ms; version 3.1.4, "
             "sha1 da39a3ee5e6b4b0d3255bfef95601890afd80709, order #123456.")
    assert redact_text(prose) == (prose, {})


def test_card_needs_luhn():
    assert luhn_ok("4111111111111111") and not luhn_ok("4111111111111112")
    out, counts = redact_text("number 4111 1111 1111 1112")
    assert counts == {} and "4111 1111 1111 1112" in out


def test_vectorized_gate_flags_everything_the_precise_redactor_changes():
    rng = random.Random(3)
    pool = TextPool(rng)
    samples = [pool.answer() for _ in range(50)] + list(PII.values())
    samples += [f"{pool.prompt(i)} {rng.choice(list(PII.values()))}" for i in range(50)]
    samples += ["amex 3782 822463 10005", "digits 4 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1", "tel 555.123.4567"]
    expected = []
    for s in samples:
        r = Redactor()
        expected.append((r.redact(s), r.counts))
    values = list(samples)
    changed = redact_values(values)
    for i, (out, counts) in enumerate(expected):
        assert values[i] == out
        assert changed.get(i, {}) == counts
    assert len(changed) >= 53
