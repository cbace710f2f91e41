"""The conversation warehouse: Parquet files (local or S3) catalogued in a local DuckDB file.

Visibility is decided by the catalog, not by what lies in the directory: a Parquet
file counts only once its row in ``parquet_files`` is committed, in the same
transaction as the manifest entries of the capture files it came from. A run that
dies between writing Parquet and committing leaves orphans that no view shows;
the next run deletes them and redoes the work.

Catalog tables: ``runs``, ``manifest``, ``quarantine``, ``skipped``, ``parquet_files``,
``content_hashes``, ``prefix_hashes`` and ``superseded`` (conversation stitching, see
:mod:`capture.stitch`); views ``conversations`` and ``conversations_split`` (local
warehouse only: DuckDB here has no S3 extension, so S3 Parquet is read with
pyarrow's own S3 filesystem, see :meth:`Warehouse.read_conversations`).

With an S3 warehouse the catalog is shared through the warehouse itself: the last committed
catalog lies at ``<uri>/_catalog/catalog.duckdb``. Opening the catalog first fetches that copy
when it differs from the local one (compared by ETag), and every ingest commit uploads it, so
workers with separate disks that share only the bucket see one catalog. One ingest writes at a
time (the DAG runs one cycle at a time); readers on any worker see the last commit.

A row named in ``superseded`` (a longer version of its conversation was stored later) stays
in its Parquet part, which is never rewritten, but no reader returns it: the views and
:meth:`Warehouse.read_conversations` leave it out.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import date, datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

if TYPE_CHECKING:
    import duckdb

    from settings.config import Config, S3Config
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from capture.fsmode import FILE_MODE, create_private, owner_only_umask, private_dirs, write_private
from capture.sources import is_not_found

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
        ("content_hash", pa.string()),
        ("run_id", pa.string()),
        ("dt", pa.date32()),
    ]
)

_DDL = """
CREATE TABLE IF NOT EXISTS runs (
    run_id VARCHAR PRIMARY KEY, started_at TIMESTAMPTZ, finished_at TIMESTAMPTZ, status VARCHAR,
    source VARCHAR, since TIMESTAMPTZ, "until" TIMESTAMPTZ, objects BIGINT, missing_objects BIGINT,
    "read" BIGINT, normalized BIGINT, duplicates BIGINT, quarantined BIGINT, skipped BIGINT, redactions VARCHAR);
CREATE TABLE IF NOT EXISTS manifest (
    source_uri VARCHAR, etag VARCHAR, size BIGINT, run_id VARCHAR, processed_at TIMESTAMPTZ,
    "read" BIGINT, normalized BIGINT, duplicates BIGINT, quarantined BIGINT, skipped BIGINT,
    PRIMARY KEY (source_uri, etag));
CREATE TABLE IF NOT EXISTS quarantine (
    run_id VARCHAR, source_uri VARCHAR, line_no BIGINT, reason VARCHAR, detail VARCHAR,
    excerpt VARCHAR, event_id VARCHAR, quarantined_at TIMESTAMPTZ);
CREATE TABLE IF NOT EXISTS skipped (run_id VARCHAR, source_uri VARCHAR, reason VARCHAR, count BIGINT);
CREATE TABLE IF NOT EXISTS parquet_files (path VARCHAR PRIMARY KEY, run_id VARCHAR, dt DATE, "rows" BIGINT, bytes BIGINT);
-- Random hex does not compress, and DuckDB's string compression tried it again at every commit
-- (~0.3 s of CPU per million hashes); a catalog made before keeps its compressed column.
CREATE TABLE IF NOT EXISTS content_hashes (content_hash VARCHAR USING COMPRESSION uncompressed, run_id VARCHAR);
-- Stitching (capture.stitch): the prefix hashes of every row taken in, and the rows a longer
-- version superseded (by_hash: the content hash of a row that has it as a prefix).
CREATE TABLE IF NOT EXISTS prefix_hashes (
    prefix_hash VARCHAR USING COMPRESSION uncompressed, content_hash VARCHAR USING COMPRESSION uncompressed,
    run_id VARCHAR);
CREATE TABLE IF NOT EXISTS superseded (
    content_hash VARCHAR, by_hash VARCHAR, run_id VARCHAR, superseded_at TIMESTAMPTZ);
-- What was done to the catalog once ("stitching": its rows were stitched, see capture.stitch.adopt).
CREATE TABLE IF NOT EXISTS catalog_state (key VARCHAR PRIMARY KEY, value VARCHAR);
-- Catalogs made before stitching: the new counters.
ALTER TABLE runs ADD COLUMN IF NOT EXISTS stitched BIGINT;
ALTER TABLE runs ADD COLUMN IF NOT EXISTS superseded BIGINT;
ALTER TABLE manifest ADD COLUMN IF NOT EXISTS stitched BIGINT;
"""

# Snappy (pyarrow's and DuckDB's default): compressing is most of the cost of writing, and
# zstd took ~1.3 µs more CPU per row than snappy for files ~30% smaller. Readers take either
# (the codec is per column chunk), so parts written with zstd before stay readable.
# Dictionary encoding only where values repeat (ids, hashes and the text are unique, and
# building a dictionary for them only to abandon it costs time).
PARQUET_OPTIONS: dict[str, Any] = {
    "compression": "snappy",
    "use_dictionary": ["conversations.list.element.from", "endpoint", "variant", "source_uri", "format", "raw",
                       "model", "temperature", "top_p", "max_tokens", "run_id", "dt"],
}

RUN_COUNTS = ("objects", "missing_objects", "read", "normalized", "duplicates", "stitched", "quarantined", "skipped",
              "superseded")


def _insert_rows(con: duckdb.DuckDBPyConnection, table: str, cols: dict[str, str], rows: list[dict],
                 **constants: Any) -> None:
    """INSERT ``rows`` (their ``cols``: name -> SQL type) plus constant columns into ``table``."""
    names = list(cols) + list(constants)
    values = [f"unnest(${k + 1}::{t}[])" for k, t in enumerate(cols.values())]
    values += [f"${len(cols) + k + 1}" for k in range(len(constants))]
    select = ", ".join(f'{v} AS "{n}"' for v, n in zip(values, names))
    con.execute(f"INSERT INTO {table} BY NAME SELECT {select}",
                [[r.get(n) for r in rows] for n in cols] + list(constants.values()))


def _tighten(path: Path) -> None:
    """Make an existing file of ours owner-only (someone else's file is left alone)."""
    try:
        if path.stat().st_mode & 0o077:
            os.chmod(path, FILE_MODE)
    except (FileNotFoundError, PermissionError):
        pass


def _has_table(con: duckdb.DuckDBPyConnection, name: str) -> bool:
    found = con.execute("SELECT count(*) FROM information_schema.tables WHERE table_name = ?", [name]).fetchall()
    return bool(found[0][0])


class IngestLocked(RuntimeError):
    """Another ingest run holds the warehouse."""


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
    """Parquet + DuckDB catalog for one config (``[warehouse]``, ``[s3]`` and ``capture.heldout_hours``)."""

    def __init__(self, cfg: Config) -> None:
        self.uri = cfg.warehouse.uri
        self.catalog = Path(cfg.warehouse.catalog).expanduser()
        self.is_s3 = self.uri.startswith("s3://")
        self.fs, self.base = _filesystem(self.uri, cfg.s3)
        self.heldout_hours = cfg.capture.heldout_hours
        self._s3_cfg = cfg.s3
        self._boto = None
        self._boto_lock = threading.Lock()  # ingest writes parts from several threads

    def _client(self) -> Any:
        with self._boto_lock:
            if self._boto is None:
                from capture.sources import s3_client

                self._boto = s3_client(self._s3_cfg)
            return self._boto

    # -- the shared catalog (S3 warehouse) ---------------------------------------------

    def _catalog_key(self) -> tuple[str, str]:
        bucket, _, prefix = self.base.partition("/")
        return bucket, "/".join(x for x in (prefix, "_catalog", "catalog.duckdb") if x)

    def _etag_file(self) -> Path:
        return self.catalog.with_name(self.catalog.name + ".etag")

    def pull_catalog(self) -> bool:
        """Fetch the shared catalog when it differs from the local copy; True when it was fetched."""
        if not self.is_s3:
            return False
        bucket, key = self._catalog_key()
        client = self._client()
        try:
            etag = client.head_object(Bucket=bucket, Key=key)["ETag"]
        except Exception as exc:  # botocore ClientError
            if is_not_found(exc):
                return False  # no catalog shared yet: the first ingest writes it
            raise
        mark = self._etag_file()
        if self.catalog.exists() and mark.exists() and mark.read_text() == etag:
            return False
        private_dirs(self.catalog.parent)
        tmp = self.catalog.with_name(f".{self.catalog.name}.{uuid.uuid4().hex[:8]}")
        try:
            with owner_only_umask():
                client.download_file(bucket, key, str(tmp))
            os.replace(tmp, self.catalog)
        finally:
            tmp.unlink(missing_ok=True)
        self.catalog.with_name(self.catalog.name + ".wal").unlink(missing_ok=True)  # belongs to the old file
        write_private(mark, etag)
        return True

    def push_catalog(self) -> None:
        """Upload the local catalog (closed, so checkpointed) as the shared one."""
        if not self.is_s3:
            return
        bucket, key = self._catalog_key()
        client = self._client()
        with open(self.catalog, "rb") as f:
            etag = client.put_object(Bucket=bucket, Key=key, Body=f)["ETag"]
        write_private(self._etag_file(), etag)

    # -- catalog -----------------------------------------------------------------------

    def connect(self, read_only: bool = False) -> duckdb.DuckDBPyConnection:
        """Open the catalog (creating its tables on first write); an S3 warehouse's shared one first."""
        # Imported here: ingest workers import this module for SCHEMA only, and duckdb
        # costs each of them ~0.05 s of CPU to import.
        import duckdb

        self.pull_catalog()

        if read_only and not self.catalog.exists():
            con = duckdb.connect(":memory:")
            con.execute(_DDL)
            return con
        private_dirs(self.catalog.parent)
        # An ingest holds the file only for its brief commits; wait those out rather than fail.
        for attempt in range(50):
            try:
                # DuckDB creates the file with no mode of ours: the umask makes it owner-only.
                with owner_only_umask() if not read_only else contextlib.nullcontext():
                    con = duckdb.connect(str(self.catalog), read_only=read_only)
                break
            except duckdb.IOException as exc:
                if "lock" not in str(exc).lower() or attempt == 49:
                    raise
                time.sleep(0.2)
        if not read_only:
            _tighten(self.catalog)  # a catalog made before files were created owner-only
            con.execute(_DDL)
        return con

    @contextmanager
    def lock(self) -> Iterator[None]:
        """Exclusive ingest lock (one writer at a time); fails fast if held."""
        private_dirs(self.catalog.parent)
        fd = os.open(str(self.catalog) + ".lock", os.O_CREAT | os.O_RDWR, FILE_MODE)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise IngestLocked(f"another ingest holds {self.catalog}.lock") from None
            yield
        finally:
            os.close(fd)

    def processed(self, con: duckdb.DuckDBPyConnection) -> set[tuple[str, str]]:
        return set(con.execute("SELECT source_uri, etag FROM manifest").fetchall())

    def known_hashes(self, con: duckdb.DuckDBPyConnection) -> Iterator[pa.Array]:
        """Content hashes of every stored conversation (for dedupe across runs), in batches."""
        reader = con.sql("SELECT content_hash FROM content_hashes").to_arrow_reader(1 << 20)
        for batch in reader:
            yield batch.column(0)

    def known_prefixes(self, con: duckdb.DuckDBPyConnection) -> Iterator[pa.Array]:
        """Prefix hashes of every stored conversation (for stitching across runs), in batches."""
        reader = con.sql("SELECT prefix_hash FROM prefix_hashes").to_arrow_reader(1 << 20)
        for batch in reader:
            yield batch.column(0)

    def superseded_hashes(self, con: duckdb.DuckDBPyConnection) -> Iterator[pa.Array]:
        """Content hashes of the stored rows a longer version superseded, in batches."""
        if not _has_table(con, "superseded"):  # a catalog opened read-only before stitching existed
            return
        reader = con.sql("SELECT DISTINCT content_hash FROM superseded").to_arrow_reader(1 << 20)
        for batch in reader:
            yield batch.column(0)

    def stored_batches(self, con: duckdb.DuckDBPyConnection, columns: list[str],
                       batch_rows: int = 65_536) -> Iterator[pa.RecordBatch]:
        """Every committed row (superseded ones too), ``columns`` of it, a batch at a time."""
        for path in self.committed_files(con):
            with self.fs.open_input_file(path) as f:
                yield from pq.ParquetFile(f).iter_batches(batch_size=batch_rows, columns=columns)

    def stitching_adopted(self, con: duckdb.DuckDBPyConnection) -> bool:
        return bool(con.execute("SELECT count(*) FROM catalog_state WHERE key = 'stitching'").fetchall()[0][0])

    def adopt_stitching(self, con: duckdb.DuckDBPyConnection, run_id: str, prefixes: Iterator[pa.Table]) -> int:
        """Record the prefix hashes of the stored rows (``prefix_hash``, ``content_hash`` tables), supersede the
        stored rows that are prefixes of stored rows, and note that it was done: one transaction. Returns how
        many rows were superseded."""
        now = datetime.now(timezone.utc)
        with owner_only_umask():
            con.execute("BEGIN TRANSACTION")
            try:
                for t in prefixes:
                    con.register("_p", t)
                    con.execute("INSERT INTO prefix_hashes SELECT prefix_hash, content_hash, ? FROM _p", [run_id])
                    con.unregister("_p")
                (n,), = con.execute(
                    "INSERT INTO superseded SELECT prefix_hash, min(content_hash), ?, ? FROM prefix_hashes "
                    "WHERE prefix_hash IN (SELECT content_hash FROM content_hashes) "
                    "AND prefix_hash NOT IN (SELECT content_hash FROM superseded) GROUP BY prefix_hash",
                    [run_id, now]).fetchall()
                con.execute("INSERT INTO catalog_state VALUES ('stitching', ?)", [now.isoformat()])
                if n and not self.is_s3:
                    self._create_views(con)
                con.execute("COMMIT")
            except BaseException:
                con.execute("ROLLBACK")
                raise
        return n

    def committed_files(self, con: duckdb.DuckDBPyConnection) -> list[str]:
        return [r[0] for r in con.execute("SELECT path FROM parquet_files ORDER BY path").fetchall()]

    def start_run(self, con: duckdb.DuckDBPyConnection, run_id: str, source: str, since: datetime | None,
                  until: datetime | None) -> None:
        con.execute(
            "INSERT INTO runs (run_id, started_at, status, source, since, \"until\") VALUES (?, ?, 'running', ?, ?, ?)",
            [run_id, datetime.now(timezone.utc), source, since, until],
        )

    # -- Parquet -----------------------------------------------------------------------

    def part_path(self, dt: date, run_id: str, seq: int) -> str:
        return f"{self.base}/dt={dt.isoformat()}/part-{run_id}-{seq:05d}.parquet"

    def write_part(self, table: pa.Table, dt: date, run_id: str, seq: int) -> tuple[str, int]:
        """Write one Parquet file atomically; returns (path, bytes)."""
        path = self.part_path(dt, run_id, seq)
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

    def clean_orphans(self, con: duckdb.DuckDBPyConnection) -> list[str]:
        """Delete Parquet (and temp) files no committed row names: leftovers of a crashed run."""
        keep = set(self.committed_files(con))
        try:
            infos = self.fs.get_file_info(pafs.FileSelector(self.base, recursive=True, allow_not_found=True))
        except FileNotFoundError:
            return []
        gone = []
        for info in infos:
            name = info.base_name
            if info.type == pafs.FileType.File and name.startswith("part-") and info.path not in keep:
                if name.endswith(".parquet") or ".parquet.tmp-" in name:
                    if self.is_s3:
                        bucket, key = info.path.split("/", 1)
                        self._client().delete_object(Bucket=bucket, Key=key)
                    else:
                        self.fs.delete_file(info.path)
                    gone.append(info.path)
        return gone

    def commit(
        self,
        con: duckdb.DuckDBPyConnection,
        run_id: str,
        *,
        manifest: list[dict],
        quarantine: list[dict],
        skipped: list[dict],
        hashes: list[str] | pa.Array | pa.ChunkedArray,
        files: list[dict],
        totals: dict[str, Any],
        final: bool,
        prefixes: pa.Table | None = None,
        superseded: pa.Table | None = None,
    ) -> None:
        """Make one checkpoint of a run visible: all of it in one transaction, or none.

        ``prefixes`` (columns ``prefix_hash``, ``content_hash``) and ``superseded`` (``content_hash``,
        ``by_hash``) are the stitching state of the checkpoint's rows (:mod:`capture.stitch`).
        """
        with owner_only_umask():  # DuckDB creates the WAL at the first write
            self._commit(con, run_id, manifest=manifest, quarantine=quarantine, skipped=skipped, hashes=hashes,
                         files=files, totals=totals, final=final, prefixes=prefixes, superseded=superseded)

    def _commit(self, con: duckdb.DuckDBPyConnection, run_id: str, *, manifest: list[dict], quarantine: list[dict],
                skipped: list[dict], hashes: list[str] | pa.Array | pa.ChunkedArray, files: list[dict],
                totals: dict[str, Any], final: bool, prefixes: pa.Table | None = None,
                superseded: pa.Table | None = None) -> None:
        now = datetime.now(timezone.utc)
        con.execute("BEGIN TRANSACTION")
        try:
            # Rows go in as unnested list parameters: an Arrow table built from Python values
            # would import pandas into the ingest parent (~0.4 s of CPU per run).
            if manifest:
                cols = {"source_uri": "VARCHAR", "etag": "VARCHAR", "size": "BIGINT", "read": "BIGINT",
                        "normalized": "BIGINT", "duplicates": "BIGINT", "stitched": "BIGINT", "quarantined": "BIGINT",
                        "skipped": "BIGINT"}
                # A changed object (new ETag) replaces its old entry.
                con.execute("DELETE FROM manifest WHERE source_uri IN (SELECT unnest(?::VARCHAR[]))",
                            [[m["source_uri"] for m in manifest]])
                _insert_rows(con, "manifest", cols, manifest, run_id=run_id, processed_at=now)
            if quarantine:
                cols = {"source_uri": "VARCHAR", "line_no": "BIGINT", "reason": "VARCHAR", "detail": "VARCHAR",
                        "excerpt": "VARCHAR", "event_id": "VARCHAR"}
                _insert_rows(con, "quarantine", cols, quarantine, run_id=run_id, quarantined_at=now)
            if skipped:
                _insert_rows(con, "skipped", {"source_uri": "VARCHAR", "reason": "VARCHAR", "count": "BIGINT"}, skipped,
                             run_id=run_id)
            if len(hashes):
                h = hashes if isinstance(hashes, (pa.Array, pa.ChunkedArray)) else pa.array(hashes, pa.string())
                t = pa.Table.from_arrays([h if isinstance(h, pa.ChunkedArray) else pa.chunked_array([h])],
                                         names=["content_hash"])
                con.register("_h", t)
                con.execute("INSERT INTO content_hashes SELECT content_hash, ? FROM _h", [run_id])
                con.unregister("_h")
            if prefixes is not None and prefixes.num_rows:
                con.register("_p", prefixes)
                con.execute("INSERT INTO prefix_hashes SELECT prefix_hash, content_hash, ? FROM _p", [run_id])
                con.unregister("_p")
            if superseded is not None and superseded.num_rows:
                con.register("_s", superseded)
                con.execute("INSERT INTO superseded SELECT content_hash, by_hash, ?, ? FROM _s", [run_id, now])
                con.unregister("_s")
            for f in files:
                con.execute(
                    'INSERT INTO parquet_files (path, run_id, dt, "rows", bytes) VALUES (?, ?, ?, ?, ?)',
                    [f["path"], run_id, f["dt"], f["rows"], f["bytes"]],
                )
            sets = ", ".join(f'"{k}" = ?' for k in RUN_COUNTS)
            con.execute(
                f"UPDATE runs SET {sets}, redactions = ?, status = ?, finished_at = ? WHERE run_id = ?",
                [*(totals[k] for k in RUN_COUNTS), json.dumps(totals["redactions"], sort_keys=True),
                 "complete" if final else "running", now if final else None, run_id],
            )
            if (files or (superseded is not None and superseded.num_rows)) and not self.is_s3:
                self._create_views(con)
            con.execute("COMMIT")
        except BaseException:
            con.execute("ROLLBACK")
            raise

    def _create_views(self, con: duckdb.DuckDBPyConnection) -> None:
        files = self.committed_files(con)
        if not files:
            return
        lst = ", ".join("'" + p.replace("'", "''") + "'" for p in files)
        con.execute(f"CREATE OR REPLACE VIEW conversations AS SELECT * FROM read_parquet([{lst}], hive_partitioning = false)"
                    " WHERE content_hash NOT IN (SELECT content_hash FROM superseded)")
        con.execute(
            "CREATE OR REPLACE VIEW conversations_split AS SELECT *, CASE WHEN inference_time > "
            f"(SELECT max(inference_time) FROM conversations) - to_microseconds({round(self.heldout_hours * 3600e6)}) "
            "THEN 'heldout' ELSE 'train' END AS split FROM conversations"
        )

    # -- reading -----------------------------------------------------------------------

    def read_conversations(self, columns: list[str] | None = None) -> pa.Table:
        """All committed conversation rows as one Arrow table (local or S3), less the superseded ones."""
        con = self.connect(read_only=True)
        try:
            files = self.committed_files(con)
            gone = list(self.superseded_hashes(con))
        finally:
            con.close()
        if not files:
            return SCHEMA.empty_table() if columns is None else SCHEMA.empty_table().select(columns)
        read = columns if columns is None or not gone or "content_hash" in columns else [*columns, "content_hash"]
        t = pa.concat_tables([pq.read_table(p, filesystem=self.fs, columns=read, schema=SCHEMA) for p in files])
        if gone:
            gone_set = pa.concat_arrays([g.cast(pa.string()) for g in gone])
            t = t.filter(pc.invert(pc.is_in(t.column("content_hash"), value_set=gone_set)))
            if read is not columns:
                t = t.select(columns)
        return t
