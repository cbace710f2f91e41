"""What the target processed and generated, as token ids: a captured exchange -> request examples.

A served request is a prompt the server rendered and tokenized, and the output tokens the
target generated after it. A training example must be exactly that, or the drafter learns
contexts and continuations the target never saw:

* with the ids vLLM reported (``return_token_ids``, kept by capture), the example *is* them:
  ``prompt_token_ids + output_token_ids``, the loss on the output;
* otherwise the request is rendered the way vLLM 0.32 renders a chat request
  (``vllm.renderers.chat_utils.parse_chat_messages`` then ``apply_chat_template`` with
  ``tools``, the request's ``chat_template_kwargs`` and ``add_generation_prompt``, the text
  tokenized with ``add_special_tokens=False``), and the output text, in the form the target's
  template writes what the target generated (reasoning, content, tool calls, end of turn), is
  tokenized on its own and appended. Tokenizing prompt and answer as one string would merge
  the prompt's last characters with the answer's first ones (a newline with newlines) into
  tokens that were never there.

The output text is the template's own: the request plus the answer rendered as a finished
turn, minus the rendered prompt, cut after the end-of-turn token. A template that does not
write the answer right after the prompt cannot be rendered this way (:class:`RenderError`).

Each assistant turn of a conversation is a request of its own, whose prompt holds the
earlier turns as the client sent them back. :func:`request_examples` chains turns into one
example while each request's prompt ids start with the previous example's ids (ChatML:
always), and starts a new one where the template rewrote an earlier turn (Qwen3 drops the
reasoning of turns before the last user message): one example per request there.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

Source = Literal["token_ids", "template"]

# apply_chat_template's own arguments: a request's chat_template_kwargs cannot set them
# (vLLM refuses chat_template/tokenize; add_generation_prompt and the rest are request fields).
_RESERVED_KWARGS = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "tokenize",
                              "add_generation_prompt", "continue_final_message", "return_dict",
                              "return_tensors", "padding", "truncation", "max_length",
                              "return_assistant_tokens_mask", "tokenizer_kwargs"})

# Stands in for an answer's reasoning to see whether the template writes reasoning at all.
_PROBE = "\u2063reasoning-probe\u2063"


class RenderError(ValueError):
    """A request that cannot be rendered as the target processed it; ``reason`` is a short counter key."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass
class RequestTokens:
    """One request as token ids: the prompt the target read and the output it generated.

    ``inexact`` names why the ids may differ from what the target processed (``None``: they
    are its own, or rendered from everything the request and answer held).
    """

    prompt_ids: list[int]
    output_ids: list[int]
    source: Source
    inexact: str | None = None


@dataclass
class ChainedExample:
    """Requests chained into one token sequence: ``outputs`` are the [start, end) spans of what
    the target generated (the loss); the rest is context."""

    input_ids: list[int]
    outputs: list[tuple[int, int]]
    source: Source
    inexact: list[str] = field(default_factory=list)


# --- vLLM's view of a chat request ---------------------------------------------------------


def _text_content(content: Any) -> str:
    """A message's content as vLLM's "string" content format gives it to the template."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, Mapping) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                raise RenderError("non_text_content", f"content part {str(part)[:80]!r}")
        return "\n".join(texts)
    raise RenderError("bad_message", f"content of type {type(content).__name__}")


def _arguments(args: Any) -> dict:
    """Tool-call arguments as vLLM hands them to templates: a JSON object (a string is parsed;
    anything else, or invalid JSON, becomes ``{}`` as vLLM coerces it)."""
    if isinstance(args, Mapping):
        return dict(args)
    if isinstance(args, str) and args:
        try:
            parsed = json.loads(args)
        except ValueError:
            return {}
        return parsed if isinstance(parsed, dict) else {}
    return {}


def vllm_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages as vLLM 0.32 passes them to the chat template
    (``parse_chat_messages`` with the "string" content format, then ``_postprocess_messages``)."""
    out = []
    for m in messages:
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise RenderError("bad_message", f"message without a role: {str(m)[:80]!r}")
        role = m["role"]
        msg: dict[str, Any] = {"role": role, "content": _text_content(m.get("content"))}
        if role == "assistant":
            reasoning = m.get("reasoning")
            if reasoning is None:
                reasoning = m.get("reasoning_content")  # the deprecated name; vLLM renames it
            calls = m.get("tool_calls")
            if calls is not None:
                if not isinstance(calls, list):
                    raise RenderError("bad_tool_calls", "tool_calls is not a list")
                norm = []
                for c in calls:
                    fn = c.get("function") if isinstance(c, Mapping) else None
                    if not isinstance(fn, Mapping) or c.get("type", "function") != "function":
                        raise RenderError("bad_tool_calls", f"tool call {str(c)[:80]!r}")
                    norm.append({**c, "function": {**fn, "arguments": _arguments(fn.get("arguments"))}})
                if norm:
                    msg["tool_calls"] = norm
            if reasoning is not None:
                if not isinstance(reasoning, str):
                    raise RenderError("bad_message", "reasoning is not text")
                msg["reasoning"] = msg["reasoning_content"] = reasoning
        elif role == "tool" and "tool_call_id" in m:
            msg["tool_call_id"] = m["tool_call_id"]
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out


def vllm_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
    """``tools`` as vLLM 0.32 dumps them for the template (``ChatCompletionToolsParam.model_dump``):
    its fields only, in its order, ``description``/``parameters`` null when absent."""
    if tools is None:
        return None
    out = []
    for t in tools:
        fn = t.get("function") if isinstance(t, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise RenderError("bad_tools", f"tool {str(t)[:80]!r}")
        f: dict[str, Any] = {"name": fn["name"], "description": fn.get("description"),
                             "parameters": fn.get("parameters")}
        if fn.get("strict") is not None:
            f["strict"] = fn["strict"]
        defer = fn.get("defer_loading", t.get("defer_loading"))
        if defer is not None:
            f["defer_loading"] = defer
        tool: dict[str, Any] = {"type": "function", "function": f}
        if t.get("defer_loading") is not None:
            tool["defer_loading"] = t["defer_loading"]
        out.append(tool)
    return out


def template_kwargs(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """A request's ``chat_template_kwargs`` less apply_chat_template's own arguments."""
    return {k: v for k, v in (kwargs or {}).items() if isinstance(k, str) and k not in _RESERVED_KWARGS}


# --- rendering -----------------------------------------------------------------------------


def _render(tokenizer: Any, messages: list[dict], tools: list[dict] | None, kwargs: dict, *, prompt: bool) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise RenderError("no_chat_template")
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=prompt, tokenize=False,
                                             **kwargs)
    except RenderError:
        raise
    except Exception as exc:  # noqa: BLE001 - a template raises what it likes (jinja, TypeError, ...)
        raise RenderError("template_error", f"{type(exc).__name__}: {str(exc)[:120]}") from None
    if not isinstance(text, str):
        raise RenderError("template_error", "the template did not return text")
    return text


def _end_of_turn(tokenizer: Any) -> str:
    return tokenizer.eos_token or ""


def output_text(tokenizer: Any, history: list[dict], answer: dict, tools: list[dict] | None, kwargs: dict,
                prompt_text: str | None = None, *, finished: bool = True) -> str:
    """The text the target generated for ``answer`` after ``history``, in its template's form:
    render(history + answer) minus render(history + generation prompt), up to and including
    the end-of-turn token (``finished``; a truncated answer has none)."""
    if prompt_text is None:
        prompt_text = _render(tokenizer, history, tools, kwargs, prompt=True)
    full = _render(tokenizer, history + [answer], tools, kwargs, prompt=False)
    if not full.startswith(prompt_text):
        raise RenderError("answer_not_after_prompt", "the template does not write the answer after the prompt")
    rest = full[len(prompt_text):]
    eot = _end_of_turn(tokenizer)
    at = rest.rfind(eot) if eot else -1
    if at >= 0:
        rest = rest[:at + len(eot)] if finished else rest[:at]
    return rest


def _encode(tokenizer: Any, text: str, special: bool = False) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def _writes_reasoning(tokenizer: Any, history: list[dict], answer: dict, tools, kwargs, prompt_text: str) -> bool:
    """Whether the template writes an answer's reasoning into the output (so a missing one is unknown)."""
    probe = {**answer, "reasoning": _PROBE, "reasoning_content": _PROBE}
    try:
        return _PROBE in output_text(tokenizer, history, probe, tools, kwargs, prompt_text)
    except RenderError:
        return False


def chat_request(tokenizer: Any, messages: list[dict], tools: list[dict] | None, kwargs: dict,
                 finished: bool = True) -> RequestTokens:
    """The request whose answer is ``messages[-1]`` (vLLM-normalized messages), from the template."""
    history, answer = messages[:-1], dict(messages[-1])
    if answer.get("role") != "assistant":
        raise RenderError("no_answer", "the last message is not the assistant's")
    if not history:
        raise RenderError("no_prompt", "an answer without a request")
    if answer.get("tool_calls") and isinstance(answer.get("content"), str):
        # A tool parser hands back the text before the first call as content, with the newlines
        # the template itself writes between content and calls: written once, not twice.
        answer["content"] = answer["content"].rstrip("\n")
    prompt_text = _render(tokenizer, history, tools, kwargs, prompt=True)
    out = output_text(tokenizer, history, answer, tools, kwargs, prompt_text, finished=finished)
    reasoning = answer.get("reasoning")
    if isinstance(reasoning, str) and reasoning.strip() and reasoning.strip() not in out:
        # Reasoning from an endpoint whose model thinks, rendered by a template that never writes
        # it (a target without a reasoning template): the example would not be what was generated.
        raise RenderError("reasoning_not_in_template", "the template does not write the answer's reasoning")
    inexact = None
    if not finished:
        inexact = "truncated"
    elif reasoning is None and _writes_reasoning(tokenizer, history, answer, tools, kwargs, prompt_text):
        inexact = "reasoning_unknown"
    return RequestTokens(_encode(tokenizer, prompt_text), _encode(tokenizer, out), "template", inexact)


def raw_request(tokenizer: Any, prompt: str, output: str, finished: bool | None) -> RequestTokens:
    """A completions request: the prompt as sent, tokenized as vLLM's completions endpoint does
    (the tokenizer's special tokens, e.g. BOS, added), the output appended (its end of sequence
    when the target stopped on it)."""
    ids = _encode(tokenizer, output)
    eos = getattr(tokenizer, "eos_token_id", None)
    if finished and eos is not None:
        ids.append(int(eos))
    return RequestTokens(_encode(tokenizer, prompt, special=True), ids, "template",
                         None if finished is not None else "finish_unknown")


# --- a conversation's requests --------------------------------------------------------------


def _finished(finish_reason: str | None) -> bool:
    return finish_reason != "length"


def request_examples(tokenizer: Any, exchange: Any) -> list[ChainedExample]:
    """A captured exchange (``capture.sharegpt.Exchange``) as chained request examples.

    The last message is the response. Its request comes from the stored ids when the exchange
    has them, else from the template; each earlier assistant turn is a request from the
    template. Raises :class:`RenderError` when the response's request cannot be built.
    """
    msgs = exchange.messages
    if exchange.raw:
        if len(msgs) != 2 or msgs[-1].get("role") != "assistant":
            raise RenderError("bad_raw_row", "a raw-prompt row is one prompt and one output")
        req, why = _stored_request(tokenizer, exchange)
        if req is None:
            finish = exchange.finish_reason
            req = raw_request(tokenizer, _text_content(msgs[0].get("content")), _text_content(msgs[-1].get("content")),
                              None if finish is None else _finished(finish))
            req.inexact = why or req.inexact
        return _chain([req])
    messages = vllm_messages(msgs)
    tools = vllm_tools(exchange.tools)
    kwargs = template_kwargs(exchange.chat_template_kwargs)
    if not messages or messages[-1]["role"] != "assistant":
        raise RenderError("no_answer", "the conversation does not end with an answer")
    requests: list[RequestTokens] = []
    for j, m in enumerate(messages[:-1]):
        if m["role"] == "assistant" and j > 0:
            try:
                requests.append(chat_request(tokenizer, messages[:j + 1], tools, kwargs))
            except RenderError:
                continue  # an earlier turn the template cannot render is context only
    req, why = _stored_request(tokenizer, exchange)
    if req is None:
        req = chat_request(tokenizer, messages, tools, kwargs, _finished(exchange.finish_reason))
        req.inexact = why or req.inexact
    requests.append(req)
    return _chain(requests)


def _has_ids(exchange: Any) -> bool:
    return exchange.prompt_token_ids is not None and exchange.output_token_ids is not None


def _fits(tokenizer: Any, ids: Any) -> bool:
    """Whether every id names a token of ``tokenizer`` (ids captured from another model's
    vocabulary would index past the target's embeddings)."""
    return not ids or (min(ids) >= 0 and max(ids) < len(tokenizer))


def _ids_unusable(tokenizer: Any, exchange: Any) -> str | None:
    """Why the exchange's stored ids cannot be trained on (None: they can, or there are none)."""
    if not _has_ids(exchange):
        return None
    if not (_fits(tokenizer, exchange.prompt_token_ids) and _fits(tokenizer, exchange.output_token_ids)):
        return "token_ids_not_this_tokenizer"
    if not _ids_hold_text(tokenizer, exchange):
        return "token_ids_not_the_text"
    return None


def _stored_request(tokenizer: Any, exchange: Any) -> tuple[RequestTokens | None, str | None]:
    """The response's request from its stored ids when it has usable ones; else None and why not
    (None: no ids stored)."""
    if not _has_ids(exchange):
        return None, None
    why = _ids_unusable(tokenizer, exchange)
    if why:
        return None, why
    return RequestTokens(list(exchange.prompt_token_ids), list(exchange.output_token_ids), "token_ids"), None


def served_request(tokenizer: Any, exchange: Any) -> RequestTokens | None:
    """The exchange's last request as the target served it: its stored prompt and output ids, where the
    capture holds usable ones (this tokenizer's, decoding to the stored text); else None."""
    return _stored_request(tokenizer, exchange)[0]


def _decoded(tokenizer: Any, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _ids_hold_text(tokenizer: Any, exchange: Any) -> bool:
    """Whether the stored ids decode to the stored text: the output holds the answer's content,
    reasoning and tool names, the prompt the last message before the answer. Ids that do not
    (another request's, or another tokenizer's with an overlapping vocabulary) are not trained on:
    the text is what redaction and every check saw."""
    msgs = exchange.messages
    answer = msgs[-1] if msgs else {}
    out = _decoded(tokenizer, list(exchange.output_token_ids))
    pieces = [answer.get("content"), answer.get("reasoning"), answer.get("reasoning_content")]
    for call in answer.get("tool_calls") or []:
        fn = call.get("function") if isinstance(call, dict) else None
        pieces.append(fn.get("name") if isinstance(fn, dict) else None)
    if any(isinstance(p, str) and p.strip() and p.strip() not in out for p in pieces):
        return False
    last = next((m["content"] for m in reversed(msgs[:-1])
                 if isinstance(m.get("content"), str) and m["content"].strip()), None)
    return last is None or last.strip() in _decoded(tokenizer, list(exchange.prompt_token_ids))


def last_prompt_ids(tokenizer: Any, exchange: Any) -> list[int]:
    """The prompt of the exchange's last request, as the target read it: the stored prompt ids, else
    the messages before the last answer (all of them when none answers) rendered as vLLM renders
    them; what an evaluation asks the target to continue."""
    if exchange.prompt_token_ids is not None and (exchange.output_token_ids is None and _fits(
            tokenizer, exchange.prompt_token_ids) or _has_ids(exchange) and not _ids_unusable(tokenizer, exchange)):
        return list(exchange.prompt_token_ids)
    msgs = exchange.messages
    if exchange.raw:
        return _encode(tokenizer, _text_content(msgs[0].get("content")) if msgs else "", special=True)
    messages = vllm_messages(msgs)
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    history = messages[:last] if last is not None else messages
    text = _render(tokenizer, history, vllm_tools(exchange.tools), template_kwargs(exchange.chat_template_kwargs),
                   prompt=True)
    return _encode(tokenizer, text)


def _chain(requests: list[RequestTokens]) -> list[ChainedExample]:
    """Requests -> examples: a request whose prompt ids start with the current example's ids
    extends it (its earlier outputs were its context, token for token); any other starts anew."""
    out: list[ChainedExample] = []
    cur: ChainedExample | None = None
    for r in requests:
        n = len(cur.input_ids) if cur is not None else 0
        if cur is not None and r.prompt_ids[:n] == cur.input_ids and len(r.prompt_ids) >= n:
            cur.input_ids.extend(r.prompt_ids[n:])
            if r.source == "token_ids":
                cur.source = "token_ids"
        else:
            cur = ChainedExample(list(r.prompt_ids), [], r.source)
            out.append(cur)
        start = len(cur.input_ids)
        cur.input_ids.extend(r.output_ids)
        if r.output_ids:
            cur.outputs.append((start, len(cur.input_ids)))
        if r.inexact:
            cur.inexact.append(r.inexact)
    return out
