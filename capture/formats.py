"""Payload formats → ShareGPT conversations.

Supported request/response pairs:

* ``openai_chat``: ``{"messages": [...]}`` → ``{"choices": [{"message": {...}}]}`` or an SSE stream of ``delta`` chunks.
* ``openai_completion``: ``{"prompt": str}`` → ``{"choices": [{"text": ...}]}`` or an SSE stream (raw prompt).
* ``tgi``: ``{"inputs": str, "parameters": {...}}`` → ``{"generated_text"}``, ``[{"generated_text"}]``
  or a TGI SSE stream of ``token`` events (raw prompt; JumpStart/LMI/TGI).
* ``jumpstart_chat``: ``{"inputs": [[{role, content}]]}`` → ``[{"generation": {role, content}}]``.

OpenAI chat and completions exchanges are kept whole where role/content text is not the
whole of them (:class:`Exchange`, the ``messages``/``tools``/... columns of
:data:`capture.warehouse.SCHEMA`): the request's messages as sent (assistant ``tool_calls``,
``tool`` messages and their ids, reasoning), ``tools``, ``tool_choice``,
``chat_template_kwargs``, and the response's ``reasoning`` (or the deprecated
``reasoning_content``), ``tool_calls`` (stream fragments merged by index) and finish
reason; with vLLM's ``return_token_ids`` also the prompt and output token ids.

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
    # The whole exchange (JSON text), None where ``turns`` already is all of it; see Exchange.
    messages: str | None = None
    tools: str | None = None
    tool_choice: str | None = None
    chat_template_kwargs: str | None = None
    finish_reason: str | None = None
    prompt_token_ids: list[int] | None = None
    output_token_ids: list[int] | None = None


PLAIN_ROLES = rules.PLAIN_ROLES
# Request keys kept as sent (JSON text), when present and not null.
REQUEST_FIELDS = ("tools", "tool_choice", "chat_template_kwargs")
# Token ids are stored as int32 (vocabularies are far smaller).
MAX_TOKEN_ID = (1 << 31) - 1


def _dumps(v: Any) -> str:
    return json.dumps(v, ensure_ascii=False, separators=(",", ":"))


def _token_ids(v: Any, path: str) -> list[int] | None:
    """A list of token ids as vLLM reports them, or None if absent; a quarantine if malformed."""
    if v is None:
        return None
    # set/min/max loop in C: an answer holds thousands of ids.
    if not isinstance(v, list) or (v and (not set(map(type, v)) <= {int} or min(v) < 0 or max(v) > MAX_TOKEN_ID)):
        raise quarantine("invalid_token_ids", f"{path} is not a list of non-negative int32 token ids")
    return v


def _reasoning(obj: dict, path: str) -> str | None:
    """``reasoning`` (vLLM >= 0.10) or the deprecated ``reasoning_content``: a string or absent."""
    out = None
    for key in ("reasoning", "reasoning_content"):
        v = obj.get(key)
        if v is None:
            continue
        if not isinstance(v, str):
            raise quarantine("invalid_reasoning", f"{path}.{key} is {type(v).__name__}")
        if out is None:
            out = v
    return out


def _check_tool_calls(calls: Any, path: str) -> list | None:
    """Tool calls as sent or generated: a list of objects whose ``function.arguments`` is JSON
    (a string that parses, or an object); None if absent or empty."""
    if calls is None:
        return None
    if not isinstance(calls, list):
        raise quarantine("wrong_type", f"{path} is {type(calls).__name__}")
    for i, c in enumerate(calls):
        if not isinstance(c, dict):
            raise quarantine("wrong_type", f"{path}[{i}] is {type(c).__name__}")
        fn = c.get("function")
        if fn is None:
            continue
        if not isinstance(fn, dict):
            raise quarantine("wrong_type", f"{path}[{i}].function is {type(fn).__name__}")
        args = fn.get("arguments")
        if args is None or isinstance(args, dict):
            continue
        if not isinstance(args, str):
            raise quarantine("invalid_tool_call_arguments", f"{path}[{i}].function.arguments is {type(args).__name__}")
        try:
            json.loads(args)
        except (ValueError, RecursionError):
            raise quarantine("invalid_tool_call_arguments", f"{path}[{i}].function.arguments is not JSON") from None
    return calls or None


@dataclass(slots=True)
class Answer:
    """One response, as the reference reads it: the text for ``conversations`` and the rest."""

    content: str
    model: str | None = None
    reasoning: str | None = None
    tool_calls: list | None = None
    finish_reason: str | None = None
    prompt_token_ids: list[int] | None = None
    output_token_ids: list[int] | None = None
    content_null: bool = False  # the message's content was null (a tool call), not ""

    @property
    def structured(self) -> bool:
        return self.reasoning is not None or self.tool_calls is not None

    def text(self) -> str:
        """The ShareGPT value: the content, or the tool calls as JSON text where there is none."""
        if not self.content and self.tool_calls:
            return json.dumps(self.tool_calls, ensure_ascii=False)
        return self.content

    def message(self) -> dict:
        m: dict[str, Any] = {"role": "assistant", "content": None if self.content_null and not self.content
                             else self.content}
        if self.reasoning is not None:
            m["reasoning"] = self.reasoning
        if self.tool_calls is not None:
            m["tool_calls"] = self.tool_calls
        return m


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


def content_text(content: Any, path: str) -> str:
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


def _messages(msgs: Any, path: str, plain: list[bool] | None = None) -> list[tuple[str, str]]:
    """Turns of a message list; ``plain`` (a one-item list) is set False unless every message
    is role/content text that the turns render exactly (see :data:`PLAIN_ROLES`)."""
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
        text = content_text(m.get("content"), f"{path}[{i}].content")
        calls = _check_tool_calls(m.get("tool_calls"), f"{path}[{i}].tool_calls")
        _reasoning(m, f"{path}[{i}]")
        for key in ("tool_call_id", "name"):
            if m.get(key) is not None and not isinstance(m[key], str):
                raise quarantine("wrong_type", f"{path}[{i}].{key} is {type(m[key]).__name__}")
        if not text and calls:
            text = json.dumps(m["tool_calls"], ensure_ascii=False)
        if plain is not None and plain[0] and not (role in PLAIN_ROLES and len(m) == 2
                                                   and isinstance(m.get("content"), str)):
            plain[0] = False
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


def _join_stream(events: list[Any]) -> Answer:
    """Join streamed chunks (OpenAI chat deltas, completion texts, TGI tokens) into one answer.

    Choice 0's content, reasoning and tool-call fragments (merged by ``index``: the id, type
    and name where first given, the arguments concatenated), its last finish reason, and
    vLLM's token ids (``prompt_token_ids`` in the first chunk, or its choice; ``token_ids``
    of each chunk's choice, concatenated).
    """
    out: list[str] = []
    reasoning: list[str] | None = None
    calls: dict[int, dict] = {}
    prompt_ids: list[int] | None = None
    output_ids: list[int] | None = None
    finish = None
    model = None
    final = None
    for ev in events:
        if not isinstance(ev, dict):
            raise quarantine("wrong_type", f"SSE chunk is {type(ev).__name__}")
        if isinstance(ev.get("model"), str):
            model = ev["model"]
        if "error" in ev:
            raise skip("error_response", "error event in stream")
        ids = _token_ids(ev.get("prompt_token_ids"), "SSE chunk.prompt_token_ids")
        if ids is not None and prompt_ids is None:
            prompt_ids = ids
        choices = ev.get("choices")
        if isinstance(choices, list):
            for ch in choices:
                if not isinstance(ch, dict) or ch.get("index", 0) != 0:
                    continue  # n>1 sampling: the first choice is the conversation
                ids = _token_ids(ch.get("prompt_token_ids"), "SSE choice.prompt_token_ids")
                if ids is not None and prompt_ids is None:
                    prompt_ids = ids
                ids = _token_ids(ch.get("token_ids"), "SSE choice.token_ids")
                if ids is not None:
                    if output_ids is None:
                        output_ids = []
                    output_ids += ids
                if isinstance(ch.get("finish_reason"), str):
                    finish = ch["finish_reason"]
                delta = ch.get("delta")
                if isinstance(delta, dict):
                    c = delta.get("content")
                    if isinstance(c, str):
                        out.append(c)
                    r = _reasoning(delta, "SSE delta")
                    if r is not None:
                        if reasoning is None:
                            reasoning = []
                        reasoning.append(r)
                    _merge_calls(calls, delta.get("tool_calls"))
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
    tool_calls = _check_tool_calls([calls[k] for k in sorted(calls)], "SSE delta.tool_calls") if calls else None
    return Answer(content=text, model=model, reasoning="".join(reasoning) if reasoning is not None else None,
                  tool_calls=tool_calls, finish_reason=finish, prompt_token_ids=prompt_ids,
                  output_token_ids=output_ids, content_null=not text)


def _merge_calls(calls: dict[int, dict], frags: Any) -> None:
    """Streamed tool-call fragments into ``calls`` (by their index)."""
    if frags is None:
        return
    if not isinstance(frags, list):
        raise quarantine("wrong_type", f"SSE delta.tool_calls is {type(frags).__name__}")
    for f in frags:
        if not isinstance(f, dict):
            raise quarantine("wrong_type", f"SSE delta.tool_calls item is {type(f).__name__}")
        idx = f.get("index", len(calls))
        if type(idx) is not int:
            raise quarantine("wrong_type", "SSE delta.tool_calls[].index")
        call = calls.setdefault(idx, {})
        for key in ("id", "type"):
            if isinstance(f.get(key), str) and key not in call:
                call[key] = f[key]
        fn = f.get("function")
        if fn is None:
            continue
        if not isinstance(fn, dict):
            raise quarantine("wrong_type", "SSE delta.tool_calls[].function")
        into = call.setdefault("function", {})
        if isinstance(fn.get("name"), str) and "name" not in into:
            into["name"] = fn["name"]
        args = fn.get("arguments")
        if args is not None:
            if not isinstance(args, str):
                raise quarantine("invalid_tool_call_arguments", f"streamed arguments are {type(args).__name__}")
            into["arguments"] = into.get("arguments", "") + args


def _response_json(resp: Payload) -> Any:
    return _loads(resp.text, "invalid_response_json")


def _openai_choice(obj: Any, chat: bool) -> Answer:
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
    # vLLM's return_token_ids: prompt ids at the top (chat) or in the choice (completions).
    prompt_ids = _token_ids(obj.get("prompt_token_ids"), "response.prompt_token_ids")
    if prompt_ids is None:
        prompt_ids = _token_ids(ch.get("prompt_token_ids"), "response.choices[0].prompt_token_ids")
    out = Answer(content="", model=model, finish_reason=ch.get("finish_reason") if isinstance(
        ch.get("finish_reason"), str) else None, prompt_token_ids=prompt_ids,
        output_token_ids=_token_ids(ch.get("token_ids"), "response.choices[0].token_ids"))
    if chat:
        msg = ch.get("message")
        if not isinstance(msg, dict):
            raise quarantine("missing_field" if msg is None else "wrong_type", "response.choices[0].message")
        out.content = content_text(msg.get("content"), "response.choices[0].message.content")
        out.content_null = msg.get("content") is None
        out.reasoning = _reasoning(msg, "response.choices[0].message")
        out.tool_calls = _check_tool_calls(msg.get("tool_calls"), "response.choices[0].message.tool_calls")
        return out
    text = ch.get("text")
    if not isinstance(text, str):
        raise quarantine("missing_field" if text is None else "wrong_type", "response.choices[0].text")
    out.content = text
    return out


def _tgi_output(resp: Payload) -> tuple[str, bool]:
    """Generated text of a TGI/LMI/JumpStart response; the flag tells a chat ``generation`` dict."""
    if _looks_sse(resp):
        return _join_stream(parse_sse(resp.text)).content, False
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
        return content_text(gen.get("content"), "response.generation.content"), True
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


def _has_nul(texts: tuple[str | None, ...]) -> bool:
    """True if JSON text (as :func:`_dumps` writes it) holds a NUL in a string or key."""
    def walk(v: Any) -> bool:
        if isinstance(v, str):
            return "\x00" in v
        if isinstance(v, list):
            return any(walk(x) for x in v)
        if isinstance(v, dict):
            return any(walk(k) or walk(x) for k, x in v.items())
        return False
    return any(t is not None and "\\u0000" in t and walk(json.loads(t)) for t in texts)


def to_conversation(request: Payload, response: Payload | None) -> Conversation:
    """Turn one decoded exchange into a :class:`Conversation` or raise ``Reject``."""
    if _is_csv(request):
        raise skip("not_llm_traffic", "CSV payload (tabular model)")
    req = _loads(request.text, "invalid_request_json")
    if not isinstance(req, dict):
        raise skip("not_llm_traffic", f"request is a JSON {type(req).__name__}")
    if response is None:
        raise skip("no_output_captured")

    ans: Answer | None = None
    if "messages" in req:
        plain = [True]
        turns = _messages(req["messages"], "request.messages", plain)
        if _looks_sse(response):
            ans = _join_stream(parse_sse(response.text))
        else:
            ans = _openai_choice(_response_json(response), chat=True)
        conv = Conversation(turns=turns, format=rules.OPENAI_CHAT, **_params(req))
        conv.model = req.get("model") if isinstance(req.get("model"), str) else ans.model
        sent = {k: req[k] for k in REQUEST_FIELDS if req.get(k) is not None}
        kwargs = sent.get("chat_template_kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise quarantine("wrong_type", f"request.chat_template_kwargs is {type(kwargs).__name__}")
        if "tools" in sent and not (isinstance(sent["tools"], list) and all(isinstance(t, dict) for t in sent["tools"])):
            raise quarantine("wrong_type", "request.tools is not a list of objects")
        if sent or ans.structured or not plain[0]:
            conv.messages = _dumps(req["messages"] + [ans.message()])
            conv.tools, conv.tool_choice, conv.chat_template_kwargs = (
                _dumps(sent[k]) if k in sent else None for k in REQUEST_FIELDS)
        answer = ans.text()
    elif "prompt" in req:
        prompt = req["prompt"]
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise quarantine("unsupported_prompt", f"request.prompt is {type(prompt).__name__} (batch or token ids)")
        if _looks_sse(response):
            ans = _join_stream(parse_sse(response.text))
        else:
            ans = _openai_choice(_response_json(response), chat=False)
        conv = Conversation(turns=[(rules.HUMAN, prompt)], format=rules.OPENAI_COMPLETION, raw=True, **_params(req))
        conv.model = req.get("model") if isinstance(req.get("model"), str) else ans.model
        answer = ans.content
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
    # An answer that is all reasoning (cut at max_tokens while thinking) is still what the
    # target generated; only an answer with nothing at all is skipped.
    if not answer.strip() and not (ans is not None and ans.structured):
        raise skip("empty_response")
    conv.turns.append((rules.GPT, answer))
    # A NUL decoded from a JSON \u0000 escape is binary junk, not text to train on.
    if any("\x00" in v for _, v in conv.turns) or (conv.messages is not None and _has_nul(
            (conv.messages, conv.tools, conv.tool_choice, conv.chat_template_kwargs))):
        raise quarantine("nul_bytes", "decoded message text contains NUL")
    if conv.format in (rules.OPENAI_CHAT, rules.OPENAI_COMPLETION):
        conv.finish_reason = ans.finish_reason
        conv.prompt_token_ids, conv.output_token_ids = ans.prompt_token_ids, ans.output_token_ids
    return conv
