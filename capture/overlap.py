"""Held-out hygiene: does a held-out conversation repeat a training prompt?

A held-out set that shares a user question with the training data measures
memory, not adaptation: a head trained on "Write a function that sorts a list"
answers that prompt far better than it answers real new traffic. Ids do not
catch it (the same question is asked under another id, another tool schema or
another system prompt), so the comparison is on the users' own words:

* **exact**: a user turn of the held-out conversation equals a training user turn
  after normalization (Unicode NFKC, case folded, whitespace collapsed);
* **near**: the held-out conversation's user text shares at least
  ``near_threshold`` of its word 3-shingles (Jaccard) with one training
  conversation's user text.

Short turns ("thanks", "continue") say nothing about the question, so turns
under ``MIN_WORDS`` words never count as a match.

Rows are ShareGPT (``{"conversations": [{"from": "human", "value": ...}]}``) or
OpenAI-style prompts (``{"messages": [{"role": "user", "content": ...}]}``).
"""

from __future__ import annotations

import re
import unicodedata
import zlib
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable

MIN_WORDS = 3
SHINGLE = 3
NEAR_THRESHOLD = 0.8
# Near-duplicate search needs enough words for shingles to mean anything.
NEAR_MIN_WORDS = 8

_WS = re.compile(r"\s+")
_WORD = re.compile(r"\w+")


def normalize(text: str) -> str:
    return _WS.sub(" ", unicodedata.normalize("NFKC", text).casefold()).strip()


def user_turns(row: dict[str, Any]) -> list[str]:
    """The user's own turns of a ShareGPT row or an OpenAI-style prompt."""
    if row.get("conversations") is not None:
        return [t.get("value") or "" for t in row["conversations"] if t.get("from") in ("human", "user")]
    return [m["content"] if isinstance(m.get("content"), str) else str(m.get("content") or "")
            for m in row.get("messages") or [] if m.get("role") == "user"]


def _exact_keys(row: dict[str, Any]) -> set[str]:
    return {n for n in (normalize(t) for t in user_turns(row)) if len(n.split(" ")) >= MIN_WORDS}


def _shingles(row: dict[str, Any]) -> set[int]:
    words = _WORD.findall(normalize(" ".join(user_turns(row))))
    if len(words) < NEAR_MIN_WORDS:
        return set()
    return {zlib.crc32(" ".join(words[i:i + SHINGLE]).encode()) for i in range(len(words) - SHINGLE + 1)}


def row_id(row: dict[str, Any], i: int) -> str:
    return str(row.get("id") or row.get("content_hash") or i)


@dataclass
class PromptIndex:
    """One side (usually training), indexed once: exact user turns and an inverted shingle index."""

    exact: dict[str, str] = field(default_factory=dict)  # normalized turn -> an indexed row id
    shingles: list[set[int]] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)
    by_shingle: dict[int, list[int]] = field(default_factory=lambda: defaultdict(list))

    @classmethod
    def build(cls, rows: Iterable[dict[str, Any]]) -> "PromptIndex":
        idx = cls()
        for i, row in enumerate(rows):
            rid = row_id(row, i)
            for key in _exact_keys(row):
                idx.exact.setdefault(key, rid)
            sh = _shingles(row)
            if sh:
                j = len(idx.shingles)
                idx.shingles.append(sh)
                idx.ids.append(rid)
                for s in sh:
                    idx.by_shingle[s].append(j)
        return idx

    def match(self, row: dict[str, Any], near_threshold: float = NEAR_THRESHOLD) -> tuple[str, str] | None:
        """``("exact" | "near", indexed id)`` for the first match of ``row``, else None."""
        for key in _exact_keys(row):
            if key in self.exact:
                return "exact", self.exact[key]
        sh = _shingles(row)
        if not sh:
            return None
        shared = Counter(j for s in sh for j in self.by_shingle.get(s, ()))
        for j, n in shared.most_common():
            if n / (len(sh) + len(self.shingles[j]) - n) >= near_threshold:
                return "near", self.ids[j]
            if n / len(sh) < near_threshold:  # no later candidate shares more
                break
        return None


def overlap(train_rows: Iterable[dict[str, Any]], heldout_rows: list[dict[str, Any]],
            near_threshold: float = NEAR_THRESHOLD) -> dict[str, Any]:
    """How many held-out rows repeat a training prompt, and which (``matches``: held-out id -> kind, train id)."""
    idx = PromptIndex.build(train_rows)
    matches: dict[str, dict[str, str]] = {}
    for i, row in enumerate(heldout_rows):
        m = idx.match(row, near_threshold)
        if m:
            matches[row_id(row, i)] = {"kind": m[0], "train_id": m[1]}
    kinds = Counter(m["kind"] for m in matches.values())
    return {"heldout": len(heldout_rows), "repeats_training": len(matches), "exact": kinds.get("exact", 0),
            "near": kinds.get("near", 0), "near_threshold": near_threshold, "matches": matches}


def drop_repeats(train_rows: Iterable[dict[str, Any]], heldout_rows: list[dict[str, Any]],
                 near_threshold: float = NEAR_THRESHOLD) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Held-out rows that repeat no training prompt, and the :func:`overlap` report."""
    rep = overlap(train_rows, heldout_rows, near_threshold)
    kept = [r for i, r in enumerate(heldout_rows) if row_id(r, i) not in rep["matches"]]
    return kept, rep
