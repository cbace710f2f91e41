"""One ingest run: capture files → deduplicated, redacted ShareGPT rows in the warehouse.

Files are processed independently (in a pool of worker processes when there is
enough input); the parent deduplicates by content hash and stitches multi-turn
conversations (:mod:`capture.stitch`) across files and runs, writes Parquet per day,
and commits checkpoints to the catalog. Every line read is accounted for:
``read = normalized + duplicates + stitched + quarantined + skipped``.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import multiprocessing as mp
import os
import tempfile
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import date, datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc
from botocore.exceptions import BotoCoreError

from capture import backend, native
from capture.dedupe import HashSet
from capture.batchpath import ROW_SCHEMA, decode_block, rows_batch, split_block
from capture.formats import content_text, to_conversation
from capture.records import Reject, decode_line
from capture.redact import flagged_json, redact_array, redact_values
from capture.sources import (BLOCK_BYTES, LongLine, ObjectMissing, SourceObject, iter_blocks, list_objects, parse_when,
                             s3_client)
from capture.stitch import Known, Prefixes, stitch_file
from capture.warehouse import COMPACT_FILES, RUN_COUNTS, SCHEMA, TURN, Checkpoint, Committed, Warehouse

if TYPE_CHECKING:
    from multiprocessing.pool import Pool

    from settings.config import CaptureConfig, Config, S3Config

log = logging.getLogger("capture.ingest")

EXCERPT_BYTES = 1024
# Redaction sees this much more of a quarantined line than its excerpt keeps, so that a
# secret which the excerpt's end would cut in two is still recognised whole.
EXCERPT_LOOKAHEAD = 512
# Below this much input a pool's start-up costs more than it saves.
POOL_MIN_BYTES = 8 << 20
CHECKPOINT_BYTES = 512 << 20
PART_ROWS = 250_000
# A day with this many rows buffered is written out as soon as a file brings none of its
# rows (capture files are listed in time order, so the day is most likely complete).
PART_MIN_ROWS = 50_000


@dataclass
class IngestResult:
    """Counts of one run. ``read = normalized + duplicates + stitched + quarantined + skipped``.

    ``stitched``: conversations not stored because a longer version of them is known (this
    run's, or stored). ``superseded``: rows stored by earlier runs that a longer version
    read by this run replaces; no part of ``read`` (see :mod:`capture.stitch`).
    """

    run_id: str
    read: int = 0
    normalized: int = 0
    duplicates: int = 0
    stitched: int = 0
    quarantined: int = 0
    skipped: int = 0
    superseded: int = 0
    redactions: dict[str, int] = field(default_factory=dict)
    objects: int = 0
    missing_objects: int = 0
    skip_reasons: dict[str, int] = field(default_factory=dict)
    quarantine_reasons: dict[str, int] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        """Exactly the keys ``adapt ingest --json`` prints."""
        return {
            "read": self.read,
            "normalized": self.normalized,
            "duplicates": self.duplicates,
            "stitched": self.stitched,
            "quarantined": self.quarantined,
            "skipped": self.skipped,
            "superseded": self.superseded,
            "redactions": dict(sorted(self.redactions.items())),
            "run_id": self.run_id,
        }


@dataclass
class FileResult:
    """What one worker made of one capture file."""

    obj: SourceObject
    missing: bool = False
    error: str | None = None
    read: int = 0
    table: pa.Table | None = None
    table_file: str | None = None  # the table, handed over in shared memory (see hand_over)
    file_duplicates: int = 0  # rows dropped as replays of an earlier row of the same file
    file_stitched: int = 0  # rows dropped as stitched prefixes of another row of the same file
    prefixes: Prefixes | None = None  # the prefix hashes of the table's rows (capture.stitch), if any
    row_redactions: list[tuple[int, dict[str, int]]] = field(default_factory=list)
    quarantine: list[dict] = field(default_factory=list)
    skips: Counter = field(default_factory=Counter)


def content_hash(turns: Iterable[tuple[str, str]]) -> str:
    """Hash of the conversation text only (roles and values), so replays of one exchange collide."""
    # Length-prefixed, so no choice of text can make two different conversations serialize alike.
    flat = "".join(f"{frm}:{len(value)}:{value}" for frm, value in turns)
    return hashlib.blake2b(flat.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def _excerpt(line: bytes, size: int | None = None) -> str:
    """The start of a quarantined line, decoded leniently; cut to its final length by :func:`_finish_quarantine`."""
    keep = EXCERPT_BYTES + EXCERPT_LOOKAHEAD
    s = line[:keep].decode("utf-8", "replace").replace("\x00", "\\x00")
    return s + ("…" if (len(line) if size is None else size) > keep else "")


def _quarantined(obj: SourceObject, line_no: int, reason: str, detail: str, line: bytes,
                 size: int | None = None) -> dict:
    return {"source_uri": obj.uri, "line_no": line_no, "reason": reason, "detail": detail[:500],
            "excerpt": _excerpt(line, size), "event_id": None}


def _finish_quarantine(rows: list[dict], redact: bool) -> None:
    """Redact the quarantine rows' excerpts and details (as the turns are: they land in the catalog),
    then cut the excerpts to ``EXCERPT_BYTES`` characters.

    A detail may quote a decoded value, which can hold a lone surrogate (a ``\\ud800`` escape):
    it is written as that escape, since neither Arrow nor DuckDB stores one.
    """
    for q in rows:
        q["detail"] = q["detail"].encode("utf-8", "backslashreplace").decode("utf-8")
    if redact and rows:
        texts = [q["excerpt"] for q in rows] + [q["detail"] for q in rows]
        redact_values(texts)
        for q, excerpt, detail in zip(rows, texts, texts[len(rows):]):
            q["excerpt"], q["detail"] = excerpt, detail
    for q in rows:
        if len(q["excerpt"]) > EXCERPT_BYTES:
            q["excerpt"] = q["excerpt"][:EXCERPT_BYTES] + "…"


# Lines per batch-path chunk, at most: a chunk is at most a block (a few MB) of lines,
# but short lines would otherwise make a chunk's columns large.
CHUNK_LINES = 8192


@dataclass(frozen=True)
class FileOptions:
    """Everything :func:`process_file` needs besides the file: what a pool worker is started with."""

    redact: bool = True
    max_line_bytes: int = 8 << 20
    s3: S3Config | None = None
    client: Any = None  # an S3 client for s3:// files; None: one is made from ``s3`` when needed
    chunk_lines: int = CHUNK_LINES
    block_bytes: int = BLOCK_BYTES

    @classmethod
    def of(cls, capture: CaptureConfig, s3: S3Config, client: Any = None) -> FileOptions:
        return cls(redact=capture.redact, max_line_bytes=capture.max_line_bytes, s3=s3, client=client)

    def with_client(self) -> FileOptions:
        """These options with an S3 client made (once, where many files are read with them)."""
        return self if self.client is not None or self.s3 is None else replace(self, client=s3_client(self.s3))
EPOCH_DAY = date(1970, 1, 1)

# The columns of the whole exchange (capture.warehouse.SCHEMA), as Conversation names them;
# the JSON text ones are what redaction walks besides the turns.
EXCHANGE_TEXT = ("messages", "tools", "tool_choice", "chat_template_kwargs")
EXCHANGE_COLUMNS = (*EXCHANGE_TEXT, "finish_reason", "prompt_token_ids", "output_token_ids")
TOKEN_ID_COLUMNS = ("prompt_token_ids", "output_token_ids")
# Counted in a run's redactions: rows whose token ids were dropped because redaction changed
# the row (ids decode to the text they came from, secret included).
IDS_DROPPED = "token_ids_dropped_redacted"


def _storable(*texts: str | None) -> bool:
    """False if a text holds a lone surrogate, which JSON escapes allow and UTF-8 (so Arrow) cannot."""
    for t in texts:
        if t is not None and not t.isascii():
            try:
                t.encode("utf-8")
            except UnicodeEncodeError:
                return False
    return True


class _PerLine:
    """Rows of the lines the per-line path decided, as columns."""

    def __init__(self) -> None:
        self.cols: dict[str, list] = {k: [] for k in ("line_no", "event_id", "inference_id", "inference_time", "format",
                                                      "raw", "model", "temperature", "top_p", "max_tokens",
                                                      *EXCHANGE_COLUMNS)}
        self.offsets = [0]
        self.t_from: list[str] = []
        self.t_value: list[str] = []

    def decide(self, line: bytes, line_no: int, obj: SourceObject, max_line: int, res: FileResult) -> None:
        """Decode one line with the reference decoder; file its row or its reject."""
        try:
            if len(line) > max_line:
                raise Reject("quarantine", "line_too_large", f"{len(line)} bytes > {max_line}")
            rec = decode_line(line)
            conv = to_conversation(rec.request, rec.response)
            when = rec.inference_time or obj.hour
            if when is None:
                raise Reject("quarantine", "missing_field", "eventMetadata.inferenceTime (and no layout hour)")
            turns = conv.turns
            if not _storable(rec.event_id, rec.inference_id, conv.model, conv.finish_reason, *(v for _, v in turns),
                             *(getattr(conv, k) for k in EXCHANGE_TEXT)):
                raise Reject("quarantine", "invalid_utf8", "decoded text holds a lone surrogate (a \\ud800-style escape)")
        except Reject as rej:
            if rej.kind == "skip":
                res.skips[rej.reason] += 1
            else:
                res.quarantine.append(_quarantined(obj, line_no, rej.reason, rej.detail, line))
            return
        except Exception as exc:  # a decoder bug must not lose the rest of the file
            res.quarantine.append(_quarantined(obj, line_no, "internal_error", f"{type(exc).__name__}: {exc}", line))
            return
        for frm, v in turns:
            self.t_from.append(frm)
            self.t_value.append(v)
        self.offsets.append(len(self.t_from))
        c = self.cols
        c["line_no"].append(line_no)
        c["event_id"].append(rec.event_id)
        c["inference_id"].append(rec.inference_id)
        c["inference_time"].append(when)
        c["format"].append(conv.format)
        c["raw"].append(conv.raw)
        c["model"].append(conv.model)
        c["temperature"].append(conv.temperature)
        c["top_p"].append(conv.top_p)
        c["max_tokens"].append(conv.max_tokens)
        for k in EXCHANGE_COLUMNS:
            c[k].append(getattr(conv, k))

    def batch(self) -> pa.RecordBatch:
        return rows_batch(offsets=self.offsets, t_from=self.t_from, t_value=self.t_value, **self.cols)


def process_file(obj: SourceObject, opts: FileOptions, batch: bool = True) -> FileResult:
    """Decode, normalize and redact every line of one capture file (runs in a worker).

    The file is read in blocks of whole lines (:func:`capture.sources.iter_blocks`); the
    batch path (:mod:`capture.batchpath`) decodes up to ``opts.chunk_lines`` lines of a block
    at a time, finding the lines itself. The lines it declines, and every line when ``batch``
    is false, go through the per-line path (the reference decoder).
    """
    redact, max_line, chunk_lines = opts.redact, opts.max_line_bytes, opts.chunk_lines
    res = FileResult(obj=obj)
    parts: list[pa.RecordBatch] = []
    hash_parts: list[pa.Array] = []  # the native decoder's hashes of the rows in `parts`
    unchecked = 0  # rows of `parts` the decoder kept without vouching that they are first
    in_file = HashSet()
    per_line = _PerLine()
    line_no = 0  # lines before the chunk at hand
    try:
        for block in iter_blocks(obj.uri, client=opts.client, s3=opts.s3, block_size=opts.block_bytes,
                                 max_line=max_line):
            if isinstance(block, LongLine):  # over the cap, and not read into memory
                line_no += 1
                res.quarantine.append(_quarantined(obj, line_no, "line_too_large", f"{block.size} bytes > {max_line}",
                                                   block.head, block.size))
                continue
            pos = 0
            while pos < len(block):
                if batch:
                    got = decode_block(block, pos, line_no + 1, chunk_lines, max_line, obj.hour, in_file)
                    if got.batch.num_rows:
                        parts.append(got.batch)
                        if got.hashes is not None:
                            hash_parts.append(got.hashes)
                    res.skips.update(got.skips)
                    res.file_duplicates += got.duplicates
                    unchecked += got.unchecked
                    for i, line in zip(got.declined, got.declined_lines):
                        per_line.decide(line, line_no + 1 + i, obj, max_line, res)
                    n, pos = got.lines, got.end
                else:
                    lines, pos = split_block(block, pos, chunk_lines)
                    for i, line in enumerate(lines):
                        per_line.decide(line, line_no + 1 + i, obj, max_line, res)
                    n = len(lines)
                line_no += n
    except ObjectMissing:
        res.missing = True
        return res
    except (OSError, BotoCoreError) as exc:
        # A read that fails part-way (connection reset, I/O error): drop what was read of
        # this file, leave it out of the manifest, and let the next run read it whole.
        res.missing = True
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    res.read = line_no
    hashes = pa.chunked_array(hash_parts, pa.string()) if len(hash_parts) == len(parts) else None
    if len(per_line.offsets) > 1:
        parts.append(per_line.batch())
        hashes = None
    rows = pa.Table.from_batches(parts, schema=ROW_SCHEMA)
    if len(parts) > 1 and len(per_line.offsets) > 1:
        rows = rows.sort_by("line_no")  # per-line rows interleave with the batch rows
    res.table, res.row_redactions, dropped = _finish(rows, obj, redact, hashes, unique=not unchecked)
    res.file_duplicates += dropped
    res.table, res.row_redactions, res.file_stitched, pre = stitch_file(res.table, res.row_redactions)
    res.prefixes = pre if len(pre) else None
    _finish_quarantine(res.quarantine, redact)
    return res


def _finish(rows: pa.Table, obj: SourceObject, redact: bool, hashes: pa.ChunkedArray | None = None,
            unique: bool = False) -> tuple[pa.Table, list[tuple[int, dict[str, int]]], int]:
    """Redact the turns, hash each conversation, drop in-file replays, lay the rows out in :data:`SCHEMA`.

    Replays within the file are dropped here (the first copy is kept, as the run-wide
    dedupe in the parent would) so that the parent, which runs alone, copies less. Most
    are gone already: the native decoder drops them unless rows came from elsewhere or
    redaction made rows alike. ``hashes``, the decoder's hashes of ``rows``, are used
    unless redaction changed a turn; ``unique`` says the decoder vouched for every row.
    """
    n = rows.num_rows
    convs = _combined(rows.column("conversations"))
    offsets = convs.offsets
    if n and offsets[0].as_py():
        offsets = pc.subtract(offsets, offsets[0])
    turns = convs.flatten()
    t_from, t_value = turns.field("from"), turns.field("value")
    row_redactions: list[tuple[int, dict[str, int]]] = []
    changed = {}
    per_row: dict[int, dict[str, int]] = {}
    if redact:
        # Vectorized over every turn of the file; see capture.redact for why.
        t_value, changed = redact_array(t_value)
        if changed:
            offs = offsets.to_numpy()
            for i, counts in changed.items():
                row = int(np.searchsorted(offs, i, side="right")) - 1
                acc = per_row.setdefault(row, {})
                for k, c in counts.items():
                    acc[k] = acc.get(k, 0) + c
            convs = pa.ListArray.from_arrays(offsets, pa.StructArray.from_arrays([t_from, t_value], fields=list(TURN)))
    exchange = _exchange_columns(rows, redact, per_row)
    if exchange.turns:
        # A secret inside a tool call's arguments is escaped twice in the turn's JSON text, where a
        # labelled one ("password": ...) escapes the redactor: those turns are remade from the
        # redacted messages (one turn a message), and redacted once more.
        values = t_value.to_pylist()
        offs = offsets.to_numpy(zero_copy_only=False)
        at: list[int] = []
        for r, texts in exchange.turns.items():
            a, b = int(offs[r]), int(offs[r + 1])
            if len(texts) == b - a:
                values[a:b] = texts
                at.extend(range(a, b))
        again = [values[i] for i in at]
        more = redact_values(again)
        for j, counts in more.items():
            values[at[j]] = again[j]
            row = int(np.searchsorted(offs, at[j], side="right")) - 1
            acc = per_row.setdefault(row, {})
            for k, c in counts.items():
                acc[k] = acc.get(k, 0) + c
        t_value = pa.array(values, pa.string())
        convs = pa.ListArray.from_arrays(offsets, pa.StructArray.from_arrays([t_from, t_value], fields=list(TURN)))
    row_redactions = sorted(per_row.items())
    # The hash is of the stored (redacted) text: what dedupe compares is what is kept. The
    # decoder's hash of a row kept exactly is already _exact_hashes' (see row_serialize in
    # capture/_native/module.c); it stands where redaction changed no row.
    if hashes is None or changed or len(hashes) != n:
        hashes, unique, decoded = content_hashes(offsets, t_from, t_value), False, False
    else:
        hashes, decoded = _combined(hashes), True
    if exchange.exact and not (decoded and not per_row):
        hashes, unique = _exact_hashes(hashes, exchange, offsets, t_from, t_value), False
    arrays = []
    for f in SCHEMA:
        if f.name in ("id", "content_hash"):
            arrays.append(hashes)
        elif f.name == "conversations":
            arrays.append(convs)
        elif f.name in ("endpoint", "variant", "source_uri"):
            v = {"endpoint": obj.endpoint, "variant": obj.variant, "source_uri": obj.uri}[f.name]
            arrays.append(_repeat(v, n))
        elif f.name == "run_id":
            arrays.append(pa.nulls(n, f.type))
        elif f.name in exchange.columns:
            arrays.append(exchange.columns[f.name])
        else:
            arrays.append(rows.column(f.name))
    table = pa.Table.from_arrays(arrays, schema=SCHEMA)
    if unique:
        return table, row_redactions, 0
    keep = _first_in(hashes)
    dropped = n - int(keep.sum())
    if dropped:
        table = _select(table, keep)
        new_index = np.cumsum(keep) - 1
        row_redactions = [(int(new_index[i]), c) for i, c in row_redactions if keep[i]]
    return table, row_redactions, dropped


@dataclass
class _Exchange:
    """The exchange columns of a file's rows after redaction, and which rows are kept exactly."""

    columns: dict[str, pa.Array]
    exact: list[int]  # rows with a structured exchange or token ids
    turns: dict[int, list[str]] = field(default_factory=dict)  # rows whose turn values redaction rebuilt


def _exchange_columns(rows: pa.Table, redact: bool, per_row: dict[int, dict[str, int]]) -> _Exchange:
    """Redact every string in the JSON of the exchange columns (values, not keys) and drop the
    token ids of each row that redaction changed (counted in ``per_row`` as :data:`IDS_DROPPED`).

    Only the reference decoder fills these columns, so for most files they are all null and this
    costs a null count. A JSON string is redacted as the text it decodes to (an escape cannot hide
    a secret): the redaction gate runs over each JSON text with its escapes undone (every string
    of it then stands in it whole, between quotes), and only the rows it flags are parsed and
    their strings redacted one by one.
    """
    n = rows.num_rows
    cols = {k: _combined(rows.column(k)) for k in EXCHANGE_COLUMNS}
    present = [k for k in (*EXCHANGE_TEXT, *TOKEN_ID_COLUMNS) if cols[k].null_count < n]
    if not present:
        return _Exchange(columns=cols, exact=[])
    valid = np.zeros(n, dtype=bool)
    for k in present:
        valid |= _bool_mask(pc.is_valid(cols[k]))
    exact = np.flatnonzero(valid).tolist()
    if not redact:
        return _Exchange(columns=cols, exact=exact)
    suspects: set[int] = set()
    for k in EXCHANGE_TEXT:
        if k in present:
            suspects.update(flagged_json(cols[k]))
    texts = {k: cols[k].to_pylist() for k in EXCHANGE_TEXT if k in present} if suspects else {}
    parsed: list[tuple[str, int, list]] = []
    leaves: list[str] = []
    slots: list[tuple[int, list | dict, Any]] = []  # (parsed index, container, key) of each leaf

    def walk(owner: int, container: list | dict, key: Any) -> None:
        v = container[key]
        if isinstance(v, str):
            slots.append((owner, container, key))
            leaves.append(v)
        elif isinstance(v, list):
            for i in range(len(v)):
                walk(owner, v, i)
        elif isinstance(v, dict):
            for k in v:
                walk(owner, v, k)

    for k, values in texts.items():
        for r in sorted(suspects):
            if values[r] is not None:
                box = [json.loads(values[r])]
                parsed.append((k, r, box))
                walk(len(parsed) - 1, box, 0)
    changed = redact_values(leaves) if leaves else {}  # in place; {leaf index: {kind: count}}
    rebuilt: dict[int, list[str]] = {}
    if changed:
        dirty = set()
        for i, counts in changed.items():
            owner, container, key = slots[i]
            container[key] = leaves[i]
            dirty.add(owner)
            acc = per_row.setdefault(parsed[owner][1], {})
            for kind, c in counts.items():
                acc[kind] = acc.get(kind, 0) + c
        for owner in dirty:
            k, r, box = parsed[owner]
            texts[k][r] = json.dumps(box[0], ensure_ascii=False, separators=(",", ":"))
            if k == "messages":
                rebuilt[r] = turn_texts(box[0])
        for k, values in texts.items():
            cols[k] = pa.array(values, pa.string())
    if per_row:
        # Ids decode to the text they came from: a row redaction changed keeps the redacted text only.
        exact_set = set(exact)
        has_ids = [r for r in per_row if r in exact_set and any(cols[k][r].is_valid for k in TOKEN_ID_COLUMNS)]
        if has_ids:
            mask = np.zeros(n, dtype=bool)
            mask[has_ids] = True
            m = pa.array(mask)
            for k in TOKEN_ID_COLUMNS:
                cols[k] = pc.if_else(m, pa.nulls(n, cols[k].type), cols[k])
            for r in has_ids:
                per_row[r][IDS_DROPPED] = per_row[r].get(IDS_DROPPED, 0) + 1
    return _Exchange(columns=cols, exact=exact, turns=rebuilt)


def turn_texts(messages: list[dict]) -> list[str]:
    """The ShareGPT values of a row's ``messages`` (as :func:`capture.formats.to_conversation` makes
    them: the content's text, or the tool calls as JSON text where there is none)."""
    out = []
    for m in messages:
        text = content_text(m.get("content"), "messages")
        if not text and m.get("tool_calls"):
            text = json.dumps(m["tool_calls"], ensure_ascii=False)
        out.append(text)
    return out


def _bool_mask(arr: pa.Array | pa.ChunkedArray) -> np.ndarray:
    return np.asarray(arr.to_numpy(zero_copy_only=False), dtype=bool)


def _exact_hashes(hashes: pa.Array, ex: _Exchange, offsets: pa.Array, t_from: pa.Array,
                  t_value: pa.Array) -> pa.Array:
    """Content hashes of the rows kept exactly: their turns and their exchange columns.

    Two requests alike in text but not in tools, reasoning or ids are two examples, not a
    replay. And since no prefix hash (:mod:`capture.stitch`, turns only) can equal such a hash,
    a row kept exactly is never stitched away into a longer row that would lose it: each such
    request stays its own example. It can still stand for plain rows that are its prefixes.
    """
    # Vectorized: each exact row's turns, then its exchange as more turns, laid out by one take
    # and hashed natively (a Python content_hash a row cost more than decoding the row in C).
    exact = np.asarray(ex.exact, dtype=np.int64)
    m, k = len(exact), len(EXCHANGE_COLUMNS) + 1
    rows = pa.array(exact, pa.int64())
    fields = [pa.nulls(m, pa.string()).fill_null("")]
    for name in EXCHANGE_COLUMNS:
        col = ex.columns[name].take(rows)
        if not pa.types.is_string(col.type):  # token ids: json.dumps of the list
            col = pc.binary_join_element_wise("[", pc.binary_join(pc.cast(col, pa.list_(pa.string())), ", "), "]", "")
        fields.append(pc.fill_null(col, ""))
    n_turns = len(t_value)
    # The added turns of exact row j are n_turns + j * k ... + k - 1 of the concatenation below.
    order = (np.arange(k, dtype=np.int64)[None, :] * m + np.arange(m, dtype=np.int64)[:, None]).ravel()
    added_value = pa.concat_arrays([f.cast(pa.string()) for f in fields]).take(pa.array(order))
    added_from = pa.array(["\x1fexchange", *EXCHANGE_COLUMNS] * m, pa.string())
    offs = offsets.to_numpy(zero_copy_only=False).astype(np.int64)
    starts = np.empty(2 * m, dtype=np.int64)
    lens = np.empty(2 * m, dtype=np.int64)
    starts[0::2], lens[0::2] = offs[exact], offs[exact + 1] - offs[exact]
    starts[1::2], lens[1::2] = n_turns + np.arange(m, dtype=np.int64) * k, k
    seg_at = np.concatenate(([0], np.cumsum(lens)[:-1]))
    idx = np.repeat(starts - seg_at, lens) + np.arange(int(lens.sum()), dtype=np.int64)
    take = pa.array(idx, pa.int64())
    frm = pa.concat_arrays([t_from.cast(pa.string()), added_from]).take(take)
    val = pa.concat_arrays([t_value.cast(pa.string()), added_value]).take(take)
    row_offs = np.concatenate(([0], np.cumsum(lens[0::2] + k))).astype(np.int32)
    got = content_hashes(pa.array(row_offs, pa.int32()), frm, val).to_pylist()
    out = hashes.to_pylist()
    for j, r in enumerate(ex.exact):
        out[r] = got[j]
    return pa.array(out, pa.string())


def _combined(col: pa.ChunkedArray) -> pa.Array:
    """``col.combine_chunks()``, but without chunks an empty array: combining no chunks imports pandas
    (~0.3 s of CPU in a worker)."""
    return col.combine_chunks() if col.num_chunks else pa.nulls(0, col.type)


def _repeat(value: str, n: int) -> pa.Array:
    """``pa.repeat(pa.scalar(value), n)`` built from buffers: pa.scalar imports pandas (see :func:`_numbers`)."""
    data = value.encode("utf-8")
    offsets = np.arange(n + 1, dtype=np.int64) * len(data)
    if offsets[-1] > np.iinfo(np.int32).max:
        return pa.repeat(pa.scalar(value, pa.string()), n)
    return pa.Array.from_buffers(pa.string(), n, [None, pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(data * n)])


def _numbers(arr: pa.Array) -> np.ndarray:
    """A signed integer Arrow array without nulls as numpy, read from its buffer.

    ``to_numpy`` would import pandas: ~0.14 s of CPU in each worker process.
    """
    if not pa.types.is_signed_integer(arr.type) or arr.null_count:
        return arr.to_numpy(zero_copy_only=False)
    dtype = np.dtype(f"int{arr.type.bit_width}")
    if not len(arr):
        return np.empty(0, dtype)
    return np.frombuffer(arr.buffers()[1], dtype=dtype)[arr.offset: arr.offset + len(arr)]


def _first_in(hashes: pa.Array) -> np.ndarray:
    """``dedupe.first_seen(hashes, set())`` without a Python object per row (which also costs GC passes).

    Dictionary codes are handed out in order of first appearance, so a row is the first of
    its hash exactly where its code exceeds every code before it.
    """
    codes = _numbers(pc.dictionary_encode(hashes).indices)
    keep = np.ones(len(codes), dtype=bool)
    if len(codes) > 1:
        keep[1:] = codes[1:] > np.maximum.accumulate(codes)[:-1]
    return keep


def _select(table: pa.Table, keep: list[bool] | np.ndarray) -> pa.Table:
    """``table.filter(keep)``, but as zero-copy slices when the kept rows form a few long runs.

    Filtering copies every byte of the rows kept; slicing copies nothing, but many short
    slices slow the Parquet writer down more than the copy would.
    """
    mask = np.asarray(keep, dtype=np.int8)
    edges = np.flatnonzero(np.diff(mask, prepend=0, append=0))  # run starts and ends, alternating
    if len(edges) > 32:
        # A bitmap from numpy: pa.array would import pandas (~0.14 s of CPU per worker process).
        bits = np.packbits(mask.astype(bool), bitorder="little")
        return table.filter(pa.Array.from_buffers(pa.bool_(), len(mask), [None, pa.py_buffer(bits)]))
    return pa.concat_tables([table.slice(a, b - a) for a, b in zip(edges[::2], edges[1::2])] or [table.slice(0, 0)])


def content_hashes(offsets: pa.Array, t_from: pa.Array, t_value: pa.Array) -> pa.Array:
    """:func:`content_hash` of each row of a turn column (``offsets`` per row), as an Arrow array.

    The native module hashes straight from the Arrow buffers; without it, one Arrow kernel
    lays out every turn's ``from:len:value`` (``len`` there counts code points, as Python's
    does) back to back, so a row's serialization is a slice of that buffer, and only the
    blake2b call per row is Python.
    """
    n = len(offsets) - 1
    if n <= 0:
        return pa.nulls(0, pa.string())
    nat = backend.native()
    if nat is not None and _plain_utf8(t_from) and _plain_utf8(t_value) and len(t_from) == len(t_value):
        rows = np.ascontiguousarray(_numbers(offsets), dtype=np.int32)
        # No nulls (checked above): the validity buffers are not passed.
        hexes = nat.content_hashes(rows, *native.utf8_args(t_from)[:4], *native.utf8_args(t_value)[:4])
    else:
        hexes = _content_hashes_hashlib(offsets, t_from, t_value)
    bounds = np.arange(0, 32 * (n + 1), 32, dtype=np.int32)
    return pa.StringArray.from_buffers(n, pa.py_buffer(bounds), pa.py_buffer(hexes))


def _plain_utf8(arr: pa.Array) -> bool:
    return arr.type == pa.string() and not arr.null_count


def _content_hashes_hashlib(offsets: pa.Array, t_from: pa.Array, t_value: pa.Array) -> bytes:
    """The hex digests of :func:`content_hashes`, concatenated, with hashlib."""
    lens = pc.cast(pc.utf8_length(t_value), pa.string())
    flat = pc.binary_join_element_wise(t_from, lens, t_value, ":")
    if flat.null_count or flat.offset or pa.types.is_large_string(flat.type):
        flat = pa.array(flat.to_pylist(), pa.string())  # not expected; keeps the buffer walk simple
    turn_ends = np.frombuffer(flat.buffers()[1], dtype=np.int32)[: len(flat) + 1]
    ends = turn_ends[offsets.to_numpy(zero_copy_only=False)].tolist()
    data = memoryview(flat.buffers()[2] or b"")
    blake = hashlib.blake2b
    digests = b"".join([blake(data[a:b], digest_size=16).digest() for a, b in zip(ends, ends[1:])])
    return digests.hex().encode("ascii")


def handoff_dir() -> str:
    """Where pool workers leave their tables for the parent: shared memory where there is some."""
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def handoff_prefix(parent_pid: int) -> str:
    """The name prefix of the handoff files of the run in process ``parent_pid``."""
    return f"drafter-ingest-{parent_pid}-"


def hand_over(fr: FileResult, directory: str | None = None) -> FileResult:
    """``fr`` with its table moved to an Arrow file in ``directory`` (default :func:`handoff_dir`),
    for the parent process to map (:func:`take_over`); as it was where the file cannot be written.

    Pickling a table through the pool's pipe costs two copies and a pickle pass on each side;
    the parent maps this file instead, and reads it without copying.
    """
    if fr.table is not None and fr.table.num_rows:
        path = None
        try:
            fd, path = tempfile.mkstemp(prefix=handoff_prefix(os.getppid()), suffix=".arrow",
                                        dir=directory or handoff_dir())
            with os.fdopen(fd, "wb") as f, ipc.new_file(f, fr.table.schema) as w:
                w.write_table(fr.table)
        except OSError:  # shared memory full or unwritable: send the table through the pipe instead
            if path is not None:
                os.unlink(path)
            return fr
        fr.table, fr.table_file = None, path
    return fr


# A pool worker's options, set once by its initializer (each worker is a process of its own).
_worker_opts: FileOptions | None = None


def _init_worker(opts: FileOptions, on_start: Callable[[], None] | None) -> None:
    global _worker_opts
    _worker_opts = opts
    if on_start is not None:
        on_start()


def _process_in_pool(obj: SourceObject) -> FileResult:
    """:func:`process_file` in a pool worker, its table handed over in shared memory."""
    global _worker_opts
    assert _worker_opts is not None, "the pool's initializer sets the options"
    if obj.uri.startswith("s3://"):
        _worker_opts = _worker_opts.with_client()  # one client per worker, not one per file
    return hand_over(process_file(obj, _worker_opts))


def take_over(path: str) -> pa.Table:
    """The table a worker handed over in ``path`` (:func:`hand_over`); the file is removed."""
    # The mapping outlives the unlink; the memory goes when the table does.
    table = ipc.open_file(pa.memory_map(path)).read_all()
    os.unlink(path)
    return table


def _drop_handoffs() -> None:
    """Remove handoff files a failed run left behind (the parent unlinks each one it reads)."""
    for p in glob.glob(os.path.join(handoff_dir(), handoff_prefix(os.getpid()) + "*.arrow")):
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


class _Sink:
    """Runs the writes of a run off the parent's main thread: Parquet parts on a few threads, commits in order.

    pyarrow's Parquet writer and DuckDB release the GIL, so the parent goes on taking worker
    results and deduplicating while parts are compressed and written; otherwise the parent,
    which alone writes, finishes long after the workers. A commit waits for every part
    submitted before it and names exactly those. At most ``depth`` parts wait to be written,
    so buffered rows cannot pile up faster than they are written.
    """

    def __init__(self, writers: int = 2, depth: int = 4) -> None:
        self.writers = ThreadPoolExecutor(writers, thread_name_prefix="ingest-write")
        self.committer = ThreadPoolExecutor(1, thread_name_prefix="ingest-commit")
        self.depth = depth
        self.parts: list[Future] = []  # part writes not yet handed to a commit
        self.inflight: list[Future] = []  # every write and commit not yet known to have succeeded

    def _reap(self, block_beyond: int) -> None:
        """Raise the first failure among finished tasks; wait while more than ``block_beyond`` are running."""
        while self.inflight and (self.inflight[0].done() or len(self.inflight) > block_beyond):
            self.inflight.pop(0).result()

    def write(self, task: Callable[[], dict]) -> None:
        """Run ``task`` (which writes one part and returns its catalog entry) on a writer thread."""
        self._reap(self.depth)
        f = self.writers.submit(task)
        self.parts.append(f)
        self.inflight.append(f)

    def commit(self, task: Callable[[list[dict]], None]) -> None:
        """Run ``task(files)`` once every part written so far is written; ``files`` are their entries."""
        parts, self.parts = self.parts, []
        self._reap(self.depth)
        f = self.committer.submit(lambda: task([p.result() for p in parts]))
        self.inflight.append(f)

    def close(self) -> None:
        """Wait for every task; raise the first error any of them raised."""
        try:
            self._reap(0)
        finally:
            self.abort()

    def abort(self) -> None:
        """Drop the tasks not started (the run failed: nothing more may be committed) and wait for the rest."""
        self.committer.shutdown(wait=True, cancel_futures=True)
        self.writers.shutdown(wait=True, cancel_futures=True)


class _Run:
    """Parent-side state of a run: dedupe and stitching, Parquet buffers, checkpoints (written by a :class:`_Sink`)."""

    def __init__(self, wh: Warehouse, run_id: str, known: Known, known_seq: int, result: IngestResult,
                 sink: _Sink) -> None:
        self.wh, self.run_id, self.known, self.result, self.sink = wh, run_id, known, result, sink
        # Other writers: ``known`` holds what they committed up to ``merged_seq``; the rows of the
        # checkpoint being gathered were decided with at least what it held at ``batch_seq``.
        self.merged_seq = self.batch_seq = known_seq
        self._commits_lock = threading.Lock()
        self._commits: list[Committed] = []  # commits done on the sink's thread, not yet merged here
        self.corrections: Counter = Counter()  # what reconciling with other writers changed in the counts
        self.catalog_files = 0  # the catalog's content_hashes files, as the final commit found them
        self._at_last: dict[str, Any] = {"redactions": {}}  # the totals at the last checkpoint
        self.buffers: dict[date, list[pa.Table]] = {}
        self.seq = 0
        self.pending_manifest: list[dict] = []
        self.pending_quarantine: list[dict] = []
        self.pending_skips: list[dict] = []
        self.pending_hashes: list[pa.Array] = []
        self.pending_prefixes: list[tuple[pa.Array, pa.Array]] = []  # (prefix hash, content hash of its row)
        self.pending_superseded: list[tuple[pa.Array, pa.Array]] = []  # (content hash, by content hash)
        # Rows this run took in and a later row superseded, until the checkpoint finds whether
        # they were dropped from a buffer (``pruned``) or written before (then they go to ``superseded``).
        self.doomed: list[tuple[pa.Array, pa.Array]] = []
        self._doomed_set: pa.Array | None = None
        self.pruned: list[pa.Array] = []
        self.pending_bytes = 0

    def _merge(self) -> None:
        """Take what other writers committed (as the last commits found) into the dedupe sets."""
        with self._commits_lock:
            got, self._commits = self._commits, []
        for c in got:
            self.known.stored.add_new(c.others_hashes)
            self.known.prefixes.add_new(c.others_prefixes)
            self.known.gone.add_new(c.others_superseded)
            self.merged_seq = max(self.merged_seq, c.seq)
            self.corrections.update(c.corrections)
            self.catalog_files = max(self.catalog_files, c.catalog_files)

    def add(self, fr: FileResult) -> None:
        self._merge()
        r = self.result
        if fr.missing:
            if fr.error:
                log.warning("could not read %s (%s); it will be retried", fr.obj.uri, fr.error)
            else:
                log.warning("capture object vanished between list and read: %s", fr.obj.uri)
            r.missing_objects += 1
            return
        r.objects += 1
        r.read += fr.read
        n_q = len(fr.quarantine)
        n_s = sum(fr.skips.values())
        r.quarantined += n_q
        r.skipped += n_s
        for q in fr.quarantine:
            r.quarantine_reasons[q["reason"]] = r.quarantine_reasons.get(q["reason"], 0) + 1
        for reason, c in fr.skips.items():
            r.skip_reasons[reason] = r.skip_reasons.get(reason, 0) + c
            self.pending_skips.append({"source_uri": fr.obj.uri, "reason": reason, "count": c})
        self.pending_quarantine.extend(fr.quarantine)
        kept, dups, stitched = 0, fr.file_duplicates, fr.file_stitched
        if fr.table_file is not None:
            fr.table = take_over(fr.table_file)
        t = fr.table
        if t is not None and t.num_rows:
            d = self.known.decide(t.column("content_hash"), fr.prefixes)
            mask = d.keep
            kept = int(np.count_nonzero(mask))
            dups += d.duplicates
            stitched += d.stitched
            if kept < len(mask):
                t = _select(t, mask)
            for i, counts in fr.row_redactions:
                if mask[i]:
                    for k, c in counts.items():
                        r.redactions[k] = r.redactions.get(k, 0) + c
            if kept:
                t = t.set_column(SCHEMA.get_field_index("run_id"), "run_id", _repeat(self.run_id, kept))
                self.pending_hashes.extend(t.column("content_hash").chunks)
                self._buffer(t)
            if len(d.prefix_hashes):
                self.pending_prefixes.append((d.prefix_hashes, d.prefix_of))
            if len(d.stored_gone):  # rows of earlier runs: recorded as superseded
                self.pending_superseded.append((d.stored_gone, d.stored_by))
                r.superseded += len(d.stored_gone)
            if len(d.run_gone):  # rows of this run: now stitched, not normalized (and not written if still buffered)
                self.doomed.append((d.run_gone, d.run_by))
                self._doomed_set = None
                r.normalized -= len(d.run_gone)
                r.stitched += len(d.run_gone)
        r.normalized += kept
        r.duplicates += dups
        r.stitched += stitched
        if fr.read != kept + dups + stitched + n_q + n_s:
            raise RuntimeError(f"line accounting broke for {fr.obj.uri}: "
                               f"{fr.read} != {kept}+{dups}+{stitched}+{n_q}+{n_s}")
        self.pending_manifest.append(
            {"source_uri": fr.obj.uri, "etag": fr.obj.etag, "size": fr.obj.size, "read": fr.read, "normalized": kept,
             "duplicates": dups, "stitched": stitched, "quarantined": n_q, "skipped": n_s}
        )
        self.pending_bytes += fr.obj.size

    def _buffer(self, t: pa.Table) -> None:
        # Days since the epoch from the date32 buffers: pa.scalar and to_pylist would import
        # pandas into the parent (~0.4 s of CPU per run).
        col = t.column("dt")
        days = np.concatenate([_numbers(c.view(pa.int32())) for c in col.chunks]) if col.num_chunks else np.empty(0, np.int32)
        uniq = np.unique(days)
        touched = set()
        for day in uniq:
            d = EPOCH_DAY + timedelta(days=int(day))
            touched.add(d)
            self.buffers.setdefault(d, []).append(t if len(uniq) == 1 else _select(t, days == day))
            if self._rows(d) >= PART_ROWS:
                self._flush_day(d)
        for d in [d for d in self.buffers if d not in touched and self._rows(d) >= PART_MIN_ROWS]:
            self._flush_day(d)

    def _rows(self, d: date) -> int:
        return sum(t.num_rows for t in self.buffers.get(d, ()))

    def _flush_day(self, d: date) -> None:
        tables = self._prune(self.buffers.pop(d, []))
        if not tables:
            return
        self.seq += 1
        seq = self.seq

        def write() -> dict:
            t = pa.concat_tables(tables)
            path, size = self.wh.write_part(t, d, self.run_id, seq)
            return {"path": path, "dt": d, "rows": t.num_rows, "bytes": size}

        self.sink.write(write)

    def _prune(self, tables: list[pa.Table]) -> list[pa.Table]:
        """``tables`` without the rows this run superseded (before they are written); notes which those were."""
        if not self.doomed or not tables:
            return tables
        if self._doomed_set is None:
            self._doomed_set = pa.concat_arrays([h for h, _ in self.doomed])
        out = []
        for t in tables:
            gone = pc.is_in(t.column("content_hash"), value_set=self._doomed_set)
            if pc.any(gone).as_py():
                self.pruned.append(t.filter(gone).column("content_hash").combine_chunks())
                t = t.filter(pc.invert(gone))
            if t.num_rows:
                out.append(t)
        return out

    def _settle_doomed(self) -> None:
        """After every buffer is written: the superseded rows of this run that were written go to
        ``superseded``; those dropped from their buffer leave ``content_hashes`` (no part holds them)."""
        if not self.doomed:
            return
        gone = pa.concat_arrays([h for h, _ in self.doomed])
        by = pa.concat_arrays([b for _, b in self.doomed])
        if self.pruned:
            pruned = pa.concat_arrays(self.pruned)
            written = pc.invert(pc.is_in(gone, value_set=pruned))
            gone, by = gone.filter(written), by.filter(written)
            self.pending_hashes = [h.filter(pc.invert(pc.is_in(h, value_set=pruned))) for h in self.pending_hashes]
        if len(gone):
            self.pending_superseded.append((gone, by))
        self.doomed, self._doomed_set, self.pruned = [], None, []

    def checkpoint(self, final: bool) -> None:
        """Write every buffer, then commit everything pending in one transaction (on the sink thread)."""
        for d in list(self.buffers):
            self._flush_day(d)
        self._settle_doomed()
        r = self.result
        counts = {k: getattr(r, k) - self._at_last.get(k, 0) for k in RUN_COUNTS}
        redactions = {k: v - self._at_last["redactions"].get(k, 0) for k, v in r.redactions.items()}
        self._at_last = {**{k: getattr(r, k) for k in RUN_COUNTS}, "redactions": dict(r.redactions)}
        cp = Checkpoint(manifest=self.pending_manifest, quarantine=self.pending_quarantine,
                        skipped=self.pending_skips, hashes=pa.chunked_array(self.pending_hashes, pa.string()),
                        prefixes=_pairs(self.pending_prefixes, ("prefix_hash", "content_hash")),
                        superseded=_pairs(self.pending_superseded, ("content_hash", "by_hash")),
                        counts=counts, redactions={k: v for k, v in redactions.items() if v}, known_seq=self.batch_seq,
                        final=final)
        self._merge()
        self.batch_seq = self.merged_seq  # the next checkpoint's rows are decided with at least this

        def commit(files: list[dict]) -> None:
            cp.files = files
            done = self.wh.commit(self.run_id, cp)
            with self._commits_lock:
                self._commits.append(done)

        self.sink.commit(commit)
        self.pending_manifest, self.pending_quarantine, self.pending_skips = [], [], []
        self.pending_hashes, self.pending_prefixes, self.pending_superseded = [], [], []
        self.pending_bytes = 0

    def finish(self) -> None:
        """After the last commit: the run's counts as committed (reconciled with other writers)."""
        self._merge()
        r = self.result
        for k, v in self.corrections.items():
            setattr(r, k, getattr(r, k) + v)


def _pairs(pairs: list[tuple[pa.Array, pa.Array]], names: tuple[str, str]) -> pa.Table | None:
    """Two string columns from pairs of arrays, or ``None`` when there are none."""
    if not pairs:
        return None
    return pa.Table.from_arrays([pa.chunked_array([a for a, _ in pairs], pa.string()),
                                 pa.chunked_array([b for _, b in pairs], pa.string())], names=list(names))


def _workers(capture: CaptureConfig, objs: list[SourceObject]) -> int:
    want = capture.workers or min(2, os.cpu_count() or 1)
    if len(objs) < 2 or sum(o.size for o in objs) < POOL_MIN_BYTES:
        return 1
    return max(1, min(want, len(objs)))


def ingest(
    cfg: Config,
    source: str | None = None,
    since: str | datetime | None = None,
    until: str | datetime | None = None,
    endpoint: str | None = None,
    workers: int | None = None,
    on_worker_start: Callable[[], None] | None = None,
) -> IngestResult:
    """Ingest new capture files from ``source`` (default ``config.capture.source``) into the warehouse.

    ``since`` (inclusive) and ``until`` (exclusive) select layout hours; ``endpoint``
    defaults to ``config.capture.endpoint`` ("" = all). Files already in the manifest
    with the same ETag are not read again. ``cfg`` gives the ``capture``, ``warehouse`` and
    ``s3`` sections. ``on_worker_start`` (picklable) runs first in each pool worker process.
    """
    source = source or cfg.capture.source
    t_since, t_until = parse_when(since), parse_when(until)
    endpoint = cfg.capture.endpoint if endpoint is None else endpoint
    wh = Warehouse(cfg)
    run_id = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ") + "-" + uuid.uuid4().hex[:8]
    result = IngestResult(run_id=run_id)
    begun = False
    try:
        client = s3_client(cfg.s3) if source.startswith("s3://") else None
        listed = list(list_objects(source, endpoint=endpoint, variant=cfg.capture.variant if endpoint else "",
                                   since=t_since, until=t_until, client=client))
        known = Known()
        opts = FileOptions.of(cfg.capture, cfg.s3, client)
        # A worker takes about half a second to start (an interpreter and its imports): the pool
        # starts now, as the catalog is read, if what is listed would need one.
        pool = _start_pool(opts, workers if workers is not None else _workers(cfg.capture, listed), on_worker_start)
        try:
            with wh.session():  # one attach of a local catalog for the whole start
                orphans = wh.clean_orphans()
                if orphans:
                    log.warning("removed %d Parquet parts that no catalog will name (of runs that failed or died)",
                                len(orphans))
                objs = wh.begin_run(run_id, source, t_since, t_until, listed)
                begun = True
                known_seq = wh.read_known(known.load)
            if pool is not None and workers is None and _workers(cfg.capture, objs) <= 1:
                pool.terminate()  # what is new is too little for a pool
                pool = None
            with _Lease(wh, run_id):
                sink = _Sink()
                run = _Run(wh, run_id, known, known_seq, result, sink)
                try:
                    _run_files(opts, run, objs, pool)
                except BaseException:
                    sink.abort()
                    raise
                sink.close()
                run.finish()
        finally:
            if pool is not None:
                pool.terminate()
                pool.join()
                _drop_handoffs()  # after the workers: none is left to write one
        if run.catalog_files >= COMPACT_FILES:
            try:
                wh.compact()
                log.info("merged the catalog tables' %d small Parquet files", run.catalog_files)
            except Exception as exc:  # upkeep: the next run tries again
                log.warning("could not merge the catalog's files: %s", exc)
    except BaseException:
        if begun:
            try:
                wh.fail_run(run_id)  # its claims lapse and its parts are orphans now, not a lease later
            except Exception as exc:  # the catalog unreachable: the lease lapses instead
                log.warning("could not mark run %s failed: %s", run_id, exc)
        raise
    finally:
        wh.close()
    return result


class _Lease:
    """Renews a run's lease (:meth:`Warehouse.renew_lease`) every quarter of it, on a thread, while open."""

    def __init__(self, wh: Warehouse, run_id: str) -> None:
        self.wh, self.run_id = wh, run_id
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name="ingest-lease", daemon=True)

    def _renew(self) -> None:
        while not self._stop.wait(self.wh.lease_s / 4):
            try:
                self.wh.renew_lease(self.run_id)
            except Exception as exc:  # the next commit finds out whether the lease lapsed
                log.warning("could not renew the lease of run %s: %s", self.run_id, exc)

    def __enter__(self) -> _Lease:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


# Environment of the pool's workers (a variable already set is left as it is):
# * Workers never call BLAS, but OpenBLAS starts a spinning thread per core when numpy is
#   imported: 0.06-0.27 s of CPU per worker, taken from the other processes.
# * glibc maps each multi-MB read block and column afresh and unmaps it when freed, so its
#   pages fault in again block after block (78k-700k minor faults per 1M records, more sys
#   time than the decoding of some formats); fixed thresholds keep them on the heap (~28k).
WORKER_ENV = {"OPENBLAS_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": str(32 << 20),
              "MALLOC_TRIM_THRESHOLD_": str(256 << 20)}


@contextmanager
def _spawn_env(**env: str) -> Iterator[None]:
    """Set environment variables (unless set) for the processes spawned inside, then restore them."""
    saved = {k: os.environ.get(k) for k in env}
    for k, v in env.items():
        os.environ.setdefault(k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _start_pool(opts: FileOptions, n: int, on_worker_start: Callable[[], None] | None) -> Pool | None:
    """``n`` worker processes for :func:`_process_in_pool`, or ``None`` for ``n`` <= 1 (files decoded in-process)."""
    if n <= 1:
        return None
    # spawn, not fork: the parent has pyarrow/duckdb threads that fork would copy mid-state.
    with _spawn_env(**WORKER_ENV):
        # The parent's S3 client stays with the parent: each worker makes its own.
        init = (replace(opts, client=None), on_worker_start)
        return mp.get_context("spawn").Pool(n, initializer=_init_worker, initargs=init)


def _run_files(opts: FileOptions, run: _Run, objs: list[SourceObject], pool: Pool | None) -> None:
    """Every file of ``objs`` into ``run``, in ``pool`` (which the caller ends) or in this process."""
    done = (process_file(o, opts) for o in objs) if pool is None else pool.imap(_process_in_pool, objs, chunksize=1)
    for fr in done:
        run.add(fr)
        if run.pending_bytes >= CHECKPOINT_BYTES:
            run.checkpoint(final=False)
    run.checkpoint(final=True)
