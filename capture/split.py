"""Train / held-out split by time, dataset statistics and ShareGPT export.

Held out = conversations served in the last ``heldout_hours`` hours of the data
(after ``max(inference_time) - heldout_hours``). Since the warehouse keeps each
content hash once (first seen wins), no hash can be in both splits; since it keeps
each multi-turn conversation once, at its longest (:mod:`capture.stitch`: the rows
it superseded are left out here), whose ``inference_time`` is its last turn's, no
conversation has turns on both sides either.
"""

from __future__ import annotations

import json
import os
import re
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import duckdb
import pyarrow as pa
import pyarrow.compute as pc

from capture.sharegpt import EXCHANGE_JSON_FIELDS
from capture.warehouse import Warehouse

if TYPE_CHECKING:
    from settings.config import Config

SPLITS = ("train", "heldout")
_TOKEN = re.compile(r"\w+|[^\w\s]")


def count_tokens(text: str) -> int:
    """Cheap tokenizer-free length: words and punctuation marks."""
    return len(_TOKEN.findall(text))


def cutoff(table: pa.Table, heldout_hours: float) -> datetime | None:
    """First instant of the held-out period, or ``None`` when there is no data."""
    if table.num_rows == 0:
        return None
    latest = pc.max(table.column("inference_time")).as_py()
    return latest - timedelta(hours=heldout_hours)


def split_table(cfg: Config, heldout_hours: float | None = None) -> pa.Table:
    """All conversations with a ``split`` column (``train``/``heldout``), oldest first."""
    hours = cfg.capture.heldout_hours if heldout_hours is None else heldout_hours
    wh = Warehouse(cfg)
    try:
        t = wh.read_conversations()
    finally:
        wh.close()
    cut = cutoff(t, hours)
    if cut is None:
        return t.append_column("split", pa.array([], pa.string()))
    held = pc.greater(t.column("inference_time"), pa.scalar(cut, t.schema.field("inference_time").type))
    split = pc.if_else(held, "heldout", "train")
    t = t.append_column("split", split)
    return t.sort_by([("inference_time", "ascending"), ("content_hash", "ascending")])


def load_split(cfg: Config, split: str = "train", heldout_hours: float | None = None) -> list[dict]:
    """ShareGPT rows (``id``, ``conversations`` + metadata) of one split, oldest first."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, not {split!r}")
    t = split_table(cfg, heldout_hours)
    if t.num_rows == 0:
        return []
    t = t.filter(pc.equal(t.column("split"), split))
    return t.to_pylist()


def export_row(row: dict[str, Any]) -> dict[str, Any]:
    """One exported JSONL row: ShareGPT ``conversations`` plus every column, the exchange's JSON
    text columns (``messages``, ``tools``, ``tool_choice``, ``chat_template_kwargs``) as JSON values
    (:func:`capture.sharegpt.to_exchange` reads both forms)."""
    out = {k: _jsonable(v) for k, v in row.items()}
    for k in EXCHANGE_JSON_FIELDS:
        if isinstance(out.get(k), str):
            out[k] = json.loads(out[k])
    return out


def _jsonable(v: Any) -> Any:
    if isinstance(v, datetime):
        return v.isoformat().replace("+00:00", "Z")
    if hasattr(v, "isoformat"):
        return v.isoformat()
    return v


def export(cfg: Config, split: str, out: str | Path, heldout_hours: float | None = None) -> int:
    """Write one split as ShareGPT JSONL (one conversation a line, with metadata and the whole
    exchange where kept: see :func:`export_row`); returns the row count.

    The file is written to a temporary name and renamed, so a reader never sees half of it.
    """
    rows = load_split(cfg, split, heldout_hours)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(export_row(r), ensure_ascii=False) + "\n")
    os.replace(tmp, out)
    return len(rows)


def stats(cfg: Config, heldout_hours: float | None = None) -> dict[str, Any]:
    """Counts per split, day, format and endpoint; token length percentiles; catalog totals."""
    t = split_table(cfg, heldout_hours)
    n = t.num_rows
    out: dict[str, Any] = {"conversations": n}
    con = duckdb.connect(":memory:")
    try:
        if n:
            lens = [
                sum(count_tokens(turn["value"]) for turn in conv)
                for conv in t.column("conversations").to_pylist()
            ]
            t2 = t.select(["split", "dt", "format", "endpoint"]).append_column("tokens", pa.array(lens, pa.int64()))
            con.register("c", t2)
            for key, col in (("splits", "split"), ("days", "dt"), ("formats", "format"), ("endpoints", "endpoint")):
                rows = con.execute(f"SELECT CAST({col} AS VARCHAR), count(*) FROM c GROUP BY 1 ORDER BY 1").fetchall()
                out[key] = {k: v for k, v in rows}
            p = con.execute(
                "SELECT quantile_disc(tokens, [0.5, 0.9, 0.99]), max(tokens), avg(tokens) FROM c"
            ).fetchone()
            out["tokens"] = {"p50": p[0][0], "p90": p[0][1], "p99": p[0][2], "max": p[1], "mean": round(p[2], 1)}
        else:
            out.update(splits={}, days={}, formats={}, endpoints={}, tokens={})
        for s in SPLITS:
            out["splits"].setdefault(s, 0)
    finally:
        con.close()
    wh = Warehouse(cfg)
    with wh.session() as cat:
        out["quarantined"] = cat.execute("SELECT count(*) FROM quarantine").fetchone()[0]
        out["quarantine_reasons"] = dict(cat.execute(
            "SELECT reason, count(*) FROM quarantine GROUP BY 1 ORDER BY 1").fetchall())
        out["skipped"] = cat.execute("SELECT coalesce(sum(count), 0) FROM skipped").fetchone()[0]
        out["skip_reasons"] = dict(cat.execute(
            "SELECT reason, sum(count) FROM skipped GROUP BY 1 ORDER BY 1").fetchall())
        out["stitched"] = cat.execute("SELECT coalesce(sum(stitched), 0) FROM runs").fetchone()[0]
        out["superseded"] = cat.execute("SELECT count(DISTINCT content_hash) FROM superseded").fetchone()[0]
        out["runs"] = cat.execute("SELECT count(*) FROM runs").fetchone()[0]
        out["objects"] = cat.execute("SELECT count(*) FROM manifest").fetchone()[0]
    wh.close()
    return out
