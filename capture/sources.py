"""Where capture files come from: a local directory or S3, in Data Capture's layout.

Layout below the source prefix: ``{endpoint}/{variant}/yyyy/mm/dd/hh/<name>.jsonl``.
Files outside that layout (a single file, a flat folder of fixtures) are read too;
they carry no hour, so the time window does not filter them.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

if TYPE_CHECKING:
    from settings.config import S3Config

_HOUR_PARTS = re.compile(r"^\d{4}/\d{2}/\d{2}/\d{2}$")
_REL = re.compile(r"^(\d+)\s*([hd])$")


@dataclass(frozen=True, slots=True)
class SourceObject:
    """One capture file. ``uri`` is its identity in the manifest; ``etag`` changes when its content does."""

    uri: str
    size: int
    etag: str
    endpoint: str
    variant: str
    hour: datetime | None


def is_s3(uri: str) -> bool:
    return uri.startswith("s3://")


def split_s3(uri: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` → ``("bucket", "a/b")``."""
    u = urlparse(uri)
    return u.netloc, u.path.lstrip("/")


def parse_layout(rel: str) -> tuple[str, str, datetime] | None:
    """``endpoint/variant/yyyy/mm/dd/hh/file`` → (endpoint, variant, hour) or ``None`` if off-layout."""
    parts = rel.strip("/").split("/")
    if len(parts) < 7:
        return None
    parts = parts[-7:]
    if not _HOUR_PARTS.match("/".join(parts[2:6])):
        return None
    try:
        hour = datetime(int(parts[2]), int(parts[3]), int(parts[4]), int(parts[5]), tzinfo=timezone.utc)
    except ValueError:
        return None
    return parts[0], parts[1], hour


def layout_key(endpoint: str, variant: str, when: datetime, name: str | None = None) -> str:
    """Relative key of a capture file in Data Capture's layout: ``endpoint/variant/yyyy/mm/dd/hh/name``.

    Writers should create the file under a name the reader ignores (a leading dot, or
    not ending in ``.jsonl``) and rename it when complete: a file that grows after it
    was ingested is read again, and its old lines then count as duplicates.
    """
    when = when.astimezone(timezone.utc) if when.tzinfo else when.replace(tzinfo=timezone.utc)
    if name is None:
        name = f"{when:%M-%S}-{when.microsecond // 1000:03d}-{uuid.uuid4()}.jsonl"
    return f"{endpoint}/{variant}/{when:%Y/%m/%d/%H}/{name}"


def parse_when(value: str | datetime | None, now: datetime | None = None) -> datetime | None:
    """Parse ``--since/--until``: ISO date/time (``2024-01-19``, ``2024-01-19T07``, ``…T07:00Z``) or ``6h``/``2d`` ago.

    The result is floored to the hour (the layout's granularity).
    """
    if value is None or value == "":
        return None
    if isinstance(value, datetime):
        t = value
    else:
        v = value.strip()
        m = _REL.match(v)
        if m:
            n, unit = int(m.group(1)), m.group(2)
            t = (now or datetime.now(timezone.utc)) - (timedelta(hours=n) if unit == "h" else timedelta(days=n))
        else:
            if v.endswith("Z"):
                v = v[:-1] + "+00:00"
            if re.fullmatch(r"\d{4}-\d{2}-\d{2}[T ]\d{2}", v):
                v += ":00"
            try:
                t = datetime.fromisoformat(v)
            except ValueError:
                raise ValueError(f"cannot parse time {value!r}: use YYYY-MM-DD[THH[:MM]], or 6h / 2d ago") from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=timezone.utc)
    return t.astimezone(timezone.utc).replace(minute=0, second=0, microsecond=0)


def in_window(hour: datetime | None, since: datetime | None, until: datetime | None) -> bool:
    """``since`` inclusive, ``until`` exclusive; off-layout files (no hour) always pass."""
    if hour is None:
        return True
    if since is not None and hour < since:
        return False
    if until is not None and hour >= until:
        return False
    return True


def is_not_found(exc: BaseException) -> bool:
    """Whether a botocore ``ClientError`` says the object is not there (GET: NoSuchKey; HEAD: a bare 404)."""
    code = getattr(exc, "response", {}).get("Error", {}).get("Code", "")
    return code in ("NoSuchKey", "404", "NotFound")


def s3_client(s3_cfg: S3Config | None) -> Any:
    """A boto3 S3 client from ``config.s3`` (standard credential chain, optional endpoint URL)."""
    import boto3

    if s3_cfg is None:
        raise ValueError("an s3:// URI needs the S3 settings (config.s3) or a client")
    return boto3.client("s3", **s3_cfg.client_kwargs())


def _describe(uri: str, rel: str | None, size: int, etag: str, default_endpoint: str, default_variant: str) -> SourceObject:
    lay = parse_layout(rel) if rel is not None else None
    if lay:
        return SourceObject(uri, size, etag, lay[0], lay[1], lay[2])
    return SourceObject(uri, size, etag, default_endpoint or "unknown", default_variant, None)


def _keep(obj: SourceObject, endpoint: str, variant: str, since: datetime | None, until: datetime | None) -> bool:
    if obj.hour is not None:
        if endpoint and obj.endpoint != endpoint:
            return False
        if variant and obj.variant != variant:
            return False
    return in_window(obj.hour, since, until)


def list_objects(
    source: str,
    *,
    endpoint: str = "",
    variant: str = "",
    since: datetime | None = None,
    until: datetime | None = None,
    s3: S3Config | None = None,
    client: Any = None,
    page_size: int | None = None,
) -> Iterator[SourceObject]:
    """Capture files under ``source`` (dir, file or ``s3://bucket/prefix``) in the window, sorted by key.

    ``endpoint``/``variant`` filter layout files ("" = all). ``s3`` is ``config.s3``
    (used when no ``client`` is given); ``page_size`` caps keys per S3 list call.
    """
    if is_s3(source):
        bucket, prefix = split_s3(source)
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        narrowed = prefix
        if endpoint:
            narrowed += endpoint + "/"
            if variant:
                narrowed += variant + "/"
        client = client or s3_client(s3)
        paging = {"PageSize": page_size} if page_size else {}
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=narrowed, PaginationConfig=paging)
        for page in pages:
            for item in page.get("Contents", []):
                key = item["Key"]
                if key.endswith("/"):
                    continue
                obj = _describe(
                    f"s3://{bucket}/{key}", key[len(prefix):], int(item["Size"]), item["ETag"].strip('"'), endpoint, variant
                )
                if _keep(obj, endpoint, variant, since, until):
                    yield obj
        return

    root = Path(source).expanduser()
    if root.is_file():
        st = root.stat()
        yield _describe(str(root.absolute()), None, st.st_size, f"{st.st_size}-{st.st_mtime_ns}", endpoint, variant)
        return
    if not root.is_dir():
        raise FileNotFoundError(f"capture source {root} does not exist")
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in filenames:
            if name.startswith(".") or not name.endswith(".jsonl"):
                continue  # Data Capture writes .jsonl; schemas, notes and temp files are not capture
            p = Path(dirpath) / name
            rel = p.relative_to(root).as_posix()
            try:
                st = p.stat()
            except FileNotFoundError:
                continue  # gone since the walk saw it
            obj = _describe(str(p.absolute()), rel, st.st_size, f"{st.st_size}-{st.st_mtime_ns}", endpoint, variant)
            if _keep(obj, endpoint, variant, since, until):
                found.append(obj)
    found.sort(key=lambda o: o.uri)
    yield from found


class ObjectMissing(Exception):
    """The object was listed but is gone (deleted or expired) when read."""


# Blocks of a few MB: large enough that per-block costs (a read call, a decode call, a
# record batch) vanish per line, small enough to stay a modest part of a worker's memory.
BLOCK_BYTES = 4 << 20


@dataclass(frozen=True, slots=True)
class LongLine:
    """A line longer than the reader's cap, which it did not buffer: its first bytes and its length
    (without the newline)."""

    head: bytes
    size: int


# What a LongLine keeps of its line: enough for a quarantine excerpt.
LONG_LINE_HEAD = 4096


def iter_blocks(uri: str, client: Any = None, s3: S3Config | None = None, block_size: int = BLOCK_BYTES,
                max_line: int | None = None) -> Iterator[memoryview | LongLine]:
    """Stream one capture file as blocks of whole lines: each ends with ``\\n``, but the last may not.

    The lines of a block are :func:`iter_lines`'s. A block is about ``block_size`` bytes
    (more where one line is longer) and is a view of a buffer that the next block reuses:
    use it, or copy from it, before asking for the next. With ``max_line``, a line that
    does not fit in ``max(block_size, max_line + 1)`` bytes is not buffered whole: it comes
    as a :class:`LongLine` in its place, so memory stays bounded whatever the file holds.
    Raises :class:`ObjectMissing` if the object is gone.
    """
    if is_s3(uri):
        bucket, key = split_s3(uri)
        client = client or s3_client(s3)
        try:
            body = client.get_object(Bucket=bucket, Key=key)["Body"]
        except Exception as exc:  # botocore ClientError
            if is_not_found(exc):
                raise ObjectMissing(uri) from exc
            raise
        try:
            yield from _blocks(_readinto_of(body.read), block_size, max_line)
        finally:
            body.close()
        return
    try:
        f = open(uri, "rb", buffering=0)  # unbuffered: each read lands straight in the block's buffer
    except FileNotFoundError as exc:
        raise ObjectMissing(uri) from exc
    with f:
        yield from _blocks(f.readinto, block_size, max_line)


def _readinto_of(read: Callable[[int], bytes]) -> Callable[[memoryview], int]:
    """``readinto`` for a stream that only has ``read(n)`` (botocore's StreamingBody)."""
    def readinto(view: memoryview) -> int:
        data = read(len(view))
        view[: len(data)] = data
        return len(data)

    return readinto


def _blocks(readinto: Callable[[memoryview], int], block_size: int,
            max_line: int | None = None) -> Iterator[memoryview | LongLine]:
    """Fill a buffer, hand out its whole lines, carry the partial last line to the buffer's start.

    The buffer is filled before each block (streams may read short), and doubled while
    it holds no newline (a line longer than it), up to ``max_line + 1`` bytes: a line
    longer than that is read through to its end without being kept (see :class:`LongLine`).
    """
    buf = bytearray(max(1, block_size))
    have = searched = 0  # bytes in buf; bytes of them known to hold no newline
    while True:
        view = memoryview(buf)
        eof = False
        while have < len(buf):
            n = readinto(view[have:])
            if not n:
                eof = True
                break
            have += n
        if eof:
            if have:
                yield view[:have]  # the last block: its last line may lack a newline
            return
        cut = buf.rfind(b"\n", searched, have) + 1
        if not cut:
            if max_line is not None and len(buf) > max_line:
                # The line at buf[0] is over the cap: skip to its end, keeping only its head.
                head = bytes(view[:LONG_LINE_HEAD])
                rest = yield from _skip_line(readinto, buf, have, head)
                if rest < 0:
                    return
                have, searched = rest, 0
                continue
            # No newline yet: the line is longer than the buffer. A new, larger buffer
            # (the old one may still be viewed by the caller, so it cannot be resized).
            size = 2 * len(buf) if max_line is None else min(2 * len(buf), max_line + 1)
            bigger = bytearray(size)
            bigger[:have] = view[:have]
            buf, searched = bigger, have
            continue
        yield view[:cut]
        rest = have - cut
        # A copy first: the two ranges may overlap. Same length, so allowed while views exist.
        buf[:rest] = bytes(view[cut:have])
        have, searched = rest, rest


def _skip_line(readinto: Callable[[memoryview], int], buf: bytearray, size: int,
               head: bytes) -> Generator[LongLine, None, int]:
    """Read the rest of a line of which ``size`` bytes were read, into ``buf`` again and again;
    yield its :class:`LongLine` and return how many bytes after its newline ``buf`` starts with
    (-1 at the end of the file)."""
    view = memoryview(buf)
    while True:
        n = readinto(view)
        if not n:
            yield LongLine(head, size)
            return -1
        nl = buf.find(b"\n", 0, n)
        if nl >= 0:
            yield LongLine(head, size + nl)
            rest = n - nl - 1
            buf[:rest] = bytes(view[nl + 1:n])
            return rest
        size += n


def iter_lines(uri: str, client: Any = None, s3: S3Config | None = None, chunk_size: int = 1 << 20) -> Iterator[bytes]:
    """Stream the lines of one capture file, split on ``\\n`` only, without the newline.

    Nothing else is stripped (``\\r``, a BOM: the decoders judge those), empty lines are
    lines, a final line without a newline is still yielded, and a trailing newline yields
    no empty line. ``chunk_size`` is the block size (see :func:`iter_blocks`). Raises
    :class:`ObjectMissing` if the object is gone.
    """
    for block in iter_blocks(uri, client=client, s3=s3, block_size=chunk_size):
        lines = bytes(block).split(b"\n")
        if lines[-1] == b"":
            lines.pop()  # the block's final newline
        yield from lines
