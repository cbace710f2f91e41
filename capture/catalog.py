"""The warehouse's catalog: a DuckLake, its metadata in a local file or in PostgreSQL.

``[warehouse] catalog`` names where the metadata lives:

* a path (the embedded default): a DuckDB file, zero services. DuckDB lets one process at a
  time open it, so each use attaches it and detaches it again; another process waits for it.
* ``postgres:<libpq keywords>`` (e.g. ``postgres:host=db dbname=catalog user=drafter``): shared
  by every worker that reaches the server. The password is never part of the string: libpq
  takes it from ``PGPASSWORD`` or a ``~/.pgpass`` file (``PGPASSFILE``).

The catalog's own tables are stored as Parquet under ``<warehouse uri>/_lake/`` (S3 through
DuckDB's httpfs, with the credentials of the AWS chain boto3 uses), except small inserts,
which DuckLake keeps inline in the metadata.

DuckLake commits optimistically: two transactions that both change (update or delete) one
table conflict, and the later one fails at COMMIT with nothing of it kept. The warehouse
uses that to serialize its writers (:meth:`Catalog.transaction`).

The extensions are loaded from the wheels the lockfile installs (built for the pinned DuckDB
version); nothing is downloaded at run time.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar
from urllib.parse import urlparse

import duckdb
import duckdb_extension_ducklake
import duckdb_extension_httpfs
import duckdb_extension_postgres_scanner

from capture.fsmode import FILE_MODE, owner_only_umask, private_dirs

if TYPE_CHECKING:
    from settings.config import S3Config, WarehouseConfig

T = TypeVar("T")

POSTGRES = "postgres:"
_EXTENSIONS = {"ducklake": duckdb_extension_ducklake, "httpfs": duckdb_extension_httpfs,
               "postgres_scanner": duckdb_extension_postgres_scanner}


# One DuckDB database per process, its extensions loaded once (loading them costs ~0.4 s of CPU);
# each Catalog attaches its DuckLake there under a name of its own.
_DB: duckdb.DuckDBPyConnection | None = None
_DB_LOCK = threading.Lock()
_LOADED: set[str] = set()
_ALIASES = itertools.count()


def _database(extensions: list[str]) -> duckdb.DuckDBPyConnection:
    global _DB
    with _DB_LOCK:
        if _DB is None:
            _DB = duckdb.connect(config={"autoinstall_known_extensions": False, "autoload_known_extensions": False})
        for name in extensions:
            if name not in _LOADED:
                _run(_DB, f"LOAD {_quote(str(extension_path(name)))}")
                _LOADED.add(name)
        return _DB


def _run(db: duckdb.DuckDBPyConnection, sql: str) -> None:
    """One statement on a connection of its own (the process's database is shared by threads)."""
    con = db.cursor()
    try:
        con.execute(sql)
    finally:
        con.close()


# One lock per local catalog file for the whole process: DuckDB's file lock keeps other processes
# out, not a second database of the same process, so two handles of one process take turns here.
_LOCAL_LOCKS: dict[str, threading.RLock] = {}
_LOCAL_LOCKS_GUARD = threading.Lock()


def _local_lock(path: Path) -> threading.RLock:
    with _LOCAL_LOCKS_GUARD:
        return _LOCAL_LOCKS.setdefault(str(path.resolve()), threading.RLock())


class CatalogError(RuntimeError):
    """The catalog cannot be used as configured (bad setting, missing extension, unreachable)."""


def extension_path(name: str) -> Path:
    """The extension file ``name`` inside its wheel, for the DuckDB version installed."""
    pkg = Path(_EXTENSIONS[name].__file__).parent / "extensions"
    path = pkg / f"v{duckdb.__version__}" / f"{name}.duckdb_extension"
    if not path.is_file():
        have = sorted(p.name for p in pkg.iterdir()) if pkg.is_dir() else []
        raise CatalogError(f"the {name} extension for DuckDB {duckdb.__version__} is not installed (its wheel has "
                           f"{have}); install the versions of requirements/*.lock")
    return path


def _quote(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def _tighten(path: Path) -> None:
    """Make an existing file of ours owner-only (someone else's file is left alone)."""
    try:
        if path.stat().st_mode & 0o077:
            os.chmod(path, FILE_MODE)
    except (FileNotFoundError, PermissionError):
        pass


def is_shared(catalog: str) -> bool:
    return catalog.startswith(POSTGRES)


def _check_postgres(conn: str) -> str:
    """The libpq keyword string, refused if it carries a password; a connect timeout added if it has none."""
    if re.search(r"(^|\s)password\s*=", conn):
        raise CatalogError("[warehouse] catalog must not hold a password: libpq reads it from PGPASSWORD or "
                           "~/.pgpass (PGPASSFILE)")
    if not re.search(r"(^|\s)connect_timeout\s*=", conn):
        conn += " connect_timeout=10"
    return conn.strip()


class Catalog:
    """One handle on the catalog: the DuckLake attached, under a name of its own, to the process's DuckDB.

    :meth:`session` yields a connection of its own to each caller (threads may use the
    catalog at once); with a local file the catalog is attached only while a session is open.
    """

    def __init__(self, wcfg: WarehouseConfig, s3: S3Config) -> None:
        self.spec = wcfg.catalog
        self.shared = is_shared(self.spec)
        self.data_path = wcfg.uri.rstrip("/") + "/_lake/"
        self.is_s3 = wcfg.uri.startswith("s3://")
        self._s3 = s3
        self.name = f"lake{next(_ALIASES)}"
        self._db: duckdb.DuckDBPyConnection | None = None
        self._lock = threading.RLock()  # getting the database; a local file's attach (shared by its handles)
        self._depth = 0  # sessions open on a local file
        self._attached = False  # a shared catalog stays attached once it was
        if self.shared:
            self._conn = _check_postgres(self.spec[len(POSTGRES):])
        else:
            self.path = Path(self.spec).expanduser()
            self._lock = _local_lock(self.path)

    # -- the database ------------------------------------------------------------------

    def _database(self) -> duckdb.DuckDBPyConnection:
        if self._db is None:
            names = ["ducklake"] + (["httpfs"] if self.is_s3 else []) + (["postgres_scanner"] if self.shared else [])
            db = _database(names)
            if self.is_s3:
                _run(db, self._s3_secret())  # credentials as the AWS chain resolves them now
            else:
                private_dirs(self.data_path)
            self._db = db
        return self._db

    def _s3_secret(self) -> str:
        """A DuckDB secret for the warehouse's prefix, from the credentials the AWS chain resolves now."""
        import boto3

        creds = boto3.Session().get_credentials()
        if creds is None:
            raise CatalogError("no AWS credentials found for the S3 warehouse (environment, profile or role)")
        c = creds.get_frozen_credentials()
        parts = ["TYPE s3", f"KEY_ID {_quote(c.access_key)}", f"SECRET {_quote(c.secret_key)}",
                 f"REGION {_quote(self._s3.region)}", f"SCOPE {_quote(self.data_path)}"]
        if c.token:
            parts.append(f"SESSION_TOKEN {_quote(c.token)}")
        if self._s3.endpoint_url:
            u = urlparse(self._s3.endpoint_url)
            parts += [f"ENDPOINT {_quote(u.netloc or u.path)}", "URL_STYLE 'path'",
                      f"USE_SSL {'false' if u.scheme == 'http' else 'true'}"]
        return f"CREATE OR REPLACE SECRET {self.name}_s3 ({', '.join(parts)})"

    def _attach(self, db: duckdb.DuckDBPyConnection) -> None:
        opts = f"DATA_PATH {_quote(self.data_path)}"
        if self.shared:
            for attempt in range(8):
                try:
                    _run(db, f"ATTACH {_quote('ducklake:postgres:' + self._conn)} AS {self.name} ({opts})")
                    return
                except duckdb.Error as exc:
                    # Writers attaching an empty database at once all create DuckLake's tables: the
                    # ones that lose the race find them made on their next attempt.
                    racing = "already exists" in str(exc) or "duplicate key" in str(exc)
                    if not racing or attempt == 7:
                        raise CatalogError(f"cannot attach the catalog in PostgreSQL ({self._conn}): {exc}") from exc
                time.sleep(0.1 + random.random() * 0.4)
        private_dirs(self.path.parent)
        # One process at a time opens the file: another one's commit is waited out.
        deadline = time.monotonic() + 300
        while True:
            try:
                with owner_only_umask():  # DuckDB creates the file with no mode of ours
                    _run(db, f"ATTACH {_quote('ducklake:' + str(self.path))} AS {self.name} ({opts})")
                _tighten(self.path)  # a catalog made before files were created owner-only
                return
            except duckdb.IOException as exc:
                if "lock" not in str(exc).lower() or time.monotonic() > deadline:
                    raise
                time.sleep(0.05 + random.random() * 0.2)

    @contextmanager
    def session(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """A connection with the catalog attached and in use (``USE lake``): unqualified names are its tables."""
        if self.shared:
            with self._lock:
                db = self._database()
                if not self._attached:
                    self._attach(db)
                    self._attached = True
                con = db.cursor()  # a connection of its own: threads may hold sessions at once
            try:
                con.execute(f"USE {self.name}")
                yield con
            finally:
                con.close()
            return
        # A local file: one session at a time in this process, attached only meanwhile (a nested
        # session of the same thread shares the attach).
        with self._lock:
            db = self._database()
            outer = self._depth == 0
            if outer:
                self._attach(db)
            self._depth += 1
            con = db.cursor()
            try:
                con.execute(f"USE {self.name}")
                yield con
            finally:
                con.close()
                self._depth -= 1
                if outer:
                    _run(db, f"DETACH {self.name}")

    def transaction(self, body: Callable[[duckdb.DuckDBPyConnection], T], attempts: int = 50) -> T:
        """Run ``body`` in one transaction, again from the start when it conflicts with another writer's.

        ``body`` must only read and write the catalog (its side effects elsewhere happen again).
        """
        for attempt in range(attempts):
            with self.session() as con:
                con.execute("BEGIN TRANSACTION")
                try:
                    # Files created here (the catalog's WAL, its tables' Parquet on a local path) are owner-only.
                    local = not (self.shared and self.is_s3)
                    with owner_only_umask() if local else contextlib.nullcontext():
                        out = body(con)
                        con.execute("COMMIT")
                    return out
                except duckdb.TransactionException:
                    with contextlib.suppress(duckdb.Error):
                        con.execute("ROLLBACK")
                    if attempt == attempts - 1:
                        raise
                except BaseException:
                    with contextlib.suppress(duckdb.Error):
                        con.execute("ROLLBACK")
                    raise
            time.sleep(min(2.0, 0.02 * 1.5 ** attempt) * (0.5 + random.random()))
        raise AssertionError("unreachable")

    def close(self) -> None:
        """Detach the catalog (a shared one; a local one is attached only during sessions)."""
        with self._lock:
            if self._db is not None:
                if self._attached:
                    with contextlib.suppress(duckdb.Error):
                        _run(self._db, f"DETACH {self.name}")
                if self.is_s3:
                    with contextlib.suppress(duckdb.Error):
                        _run(self._db, f"DROP SECRET IF EXISTS {self.name}_s3")
                self._db = None
                self._depth, self._attached = 0, False


def probe(wcfg: WarehouseConfig) -> str:
    """Whether the catalog can be used, found without changing anything (``adapt doctor``): its extensions
    load, and it attaches read-only (one not made yet is reported so: the first ingest makes it)."""
    shared = is_shared(wcfg.catalog)
    db = _database(["ducklake"] + (["postgres_scanner"] if shared else []))
    if shared:
        where = "PostgreSQL"
        target = "ducklake:postgres:" + _check_postgres(wcfg.catalog[len(POSTGRES):])
    else:
        path = Path(wcfg.catalog).expanduser()
        where = str(path)
        if not path.exists():
            return f"DuckLake in {where}: not made yet (the first ingest makes it)"
        target = f"ducklake:{path}"
    alias = f"probe{next(_ALIASES)}"
    try:
        _run(db, f"ATTACH {_quote(target)} AS {alias} (READ_ONLY)")
    except duckdb.Error as exc:
        if "creating a new DuckLake is explicitly disabled" in str(exc):
            return f"DuckLake in {where}: reachable, not made yet (the first ingest makes it)"
        raise CatalogError(f"cannot attach the catalog in {where}: {exc}") from exc
    try:
        con = db.cursor()
        try:
            (n,), = con.execute("SELECT count(*) FROM information_schema.tables WHERE table_catalog = ?",
                                [alias]).fetchall()
        finally:
            con.close()
    finally:
        _run(db, f"DETACH {alias}")
    return f"DuckLake in {where}: {n} tables"
