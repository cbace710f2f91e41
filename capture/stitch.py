"""Conversation stitching: a multi-turn chat is kept once, at its longest.

A chat client sends the whole history with every request, so a conversation of n turns
leaves n capture records, each a prefix of the next. Training on all of them would weigh
the first turns n times; this module keeps only the maximal rows.

**Definition.** Row A is a *stitched prefix* of row B when A's turns equal B's first
``len(A)`` turns exactly, as stored (after redaction), ``len(A) < len(B)``, and A ends at
an assistant turn of B. Every row ingest makes ends with the response, an assistant
turn, so the last condition only says where to look: the *prefix hashes* of a row are
the content hashes (:func:`capture.ingest.content_hash`) of its turns ``[:k]`` for each
``k < len`` whose turn ``k - 1`` is an assistant (``gpt``) turn. A is a stitched prefix of
B exactly when A's content hash is among B's prefix hashes. Consequences:

* *branching* (one history, two continuations) keeps both leaves; the shared prefix
  record, a prefix of each, is dropped;
* *edited history* (an earlier turn changed) shares no prefix hash: another conversation;
* an identical record is no proper prefix: it stays a duplicate;
* a row whose only assistant turn is its last (every single-turn exchange) has no prefix
  hashes, so they cost nothing for such traffic; it can still *be* a prefix, which one
  lookup of its content hash in the set of known prefix hashes finds.

**Order.** The result does not depend on the order records arrive in, within a file,
across the files of a run, or across runs: a row is dropped on arrival when a longer
version is known (its hash is a known prefix hash), and a row already taken in is
*superseded* when a longer version arrives (one of the newcomer's prefix hashes is its
content hash). Both sets are kept whole: the prefix hashes of every row taken in (in
the catalog table ``prefix_hashes``, since one hash per assistant turn of a row is far
less than the row) and the content hashes of every stored row (``content_hashes``).

**Where it runs.** A worker stitches within its file (:func:`stitch_file`, longest rows
first, so that only the kept rows' prefixes are hashed) and hands the parent the prefix
hashes of the rows it keeps; the parent (:class:`Known`) stitches
across files and runs. A row of an earlier run that is superseded stays in its Parquet
part (parts are immutable) and is recorded in the catalog table ``superseded``, which
every reader of the warehouse leaves out. A row of the same run that is superseded is
dropped from its buffer before it is written, or, if it was written already, recorded in
``superseded`` too.

**Several writers.** Each run stitches against what the catalog held when it last looked;
its commit reconciles its rows with what other runs committed since, by the same rules
(:class:`capture.warehouse.Warehouse`), so the result does not depend on which writer read
which record either.

**Counts.** Each line that becomes a conversation ends as exactly one of: *normalized*
(stored, and the longest version known at the end of the run), *duplicate* (an exact
replay of a conversation taken in before, in the file, the run or the warehouse), or
*stitched* (a proper prefix of a conversation known to the run or the warehouse), so
``read = normalized + duplicates + stitched + quarantined + skipped``. A prefix check
comes before the run-wide duplicate check (a replay of a superseded row is stitched), and
after the in-file duplicate check (the decoder drops in-file replays first). A row taken
in earlier in the same run and superseded later in it moves from normalized to stitched
in the run's totals (the per-file manifest counts stay as decided when the file was
read). Rows of earlier runs superseded by this run are counted apart, as *superseded*:
they were read by another run, so they are no part of this run's ``read``; the warehouse
grows by ``normalized - superseded`` conversations.

**Time split.** With one row per conversation, whose ``inference_time`` is its last
turn's, the time split (:mod:`capture.split`) cannot put two turns of one conversation
on different sides. Branches are separate conversations: two branches of one history
may fall on different sides, and their shared prefix with them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from capture import backend, native
from capture.dedupe import HashSet
from capture.rules import GPT


def _strings(values: list[str]) -> pa.Array:
    """A string array built from buffers: ``pa.array`` (and scalar conversion) would import pandas
    into the worker or the ingest parent (~0.15 s of CPU each)."""
    data = [v.encode("utf-8") for v in values]
    offsets = np.cumsum([0] + [len(d) for d in data], dtype=np.int64).astype(np.int32)
    return pa.StringArray.from_buffers(len(values), pa.py_buffer(offsets.tobytes()), pa.py_buffer(b"".join(data)))


def _mask(keep: np.ndarray) -> pa.Array:
    """A numpy bool mask as an Arrow one (without ``pa.array``, see :func:`_strings`)."""
    bits = np.packbits(np.asarray(keep, dtype=bool), bitorder="little")
    return pa.Array.from_buffers(pa.bool_(), len(keep), [None, pa.py_buffer(bits)])


def _index(ix: np.ndarray) -> pa.Array:
    """Numpy indices as an Arrow int64 array (without ``pa.array``, see :func:`_strings`)."""
    ix = np.ascontiguousarray(ix, dtype=np.int64)
    return pa.Array.from_buffers(pa.int64(), len(ix), [None, pa.py_buffer(ix)])


EMPTY = _strings([])
GPT_SET = _strings([GPT])


def _bools(arr: pa.Array) -> np.ndarray:
    """A boolean Arrow array without nulls as numpy, from its bitmap (``to_numpy`` would import pandas)."""
    n = len(arr)
    if not n:
        return np.zeros(0, bool)
    bits = np.frombuffer(arr.buffers()[1], dtype=np.uint8)
    return np.unpackbits(bits, bitorder="little")[arr.offset: arr.offset + n].astype(bool)


def _ints(arr: pa.Array) -> np.ndarray:
    """An int32 Arrow array without nulls as numpy, from its buffer."""
    if not len(arr):
        return np.zeros(0, np.int32)
    return np.frombuffer(arr.buffers()[1], dtype=np.int32)[arr.offset: arr.offset + len(arr)]


def boundaries(offsets: np.ndarray, t_from: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The prefixes to hash: ``(rows, starts, ends)``, one entry per assistant turn that is not its row's last.

    ``offsets`` are the rows' turn offsets into ``t_from`` (the rows' speakers, flattened);
    prefix ``i`` is turns ``[starts[i], ends[i])`` of row ``rows[i]``.
    """
    offsets = np.asarray(offsets, dtype=np.int64)
    n_turns = int(offsets[-1]) if len(offsets) else 0
    if n_turns == 0:
        z = np.zeros(0, np.int32)
        return z, z, z
    is_gpt = _bools(pc.is_in(t_from.slice(0, n_turns), value_set=GPT_SET))
    lasts = offsets[1:][offsets[1:] > offsets[:-1]] - 1
    is_gpt[lasts] = False
    at = np.flatnonzero(is_gpt)
    rows = np.searchsorted(offsets, at, side="right") - 1
    return rows.astype(np.int32), offsets[rows].astype(np.int32), (at + 1).astype(np.int32)


def range_hashes(starts: np.ndarray, ends: np.ndarray, t_from: pa.Array, t_value: pa.Array) -> pa.Array:
    """The content hash of turns ``[starts[i], ends[i])`` of each range, as a string array.

    A prefix is hashed from its row's start (a prefix's hash is that of a row of its turns):
    the work grows with the square of a row's assistant turns, as the capture records of a
    chat do anyway (each carries the whole history).
    """
    n = len(starts)
    if n == 0:
        return EMPTY
    starts = np.ascontiguousarray(starts, dtype=np.int32)
    ends = np.ascontiguousarray(ends, dtype=np.int32)
    nat = backend.native()
    plain = not t_from.null_count and not t_value.null_count and t_from.type == t_value.type == pa.string()
    if nat is not None and plain:
        hexes = nat.range_hashes(starts, ends, *native.utf8_args(t_from)[:4], *native.utf8_args(t_value)[:4])
    else:
        hexes = _range_hashes_hashlib(starts, ends, t_from, t_value)
    bounds = np.arange(0, 32 * (n + 1), 32, dtype=np.int32)
    return pa.StringArray.from_buffers(n, pa.py_buffer(bounds), pa.py_buffer(hexes))


def _range_hashes_hashlib(starts: np.ndarray, ends: np.ndarray, t_from: pa.Array, t_value: pa.Array) -> bytes:
    """The hex digests of :func:`range_hashes`, concatenated, with hashlib (as ``ingest._content_hashes_hashlib``)."""
    lens = pc.cast(pc.utf8_length(t_value), pa.string())
    flat = pc.binary_join_element_wise(t_from, lens, t_value, ":")
    if flat.null_count or flat.offset or pa.types.is_large_string(flat.type):
        flat = pa.array(flat.to_pylist(), pa.string())
    turn_ends = np.frombuffer(flat.buffers()[1], dtype=np.int32)[: len(flat) + 1]
    data = memoryview(flat.buffers()[2] or b"")
    blake = hashlib.blake2b
    a, b = turn_ends[starts].tolist(), turn_ends[ends].tolist()
    return b"".join([blake(data[i:j], digest_size=16).digest() for i, j in zip(a, b)]).hex().encode("ascii")


@dataclass
class Prefixes:
    """The prefix hashes of a table's rows: ``hashes[i]`` is a prefix of row ``rows[i]``."""

    hashes: pa.Array
    rows: np.ndarray

    def __len__(self) -> int:
        return len(self.hashes)


def _turns(table: pa.Table) -> tuple[np.ndarray, pa.Array, pa.Array] | None:
    """The rows' turn offsets (from 0) and their speakers and values, flattened; ``None`` without rows."""
    col = table.column("conversations")
    convs = col.combine_chunks() if col.num_chunks > 1 else col.chunk(0) if col.num_chunks else None
    if convs is None or not len(convs):
        return None
    offsets = _ints(convs.offsets).astype(np.int64)
    offsets -= offsets[0]
    turns = convs.flatten()
    return offsets, turns.field("from"), turns.field("value")


def table_prefixes(table: pa.Table) -> Prefixes:
    """The prefix hashes of every row of a table in :data:`capture.warehouse.SCHEMA`."""
    got = _turns(table)
    if got is None:
        return Prefixes(EMPTY, np.zeros(0, np.int32))
    offsets, t_from, t_value = got
    rows, starts, ends = boundaries(offsets, t_from)
    return Prefixes(range_hashes(starts, ends, t_from, t_value), rows)


def stitch_file(table: pa.Table, row_redactions: list[tuple[int, dict[str, int]]]
                ) -> tuple[pa.Table, list[tuple[int, dict[str, int]]], int, Prefixes]:
    """Drop the rows of one file's table that are stitched prefixes of others in it.

    ``table`` holds no two rows alike (in-file replays are gone). Returns the kept rows,
    their redaction counts renumbered, how many rows were dropped, and the prefix hashes
    of the kept rows. Rows are taken longest first, a group of one length at a time: a
    row that is a prefix of a longer one is dropped before its own prefixes are hashed
    (they are prefixes of the longer row too), so only the kept rows' prefixes are hashed.
    """
    got = _turns(table)
    none = Prefixes(EMPTY, np.zeros(0, np.int32))
    if got is None:
        return table, row_redactions, 0, none
    offsets, t_from, t_value = got
    rows, starts, ends = boundaries(offsets, t_from)
    if not len(rows):
        return table, row_redactions, 0, none
    col = table.column("content_hash")
    hashes = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    lengths = np.diff(offsets)
    row_len = lengths[rows]  # the length of each prefix's row
    seen = HashSet()  # the prefix hashes of the longer rows kept so far
    drop = np.zeros(len(hashes), bool)
    got_h, got_r = [], []
    # A row longer than every row with a prefix is no prefix and has none: left alone.
    for length in np.unique(lengths[lengths <= row_len.max()])[::-1]:
        if len(seen):
            group = np.flatnonzero(lengths == length)
            drop[group[seen.contains(hashes.take(_index(group)))]] = True
        mine = np.flatnonzero(row_len == length)
        mine = mine[~drop[rows[mine]]]
        if len(mine):
            got_h.append(range_hashes(starts[mine], ends[mine], t_from, t_value))
            got_r.append(mine)
            seen.add_new(got_h[-1])
    if got_h:
        at = np.concatenate(got_r)
        order = np.argsort(at, kind="stable")  # back in row order
        pre = Prefixes(pa.concat_arrays(got_h).take(_index(order)), rows[at[order]])
    else:
        pre = none
    n_drop = int(drop.sum())
    if not n_drop:
        return table, row_redactions, 0, pre
    keep = ~drop
    new_index = np.cumsum(keep) - 1
    table = table.filter(_mask(keep))
    row_redactions = [(int(new_index[i]), c) for i, c in row_redactions if keep[i]]
    return table, row_redactions, n_drop, Prefixes(pre.hashes, new_index[pre.rows].astype(np.int32))


@dataclass
class Decision:
    """What :meth:`Known.decide` made of one file's rows."""

    keep: np.ndarray  # rows to store
    stitched: int  # rows dropped: prefixes of conversations known before
    duplicates: int  # rows dropped: replays of conversations taken in before
    prefix_hashes: pa.Array  # the prefix hashes of the kept rows ...
    prefix_of: pa.Array  # ... and the content hash of the row each is a prefix of
    stored_gone: pa.Array  # rows of earlier runs now superseded ...
    stored_by: pa.Array  # ... and the content hash of a row superseding each
    run_gone: pa.Array  # rows this run took in, now superseded ...
    run_by: pa.Array  # ... and the content hash of a row superseding each


class Known:
    """Everything a run dedupes and stitches against, as digest tables (:class:`capture.dedupe.HashSet`).

    ``stored``: content hashes of the rows earlier runs stored; ``run``: those this run took
    in; ``prefixes``: prefix hashes of all of them; ``gone``: content hashes of the rows
    superseded so far. Load the catalog's with :meth:`load` first.
    """

    def __init__(self) -> None:
        self.stored, self.run, self.prefixes, self.gone = HashSet(), HashSet(), HashSet(), HashSet()

    def load(self, stored: Iterable[pa.Array], prefixes: Iterable[pa.Array], gone: Iterable[pa.Array]) -> None:
        for target, batches in ((self.stored, stored), (self.prefixes, prefixes), (self.gone, gone)):
            for b in batches:
                target.add_new(b)

    def decide(self, hashes: pa.Array | pa.ChunkedArray, pre: Prefixes | None) -> Decision:
        """Stitch and dedupe one file's rows (no two alike, none a prefix of another) against what is known,
        then add the kept ones to it."""
        if isinstance(hashes, pa.ChunkedArray):
            hashes = hashes.combine_chunks() if hashes.num_chunks else EMPTY
        n = len(hashes)
        is_prefix = self.prefixes.contains(hashes) if len(self.prefixes) else None
        if is_prefix is not None and is_prefix.any():
            keep = np.zeros(n, bool)
            cand = ~is_prefix
            keep[cand] = self._add_new(hashes.filter(_mask(cand)))
            stitched = int(is_prefix.sum())
        else:
            keep, stitched = self._add_new(hashes), 0
        d = Decision(keep=keep, stitched=stitched, duplicates=n - stitched - int(keep.sum()),
                     prefix_hashes=EMPTY, prefix_of=EMPTY, stored_gone=EMPTY, stored_by=EMPTY, run_gone=EMPTY,
                     run_by=EMPTY)
        if pre is None or not len(pre):
            return d
        mine = keep[pre.rows]
        if not mine.any():
            return d
        ph = pre.hashes.filter(_mask(mine)) if not mine.all() else pre.hashes
        of = hashes.take(_index(pre.rows[mine]))
        d.prefix_hashes, d.prefix_of = ph, of
        self.prefixes.add_new(ph)
        in_stored = self.stored.contains(ph)
        hit = in_stored | self.run.contains(ph)
        if hit.any():
            idx = np.flatnonzero(hit)
            first = self.gone.add_new(ph.take(_index(idx)))  # each row is superseded once
            idx, in_stored = idx[first], in_stored[idx[first]]
            old, new = idx[in_stored], idx[~in_stored]
            d.stored_gone, d.stored_by = ph.take(_index(old)), of.take(_index(old))
            d.run_gone, d.run_by = ph.take(_index(new)), of.take(_index(new))
        return d

    def _add_new(self, hashes: pa.Array) -> np.ndarray:
        """True for each hash neither stored nor taken in by this run before; takes them in."""
        new = self.run.add_new(hashes)
        if len(self.stored):
            new = new & ~self.stored.contains(hashes)
        return new
