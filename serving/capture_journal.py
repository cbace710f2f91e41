"""Capture for a router process that may be killed: each record is in the kernel before its answer ends.

A router worker (``serving.workers``) captures with :class:`JournalWriter` instead of the batching
:class:`~serving.capture_writer.CaptureWriter`, whose queue a killed process would lose. Each
record is written, with one ``write`` of its whole line, to the worker's own journal file in a spool
directory the moment the request is answered, before the answer's end goes out: the router offers a
JSON answer's record before sending its first byte, and a stream's before the chunk that ends the
HTTP response. A process killed after that (``kill -9``, the OOM killer) leaves the record in the
page cache, which the kernel keeps; a host that loses power loses what it had not written back
(no fsync per request: that would cost a disk flush per request).

A journal file is published as one capture object (``{endpoint}/{variant}/yyyy/mm/dd/hh/...jsonl``,
the layout ``capture.sources`` reads) once it holds ``batch_size`` records or is ``flush_seconds``
old: renamed into a local destination (the spool lies inside it, so the rename is atomic), or
uploaded to S3 under the key its name holds and then removed. Nothing is ever appended to a file
another process writes: every worker slot has its spool directory, and only one process holds a
slot at a time. A worker starting in a slot first publishes what its predecessor left there
(:func:`recover`), dropping a trailing partial line (a record cut by the kill, whose request had
not been answered: counted). Publishing is idempotent, by name: a file renamed is gone from the
spool; one uploaded again after a crash between the upload and its removal lands on the same key.
So a record is published exactly once, whichever process dies when.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

from capture.fsmode import create_private, private_dirs
from serving.capture_writer import CaptureWriter, encode_record, object_key

log = logging.getLogger(__name__)
SUFFIX = ".part"


def spool_name(key: str) -> str:
    """A journal file's name: its capture object's key, one path component."""
    return quote(key, safe="") + SUFFIX


def key_of(name: str) -> str:
    return unquote(name[:-len(SUFFIX)])


def default_spool_root(destination: str, state_dir: str | Path) -> Path:
    """Where the workers' spools lie (slot i's in ``worker-i``): inside a local destination (a dot
    directory ``capture.sources`` skips, on the same file system, so publishing is a rename), under
    ``state_dir`` for S3."""
    if destination.startswith("s3://"):
        return Path(state_dir) / "serving" / "capture-spool"
    return Path(destination) / ".spool"


def claim_spool(root: str | Path, name: str, *, alternatives: int = 0) -> tuple[Path, int]:
    """The first of ``root/name``, ``root/name-1`` … ``root/name-{alternatives}`` that no live process holds:
    its directory and an open descriptor of its lock, which this process then holds until it closes it or
    ends (however it ends: the kernel releases it, so a killed process's successor claims its spool and
    publishes what it left). Raises when every one is held."""
    import fcntl

    names = [name] + [f"{name}-{i}" for i in range(1, alternatives + 1)]
    for n in names:
        spool = Path(root) / n
        private_dirs(spool)
        fd = os.open(spool / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return spool, fd
    raise RuntimeError(f"capture spool {Path(root) / name} (and {alternatives} alternative(s)) held by other "
                       "live router processes: one spool per process")


def _whole_lines(path: Path) -> tuple[int, int]:
    """Cut ``path`` after its last newline; (records kept, bytes cut)."""
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        os.truncate(path, end)
    return data.count(b"\n"), len(data) - end


class Publisher:
    """Moves finished journal files to the capture destination (local directory or S3)."""

    def __init__(self, destination: str, s3_client_kwargs: dict[str, Any] | None = None) -> None:
        self.destination = destination.rstrip("/")
        self.s3_client_kwargs = s3_client_kwargs or {}
        self._s3: Any = None

    def publish(self, path: Path) -> None:
        key = key_of(path.name)
        if self.destination.startswith("s3://"):
            import boto3

            bucket, _, prefix = self.destination[len("s3://"):].partition("/")
            if self._s3 is None:
                self._s3 = boto3.client("s3", **self.s3_client_kwargs)
            self._s3.put_object(Bucket=bucket, Key=f"{prefix}/{key}" if prefix else key, Body=path.read_bytes(),
                                ContentType="application/jsonl")
            path.unlink(missing_ok=True)
            return
        final = Path(self.destination) / key
        private_dirs(final.parent)
        try:
            os.replace(path, final)
        except OSError as exc:
            if exc.errno != 18:  # EXDEV: a spool set on another file system than the destination
                raise
            tmp = final.with_suffix(".jsonl.part")
            shutil.copyfile(path, tmp)
            os.chmod(tmp, 0o600)
            os.replace(tmp, final)
            path.unlink()


def recover(spool: Path, publisher: Publisher) -> tuple[int, int, int]:
    """Publish every journal file left in ``spool`` (by a process that is gone); (files, records, partial
    records dropped). A file that cannot be published stays for the next try, and raises."""
    files = records = partial = 0
    if not spool.is_dir():
        return 0, 0, 0
    for p in sorted(spool.glob("*" + SUFFIX)):
        n, cut = _whole_lines(p)
        partial += 1 if cut else 0
        if n:
            publisher.publish(p)
            files += 1
            records += n
        else:
            p.unlink()
    return files, records, partial


class JournalWriter(CaptureWriter):
    """:class:`CaptureWriter`'s interface (``draw``/``sample``/``offer``/``counts``/``start``/``close``)
    with each record written to this process's journal file when offered (see the module doc).

    ``counts["written"]``: records in a journal (in the kernel); ``objects``: journal files published;
    ``published``: the records in them (an ingest reads those; recovered ones included);
    ``recovered``: records a previous process of this slot left and this one published;
    ``dropped_partial``: records cut by that process's end (their requests were not answered).
    """

    def __init__(self, destination: str, endpoint: str, variant: str = "AllTraffic", *, spool: str | Path,
                 sampling_pct: float = 100.0, s3_client_kwargs: dict[str, Any] | None = None,
                 batch_size: int = 256, flush_seconds: float = 1.0, alternatives: int = 0, **kwargs: Any) -> None:
        super().__init__(destination, endpoint, variant, sampling_pct=sampling_pct, s3_client_kwargs=s3_client_kwargs,
                         batch_size=batch_size, flush_seconds=flush_seconds, **kwargs)
        # ``spool``, or the first free of ``alternatives`` more beside it (claim_spool): taken at start.
        self._asked, self.alternatives = Path(spool), alternatives
        self.spool = self._asked
        self._lock_fd: int | None = None  # the spool's lock, held while this writer lives
        self.publisher = Publisher(destination, s3_client_kwargs)
        self.counts.update(recovered=0, dropped_partial=0, unpublished=0)
        self._fd: int | None = None
        self._path: Path | None = None
        self._n = 0
        self._opened = 0.0
        self._ready: list[tuple[Path, int]] = []  # closed journal files and their records
        self._wake: asyncio.Event | None = None

    # -- request path ------------------------------------------------------------

    def offer(self, line: str) -> bool:
        """Write one record to the journal now (one ``write`` of the whole line); False (counted) if not."""
        data = encode_record(line)
        if data is None:
            self.counts["dropped_bad_record"] += 1
            self.last_error = "a record that is no single line of text dropped"
            return False
        try:
            if self._fd is None:
                self._open()
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view):]  # type: ignore[arg-type]
        except OSError as exc:
            self.counts["dropped_write_error"] += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            self._close_file()  # the next record starts a new file; this one keeps its whole lines
            return False
        self.counts["written"] += 1
        self._n += 1
        if self._n >= self.batch_size:
            self._close_file()
        return True

    def _open(self) -> None:
        private_dirs(self.spool)
        self._path = self.spool / spool_name(object_key(self.endpoint, self.variant, datetime.now(timezone.utc)))
        self._fd = create_private(self._path)
        self._n, self._opened = 0, time.monotonic()

    def _close_file(self) -> None:
        if self._fd is None:
            return
        os.close(self._fd)
        self._fd = None
        if self._n:
            self._ready.append((self._path, self._n))  # type: ignore[arg-type]
        elif self._path is not None:
            self._path.unlink(missing_ok=True)
        self._n = 0
        if self._wake is not None:
            self._wake.set()

    # -- background --------------------------------------------------------------

    def start(self) -> None:
        """Publish what a previous process of this slot left, then publish this one's files as they fill."""
        if self._task is not None:
            return
        self.spool, self._lock_fd = claim_spool(self._asked.parent, self._asked.name, alternatives=self.alternatives)
        files, records, partial = recover(self.spool, self.publisher)
        self.counts["recovered"] += records
        self.counts["dropped_partial"] += partial
        self.counts["objects"] += files
        self.counts["published"] += records
        if files or partial:
            log.warning("capture: published %d record(s) in %d file(s) a previous router worker left in %s "
                        "(%d partial record(s) of unanswered requests dropped)", records, files, self.spool, partial)
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="capture-journal")

    async def _run(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self.flush_seconds / 2)  # type: ignore[union-attr]
            except asyncio.TimeoutError:
                pass
            self._wake.clear()  # type: ignore[union-attr]
            if self._fd is not None and time.monotonic() - self._opened >= self.flush_seconds:
                self._close_file()
            await self._publish_ready()

    async def _publish_ready(self) -> None:
        while self._ready:
            path, n = self._ready[0]
            try:
                if self.destination.startswith("s3://"):
                    await asyncio.wait_for(asyncio.to_thread(self.publisher.publish, path), self.write_timeout)
                else:
                    self.publisher.publish(path)  # a rename
            except FileNotFoundError:
                pass  # an upload that outlived its timeout finished it meanwhile (the same key either way)
            except Exception as exc:  # noqa: BLE001 - the file stays in the spool; tried again later
                self.last_error = f"publish {path.name}: {type(exc).__name__}: {exc}"
                log.warning("capture: %s", self.last_error)
                self.counts["unpublished"] = len(self._ready)
                return
            self._ready.pop(0)
            self.counts["objects"] += 1
            self.counts["published"] += n
        self.counts["unpublished"] = 0

    async def close(self, timeout: float = 15.0) -> None:
        """Publish everything (bounded by ``timeout``) and stop; what is left stays in the spool for the next
        process of this slot."""
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None
        self._close_file()
        try:
            await asyncio.wait_for(self._publish_ready(), timeout)
        except asyncio.TimeoutError:
            pass
        if self._lock_fd is not None:  # what is left stays for the spool's next holder
            os.close(self._lock_fd)
            self._lock_fd = None
