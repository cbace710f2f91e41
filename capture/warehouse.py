"""The conversation warehouse: Parquet parts (local or S3) catalogued in a DuckLake (:mod:`capture.catalog`).

Visibility is decided by the catalog, not by what lies in the directory: a Parquet part
counts only once its row in ``parquet_files`` is committed, in the same transaction as the
manifest entries of the capture files it came from. Parts are written by pyarrow beside the
catalog (``<uri>/dt=YYYY-MM-DD/part-<run id>-<n>.parquet``) and never rewritten once committed.

**Several writers at once.** Any number of ingest runs, on any workers that reach the same
catalog, may write at the same time:

* every writing transaction bumps the one row of ``head``; two that overlap conflict in
  DuckLake, and the later one is run again from the start (:meth:`Catalog.transaction`), so
  writers' transactions are serialized, each numbered by its ``head`` sequence (``seq``,
  stored with every row it adds);
* a run *claims* the capture files it will read when it starts (``claims``); a file claimed by
  a run that is alive is left to it, so two runs never read one file. A run is alive while it
  renews its *lease* (``leases``, every ``lease_s / 4``); a run killed stops renewing, and its
  claims lapse ``lease_s`` later. A run commits only while its lease holds and no one took
  over one of its files (else :class:`WriterLost`);
* dedupe and stitching hold across writers: a run decides its rows against what was committed
  when it last looked (``known_seq``), and each commit first *reconciles* its rows with what
  other runs committed since. A row another run stored meanwhile (a duplicate), or that is a
  prefix of a row stored meanwhile (stitched), is taken out of this run's parts (rewritten
  before the commit names them) and counted so; a stored row that is a prefix of one of this
  run's rows is superseded. The run then merges what others committed into its own sets;
* a part is deleted as an orphan only when no catalog can ever name it: its run (of this
  catalog) finished, failed, or has not renewed its lease for ``2 * lease_s`` (one lease for it
  to lapse, one of grace); a part another writer is about to commit is never touched, nor one
  no run of this catalog wrote.

The catalog tables' own Parquet (one small file per table per commit) is merged by the run
that finds ``content_hashes`` in :data:`COMPACT_FILES` files or more (:meth:`Warehouse.compact`).

Catalog tables: ``head``, ``runs``, ``leases``, ``claims``, ``manifest``, ``quarantine``,
``skipped``, ``parquet_files``, ``content_hashes``, ``prefix_hashes`` and ``superseded``
(conversation stitching, see :mod:`capture.stitch`). A row named in ``superseded`` stays in
its part but no reader returns it (:meth:`Warehouse.read_conversations`).
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

if TYPE_CHECKING:
    import duckdb

    from capture.sources import SourceObject
    from settings.config import Config, S3Config
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from capture.catalog import Catalog
from capture.fsmode import create_private, private_dirs

TURN = pa.struct([("from", pa.string()), ("value", pa.string())])

# The Parquet row: one ShareGPT conversation plus where and how it was served.
SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("conversations", pa.list_(TURN)),
        ("event_id", pa.string()),
        ("inference_id", pa.string()),
        ("inference_time", pa.timestamp("us", tz="UTC")),
        ("endpoint", pa.string()),
        ("variant", pa.string()),
        ("source_uri", pa.string()),
        ("line_no", pa.int64()),
        ("format", pa.string()),
        ("raw", pa.bool_()),
        ("model", pa.string()),
        ("temperature", pa.float64()),
        ("top_p", pa.float64()),
        ("max_tokens", pa.int64()),
        # The whole exchange where ``conversations`` is not exact (see capture.sharegpt.Exchange);
        # null for plain role/content rows. JSON text: the request's messages as sent plus the
        # response as a last assistant message; tools, tool_choice, chat_template_kwargs as sent.
        ("messages", pa.string()),
        ("tools", pa.string()),
        ("tool_choice", pa.string()),
        ("chat_template_kwargs", pa.string()),
        ("finish_reason", pa.string()),
        # vLLM's return_token_ids: what the target processed and generated (dropped where
        # redaction changed the row: ids decode to the text they came from).
        ("prompt_token_ids", pa.list_(pa.int32())),
        ("output_token_ids", pa.list_(pa.int32())),
        ("content_hash", pa.string()),
        ("run_id", pa.string()),
        ("dt", pa.date32()),
    ]
)

# DuckLake has no keys or constraints: uniqueness is kept by the serialized writers.
_TABLES = {
    "head": "CREATE TABLE head (seq BIGINT)",
    "runs": """CREATE TABLE runs (
        run_id VARCHAR, started_at TIMESTAMPTZ, finished_at TIMESTAMPTZ, status VARCHAR, source VARCHAR,
        since TIMESTAMPTZ, "until" TIMESTAMPTZ, objects BIGINT, missing_objects BIGINT, "read" BIGINT,
        normalized BIGINT, duplicates BIGINT, stitched BIGINT, quarantined BIGINT, skipped BIGINT,
        superseded BIGINT, redactions VARCHAR)""",
    "leases": 'CREATE TABLE leases (run_id VARCHAR, "until" TIMESTAMPTZ)',
    "claims": "CREATE TABLE claims (source_uri VARCHAR, etag VARCHAR, run_id VARCHAR, claimed_at TIMESTAMPTZ)",
    "manifest": """CREATE TABLE manifest (
        source_uri VARCHAR, etag VARCHAR, size BIGINT, run_id VARCHAR, processed_at TIMESTAMPTZ, "read" BIGINT,
        normalized BIGINT, duplicates BIGINT, stitched BIGINT, quarantined BIGINT, skipped BIGINT, seq BIGINT)""",
    "quarantine": """CREATE TABLE quarantine (
        run_id VARCHAR, source_uri VARCHAR, line_no BIGINT, reason VARCHAR, detail VARCHAR, excerpt VARCHAR,
        event_id VARCHAR, quarantined_at TIMESTAMPTZ)""",
    "skipped": "CREATE TABLE skipped (run_id VARCHAR, source_uri VARCHAR, reason VARCHAR, count BIGINT)",
    "parquet_files": """CREATE TABLE parquet_files (
        path VARCHAR, run_id VARCHAR, dt DATE, "rows" BIGINT, bytes BIGINT, seq BIGINT)""",
    "content_hashes": "CREATE TABLE content_hashes (content_hash VARCHAR, run_id VARCHAR, seq BIGINT)",
    # Stitching (capture.stitch): the prefix hashes of every row taken in, and the rows a longer
    # version superseded (by_hash: the content hash of a row that has it as a prefix).
    "prefix_hashes": "CREATE TABLE prefix_hashes (prefix_hash VARCHAR, content_hash VARCHAR, run_id VARCHAR, seq BIGINT)",
    "superseded": """CREATE TABLE superseded (
        content_hash VARCHAR, by_hash VARCHAR, run_id VARCHAR, superseded_at TIMESTAMPTZ, seq BIGINT)""",
}

# Snappy (pyarrow's and DuckDB's default): compressing is most of the cost of writing, and
# zstd took ~1.3 µs more CPU per row than snappy for files ~30% smaller. Readers take either
# (the codec is per column chunk), so parts written with zstd before stay readable.
# Dictionary encoding only where values repeat (ids, hashes and the text are unique, and
# building a dictionary for them only to abandon it costs time).
# Min/max statistics only for the columns a reader filters on: those of the text, ids and hashes
# prune nothing (every file spans their range) and cost a tenth of the writer's CPU.
PARQUET_OPTIONS: dict[str, Any] = {
    "compression": "snappy",
    "use_dictionary": ["conversations.list.element.from", "endpoint", "variant", "source_uri", "format", "raw",
                       "model", "temperature", "top_p", "max_tokens", "run_id", "dt"],
    "write_statistics": ["inference_time", "endpoint", "variant", "source_uri", "line_no", "format", "raw", "model",
                         "temperature", "top_p", "max_tokens", "finish_reason", "run_id", "dt"],
}

RUN_COUNTS = ("objects", "missing_objects", "read", "normalized", "duplicates", "stitched", "quarantined", "skipped",
              "superseded")


# Nothing goes into DuckDB as a Python object: DuckDB's Python parameters and registered Arrow
# tables import pandas into the ingest parent (~0.4 s of CPU per run). Values are written into
# the statement as literals, and Arrow columns are handed over as Parquet files (_staged).


def _lit(v: Any) -> str:
    """``v`` as a SQL literal."""
    if v is None:
        return "NULL"
    if isinstance(v, bool):
        return "TRUE" if v else "FALSE"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, datetime):
        return f"TIMESTAMPTZ '{v.isoformat()}'"
    if isinstance(v, date):
        return f"DATE '{v.isoformat()}'"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_lit(x) for x in v) + "]::VARCHAR[]"
    return "'" + str(v).replace("'", "''") + "'"


def _insert_rows(con: duckdb.DuckDBPyConnection, table: str, cols: list[str], rows: list[dict], **constants: Any) -> None:
    """INSERT ``rows`` (their ``cols``) plus constant columns into ``table``."""
    names = ", ".join(f'"{n}"' for n in [*cols, *constants])
    consts = [_lit(v) for v in constants.values()]
    for i in range(0, len(rows), 2000):
        values = ", ".join("(" + ", ".join([*(_lit(r.get(c)) for c in cols), *consts]) + ")" for r in rows[i:i + 2000])
        con.execute(f"INSERT INTO {table} ({names}) VALUES {values}")


@contextmanager
def _staged(**tables: pa.Table) -> Iterator[dict[str, str]]:
    """Each Arrow table as a ``read_parquet(...)`` expression to use in SQL, for as long as the block runs."""
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    d = tempfile.mkdtemp(prefix="drafter-stage-", dir=base)  # owner-only
    try:
        out = {}
        for name, t in tables.items():
            path = os.path.join(d, f"{name}.parquet")
            pq.write_table(t, path, compression="none", use_dictionary=False)
            out[name] = f"read_parquet({_lit(path)})"
        yield out
    finally:
        shutil.rmtree(d, ignore_errors=True)


log = logging.getLogger("capture.warehouse")

_READY: set[str] = set()  # catalogs whose tables this process made or found (checked once per process)

_EMPTY = pa.nulls(0, pa.string())
# The catalog tables' Parquet files (one per table per commit) are merged past this many.
COMPACT_FILES = 32
_SUPERSEDED = pa.schema([("content_hash", pa.string()), ("by_hash", pa.string())])
_PART = re.compile(r"^part-(\d{8}T\d{6}Z-[0-9a-f]{8})-")


class WriterLost(RuntimeError):
    """This run may no longer commit: its lease lapsed, or another run took over one of its files."""


@dataclass
class Checkpoint:
    """What a run decided since its last commit, committed all at once (:meth:`Warehouse.commit`).

    ``counts`` and ``redactions`` are this checkpoint's share of the run's totals. ``hashes``,
    ``prefixes`` (``prefix_hash``, ``content_hash``) and ``superseded`` (``content_hash``,
    ``by_hash``) are the dedupe and stitching state of the rows of ``files``; ``known_seq`` is
    the catalog sequence the run's sets held when it decided them.
    """

    manifest: list[dict]
    quarantine: list[dict]
    skipped: list[dict]
    hashes: pa.ChunkedArray
    prefixes: pa.Table | None
    superseded: pa.Table | None
    counts: dict[str, int]
    redactions: dict[str, int]
    known_seq: int
    final: bool
    files: list[dict] = field(default_factory=list)


@dataclass
class Committed:
    """What a commit changed beyond the checkpoint, and what others had committed meanwhile.

    ``corrections``: changes to the run's counts from reconciling with other writers (rows
    found duplicated or stitched by theirs, stored rows superseded). ``others_*``: content
    hashes, prefix hashes and superseded hashes other runs committed after ``known_seq``, up
    to ``seq``, for the run's dedupe sets.
    """

    seq: int
    corrections: Counter
    others_hashes: pa.Array
    others_prefixes: pa.Array
    others_superseded: pa.Array
    catalog_files: int = 0  # with the final checkpoint: the Parquet files of content_hashes (see compact)


class _Rewrite(Exception):
    """Rows of the checkpoint must leave its parts before it may commit (raised inside the transaction)."""

    def __init__(self, duplicates: set[str], stitched: set[str]) -> None:
        super().__init__("reconcile")
        self.duplicates, self.stitched = duplicates, stitched


def _strings(values: Iterable[str]) -> pa.Array:
    """A string array built from buffers (``pa.array`` would import pandas)."""
    data = [v.encode("utf-8") for v in values]
    offsets = np.cumsum([0] + [len(x) for x in data], dtype=np.int64).astype(np.int32)
    return pa.StringArray.from_buffers(len(data), pa.py_buffer(offsets.tobytes()), pa.py_buffer(b"".join(data)))


def _column(con: duckdb.DuckDBPyConnection, sql: str) -> pa.Array:
    """The first column of a query as one string array."""
    col = con.execute(sql).to_arrow_table().column(0)
    return col.combine_chunks().cast(pa.string()) if col.num_chunks else pa.nulls(0, pa.string())


def _chunked(a: pa.Array | pa.ChunkedArray) -> pa.ChunkedArray:
    return a if isinstance(a, pa.ChunkedArray) else pa.chunked_array([a], pa.string())


def _filesystem(uri: str, s3_cfg: S3Config) -> tuple[pafs.FileSystem, str]:
    """pyarrow filesystem and base path for a warehouse URI (local dir or ``s3://bucket/prefix``)."""
    if uri.startswith("s3://"):
        kw: dict[str, Any] = {"region": s3_cfg.region}
        if s3_cfg.endpoint_url:
            u = urlparse(s3_cfg.endpoint_url)
            kw["endpoint_override"] = u.netloc or u.path
            kw["scheme"] = u.scheme or "https"
        # Credentials: the AWS SDK's default chain (env vars, profile, instance role), like boto3.
        fs = pafs.S3FileSystem(**kw)
        u = urlparse(uri)
        return fs, f"{u.netloc}/{u.path.strip('/')}".rstrip("/")
    p = Path(uri).expanduser().absolute()
    return pafs.LocalFileSystem(), str(p)


class Warehouse:
    """Parquet + DuckLake catalog for one config (``[warehouse]`` and ``[s3]``)."""

    def __init__(self, cfg: Config) -> None:
        self.uri = cfg.warehouse.uri
        self.is_s3 = self.uri.startswith("s3://")
        self.fs, self.base = _filesystem(self.uri, cfg.s3)
        self.lease_s = cfg.warehouse.lease_s
        self.catalog = Catalog(cfg.warehouse, cfg.s3)
        self._s3_cfg = cfg.s3
        self._boto = None
        self._boto_lock = threading.Lock()  # ingest writes parts from several threads
        # A local catalog deleted since (a state directory wiped) is made again.
        self._ready = cfg.warehouse.catalog in _READY and (self.catalog.shared or self.catalog.path.exists())

    def _client(self) -> Any:
        with self._boto_lock:
            if self._boto is None:
                from capture.sources import s3_client

                self._boto = s3_client(self._s3_cfg)
            return self._boto

    def close(self) -> None:
        self.catalog.close()

    # -- the catalog -------------------------------------------------------------------

    def _ensure(self) -> None:
        """Create the catalog's tables once (two writers creating them at once conflict; one redoes it)."""
        if self._ready:
            return

        def create(con: duckdb.DuckDBPyConnection) -> None:
            have = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables "
                                              "WHERE table_catalog = current_database()").fetchall()}
            for name, ddl in _TABLES.items():
                if name not in have:
                    con.execute(ddl)
            if "head" not in have:
                con.execute("INSERT INTO head VALUES (0)")

        self.catalog.transaction(create)
        self._ready = True
        _READY.add(self.catalog.spec)

    @contextmanager
    def session(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """A connection on the catalog (its tables by their plain names), for reading."""
        self._ensure()
        with self.catalog.session() as con:
            yield con

    def sql(self, query: str, params: list | None = None) -> list[tuple]:
        """The rows of one query on the catalog."""
        with self.session() as con:
            return con.execute(query, params).fetchall() if params else con.execute(query).fetchall()

    def _transaction(self, body: Callable[[duckdb.DuckDBPyConnection, int], Any]) -> Any:
        """``body(con, seq)`` in a writing transaction numbered ``seq``, serialized with every other writer's."""
        self._ensure()

        def run(con: duckdb.DuckDBPyConnection) -> Any:
            # Every writer updates this row: DuckLake lets only one of two overlapping writers commit.
            con.execute("UPDATE head SET seq = seq + 1")
            (seq,), = con.execute("SELECT seq FROM head").fetchall()
            return body(con, seq)

        return self.catalog.transaction(run)

    # -- a run's life ------------------------------------------------------------------

    def begin_run(self, run_id: str, source: str, since: datetime | None, until: datetime | None,
                  objs: list[SourceObject]) -> list[SourceObject]:
        """Record the run, take its lease, and claim the listed files that no run committed or holds;
        returns those (the files this run reads)."""
        def body(con: duckdb.DuckDBPyConnection, seq: int) -> list[SourceObject]:
            now = datetime.now(timezone.utc)
            done = set(con.execute("SELECT source_uri, etag FROM manifest").fetchall())
            held = set(con.execute(
                "SELECT c.source_uri, c.etag FROM claims c JOIN runs r USING (run_id) WHERE r.status = 'running' "
                f'AND (SELECT max(l."until") FROM leases l WHERE l.run_id = c.run_id) > {_lit(now)}').fetchall())
            todo = [o for o in objs if (o.uri, o.etag) not in done and (o.uri, o.etag) not in held]
            _insert_rows(con, "runs", [], [{}], run_id=run_id, started_at=now, status="running", source=source,
                         since=since, until=until, redactions="{}", **{k: 0 for k in RUN_COUNTS})
            _insert_rows(con, "leases", [], [{}], run_id=run_id, until=now + timedelta(seconds=self.lease_s))
            if todo:
                _insert_rows(con, "claims", ["source_uri", "etag"], [{"source_uri": o.uri, "etag": o.etag} for o in todo],
                             run_id=run_id, claimed_at=now)
            return todo

        return self._transaction(body)

    def renew_lease(self, run_id: str) -> None:
        """Extend the run's lease to ``lease_s`` from now (an insert: it conflicts with no other writer)."""
        until = datetime.now(timezone.utc) + timedelta(seconds=self.lease_s)
        self._ensure()
        self.catalog.transaction(lambda con: _insert_rows(con, "leases", [], [{}], run_id=run_id, until=until))

    def fail_run(self, run_id: str) -> None:
        """Mark a run that stopped on an error: its claims lapse and its parts are orphans at once."""
        now = datetime.now(timezone.utc)
        self._transaction(lambda con, seq: con.execute(
            f"UPDATE runs SET status = 'failed', finished_at = {_lit(now)} WHERE run_id = {_lit(run_id)} "
            "AND status = 'running'"))

    def read_known(self, load: Callable[[Iterator[pa.Array], Iterator[pa.Array], Iterator[pa.Array]], None]) -> int:
        """Hand ``load`` the content hashes, prefix hashes and superseded hashes of everything committed
        (each as batches), read in one snapshot; returns that snapshot's sequence."""
        with self.session() as con:
            con.execute("BEGIN TRANSACTION")
            try:
                (seq,), = con.execute("SELECT seq FROM head").fetchall()

                def batches(sql: str) -> Iterator[pa.Array]:
                    for batch in con.execute(sql).to_arrow_reader(1 << 20):
                        yield batch.column(0)

                load(batches("SELECT content_hash FROM content_hashes"),
                     batches("SELECT prefix_hash FROM prefix_hashes"),
                     batches("SELECT DISTINCT content_hash FROM superseded"))
            finally:
                con.execute("COMMIT")
        return seq

    def committed_files(self, con: duckdb.DuckDBPyConnection) -> list[str]:
        return [r[0] for r in con.execute("SELECT path FROM parquet_files ORDER BY path").fetchall()]

    # -- Parquet -----------------------------------------------------------------------

    def part_path(self, dt: date, run_id: str, seq: int, suffix: str = "") -> str:
        return f"{self.base}/dt={dt.isoformat()}/part-{run_id}-{seq:05d}{suffix}.parquet"

    def write_part(self, table: pa.Table, dt: date, run_id: str, seq: int, suffix: str = "") -> tuple[str, int]:
        """Write one Parquet file atomically; returns (path, bytes)."""
        path = self.part_path(dt, run_id, seq, suffix)
        if self.is_s3:
            # Uploaded with boto3 rather than pyarrow's S3 writer, which signs parts with
            # aws-chunked streaming signatures that some S3-compatible stores reject.
            # A PUT (or completed multipart upload) becomes visible whole or not at all.
            sink = pa.BufferOutputStream()
            pq.write_table(table, sink, **PARQUET_OPTIONS)
            body = sink.getvalue().to_pybytes()
            bucket, key = path.split("/", 1)
            self._client().upload_fileobj(io.BytesIO(body), bucket, key)
            return path, len(body)
        private_dirs(Path(path).parent)
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        os.close(create_private(tmp))  # the writer truncates it and keeps its mode
        pq.write_table(table, tmp, **PARQUET_OPTIONS)
        os.replace(tmp, path)
        return path, os.path.getsize(path)

    def _delete(self, path: str) -> None:
        if self.is_s3:
            bucket, key = path.split("/", 1)
            self._client().delete_object(Bucket=bucket, Key=key)
        else:
            self.fs.delete_file(path)

    def _rewrite(self, files: list[dict], rw: _Rewrite, run_id: str, attempt: int) -> tuple[list[dict], Counter]:
        """``files`` (uncommitted parts of this run) without the rows ``rw`` takes out: parts that hold
        some are written anew (or not at all when none is left) and the old ones deleted. Returns the
        new entries, and how many rows left each source file as what (``(source_uri, "duplicates")``...).

        A part is read and written a batch of rows at a time: parts hold up to ``PART_ROWS`` rows."""
        drop = _strings(rw.duplicates | rw.stitched)
        stitched = _strings(rw.stitched)
        out, gone = [], Counter()
        for f in files:
            with self.fs.open_input_file(f["path"]) as fh:
                hashes = pq.read_table(fh, columns=["content_hash"]).column("content_hash")
            if not pc.any(pc.is_in(hashes, value_set=drop)).as_py():
                out.append(f)
                continue
            m = re.search(r"-(\d{5})(?:-r\d+)?\.parquet$", f["path"])
            path = self.part_path(f["dt"], run_id, int(m.group(1)) if m else 0, suffix=f"-r{attempt}")
            kept, size = self._copy_part(f["path"], path, drop, stitched, gone)
            if kept:
                out.append({**f, "path": path, "rows": kept, "bytes": size})
            self._delete(f["path"])
        return out, gone

    def _copy_part(self, src: str, dest: str, drop: pa.Array, stitched: pa.Array, gone: Counter) -> tuple[int, int]:
        """Copy part ``src`` to ``dest`` without the rows whose hash is in ``drop``, counting them in ``gone``;
        returns (rows kept, bytes). Nothing is written when no row is kept."""
        if self.is_s3:
            fd, tmp = tempfile.mkstemp(prefix="drafter-part-", suffix=".parquet")  # owner-only
            os.close(fd)
        else:
            private_dirs(Path(dest).parent)
            tmp = f"{dest}.tmp-{uuid.uuid4().hex[:8]}"
            os.close(create_private(tmp))
        kept = 0
        try:
            with self.fs.open_input_file(src) as fh, pq.ParquetWriter(tmp, SCHEMA, **PARQUET_OPTIONS) as w:
                for batch in pq.ParquetFile(fh).iter_batches(batch_size=65_536):
                    t = pa.Table.from_batches([batch], schema=SCHEMA)
                    hit = pc.is_in(t.column("content_hash"), value_set=drop)
                    left = t.filter(hit)
                    is_st = pc.is_in(left.column("content_hash"), value_set=stitched).to_pylist()
                    for uri, st in zip(left.column("source_uri").to_pylist(), is_st):
                        gone[(uri, "stitched" if st else "duplicates")] += 1
                    t = t.filter(pc.invert(hit))
                    if t.num_rows:
                        w.write_table(t)
                        kept += t.num_rows
            if not kept:
                return 0, 0
            size = os.path.getsize(tmp)
            if self.is_s3:
                bucket, key = dest.split("/", 1)
                self._client().upload_file(tmp, bucket, key)  # visible whole or not at all, as write_part's
            else:
                os.replace(tmp, dest)
            return kept, size
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def clean_orphans(self) -> list[str]:
        """Delete the parts (and temp files) no catalog will ever name: this catalog's runs' that it does
        not name, once their run finished, failed, or let its lease lapse more than ``lease_s`` ago.
        Another writer's parts in flight, and parts no run of this catalog wrote, are left alone."""
        try:
            infos = self.fs.get_file_info(pafs.FileSelector(self.base, recursive=True, allow_not_found=True))
        except FileNotFoundError:
            return []
        parts = [i for i in infos if i.type == pafs.FileType.File and i.base_name.startswith("part-")
                 and (i.base_name.endswith(".parquet") or ".parquet.tmp-" in i.base_name)]
        if not parts:
            return []
        now = datetime.now(timezone.utc)
        with self.session() as con:
            keep = set(self.committed_files(con))
            runs = {r[0]: (r[1], r[2]) for r in con.execute(
                'SELECT r.run_id, r.status, (SELECT epoch(max(l."until")) FROM leases l WHERE l.run_id = r.run_id) '
                "FROM runs r").fetchall()}
        grace = timedelta(seconds=self.lease_s)
        gone = []
        for info in parts:
            if info.path in keep:
                continue
            m = _PART.match(info.base_name)
            status, until = runs.get(m.group(1), (None, None)) if m else (None, None)
            if status in ("complete", "failed"):
                dead = True
            elif status == "running":
                dead = until is None or until < (now - grace).timestamp()
            else:  # no run of this catalog wrote it (another catalog's, a warehouse from before): not ours
                dead = False
            if dead:
                try:
                    self._delete(info.path)
                except FileNotFoundError:
                    pass  # another writer cleaned it first
                gone.append(info.path)
        return gone

    # -- committing --------------------------------------------------------------------

    def commit(self, run_id: str, cp: Checkpoint) -> Committed:
        """Make one checkpoint of a run visible, reconciled with what other writers committed meanwhile:
        all of it in one transaction, or none."""
        corrections: Counter = Counter()
        dropped: set[str] = set()
        attempt = 0
        while True:
            try:
                return self._transaction(lambda con, seq: self._commit(con, seq, run_id, cp, dropped, corrections))
            except _Rewrite as rw:
                attempt += 1
                log.info("run %s: %d rows another writer stored meanwhile (%d of them as longer conversations) "
                         "taken out before the commit", run_id, len(rw.duplicates) + len(rw.stitched), len(rw.stitched))
                self._take_out(run_id, cp, rw, corrections, attempt)
                dropped |= rw.duplicates | rw.stitched

    def _take_out(self, run_id: str, cp: Checkpoint, rw: _Rewrite, corrections: Counter, attempt: int) -> None:
        """Take the rows other writers made duplicates or stitched prefixes out of the checkpoint: its
        parts, dedupe state, per-file counts, and the run's counts (``corrections``)."""
        cp.files, gone = self._rewrite(cp.files, rw, run_id, attempt)
        for m in cp.manifest:
            for key in ("duplicates", "stitched"):
                k = gone.get((m["source_uri"], key), 0)
                m[key] += k
                m["normalized"] -= k
        corrections["normalized"] -= len(rw.duplicates) + len(rw.stitched)
        corrections["duplicates"] += len(rw.duplicates)
        corrections["stitched"] += len(rw.stitched)
        drop = _strings(rw.duplicates | rw.stitched)
        cp.hashes = _chunked(cp.hashes.filter(pc.invert(pc.is_in(cp.hashes, value_set=drop))))
        if cp.prefixes is not None:
            cp.prefixes = cp.prefixes.filter(pc.invert(pc.is_in(cp.prefixes.column("content_hash"), value_set=drop)))

    def _commit(self, con: duckdb.DuckDBPyConnection, seq: int, run_id: str, cp: Checkpoint, dropped: set[str],
                taken_out: Counter) -> Committed:
        """One attempt at the commit (``dropped``: rows already taken out, which changed the counts by ``taken_out``)."""
        now = datetime.now(timezone.utc)
        self._check_writer(con, run_id, cp, now)
        since, corrections = int(cp.known_seq), Counter(taken_out)
        others = f"seq > {since} AND run_id <> {_lit(run_id)}"
        tables = {"h": pa.Table.from_arrays([_chunked(cp.hashes)], names=["content_hash"])}
        if cp.prefixes is not None and cp.prefixes.num_rows:
            tables["p"] = cp.prefixes
        # Most commits follow none of another writer's: nothing to reconcile with, nothing to hand back.
        (others_wrote,), = con.execute(
            f"SELECT EXISTS (SELECT 1 FROM content_hashes WHERE {others}) OR EXISTS (SELECT 1 FROM prefix_hashes "
            f"WHERE {others}) OR EXISTS (SELECT 1 FROM superseded WHERE {others})").fetchall()
        with _staged(**tables) as t:
            if len(cp.hashes) and others_wrote:
                dup = {r[0] for r in con.execute(
                    f"SELECT DISTINCT h.content_hash FROM {t['h']} h JOIN (SELECT content_hash FROM content_hashes "
                    f"WHERE {others}) o USING (content_hash)").fetchall()} - dropped
                st = {r[0] for r in con.execute(
                    f"SELECT DISTINCT h.content_hash FROM {t['h']} h JOIN (SELECT prefix_hash FROM prefix_hashes "
                    f"WHERE {others}) o ON o.prefix_hash = h.content_hash").fetchall()} - dropped
                if dup or st:
                    raise _Rewrite(dup - st, st)  # a prefix is stitched, not a duplicate (as in capture.stitch)
            proposed = [cp.superseded] if cp.superseded is not None and cp.superseded.num_rows else []
            if "p" in t and others_wrote:
                # Rows others stored meanwhile that are prefixes of this checkpoint's rows: superseded by them.
                theirs = con.execute(
                    f"SELECT p.prefix_hash AS content_hash, min(p.content_hash) AS by_hash FROM {t['p']} p JOIN "
                    f"(SELECT content_hash FROM content_hashes WHERE {others}) o ON o.content_hash = p.prefix_hash "
                    "GROUP BY 1").to_arrow_table()
                if theirs.num_rows:
                    proposed.append(theirs.cast(_SUPERSEDED))
                    corrections["superseded"] += theirs.num_rows
            superseded = None
            if proposed:
                # Each stored row is superseded once: leave out those another writer superseded meanwhile.
                table = pa.concat_tables([x.cast(_SUPERSEDED) for x in proposed])
                with _staged(s=table) as t2:
                    superseded = con.execute(
                        f"SELECT content_hash, min(by_hash) AS by_hash FROM {t2['s']} WHERE content_hash NOT IN "
                        f"(SELECT content_hash FROM superseded WHERE seq > {since}) GROUP BY 1").to_arrow_table()
                corrections["superseded"] -= table.num_rows - superseded.num_rows
            self._write(con, seq, run_id, cp, t, superseded, corrections, now)
        files = 0
        if cp.final:
            (files,), = con.execute(f"SELECT count(*) FROM ducklake_list_files('{self.catalog.name}', "
                                    "'content_hashes')").fetchall()
        if not others_wrote:
            return Committed(seq, corrections, _EMPTY, _EMPTY, _EMPTY, files)
        return Committed(
            seq=seq, corrections=corrections,
            others_hashes=_column(con, f"SELECT content_hash FROM content_hashes WHERE {others}"),
            others_prefixes=_column(con, f"SELECT prefix_hash FROM prefix_hashes WHERE {others}"),
            others_superseded=_column(con, f"SELECT content_hash FROM superseded WHERE {others}"),
            catalog_files=files)

    def _check_writer(self, con: duckdb.DuckDBPyConnection, run_id: str, cp: Checkpoint, now: datetime) -> None:
        # Times come back as epoch seconds: DuckDB returns TIMESTAMPTZ values through pytz.
        (until,), = con.execute(f'SELECT epoch(max("until")) FROM leases WHERE run_id = {_lit(run_id)}').fetchall()
        if until is None or until <= now.timestamp():
            lapsed = datetime.fromtimestamp(until, timezone.utc).isoformat() if until is not None else "never taken"
            raise WriterLost(f"run {run_id}: its lease lapsed ({lapsed}; stopped for over [warehouse] lease_s?); "
                             "its files are left to the next run")
        if cp.manifest:
            uris = _lit([m["source_uri"] for m in cp.manifest])
            taken = con.execute(
                f"SELECT source_uri, run_id FROM claims WHERE run_id <> {_lit(run_id)} AND source_uri IN "
                f"(SELECT unnest({uris})) AND claimed_at >= (SELECT min(claimed_at) FROM claims WHERE run_id = "
                f"{_lit(run_id)}) LIMIT 1").fetchall()
            if taken:
                raise WriterLost(f"run {run_id}: run {taken[0][1]} took over {taken[0][0]}")

    def _write(self, con: duckdb.DuckDBPyConnection, seq: int, run_id: str, cp: Checkpoint, t: dict[str, str],
               superseded: pa.Table | None, corrections: Counter, now: datetime) -> None:
        run = _lit(run_id)
        if cp.manifest:
            uris = _lit([m["source_uri"] for m in cp.manifest])
            # A changed object (new ETag) replaces its old entry (a delete only where there is one: a
            # delete is a change other writers' transactions conflict with).
            if con.execute(f"SELECT count(*) FROM manifest WHERE source_uri IN (SELECT unnest({uris}))").fetchall()[0][0]:
                con.execute(f"DELETE FROM manifest WHERE source_uri IN (SELECT unnest({uris}))")
            _insert_rows(con, "manifest", ["source_uri", "etag", "size", "read", "normalized", "duplicates", "stitched",
                                           "quarantined", "skipped"], cp.manifest, run_id=run_id, processed_at=now, seq=seq)
        if cp.quarantine:
            _insert_rows(con, "quarantine", ["source_uri", "line_no", "reason", "detail", "excerpt", "event_id"],
                         cp.quarantine, run_id=run_id, quarantined_at=now)
        if cp.skipped:
            _insert_rows(con, "skipped", ["source_uri", "reason", "count"], cp.skipped, run_id=run_id)
        if len(cp.hashes):
            con.execute(f"INSERT INTO content_hashes SELECT content_hash, {run}, {seq} FROM {t['h']}")
        if "p" in t:
            con.execute(f"INSERT INTO prefix_hashes SELECT prefix_hash, content_hash, {run}, {seq} FROM {t['p']}")
        if superseded is not None and superseded.num_rows:
            with _staged(s=superseded) as t2:
                con.execute(f"INSERT INTO superseded SELECT content_hash, by_hash, {run}, {_lit(now)}, {seq} "
                            f"FROM {t2['s']}")
        if cp.files:
            _insert_rows(con, "parquet_files", ["path", "dt", "rows", "bytes"], cp.files, run_id=run_id, seq=seq)
        counts = Counter(cp.counts)
        counts.update(corrections)
        (old,), = con.execute(f"SELECT redactions FROM runs WHERE run_id = {run}").fetchall()
        redactions = Counter(json.loads(old or "{}"))
        redactions.update(cp.redactions)
        sets = ", ".join(f'"{k}" = "{k}" + {int(counts.get(k, 0))}' for k in RUN_COUNTS)
        status = "complete" if cp.final else "running"
        con.execute(f"UPDATE runs SET {sets}, redactions = {_lit(json.dumps(dict(sorted(redactions.items()))))}, "
                    f"status = {_lit(status)}, finished_at = {_lit(now if cp.final else None)} WHERE run_id = {run}")

    # -- upkeep ------------------------------------------------------------------------

    def compact(self) -> None:
        """Merge the catalog tables' Parquet files (each commit adds one per table, and a run start reads
        them all), then delete the files merges replaced over a day ago. Appends of other writers meanwhile
        do not conflict with it. Ingest calls it when its last commit found :data:`COMPACT_FILES` files."""
        with self.session() as con:
            n = self.catalog.name
            # Results are not fetched: they hold timestamps, which DuckDB returns through pytz.
            con.execute(f"CALL ducklake_merge_adjacent_files('{n}')")
            con.execute(f"CALL ducklake_expire_snapshots('{n}', older_than => now() - INTERVAL 1 DAY)")
            con.execute(f"CALL ducklake_cleanup_old_files('{n}', older_than => now() - INTERVAL 1 DAY)")

    # -- reading -----------------------------------------------------------------------

    def read_conversations(self, columns: list[str] | None = None) -> pa.Table:
        """All committed conversation rows as one Arrow table (local or S3), less the superseded ones."""
        with self.session() as con:
            con.execute("BEGIN TRANSACTION")  # one snapshot for both
            files = self.committed_files(con)
            gone = _column(con, "SELECT DISTINCT content_hash FROM superseded")
            con.execute("COMMIT")
        if not files:
            return SCHEMA.empty_table() if columns is None else SCHEMA.empty_table().select(columns)
        read = columns if columns is None or not len(gone) or "content_hash" in columns else [*columns, "content_hash"]
        t = pa.concat_tables([pq.read_table(p, filesystem=self.fs, columns=read, schema=SCHEMA) for p in files])
        if len(gone):
            t = t.filter(pc.invert(pc.is_in(t.column("content_hash"), value_set=gone)))
            if read is not columns:
                t = t.select(columns)
        return t
