"""Batch path: a chunk of capture lines → columns, with the reference decoder as the arbiter.

The reference decoder (:func:`capture.records.decode_line` + :func:`capture.formats.to_conversation`)
walks generic JSON with per-field Python checks so that it can name every kind of bad
input. Most lines are not bad, so this module decodes a chunk of lines straight into
typed structs of the common formats and appends the rows to columns. Every line it cannot
decide exactly as the reference would (bad JSON, odd shapes, quarantines, anything but the
common formats and tabular CSV) is returned by index, and the caller hands it to the
reference, which decides. Tests check that both give identical tables.

Two implementations of the same rules (:mod:`capture.rules`) do the decoding:

* the C decoder of :mod:`capture.native` (:func:`decode_chunk`; :func:`decode_block` takes a
  block of raw lines and splits them in C), which writes Arrow buffers directly;
* msgspec's typed decoders in a Python loop (:func:`decode_chunk_msgspec`), the fallback
  where the native module is unavailable and the oracle the C decoder is tested against: every
  line both decide comes out alike. Whole exchanges (reasoning, tool calls, token ids: the
  :data:`STRUCTURED` columns) only the C decoder decides; this loop declines them to the
  reference, and the tests compare the C decoder's rows of them with the reference's.

Which one runs is :mod:`capture.backend`'s choice.
"""

from __future__ import annotations

import base64
import binascii
import gc
import re
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Union

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from msgspec import UNSET, UnsetType

from capture import backend, native, rules
from capture.dedupe import HashSet
from capture.records import parse_time
from capture.warehouse import SCHEMA, TURN

# The columns a decoded line yields (typed as in the warehouse); capture.ingest adds hashes and provenance.
ROW_SCHEMA = pa.schema([SCHEMA.field(name) for name in (
    "line_no", "conversations", "event_id", "inference_id", "inference_time", "format", "raw", "model",
    "temperature", "top_p", "max_tokens", "messages", "tools", "tool_choice", "chat_template_kwargs", "finish_reason",
    "prompt_token_ids", "output_token_ids", "dt")])
# The whole exchange (see capture.formats.Answer): filled by the reference and the C decoder; the
# msgspec path declines every exchange the reference keeps whole, so it leaves them null.
STRUCTURED = ("messages", "tools", "tool_choice", "chat_template_kwargs", "prompt_token_ids", "output_token_ids")


# ---- the msgspec path: typed structs of the common formats ---------------------------------


class Struct(msgspec.Struct, gc=False):
    """Decoded JSON holds no reference cycles, so the cyclic GC need not track these."""


class _Side(Struct):
    data: str
    encoding: Union[str, None] = None
    observedContentType: Union[str, None] = None


class _Cap(Struct):
    endpointInput: _Side
    # Optional so that tabular lines without output are decided (skipped) here.
    endpointOutput: Union[_Side, None] = None


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


class _ChatMsg(Struct, forbid_unknown_fields=True):
    """A chat message the fast paths take: role/content only (tool_calls, names, reasoning and
    the like are the reference's, which keeps the messages as sent)."""

    role: str
    content: str


class _Params(Struct):
    temperature: Union[float, None] = None
    top_p: Union[float, None] = None
    max_tokens: Union[int, None] = None
    max_completion_tokens: Union[int, None] = None
    max_new_tokens: Union[int, None] = None


# The struct reads every key the rules take a token budget from.
assert set(rules.MAX_TOKENS_KEYS) <= set(_Params.__struct_fields__), rules.MAX_TOKENS_KEYS


# kw_only: required fields after the optional ones they inherit.
class _ChatReq(_Params, kw_only=True):
    messages: list[_ChatMsg]
    model: Union[str, None] = None
    # Present and not null: the reference keeps the exchange whole; declined here.
    tools: Any = None
    tool_choice: Any = None
    chat_template_kwargs: Any = None


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
    reasoning: Any = None
    reasoning_content: Any = None
    tool_calls: Any = None  # null or [] (vLLM's answer without calls); anything else is declined


class _Choice(Struct):
    message: Union[_RespMsg, None] = None
    text: Union[str, None] = None
    finish_reason: Union[str, None] = None
    token_ids: Any = None
    prompt_token_ids: Any = None


class _Resp(Struct):
    choices: list[_Choice]
    prompt_token_ids: Any = None
    model: Union[str, None] = None
    object: Union[str, None] = None
    error: Union[Any, UnsetType] = UNSET


class _Delta(Struct):
    content: Union[str, None] = None
    reasoning: Any = None
    reasoning_content: Any = None
    tool_calls: Any = None


class _StreamChoice(Struct):
    index: int = 0
    delta: Union[_Delta, None] = None
    text: Union[str, None] = None
    finish_reason: Union[str, None] = None
    token_ids: Any = None
    prompt_token_ids: Any = None


class _Chunk(Struct):
    choices: Union[list[_StreamChoice], None] = None
    prompt_token_ids: Any = None
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
    """Not for this path: the reference decoder decides."""


_FROM: dict[str, str | None] = {}  # role as sent → ShareGPT "from" (memo of ROLE_MAP[role.lower()])


def _from(role: str) -> str | None:
    frm = _FROM.get(role, _FROM)
    if frm is _FROM:
        frm = rules.ROLE_MAP.get(role.lower())
        if len(_FROM) < 256:  # capped against hostile input
            _FROM[role] = frm
    return frm


def _turns(msgs: list, chat: bool = False) -> tuple[list[tuple[str, str]], bool]:
    """Turns of role/content messages, and whether one is the user's."""
    turns = []
    human = False
    for m in msgs:
        frm = _from(m.role)
        if frm is None or not m.content:
            raise _Decline  # unknown roles and empty content (tool calls) need the reference rules
        if chat and m.role not in rules.PLAIN_ROLES:
            raise _Decline  # tool, developer, ...: the reference keeps the messages as sent
        human = human or frm == rules.HUMAN
        turns.append((frm, m.content))
    return turns, human


def _max_tokens(p: Any) -> int | None:
    if p is None:
        return None
    for key in rules.MAX_TOKENS_KEYS:
        v = getattr(p, key)
        if v is not None:
            if not -(1 << 63) <= v < 1 << 63:
                raise _Decline  # the reference skips it for the next key
            return v
    return None


def canonical_sse(text: str) -> str | None:
    """A stream in the canonical form (:data:`capture.rules.SSE_HEAD` …) → ``[c0,c1,…]``, else ``None``.

    One replace instead of a split and a strip per event. The JSON array is the one the
    reference parser builds, as long as every line break was a separator: the reference
    reads line by line, and JSON allows "\\r" between tokens and U+0085/U+2028/U+2029 raw
    in strings, so text holding one of those is left to the general parser below.
    """
    if not (text.startswith(rules.SSE_HEAD) and text.endswith(rules.SSE_TAIL)):
        return None
    arr = "[" + text[len(rules.SSE_HEAD):-len(rules.SSE_TAIL)].replace(rules.SSE_SEP, ",") + "]"
    if "\n" in arr or "\r" in arr or (not arr.isascii() and ("\x85" in arr or "\u2028" in arr or "\u2029" in arr)):
        return None
    return arr


def _stream(text: str) -> tuple[str, str | None, str | None]:
    arr = canonical_sse(text)
    chunks = _chunks_dec.decode(arr if arr is not None else _sse_array(text))
    out = []
    model = finish = None
    for ch in chunks:
        if ch.error is not UNSET or ch.token is not UNSET or ch.generated_text is not UNSET:
            raise _Decline  # error events and TGI token streams
        if ch.prompt_token_ids is not None:
            raise _Decline  # token ids: the reference's
        if ch.model is not None:
            model = ch.model
        for c in ch.choices or ():
            if c.token_ids is not None or c.prompt_token_ids is not None:
                raise _Decline
            d = c.delta
            if d is not None and (d.reasoning is not None or d.reasoning_content is not None
                                  or d.tool_calls is not None):
                raise _Decline  # reasoning and tool calls: the reference keeps them
            if c.index != 0:
                continue
            if c.finish_reason is not None:
                finish = c.finish_reason
            if d is not None:
                if d.content is not None:
                    out.append(d.content)
            elif c.text is not None:
                out.append(c.text)
    return "".join(out), model, finish


# Line breaks to str.splitlines(), which the reference parser reads SSE lines with, besides "\n".
_OTHER_BREAKS = ("\r", "\v", "\f", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029")


def _sse_array(text: str) -> str:
    """The JSON array of an SSE body's data events as the reference parser builds it."""
    # Split on the data field in C instead of walking lines in Python. Safe only when every
    # data field starts a line, no chunk spans lines, every line ends at "\n" (a "\r" or
    # another break would start a line where the reference reads one) and there are no other
    # SSE fields; anything else is declined.
    if any(b in text for b in _OTHER_BREAKS):
        raise _Decline
    data = rules.SSE_DATA
    n = text.count(data)
    if n == 0 or n != text.count("\n" + data) + text.lstrip().startswith(data):
        raise _Decline
    segs = text.split(data)
    if segs[0].strip() or "\n:" in text or "\nevent:" in text or "\nid:" in text or "\nretry:" in text:
        raise _Decline
    parts = [p.strip() for p in segs[1:]]
    if rules.SSE_DONE in parts:
        parts = parts[: parts.index(rules.SSE_DONE)]
    parts = [p for p in parts if p]
    if not parts:
        raise _Decline
    joined = ",".join(parts)
    # The reference parser splits on every str.splitlines() break; JSON allows "\r\n"
    # between tokens and U+2028 raw inside strings, so a chunk holding one is declined.
    if len(joined.splitlines()) != 1:
        raise _Decline
    return "[" + joined + "]"


def _openai_answer(text: str, ct: str | None, chat: bool) -> tuple[str, str | None, str | None]:
    """The answer's text, the model and the finish reason."""
    if rules.looks_sse(text, ct):
        return _stream(text)
    r = _resp_dec.decode(text)
    if r.error is not UNSET or r.object == "error" or not r.choices:
        raise _Decline
    c = r.choices[0]
    if r.prompt_token_ids is not None or c.token_ids is not None or c.prompt_token_ids is not None:
        raise _Decline  # token ids: the reference's
    if chat:
        m = c.message
        if m is None:
            raise _Decline
        if m.reasoning is not None or m.reasoning_content is not None or not (
                m.tool_calls is None or (type(m.tool_calls) is list and not m.tool_calls)):
            raise _Decline  # reasoning and tool calls: the reference keeps them
        return m.content, r.model, c.finish_reason
    if c.text is None:
        raise _Decline
    return c.text, r.model, c.finish_reason


def _tgi_answer(text: str, ct: str | None) -> str:
    if rules.looks_sse(text, ct):
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


# A \u escape of a printable ASCII character can spell a key ("m\u0065ssages") that the
# substring dispatch below would not see, while the reference decoder would. The C decoder
# has this scan in its own inner loop (escapes_ascii in capture.c); a test pins the two equal.
_ASCII_ESCAPE = re.compile(r"\\u00[2-7][0-9a-fA-F]")


def escapes_ascii(text: str) -> bool:
    """True if ``text`` (JSON) holds a \\u escape of a printable ASCII character."""
    return "\\" in text and "\\u00" in text and _ASCII_ESCAPE.search(text) is not None


# What one exchange yields: turns, format, raw, model, temperature, top_p, max_tokens, finish_reason.
Exchange = tuple[list[tuple[str, str]], str, bool, Union[str, None], Union[float, None], Union[float, None],
                 Union[int, None], Union[str, None]]


def exchange(req_text: str, resp_text: str, resp_ct: str | None) -> Exchange:
    """The conversation of one exchange of a common format, as a plain tuple; raises to decline."""
    head = req_text.lstrip()[:1]
    if head != "{" or escapes_ascii(req_text):
        raise _Decline
    if '"messages"' in req_text:
        r = _chat_dec.decode(req_text)
        if not r.messages or r.tools is not None or r.tool_choice is not None or r.chat_template_kwargs is not None:
            raise _Decline
        turns, human = _turns(r.messages, chat=True)
        answer, model, finish = _openai_answer(resp_text, resp_ct, chat=True)
        out = (turns, rules.OPENAI_CHAT, False, r.model if r.model is not None else model, r.temperature, r.top_p,
               _max_tokens(r), finish)
    elif '"prompt"' in req_text:
        r = _completion_dec.decode(req_text)
        answer, model, finish = _openai_answer(resp_text, resp_ct, chat=False)
        human = True
        out = ([(rules.HUMAN, r.prompt)], rules.OPENAI_COMPLETION, True, r.model if r.model is not None else model,
               r.temperature, r.top_p, _max_tokens(r), finish)
    elif '"inputs"' in req_text:
        after = req_text.split('"inputs"', 1)[1].lstrip().lstrip(":").lstrip()[:2]
        if after[:1] == '"':
            r = _tgi_dec.decode(req_text)
            answer = _tgi_answer(resp_text, resp_ct)
            if r.inputs and answer.startswith(r.inputs):
                answer = answer[len(r.inputs):]
            (turns, human), fmt, raw = ([(rules.HUMAN, r.inputs)], True), rules.TGI, True
        elif after == "[[" or after.replace(" ", "")[:2] == "[[":
            r = _dialogs_dec.decode(req_text)
            if len(r.inputs) != 1:
                raise _Decline
            (turns, human), fmt, raw = _turns(r.inputs[0]), rules.JUMPSTART_CHAT, False
            answer = _tgi_answer(resp_text, resp_ct)
        else:
            r = _dialog_dec.decode(req_text)
            (turns, human), fmt, raw = _turns(r.inputs), rules.JUMPSTART_CHAT, False
            answer = _tgi_answer(resp_text, resp_ct)
        p = r.parameters
        out = (turns, fmt, raw, r.model, p.temperature if p else None, p.top_p if p else None, _max_tokens(p), None)
    else:
        raise _Decline
    if not answer or answer.isspace() or not human:  # isspace: "not answer.strip()" without the copy
        raise _Decline
    if not (rules.sampling_ok("temperature", out[4]) and rules.sampling_ok("top_p", out[5])):
        raise _Decline  # the reference quarantines it
    turns = out[0]
    turns.append((rules.GPT, answer))
    for _, v in turns:
        if "\x00" in v:
            raise _Decline
    return out


def _text(side: _Side, kind: str) -> str | None:
    """A payload's text as the reference decodes it, or ``None`` where it would quarantine."""
    if kind == rules.JSON or kind == rules.CSV:
        text = side.data
    elif kind == rules.BASE64:
        try:
            text = base64.b64decode(side.data, validate=True).decode("utf-8")
        except (binascii.Error, ValueError):
            return None
    else:
        return None
    return None if "\x00" in text else text


def _valid_utf8(line: bytes) -> bool:
    try:
        line.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


@contextmanager
def _gc_paused() -> Iterator[None]:
    # A chunk allocates millions of small objects that all stay alive until its end, so
    # each automatic collection would walk them all again for nothing: pause it.
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@dataclass
class Chunk:
    """What the batch path made of a chunk of lines."""

    batch: pa.RecordBatch
    declined: list[int] = field(default_factory=list)  # chunk indices for the per-line path
    skips: Counter = field(default_factory=Counter)
    # decode_block only: the declined lines' bytes (parallel to ``declined``), how many
    # lines the chunk took from the block, and the block offset after the last of them.
    declined_lines: list[bytes] = field(default_factory=list)
    lines: int = 0
    end: int = 0
    # decode_block with ``seen`` (native only): each row's content hash, the rows dropped as
    # copies of an earlier one (whose hash was in ``seen``), and the rows kept that did not
    # go into ``seen`` (so that a later copy of them may be in the batch).
    hashes: pa.Array | None = None
    duplicates: int = 0
    unchecked: int = 0


def _decode_outer(lines: list[bytes], max_line: int) -> list[_Line | None]:
    dec = _line_dec.decode
    if max(map(len, lines), default=0) <= max_line:
        try:
            return [dec(line) for line in lines]
        except _Invalid:
            pass  # some line is bad: find which, one by one
    out: list[_Line | None] = []
    for line in lines:
        if len(line) > max_line:
            out.append(None)
            continue
        try:
            out.append(dec(line))
        except _Invalid:
            out.append(None)
    return out


def decode_chunk(lines: list[bytes], first_line_no: int, max_line: int, hour: datetime | None) -> Chunk:
    """Decode ``lines`` (numbered from ``first_line_no``); declined ones come back by index."""
    nat = backend.native()
    if nat is not None:
        try:
            return _decode_chunk_native(nat, lines, first_line_no, max_line, hour)
        except MemoryError:
            pass  # a chunk beyond Arrow's 2 GiB string offsets (or memory): the msgspec loop copes
    return decode_chunk_msgspec(lines, first_line_no, max_line, hour)


def decode_block(block: bytes | memoryview, start: int, first_line_no: int, max_lines: int, max_line: int,
                 hour: datetime | None, seen: HashSet | None = None) -> Chunk:
    """:func:`decode_chunk` of up to ``max_lines`` lines of a buffer of whole lines, from byte ``start`` on.

    Lines are split as :func:`capture.sources.iter_lines` splits them: at ``\\n``, which is
    not part of the line; the block's last line may lack it. The native decoder finds the
    lines itself, so no Python object is made per line; only the declined ones come back,
    as bytes in ``declined_lines``. ``lines`` and ``end`` say how far the chunk got.

    With ``seen`` (a file's hashes so far), the native decoder also hashes each row and drops
    the copies of rows in ``seen`` before they reach a column (dropping them later copies the
    table); rows it cannot vouch for stay, and the caller's dedupe decides them. Without the
    native module ``seen`` is not used.
    """
    nat = backend.native()
    if nat is not None:
        table = seen.native_table(min(max_lines, (len(block) - start) // 256 + 1)) if seen is not None else None
        try:
            if table is None:
                out = nat.decode_block(block, start, max_lines, max_line)
            else:
                out = nat.decode_block(block, start, max_lines, max_line, *table, hour is not None)
        except MemoryError:
            pass  # as in decode_chunk: the msgspec loop copes
        else:
            if table is not None:
                seen.added(out["inserted"])
            got = _native_chunk(out, first_line_no, hour)
            starts = np.frombuffer(out["starts"], dtype=np.int64)
            got.declined_lines = [_line_at(block, int(starts[i]), int(starts[i + 1])) for i in got.declined]
            got.lines, got.end = out["lines"], out["end"]
            return got
    lines, end = split_block(block, start, max_lines)
    got = decode_chunk_msgspec(lines, first_line_no, max_line, hour)
    got.lines, got.end = len(lines), end
    return got


def _line_at(block: bytes | memoryview, a: int, b: int) -> bytes:
    """Line ``block[a:b]`` without its newline (only a block's last line may lack one)."""
    if b > a and block[b - 1] == 10:
        b -= 1
    return bytes(block[a:b])


def split_block(block: bytes | memoryview, start: int, max_lines: int) -> tuple[list[bytes], int]:
    """Up to ``max_lines`` lines of ``block`` from byte ``start`` on, and the offset after the last of them."""
    if max_lines <= 0:
        return [], start
    data = bytes(block[start:]) if start or not isinstance(block, bytes) else block
    lines = data.split(b"\n", max_lines)
    if len(lines) > max_lines:
        rest = lines.pop()  # the lines after the first max_lines
        return lines, len(block) - len(rest)
    if lines[-1] == b"":
        lines.pop()  # the block ends with a newline (or holds nothing): no empty line after it
    return lines, len(block)


def _decode_chunk_native(nat, lines: list[bytes], first_line_no: int, max_line: int,
                         hour: datetime | None) -> Chunk:
    got = _native_chunk(nat.decode_chunk(lines if type(lines) is list else list(lines), max_line), first_line_no, hour)
    got.declined_lines = [lines[i] for i in got.declined]
    return got


def _native_chunk(out: dict, first_line_no: int, hour: datetime | None) -> Chunk:
    """A chunk from the native decoder's buffers."""
    n = out["rows"]
    declined: list[int] = out["declined"]
    skips: Counter = Counter()
    if out["skips"]:
        skips["not_llm_traffic"] = out["skips"]
    idx = np.frombuffer(out["index"], dtype=np.int64)
    when = parse_times(_utf8(n, out["inference_time"]))
    if when.null_count and hour is not None:
        when = when.fill_null(pa.scalar(hour, when.type))
    turns = pa.StructArray.from_arrays([_utf8(out["turns"], out["from"]), _utf8(out["turns"], out["value"])],
                                       fields=list(TURN))
    cols = {name: _utf8(n, out[name]) for name in ("event_id", "inference_id", "format", "model", "finish_reason",
                                                   "messages", "tools", "tool_choice", "chat_template_kwargs")}
    for name in ("prompt_token_ids", "output_token_ids"):
        offsets, values, validity, nulls = out[name]
        cols[name] = pa.Array.from_buffers(
            ROW_SCHEMA.field(name).type, n, [pa.py_buffer(validity) if nulls else None, pa.py_buffer(offsets)], nulls,
            children=[pa.Array.from_buffers(pa.int32(), len(values) // 4, [None, pa.py_buffer(values)])])
    for name in ("temperature", "top_p", "max_tokens"):
        values, validity, nulls = out[name]
        cols[name] = pa.Array.from_buffers(ROW_SCHEMA.field(name).type, n,
                                           [pa.py_buffer(validity) if nulls else None, pa.py_buffer(values)], nulls)
    cols["raw"] = pa.Array.from_buffers(pa.bool_(), n, [None, pa.py_buffer(out["raw"])])
    # from_buffers, not pa.array: pa.array imports pandas (~0.14 s of CPU per worker process).
    batch = rows_batch(line_no=pa.Array.from_buffers(pa.int64(), n, [None, pa.py_buffer(idx + first_line_no)]),
                       offsets=pa.Array.from_buffers(pa.int32(), n + 1, [None, pa.py_buffer(out["conv_offsets"])]),
                       turns=turns, inference_time=when, **cols)
    hashes = None
    if "hashes" in out:
        hashes = pa.StringArray.from_buffers(n, pa.py_buffer(np.arange(0, 32 * (n + 1), 32, dtype=np.int32)),
                                             pa.py_buffer(out["hashes"]))
    if when.null_count:
        # No time and no layout hour: the reference quarantines these; let it.
        valid = pc.is_valid(when)
        declined = sorted(declined + idx[~valid.to_numpy(zero_copy_only=False)].tolist())
        batch = batch.filter(valid)
        hashes = hashes.filter(valid) if hashes is not None else None
    return Chunk(batch=batch, declined=declined, skips=skips, hashes=hashes, duplicates=out.get("duplicates", 0),
                 unchecked=out.get("unchecked", 0))


def _utf8(n: int, col: tuple) -> pa.Array:
    """A string array from the native decoder's (offsets, data, validity, null count)."""
    offsets, data, validity, nulls = col
    return pa.Array.from_buffers(pa.string(), n, [pa.py_buffer(validity) if nulls else None, pa.py_buffer(offsets),
                                                  pa.py_buffer(data)], nulls)


def decode_chunk_msgspec(lines: list[bytes], first_line_no: int, max_line: int, hour: datetime | None) -> Chunk:
    """:func:`decode_chunk` with msgspec's typed decoders in a Python loop (the reference of the native path)."""
    declined: list[int] = []
    skips: Counter = Counter()
    cols: dict[str, list] = {k: [] for k in ("idx", "event_id", "inference_id", "time", "format", "raw", "model",
                                             "temperature", "top_p", "max_tokens", "finish_reason", "n_turns")}
    idx, ev, inf, tm = cols["idx"], cols["event_id"], cols["inference_id"], cols["time"]
    fmt, raw, model, temp, top_p, max_tok, n_turns = (cols[k] for k in ("format", "raw", "model", "temperature",
                                                                       "top_p", "max_tokens", "n_turns"))
    finish = cols["finish_reason"]
    turns: list[tuple[str, str]] = []
    with _gc_paused():
        recs = _decode_outer(lines, max_line)
        for i, rec in enumerate(recs):
            if rec is None:
                declined.append(i)
                continue
            cap = rec.captureData
            inp, out = cap.endpointInput, cap.endpointOutput
            # Sides as the reference decodes them (inlined for the usual JSON encoding).
            enc = inp.encoding
            if enc is None or enc == rules.JSON:
                ikind, req = rules.JSON, inp.data
                if "\x00" in req:
                    req = None
            else:
                ikind = rules.encoding_of(enc)
                req = _text(inp, ikind)
            resp = None
            if out is not None:
                enc = out.encoding
                if enc is None or enc == rules.JSON:
                    resp = out.data
                    if "\x00" in resp:
                        resp = None
                else:
                    resp = _text(out, rules.encoding_of(enc))
                if resp is None:
                    declined.append(i)  # the reference quarantines the bad output side
                    continue
            if req is None:
                declined.append(i)
                continue
            if ikind == rules.CSV or rules.is_csv_content_type(inp.observedContentType):
                if not _valid_utf8(lines[i]):
                    # msgspec skips unknown fields without checking their UTF-8; the
                    # reference quarantines such a line.
                    declined.append(i)
                    continue
                skips["not_llm_traffic"] += 1  # tabular traffic, as the reference decides first
                continue
            if resp is None:
                declined.append(i)
                continue
            try:
                conv_turns, f, r, m, t, p, mt, fr = exchange(req, resp, out.observedContentType)
            except (_Decline, *_Invalid):
                declined.append(i)
                continue
            if not _valid_utf8(lines[i]):  # as for tabular lines above
                declined.append(i)
                continue
            meta = rec.eventMetadata
            if meta is None:
                ev.append(None)
                inf.append(None)
                tm.append(None)
            else:
                ev.append(meta.eventId)
                inf.append(meta.inferenceId)
                tm.append(meta.inferenceTime)
            idx.append(i)
            fmt.append(f)
            raw.append(r)
            model.append(m)
            temp.append(t)
            top_p.append(p)
            max_tok.append(mt)
            finish.append(fr)
            n_turns.append(len(conv_turns))
            turns += conv_turns
    when = parse_times(tm)
    if when.null_count:
        if hour is not None:
            when = when.fill_null(pa.scalar(hour, when.type))
        else:
            # No time and no layout hour: the reference quarantines these; let it.
            keep = pc.is_valid(when).to_pylist()
            declined.extend(i for i, k in zip(idx, keep) if not k)
            declined.sort()
    batch = _batch(cols, turns, when, first_line_no)
    if when.null_count and hour is None:
        batch = batch.filter(pc.is_valid(batch.column("inference_time")))
    return Chunk(batch=batch, declined=declined, skips=skips, declined_lines=[lines[i] for i in declined])


def _batch(cols: dict[str, list], turns: list[tuple[str, str]], when: pa.Array, first_line_no: int) -> pa.RecordBatch:
    n_turns = cols["n_turns"]
    offsets = [0] * (len(n_turns) + 1)
    acc = 0
    for r, k in enumerate(n_turns, 1):
        acc += k
        offsets[r] = acc
    return rows_batch(
        line_no=[first_line_no + i for i in cols["idx"]],
        offsets=offsets,
        t_from=[t[0] for t in turns],
        t_value=[t[1] for t in turns],
        event_id=cols["event_id"], inference_id=cols["inference_id"], inference_time=when,
        format=cols["format"], raw=cols["raw"], model=cols["model"], temperature=cols["temperature"],
        top_p=cols["top_p"], max_tokens=cols["max_tokens"], finish_reason=cols["finish_reason"],
    )


def _array(values: list | pa.Array, type_: pa.DataType) -> pa.Array:
    return values if isinstance(values, pa.Array) else pa.array(values, type_)


def rows_batch(*, line_no: list[int] | pa.Array, offsets: list[int] | pa.Array, t_from: list[str] | None = None,
               t_value: list[str] | None = None, turns: pa.StructArray | None = None,
               inference_time: pa.Array | list, **cols: list | pa.Array) -> pa.RecordBatch:
    """A :data:`ROW_SCHEMA` batch from columns (turns flattened, ``offsets`` per row); lists or Arrow arrays."""
    if turns is None:
        turns = pa.StructArray.from_arrays([_array(t_from, pa.string()), _array(t_value, pa.string())],
                                           fields=list(TURN))
    convs = pa.ListArray.from_arrays(_array(offsets, pa.int32()), turns)
    when = _array(inference_time, ROW_SCHEMA.field("inference_time").type)
    arrays = []
    for f in ROW_SCHEMA:
        if f.name == "conversations":
            arrays.append(convs)
        elif f.name == "line_no":
            arrays.append(_array(line_no, f.type))
        elif f.name == "inference_time":
            arrays.append(when)
        elif f.name == "dt":
            arrays.append(when.cast(pa.date32()))
        elif f.name in STRUCTURED and cols.get(f.name) is None:
            arrays.append(pa.nulls(len(when), f.type))  # the msgspec path's rows: none of them structured
        else:
            arrays.append(_array(cols[f.name], f.type))
    return pa.RecordBatch.from_arrays(arrays, schema=ROW_SCHEMA)



def parse_times(values: list[str | None] | pa.Array) -> pa.Array:
    """:func:`capture.records.parse_time` over a column (null where it gives ``None``).

    SageMaker writes ``2024-01-19T19:27:57Z``; the native module (else Arrow) parses those,
    and keeps a result only if its day is the one written (Arrow rolls ``02-30`` over to
    March where ``datetime.fromisoformat`` refuses). Everything else goes through ``parse_time``.
    """
    ts_type = ROW_SCHEMA.field("inference_time").type
    if len(values) == 0:
        return pa.nulls(0, ts_type)
    arr = _array(values, pa.string())
    nat = backend.native()
    if nat is not None and arr.type == pa.string() and ts_type == pa.timestamp("us", tz="UTC"):
        # The same canonical check and parse in C, in one pass instead of the three Arrow
        # kernels below (regex, strptime, day check).
        us, bits, pending = nat.parse_times(*native.utf8_args(arr))
        parsed = pa.Array.from_buffers(ts_type, len(arr), [pa.py_buffer(bits), pa.py_buffer(us)], pending)
        if not pending:
            return parsed
        same = pc.is_valid(parsed)
    else:
        # rules.TIME_REGEX has every field in range but the day in its month, which is checked after.
        canonical = pc.fill_null(pc.match_substring_regex(arr, rules.TIME_REGEX), False)
        parsed = pc.strptime(pc.if_else(canonical, arr, None), format=rules.TIME_FORMAT, unit="s", error_is_null=True)
        at, width = rules.TIME_FIELDS["day"]
        day = pc.cast(pc.utf8_slice_codeunits(pc.if_else(canonical, arr, None), at, at + width), pa.int64())
        same = pc.fill_null(pc.equal(pc.day(parsed), day), False)
        parsed = parsed.cast(ts_type)
        if pc.all(same).as_py():
            return parsed
    rest = pc.indices_nonzero(pc.invert(same)).to_pylist()
    fixed = pa.array([parse_time(v) for v in arr.take(rest).to_pylist()], ts_type)
    return pc.replace_with_mask(parsed, pc.invert(same), fixed)
