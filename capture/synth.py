"""Synthetic Data Capture traffic in every supported format (tests, demos, the ingest benchmark).

The shapes follow the documented wire formats: OpenAI chat/completions (plain and
SSE-streamed), TGI/LMI ``{"inputs": str}`` → ``{"generated_text"}``, JumpStart chat
``{"inputs": [[...]]}`` → BASE64 ``[{"generation": {...}}]``, plus tabular CSV that an
LLM reader must skip.

:data:`EXCHANGE_FORMATS` are the reasoning and tool-calling traffic of a vLLM server run with
``--reasoning-parser qwen3 --enable-auto-tool-choice --tool-call-parser hermes``: answers with
``message.reasoning``, ``message.tool_calls`` (``function.arguments`` a JSON string), requests
with ``tools``, ``tool_choice``, ``chat_template_kwargs``, earlier tool calls and ``tool``
messages with their ids, streamed too (reasoning and tool-call deltas); some carry vLLM's
``return_token_ids`` (prompt ids at the top, output ids in the choice), as the router's capture.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

from capture.records import make_capture_record

_WORDS = (
    "the model request latency token cache decode speculative draft head layer batch throughput queue "
    "python function returns list value error retry timeout network service endpoint region bucket data "
    "summarize explain translate compare write code test review plan design schema table query index join "
    "customer order invoice refund shipping product price discount account password email support ticket "
    "weather travel recipe history science music movie book sport health budget report meeting project"
).split()

FORMATS = ("openai_chat", "openai_chat_stream", "openai_completion", "tgi", "jumpstart_chat", "tabular_csv")
EXCHANGE_FORMATS = ("reasoning_chat", "reasoning_chat_stream", "tool_chat", "tool_chat_stream")
ALL_FORMATS = FORMATS + EXCHANGE_FORMATS
# The mix before reasoning and tool-call traffic (weights over FORMATS).
PLAIN_MIX = (0.40, 0.15, 0.10, 0.15, 0.15, 0.05)
# Weights over ALL_FORMATS: 40% reasoning and tool-call traffic.
DEFAULT_MIX = (0.22, 0.09, 0.06, 0.09, 0.09, 0.05, 0.14, 0.06, 0.14, 0.06)

_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string"}, "unit": {"type": "string",
                                                                               "enum": ["c", "f"]}},
                                          "required": ["city"]}}},
    {"type": "function", "function": {"name": "search_orders", "description": "Find a customer's orders.",
                                      "parameters": {"type": "object", "properties": {
                                          "customer": {"type": "string"}, "limit": {"type": "integer"}},
                                          "required": ["customer"]}}},
]


def _text(rng: random.Random, mean_words: int) -> str:
    n = max(3, int(rng.lognormvariate(0, 0.6) * mean_words))
    return " ".join(rng.choices(_WORDS, k=n)).capitalize() + "."


class TextPool:
    """Pre-made sentences so that millions of records cost string joins, not random draws per word."""

    def __init__(self, rng: random.Random, size: int = 4096) -> None:
        self.rng = rng
        self.prompts = [_text(rng, 30) for _ in range(size)]
        self.answers = [_text(rng, 80) for _ in range(size)]

    def prompt(self, uid: int) -> str:
        # The uid keeps synthetic conversations distinct, as real traffic mostly is.
        return f"[{uid}] " + self.rng.choice(self.prompts)

    def answer(self) -> str:
        return self.rng.choice(self.answers)


def _vllm_message(content: str | None, reasoning: str | None = None, tool_calls: list | None = None) -> dict:
    """A chat completion message as vLLM's OpenAI server writes it (nulls included)."""
    return {"role": "assistant", "content": content, "refusal": None, "annotations": None, "audio": None,
            "function_call": None, "tool_calls": tool_calls or [], "reasoning": reasoning}


def _ids(rng: random.Random, text: str) -> list[int]:
    # About a token per word, ids as in a 150k vocabulary.
    return [rng.randrange(151_000) for _ in range(len(text.split()) + 2)]


def _tool_call(rng: random.Random, uid: int) -> dict:
    if rng.random() < 0.5:
        name, args = "get_weather", {"city": rng.choice(("Paris", "Lima", "Oslo", "Kyoto")), "unit": "c"}
    else:
        name, args = "search_orders", {"customer": f"cust-{uid}", "limit": rng.randint(1, 20)}
    return {"id": f"chatcmpl-tool-{uid:x}{rng.randrange(1 << 32):08x}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(args)}}


def _structured(fmt: str, pool: TextPool, uid: int) -> dict:
    """One reasoning or tool-calling exchange (see :data:`EXCHANGE_FORMATS`)."""
    rng = pool.rng
    prompt, answer = pool.prompt(uid), pool.answer()
    thinking = pool.answer()
    req: dict = {"model": "qwen3", "messages": [{"role": "user", "content": prompt}], "temperature": 0.6,
                 "top_p": 0.95, "max_tokens": 1024}
    ids = rng.random() < 0.25  # captured through the router: vLLM's return_token_ids
    if ids:
        req["return_token_ids"] = True
    reasoning = thinking if fmt.startswith("reasoning") else None
    calls = None
    if fmt.startswith("tool"):
        req["tools"] = _TOOLS
        req["tool_choice"] = "auto"
        if rng.random() < 0.5:
            # A later step of an agent loop: the earlier call and its result come back.
            earlier = _tool_call(rng, uid)
            req["messages"] += [{"role": "assistant", "content": None, "tool_calls": [earlier]},
                                {"role": "tool", "tool_call_id": earlier["id"], "content": pool.prompt(uid)}]
        if rng.random() < 0.6:
            calls = [_tool_call(rng, uid + 1)]
            answer = None
    if reasoning is not None and rng.random() < 0.3:
        req["chat_template_kwargs"] = {"enable_thinking": True}
    out_text = (reasoning or "") + (answer or "") + (json.dumps(calls) if calls else "")
    finish = "tool_calls" if calls else "stop"
    if not fmt.endswith("_stream"):
        resp = {"id": f"chatcmpl-{uid}", "object": "chat.completion", "created": 1735689600, "model": "qwen3",
                "choices": [{"index": 0, "message": _vllm_message(answer, reasoning, calls), "logprobs": None,
                             "finish_reason": finish, "stop_reason": None,
                             "token_ids": _ids(rng, out_text) if ids else None}],
                "usage": {"prompt_tokens": 40, "completion_tokens": 90, "total_tokens": 130},
                "prompt_token_ids": _ids(rng, prompt) if ids else None}
        return {"request": req, "response": resp}
    req["stream"] = True
    head: dict = {"id": f"chatcmpl-{uid}", "object": "chat.completion.chunk", "created": 1735689600,
                  "model": "qwen3"}
    chunks = [head | {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                   "finish_reason": None}]}]
    if ids:
        chunks[0]["prompt_token_ids"] = _ids(rng, prompt)

    def add(delta: dict, text: str) -> None:
        ch: dict = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
        if ids:
            ch["token_ids"] = _ids(rng, text)
        chunks.append(head | {"choices": [ch]})

    for piece in _pieces(reasoning or ""):
        add({"reasoning": piece}, piece)
    for piece in _pieces(answer or ""):
        add({"content": piece}, piece)
    for i, call in enumerate(calls or ()):
        args = call["function"]["arguments"]
        add({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                             "function": {"name": call["function"]["name"], "arguments": ""}}]}, "")
        for a in range(0, len(args), 12):
            add({"tool_calls": [{"index": i, "function": {"arguments": args[a:a + 12]}}]}, args[a:a + 12])
    chunks.append(head | {"choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish}]})
    return {"request": req, "response": _sse(chunks), "response_content_type": "text/event-stream"}


def _pieces(text: str) -> list[str]:
    words = text.split(" ") if text else []
    return [(" " if i else "") + " ".join(words[i:i + 4]) for i in range(0, len(words), 4)]


def _sse(chunks: list[dict]) -> str:
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


def exchange(fmt: str, pool: TextPool, uid: int) -> dict:
    """Keyword arguments for :func:`capture.records.make_capture_record` for one exchange of ``fmt``."""
    rng = pool.rng
    prompt, answer = pool.prompt(uid), pool.answer()
    temp = round(rng.choice((0.0, 0.2, 0.7, 1.0)), 2)
    if fmt in EXCHANGE_FORMATS:
        return _structured(fmt, pool, uid)
    if fmt == "openai_chat":
        req = {"model": "smollm2", "messages": [{"role": "system", "content": "You are helpful."},
                                                {"role": "user", "content": prompt}],
               "temperature": temp, "top_p": 0.9, "max_tokens": 256}
        resp = {"id": f"chatcmpl-{uid}", "object": "chat.completion", "model": "smollm2",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": answer}, "finish_reason": "stop"}]}
        return {"request": req, "response": resp}
    if fmt == "openai_chat_stream":
        req = {"model": "smollm2", "messages": [{"role": "user", "content": prompt}], "stream": True,
               "temperature": temp, "max_tokens": 256}
        words = answer.split(" ")
        # Servers flush a few tokens per event; four words a chunk keeps the body realistic in size.
        pieces = [" ".join(words[i:i + 4]) for i in range(0, len(words), 4)]
        chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant"}}], "model": "smollm2"}]
        chunks += [{"choices": [{"index": 0, "delta": {"content": (" " if i else "") + w}}], "model": "smollm2"}
                   for i, w in enumerate(pieces)]
        return {"request": req, "response": _sse(chunks), "response_content_type": "text/event-stream"}
    if fmt == "openai_completion":
        req = {"model": "smollm2", "prompt": prompt, "temperature": temp, "max_tokens": 128}
        resp = {"object": "text_completion", "model": "smollm2", "choices": [{"index": 0, "text": answer}]}
        return {"request": req, "response": resp}
    if fmt == "tgi":
        req = {"inputs": prompt, "parameters": {"max_new_tokens": 256, "temperature": temp, "top_p": 0.9}}
        return {"request": req, "response": [{"generated_text": answer}]}
    if fmt == "jumpstart_chat":
        req = {"inputs": [[{"role": "user", "content": prompt}]], "parameters": {"max_new_tokens": 256, "top_p": 0.9}}
        resp = [{"generation": {"role": "assistant", "content": answer}}]
        return {"request": req, "response": resp, "response_content_type": None, "response_encoding": "BASE64"}
    if fmt == "tabular_csv":
        row = ",".join(str(rng.randint(0, 300)) for _ in range(8))
        return {"request": row, "response": f"{rng.random():.6f}", "request_content_type": "text/csv",
                "response_content_type": "text/csv", "request_encoding": "CSV", "response_encoding": "CSV"}
    raise ValueError(f"unknown synthetic format {fmt!r}")


def lines(n: int, seed: int = 0, start: datetime | None = None, mix: tuple[float, ...] = DEFAULT_MIX,
          duplicate_rate: float = 0.02, pool: TextPool | None = None, uid0: int = 0) -> Iterator[str]:
    """``n`` capture lines, one second apart from ``start``; ``duplicate_rate`` of them replay an earlier prompt."""
    rng = random.Random(seed)
    pool = pool or TextPool(rng)
    start = start or datetime(2025, 1, 1, tzinfo=timezone.utc)
    recent: list[dict] = []
    for i in range(n):
        if recent and rng.random() < duplicate_rate:
            kw = rng.choice(recent)  # the same exchange served again later: an exact duplicate
        else:
            kw = exchange(rng.choices(ALL_FORMATS if len(mix) == len(ALL_FORMATS) else FORMATS, weights=mix)[0],
                          pool, uid0 + i)
            if len(recent) < 256:
                recent.append(kw)
            else:
                recent[rng.randrange(256)] = kw
        yield make_capture_record(event_id=f"evt-{seed}-{i}", inference_time=start + timedelta(seconds=i), **kw)


def write_layout(root: str | Path, n: int, *, endpoint: str = "ep", variant: str = "AllTraffic",
                 per_file: int = 1000, seed: int = 0, start: datetime | None = None,
                 duplicate_rate: float = 0.02, mix: tuple[float, ...] = DEFAULT_MIX) -> list[Path]:
    """Write ``n`` records as ``root/endpoint/variant/yyyy/mm/dd/hh/*.jsonl`` files of ``per_file`` lines."""
    root = Path(root)
    start = start or datetime(2025, 1, 1, tzinfo=timezone.utc)
    paths: list[Path] = []
    f = None
    rng = random.Random(seed)
    pool = TextPool(rng)
    for i, line in enumerate(lines(n, seed=seed, start=start, duplicate_rate=duplicate_rate, pool=pool, mix=mix)):
        if i % per_file == 0:
            if f:
                f.close()
            t = start + timedelta(seconds=i)
            d = root / endpoint / variant / t.strftime("%Y/%m/%d/%H")
            d.mkdir(parents=True, exist_ok=True)
            p = d / f"{t:%M-%S}-{seed:04d}-{i:09d}.jsonl"
            paths.append(p)
            f = open(p, "w", encoding="utf-8")
        f.write(line + "\n")
    if f:
        f.close()
    return paths
