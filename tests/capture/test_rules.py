"""capture/rules.py is the one table of format rules: the C decoder holds no copy of it, follows it
when it changes, and refuses a table it could not apply; the forms derived from it stay what they were."""

from __future__ import annotations

import re
from datetime import datetime, timezone

import pyarrow as pa
import pytest

from capture import backend, batchpath, native, rules
from capture.records import make_capture_record
from tests.capture_support import T0, check, msgspec_chunk, native_chunk

OK = {"choices": [{"message": {"content": "a"}}]}


def _chat(role: str, content_type: str | None = "application/json") -> bytes:
    req = '{"messages": [{"role": "%s", "content": "q"}]}' % role
    return make_capture_record(req, OK, inference_time=T0, request_content_type=content_type).encode()


def _c_literals() -> set[str]:
    """Every string literal in the C sources."""
    text = "".join(p.read_text() for p in sorted(native.SOURCE_DIR.glob("*.[ch]")))
    return set(re.findall(r'"((?:[^"\\\n]|\\.)*)"', text))


def test_the_c_sources_hold_none_of_the_rules():
    """The role map, speakers, formats, content types, SSE forms and time layout are written once, in Python."""
    table = rules.native_table()
    values = [*table["roles"], *table["speakers"], *table["formats"], table["csv_content_type"],
              table["sse_content_type"], table["sse_data"], table["sse_head"], rules.SSE_DONE, table["time_layout"],
              *table["max_tokens_keys"], "BASE64", "CSV"]
    c_literals = {bytes(s, "ascii").decode("unicode_escape") for s in _c_literals()}
    # "model" (a role) and "max_tokens" (a budget key) are also a wire field and a column the C side names;
    # "function" (a role) is also the key of a tool call's name and arguments, which the C side reads.
    assert not [v for v in values if v in c_literals and v not in ("model", "max_tokens", "function")]
    assert not [s for s in c_literals if "event-stream" in s or "text/csv" in s or "[DONE]" in s]


@pytest.fixture
def reconfigure():
    """Configure the native module with other rules; the real ones are put back after the test."""
    mod = native.load()
    assert backend.native() is mod
    yield lambda **changes: mod.configure(rules.native_table() | changes)
    mod.configure(rules.native_table())


def test_the_c_decoder_follows_the_table_it_is_given(reconfigure):
    robot, user = _chat("robot"), _chat("user")
    tabular = _chat("user", content_type="application/x-table")
    assert native_chunk([robot]).declined == [0] and native_chunk([user]).batch.num_rows == 1
    speakers = {rules.SYSTEM: "sys", rules.HUMAN: "person", rules.GPT: "bot"}
    roles = {k: speakers[v] for k, v in rules.ROLE_MAP.items() if k != "user"} | {"robot": "person"}
    # "robot" a role whose messages conversations render alone (rules.PLAIN_ROLES), "user" not.
    reconfigure(roles=roles, csv_content_type="application/x-table", speakers=tuple(speakers.values()),
                plain_roles=("system", "robot", "assistant"))
    got = native_chunk([robot, user, tabular])
    assert got.declined == [1] and got.skips == {"not_llm_traffic": 1}
    assert got.batch.column("conversations").to_pylist() == [[{"from": "person", "value": "q"},
                                                              {"from": "bot", "value": "a"}]]


def test_the_c_time_parser_follows_the_layout_it_is_given(reconfigure):
    values = pa.array(["2025/05/01 10-00-07", "2025-05-01T10:00:07Z", "2025/02/30 10-00-07"])
    with backend.python_fallback():
        assert batchpath.parse_times(values).to_pylist()[1] == datetime(2025, 5, 1, 10, 0, 7, tzinfo=timezone.utc)
    fields = {"year": (0, 4), "month": (5, 2), "day": (8, 2), "hour": (11, 2), "minute": (14, 2), "second": (17, 2)}
    reconfigure(time_layout="YYYY/MM/DD hh-mm-ss", time_fields=fields)
    us, bits, pending = native.load().parse_times(*native.utf8_args(values))
    assert pending == 2 and bits[0] & 0b111 == 0b001
    assert int.from_bytes(us[:8], "little", signed=True) == int(datetime(2025, 5, 1, 10, 0, 7,
                                                                         tzinfo=timezone.utc).timestamp() * 1e6)


@pytest.mark.parametrize("changes, error", [
    ({"roles": {"User": "human"}}, "lowercase"),
    ({"roles": {"user": "person"}}, "speaker"),
    ({"encodings": ("json", "BASE64", "CSV")}, "uppercase"),
    ({"formats": ("a", "b")}, "must name 4"),
    ({"sse_sep": ",data: "}, "line break"),
    ({"time_fields": {"year": (0, 2)}}, "does not fit|needs"),
    ({"temperature": "hot"}, "lo, hi"),
    ({"csv_content_type": "x" * 64}, "longer"),
])
def test_a_table_the_decoder_cannot_apply_is_refused_and_changes_nothing(reconfigure, changes, error):
    with pytest.raises((ValueError, TypeError), match=error):
        reconfigure(**changes)
    assert native_chunk([_chat("user")]).batch.num_rows == 1  # the rules in force are the real ones


def test_every_rule_key_is_required():
    mod = native.load()
    for key in rules.native_table():
        table = rules.native_table()
        del table[key]
        with pytest.raises(KeyError, match=key):
            mod.configure(table)
    assert native_chunk([_chat("user")]).batch.num_rows == 1


def test_the_ascii_escape_guard_is_the_same_in_c_and_python():
    """A \\u escape of printable ASCII could spell a key the substring dispatch misses: both decline it.
    (The C decoder scans for it in its own loop, escapes_ascii in capture.c, not from the table.)"""
    lines = []
    for k in range(256):
        for spelled in (f"{k:02x}", f"{k:02X}"):
            req = '{"messages": [{"role": "user", "content": "q"}], "x": "a\\u00%s"}' % spelled
            lines.append(make_capture_record(req, OK, inference_time=T0).encode())
    want = [i for i in range(len(lines)) if 0x20 <= i // 2 <= 0x7F]
    assert msgspec_chunk(lines).declined == want
    assert [i for i in native_chunk(lines).declined if i // 2 != 0] == want  # \u0000: C declines NUL escapes too
    check(lines)


def test_the_forms_derived_from_the_time_layout():
    assert rules.TIME_FORMAT == "%Y-%m-%dT%H:%M:%SZ"
    assert rules.TIME_REGEX == r"^[1-9]\d{3}\-(?:0[1-9]|1[0-2])\-(?:0[1-9]|[12]\d|3[01])T(?:[01]\d|2[0-3]):[0-5]\d:[0-5]\dZ$"
    assert rules.TIME_FIELDS["day"] == (8, 2)
    t = datetime(2024, 2, 29, 23, 59, 58, tzinfo=timezone.utc)
    text = t.strftime(rules.TIME_FORMAT)
    assert re.match(rules.TIME_REGEX, text) and datetime.strptime(text, rules.TIME_FORMAT).replace(tzinfo=timezone.utc) == t
    assert rules.SSE_TAIL == "\n\ndata: [DONE]\n\n" and rules.SSE_SEP == "\n\ndata: "
