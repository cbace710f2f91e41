"""The native redaction gate (capture/_native/gate.c) against RE2's GATE, and redaction with it on and off."""

from __future__ import annotations

import random

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from capture import batchpath, native, redact
from capture.redact import GATE, Redactor, redact_array
from capture.synth import lines as synth_lines

KELVIN, LONG_S = "\u212a", "\u017f"


def c_gate(values: pa.Array) -> list[int]:
    """Indices the native gate flags (the module must load: no silent fallback here)."""
    validity, offsets, data = values.buffers()
    hits = native.load().redact_gate(values.offset, len(values), offsets, data if data is not None else b"",
                                     validity if values.null_count else None)
    return np.frombuffer(hits, dtype=np.int64).tolist()


def re2_gate(values: pa.Array) -> list[int]:
    return redact._flagged_re2(values)


def assert_superset(values: list[str | None]) -> tuple[set[int], set[int]]:
    """C ⊇ RE2 on ``values`` (also sliced, so that the array offset is not 0); returns (re2, c)."""
    arr = pa.array(values, pa.string())
    want, got = set(re2_gate(arr)), set(c_gate(arr))
    missed = sorted(want - got)
    assert not missed, [values[i] for i in missed[:20]]
    if len(arr) > 3:
        sl = arr.slice(3)
        assert set(re2_gate(sl)) <= set(c_gate(sl))
    return want, got


# -- what the C gate assumes about RE2 -------------------------------------------------


def test_re2_folds_and_digits_are_what_the_c_gate_assumes():
    """(?i) folds only k (Kelvin sign) and s (long s) of GATE's case-insensitive words to non-ASCII; \\d is ASCII."""
    cps = pa.array([chr(c) for c in range(0x80, 0x110000) if not 0xD800 <= c < 0xE000])
    folds = {}
    for letter in sorted(set("bearer" "apikey" "accesstoken")):
        hits = pc.indices_nonzero(pc.match_substring_regex(cps, f"(?i:{letter})")).to_pylist()
        folds[letter] = [cps[i].as_py() for i in hits]
    assert {k: v for k, v in folds.items() if v} == {"k": [KELVIN], "s": [LONG_S]}
    assert not pc.any(pc.match_substring_regex(cps, r"\d|[A-Za-z0-9/+]")).as_py()
    # and the gate reads the Kelvin sign / long s as they fold
    assert assert_superset([f"api{KELVIN}ey", f"acce{LONG_S}s_token", f"ACCES{LONG_S}TO{KELVIN}EN"])[0] == {0, 1, 2}


# -- the superset property -------------------------------------------------------------

PIECES = [
    "@", "a@b.co", "AKIA", "ASIA", "AGPA", "AIDA", "AROA", "AIPA", "ANPA", "ANVA", "ABIA", "ACCA", "AKI", "AKIa",
    "AIza", "AIz", "aiza", "BeArEr", "bearer", "BEARER", "beare", "bear er", "sk-", "sk", "s-k", "SK-", "ghp_", "gho_",
    "ghu_", "ghs_", "ghr_", "ghx_", "gh_", "github_pat_", "github_pa_", "xox", "xo", "XOX", "hf_", "hf", "HF_",
    "api-key", "apikey", "api_key", "API_KEY", "Api-Key", "api key", "api--key", "apiey", "access-token",
    "accesstoken", "ACCESS_TOKEN", "access token", "acess_token", "access__token", f"api{KELVIN}ey", f"API-{KELVIN}EY",
    f"acce{LONG_S}{LONG_S}token", f"access_to{KELVIN}en", KELVIN, LONG_S, "\u212b", "\u0130", "\u0131", "ß", "é",
    "中文", "😀", "\u2019", "\u2014", "—", "’", "+", "+1", "+ 1", "++1", "555) 123", "555)) 123", "555 ) 123",
    "555.123", "555-123", "555 123", "555  123", "555...123", "55 123", "555 12", "(555) 123-4567",
    "555.123.4567", "+44 20 7946 0958", "4111 1111 1111 1111", "4111-1111-1111-1111", "4111111111111",
    "411111111111", "4 1 1 1 1 1 1 1 1 1 1 1 1", "4 1 1 1 1 1 1 1 1 1 1 1", "4  1", "4--1", " ", "-", ".", ")",
    "(", "/", "+", "=", "_", "\n", "\t", "\x00", "０１２", "٣٤٥", "the", "model", "Key", "token",
]
B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789/+"


def _random_text(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randrange(0, 12)):
        r = rng.random()
        if r < 0.45:
            parts.append(rng.choice(PIECES))
        elif r < 0.6:  # base64 runs around the 40 mark
            parts.append("".join(rng.choices(B64, k=rng.choice([1, 15, 16, 17, 38, 39, 40, 41, 60]))))
        elif r < 0.8:  # digits joined by separators of every kind and length
            k = rng.choice([1, 2, 3, 4, 6, 12, 13, 14, 19, 20])
            seps = ["", "", " ", "-", ".", ")", "  ", " -", ") ", "--", "/", "+"]
            parts.append("".join(rng.choice("0123456789") + (rng.choice(seps) if j < k - 1 else "") for j in range(k)))
        else:
            parts.append("".join(rng.choices("abcdefghiklmnoprstuxyzAKBIE_-@+ 0123456789.)", k=rng.randrange(1, 8))))
        if rng.random() < 0.5:
            parts.append(rng.choice(["", " ", "  ", "\n", "x", "é", "😀", "-", "_"]))
    text = "".join(parts)
    if rng.random() < 0.3:  # shift matches across the 16-byte blocks
        text = "." * rng.randrange(0, 33) + text
    return text


def test_c_gate_is_a_superset_of_re2_on_a_random_corpus():
    rng = random.Random(20250501)
    values = [_random_text(rng) for _ in range(60_000)]
    want, got = assert_superset(values)
    assert len(want) > 20_000 and len(want) < len(values)  # the corpus does exercise both sides


def test_every_alternative_anywhere_in_a_string():
    """Each alternative alone, at every position against the block boundaries, with every kind of neighbour."""
    hits = ["@", "AKIA", "ASIA", "AGPA", "AIDA", "AROA", "AIPA", "ANPA", "ANVA", "ABIA", "ACCA", "AIza", "bEaReR",
            "sk-", "ghp_", "gho_", "ghu_", "ghs_", "ghr_", "github_pat_", "xox", "hf_", "ApI_kEy", "api-key", "APIKEY",
            "access_token", "Access-Token", "ACCESSTOKEN", "a" * 40, "/+" * 20, "1234567890123", "1-2-3-4-5-6-7-8-9-0-1-2-3",
            "1 2 3 4 5 6 7 8 9 0 1 2 3", "123 456", "123.456", "123-456", "123)456", "123) 456", "123 -456", "+1",
            f"api{KELVIN}ey", f"acce{LONG_S}s-token"]
    values = []
    for h in hits:
        for pad in range(0, 40):
            for left, right in [(".", "."), ("x", "x"), ("é", "😀"), ("9", "9"), ("", "")]:
                values.append(left * pad + h + right * (pad % 7))
    want, got = assert_superset(values)
    assert want == set(range(len(values)))


def test_near_misses_are_not_flagged():
    """The C gate stays tight: none of these matches GATE, and the C gate flags none of them."""
    misses = ["AKI", "AKIa", "akia", "AIzb", "beare", "bear er", "s-k", "SK-", "sk", "ghx_", "gh_", "github_pa_", "xo",
              "x ox", "HF_", "hf", "api key", "api--key", "apkey", "access token", "acess_token", "access__token",
              "a" * 39, "/+" * 19 + "a", "a" * 20 + "=" + "a" * 20, "123456789012", "1-2-3-4-5-6-7-8-9-0-1-2",
              "1 2 3 4 5 6 7 8 9 0 1 2 3".replace(" ", "  "), "12 456", "123 45", "123...456", "123--- 456",
              "123/456", "+ 1", "+a", "++", "٣٤٥ ٣٤٥", "０１２ ０１２", "café au lait — “quoted” ’s",
              "[123] The model request", "version 3.1.4 at 12:30", ""]
    arr = pa.array(misses * 3)
    assert re2_gate(arr) == [] and c_gate(arr) == []


def test_nulls_and_slices():
    values = ["a@b", None, "plain", None, "call 555-123-4567", "x" * 40, None]
    arr = pa.array(values)
    assert c_gate(arr) == re2_gate(arr) == [0, 4, 5]
    assert redact._flagged(arr) == [0, 4, 5]
    for start in range(len(values)):
        for stop in range(start, len(values) + 1):
            sl = arr.slice(start, stop - start)
            assert c_gate(sl) == re2_gate(sl)


def test_strings_ending_at_the_buffer_end():
    """The last string's final block is read from a copy (no load past the data buffer)."""
    tails = ["a@", "x" * 40, "123 456", "+1", "apikey", "ACCESS_TOKEN", "bearer", "xox", "sk-", "hf_", LONG_S,
             f"api{KELVIN}ey", "1234567890123"]
    for n in range(0, 70):
        for tail in tails + ["z", "toke", "be", "xo", "\u212b"]:
            text = "." * n + tail
            arr = pa.array([text])
            assert c_gate(arr) == re2_gate(arr) or tail == LONG_S
            assert c_gate(arr) == ([0] if tail in tails else [])


def test_gate_rejects_inconsistent_buffers():
    nat = native.load()
    s = pa.array(["ab", "cd"])
    _, offsets, data = s.buffers()
    with pytest.raises(ValueError):  # more strings than offsets
        nat.redact_gate(0, 3, offsets, data, None)
    with pytest.raises(ValueError):  # offsets past the data
        nat.redact_gate(0, 2, offsets, b"abc", None)
    with pytest.raises(ValueError):  # validity too short
        nat.redact_gate(0, 9, pa.array(["a"] * 9).buffers()[1], b"a" * 9, b"\xff")


# -- synthetic traffic: the same flags as RE2 -------------------------------------------


def _synth_values(n: int, seed: int = 5) -> pa.Array:
    chunk = batchpath.decode_chunk([line.encode() for line in synth_lines(n, seed=seed)], 1, 8 << 20, None)
    return chunk.batch.column("conversations").flatten().field("value")


def test_synthetic_traffic_flags_equal_re2():
    values = _synth_values(3000)
    assert len(values) > 6000
    assert c_gate(values) == re2_gate(values)


# -- redaction end to end ---------------------------------------------------------------

PII = [
    "write to jane.doe+x@mail.example.co.uk today", "call (555) 123-4567 or +44 20 7946 0958",
    "card 4111 1111 1111 1111 exp 12/29", "key AKIAIOSFODNN7EXAMPLE here",
    "aws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
    "Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.abc.def",
    "OPENAI_API_KEY=sk-proj-abcdefghijklmnopqrstuvwx and ghp_abcdefghijklmnopqrstuvwxyz0123456789",
    "amex 3782 822463 10005", "digits 4 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1", "tel 555.123.4567",
    "number 4111 1111 1111 1112", "x-api-key: abcdefghijklmnop1234", "access_token=abcdefghijklmnopqrstuvwxyz",
    "hf_abcdefghijklmnopqrstuvwxyzABCDEF", "xoxb-1234567890-abcdef", "AIza" + "B" * 35,
    "github_pat_" + "a1" * 20, "sha1 da39a3ee5e6b4b0d3255bfef95601890afd80709", f"api{KELVIN}ey = abcdefghijklmnopqrst",
]


def test_redact_array_identical_with_the_native_gate_on_and_off(monkeypatch):
    rng = random.Random(7)
    values = list(_synth_values(400).to_pylist())
    values += PII + [_random_text(rng) for _ in range(3000)]
    values += [f"{rng.choice(values[:800])} {rng.choice(PII)} {rng.choice(values[:800])}" for _ in range(500)]
    rng.shuffle(values)
    arr = pa.array(values, pa.string()).slice(1)

    def calls(name):
        seen = []
        real = getattr(redact, name)

        def spy(v):
            seen.append(name)
            return real(v)

        monkeypatch.setattr(redact, name, spy)
        return seen

    used_re2 = calls("_flagged_re2")
    on_values, on_counts = redact_array(arr)
    assert not used_re2 and native.get() is not None
    monkeypatch.setattr(native, "get", lambda: None)
    off_values, off_counts = redact_array(arr)
    assert used_re2
    assert on_counts == off_counts and len(on_counts) > 500
    assert on_values.to_pylist() == off_values.to_pylist()
    # and both are what the precise redactor does string by string
    for i in list(on_counts)[:300]:
        r = Redactor()
        assert r.redact(arr[i].as_py()) == on_values[i].as_py() and r.counts == on_counts[i]


def test_gate_pattern_is_the_one_the_c_gate_mirrors():
    """gate.c lists GATE's alternatives by hand: a changed GATE must be mirrored there (and here)."""
    assert GATE == (
        r"@|A(?:KIA|SIA|GPA|IDA|ROA|IPA|NPA|NVA|BIA|CCA)|(?i:bearer)|sk-|gh[pousr]_|github_pat_|xox|AIza|hf_"
        r"|(?i:api[_\-]?key|access[_\-]?token)|[A-Za-z0-9/+]{40}"
        r"|\d(?:[ \-]?\d){12,18}|\d{3}[ .\-)]{1,2}\d{3}|\+\d"
    )
