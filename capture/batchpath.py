"""Batch path: a chunk of capture lines → columns, with the per-line path as the arbiter.

Typed msgspec decoding of a line and its two payloads costs ~7 µs; the per-line path
(:func:`capture.fastpath.fast_decode`, else the reference decoder) spent as much again
around it: payload/record/conversation objects, a ``datetime`` per line, row-wise
appends, and cyclic-GC passes over the millions of small objects a file keeps alive.
Here a chunk of lines goes through the *same* typed decoders and format rules
(:func:`capture.fastpath.exchange`, so the same strictness) in one loop that appends
straight to columns, with the garbage collector paused; inference times are parsed by
Arrow for the whole chunk.

Every line this path cannot decide exactly (bad JSON, odd shapes, quarantines, anything
but the common formats and tabular CSV) is returned by index, and the caller hands it to
the per-line path, which decides. Tests check that both paths give identical tables.

By default the chunk goes through the C decoder of :mod:`capture.native` instead
(:func:`decode_chunk`; :func:`decode_block` takes a block of raw lines and splits them in C), which applies the same rules, declines at least every line this
module's msgspec loop (:func:`decode_chunk_msgspec`, kept as its reference and fallback)
declines, and writes Arrow buffers directly; tests compare the two line for line.
"""

from __future__ import annotations

import base64
import binascii
import gc
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Union

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from capture import native
from capture.dedupe import HashSet
from capture.fastpath import _Decline, _Invalid, _Meta, _Side, exchange
from capture.records import parse_time
from capture.warehouse import SCHEMA, TURN

# The columns a decoded line yields (typed as in the warehouse); capture.ingest adds hashes and provenance.
ROW_SCHEMA = pa.schema([SCHEMA.field(name) for name in (
    "line_no", "conversations", "event_id", "inference_id", "inference_time", "format", "raw", "model",
    "temperature", "top_p", "max_tokens", "dt")])


class _Cap(msgspec.Struct, gc=False):
    endpointInput: _Side
    # Optional here (unlike the fast path) so that tabular lines without output stay in the batch.
    endpointOutput: Union[_Side, None] = None


class _Line(msgspec.Struct, gc=False):
    captureData: _Cap
    eventMetadata: Union[_Meta, None] = None


_line_dec = msgspec.json.Decoder(_Line)

# encoding field → what the reference does with it; content type → is it tabular CSV.
# Both are memoized (few distinct values in practice; capped against hostile input).
_KIND: dict[str | None, str] = {}
_CSV_CT: dict[str | None, bool] = {}
_MEMO_MAX = 256


def _kind(enc: str | None) -> str:
    k = _KIND.get(enc)
    if k is None:
        k = (enc or "JSON").upper()
        if len(_KIND) < _MEMO_MAX:
            _KIND[enc] = k
    return k


def _csv_ct(ct: str | None) -> bool:
    v = _CSV_CT.get(ct)
    if v is None:
        v = (ct or "").split(";")[0].strip().lower() == "text/csv"
        if len(_CSV_CT) < _MEMO_MAX:
            _CSV_CT[ct] = v
    return v


def _text(side: _Side, kind: str) -> str | None:
    """A payload's text as the reference decodes it, or ``None`` where it would quarantine."""
    if kind == "JSON" or kind == "CSV":
        text = side.data
    elif kind == "BASE64":
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


# Tests and benchmarks turn this off to compare with the msgspec loop.
USE_NATIVE = True


def decode_chunk(lines: list[bytes], first_line_no: int, max_line: int, hour: datetime | None) -> Chunk:
    """Decode ``lines`` (numbered from ``first_line_no``); declined ones come back by index."""
    nat = native.get() if USE_NATIVE else None
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
    nat = native.get() if USE_NATIVE else None
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
    cols = {name: _utf8(n, out[name]) for name in ("event_id", "inference_id", "format", "model")}
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
                                             "temperature", "top_p", "max_tokens", "n_turns")}
    idx, ev, inf, tm = cols["idx"], cols["event_id"], cols["inference_id"], cols["time"]
    fmt, raw, model, temp, top_p, max_tok, n_turns = (cols[k] for k in ("format", "raw", "model", "temperature",
                                                                       "top_p", "max_tokens", "n_turns"))
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
            if enc is None or enc == "JSON":
                ikind, req = "JSON", inp.data
                if "\x00" in req:
                    req = None
            else:
                ikind = _kind(enc)
                req = _text(inp, ikind)
            resp = None
            if out is not None:
                enc = out.encoding
                if enc is None or enc == "JSON":
                    resp = out.data
                    if "\x00" in resp:
                        resp = None
                else:
                    resp = _text(out, _kind(enc))
                if resp is None:
                    declined.append(i)  # the reference quarantines the bad output side
                    continue
            if req is None:
                declined.append(i)
                continue
            if ikind == "CSV" or _csv_ct(inp.observedContentType):
                if not _valid_utf8(lines[i]):
                    # msgspec skips unknown fields without checking their UTF-8; the
                    # reference (and so the per-line path) quarantines such a line.
                    declined.append(i)
                    continue
                skips["not_llm_traffic"] += 1  # tabular traffic, as the reference decides first
                continue
            if resp is None:
                declined.append(i)
                continue
            try:
                conv_turns, f, r, m, t, p, mt = exchange(req, resp, out.observedContentType)
            except (_Decline, *_Invalid):
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
        top_p=cols["top_p"], max_tokens=cols["max_tokens"],
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
        else:
            arrays.append(_array(cols[f.name], f.type))
    return pa.RecordBatch.from_arrays(arrays, schema=ROW_SCHEMA)


# SageMaker's inferenceTime, with every field in range (the day is checked against the month below).
_CANONICAL_TIME = r"^[1-9]\d{3}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])T(?:[01]\d|2[0-3]):[0-5]\d:[0-5]\dZ$"
_TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


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
    nat = native.get() if USE_NATIVE else None
    if nat is not None and arr.type == pa.string() and ts_type == pa.timestamp("us", tz="UTC"):
        # The same canonical check and parse in C: ~0.02 µs a row, against ~0.2 for the
        # Arrow kernels below (regex, strptime, day check).
        us, bits, pending = nat.parse_times(*native.utf8_args(arr))
        parsed = pa.Array.from_buffers(ts_type, len(arr), [pa.py_buffer(bits), pa.py_buffer(us)], pending)
        if not pending:
            return parsed
        same = pc.is_valid(parsed)
    else:
        canonical = pc.fill_null(pc.match_substring_regex(arr, _CANONICAL_TIME), False)
        parsed = pc.strptime(pc.if_else(canonical, arr, None), format=_TIME_FORMAT, unit="s", error_is_null=True)
        day = pc.cast(pc.utf8_slice_codeunits(pc.if_else(canonical, arr, None), 8, 10), pa.int64())
        same = pc.fill_null(pc.equal(pc.day(parsed), day), False)
        parsed = parsed.cast(ts_type)
        if pc.all(same).as_py():
            return parsed
    rest = pc.indices_nonzero(pc.invert(same)).to_pylist()
    fixed = pa.array([parse_time(v) for v in arr.take(rest).to_pylist()], ts_type)
    return pc.replace_with_mask(parsed, pc.invert(same), fixed)
