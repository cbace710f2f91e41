"""Token-exact capture through the router: ask vLLM for ``return_token_ids``, give the client its own answer.

vLLM (0.10.2 and later) answers a request with ``"return_token_ids": true`` with the prompt's and the
output's token ids: a chat completion's top-level ``prompt_token_ids`` and each choice's ``token_ids``;
a completion's choices carry both; in a stream, the first chunk of each choice carries
``prompt_token_ids`` and every chunk its choice's new ``token_ids``. Without the flag vLLM still writes
those keys, as ``null``, at the same places. So the router asks for the ids on every request it may
capture, keeps the upstream bytes for capture, and hands the client the same bytes with each id list
turned back into ``null``: byte for byte what vLLM would have answered without the flag.

One more difference, in chat streams only: with the flag vLLM also sends a chunk for tokens its
reasoning or tool parser holds back (an empty ``delta``, no finish reason, no logprobs; without the
flag it sends nothing for them). Those chunks are dropped from the client's stream.

The edits are byte-level (a regular expression over the body or over a stream's complete lines),
never a JSON parse and re-serialisation: that would cost the hot path a parse per chunk and change
the bytes. A key inside a JSON string cannot match: a quote in a string is escaped (``\\"``).

Not asked for when the client sets ``echo`` (with the flag, vLLM's completions echo the prompt as
ids instead of text) or asks for the ids itself (then its answer is passed through as is).
"""

from __future__ import annotations

import json
import re

FIELD = "return_token_ids"
# An id list under either key. The pattern starts with a literal, which lets the regex engine
# search for it as a string (several times faster than a pattern that starts with a quote or a
# group); the lookbehinds then admit the two keys alone. vLLM writes compact JSON; _SPACED is the
# form of servers that put a space after ':' and ','. An id list never spans a line (JSON strings
# hold no raw newline and the patterns take none), so complete lines can be edited on their own.
_LB = rb'token_ids"(?:(?<="token_ids")|(?<="prompt_token_ids"))'
_IDS = re.compile(_LB + rb':\[[0-9,]*\]')
_SPACED = re.compile(_LB + rb': \[[0-9, ]*\]')
# The chat chunk vLLM sends only because of the flag: its delta is empty and nothing else is in it.
_HELD_BACK = b'"delta":{},"logprobs":null,"finish_reason":null,"token_ids":['


def wants_ids(payload: dict) -> bool:
    """Whether the router should ask the replica for token ids on this request (see the module doc)."""
    return not payload.get(FIELD) and not payload.get("echo")


def with_ids(raw: bytes, payload: dict) -> bytes:
    """``raw`` (the client's JSON object, already parsed as ``payload``) with ``"return_token_ids": true``.

    The field is appended before the object's closing brace, so the rest of the body reaches the
    replica unchanged; a body that already holds the key (false) is written again.
    """
    if FIELD in payload:
        return json.dumps({**payload, FIELD: True}).encode()  # ASCII: a lone surrogate stays an escape
    body = raw.rstrip()
    head = body[:-1].rstrip()
    sep = b"" if head.endswith(b"{") else b","
    return head + sep + b'"return_token_ids":true}'


def strip_json(body: bytes) -> bytes:
    """A JSON response with every id list written back as ``null``."""
    body, n = _IDS.subn(b'token_ids":null', body)
    if not n and b'token_ids": [' in body:  # not vLLM's compact form
        body = _SPACED.sub(b'token_ids": null', body)
    return body


def names_field(error_body: bytes) -> bool:
    """Whether an upstream's 400/422 names the field: the replica may not know it (not vLLM)."""
    return FIELD.encode() in error_body


class StreamStripper:
    """Strips a text/event-stream as it passes: :meth:`feed` each upstream chunk, send what it returns,
    then send :meth:`flush`. Only complete lines are edited; a partial one waits for its end.

    ``drop_held_back``: chat streams also lose the chunks that the flag alone made vLLM send.
    """

    __slots__ = ("tail", "drop_held_back", "skip_blank")

    def __init__(self, drop_held_back: bool) -> None:
        self.tail = b""
        self.drop_held_back = drop_held_back
        self.skip_blank = False

    def feed(self, chunk: bytes) -> bytes:
        if self.tail:
            chunk = self.tail + chunk
            self.tail = b""
        if not chunk.endswith(b"\n"):  # a line cut by the transport: its start waits for the rest
            cut = chunk.rfind(b"\n") + 1
            self.tail = chunk[cut:]
            chunk = chunk[:cut]
            if not chunk:
                return b""
        if self.skip_blank or (self.drop_held_back and b'"delta":{},' in chunk and _HELD_BACK in chunk):
            chunk = self._drop(chunk)
        return strip_json(chunk)

    def flush(self) -> bytes:
        rest, self.tail = self.tail, b""
        return self.feed(rest + b"\n")[:-1] if rest else b""

    def _drop(self, text: bytes) -> bytes:
        """``text`` without the held-back chunks' lines, and the blank line that ends each of those events."""
        kept: list[bytes] = []
        for line in text.splitlines(keepends=True):
            if self.skip_blank:
                self.skip_blank = False
                if not line.strip():
                    continue
            if _HELD_BACK in line:
                self.skip_blank = True
                continue
            kept.append(line)
        return b"".join(kept)

