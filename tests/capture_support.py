"""What the capture tests share: capture files and the catalog, the edge variants and the mutated corpus, and the
oracles that compare the decoders (the C decoder, the msgspec batch path, the reference) and the redaction gates.

Not a test module: test modules import it (and the fuzzer, benchmarks/fuzz_decoder.py), never each other.
"""

from __future__ import annotations

import base64
import json
import random
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from capture import backend, batchpath, native, redact, rules
from capture.formats import to_conversation
from capture.ingest import FileOptions, FileResult, process_file
from capture.records import Reject, decode_line, make_capture_record
from capture.redact import Redactor
from capture.sources import SourceObject
from capture.synth import ALL_FORMATS, TextPool, exchange
from settings.config import Config

T0 = datetime(2025, 5, 1, 10, 0, tzinfo=timezone.utc)
MAX_LINE = 8 << 20


# -- capture files and the catalog -----------------------------------------------------------

def catalog_rows(cfg: Config, sql: str, params: list | None = None) -> list[tuple]:
    """The rows of one query on the warehouse's catalog (its tables by their plain names)."""
    from capture.warehouse import Warehouse

    wh = Warehouse(cfg)
    try:
        return wh.sql(sql, params)
    finally:
        wh.close()


def reconciles(res) -> bool:
    """Every line read is accounted for (rows superseded by the run were read by earlier runs: no part of it)."""
    return res.read == res.normalized + res.duplicates + res.stitched + res.quarantined + res.skipped


def chat(i: int, t: datetime, text: str | None = None, **kw) -> str:
    req = {"model": "m", "messages": [{"role": "user", "content": text or f"question {i}"}], "temperature": 0.2}
    resp = {"choices": [{"index": 0, "message": {"role": "assistant", "content": f"answer {i}"}}]}
    return make_capture_record(req, resp, event_id=f"e{i}", inference_time=t, **kw)


def record(history: list[tuple[str, str]], answer: str, t: datetime, event: str) -> str:
    """One capture record of an OpenAI chat request with ``history`` ((role, content) pairs) answered by ``answer``."""
    req = {"model": "m", "messages": [{"role": r, "content": c} for r, c in history], "temperature": 0.2}
    resp = {"choices": [{"index": 0, "message": {"role": "assistant", "content": answer}}]}
    return make_capture_record(req, resp, event_id=event, inference_time=t)


def chain(conv: str, n: int, t0: datetime = T0, step: timedelta = timedelta(minutes=1),
          system: str | None = "Be brief.", edit: dict[int, str] | None = None) -> list[str]:
    """The records of the first ``n`` turns of one conversation: record k holds turns 1..k.

    ``edit`` replaces the user text of some turns (``{turn index: text}``), as a client that
    edits history would send.
    """
    history = [("system", system)] if system else []
    out = []
    for k in range(n):
        history.append(("user", (edit or {}).get(k, f"{conv} question {k}")))
        answer = f"{conv} answer {k}"
        out.append(record(history, answer, t0 + k * step, f"{conv}-{k}"))
        history.append(("assistant", answer))
    return out


def write(path: Path, lines: list[str | bytes], newline: bytes = b"\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join((ln.encode() if isinstance(ln, str) else ln) + newline for ln in lines))
    return path


def layout_file(root: Path, t: datetime, name: str, lines: list, endpoint: str = "ep", variant: str = "AllTraffic") -> Path:
    return write(root / endpoint / variant / t.strftime("%Y/%m/%d/%H") / name, lines)


def obj_of(path: Path, hour: datetime | None = None) -> SourceObject:
    size = path.stat().st_size
    return SourceObject(str(path), size, str(size), "ep", "AllTraffic", hour)


# -- edge variants of the common formats ------------------------------------------------------

_CHAT = {"messages": [{"role": "user", "content": "hi"}]}
_D_A, _D_B = '{"choices":[{"delta":{"content":"a"}}]}', '{"choices":[{"delta":{"content":"b"}}],"model":"m"}'
_OK = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "yo"}}]}

VARIANTS = [
    (_CHAT | {"temperature": True}, _OK),  # bool is not a number
    (_CHAT | {"temperature": "0.5"}, _OK),
    (_CHAT | {"max_tokens": 12.0}, _OK),
    (_CHAT | {"model": 5}, _OK),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, _OK),
    ({"messages": [{"role": "robot", "content": "x"}]}, _OK),
    ({"messages": [{"role": "user", "content": "a\u0000b"}]}, _OK),
    ({"messages": []}, _OK),
    ({"messages": None, "prompt": "x"}, {"choices": [{"text": "y"}]}),
    ({"prompt": ["one"]}, {"choices": [{"text": "y"}]}),
    ({"prompt": "x", "nested": {"messages": 1}}, {"choices": [{"text": "y"}]}),
    ({"inputs": "x", "parameters": {"max_new_tokens": 3}}, {"generated_text": None}),
    ({"inputs": "x"}, [{"generated_text": "y"}, "junk"]),
    ({"inputs": "x"}, [{"generation": None}]),
    ({"inputs": "x"}, {"error": None}),
    ({"inputs": [[{"role": "user", "content": "q"}], [{"role": "user", "content": "q2"}]]}, [{"generation": "a"}]),
    ({"inputs": [{"role": "user", "content": "q"}]}, [{"generation": {"role": "assistant", "content": "a"}}]),
    ({"inputs": []}, [{"generation": "a"}]),
    (_CHAT, {"choices": [{"message": {"content": None, "tool_calls": [{"id": "1"}]}}]}),
    (_CHAT, {"choices": [{"message": {"content": "   "}}]}),
    (_CHAT, {"object": "error", "message": "x"}),
    (_CHAT, {"choices": []}),
    (_CHAT, 'data: {"choices":[{"index":1,"delta":{"content":"no"}}]}\n\ndata: {"choices":[{"delta":{"content":"yes"}}]}\n\n'),
    (_CHAT, 'data: {"choices":[{"delta":{"content":"a data: b"}}]}\n\ndata: [DONE]\n\n'),
    (_CHAT, 'event: message\ndata: {"choices":[{"delta":{"content":"x"}}]}\n\n'),
    (_CHAT, 'data: {"choices":[{"delta":"x","text":"t"}]}\n\n'),
    (_CHAT, 'data: {"choices":[{"delta":null,"text":"t"}]}\n\n'),
    (_CHAT, 'data: {"token":{"text":"x"}}\n\n'),
    (_CHAT, "data: 1,2\n\n"),
    (_CHAT, 'data: {"choices":[{"delta":{"content":"x"}}]},{"choices":[]}\n\n'),
    (_CHAT, "data: [DONE]\n\n"),
    # Keys spelled with \u escapes, which a substring dispatch would miss.
    ('{"m\\u0065ssages": [{"role": "user", "content": "q"}], "prompt": "p"}', {"choices": [{"text": "y"}]}),
    ('{"inputs": "x", "m\\u0065ssages": 1}', [{"generated_text": "y"}]),
    # Line breaks inside a chunk: the reference splits lines on every str.splitlines() break.
    (_CHAT, 'data: {"choices":[{"delta":{"content":\n"x"}}]}\n\n'),
    (_CHAT, 'data: {"choices":[{"delta":{"content":"x\u2028y"}}]}\n\n'),
    (_CHAT, 'data: {"choices":[{"delta":{"content":"x\x85y"}}]}\n\n'),
    (_CHAT, 'data: {"choices":[{"delta":{"content":"x"}}]}\r\n\r\ndata: [DONE]\r\n\r\n'),
    # A lone "\r" breaks a line for the reference: the chunk after it is no data field.
    (_CHAT, 'data: \r' + _D_A + '\ndata: ' + _D_B + '\n\ndata: [DONE]\n\n'),
] + [(_CHAT, "data: " + body + "\n\ndata: [DONE]\n\n") for body in (
    # The canonical shape, which is parsed with one replace: its edge cases.
    _D_A + "\n\ndata: [DONE]\n\ndata: " + _D_B,  # [DONE] mid-stream: the rest is ignored
    _D_A + "\n\ndata: \n\ndata: " + _D_B,  # an empty event
    _D_A + "\n\ndata: \t " + _D_B + "  ",  # padded events
    _D_A + "," + _D_B,  # two objects in one event
    '{"choices":[{"delta":{"content":"a data: b"}}]}',
    _D_A + "\ndata: " + _D_B,  # events not separated by a blank line
    '{"choices":[{"delta":{"content":\r"a"}}]}',
    '{"choices":[{"delta":{"content":"a\u2029"}}]}',
    _D_A + "\xa0",  # whitespace that str.strip() removes but JSON does not allow
    '{"choices":[{"delta":{"content":"a"}}],"error":null}',
)]
CANONICAL_ACCEPTED = (len(VARIANTS) - 8, len(VARIANTS) - 7, len(VARIANTS) - 6)

# -- edge variants of whole exchanges (reasoning, tool calls, token ids) ------------------------

_U = {"role": "user", "content": "q"}
_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]


def _answer(**msg) -> dict:
    return {"choices": [{"index": 0, "message": {"role": "assistant", "content": None} | msg, "finish_reason": "stop"}]}


def _call(args, **kw) -> dict:
    return {"id": "c1", "type": "function", "function": {"name": "f", "arguments": args}} | kw


def _stream(*chunks, done: bool = True) -> str:
    return "".join("data: " + (c if isinstance(c, str) else json.dumps(c, ensure_ascii=False)) + "\n\n"
                   for c in chunks) + ("data: [DONE]\n\n" if done else "")


def _delta(index: int = 0, **delta) -> dict:
    return {"choices": [{"index": index, "delta": delta, "finish_reason": None}]}


_TEXTY = "a\"b\\c\n\t\r\b\f\x01\x1f\x7f é 😀 \u2028 </script>"
EXCHANGE_VARIANTS = [
    # requests kept as sent
    ({"messages": [_U], "tools": _TOOLS, "tool_choice": "auto"}, _answer(content="a")),
    ({"messages": [_U], "tools": _TOOLS, "tool_choice": {"type": "function", "function": {"name": "f"}}},
     _answer(tool_calls=[_call('{"x": 1}')])),
    ({"messages": [_U], "tools": {"a": 1}}, _answer(content="a")),
    ({"messages": [_U], "tools": [1]}, _answer(content="a")),
    ({"messages": [_U], "tools": []}, _answer(content="a")),
    ({"messages": [_U], "tools": None, "tool_choice": None, "chat_template_kwargs": None}, _answer(content="a")),
    ({"messages": [_U], "chat_template_kwargs": []}, _answer(content="a")),
    ({"messages": [_U], "chat_template_kwargs": {"enable_thinking": False, "n": -0, "big": 10 ** 30}},
     _answer(content="a")),
    ({"messages": [_U], "chat_template_kwargs": {"t": 0.5}}, _answer(content="a")),  # a float: declined
    ({"messages": [_U, {"role": "assistant", "content": None, "tool_calls": [_call('{"city": "Oslo"}')]},
                   {"role": "tool", "tool_call_id": "c1", "content": "sunny"}, {"role": "user", "content": "and?"}]},
     _answer(content="ok")),
    ({"messages": [_U, {"role": "assistant", "content": "", "tool_calls": [_call('{"t": "é\\n"}')]}]},
     _answer(content="ok")),
    ({"messages": [_U, {"role": "assistant", "content": None, "tool_calls": []}]}, _answer(content="ok")),
    ({"messages": [_U, {"role": "assistant", "content": None, "tool_calls": [_call("{")]}]}, _answer(content="ok")),
    ({"messages": [_U, {"role": "assistant", "content": None, "tool_calls": [_call(5)]}]}, _answer(content="ok")),
    ({"messages": [_U, {"role": "assistant", "content": None, "tool_calls": [{"function": None}]}]},
     _answer(content="ok")),
    ({"messages": [_U, {"role": "assistant", "content": None, "tool_calls": "x"}]}, _answer(content="ok")),
    ({"messages": [_U, {"role": "tool", "tool_call_id": 5, "content": "x"}]}, _answer(content="ok")),
    ({"messages": [_U, {"role": "assistant", "content": "x", "reasoning": 1}]}, _answer(content="ok")),
    ({"messages": [{"role": "developer", "content": "d"}, _U]}, _answer(content="ok")),
    ({"messages": [{"role": "user", "content": "q", "name": "bob"}]}, _answer(content="ok")),
    ({"messages": [{"role": "user", "content": ""}, _U]}, _answer(content="ok")),
    ({"messages": [{"role": "user", "content": _TEXTY, "extra": [_TEXTY, {"k": None}, True, 12]}]},
     _answer(content=_TEXTY)),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "q"}]}], "tools": _TOOLS},
     _answer(content="a")),
    ('{"messages": [{"role": "user", "content": "q", "x": 1, "x": 2}], "tool_choice": "auto"}', _answer(content="a")),
    ('{"messages": [{"role": "user", "content": "q\\ud83d\\ude00\\u00e9\\u001f\\u2028\\/"}], "tool_choice": "auto"}',
     _answer(content="a")),
    ('{"messages": [{"role": "user", "content": "q"}], "tool_choice": {"n": -0, "m": [1 , 2 ], "e": 1e2}}',
     _answer(content="a")),
    ({"messages": [_U], "tool_choice": {"deep": json.loads("[" * 34 + "]" * 34)}}, _answer(content="a")),
    # answers
    ({"messages": [_U]}, _answer(reasoning="think")),  # all reasoning: kept, an empty turn
    ({"messages": [_U]}, _answer(content="", reasoning_content="think")),
    ({"messages": [_U]}, _answer(content="a", reasoning="r1", reasoning_content="r2")),
    ({"messages": [_U]}, _answer(content="a", reasoning=None, reasoning_content="r2")),
    ({"messages": [_U]}, _answer(content="a", reasoning=5)),
    ({"messages": [_U]}, _answer(content=None)),
    ({"messages": [_U]}, _answer(content=" ", tool_calls=[])),
    ({"messages": [_U]}, _answer(tool_calls=[_call('{"a": "é\\u00e9"}'), _call({"a": 1}, id="c2")])),
    ({"messages": [_U]}, _answer(content="with text", tool_calls=[_call("[1, 2]")])),
    ({"messages": [_U]}, _answer(tool_calls=[_call("not json")])),
    ({"messages": [_U]}, _answer(tool_calls=[_call(None)])),
    ({"messages": [_U]}, _answer(tool_calls=[_call(" 1 ")])),
    ({"messages": [_U]}, _answer(tool_calls=[_call('{"a": 1.5}')])),
    ({"messages": [_U]}, _answer(tool_calls=[_call('{"a": "\\u0000"}')])),
    ({"messages": [_U]}, _answer(tool_calls=[{"function": "f"}])),
    ({"messages": [_U]}, _answer(tool_calls=[1])),
    ({"messages": [_U]}, {"choices": [{"message": None}]}),
    ({"messages": [_U]}, {"choices": [{"message": {"content": [{"type": "text", "text": "a"}]}}]}),
    # token ids
    ({"messages": [_U]}, _answer(content="a") | {"prompt_token_ids": [1, 2, 2147483647]}),
    ({"messages": [_U]}, _answer(content="a") | {"prompt_token_ids": []}),
    ({"messages": [_U]}, {"prompt_token_ids": None, "choices": [{"message": {"content": "a"}, "token_ids": [0, 5],
                                                                 "prompt_token_ids": [7]}]}),
    ({"messages": [_U]}, {"prompt_token_ids": [1], "choices": [{"message": {"content": "a"}, "prompt_token_ids": [7]}]}),
    ({"messages": [_U]}, {"choices": [{"message": {"content": "a"}, "token_ids": [1]},
                                      {"message": {"content": "b"}, "token_ids": [2]}]}),
    *[({"messages": [_U]}, _answer(content="a") | {"prompt_token_ids": bad})
      for bad in ([-1], [1.0], [True], [2147483648], "x", [[1]], [1, None], [10 ** 20], [0o7])],
    ({"prompt": "p"}, {"choices": [{"text": "a", "token_ids": [3, 4], "prompt_token_ids": [1, 2]}]}),
    ({"prompt": "p"}, {"choices": [{"text": "", "token_ids": [3]}]}),
    # streams
    ({"messages": [_U], "tools": _TOOLS},
     _stream(_delta(role="assistant", content=""), _delta(reasoning="th"), _delta(reasoning="ink"),
             _delta(tool_calls=[{"index": 0, "id": "c1", "type": "function", "function": {"name": "f", "arguments": ""}}]),
             _delta(tool_calls=[{"index": 0, "function": {"arguments": '{"a": '}}]),
             _delta(tool_calls=[{"index": 0, "id": None, "function": {"arguments": '"é\\n"}'}}]),
             {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})),
    ({"messages": [_U]},  # two calls interleaved, indices out of order, keys first given late
     _stream(_delta(tool_calls=[{"index": 1, "function": {"arguments": "[1"}}]),
             _delta(tool_calls=[{"index": 0, "type": "function", "function": {"name": "g"}}]),
             _delta(tool_calls=[{"index": 1, "id": "b", "function": {"name": "f", "arguments": "]"}}]),
             _delta(tool_calls=[{"index": 0, "id": "a", "function": {"arguments": "{}"}}]))),
    ({"messages": [_U]}, _stream(_delta(tool_calls=[{"function": {"name": "f", "arguments": "{}"}}]),
                                 _delta(tool_calls=[{"function": {"arguments": "1"}}]))),  # no index: len(calls)
    ({"messages": [_U]}, _stream(_delta(tool_calls=[{"index": 0, "function": None, "id": "x"}]))),
    ({"messages": [_U]}, _stream(_delta(tool_calls=[{"index": 0, "function": {}}]))),
    ({"messages": [_U]}, _stream(_delta(tool_calls=[{"index": "0", "function": {"arguments": "1"}}]))),
    ({"messages": [_U]}, _stream(_delta(tool_calls=[{"index": None, "function": {"arguments": "1"}}]))),
    ({"messages": [_U]}, _stream(_delta(tool_calls=[{"index": True, "function": {"arguments": "1"}}]))),
    ({"messages": [_U]}, _stream(_delta(tool_calls=[{"index": 0, "function": {"arguments": 1}}]))),
    ({"messages": [_U]}, _stream(_delta(tool_calls=[{"index": 0, "function": {"arguments": "{"}}]))),
    ({"messages": [_U]}, _stream(_delta(tool_calls=[{"index": 0, "function": "f"}]))),
    ({"messages": [_U]}, _stream(_delta(tool_calls={"index": 0}))),
    ({"messages": [_U]}, _stream(_delta(tool_calls=[]))),
    ({"messages": [_U]}, _stream(_delta(tool_calls=[{"index": 0, "id": 5, "type": "function",
                                                     "function": {"name": 3, "arguments": "1"}}]))),
    ({"messages": [_U]}, _stream(_delta(reasoning_content="r"), _delta(reasoning="s", reasoning_content="t"))),
    ({"messages": [_U]}, _stream(_delta(reasoning=""))),
    ({"messages": [_U]}, _stream(_delta(reasoning=5))),
    ({"messages": [_U]}, _stream(_delta(content="a"), _delta(index=1, reasoning="other choice", tool_calls=[1]))),
    ({"messages": [_U]}, _stream(_delta(content="a") | {"prompt_token_ids": [1, 2]},
                                 {"choices": [{"index": 0, "delta": {"content": "b"}, "token_ids": [5],
                                               "prompt_token_ids": [9]}], "prompt_token_ids": [3]},
                                 {"choices": [{"index": 0, "delta": {}, "token_ids": [6]}]})),
    ({"messages": [_U]}, _stream({"choices": [{"index": 0, "delta": {"content": "a"}, "prompt_token_ids": [9]}],
                                  "prompt_token_ids": [3]})),  # the chunk's own ids come first
    ({"messages": [_U]}, _stream({"choices": [{"index": 0, "delta": {"content": "a"}, "token_ids": []}]})),
    ({"messages": [_U]}, _stream({"choices": [{"index": 0, "delta": {"content": "a"}, "token_ids": [-3]}]})),
    ({"messages": [_U]}, _stream({"choices": [{"index": 1, "delta": {"content": "a"}, "token_ids": [-3]}]},
                                 _delta(content="b"))),
    ({"messages": [_U]}, _stream(_delta(content="a"), {"choices": [], "prompt_token_ids": [1.5]})),
    ({"prompt": "p"}, _stream({"choices": [{"index": 0, "text": "a", "token_ids": [1], "prompt_token_ids": [2]}]})),
    ({"prompt": "p"}, _stream(_delta(reasoning="r"), {"choices": [{"index": 0, "text": "a"}]})),
]

# -- the reference, and the msgspec batch path against it, one line at a time ----------------

def reference(line: bytes):
    """The reference decoder's record and conversation of ``line``, or its Reject."""
    try:
        rec = decode_line(line)
        return rec, to_conversation(rec.request, rec.response)
    except Reject as rej:
        return rej


def msgspec_chunk(lines: list[bytes], hour: datetime | None = None, max_line: int = MAX_LINE) -> batchpath.Chunk:
    """The msgspec batch path's chunk of ``lines`` (the C decoder off)."""
    with backend.python_fallback():
        return batchpath.decode_chunk(lines, 1, max_line, hour)


def decided(line: bytes) -> str:
    """What the msgspec batch path made of one line: "row", "skip" or "declined"."""
    got = msgspec_chunk([line])
    return "declined" if got.declined else "row" if got.batch.num_rows else "skip"


def same(line: bytes) -> bool:
    """True if the msgspec batch path declined the line or decided it exactly as the reference does."""
    got = msgspec_chunk([line])
    if got.declined:
        return True
    ref = reference(line)
    if not got.batch.num_rows:  # skipped
        assert isinstance(ref, Reject) and ref.kind == "skip" and got.skips == {ref.reason: 1}, (ref, line[:200])
        return True
    assert not isinstance(ref, Reject), f"the batch path decided a line the reference rejects ({ref}): {line[:200]!r}"
    (row,), (rec, conv) = got.batch.to_pylist(), ref
    assert (row["event_id"], row["inference_id"], row["inference_time"]) == \
        (rec.event_id, rec.inference_id, rec.inference_time)
    got_turns = [(t["from"], t["value"]) for t in row["conversations"]]
    assert (got_turns, row["format"], row["raw"], row["model"], row["temperature"], row["top_p"], row["max_tokens"],
            row["finish_reason"]) == (conv.turns, conv.format, conv.raw, conv.model, conv.temperature, conv.top_p,
                                      conv.max_tokens, conv.finish_reason), (row, conv)
    # The fast paths keep no whole exchange: they decline every line the reference keeps whole.
    assert all(row[k] is None for k in batchpath.STRUCTURED), row
    assert (conv.messages, conv.tools, conv.tool_choice, conv.chat_template_kwargs, conv.prompt_token_ids,
            conv.output_token_ids) == (None,) * 6, (conv, line[:300])
    assert conv.extra == {}
    return True


# -- the C decoder against the msgspec batch path ---------------------------------------------

def native_chunk(lines: list[bytes], hour: datetime | None = None, max_line: int = MAX_LINE) -> batchpath.Chunk:
    """The C decoder's chunk of ``lines`` (the module must load: no silent fallback here)."""
    native.load()
    assert backend.native() is not None, "the native decoder is switched off"
    return batchpath.decode_chunk(lines, 1, max_line, hour)


def _outcomes(chunk: batchpath.Chunk, n: int) -> tuple[set[int], set[int], set[int]]:
    rows = set(chunk.batch.column("line_no").to_pylist())
    declined = {i + 1 for i in chunk.declined}
    skipped = set(range(1, n + 1)) - rows - declined
    assert sum(chunk.skips.values()) == len(skipped)
    return rows, declined, skipped


def reference_row(line: bytes, hour: datetime | None = None) -> dict | None:
    """The row the reference decoder makes of ``line`` (the :data:`batchpath.ROW_SCHEMA` columns
    but line_no and dt), or ``None`` where it rejects the line or has no time for it."""
    ref = reference(line)
    if isinstance(ref, Reject):
        return None
    rec, conv = ref
    when = rec.inference_time or hour
    if when is None:
        return None
    return {"conversations": [{"from": f, "value": v} for f, v in conv.turns], "event_id": rec.event_id,
            "inference_id": rec.inference_id, "inference_time": when, "format": conv.format, "raw": conv.raw,
            "model": conv.model, "temperature": conv.temperature, "top_p": conv.top_p, "max_tokens": conv.max_tokens,
            "messages": conv.messages, "tools": conv.tools, "tool_choice": conv.tool_choice,
            "chat_template_kwargs": conv.chat_template_kwargs, "finish_reason": conv.finish_reason,
            "prompt_token_ids": conv.prompt_token_ids, "output_token_ids": conv.output_token_ids}


def check(lines: list[bytes], hour=None, max_line=MAX_LINE, exact=False) -> tuple[int, int]:
    """Native vs msgspec on one chunk: every line both decide comes out alike; the lines only the
    native decoder decides (the whole exchanges, which the msgspec path declines) come out as the
    reference decoder makes them; the native decoder skips no line the msgspec path does not.

    Returns (lines native decided, lines msgspec decided); ``exact`` requires the same declines.
    """
    nat = native_chunk(lines, hour, max_line)
    ref = msgspec_chunk(lines, hour, max_line)
    n_rows, n_dec, n_skip = _outcomes(nat, len(lines))
    m_rows, m_dec, m_skip = _outcomes(ref, len(lines))
    assert n_skip <= m_skip, [lines[i - 1][:300] for i in sorted(n_skip - m_skip)]
    assert n_rows - m_rows <= m_dec, [lines[i - 1][:300] for i in sorted(n_rows - m_rows - m_dec)]
    both = n_rows & m_rows
    keep = pc.is_in(ref.batch.column("line_no"), pa.array(sorted(both), pa.int64()))
    expected = ref.batch.filter(keep)
    mine = nat.batch.filter(pc.is_in(nat.batch.column("line_no"), pa.array(sorted(both), pa.int64())))
    assert mine.schema == expected.schema == batchpath.ROW_SCHEMA
    for name in mine.schema.names:
        got, want = mine.column(name).to_pylist(), expected.column(name).to_pylist()
        if got != want:
            bad = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
            line_no = expected.column("line_no")[bad].as_py()
            raise AssertionError(f"{name}: {got[bad]!r} != {want[bad]!r} in {lines[line_no - 1][:500]!r}")
    assert mine.equals(expected)
    only = nat.batch.filter(pc.is_in(nat.batch.column("line_no"), pa.array(sorted(n_rows - m_rows), pa.int64())))
    for row in only.to_pylist():
        line = lines[row["line_no"] - 1]
        want = reference_row(line, hour)
        assert want is not None, f"the native decoder decided a line the reference rejects: {line[:500]!r}"
        for name, v in want.items():
            assert row[name] == v, f"{name}: {row[name]!r} != {v!r} in {line[:500]!r}"
    if exact:
        assert nat.declined == ref.declined and nat.skips == ref.skips and nat.batch.equals(ref.batch)
    return len(n_rows) + len(n_skip), len(m_rows) + len(m_skip)


def same_file_result(obj: SourceObject, opts: FileOptions | None = None) -> None:
    """process_file of ``obj`` with the native backend and with the Python fallback: the same result."""
    opts = opts or FileOptions()
    on = process_file(obj, opts)
    with backend.python_fallback():
        off = process_file(obj, opts)
    same_result(on, off)


def same_result(on: FileResult, off: FileResult) -> None:
    for attr in ("read", "missing", "error", "file_duplicates", "file_stitched", "skips", "quarantine",
                 "row_redactions"):
        assert getattr(on, attr) == getattr(off, attr), attr
    assert (on.prefixes is None) == (off.prefixes is None)
    if on.prefixes is not None:
        assert on.prefixes.hashes.equals(off.prefixes.hashes) and on.prefixes.rows.tolist() == off.prefixes.rows.tolist()
    assert on.table.schema == off.table.schema
    for name in on.table.column_names:  # NaN (from the reference's json) compares unequal to itself
        nan_safe = [["nan" if v != v else v for v in t[name].to_pylist()] for t in (on.table, off.table)]
        assert nan_safe[0] == nan_safe[1], name


# -- a seeded corpus of mutated lines ------------------------------------------------------

NUMBERS = ["0", "-0", "1", "256", "-5", "0.5", "1.0", "12.0", "1e2", "1E+2", "2.5e-3", "1e400", "-1e400", "1e-400",
           "5e-324", "9223372036854775807", "9223372036854775808", "-9223372036854775808", "-9223372036854775809",
           "100000000000000000000000", "0.1000000000000000055511151231257827", "3.141592653589793238462643383279",
           "true", "false", "null", '"0.5"', '"7"', "[]", "{}", "01", "1.", ".5", "+1", "NaN", "Infinity", "-", "1e",
           "-0.5", "1.5", "-Infinity", "1" + "0" * 400]
TEXTS = ["hi", "", " ", "\t\n", "\u3000\u2003", "\x1c", "\xa0x", "ünï", "😀", "中文", "a\u2028b", "a\x85b",
         "\\u00e9", "q\\u0000", "x" * 300, "data: x", "[DONE]", "\"quoted\"", "back\\slash"]
# Escapes as they appear in JSON text: pairs, lone and reversed surrogates, NUL, printable ASCII.
RAW_ESCAPES = ["", "", "\\ud83d\\ude00", "\\uD83D\\uDE00", "\\ud800", "\\udc00\\ud800", "\\uDBFF\\uDFFF", "\\u0041",
               "\\u00e9", "\\u0000", "\\u001c", "\\n", "\\/", "\\u2028"]
# Every role the rules map, plus cases and near misses.
ROLES = [*rules.ROLE_MAP, "USER", "User", "Assistant", "robot", "", "ſystem", "usér", "user "]
KEYS = ["messages", "prompt", "inputs", "parameters", "model", "temperature", "top_p", "max_tokens",
        "max_completion_tokens", "max_new_tokens", "choices", "message", "content", "role", "text", "delta", "index",
        "generated_text", "generation", "error", "object", "token", "stream", "extra"]
CONTENT_TYPES = [None, "application/json", "text/csv", " TEXT/CSV ; charset=utf-8", "text/event-stream",
                 "Text/Event-Stream; charset=utf-8", "application/jsonlines", "", "téxt/csv", "\x1ctext/csv\x1f",
                 "text/csv\u3000", "event-stream\u212a"]
ENCODINGS = ["JSON", "json", "BASE64", "base64", "Base64", "CSV", "", None, "GZIP", "baſe64", "JSON "]


def _value(rng: random.Random, depth: int = 0):
    """A random JSON value (as text) for unknown fields."""
    k = rng.randrange(7 if depth < 4 else 4)
    if k == 0:
        return rng.choice(NUMBERS[:22])
    if k == 1:
        return json.dumps(rng.choice(TEXTS), ensure_ascii=rng.random() < 0.5)
    if k == 2:
        return rng.choice(["true", "false", "null"])
    if k == 3:
        return json.dumps(rng.random() * 10 ** rng.randrange(-5, 30))
    if k == 4:
        return "[" + ", ".join(_value(rng, depth + 1) for _ in range(rng.randrange(4))) + "]"
    return "{" + ", ".join(f"{json.dumps(rng.choice(KEYS))}: {_value(rng, depth + 1)}" for _ in range(rng.randrange(4))) + "}"


def _mutate_json(rng: random.Random, text: str) -> str:
    """A structural mutation of a JSON document's text (a payload or the outer line)."""
    k = rng.randrange(12)
    braces = [i for i, c in enumerate(text) if c in "{,"]
    if k == 0 and braces:  # an extra member: unknown, or a duplicate of a key of interest
        i = rng.choice(braces)
        member = f"{json.dumps(rng.choice(KEYS))}: {_value(rng)}"
        return text[: i + 1] + member + ("," if text[i] == "{" and text[i + 1:i + 2] != "}" else "") + text[i + 1:] \
            if text[i] == "{" else text[: i + 1] + member + "," + text[i + 1:]
    if k == 1:  # a number field replaced
        for key in ("temperature", "top_p", "max_tokens", "max_new_tokens", "index"):
            j = text.find(f'"{key}": ')
            if j >= 0:
                j += len(key) + 4
                end = j
                while end < len(text) and text[end] not in ",}]":
                    end += 1
                return text[:j] + rng.choice(NUMBERS) + text[end:]
        return text
    if k == 2:  # a character as a \u escape (printable ASCII ones are what escapes_ascii looks for)
        quotes = [i for i, c in enumerate(text) if c.isalpha()]
        if quotes:
            i = rng.choice(quotes)
            esc = f"\\u{ord(text[i]):04{rng.choice('xX')}}"
            return text[:i] + esc + text[i + 1:]
        return text
    if k == 3:  # a string value replaced by tricky text
        j = text.find('": "')
        starts = [i for i in range(len(text)) if text.startswith('": "', i)]
        if starts:
            j = rng.choice(starts) + 4
            end = text.find('"', j)
            while end > 0 and text[end - 1] == "\\":
                end = text.find('"', end + 1)
            if end > 0:
                body = json.dumps(rng.choice(TEXTS) + rng.choice(["", "\U0001F600"]), ensure_ascii=rng.random() < 0.3)
                return text[:j] + body[1:-1] + rng.choice(RAW_ESCAPES) + text[end:]
        return text
    if k == 4:  # a role
        j = text.find('"role": "')
        if j >= 0:
            j += 9
            end = text.find('"', j)
            return text[:j] + rng.choice(ROLES) + text[end:]
        return text
    if k == 5:  # a value replaced by null / another type
        starts = [i for i in range(len(text)) if text.startswith('": ', i)]
        if starts:
            j = rng.choice(starts) + 3
            end = j
            depth = 0
            in_str = False
            while end < len(text):
                c = text[end]
                if in_str:
                    if c == "\\":
                        end += 1
                    elif c == '"':
                        in_str = False
                elif c == '"':
                    in_str = True
                elif c in "[{":
                    depth += 1
                elif c in "]}":
                    if depth == 0:
                        break
                    depth -= 1
                elif c == "," and depth == 0:
                    break
                end += 1
            return text[:j] + rng.choice(["null", "1", '"s"', "[]", "{}", "true", _value(rng)]) + text[end:]
        return text
    if k == 6:  # deep nesting in an unknown field
        d = rng.choice([5, 20, 31, 33, 40, 200, 10_000])
        i = text.find("{")
        return text[: i + 1] + '"extra": ' + "[" * d + "]" * d + ", " + text[i + 1:] if i >= 0 else text
    if k == 7:  # surrounding whitespace
        return rng.choice([" ", "\n", "\t", "\r\n", "\xa0", "\u3000", "\x0c"]) + text + rng.choice(["", " ", "\n", "\x0b"])
    if k == 8:  # truncation
        return text[: rng.randrange(len(text) + 1)]
    if k == 9:  # a line break in the middle of whitespace or strings
        i = rng.randrange(len(text) + 1)
        return text[:i] + rng.choice(["\n", "\r", "\u2028", "\x85", " "]) + text[i:]
    if k == 10:  # the TGI echo: the answer starts with the prompt
        m = text.find('"generated_text": "')
        return text if m < 0 else text[: m + 19] + "[0] " + text[m + 19:]
    return text


def _payload_text(rng: random.Random, payload, mutate: bool) -> str:
    text = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=rng.random() < 0.5)
    for _ in range(rng.choice([0, 1, 1, 2]) if mutate else 0):
        text = _mutate_json(rng, text)
    return text


def mutated_line(rng: random.Random, pool: TextPool, i: int) -> bytes:
    """A capture line of a random format, mutated (or not) in its payloads, outer document and bytes."""
    kw = exchange(rng.choice(ALL_FORMATS), pool, i)
    if rng.random() < 0.3:
        req, resp = rng.choice(VARIANTS + EXCHANGE_VARIANTS)
        kw = {"request": req, "response": resp,
              "response_content_type": "text/event-stream" if isinstance(resp, str) else "application/json"}
    if rng.random() < 0.2 and isinstance(kw["request"], dict) and "inputs" in kw["request"]:
        kw["response"] = [{"generated_text": str(kw["request"]["inputs"]) + " and more"}]
    mutate = rng.random() < 0.6  # else only the benign variety above and below
    req = _payload_text(rng, kw["request"], mutate)
    resp = _payload_text(rng, kw["response"], mutate)
    cts = {"request_content_type": kw.get("request_content_type", "application/json"),
           "response_content_type": kw.get("response_content_type", "application/json")}
    for side in cts:
        if mutate and rng.random() < 0.3:
            cts[side] = rng.choice(CONTENT_TYPES)
    line = make_capture_record(
        req, resp, event_id=rng.choice([f"e{i}", None, "é\U0001F600"]),
        inference_time=rng.choice([T0 + timedelta(seconds=i)] * 4 + ["2025-02-30T00:00:00Z", "{%s}", "",
                                                                      "2025-05-01T10:00:00.250+02:00"]),
        inference_id=rng.choice([None, f"inf-{i}"]),
        **cts,
        request_encoding=kw.get("request_encoding", "JSON") if rng.random() < 0.8 else rng.choice(["JSON", "BASE64"]),
        response_encoding=kw.get("response_encoding", "JSON") if rng.random() < 0.8 else rng.choice(["JSON", "BASE64"]),
    )
    obj = json.loads(line)
    if mutate and rng.random() < 0.3:  # the outer document: encodings, nulls, missing parts
        side = obj["captureData"][rng.choice(["endpointInput", "endpointOutput"])]
        k = rng.randrange(6)
        if k == 0:
            side["encoding"] = rng.choice(ENCODINGS)
        elif k == 1 and side.get("encoding") == "BASE64":
            side["data"] = rng.choice(["", "QQ==", "QR==", "QQ=", "Q===", "QUJD\n", "%%%", side["data"][:-1],
                                       side["data"] + "=", base64.b64encode(b"\xff\xfe").decode(),
                                       base64.b64encode(b'{"inputs": "a\x00"}').decode()])
        elif k == 2:
            obj["eventMetadata"] = rng.choice([None, {}, {"eventId": 5}, [], {"inferenceTime": None}])
        elif k == 3:
            del obj["captureData"][rng.choice(["endpointInput", "endpointOutput"])]
        elif k == 4:
            side["observedContentType"] = rng.choice(CONTENT_TYPES + [1])
        else:
            side["data"] = rng.choice([1, None, ["x"], side["data"]])
    text = json.dumps(obj, ensure_ascii=rng.random() < 0.3)
    if mutate and rng.random() < 0.2:
        text = _mutate_json(rng, text)
    raw = text.encode("utf-8", "surrogatepass")
    k = rng.randrange(16) if mutate else 99
    if k == 0:  # a byte flipped
        j = rng.randrange(len(raw))
        raw = raw[:j] + bytes([rng.randrange(256)]) + raw[j + 1:]
    elif k == 1:
        raw = b"\xef\xbb\xbf" + raw
    elif k == 2:
        raw = raw + b"\r"
    elif k == 3:  # a raw NUL, or invalid UTF-8 sequences
        j = rng.randrange(len(raw))
        raw = raw[:j] + rng.choice([b"\x00", b"\xff", b"\xc0\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xe2\x82"]) + raw[j:]
    return raw


# -- the redaction gates: the native one, RE2's, and the redactor -----------------------------

def c_gate(values: pa.Array) -> list[int]:
    """Indices the native gate flags (the module must load: no silent fallback here)."""
    validity, offsets, data = values.buffers()
    hits = native.load().redact_gate(values.offset, len(values), offsets, data if data is not None else b"",
                                     validity if values.null_count else None)
    return np.frombuffer(hits, dtype=np.int64).tolist()


def re2_gate(values: pa.Array) -> list[int]:
    """Indices the RE2 gate (the fallback) flags."""
    return redact.flagged_re2(values)


def assert_superset(values: list[str | None]) -> tuple[set[int], set[int]]:
    """C ⊇ RE2 on ``values`` (also sliced, so that the array offset is not 0); returns (re2, c)."""
    arr = pa.array(values, pa.string())
    want, got = set(re2_gate(arr)), set(c_gate(arr))
    missed = sorted(want - got)
    assert not missed, [values[i] for i in missed[:20]]
    if len(arr) > 3:
        sl = arr.slice(3)
        assert set(re2_gate(sl)) <= set(c_gate(sl))
    return want, got


def gates_cover_the_redactor(values: list[str]) -> None:
    """Both gates flag every string the redactor changes."""
    arr = pa.array(values, pa.string())
    c, r = set(c_gate(arr)), set(re2_gate(arr))
    for i, v in enumerate(values):
        if Redactor().redact(v) != v:
            assert i in c, f"C gate misses {v!r}"
            assert i in r, f"RE2 gate misses {v!r}"
