"""Asynchronous, batched SageMaker Data Capture writer (local directory or S3).

Objects land at ``{dest}/{endpoint}/{variant}/yyyy/mm/dd/hh/{MM-SS-mmm}-{uuid}.jsonl``,
the layout ``capture.sources`` reads. The request path only calls :meth:`offer`,
which never blocks: a full queue or a failed/slow write drops records, counted
in :attr:`counts` (and exported as Prometheus metrics by the router). Its encoding
and writing run on threads, which a loop saturated with requests starves of the GIL:
``adapt serve`` captures with :class:`serving.capture_journal.JournalWriter`, which
writes each record on the request path and loses none to a busy loop.

Each record is encoded on its own, so that one request's body cannot fail the batch
it shares with others: a lone surrogate (a ``"\\ud800"`` escape that JSON allows and
UTF-8 does not) is written back as that escape, as SageMaker writes its capture; a
record that is no single line of text is dropped alone and counted. Local objects are
owner-only (they hold users' prompts), and a failed write leaves no partial file.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from capture.fsmode import create_private, private_dirs

log = logging.getLogger(__name__)


def object_key(endpoint: str, variant: str, when: datetime) -> str:
    """Relative key of one capture object, SageMaker style."""
    when = when.astimezone(timezone.utc)
    return (f"{endpoint}/{variant}/{when:%Y/%m/%d/%H}/"
            f"{when:%M-%S}-{when.microsecond // 1000:03d}-{uuid.uuid4()}.jsonl")


def encode_record(line: Any) -> bytes | None:
    """One record as its JSONL bytes (newline included), or ``None`` if it is no single line of text.

    ``backslashreplace`` writes a lone surrogate as its ``\\uXXXX`` escape: in a JSON document
    one can only stand inside a string, where that escape means the same character.
    """
    if not isinstance(line, str) or "\n" in line or "\r" in line:
        return None
    return line.encode("utf-8", "backslashreplace") + b"\n"


class CaptureWriter:
    """Queue capture lines and write them in batches from a background task."""

    def __init__(self, destination: str, endpoint: str, variant: str = "AllTraffic", *,
                 sampling_pct: float = 100.0, s3_client_kwargs: dict[str, Any] | None = None,
                 max_queue: int = 10_000, batch_size: int = 256, flush_seconds: float = 1.0,
                 write_timeout: float = 10.0, rng: random.Random | None = None) -> None:
        self.destination = destination.rstrip("/")
        self.endpoint, self.variant = endpoint, variant
        self.sampling_pct = float(sampling_pct)
        self.s3_client_kwargs = s3_client_kwargs or {}
        self.batch_size, self.flush_seconds, self.write_timeout = batch_size, flush_seconds, write_timeout
        self.queue: asyncio.Queue[str] = asyncio.Queue(maxsize=max_queue)
        self.rng = rng or random.Random()
        # ``published``: records in objects at the destination, where an ingest reads them (here as soon
        # as ``written``; a journal writes first and publishes after).
        self.counts = {"offered": 0, "sampled_out": 0, "written": 0, "dropped_queue_full": 0,
                       "dropped_write_error": 0, "dropped_bad_record": 0, "objects": 0, "published": 0}
        self.last_error: str | None = None
        self._task: asyncio.Task | None = None
        self._s3 = None
        self._closing = False

    # -- request path ------------------------------------------------------------

    def draw(self) -> bool:
        """Whether a request is to be captured, drawn when it arrives (nothing counted): the router asks
        the replica for token ids only on those. Pass the draw to :meth:`sample` once it is answered."""
        return self.sampling_pct >= 100 or self.rng.random() * 100 < self.sampling_pct

    def sample(self, drawn: bool | None = None) -> bool:
        """Decide (before building a record) whether this request is captured: ``drawn`` (from
        :meth:`draw`), else a new draw; counted."""
        self.counts["offered"] += 1
        if self.draw() if drawn is None else drawn:
            return True
        self.counts["sampled_out"] += 1
        return False

    def offer(self, line: str) -> bool:
        """Enqueue one JSONL line without blocking; False (and counted) if dropped."""
        if self._closing:
            self.counts["dropped_queue_full"] += 1
            return False
        try:
            self.queue.put_nowait(line)
            return True
        except asyncio.QueueFull:
            self.counts["dropped_queue_full"] += 1
            return False

    @property
    def dropped(self) -> int:
        return self.counts["dropped_queue_full"] + self.counts["dropped_write_error"] + self.counts["dropped_bad_record"]

    # -- background task ----------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="capture-writer")

    async def close(self, timeout: float = 15.0) -> None:
        """Flush what is queued (bounded by ``timeout``) and stop."""
        self._closing = True
        if self._task is None:
            return
        try:
            await asyncio.wait_for(self.queue.join(), timeout)
        except asyncio.TimeoutError:
            pass
        self._task.cancel()
        try:
            await self._task
        except (asyncio.CancelledError, Exception):
            pass
        self._task = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            first = await self.queue.get()
            batch = [first]
            deadline = loop.time() + self.flush_seconds
            while len(batch) < self.batch_size:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(self.queue.get(), remaining))
                except asyncio.TimeoutError:
                    break
            records: list[bytes] = []
            try:
                # Encoded off the event loop: bodies can be megabytes.
                records = await asyncio.to_thread(lambda: [r for r in map(encode_record, batch) if r is not None])
                if len(records) < len(batch):
                    bad = len(batch) - len(records)
                    self.counts["dropped_bad_record"] += bad
                    self.last_error = f"{bad} record(s) that are no single line of text dropped"
                    log.warning("capture: %s", self.last_error)
                if records:
                    await asyncio.wait_for(asyncio.to_thread(self._write, records), self.write_timeout)
                    self.counts["written"] += len(records)
                    self.counts["published"] += len(records)
                    self.counts["objects"] += 1
            except Exception as exc:  # noqa: BLE001 - a capture failure must not propagate
                self.counts["dropped_write_error"] += len(records)
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.warning("capture batch of %d dropped: %s", len(records), self.last_error)
            finally:
                for _ in batch:
                    self.queue.task_done()

    def _write(self, records: list[bytes]) -> None:
        body = b"".join(records)
        key = object_key(self.endpoint, self.variant, datetime.now(timezone.utc))
        if self.destination.startswith("s3://"):
            import boto3

            bucket, _, prefix = self.destination[len("s3://"):].partition("/")
            if self._s3 is None:
                self._s3 = boto3.client("s3", **self.s3_client_kwargs)
            self._s3.put_object(Bucket=bucket, Key=f"{prefix}/{key}" if prefix else key, Body=body,
                                ContentType="application/jsonl")
        else:
            path = Path(self.destination) / key
            private_dirs(path.parent)
            tmp = path.with_suffix(".jsonl.part")
            fd = create_private(tmp)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(body)
                # Readers list *.jsonl: publish only complete objects.
                tmp.replace(path)
            except BaseException:
                tmp.unlink(missing_ok=True)  # a full disk must not leave a partial object behind
                raise
