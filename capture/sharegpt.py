"""The ShareGPT row, as capture writes it and training, evaluation and the bench read it.

A row is ``{"conversations": [{"from": "human"|"gpt"|"system"|..., "value": text}, ...]}``
(plus sampling parameters and catalog columns). :func:`to_messages` turns it into chat
messages for a chat template or an OpenAI request; it is the one mapping of speakers
to roles in the product. :func:`to_exchange` reads the whole exchange (tools, tool calls,
reasoning, token ids) where capture kept it, for training on exactly what the target saw.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# ShareGPT speaker names (any case) -> chat-template roles.
SPEAKER_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
    "function_call": "assistant",
}


def to_messages(row: Mapping[str, Any] | list) -> list[dict[str, str]]:
    """ShareGPT ``conversations`` (from/value; or OpenAI role/content) -> chat messages (role/content)."""
    convs = row if isinstance(row, list) else (row.get("conversations") or row.get("messages") or [])
    out = []
    for turn in convs:
        who = turn.get("from", turn.get("role"))
        text = turn.get("value", turn.get("content"))
        if who is None or text is None:
            raise ValueError(f"conversation turn without speaker/text: {turn!r}")
        role = SPEAKER_ROLES.get(str(who).lower())
        if role is None:
            raise ValueError(f"unknown ShareGPT speaker {who!r}")
        out.append({"role": role, "content": str(text)})
    return out


# ---- the whole exchange (issue 40) ------------------------------------------------------------

# The columns beside ``conversations`` that hold an exchange exactly (capture.warehouse.SCHEMA).
# In Parquet the structured ones are JSON text; in an exported JSONL row they are already parsed.
EXCHANGE_JSON_FIELDS = ("messages", "tools", "tool_choice", "chat_template_kwargs")
TOKEN_ID_FIELDS = ("prompt_token_ids", "output_token_ids")


@dataclass(frozen=True)
class Exchange:
    """One captured exchange as the target processed it, for training.

    ``messages`` is the request's messages exactly as sent (role, content, tool_calls,
    tool_call_id, name, reasoning / reasoning_content when sent) followed by the response as
    one final ``{"role": "assistant", "content", "reasoning"?, "tool_calls"?}`` message. For a
    plain role/content row it is :func:`to_messages` of ``conversations``. ``raw`` says the
    prompt was sent as raw text (a completions or TGI request: no chat template).
    ``prompt_token_ids`` / ``output_token_ids`` are what vLLM reported (``return_token_ids``);
    ``None`` when not captured or when redaction changed the row.
    """

    messages: list[dict]
    tools: list[dict] | None
    tool_choice: Any
    chat_template_kwargs: dict | None
    raw: bool
    prompt_token_ids: list[int] | None
    output_token_ids: list[int] | None
    finish_reason: str | None


def _parsed(v: Any, name: str) -> Any:
    """A structured field as stored (JSON text in Parquet) or exported (already parsed)."""
    if isinstance(v, str):
        try:
            return json.loads(v)
        except ValueError as exc:
            raise ValueError(f"row field {name!r} is not valid JSON: {exc}") from None
    return v


def _ids(v: Any, name: str) -> list[int] | None:
    if v is None:
        return None
    if hasattr(v, "tolist"):  # numpy arrays from a pandas/Arrow read
        v = v.tolist()
    if not isinstance(v, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                   for t in v):
        raise ValueError(f"row field {name!r} is not a list of non-negative token ids")
    return list(v)


def to_exchange(row: Mapping[str, Any]) -> Exchange:
    """A warehouse row (Parquet/Arrow ``to_pylist``) or an exported JSONL row → :class:`Exchange`."""
    msgs = _parsed(row.get("messages"), "messages")
    if msgs is None:
        messages: list[dict] = to_messages(row if "conversations" in row else {"conversations": []})
    else:
        if not isinstance(msgs, list) or not all(isinstance(m, dict) for m in msgs):
            raise ValueError("row field 'messages' is not a list of message objects")
        messages = msgs
    tools = _parsed(row.get("tools"), "tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ValueError("row field 'tools' is not a list of tool objects")
    kwargs = _parsed(row.get("chat_template_kwargs"), "chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ValueError("row field 'chat_template_kwargs' is not an object")
    finish = row.get("finish_reason")
    choice = row.get("tool_choice")
    # Stored (Parquet) rows hold JSON text; an exported row holds the value, and a tool_choice
    # of "auto" is then a plain string. A row is structured exactly where ``messages`` is set.
    if isinstance(row.get("messages"), str):
        choice = _parsed(choice, "tool_choice")
    return Exchange(
        messages=messages,
        tools=tools,
        tool_choice=choice,
        chat_template_kwargs=kwargs,
        raw=bool(row.get("raw") or False),
        prompt_token_ids=_ids(row.get("prompt_token_ids"), "prompt_token_ids"),
        output_token_ids=_ids(row.get("output_token_ids"), "output_token_ids"),
        finish_reason=finish if isinstance(finish, str) else None,
    )
