"""PII and secret redaction: typed placeholders, counted per type.

Python's regex engine scans prose at ~15 ns a character per pattern, which would
cost more than all the JSON decoding of a record. So :func:`redact_array` first
runs a gate that matches a superset of every detector (:data:`GATE`), and only the
strings it flags go through the precise detectors (lookarounds, checksums,
per-type counts) of :class:`Redactor`. The gate is the native module's
``redact_gate`` (``capture/_native/gate.c``: one pass over the Arrow buffers, a
superset of GATE's matches) where that module is loaded, else GATE itself as one
RE2 pattern (pyarrow, linear time, vectorized). Whatever the redactor changes,
both gates flag (tests/capture/test_redact.py checks it with hypothesis).

Time per line: every detector runs in time linear in the string. Each unbounded
repetition is followed by a character its class cannot match (so a failed match
does not back off through it), the other repetitions are bounded, and e-mail
addresses are found from their ``@`` (a local part is at most 64 characters), not
by trying every start. Redacting a string therefore costs at most a constant per
character, and a line is at most ``capture.max_line_bytes``: that bound is the
per-line budget. It is deterministic, unlike a wall-clock budget, so a run redacts
the same way on a loaded machine. Patterns use ASCII semantics (``re.ASCII``):
``\\d`` is 0-9 and case folding is ASCII, as in the RE2 gate, so a homoglyph such
as ``apı_key`` (dotless ı) is no label to either.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Callable
from typing import TYPE_CHECKING

from capture import backend, native

if TYPE_CHECKING:
    import pyarrow as pa

PLACEHOLDER = "[REDACTED_{}]"
_A = re.ASCII

# E-mail: found from each "@" (see Redactor._emails): the domain matched forward, the local
# part (RFC 5321: at most 64 characters) walked back. Bounded labels keep a failed domain cheap.
_EMAIL_DOMAIN = re.compile(r"(?:[A-Za-z0-9\-]{1,63}\.){1,10}[A-Za-z]{2,63}", _A)
_EMAIL_LOCAL = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._%+-")
_AWS_KEY = re.compile(r"\b(?:AKIA|ASIA|AGPA|AIDA|AROA|AIPA|ANPA|ANVA|ABIA|ACCA)[A-Z0-9]{16}\b", _A)
# A secret access key is 40 base64 characters; alone that also matches hashes and
# identifiers, so either a nearby label or a mix of cases and digits is required.
_AWS_SECRET_LABELLED = re.compile(
    r"(?i)(aws_?secret_?(?:access_?)?key|secret_?access_?key)(\"?\s*[:=]\s*[\"']?)([A-Za-z0-9/+]{40})(?![A-Za-z0-9/+=])", _A
)
_AWS_SECRET_BARE = re.compile(r"(?<![A-Za-z0-9/+=])[A-Za-z0-9/+]{40}(?![A-Za-z0-9/+=])", _A)
_BEARER = re.compile(r"(?i)\b(bearer)(\s+)[A-Za-z0-9\-._~+/]{8,}=*", _A)
# A credential is base64 of "user:password", which has a character outside [a-z] (a word of
# prose after "basic" has none): the gates look for "basic", blanks, [a-z]* and such a character.
_BASIC = re.compile(r"(?i)\b(basic)(\s+)([A-Za-z0-9+/]{8,}={0,2})", _A)
_API_KEY = re.compile(
    r"\b(?:sk-(?:proj-|ant-(?:api\d\d-)?)?[A-Za-z0-9_\-]{20,}"
    r"|gh[pousr]_[A-Za-z0-9]{30,}"
    r"|github_pat_[A-Za-z0-9_]{30,}"
    r"|xox[abposr]-[A-Za-z0-9\-]{10,}"
    r"|AIza[0-9A-Za-z\-_]{35}"
    r"|hf_[A-Za-z0-9]{30,}"
    r"|[sr]k_(?:live|test)_[A-Za-z0-9]{16,}"  # Stripe secret and restricted keys
    r"|glpat-[A-Za-z0-9_\-]{20,}"  # GitLab personal access token
    r"|npm_[A-Za-z0-9]{36}"
    r"|SG\.[A-Za-z0-9_\-]{22}\.[A-Za-z0-9_\-]{43})",  # SendGrid
    _A,
)
_API_KEY_LABELLED = re.compile(r"(?i)\b(api[_\-]?key|x-api-key|access[_\-]?token)(\"?\s*[:=]\s*[\"']?)([A-Za-z0-9\-_.]{16,})", _A)
# After the path's first segment, 31 or more [A-Za-z0-9/]: with "services/" (or workflows/,
# triggers/) that is a run of 40 characters of [A-Za-z0-9/+], which the gates flag.
_SLACK_WEBHOOK = re.compile(r"https?://hooks\.slack\.com/(?:services|workflows|triggers)/[A-Za-z0-9/]{31,}", _A)
# Azure storage / Service Bus connection strings; the key (40+ base64) is a run the gates flag.
_AZURE_KEY = re.compile(r"(?i)\b((?:Account|SharedAccess)Key)(\s*=\s*)([A-Za-z0-9+/]{40,}={0,2})", _A)
_PASSWORD = re.compile(
    r"(?i)(?<![A-Za-z])(password|passwd|pwd)(\"?[\t\n\v\f\r ]*[:=]\s*)"
    r"(\"[^\"\n\x00]{1,256}\"|'[^'\n\x00]{1,256}'|[^\s\"',;\x00]{1,256})", _A
)
# PEM / OpenSSH private keys, to their END line or, if cut off, to the end of the base64 body.
# The body stops at the next "-----" (a dash is allowed alone, as in "Proc-Type"), so
# neither repeated BEGIN lines nor a missing END make the scan go back over it.
_PRIVATE_KEY = re.compile(
    r"-----BEGIN (?:[A-Z0-9]+ ){0,3}PRIVATE KEY-----(?:[A-Za-z0-9+/=:,.\s\\]|-(?!----))*"
    r"(?:-----END (?:[A-Z0-9]+ ){0,3}PRIVATE KEY-----)?", _A
)
# header.payload.signature, both JSON objects: base64url of '{"' is "eyJ".
_JWT = re.compile(r"\beyJ[A-Za-z0-9_\-]{10,}\.eyJ[A-Za-z0-9_\-]{4,}\.[A-Za-z0-9_\-]*", _A)
_IBAN = re.compile(r"\b[A-Z]{2}\d{2}(?: ?[A-Z0-9]{4}){2,7}(?: ?[A-Z0-9]{1,3})?\b", _A)
_SSN = re.compile(r"(?<![\d\-])(?!000|666|9)\d{3}-(?!00)\d{2}-(?!0000)\d{4}(?![\d\-])", _A)
_CARD = re.compile(r"(?<![\d\-])\d(?:[ \-]?\d){12,18}(?![\d\-])", _A)
_PHONE = re.compile(
    r"(?<![\w+])(?:"
    r"\+\d{1,3}[ .\-]?(?:\(\d{1,4}\)[ .\-]?)?\d{1,4}(?:[ .\-]?\d{2,4}){2,4}"  # international, leading +
    r"|(?:1[ .\-])?\(\d{3}\)[ .\-]?\d{3}[ .\-]\d{4}"  # (555) 123-4567
    r"|(?:1[ .\-])?\d{3}[.\-]\d{3}[.\-]\d{4}"  # 555-123-4567, 555.123.4567
    r")(?![\w])", _A
)
# Cheap gates: each starts with a literal or \d, which the regex engine scans for quickly.
_AWS_KEY_GATE = re.compile(r"A(?:KIA|SIA|GPA|IDA|ROA|IPA|NPA|NVA|BIA|CCA)")
_GH_GATE = re.compile(r"gh[pousr]_")
_LONG_WORD = re.compile(r"[A-Za-z0-9/+]{40}")
_WORD_CHAR = re.compile(r"\w", _A)
_CARD_GATE = re.compile(r"\d(?:[ \-]?\d){12}", _A)
_PHONE_GATE = re.compile(r"\d{3}[ .\-)]{1,2}\d{3}|\+\d", _A)
_IBAN_GATE = re.compile(r"[A-Z]{2}\d{2}", _A)
_SSN_GATE = re.compile(r"\d{3}-\d{2}-\d", _A)
_HAS_UPPER = re.compile(r"[A-Z]")
_HAS_LOWER = re.compile(r"[a-z]")
_HAS_DIGIT = re.compile(r"\d", _A)
_API_KEY_HINTS = ("sk-", "_pat_", "xox", "AIza", "hf_", "k_live_", "k_test_", "glpat-", "npm_", "SG.")


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


def iban_ok(iban: str) -> bool:
    """ISO 13616 check: 15 to 34 characters whose rearranged number is 1 modulo 97."""
    s = iban.replace(" ", "")
    if not 15 <= len(s) <= 34 or not s[:2].isalpha() or not s[2:4].isdigit():
        return False
    return int("".join(str(int(c, 36)) for c in s[4:] + s[:4])) % 97 == 1


def _basic_credentials(token: str) -> bool:
    """True if ``token`` is base64 of printable ``user:password`` (prose after "basic" is not)."""
    if token.islower() and token.isalpha():
        return False  # a word; the gates do not flag it either
    try:
        raw = base64.b64decode(token + "=" * (-len(token) % 4), validate=True)
        text = raw.decode("utf-8")
    except (binascii.Error, ValueError):
        return False
    return ":" in text and text.isprintable()


class Redactor:
    """Replace PII/secrets with ``[REDACTED_<TYPE>]``; ``counts`` accumulates per type."""

    TYPES = ("EMAIL", "PHONE", "CARD", "AWS_ACCESS_KEY", "AWS_SECRET_KEY", "BEARER_TOKEN", "API_KEY", "PRIVATE_KEY",
             "JWT", "IBAN", "SSN", "PASSWORD", "BASIC_AUTH", "SLACK_WEBHOOK", "AZURE_KEY")

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def _bump(self, kind: str, n: int = 1) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + n

    def redact(self, text: str) -> str:
        """Return ``text`` with every detected item replaced by its placeholder."""
        # Whole blocks first: a key's base64 body would otherwise be taken for other secrets.
        if "-----BEGIN " in text:
            text = self._simple(_PRIVATE_KEY, text, "PRIVATE_KEY")
        if "hooks.slack.com" in text:
            text = self._simple(_SLACK_WEBHOOK, text, "SLACK_WEBHOOK")
        if "@" in text:
            text = self._emails(text)
        if "A" in text and _AWS_KEY_GATE.search(text):
            text = self._simple(_AWS_KEY, text, "AWS_ACCESS_KEY")
        lowered = text.lower()
        if "bearer" in lowered:
            text = _BEARER.sub(self._bearer, text)
        if "basic" in lowered:
            text = _BASIC.sub(self._basic, text)
        if "eyJ" in text:
            text = self._simple(_JWT, text, "JWT")
        if any(h in text for h in _API_KEY_HINTS) or "gh" in text and _GH_GATE.search(text):
            text = self._simple(_API_KEY, text, "API_KEY")
        if "key" in lowered or "token" in lowered:
            if "accountkey" in lowered or "sharedaccesskey" in lowered:
                text = _AZURE_KEY.sub(self._labelled("AZURE_KEY"), text)
            text = _API_KEY_LABELLED.sub(self._labelled("API_KEY"), text)
            if "secret" in lowered:
                text = _AWS_SECRET_LABELLED.sub(self._labelled("AWS_SECRET_KEY"), text)
        if "pw" in lowered or "passw" in lowered:
            text = _PASSWORD.sub(self._password, text)
        # Words of 40+ characters are rare in prose; only then look for a bare secret key.
        if len(text) >= 40 and _LONG_WORD.search(text):
            text = _AWS_SECRET_BARE.sub(self._bare_secret, text)
        if _IBAN_GATE.search(text):
            text = _IBAN.sub(self._iban, text)
        if _SSN_GATE.search(text):
            text = self._simple(_SSN, text, "SSN")
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

    def _emails(self, text: str) -> str:
        """Replace e-mail addresses, found from each "@": linear, where a regex tried every start."""
        out: list[str] = []
        done = 0  # text[:done] is settled
        at = text.find("@")
        while at >= 0:
            m = _EMAIL_DOMAIN.match(text, at + 1)
            start = at
            if m:
                floor = max(done, at - 64)
                while start > floor and text[start - 1] in _EMAIL_LOCAL:
                    start -= 1
            if m and start < at:
                out += (text[done:start], PLACEHOLDER.format("EMAIL"))
                self._bump("EMAIL")
                done = m.end()
                at = text.find("@", done)
            else:
                at = text.find("@", at + 1)
        if not out:
            return text
        out.append(text[done:])
        return "".join(out)

    def _bearer(self, m: re.Match[str]) -> str:
        self._bump("BEARER_TOKEN")
        return f"{m.group(1)}{m.group(2)}{PLACEHOLDER.format('BEARER_TOKEN')}"

    def _basic(self, m: re.Match[str]) -> str:
        if not _basic_credentials(m.group(3)):
            return m.group(0)
        self._bump("BASIC_AUTH")
        return f"{m.group(1)}{m.group(2)}{PLACEHOLDER.format('BASIC_AUTH')}"

    def _labelled(self, kind: str) -> Callable[[re.Match[str]], str]:
        def repl(m: re.Match[str]) -> str:
            if m.group(3).startswith("[REDACTED"):
                return m.group(0)
            self._bump(kind)
            return f"{m.group(1)}{m.group(2)}{PLACEHOLDER.format(kind)}"

        return repl

    def _password(self, m: re.Match[str]) -> str:
        value = m.group(3)
        quote = value[0] if value[0] in "\"'" else ""
        if value.lstrip("\"'").startswith("[REDACTED"):
            return m.group(0)
        self._bump("PASSWORD")
        return f"{m.group(1)}{m.group(2)}{quote}{PLACEHOLDER.format('PASSWORD')}{quote}"

    def _bare_secret(self, m: re.Match[str]) -> str:
        s = m.group(0)
        if "/" in s or "+" in s:
            secret = bool(_HAS_UPPER.search(s) and _HAS_LOWER.search(s) and _HAS_DIGIT.search(s))
        else:
            # Without / or + only a good mix of classes: hex digests and CamelCase names are not keys.
            upper = sum(c.isupper() for c in s)
            digits = sum(c.isdigit() for c in s)
            secret = upper >= 4 and 40 - upper - digits >= 4 and digits >= 2
        if secret:
            self._bump("AWS_SECRET_KEY")
            return PLACEHOLDER.format("AWS_SECRET_KEY")
        return s

    def _iban(self, m: re.Match[str]) -> str:
        if not iban_ok(m.group(0)):
            return m.group(0)
        self._bump("IBAN")
        return PLACEHOLDER.format("IBAN")

    def _card(self, m: re.Match[str]) -> str:
        s = m.group(0)
        # A card number stands alone: digits glued to letters belong to a longer token (a hex id
        # such as a UUID without dashes, a hash, base64), even where they pass Luhn.
        text, a, b = m.string, m.start(), m.end()
        if (a and _WORD_CHAR.match(text, a - 1)) or _WORD_CHAR.match(text, b):
            return s
        digits = s.replace(" ", "").replace("-", "")
        if 13 <= len(digits) <= 19 and luhn_ok(digits):
            self._bump("CARD")
            return PLACEHOLDER.format("CARD")
        return s


# A superset of every detector above, in RE2 syntax (no lookarounds). capture/_native/gate.c
# finds a superset of its matches by hand: change the two together. Detectors without an
# alternative of their own here (AWS secret keys, Azure keys, Slack webhooks) match a run of
# 40 characters of [A-Za-z0-9/+]. RE2's \s has no \v, Python's has: blanks are spelled out.
# Words common in prose (basic, password) count only with what the detector needs after them.
GATE = (
    r"@|A(?:KIA|SIA|GPA|IDA|ROA|IPA|NPA|NVA|BIA|CCA)|(?i:bearer)|sk-|gh[pousr]_|github_pat_|xox|AIza|hf_"
    r"|(?i:api[_\-]?key|access[_\-]?token)|[A-Za-z0-9/+]{40}"
    r"|\d(?:[ \-]?\d){12,18}|\d{3}[ .\-)]{1,2}\d{3}|\+\d"
    r"|-----BEGIN |eyJ|[sr]k_(?:live|test)_|glpat-|npm_|SG\."
    r"|(?i:basic)[\t\n\v\f\r ]+[a-z]*[A-Z0-9+/=]|(?i:passw(?:or)?d|pwd)\"?[\t\n\v\f\r ]*[:=]"
    r"|[A-Z]{2}\d{2} ?[A-Z0-9]{4}|\d{3}-\d{2}-\d{4}"
)


def flagged(values: "pa.Array") -> list[int]:
    """Indices of the strings that may hold something to redact: a superset of those GATE matches."""
    import numpy as np
    import pyarrow as pa

    nat = backend.native()
    if nat is not None and isinstance(values, pa.Array) and values.type == pa.string():
        if not len(values):
            return []
        hits = nat.redact_gate(*native.utf8_args(values))
        return np.frombuffer(hits, dtype=np.int64).tolist()
    return flagged_re2(values)


# JSON escapes undone for the gate over JSON text: "\\" first (so that the one after a backslash
# is not read as an escape's start), to a byte no JSON text holds raw, then back.
_UNESCAPE = (("\\\\", "\x01"), ('\\"', '"'), ("\\n", "\n"), ("\\t", "\t"), ("\\r", "\r"), ("\x01", "\\"))


def flagged_json(values: "pa.Array") -> list[int]:
    """Indices of the JSON texts whose strings may hold something to redact (sorted; nulls never).

    A JSON string is redacted as the text it decodes to (an escape cannot hide a secret): the gate
    runs over each text with its escapes undone, where every string of it stands whole between
    quotes; a text holding another escape (\\b, \\f, \\u, \\/: control characters) is flagged
    outright. The native module does it in one pass (``redact_gate_json``), else Arrow kernels.
    """
    import pyarrow as pa

    nat = backend.native()
    if nat is not None and isinstance(values, pa.Array) and values.type == pa.string():
        import numpy as np

        if not len(values) or values.null_count == len(values):
            return []
        return np.frombuffer(nat.redact_gate_json(*native.utf8_args(values)), dtype=np.int64).tolist()
    return flagged_json_arrow(values)


def flagged_json_arrow(values: "pa.Array") -> list[int]:
    """:func:`flagged_json` with Arrow kernels and the gate of :func:`flagged` (the native module's or RE2)."""
    import pyarrow.compute as pc

    if values.null_count == len(values):
        return []
    view = values
    for a, b in _UNESCAPE:
        view = pc.replace_substring(view, a, b)
    odd = pc.indices_nonzero(pc.fill_null(pc.match_substring_regex(view, r"\\[bfu/]"), False)).to_pylist()
    return sorted(set(flagged(pc.fill_null(view, ""))) | set(odd))


def flagged_re2(values: "pa.Array") -> list[int]:
    """Indices of the strings GATE matches (RE2)."""
    import pyarrow.compute as pc

    return pc.indices_nonzero(pc.match_substring_regex(values, GATE)).to_pylist()


def redact_values(values: list[str]) -> dict[int, dict[str, int]]:
    """Redact ``values`` in place; returns ``{index: {type: count}}`` for the strings that changed."""
    out: dict[int, dict[str, int]] = {}
    if not values:
        return out
    for i in flagged(_string_array(values)):
        r = Redactor()
        text = r.redact(values[i])
        if r.counts:
            values[i] = text
            out[i] = r.counts
    return out


def _string_array(values: list[str]) -> "pa.Array":
    """``pa.array(values, pa.string())`` built from buffers: pa.array imports pandas (~0.14 s of CPU
    in each ingest worker, which redacts quarantine excerpts with this)."""
    import numpy as np
    import pyarrow as pa

    data = [v.encode("utf-8") for v in values]
    ends = np.cumsum([len(d) for d in data], dtype=np.int64)
    if ends[-1] > np.iinfo(np.int32).max:
        return pa.array(values, pa.string())
    offsets = np.concatenate([np.zeros(1, np.int32), ends.astype(np.int32)])
    return pa.Array.from_buffers(pa.string(), len(values), [None, pa.py_buffer(offsets), pa.py_buffer(b"".join(data))])


def redact_array(values: "pa.Array") -> tuple["pa.Array", dict[int, dict[str, int]]]:
    """Redact an Arrow string array: the redacted array and ``{index: {type: count}}`` for the strings that changed."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    if not len(values):
        return values, {}
    out: dict[int, dict[str, int]] = {}
    new: list[str] = []
    for i in flagged(values):
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
