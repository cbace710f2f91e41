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
import pyarrow as pa
import pyarrow.compute as pc

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
    return Chunk(batch=batch, declined=declined, skips=skips)


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


def rows_batch(*, line_no: list[int], offsets: list[int], t_from: list[str], t_value: list[str],
               inference_time: pa.Array | list, **cols: list) -> pa.RecordBatch:
    """A :data:`ROW_SCHEMA` batch from columns (turns flattened, ``offsets`` per row)."""
    convs = pa.ListArray.from_arrays(
        pa.array(offsets, pa.int32()),
        pa.StructArray.from_arrays([pa.array(t_from, pa.string()), pa.array(t_value, pa.string())], fields=list(TURN)),
    )
    when = inference_time
    if not isinstance(when, pa.Array):
        when = pa.array(when, ROW_SCHEMA.field("inference_time").type)
    arrays = []
    for f in ROW_SCHEMA:
        if f.name == "conversations":
            arrays.append(convs)
        elif f.name == "line_no":
            arrays.append(pa.array(line_no, f.type))
        elif f.name == "inference_time":
            arrays.append(when)
        elif f.name == "dt":
            arrays.append(when.cast(pa.date32()))
        else:
            arrays.append(pa.array(cols[f.name], f.type))
    return pa.RecordBatch.from_arrays(arrays, schema=ROW_SCHEMA)


# SageMaker's inferenceTime, with every field in range (the day is checked against the month below).
_CANONICAL_TIME = r"^[1-9]\d{3}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])T(?:[01]\d|2[0-3]):[0-5]\d:[0-5]\dZ$"
_TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


def parse_times(values: list[str | None]) -> pa.Array:
    """:func:`capture.records.parse_time` over a column (null where it gives ``None``).

    SageMaker writes ``2024-01-19T19:27:57Z``; Arrow parses those, and keeps a result only
    if its day is the one written (Arrow rolls ``02-30`` over to March where
    ``datetime.fromisoformat`` refuses). Everything else goes through ``parse_time``.
    """
    ts_type = ROW_SCHEMA.field("inference_time").type
    if not values:
        return pa.array([], ts_type)
    arr = pa.array(values, pa.string())
    canonical = pc.fill_null(pc.match_substring_regex(arr, _CANONICAL_TIME), False)
    parsed = pc.strptime(pc.if_else(canonical, arr, None), format=_TIME_FORMAT, unit="s", error_is_null=True)
    day = pc.cast(pc.utf8_slice_codeunits(pc.if_else(canonical, arr, None), 8, 10), pa.int64())
    same = pc.fill_null(pc.equal(pc.day(parsed), day), False)
    parsed = parsed.cast(ts_type)
    if pc.all(same).as_py():
        return parsed
    rest = pc.indices_nonzero(pc.invert(same)).to_pylist()
    fixed = pa.array([parse_time(values[i]) for i in rest], ts_type)
    return pc.replace_with_mask(parsed, pc.invert(same), fixed)
