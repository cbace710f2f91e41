"""The format rules of Data Capture traffic, written once.

Three decoders apply them: the Python reference (:mod:`capture.records` and
:mod:`capture.formats`, which decides every line and names every reason), the msgspec
batch path (:mod:`capture.batchpath`) and the C decoder (``capture/_native``). The
Python ones import the values below; the C one holds no copy of them: it is given
:func:`native_table` when :mod:`capture.native` imports it, and refuses to decode
before that (``configure`` in ``capture/_native/module.c``).

What lives here: the role map and ShareGPT speakers, the format names, the payload
encodings, the tabular (CSV) content type, what makes a response look like an SSE
stream and the canonical stream form, SageMaker's ``inferenceTime`` layout, and the
sampling parameter ranges. The JSON field names of each wire format are the shape of
the parsers themselves (the reference's lookups, the msgspec structs, the C member
switches) and stay with them; the differential tests and the fuzzer pin those equal.
"""

from __future__ import annotations

import math
import re
from functools import lru_cache

# ShareGPT speakers, in the order the C decoder numbers them (enum From in capture.h).
SYSTEM, HUMAN, GPT = "system", "human", "gpt"
SPEAKERS = (SYSTEM, HUMAN, GPT)

# A message's role (lowercased) → its ShareGPT speaker; any other role is quarantined.
ROLE_MAP = {
    "system": SYSTEM,
    "developer": SYSTEM,
    "user": HUMAN,
    "human": HUMAN,
    "tool": HUMAN,
    "function": HUMAN,
    "ipython": HUMAN,
    "assistant": GPT,
    "gpt": GPT,
    "model": GPT,
    "bot": GPT,
}

# Chat roles whose role/content messages a template renders as conversations' from/value says;
# a message of any other role (tool, developer, ...) or with any other key is kept as sent (the
# row's ``messages``), and the fast paths decline it.
PLAIN_ROLES = frozenset(("system", "user", "assistant"))

# What a row's ``format`` says, in the order of enum Format in capture.h.
OPENAI_CHAT, OPENAI_COMPLETION, TGI, JUMPSTART_CHAT = "openai_chat", "openai_completion", "tgi", "jumpstart_chat"
FORMATS = (OPENAI_CHAT, OPENAI_COMPLETION, TGI, JUMPSTART_CHAT)

# A capture side's ``encoding`` (upper-cased; absent means JSON), in the order of enum Kind in
# capture.c. JSON and CSV data is the text itself; BASE64 data is decoded to UTF-8 text.
JSON, BASE64, CSV = "JSON", "BASE64", "CSV"
ENCODINGS = (JSON, BASE64, CSV)

# Tabular traffic: a request with this content type (before any ";"), or CSV-encoded, is skipped.
CSV_CONTENT_TYPE = "text/csv"

# A response is an SSE stream if its content type holds this (case-insensitively) ...
SSE_CONTENT_TYPE = "event-stream"
# ... or its body, less leading whitespace, starts with a data field.
SSE_DATA = "data:"
# The event that ends a stream; events after it are ignored.
SSE_DONE = "[DONE]"
# The form servers write, "data: c0⏎⏎data: c1 … ⏎⏎data: [DONE]⏎⏎", which the fast paths turn
# into the JSON array "[c0,c1,…]" with one replace instead of reading it line by line.
SSE_HEAD = SSE_DATA + " "
SSE_SEP = "\n\n" + SSE_HEAD
SSE_TAIL = SSE_SEP + SSE_DONE + "\n\n"

# SageMaker's inferenceTime: YYYY year, MM month, DD day, hh hour, mm minute, ss second; any
# other character is itself. Times in this layout (every field in range, the day in its month)
# are parsed by the fast paths; anything else goes through records.parse_time.
TIME_LAYOUT = "YYYY-MM-DDThh:mm:ssZ"
_TIME_FIELDS = {  # layout field → (its name, strftime directive, a regex of its values in range)
    "YYYY": ("year", "%Y", r"[1-9]\d{3}"),
    "MM": ("month", "%m", r"(?:0[1-9]|1[0-2])"),
    "DD": ("day", "%d", r"(?:0[1-9]|[12]\d|3[01])"),
    "hh": ("hour", "%H", r"(?:[01]\d|2[0-3])"),
    "mm": ("minute", "%M", r"[0-5]\d"),
    "ss": ("second", "%S", r"[0-5]\d"),
}
_TIME_TOKEN = re.compile("|".join(_TIME_FIELDS))


def _time_forms(layout: str) -> tuple[str, str, dict[str, tuple[int, int]]]:
    """The strftime format of ``layout``, its anchored regex, and each field's (offset, width)."""
    fmt, regex, fields, at = [], ["^"], {}, 0
    for m in _TIME_TOKEN.finditer(layout):
        literal = layout[at:m.start()]
        fmt.append(literal.replace("%", "%%"))
        regex.append(re.escape(literal))
        name, directive, values = _TIME_FIELDS[m.group()]
        fmt.append(directive)
        regex.append(values)
        fields[name] = (m.start(), len(m.group()))
        at = m.end()
    fmt.append(layout[at:].replace("%", "%%"))
    regex.append(re.escape(layout[at:]) + "$")
    return "".join(fmt), "".join(regex), fields


TIME_FORMAT, TIME_REGEX, TIME_FIELDS = _time_forms(TIME_LAYOUT)

# What a sampler takes, per parameter (inclusive bounds, finite values only): a number outside
# its range (NaN, 1e999, a negative temperature, a top_p above 1, an integer too large for a
# float) is bad data, quarantined with a reason, never stored. The fast paths decline such
# lines so that the reference decides them.
SAMPLING_RANGES = {"temperature": (0.0, math.inf), "top_p": (0.0, 1.0)}
# Where a request's token budget is read, first present key first.
MAX_TOKENS_KEYS = ("max_tokens", "max_completion_tokens", "max_new_tokens")


def sampling_ok(name: str, value: float | None) -> bool:
    """True if ``value`` (a float or absent) is in ``name``'s range."""
    if value is None:
        return True
    lo, hi = SAMPLING_RANGES[name]
    return math.isfinite(value) and lo <= value <= hi


def encoding_of(encoding: str | None) -> str:
    """A side's encoding as the rules read it: absent is JSON, case does not matter."""
    return (encoding or JSON).upper()


@lru_cache(maxsize=256)  # few distinct content types in practice; bounded against hostile input
def is_csv_content_type(content_type: str | None) -> bool:
    """True for a tabular (CSV) content type, parameters and case aside."""
    return (content_type or "").split(";")[0].strip().lower() == CSV_CONTENT_TYPE


@lru_cache(maxsize=256)
def _sse_content_type(content_type: str) -> bool:
    return SSE_CONTENT_TYPE in content_type.lower()


def looks_sse(text: str, content_type: str | None) -> bool:
    """True if a response (its text and content type) is to be read as an SSE stream."""
    if content_type and _sse_content_type(content_type):
        return True
    return text.lstrip()[:len(SSE_DATA)].startswith(SSE_DATA)


def native_table() -> dict:
    """The rules above as the C decoder's ``configure`` takes them (see capture/_native/module.c)."""
    return {
        "speakers": SPEAKERS,
        "roles": dict(ROLE_MAP),
        "formats": FORMATS,
        "encodings": ENCODINGS,
        "csv_content_type": CSV_CONTENT_TYPE,
        "sse_content_type": SSE_CONTENT_TYPE,
        "sse_data": SSE_DATA,
        "sse_head": SSE_HEAD,
        "sse_sep": SSE_SEP,
        "sse_tail": SSE_TAIL,
        "time_layout": TIME_LAYOUT,
        "time_fields": TIME_FIELDS,
        "temperature": SAMPLING_RANGES["temperature"],
        "top_p": SAMPLING_RANGES["top_p"],
        "max_tokens_keys": MAX_TOKENS_KEYS,
        "plain_roles": tuple(sorted(PLAIN_ROLES)),
    }
