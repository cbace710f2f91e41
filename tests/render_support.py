"""Requests to a vLLM server of the tiny Qwen3 chat target whose answers are forced (structured
outputs) to hold reasoning and tool calls, and the comparison of the training examples built
from what came back with the ids vLLM reported (tests/adapt/test_render_vllm.py)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import httpx

from adapt.data import row_examples

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
IM_END = 151645

CALL_PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL_ROME = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'


@dataclass
class Turn:
    """One request: the user's message (or tool result) added to the history, and the text the
    target is forced to generate for it."""

    add: list[dict]
    forced: str


@dataclass
class Case:
    kind: str  # reasoning | tools | multi-turn
    turns: list[Turn]
    tools: list[dict] | None = None
    kwargs: dict | None = None
    send_back_reasoning: bool = False


def _u(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


CASES = [
    Case("reasoning", [Turn(_u("what is two plus two"),
                            "<think>\nthe user wants the sum\n</think>\n\nthe answer is four")]),
    Case("reasoning", [Turn([{"role": "system", "content": "be brief"}] + _u("is the sky blue"),
                            "<think>\nshort question, short answer\n</think>\n\nyes")]),
    Case("reasoning", [Turn(_u("list two steps"),
                            "<think>\nfirst step.\n\nsecond step.\n</think>\n\nline one\nline two")]),
    Case("reasoning", [Turn(_u("say hi"), "hello there, friend")], kwargs={"enable_thinking": False}),
    Case("tools", [Turn(_u("weather in Paris?"), "<think>\nI should call the tool\n</think>\n\n" + CALL_PARIS)],
         tools=TOOLS),
    Case("tools", [Turn(_u("weather in Paris?"), "let me check\n" + CALL_PARIS)], tools=TOOLS,
         kwargs={"enable_thinking": False}),
    Case("tools", [Turn(_u("Paris or Rome?"), "<think>\nboth\n</think>\n\n" + CALL_PARIS + "\n" + CALL_ROME)],
         tools=TOOLS),
    Case("multi-turn", [Turn(_u("what is two plus two"), "<think>\nsum\n</think>\n\nfour"),
                        Turn(_u("and three plus three"), "<think>\nanother sum\n</think>\n\nsix")]),
    Case("multi-turn", [Turn(_u("weather in Paris?"), "<think>\ncall it\n</think>\n\n" + CALL_PARIS),
                        Turn([{"role": "tool", "content": "sunny, 21 C"}],
                             "<think>\nthe tool says sunny\n</think>\n\nIt is sunny in Paris.")],
         tools=TOOLS, send_back_reasoning=True),
    Case("multi-turn", [Turn(_u("is it ok?"), "yes"), Turn(_u("really?"), "yes, sure"),
                        Turn(_u("sure?\n"), "yes\n\nsure")], kwargs={"enable_thinking": False}),
]


def _bias(tok, text: str) -> dict[str, float]:
    """Structured outputs fix the characters; a random model may still spell them with other
    tokens. The bias makes it pick the tokenizer's own spelling (and end its turn with <|im_end|>),
    as a trained model does: the canonical tokens only, a longer one above a shorter one where
    both fit the text still to come ("\n\n" over "\n"); vLLM clamps a bias to 100."""
    ids = tok(text, add_special_tokens=False)["input_ids"] + [IM_END]
    pieces = {t: tok.decode([t]) for t in ids}
    bias = {t: min(100.0, 40.0 + 10.0 * len(s)) for t, s in pieces.items()}
    # Where another biased token fits what is still to come, the canonical one must win.
    full, at = text + "<|im_end|>", 0
    for t in ids:
        rest = full[at:]
        rivals = [u for u, s in pieces.items() if u != t and rest.startswith(s)]
        assert all(bias[u] < bias[t] for u in rivals), f"forced text {text!r} is ambiguous at {rest[:20]!r}"
        at += len(pieces[t])
    return {str(t): b for t, b in bias.items()}


def _message(msg: dict) -> dict:
    return {"role": "assistant", "content": msg.get("content"), "reasoning": msg.get("reasoning"),
            "tool_calls": msg.get("tool_calls")}


@dataclass
class Served:
    """One request as served: what the client sent, the body it got back, and vLLM's ids."""

    event_id: str
    kind: str
    request: dict
    body: str  # the response body as it crossed the wire (JSON, or the SSE stream)
    stream: bool
    prompt_ids: list[int]
    output_ids: list[int]


def _sse_answer(body: str) -> tuple[list, list, dict, str]:
    msg: dict[str, Any] = {"role": "assistant", "content": None, "reasoning": None, "tool_calls": None}
    prompt, out, finish = None, [], None
    for line in body.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        prompt = chunk.get("prompt_token_ids") or prompt
        for c in chunk["choices"]:
            out += c.get("token_ids") or []
            d = c["delta"]
            for k in ("content", "reasoning"):
                if d.get(k):
                    msg[k] = (msg[k] or "") + d[k]
            for tc in d.get("tool_calls") or []:
                calls = msg["tool_calls"] = msg["tool_calls"] or []
                while len(calls) <= tc["index"]:
                    calls.append({"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
                call = calls[tc["index"]]
                call["id"] = tc.get("id") or call["id"]
                fn = tc.get("function") or {}
                call["function"]["name"] += fn.get("name") or ""
                call["function"]["arguments"] += fn.get("arguments") or ""
            finish = c.get("finish_reason") or finish
    return prompt, out, msg, finish


def send(url: str, tok, messages: list[dict], turn: Turn, case: Case, stream: bool) -> tuple[dict, str, list, list, dict]:
    """(the request, the response body, prompt ids, output ids, the answer as one message)."""
    body: dict[str, Any] = {"model": "target", "messages": json.loads(json.dumps(messages)), "temperature": 0,
                            "max_tokens": 96,
                            "return_token_ids": True, "structured_outputs": {"regex": re.escape(turn.forced)},
                            "logit_bias": _bias(tok, turn.forced)}
    if case.tools:
        body["tools"] = case.tools
    if case.kwargs:
        body["chat_template_kwargs"] = case.kwargs
    if stream:
        body["stream"] = True
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    r.raise_for_status()
    if stream:
        prompt, out, msg, _ = _sse_answer(r.text)
    else:
        j = r.json()
        prompt, out, msg = j["prompt_token_ids"], j["choices"][0]["token_ids"], _message(j["choices"][0]["message"])
    return body, r.text, prompt, out, msg


def serve_cases(url: str, tok, streams=(False, True)) -> list[Served]:
    """Every case's requests, streamed and not; a conversation's next request carries the previous
    answer back as a client does (content and tool calls; reasoning where the case says)."""
    served = []
    for stream in streams:
        for n, case in enumerate(CASES):
            history: list[dict] = []
            for k, turn in enumerate(case.turns):
                add = [dict(m) for m in turn.add]
                if stream and not history:  # streamed twins differ in text, or capture keeps one of each pair
                    add[-1]["content"] += " (streamed)"
                for m in add:
                    if m["role"] == "tool":  # the result answers the previous call
                        m["tool_call_id"] = history[-1]["tool_calls"][0]["id"]
                history += add
                req, body, prompt, out, msg = send(url, tok, history, turn, case, stream)
                served.append(Served(f"{'s' if stream else 'p'}{n}-{k}", case.kind, req, body, stream, prompt, out))
                sent = {"role": "assistant", "content": msg["content"]}
                if msg["tool_calls"]:
                    sent["tool_calls"] = msg["tool_calls"]
                if case.send_back_reasoning and msg["reasoning"] is not None:
                    sent["reasoning"] = msg["reasoning"]
                history.append(sent)
    return served


def without_ids(s: Served) -> tuple[dict, str]:
    """The exchange as SageMaker Data Capture records it for a client that did not ask for ids."""
    req = {k: v for k, v in s.request.items() if k != "return_token_ids"}
    if not s.stream:
        j = json.loads(s.body)
        j.pop("prompt_token_ids", None)
        for c in j["choices"]:
            c.pop("token_ids", None)
        return req, json.dumps(j)
    lines = []
    for line in s.body.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            chunk = json.loads(line[6:])
            chunk.pop("prompt_token_ids", None)
            for c in chunk["choices"]:
                c.pop("token_ids", None)
            line = "data: " + json.dumps(chunk)
        lines.append(line)
    return req, "\n".join(lines) + "\n"


def capture_records(served: list[Served], with_ids: bool, t0) -> list[str]:
    """Data Capture lines of the exchanges, a minute apart, the event id naming the request."""
    from datetime import timedelta

    from capture.records import make_capture_record

    out = []
    for i, s in enumerate(served):
        req, body = (s.request, s.body) if with_ids else without_ids(s)
        out.append(make_capture_record(req, body if s.stream else json.loads(body), event_id=s.event_id,
                                       inference_time=t0 + timedelta(minutes=i),
                                       response_content_type="text/event-stream" if s.stream else "application/json"))
    return out


@dataclass
class Tally:
    requests: dict[str, int] = field(default_factory=dict)
    exact: dict[str, int] = field(default_factory=dict)
    misses: list[str] = field(default_factory=list)

    def add(self, kind: str, ok: bool, why: str) -> None:
        self.requests[kind] = self.requests.get(kind, 0) + 1
        self.exact[kind] = self.exact.get(kind, 0) + int(ok)
        if not ok:
            self.misses.append(why)


def _runs(mask: list[bool]) -> list[tuple[int, int]]:
    out, start = [], None
    for i, m in enumerate(mask + [False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def _exact(tok, row: dict, prompt: list[int], out: list[int], earlier: list[list[int]]) -> tuple[bool, str]:
    """Whether the row's own example is vLLM's prompt + output ids with the loss on the output,
    and in the prompt at most on earlier answers of the conversation as the target generated them."""
    ex = row_examples(tok, row)[-1]
    want_ids = prompt + out
    ids, mask = ex.input_ids.tolist(), ex.loss_mask.tolist()
    if ids != want_ids:
        at = next((i for i, (a, b) in enumerate(zip(ids, want_ids)) if a != b), min(len(ids), len(want_ids)))
        return False, (f"ids differ at {at} of {len(want_ids)} (prompt {len(prompt)}): got "
                       f"{tok.decode(ids[at:at + 8])!r} want {tok.decode(want_ids[at:at + 8])!r}")
    if not all(mask[len(prompt):]):
        return False, "output not all in the loss"
    stray = [(a, b) for a, b in _runs(mask[:len(prompt)]) if ids[a:b] not in earlier]
    if stray:
        return False, f"loss on prompt tokens {tok.decode(ids[stray[0][0]:stray[0][1]])!r}"
    return True, ""


def compare(tok, served: list[Served], rows: dict[str, dict], source: str) -> Tally:
    """Each served request's captured row (by event id) against vLLM's ids; the row's example must
    come from ``source`` (``token_ids`` or ``template``)."""
    tally = Tally()
    earlier: dict[str, list[list[int]]] = {}
    for s in served:
        conv = s.event_id.split("-")[0]
        row = rows.get(s.event_id)
        if row is None:
            tally.add(s.kind, False, f"{s.event_id}: no row in the warehouse")
            continue
        ok, why = _exact(tok, row, s.prompt_ids, s.output_ids, earlier.get(conv, []))
        got = row_examples(tok, row)[-1].source
        if got != source:
            ok, why = False, f"source {got}"
        tally.add(s.kind, ok, f"{s.event_id} {s.kind} stream={s.stream}: {why}")
        earlier.setdefault(conv, []).append(s.output_ids)
    return tally
