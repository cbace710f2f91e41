"""Payload formats → ShareGPT conversations.

Supported request/response pairs:

* ``openai_chat``: ``{"messages": [...]}`` → ``{"choices": [{"message": {...}}]}`` or an SSE stream of ``delta`` chunks.
* ``openai_completion``: ``{"prompt": str}`` → ``{"choices": [{"text": ...}]}`` or an SSE stream (raw prompt).
* ``tgi``: ``{"inputs": str, "parameters": {...}}`` → ``{"generated_text"}``, ``[{"generated_text"}]``
  or a TGI SSE stream of ``token`` events (raw prompt; JumpStart/LMI/TGI).
* ``jumpstart_chat``: ``{"inputs": [[{role, content}]]}`` → ``[{"generation": {role, content}}]``.

Anything else raises :class:`capture.records.Reject`: ``skip`` for traffic that is
not LLM chat (tabular CSV, ``{"instances": ...}``), ``quarantine`` for LLM-shaped
payloads that are broken.

This is the reference: it decides every line and names every reason. The rules' values
(roles, content types, SSE, sampling ranges) are :mod:`capture.rules`', which the fast
paths apply too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from capture import rules
from capture.records import Payload, fast_loads, quarantine, skip


@dataclass(slots=True)
class Conversation:
    turns: list[tuple[str, str]]
    format: str
    raw: bool = False
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _loads(text: str, reason: str) -> Any:
    try:
        return fast_loads(text)
    except RecursionError:
        raise quarantine("too_deeply_nested", reason) from None
    except ValueError as exc:
        raise quarantine(reason, str(exc)[:200]) from None


def _sampling(name: str, v: Any) -> float | None:
    """A sampling parameter as stored: ``None`` unless a number; a quarantine if out of range."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return None
    try:
        f = float(v)
    except OverflowError:
        raise quarantine("invalid_sampling_param", f"{name}: an integer of {len(str(v))} digits") from None
    if not rules.sampling_ok(name, f):
        raise quarantine("invalid_sampling_param", f"{name}={f!r}, outside {list(rules.SAMPLING_RANGES[name])}")
    return f


def _int(v: Any) -> int | None:
    # Out of int64 a value is no usable token count (and Parquet could not store it).
    return int(v) if isinstance(v, int) and not isinstance(v, bool) and -(1 << 63) <= v < 1 << 63 else None


def _is_csv(p: Payload) -> bool:
    return p.encoding == rules.CSV or rules.is_csv_content_type(p.content_type)


def _looks_sse(p: Payload) -> bool:
    return rules.looks_sse(p.text, p.content_type)


def _content_text(content: Any, path: str) -> str:
    """OpenAI message content: a string, or a list of parts whose text parts are joined."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict):
                if part.get("type") in (None, "text", "input_text", "output_text"):
                    t = part.get("text")
                    if not isinstance(t, str):
                        raise quarantine("wrong_type", f"{path}[{i}].text")
                    parts.append(t)
                # Images/audio parts carry no text for a drafter to learn.
            else:
                raise quarantine("wrong_type", f"{path}[{i}] is {type(part).__name__}")
        return "".join(parts)
    raise quarantine("wrong_type", f"{path} is {type(content).__name__}")


def _messages(msgs: Any, path: str) -> list[tuple[str, str]]:
    if not isinstance(msgs, list):
        raise quarantine("wrong_type", f"{path} is {type(msgs).__name__}")
    turns = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise quarantine("wrong_type", f"{path}[{i}] is {type(m).__name__}")
        role = m.get("role")
        if not isinstance(role, str):
            raise quarantine("missing_field" if role is None else "wrong_type", f"{path}[{i}].role")
        frm = rules.ROLE_MAP.get(role.lower())
        if frm is None:
            raise quarantine("unknown_role", f"{path}[{i}].role={role[:40]}")
        text = _content_text(m.get("content"), f"{path}[{i}].content")
        if not text and m.get("tool_calls"):
            text = json.dumps(m["tool_calls"], ensure_ascii=False)
        turns.append((frm, text))
    return turns


def parse_sse(text: str) -> list[Any]:
    """The JSON objects of an SSE body's ``data:`` events, in order, stopping at ``[DONE]``."""
    parts = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith(rules.SSE_DATA):
            continue  # event:, id:, retry:, comments and blank separators
        data = line[len(rules.SSE_DATA):].strip()
        if data == rules.SSE_DONE:
            break
        if data:
            parts.append(data)
    if not parts:
        raise quarantine("invalid_sse", "no data events")
    try:
        # One parse of all chunks as a JSON array is much cheaper than one parse per chunk.
        return fast_loads("[" + ",".join(parts) + "]")
    except RecursionError:
        raise quarantine("too_deeply_nested", "invalid_sse_chunk") from None
    except ValueError:
        return [_loads(p, "invalid_sse_chunk") for p in parts]


def _join_stream(events: list[Any]) -> tuple[str, str | None]:
    """Join streamed chunks (OpenAI chat deltas, completion texts, TGI tokens) into one text."""
    out: list[str] = []
    model = None
    final = None
    for ev in events:
        if not isinstance(ev, dict):
            raise quarantine("wrong_type", f"SSE chunk is {type(ev).__name__}")
        if isinstance(ev.get("model"), str):
            model = ev["model"]
        if "error" in ev:
            raise skip("error_response", "error event in stream")
        choices = ev.get("choices")
        if isinstance(choices, list):
            for ch in choices:
                if not isinstance(ch, dict) or ch.get("index", 0) != 0:
                    continue  # n>1 sampling: the first choice is the conversation
                delta = ch.get("delta")
                if isinstance(delta, dict):
                    c = delta.get("content")
                    if isinstance(c, str):
                        out.append(c)
                elif isinstance(ch.get("text"), str):
                    out.append(ch["text"])
        elif isinstance(ev.get("token"), dict):
            t = ev["token"].get("text")
            if isinstance(t, str) and not ev["token"].get("special", False):
                out.append(t)
            if isinstance(ev.get("generated_text"), str):
                final = ev["generated_text"]
        elif isinstance(ev.get("generated_text"), str):
            final = ev["generated_text"]
    text = "".join(out)
    if final is not None and not text:
        text = final
    return text, model


def _response_json(resp: Payload) -> Any:
    return _loads(resp.text, "invalid_response_json")


def _openai_choice(obj: Any, chat: bool) -> tuple[str, str | None]:
    if not isinstance(obj, dict):
        raise quarantine("wrong_type", f"response is a JSON {type(obj).__name__}")
    if "error" in obj or obj.get("object") == "error":
        raise skip("error_response")
    choices = obj.get("choices")
    if not isinstance(choices, list) or not choices:
        raise quarantine("missing_field" if choices is None else "wrong_type", "response.choices")
    ch = choices[0]
    if not isinstance(ch, dict):
        raise quarantine("wrong_type", "response.choices[0]")
    model = obj.get("model") if isinstance(obj.get("model"), str) else None
    if chat:
        msg = ch.get("message")
        if not isinstance(msg, dict):
            raise quarantine("missing_field" if msg is None else "wrong_type", "response.choices[0].message")
        text = _content_text(msg.get("content"), "response.choices[0].message.content")
        if not text and msg.get("tool_calls"):
            text = json.dumps(msg["tool_calls"], ensure_ascii=False)
        return text, model
    text = ch.get("text")
    if not isinstance(text, str):
        raise quarantine("missing_field" if text is None else "wrong_type", "response.choices[0].text")
    return text, model


def _tgi_output(resp: Payload) -> tuple[str, bool]:
    """Generated text of a TGI/LMI/JumpStart response; the flag tells a chat ``generation`` dict."""
    if _looks_sse(resp):
        text, _ = _join_stream(parse_sse(resp.text))
        return text, False
    obj = _response_json(resp)
    if isinstance(obj, list):
        if not obj:
            raise quarantine("missing_field", "response is an empty list")
        obj = obj[0]
    if not isinstance(obj, dict):
        raise quarantine("wrong_type", f"response item is a JSON {type(obj).__name__}")
    if "error" in obj:
        raise skip("error_response")
    if "generated_text" in obj:
        if not isinstance(obj["generated_text"], str):
            raise quarantine("wrong_type", "response.generated_text")
        return obj["generated_text"], False
    gen = obj.get("generation")
    if isinstance(gen, dict):
        return _content_text(gen.get("content"), "response.generation.content"), True
    if isinstance(gen, str):
        return gen, False
    raise quarantine("missing_field", "response.generated_text/generation")


def _params(p: Any) -> dict[str, Any]:
    if not isinstance(p, dict):
        return {}
    max_tokens = None
    for k in rules.MAX_TOKENS_KEYS:
        max_tokens = _int(p.get(k))
        if max_tokens is not None:
            break
    return {"temperature": _sampling("temperature", p.get("temperature")), "top_p": _sampling("top_p", p.get("top_p")),
            "max_tokens": max_tokens}


def to_conversation(request: Payload, response: Payload | None) -> Conversation:
    """Turn one decoded exchange into a :class:`Conversation` or raise ``Reject``."""
    if _is_csv(request):
        raise skip("not_llm_traffic", "CSV payload (tabular model)")
    req = _loads(request.text, "invalid_request_json")
    if not isinstance(req, dict):
        raise skip("not_llm_traffic", f"request is a JSON {type(req).__name__}")
    if response is None:
        raise skip("no_output_captured")

    if "messages" in req:
        turns = _messages(req["messages"], "request.messages")
        if _looks_sse(response):
            answer, model = _join_stream(parse_sse(response.text))
        else:
            answer, model = _openai_choice(_response_json(response), chat=True)
        conv = Conversation(turns=turns, format=rules.OPENAI_CHAT, **_params(req))
        conv.model = req.get("model") if isinstance(req.get("model"), str) else model
    elif "prompt" in req:
        prompt = req["prompt"]
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise quarantine("unsupported_prompt", f"request.prompt is {type(prompt).__name__} (batch or token ids)")
        if _looks_sse(response):
            answer, model = _join_stream(parse_sse(response.text))
        else:
            answer, model = _openai_choice(_response_json(response), chat=False)
        conv = Conversation(turns=[(rules.HUMAN, prompt)], format=rules.OPENAI_COMPLETION, raw=True, **_params(req))
        conv.model = req.get("model") if isinstance(req.get("model"), str) else model
    elif "inputs" in req:
        inputs = req["inputs"]
        params = req.get("parameters")
        if isinstance(inputs, str):
            answer, _ = _tgi_output(response)
            # return_full_text=true echoes the prompt; the drafter learns the continuation.
            if answer.startswith(inputs) and inputs:
                answer = answer[len(inputs):]
            conv = Conversation(turns=[(rules.HUMAN, inputs)], format=rules.TGI, raw=True, **_params(params))
        elif isinstance(inputs, list):
            dialog = inputs
            if dialog and isinstance(dialog[0], list):
                if len(dialog) != 1:
                    raise quarantine("unsupported_batch", f"request.inputs holds {len(dialog)} dialogs")
                dialog = dialog[0]
            turns = _messages(dialog, "request.inputs")
            answer, _ = _tgi_output(response)
            conv = Conversation(turns=turns, format=rules.JUMPSTART_CHAT, **_params(params))
        else:
            raise quarantine("wrong_type", f"request.inputs is {type(inputs).__name__}")
        model = req.get("model")
        conv.model = model if isinstance(model, str) else None
    else:
        keys = ",".join(sorted(str(k) for k in req)[:5])
        raise skip("not_llm_traffic", f"JSON request keys: {keys}")

    if not any(frm == rules.HUMAN for frm, _ in conv.turns):
        raise quarantine("no_user_turn")
    if not answer.strip():
        raise skip("empty_response")
    conv.turns.append((rules.GPT, answer))
    # A NUL decoded from a JSON \u0000 escape is binary junk, not text to train on.
    if any("\x00" in v for _, v in conv.turns):
        raise quarantine("nul_bytes", "decoded message text contains NUL")
    return conv
