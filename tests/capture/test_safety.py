"""Safe by default (issue #23), capture side: what lands in the catalog is redacted, hostile
files cost bounded memory, and the warehouse and state files are owner-only."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from capture.ingest import EXCERPT_BYTES, ingest
from capture.records import make_capture_record
from capture.sources import LongLine, _blocks, iter_blocks, iter_lines
from tests.capture_support import T0, catalog_rows, chat, layout_file, reconciles
from tests.config_support import make_cfg
from tests.paths import REPO_ROOT

GHP = "ghp_" + "A1b2C3d4E5" * 4
AKIA = "AKIAIOSFODNN7EXAMPLE"


def with_role(role_json: str) -> str:
    """A chat capture line whose message role is ``role_json`` (JSON string text, escapes kept)."""
    req = '{"messages": [{"role": "%s", "content": "q"}]}' % role_json
    return make_capture_record(req, {"choices": [{"message": {"content": "a"}}]}, inference_time=T0)


def quarantine_rows(cfg) -> list[tuple]:
    return catalog_rows(cfg, "SELECT line_no, reason, detail, excerpt FROM quarantine ORDER BY line_no")


# -- quarantine rows are redacted like the turns ----------------------------------------------

def test_quarantine_excerpts_and_details_are_redacted(tmp_path):
    """A quarantined line's first KiB went into quarantine.excerpt as it came: a ghp_ token and an AKIA key."""
    cfg = make_cfg(tmp_path)
    good = chat(1, T0)
    truncated = chat(2, T0, text=f"my token is {GHP} and key {AKIA}")[:-40]  # invalid JSON
    # A secret that the excerpt's end cuts in two is still found (redaction reads past the cut).
    straddling = chat(3, T0, text="p" * (EXCERPT_BYTES - 170) + f" {GHP} tail")[:-5]
    role = with_role(GHP)  # the detail quotes the role
    layout_file(tmp_path / "cap", T0, "q.jsonl", [good, truncated, straddling, role])
    res = ingest(cfg, source=str(tmp_path / "cap"))
    assert reconciles(res) and res.quarantined == 3 and res.normalized == 1
    rows = quarantine_rows(cfg)
    assert [r[1] for r in rows] == ["invalid_json", "invalid_json", "unknown_role"]
    for _, _, detail, excerpt in rows:
        for secret in (GHP, GHP[:20], AKIA):
            assert secret not in excerpt and secret not in detail, (detail, excerpt)
    assert "[REDACTED_API_KEY]" in rows[0][3] and "[REDACTED_AWS_ACCESS_KEY]" in rows[0][3]
    assert "[REDACTED_API_KEY]" in rows[2][2]
    assert all(len(r[3]) <= EXCERPT_BYTES + 1 for r in rows)
    # Redaction off (capture.redact = false) keeps them as they came.
    cfg2 = make_cfg(tmp_path / "off", capture={"redact": False})
    ingest(cfg2, source=str(tmp_path / "cap"))
    assert GHP in quarantine_rows(cfg2)[0][3]


def test_a_lone_surrogate_in_a_quarantine_detail_does_not_fail_the_run(tmp_path):
    """The detail quoting a role "\\ud800" could not be stored: DuckDB refused it and the whole run failed, every time."""
    cfg = make_cfg(tmp_path)
    bad = with_role("\\ud800x")
    layout_file(tmp_path / "cap", T0, "s.jsonl", [bad, chat(2, T0)])
    res = ingest(cfg, source=str(tmp_path / "cap"))
    assert (res.read, res.quarantined, res.normalized) == (2, 1, 1) and reconciles(res)
    assert quarantine_rows(cfg)[0][1:3] == ("unknown_role", "request.messages[0].role=\\ud800x")
    assert ingest(cfg, source=str(tmp_path / "cap")).read == 0  # done: a re-run is a no-op


# -- the reader stops buffering at the line cap -------------------------------------------------

def _chunks(data: bytes, sizes: list[int]):
    """readinto over ``data``, returning at most the next of ``sizes`` bytes each call (short reads)."""
    pos, k = 0, 0

    def readinto(view):
        nonlocal pos, k
        n = min(len(view), sizes[k % len(sizes)], len(data) - pos)
        k += 1
        view[:n] = data[pos:pos + n]
        pos += n
        return n

    return readinto


@pytest.mark.parametrize("block", [1, 7, 64, 1000])
@pytest.mark.parametrize("reads", [[1 << 20], [3, 50, 1], [999]])
def test_lines_over_the_cap_come_as_long_lines_and_the_rest_as_before(block, reads):
    max_line = 100
    # The buffer starts at `block` bytes and doubles up to max_line + 1: a line that fills it
    # without a newline is over the cap and comes as a LongLine.
    longest_kept = (block if block > max_line else max_line + 1) - 1
    lines = [b"a" * 10, b"b" * 100, b"c" * 101, b"", b"d" * 5000, b"e" * 99, b"f" * 999, b"g" * 1000, b"h" * 250]
    for tail in (b"\n", b""):
        data = b"\n".join(lines) + tail
        got = []
        for item in _blocks(_chunks(data, reads), block, max_line):
            if isinstance(item, LongLine):
                got.append(("long", item.size, item.head))
            else:
                parts = bytes(item).split(b"\n")
                if parts[-1] == b"":
                    parts.pop()
                got += [("line", len(x), x) for x in parts]
        # A long line's head is what the buffer held of it, at most LONG_LINE_HEAD bytes.
        want = [("long", len(x), x[:min(4096, longest_kept + 1)]) if len(x) > longest_kept else ("line", len(x), x)
                for x in lines]
        assert got == want


def test_iter_blocks_without_a_cap_is_unchanged(tmp_path):
    p = tmp_path / "f.jsonl"
    p.write_bytes(b"x" * 300 + b"\nshort\n" + b"y" * 5)
    assert b"".join(bytes(b) for b in iter_blocks(str(p), block_size=16)) == p.read_bytes()
    assert list(iter_lines(str(p), chunk_size=16)) == [b"x" * 300, b"short", b"y" * 5]


def test_a_huge_line_without_newline_costs_no_memory_and_is_quarantined_with_its_size(tmp_path):
    """A 200 MB file with no newline reached 586 MB RSS before being quarantined; here 64 MB against a 1 MiB cap."""
    src = tmp_path / "cap" / "ep" / "AllTraffic" / T0.strftime("%Y/%m/%d/%H")
    src.mkdir(parents=True)
    with open(src / "huge.jsonl", "wb") as f:
        f.write((chat(1, T0) + "\n").encode())
        for _ in range(64):
            f.write(b"z" * (1 << 20))
        f.write(b"\n" + (chat(2, T0) + "\n").encode())
        f.write(f"trailing {GHP} ".encode() * 200_000)  # a final over-long line with a secret, no newline
    (tmp_path / "warm.jsonl").write_text(chat(3, T0) + "\n{bad\n")
    code = textwrap.dedent(f"""
        import json, resource
        from capture import ingest as m
        from capture.sources import list_objects
        opts = m.FileOptions(max_line_bytes=1 << 20)
        (warm,) = list(list_objects({str(tmp_path / "warm.jsonl")!r}))
        m.process_file(warm, opts)  # imports and the native module: not the buffers under test
        (obj,) = list(list_objects({str(tmp_path / "cap")!r}))
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        r = m.process_file(obj, opts)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(json.dumps({{"grew_mb": (peak - base) / 1024, "read": r.read, "rows": r.table.num_rows,
                          "q": [(q["line_no"], q["reason"], q["detail"], q["excerpt"]) for q in r.quarantine]}}))
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["grew_mb"] < 40, out["grew_mb"]  # buffers of ~1 MiB, not the 64 MB line (nor 3x it)
    assert (out["read"], out["rows"]) == (4, 2)
    (l2, r2, d2, e2), (l4, r4, d4, e4) = out["q"]
    assert (l2, r2, d2) == (2, "line_too_large", f"{64 << 20} bytes > {1 << 20}")
    assert e2.startswith("zzzz") and e2.endswith("…") and len(e2) == EXCERPT_BYTES + 1
    assert (l4, r4) == (4, "line_too_large") and GHP not in e4 and "[REDACTED_API_KEY]" in e4


# -- owner-only files --------------------------------------------------------------------------

@pytest.fixture
def open_umask():
    old = os.umask(0o022)  # what most shells give: files 0644 unless the code says otherwise
    yield
    os.umask(old)


def mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_warehouse_catalog_and_parquet_are_owner_only(tmp_path, open_umask):
    cfg = make_cfg(tmp_path)
    layout_file(tmp_path / "cap", T0, "a.jsonl", [chat(i, T0) for i in range(5)] + ["{bad"])
    res = ingest(cfg, source=str(tmp_path / "cap"))
    assert res.normalized == 5 and res.quarantined == 1
    wh = Path(cfg.warehouse.uri)
    catalog = Path(cfg.warehouse.catalog)
    assert mode(catalog) == 0o600
    parts = list(wh.rglob("*.parquet"))  # the conversations' parts and the catalog's own tables
    assert parts and all(mode(p) == 0o600 for p in parts)
    for d in [wh, *{p.parent for p in parts}]:
        assert mode(d) == 0o700, d
    assert all(mode(p) & 0o077 == 0 for p in wh.rglob("*") if p.is_file())
    # A catalog from before (0644) is made owner-only by the next run that writes it.
    os.chmod(catalog, 0o644)
    ingest(cfg, source=str(tmp_path / "cap"))
    assert mode(catalog) == 0o600


def test_cycle_state_file_is_owner_only(tmp_path, open_umask):
    from loop import cycle

    cfg = make_cfg(tmp_path)
    cycle.save_state(cfg, {"cycle_id": "c1", "steps": {}, "options": {}})
    assert mode(cycle.cycle_dir(cfg, "c1") / "state.json") == 0o600
    assert cycle.load_state(cfg, "c1")["cycle_id"] == "c1"

