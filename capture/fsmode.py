"""Owner-only files and directories for what holds user traffic or run state.

Captures, the warehouse (Parquet and its catalog) and state files hold prompts,
answers and quarantined raw lines, so they are created readable by their owner only
(files 0600, directories 0700) whatever the process umask: a mode passed to open or
mkdir is filtered by the umask, so each is set explicitly. Directories that exist
already are left as they are (a configured path may be shared on purpose, or be /tmp).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

FILE_MODE = 0o600
DIR_MODE = 0o700

_umask_lock = threading.Lock()


def private_dirs(path: str | Path) -> Path:
    """``mkdir -p path``, each directory it creates owner-only; returns ``path``."""
    path = Path(path)
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=DIR_MODE)
        except FileExistsError:
            continue  # made meanwhile by another process, which sets its mode
        os.chmod(d, DIR_MODE)
    return path


def create_private(path: str | Path, exclusive: bool = True) -> int:
    """Open ``path`` for writing as a new owner-only file (or truncate it, if not ``exclusive``); returns the fd."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_EXCL if exclusive else os.O_TRUNC)
    fd = os.open(path, flags, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_private(path: str | Path, data: bytes | str) -> None:
    """Write ``data`` to ``path`` (created or truncated) as an owner-only file."""
    with os.fdopen(create_private(path, exclusive=False), "wb") as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)


@contextmanager
def owner_only_umask() -> Iterator[None]:
    """Files and directories created inside (by code that takes no mode, such as DuckDB) are owner-only.

    The umask belongs to the process: the lock keeps two of these from restoring each
    other's value; another thread creating a file meanwhile only gets a stricter mode.
    """
    with _umask_lock:
        old = os.umask(0o077)
        try:
            yield
        finally:
            os.umask(old)
