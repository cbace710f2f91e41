"""Sets of content hashes: a run dedupes against every stored conversation's and its own, and stitches
(capture.stitch) against the prefix hashes of both."""
from __future__ import annotations

import numpy as np
import pyarrow as pa

from capture import backend, native


def first_seen(hashes: list[str], seen: set[str]) -> list[bool]:
    """True for each hash not in ``seen`` nor earlier in ``hashes``; adds the new ones to ``seen``."""
    keep = []
    for h in hashes:
        new = h not in seen
        if new:
            seen.add(h)
        keep.append(new)
    return keep


def _plain(hashes: pa.Array | pa.ChunkedArray) -> pa.Array:
    """``hashes`` as one ``pa.string()`` array."""
    if isinstance(hashes, pa.ChunkedArray):
        hashes = hashes.combine_chunks() if hashes.num_chunks else pa.nulls(0, pa.string())
    if hashes.type != pa.string():
        hashes = hashes.cast(pa.string())
    return hashes


class HashSet:
    """Content hashes (32 hex characters), 16 bytes each in the native module's open-addressing
    table; a Python set of the strings where the module is unavailable.

    A set of ``str`` costs ~100 bytes and a Python object per hash, and a warehouse of ten
    million conversations loads all of them at every run; the table costs 32 bytes each.
    """

    def __init__(self) -> None:
        self._nat = backend.native()
        self._py: set[str] | None = None if self._nat is not None else set()
        self._slots = 1024
        self._table = bytearray(16 * (self._slots + 1))
        self._count = 0

    def __len__(self) -> int:
        return len(self._py) if self._py is not None else self._count

    def add_new(self, hashes: pa.Array | pa.ChunkedArray) -> np.ndarray:
        """Adds ``hashes``; True for each one neither in the set before nor earlier in ``hashes``."""
        hashes = _plain(hashes)
        if self._py is not None:
            return np.array(first_seen(hashes.to_pylist(), self._py), dtype=bool)
        self._reserve(self._count + len(hashes))
        got = self._nat.digests_add_new(self._table, self._slots, *native.utf8_args(hashes))
        mask = np.frombuffer(got, dtype=np.bool_)
        self._count += int(np.count_nonzero(mask))
        return mask

    def contains(self, hashes: pa.Array | pa.ChunkedArray) -> np.ndarray:
        """True for each of ``hashes`` that is in the set; adds nothing."""
        hashes = _plain(hashes)
        if not self or not len(hashes):
            return np.zeros(len(hashes), dtype=bool)
        if self._py is not None:
            seen = self._py
            return np.array([h in seen for h in hashes.to_pylist()], dtype=bool)
        got = self._nat.digests_contains(self._table, self._slots, *native.utf8_args(hashes))
        return np.frombuffer(got, dtype=np.bool_)

    def native_table(self, more: int) -> tuple[bytearray, int, int] | None:
        """``(table, slots, room)`` for the native decoder to add up to ``room`` (>= ``more``) hashes
        to, in place; report what it added with :meth:`added`. ``None`` without the module."""
        if self._py is not None:
            return None
        self._reserve(self._count + more)
        return self._table, self._slots, self._slots // 2 - self._count

    def added(self, n: int) -> None:
        """Counts ``n`` hashes the native decoder added to :meth:`native_table`'s table."""
        self._count += n

    def _reserve(self, n: int) -> None:
        """Grows the table so that ``n`` hashes leave it at most half full (probes stay short)."""
        slots = self._slots
        while 2 * n > slots:
            slots *= 2
        if slots != self._slots:
            table = bytearray(16 * (slots + 1))
            self._nat.digests_rehash(self._table, self._slots, table, slots)
            self._table, self._slots = table, slots
