"""Fast path for well-formed capture lines: typed decoding with msgspec, in C.

The reference decoder (:func:`capture.records.decode_line` + :func:`capture.formats.to_conversation`)
walks generic JSON with per-field Python checks so that it can name every kind of
bad input. Most lines are not bad, so this module first tries to decode a line
straight into typed structs of the common formats; the typed decoder validates
types in C. Whenever a line does not fit those shapes exactly, or would be
skipped, quarantined or need any judgement, :func:`fast_decode` returns ``None``
and the caller uses the reference path, which decides. Tests check that the two
agree on every line the fast path accepts.

msgspec is present wherever vLLM is installed; without it the reference path runs alone.
"""

from __future__ import annotations

import base64
import binascii
import re
from typing import Any, Union

from capture.formats import ROLE_MAP, Conversation, sampling_ok
from capture.records import CaptureRecord, Payload, parse_time

try:
    import msgspec
except ImportError:  # pragma: no cover - exercised only where vLLM (and so msgspec) is absent
    msgspec = None

AVAILABLE = msgspec is not None

if AVAILABLE:
    from msgspec import UNSET, UnsetType

    class Struct(msgspec.Struct, gc=False):
        """Decoded JSON holds no reference cycles, so the cyclic GC need not track these."""

    class _Side(Struct):
        data: str
        encoding: Union[str, None] = None
        observedContentType: Union[str, None] = None

    class _Cap(Struct):
        endpointInput: _Side
        endpointOutput: _Side

    class _Meta(Struct):
        eventId: Union[str, None] = None
        inferenceId: Union[str, None] = None
        inferenceTime: Union[str, None] = None

    class _Line(Struct):
        captureData: _Cap
        eventMetadata: Union[_Meta, None] = None

    class _Msg(Struct):
        role: str
        content: str

    class _Params(Struct):
        temperature: Union[float, None] = None
        top_p: Union[float, None] = None
        max_tokens: Union[int, None] = None
        max_completion_tokens: Union[int, None] = None
        max_new_tokens: Union[int, None] = None

    # kw_only: required fields after the optional ones they inherit.
    class _ChatReq(_Params, kw_only=True):
        messages: list[_Msg]
        model: Union[str, None] = None

    class _CompletionReq(_Params, kw_only=True):
        prompt: str
        model: Union[str, None] = None

    class _TgiReq(Struct):
        inputs: str
        parameters: Union[_Params, None] = None
        model: Union[str, None] = None

    class _DialogsReq(Struct):
        inputs: list[list[_Msg]]
        parameters: Union[_Params, None] = None
        model: Union[str, None] = None

    class _DialogReq(Struct):
        inputs: list[_Msg]
        parameters: Union[_Params, None] = None
        model: Union[str, None] = None

    class _RespMsg(Struct):
        content: str

    class _Choice(Struct):
        message: Union[_RespMsg, None] = None
        text: Union[str, None] = None

    class _Resp(Struct):
        choices: list[_Choice]
        model: Union[str, None] = None
        object: Union[str, None] = None
        error: Union[Any, UnsetType] = UNSET

    class _Delta(Struct):
        content: Union[str, None] = None

    class _StreamChoice(Struct):
        index: int = 0
        delta: Union[_Delta, None] = None
        text: Union[str, None] = None

    class _Chunk(Struct):
        choices: Union[list[_StreamChoice], None] = None
        model: Union[str, None] = None
        error: Union[Any, UnsetType] = UNSET
        token: Union[Any, UnsetType] = UNSET
        generated_text: Union[Any, UnsetType] = UNSET

    class _GenMsg(Struct):
        content: str

    class _Gen(Struct):
        generated_text: Union[str, UnsetType] = UNSET
        generation: Union[_GenMsg, str, UnsetType] = UNSET
        error: Union[Any, UnsetType] = UNSET

    _D = msgspec.json.Decoder
    _line_dec = _D(_Line)
    _chat_dec, _completion_dec = _D(_ChatReq), _D(_CompletionReq)
    _tgi_dec, _dialogs_dec, _dialog_dec = _D(_TgiReq), _D(_DialogsReq), _D(_DialogReq)
    _resp_dec, _chunks_dec, _gen_dec = _D(_Resp), _D(list[_Chunk]), _D(Union[list[_Gen], _Gen])
    _Invalid = (msgspec.DecodeError, msgspec.ValidationError, RecursionError, ValueError)


class _Decline(Exception):
    """Not for the fast path: let the reference decoder decide."""


def _payload(side: "_Side") -> Payload:
    enc = (side.encoding or "JSON").upper()
    if enc == "JSON":
        text = side.data
    elif enc == "BASE64":
        try:
            text = base64.b64decode(side.data, validate=True).decode("utf-8")
        except (binascii.Error, ValueError):
            raise _Decline from None
    else:
        raise _Decline  # CSV (tabular) and unknown encodings
    if "\x00" in text:
        raise _Decline
    return Payload(text=text, content_type=side.observedContentType, encoding=enc)


_FROM: dict[str, str | None] = {}  # role as sent → ShareGPT "from" (memo of ROLE_MAP[role.lower()])


def _from(role: str) -> str | None:
    frm = _FROM.get(role, _FROM)
    if frm is _FROM:
        frm = ROLE_MAP.get(role.lower())
        if len(_FROM) < 256:  # capped against hostile input
            _FROM[role] = frm
    return frm


def _turns(msgs: list) -> tuple[list[tuple[str, str]], bool]:
    """Turns of role/content messages, and whether one is the user's."""
    turns = []
    human = False
    for m in msgs:
        frm = _from(m.role)
        if frm is None or not m.content:
            raise _Decline  # unknown roles and empty content (tool calls) need the reference rules
        human = human or frm == "human"
        turns.append((frm, m.content))
    return turns, human


def _max_tokens(p: Any) -> int | None:
    if p is None:
        return None
    for v in (p.max_tokens, p.max_completion_tokens, p.max_new_tokens):
        if v is not None:
            if not -(1 << 63) <= v < 1 << 63:
                raise _Decline  # the reference skips it for the next key
            return v
    return None


_SSE_HEAD, _SSE_SEP, _SSE_TAIL = "data: ", "\n\ndata: ", "\n\ndata: [DONE]\n\n"


def _canonical_sse(text: str) -> str | None:
    """``data: c0⏎⏎data: c1 … ⏎⏎data: [DONE]⏎⏎`` (what servers write) → ``[c0,c1,…]``, else ``None``.

    One replace instead of a split and a strip per event. The JSON array is the one the
    reference parser builds, as long as every line break was a separator: the reference
    reads line by line, and JSON allows "\r" between tokens and U+0085/U+2028/U+2029 raw
    in strings, so text holding one of those is left to the general parser below.
    """
    if not (text.startswith(_SSE_HEAD) and text.endswith(_SSE_TAIL)):
        return None
    arr = "[" + text[len(_SSE_HEAD):-len(_SSE_TAIL)].replace(_SSE_SEP, ",") + "]"
    if "\n" in arr or "\r" in arr or (not arr.isascii() and ("\x85" in arr or "\u2028" in arr or "\u2029" in arr)):
        return None
    return arr


def _stream(text: str) -> tuple[str, str | None]:
    arr = _canonical_sse(text)
    chunks = _chunks_dec.decode(arr if arr is not None else _sse_array(text))
    out = []
    model = None
    for ch in chunks:
        if ch.error is not UNSET or ch.token is not UNSET or ch.generated_text is not UNSET:
            raise _Decline  # error events and TGI token streams
        if ch.model is not None:
            model = ch.model
        for c in ch.choices or ():
            if c.index != 0:
                continue
            d = c.delta
            if d is not None:
                if d.content is not None:
                    out.append(d.content)
            elif c.text is not None:
                out.append(c.text)
    return "".join(out), model


def _sse_array(text: str) -> str:
    """The JSON array of an SSE body's ``data:`` events as the reference parser builds it."""
    # Split on "data:" in C instead of walking lines in Python. Safe only when every
    # "data:" starts a line, no chunk spans lines and there are no other SSE fields;
    # anything else is declined.
    n = text.count("data:")
    if n == 0 or n != text.count("\ndata:") + text.lstrip().startswith("data:"):
        raise _Decline
    segs = text.split("data:")
    if segs[0].strip() or "\n:" in text or "\nevent:" in text or "\nid:" in text or "\nretry:" in text:
        raise _Decline
    parts = [p.strip() for p in segs[1:]]
    if "[DONE]" in parts:
        parts = parts[: parts.index("[DONE]")]
    parts = [p for p in parts if p]
    if not parts:
        raise _Decline
    joined = ",".join(parts)
    # The reference parser splits on every str.splitlines() break; JSON allows "\r\n"
    # between tokens and U+2028 raw inside strings, so a chunk holding one is declined.
    if len(joined.splitlines()) != 1:
        raise _Decline
    return "[" + joined + "]"


def _openai_answer(text: str, ct: str | None, chat: bool) -> tuple[str, str | None]:
    if _looks_sse(text, ct):
        return _stream(text)
    r = _resp_dec.decode(text)
    if r.error is not UNSET or r.object == "error" or not r.choices:
        raise _Decline
    c = r.choices[0]
    if chat:
        if c.message is None:
            raise _Decline
        return c.message.content, r.model
    if c.text is None:
        raise _Decline
    return c.text, r.model


def _tgi_answer(text: str, ct: str | None) -> str:
    if _looks_sse(text, ct):
        raise _Decline
    g = _gen_dec.decode(text)
    if isinstance(g, list):
        if not g:
            raise _Decline
        g = g[0]
    if g.error is not UNSET:
        raise _Decline
    if g.generated_text is not UNSET:
        return g.generated_text
    if isinstance(g.generation, str):
        return g.generation
    if g.generation is not UNSET:
        return g.generation.content
    raise _Decline


_SSE_CT: dict[str, bool] = {}


def _looks_sse(text: str, ct: str | None) -> bool:
    if ct:
        sse = _SSE_CT.get(ct)
        if sse is None:
            sse = "event-stream" in ct.lower()
            if len(_SSE_CT) < 256:
                _SSE_CT[ct] = sse
        if sse:
            return True
    return text.lstrip()[:6].startswith("data:")


# A \u escape of a printable ASCII character can spell a key ("m\u0065ssages") that the
# substring dispatch below would not see, while the reference decoder would.
_ASCII_ESCAPE = re.compile(r"\\u00[2-7][0-9a-fA-F]")


def escapes_ascii(text: str) -> bool:
    """True if ``text`` (JSON) holds a \\u escape of a printable ASCII character."""
    return "\\" in text and "\\u00" in text and _ASCII_ESCAPE.search(text) is not None


# What one exchange yields: turns, format, raw, model, temperature, top_p, max_tokens.
Exchange = tuple[list[tuple[str, str]], str, bool, Union[str, None], Union[float, None], Union[float, None],
                 Union[int, None]]


def exchange(req_text: str, resp_text: str, resp_ct: str | None) -> Exchange:
    """The conversation of one exchange of a common format, as a plain tuple; raises to decline."""
    head = req_text.lstrip()[:1]
    if head != "{" or escapes_ascii(req_text):
        raise _Decline
    if '"messages"' in req_text:
        r = _chat_dec.decode(req_text)
        if not r.messages:
            raise _Decline
        turns, human = _turns(r.messages)
        answer, model = _openai_answer(resp_text, resp_ct, chat=True)
        out = (turns, "openai_chat", False, r.model if r.model is not None else model, r.temperature, r.top_p,
               _max_tokens(r))
    elif '"prompt"' in req_text:
        r = _completion_dec.decode(req_text)
        answer, model = _openai_answer(resp_text, resp_ct, chat=False)
        human = True
        out = ([("human", r.prompt)], "openai_completion", True, r.model if r.model is not None else model,
               r.temperature, r.top_p, _max_tokens(r))
    elif '"inputs"' in req_text:
        after = req_text.split('"inputs"', 1)[1].lstrip().lstrip(":").lstrip()[:2]
        if after[:1] == '"':
            r = _tgi_dec.decode(req_text)
            answer = _tgi_answer(resp_text, resp_ct)
            if r.inputs and answer.startswith(r.inputs):
                answer = answer[len(r.inputs):]
            (turns, human), fmt, raw = ([("human", r.inputs)], True), "tgi", True
        elif after == "[[" or after.replace(" ", "")[:2] == "[[":
            r = _dialogs_dec.decode(req_text)
            if len(r.inputs) != 1:
                raise _Decline
            (turns, human), fmt, raw = _turns(r.inputs[0]), "jumpstart_chat", False
            answer = _tgi_answer(resp_text, resp_ct)
        else:
            r = _dialog_dec.decode(req_text)
            (turns, human), fmt, raw = _turns(r.inputs), "jumpstart_chat", False
            answer = _tgi_answer(resp_text, resp_ct)
        p = r.parameters
        out = (turns, fmt, raw, r.model, p.temperature if p else None, p.top_p if p else None, _max_tokens(p))
    else:
        raise _Decline
    if not answer or answer.isspace() or not human:  # isspace: "not answer.strip()" without the copy
        raise _Decline
    if not (sampling_ok("temperature", out[4]) and sampling_ok("top_p", out[5])):
        raise _Decline  # the reference quarantines it
    turns = out[0]
    turns.append(("gpt", answer))
    for _, v in turns:
        if "\x00" in v:
            raise _Decline
    return out


def _conversation(req_text: str, resp_text: str, resp_ct: str | None) -> Conversation:
    turns, fmt, raw, model, temperature, top_p, max_tokens = exchange(req_text, resp_text, resp_ct)
    return Conversation(turns=turns, format=fmt, raw=raw, model=model, temperature=temperature, top_p=top_p,
                        max_tokens=max_tokens)


def fast_decode(line: bytes) -> tuple[CaptureRecord, Conversation] | None:
    """Decode a common, well-formed capture line; ``None`` means "use the reference path"."""
    if not AVAILABLE:
        return None
    try:
        rec = _line_dec.decode(line)
        cap = rec.captureData
        req, resp = _payload(cap.endpointInput), _payload(cap.endpointOutput)
        if req.content_type and req.content_type.split(";")[0].strip().lower() == "text/csv":
            raise _Decline
        conv = _conversation(req.text, resp.text, resp.content_type)
    except (_Decline, *_Invalid):
        return None
    meta = rec.eventMetadata
    record = CaptureRecord(
        event_id=meta.eventId if meta else None,
        inference_id=meta.inferenceId if meta else None,
        inference_time=parse_time(meta.inferenceTime) if meta else None,
        request=req,
        response=resp,
    )
    return record, conv
