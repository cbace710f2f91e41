"""The ShareGPT row, as capture writes it and training, evaluation and the bench read it.

A row is ``{"conversations": [{"from": "human"|"gpt"|"system"|..., "value": text}, ...]}``
(plus sampling parameters and catalog columns). :func:`to_messages` turns it into chat
messages for a chat template or an OpenAI request; it is the one mapping of speakers
to roles in the product.
"""

from __future__ import annotations

from collections.abc import Mapping
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
