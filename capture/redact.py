"""PII and secret redaction: typed placeholders, counted per type.

Python's regex engine scans prose at ~15 ns a character per pattern, which would
cost more than all the JSON decoding of a record. So :func:`redact_array` first
runs a gate that matches a superset of every detector (:data:`GATE`), and only the
strings it flags go through the precise detectors (lookarounds, Luhn check,
per-type counts) of :class:`Redactor`. The gate is the native module's
``redact_gate`` (``capture/_native/gate.c``: one pass over the Arrow buffers, a
superset of GATE's matches) where that module is loaded, else GATE itself as one
RE2 pattern (pyarrow, linear time, vectorized).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING

from capture import native

if TYPE_CHECKING:
    import pyarrow as pa

PLACEHOLDER = "[REDACTED_{}]"

_EMAIL = re.compile(r"[A-Za-z0-9._%+\-]+@[A-Za-z0-9\-]+(?:\.[A-Za-z0-9\-]+)*\.[A-Za-z]{2,}")
_AWS_KEY = re.compile(r"\b(?:AKIA|ASIA|AGPA|AIDA|AROA|AIPA|ANPA|ANVA|ABIA|ACCA)[A-Z0-9]{16}\b")
# A secret access key is 40 base64 characters; alone that also matches hashes and
# identifiers, so either a nearby label or a mix of cases, digits and / or + is required.
_AWS_SECRET_LABELLED = re.compile(
    r"(?i)(aws_?secret_?(?:access_?)?key|secret_?access_?key)(\"?\s*[:=]\s*[\"']?)([A-Za-z0-9/+]{40})(?![A-Za-z0-9/+=])"
)
_AWS_SECRET_BARE = re.compile(r"(?<![A-Za-z0-9/+=])[A-Za-z0-9/+]{40}(?![A-Za-z0-9/+=])")
_BEARER = re.compile(r"(?i)\b(bearer)(\s+)[A-Za-z0-9\-._~+/]{8,}=*")
_API_KEY = re.compile(
    r"\b(?:sk-(?:proj-|ant-(?:api\d\d-)?)?[A-Za-z0-9_\-]{20,}"
    r"|gh[pousr]_[A-Za-z0-9]{30,}"
    r"|github_pat_[A-Za-z0-9_]{30,}"
    r"|xox[abposr]-[A-Za-z0-9\-]{10,}"
    r"|AIza[0-9A-Za-z\-_]{35}"
    r"|hf_[A-Za-z0-9]{30,})"
)
_API_KEY_LABELLED = re.compile(r"(?i)\b(api[_\-]?key|x-api-key|access[_\-]?token)(\"?\s*[:=]\s*[\"']?)([A-Za-z0-9\-_.]{16,})")
_CARD = re.compile(r"(?<![\d\-])\d(?:[ \-]?\d){12,18}(?![\d\-])")
_PHONE = re.compile(
    r"(?<![\w+])(?:"
    r"\+\d{1,3}[ .\-]?(?:\(\d{1,4}\)[ .\-]?)?\d{1,4}(?:[ .\-]?\d{2,4}){2,4}"  # international, leading +
    r"|(?:1[ .\-])?\(\d{3}\)[ .\-]?\d{3}[ .\-]\d{4}"  # (555) 123-4567
    r"|(?:1[ .\-])?\d{3}[.\-]\d{3}[.\-]\d{4}"  # 555-123-4567, 555.123.4567
    r")(?![\w])"
)
# Cheap gates: each starts with a literal or \d, which the regex engine scans for quickly.
_AWS_KEY_GATE = re.compile(r"A(?:KIA|SIA|GPA|IDA|ROA|IPA|NPA|NVA|BIA|CCA)")
_GH_GATE = re.compile(r"gh[pousr]_")
_LONG_WORD = re.compile(r"[A-Za-z0-9/+]{40}")
_CARD_GATE = re.compile(r"\d(?:[ \-]?\d){12}")
_PHONE_GATE = re.compile(r"\d{3}[ .\-)]{1,2}\d{3}|\+\d")
_HAS_UPPER = re.compile(r"[A-Z]")
_HAS_LOWER = re.compile(r"[a-z]")
_HAS_DIGIT = re.compile(r"\d")


def luhn_ok(digits: str) -> bool:
    """Luhn checksum of a string of digits."""
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = ord(ch) - 48
        if i % 2:
            d *= 2
            if d > 9:
                d -= 9
        total += d
    return total % 10 == 0


class Redactor:
    """Replace PII/secrets with ``[REDACTED_<TYPE>]``; ``counts`` accumulates per type."""

    TYPES = ("EMAIL", "PHONE", "CARD", "AWS_ACCESS_KEY", "AWS_SECRET_KEY", "BEARER_TOKEN", "API_KEY")

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def _bump(self, kind: str, n: int = 1) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + n

    def redact(self, text: str) -> str:
        """Return ``text`` with every detected item replaced by its placeholder."""
        if "@" in text:
            text = self._simple(_EMAIL, text, "EMAIL")
        if "A" in text and _AWS_KEY_GATE.search(text):
            text = self._simple(_AWS_KEY, text, "AWS_ACCESS_KEY")
        if "earer" in text or "EARER" in text:
            text = _BEARER.sub(self._bearer, text)
        if ("sk-" in text or "_pat_" in text or "xox" in text or "AIza" in text or "hf_" in text
                or "gh" in text and _GH_GATE.search(text)):
            text = self._simple(_API_KEY, text, "API_KEY")
        if "ey" in text or "EY" in text or "oken" in text or "OKEN" in text:
            lowered = text.lower()
            if "key" in lowered or "token" in lowered:
                text = _API_KEY_LABELLED.sub(self._labelled("API_KEY"), text)
                if "secret" in lowered:
                    text = _AWS_SECRET_LABELLED.sub(self._labelled("AWS_SECRET_KEY"), text)
        # Words of 40+ characters are rare in prose; only then look for a bare secret key.
        if len(text) >= 40 and _LONG_WORD.search(text):
            text = _AWS_SECRET_BARE.sub(self._bare_secret, text)
        if _CARD_GATE.search(text):
            text = _CARD.sub(self._card, text)
        if _PHONE_GATE.search(text):
            text = self._simple(_PHONE, text, "PHONE")
        return text

    def redact_many(self, texts: list[str]) -> list[str]:
        """Redact several strings in one pass (NUL joins them; no pattern matches NUL)."""
        if len(texts) == 1:
            return [self.redact(texts[0])]
        if any("\x00" in t for t in texts):
            return [self.redact(t) for t in texts]
        return self.redact("\x00".join(texts)).split("\x00")

    def _simple(self, pattern: re.Pattern[str], text: str, kind: str) -> str:
        out, n = pattern.subn(PLACEHOLDER.format(kind), text)
        if n:
            self._bump(kind, n)
        return out

    def _bearer(self, m: re.Match[str]) -> str:
        self._bump("BEARER_TOKEN")
        return f"{m.group(1)}{m.group(2)}{PLACEHOLDER.format('BEARER_TOKEN')}"

    def _labelled(self, kind: str) -> Callable[[re.Match[str]], str]:
        def repl(m: re.Match[str]) -> str:
            if m.group(3).startswith("[REDACTED"):
                return m.group(0)
            self._bump(kind)
            return f"{m.group(1)}{m.group(2)}{PLACEHOLDER.format(kind)}"

        return repl

    def _bare_secret(self, m: re.Match[str]) -> str:
        s = m.group(0)
        if _HAS_UPPER.search(s) and _HAS_LOWER.search(s) and _HAS_DIGIT.search(s) and ("/" in s or "+" in s):
            self._bump("AWS_SECRET_KEY")
            return PLACEHOLDER.format("AWS_SECRET_KEY")
        return s

    def _card(self, m: re.Match[str]) -> str:
        s = m.group(0)
        digits = s.replace(" ", "").replace("-", "")
        if 13 <= len(digits) <= 19 and luhn_ok(digits):
            self._bump("CARD")
            return PLACEHOLDER.format("CARD")
        return s


# A superset of every detector below, in RE2 syntax (no lookarounds). capture/_native/gate.c
# finds a superset of its matches by hand: change the two together.
GATE = (
    r"@|A(?:KIA|SIA|GPA|IDA|ROA|IPA|NPA|NVA|BIA|CCA)|(?i:bearer)|sk-|gh[pousr]_|github_pat_|xox|AIza|hf_"
    r"|(?i:api[_\-]?key|access[_\-]?token)|[A-Za-z0-9/+]{40}"
    r"|\d(?:[ \-]?\d){12,18}|\d{3}[ .\-)]{1,2}\d{3}|\+\d"
)


def _flagged(values: "pa.Array") -> list[int]:
    """Indices of the strings that may hold something to redact: a superset of those GATE matches."""
    import numpy as np
    import pyarrow as pa

    nat = native.get()
    if nat is not None and isinstance(values, pa.Array) and values.type == pa.string():
        if not len(values):
            return []
        hits = nat.redact_gate(*native.utf8_args(values))
        return np.frombuffer(hits, dtype=np.int64).tolist()
    return _flagged_re2(values)


def _flagged_re2(values: "pa.Array") -> list[int]:
    """Indices of the strings GATE matches (RE2)."""
    import pyarrow.compute as pc

    return pc.indices_nonzero(pc.match_substring_regex(values, GATE)).to_pylist()


def redact_values(values: list[str]) -> dict[int, dict[str, int]]:
    """Redact ``values`` in place; returns ``{index: {type: count}}`` for the strings that changed."""
    import pyarrow as pa

    if not values:
        return {}
    redacted, out = redact_array(pa.array(values, pa.string()))
    for i in out:
        values[i] = redacted[i].as_py()
    return out


def redact_array(values: "pa.Array") -> tuple["pa.Array", dict[int, dict[str, int]]]:
    """Redact an Arrow string array: the redacted array and ``{index: {type: count}}`` for the strings that changed."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    if not len(values):
        return values, {}
    out: dict[int, dict[str, int]] = {}
    new: list[str] = []
    for i in _flagged(values):
        r = Redactor()
        text = r.redact(values[i].as_py())
        if r.counts:  # no count means nothing was replaced
            out[i] = r.counts
            new.append(text)
    if not out:
        return values, out
    mask = np.zeros(len(values), dtype=bool)
    mask[list(out)] = True
    return pc.replace_with_mask(values, pa.array(mask), pa.array(new, pa.string())), out


def redact_text(text: str) -> tuple[str, dict[str, int]]:
    """Redact one string; returns the new text and the per-type counts."""
    r = Redactor()
    return r.redact(text), r.counts
