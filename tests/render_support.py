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


def send(url: str, tok, messages: list[dict], turn: Turn, case: Case, stream: bool) -> tuple[list, list, dict, str]:
    """(prompt ids, output ids, the answer as one message, finish reason), streamed or not."""
    body: dict[str, Any] = {"model": "target", "messages": messages, "temperature": 0, "max_tokens": 96,
                            "return_token_ids": True, "structured_outputs": {"regex": re.escape(turn.forced)},
                            "logit_bias": _bias(tok, turn.forced)}
    if case.tools:
        body["tools"] = case.tools
    if case.kwargs:
        body["chat_template_kwargs"] = case.kwargs
    if not stream:
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
        r.raise_for_status()
        j = r.json()
        c = j["choices"][0]
        return j["prompt_token_ids"], c["token_ids"], _message(c["message"]), c["finish_reason"]
    body["stream"] = True
    msg: dict[str, Any] = {"role": "assistant", "content": None, "reasoning": None, "tool_calls": None}
    prompt, out, finish = None, [], None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
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


@dataclass
class Tally:
    requests: dict[str, int] = field(default_factory=dict)
    exact_template: dict[str, int] = field(default_factory=dict)
    exact_ids: dict[str, int] = field(default_factory=dict)
    misses: list[str] = field(default_factory=list)

    def add(self, kind: str, template_ok: bool, ids_ok: bool, why: str) -> None:
        for d, ok in ((self.requests, True), (self.exact_template, template_ok), (self.exact_ids, ids_ok)):
            d[kind] = d.get(kind, 0) + int(ok)
        if not (template_ok and ids_ok):
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


def run_cases(url: str, tok, streams=(False, True)) -> Tally:
    """Every case's requests, streamed and not; each answer compared as a captured row (text
    only: the template path; with the ids: the ids path) with vLLM's prompt + output ids."""
    tally = Tally()
    for stream in streams:
        for case in CASES:
            history: list[dict] = []
            earlier: list[list[int]] = []
            for turn in case.turns:
                add = [dict(m) for m in turn.add]
                for m in add:
                    if m["role"] == "tool":  # the result answers the previous call
                        m["tool_call_id"] = history[-1]["tool_calls"][0]["id"]
                history += add
                prompt, out, msg, finish = send(url, tok, history, turn, case, stream)
                row = {"messages": history + [msg], "tools": case.tools, "tool_choice": None,
                       "chat_template_kwargs": case.kwargs, "finish_reason": finish}
                t_ok, why = _exact(tok, row, prompt, out, earlier)
                i_ok, why_i = _exact(tok, {**row, "prompt_token_ids": prompt, "output_token_ids": out}, prompt, out,
                                     earlier)
                earlier.append(out)
                tally.add(case.kind, t_ok, i_ok, f"{case.kind} stream={stream} {turn.forced[:30]!r}: {why}{why_i}")
                sent = {"role": "assistant", "content": msg["content"]}
                if msg["tool_calls"]:
                    sent["tool_calls"] = msg["tool_calls"]
                if case.send_back_reasoning and msg["reasoning"] is not None:
                    sent["reasoning"] = msg["reasoning"]
                history.append(sent)
    return tally
