"""End-to-end ingest from local directories: real fixtures, idempotency, bad input, crash, split, CLI."""

from __future__ import annotations

import glob
import json
import os
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from typer.testing import CliRunner

from capture import ingest as ingest_mod
from capture.ingest import ingest
from capture.sources import SourceObject, list_objects
from capture.split import export, load_split, stats
from capture.synth import write_layout
from capture.warehouse import SCHEMA, Warehouse
from settings.config import dump_toml
from tests.capture_support import T0, catalog_rows, chat, layout_file, reconciles, write
from tests.config_support import make_cfg
from tests.paths import DATACAPTURE


def test_real_llm_fixture_yields_three_conversations_then_nothing(tmp_path):
    cfg = make_cfg(tmp_path)
    src = str(DATACAPTURE / "llm-jumpstart-llama31.jsonl")
    res = ingest(cfg, source=src)
    assert (res.read, res.normalized, res.quarantined, res.skipped, res.duplicates) == (3, 3, 0, 0, 0)
    rows = load_split(cfg, "train", heldout_hours=0) + load_split(cfg, "heldout", heldout_hours=0)
    assert len(rows) == 3
    by_prompt = {r["conversations"][0]["value"]: r for r in rows}
    r = by_prompt["When does machine learning performce below bar?"]
    assert [t["from"] for t in r["conversations"]] == ["human", "gpt"]
    assert r["conversations"][1]["value"].startswith(" When does it perform better than human intelligence?")
    assert (r["format"], r["raw"], r["temperature"], r["top_p"], r["max_tokens"]) == ("tgi", True, 0.7, 0.9, 512)
    assert r["event_id"] == "73c27749-61f8-43ed-b3a6-841c4aa8a7eb"
    assert r["inference_time"] == datetime(2026, 2, 19, 1, 34, 30, tzinfo=timezone.utc)
    assert r["source_uri"] == src and len(r["content_hash"]) == 32
    again = ingest(cfg, source=src)
    assert (again.read, again.normalized) == (0, 0)


@pytest.mark.parametrize("name", ["tabular-csv-sdk-fixture.jsonl", "tabular-csv-notebook.jsonl", "tabular-json-notebook.jsonl"])
def test_real_tabular_fixtures_are_skipped_with_reason(tmp_path, name):
    cfg = make_cfg(tmp_path)
    res = ingest(cfg, source=str(DATACAPTURE / name))
    n_lines = len((DATACAPTURE / name).read_bytes().rstrip(b"\n").split(b"\n"))
    assert res.read == n_lines > 0
    assert (res.normalized, res.quarantined, res.duplicates) == (0, 0, 0)
    assert res.skipped == res.read and res.skip_reasons == {"not_llm_traffic": res.read}
    assert catalog_rows(cfg, "SELECT reason, sum(count) FROM skipped GROUP BY 1") == [("not_llm_traffic", res.read)]


def test_incremental_new_file_picked_up_once_and_dedupe_across_runs(tmp_path):
    cfg = make_cfg(tmp_path)
    src = tmp_path / "cap"
    layout_file(src, T0, "00-00-a.jsonl", [chat(i, T0 + timedelta(minutes=i)) for i in range(5)])
    first = ingest(cfg, source=str(src))
    assert (first.read, first.normalized, first.objects) == (5, 5, 1)
    # A later file: two new conversations, one replay of an earlier one and one replay within the file.
    t1 = T0 + timedelta(hours=1)
    layout_file(src, t1, "00-00-b.jsonl", [chat(5, t1), chat(6, t1), chat(2, t1), chat(5, t1 + timedelta(seconds=1))])
    second = ingest(cfg, source=str(src))
    assert (second.read, second.normalized, second.duplicates, second.objects) == (4, 2, 2, 1)
    third = ingest(cfg, source=str(src))
    assert (third.read, third.objects) == (0, 0)
    rows = load_split(cfg, "train", heldout_hours=0)
    hashes = [r["content_hash"] for r in rows]
    assert len(rows) == 7 and len(set(hashes)) == 7
    # Partitioned by day, catalogued.
    assert list((Path(cfg.warehouse.uri)).glob("dt=2025-05-01/part-*.parquet"))
    assert catalog_rows(cfg, 'SELECT sum("rows"), count(*) FROM parquet_files') == [(7, 2)]
    assert catalog_rows(cfg, "SELECT count(*), count(DISTINCT content_hash) FROM content_hashes") == [(7, 7)]
    assert catalog_rows(cfg, "SELECT count(*) FROM manifest") == [(2,)]
    assert catalog_rows(cfg, "SELECT count(*) FROM runs WHERE status = 'complete'") == [(3,)]


def test_changed_object_is_reread_and_old_rows_count_as_duplicates(tmp_path):
    cfg = make_cfg(tmp_path)
    f = layout_file(tmp_path / "cap", T0, "x.jsonl", [chat(1, T0)])
    ingest(cfg, source=str(tmp_path / "cap"))
    with open(f, "a") as fh:
        fh.write(chat(2, T0) + "\n")
    res = ingest(cfg, source=str(tmp_path / "cap"))
    assert (res.read, res.normalized, res.duplicates) == (2, 1, 1)


def test_time_window_and_endpoint_filter(tmp_path):
    cfg = make_cfg(tmp_path)
    src = tmp_path / "cap"
    for h in range(4):
        t = T0 + timedelta(hours=h)
        layout_file(src, t, "f.jsonl", [chat(h, t)], endpoint="ep")
        layout_file(src, t, "f.jsonl", [chat(100 + h, t)], endpoint="other")
    res = ingest(cfg, source=str(src), since="2025-05-01T11", until="2025-05-01T13:00Z", endpoint="ep")
    assert (res.objects, res.normalized) == (2, 2)
    rows = load_split(cfg, "train", heldout_hours=0)
    assert {r["conversations"][0]["value"] for r in rows} == {"question 1", "question 2"}
    assert {(r["endpoint"], r["variant"]) for r in rows} == {("ep", "AllTraffic")}
    rest = ingest(cfg, source=str(src))
    assert (rest.objects, rest.normalized) == (6, 6)


def test_bad_input_file_quarantines_each_line_and_keeps_the_valid_ones(tmp_path):
    cfg = make_cfg(tmp_path)
    good = [chat(i, T0) for i in range(6)]
    huge = chat(99, T0, text="x" * (20 * 1024 * 1024))
    bad_b64 = json.loads(chat(98, T0))
    bad_b64["captureData"]["endpointInput"].update(encoding="BASE64", data="%%%")
    lines = [
        b"\xef\xbb\xbf" + good[0].encode(),  # BOM on the first line
        good[1][: len(good[1]) // 2],  # truncated JSON
        good[2],
        json.dumps(bad_b64),
        b"",  # empty line
        good[3].encode().replace(b"question 3", b"question \xff3"),  # invalid UTF-8
        good[4].encode().replace(b"question 4", b"question \x004"),  # NUL byte
        huge,  # 20 MB line
        json.dumps({"captureData": {"endpointInput": {"data": 1}}}),  # wrongly typed field
        "[" * 10_000 + "]" * 10_000,  # 10,000-deep nesting
        good[5],
        chat(7, T0) + "\r",  # CRLF line ending
    ]
    f = layout_file(tmp_path / "cap", T0, "bad.jsonl", lines)
    res = ingest(cfg, source=str(tmp_path / "cap"))
    assert res.read == len(lines) and reconciles(res)
    assert res.normalized == 4
    assert res.quarantine_reasons == {"invalid_json": 1, "invalid_base64": 1, "invalid_utf8": 1, "nul_bytes": 1,
                                      "line_too_large": 1, "wrong_type": 1, "too_deeply_nested": 1}
    assert res.skip_reasons == {"empty_line": 1}
    q = catalog_rows(cfg, "SELECT line_no, reason, source_uri, length(excerpt) FROM quarantine ORDER BY line_no")
    assert [r[0] for r in q] == [2, 4, 6, 7, 8, 9, 10]
    assert all(r[2] == str(f) and 0 < r[3] <= 1025 for r in q)
    values = {r["conversations"][0]["value"] for r in load_split(cfg, "train", heldout_hours=0)}
    assert values == {"question 0", "question 2", "question 5", "question 7"}  # BOM and CRLF lines included


def test_twenty_megabyte_valid_line_over_limit_is_quarantined_not_lost(tmp_path):
    cfg = make_cfg(tmp_path)  # default max_line_bytes: 8 MiB
    layout_file(tmp_path / "cap", T0, "big.jsonl", [chat(1, T0), chat(2, T0, text="y" * (20 << 20)), chat(3, T0)])
    res = ingest(cfg, source=str(tmp_path / "cap"))
    assert (res.read, res.normalized, res.quarantined) == (3, 2, 1)
    assert res.quarantine_reasons == {"line_too_large": 1}


def test_crash_before_commit_leaves_nothing_visible_and_next_run_completes(tmp_path, monkeypatch):
    cfg = make_cfg(tmp_path)
    src = tmp_path / "cap"
    for h in range(3):
        t = T0 + timedelta(hours=h)
        layout_file(src, t, "f.jsonl", [chat(10 * h + i, t) for i in range(4)])
    real_commit = Warehouse.commit

    def dying_commit(self, *a, **kw):
        raise KeyboardInterrupt("killed mid-run")

    monkeypatch.setattr(Warehouse, "commit", dying_commit)
    monkeypatch.setattr(ingest_mod, "PART_ROWS", 2)  # Parquet files get written before the commit
    with pytest.raises(KeyboardInterrupt):
        ingest(cfg, source=str(src))
    orphans = list(Path(cfg.warehouse.uri).rglob("part-*.parquet"))
    assert orphans, "the test must crash after Parquet was written"
    assert load_split(cfg, "train", heldout_hours=0) == []
    assert catalog_rows(cfg, "SELECT count(*) FROM manifest") == [(0,)]
    # The run that stopped says so: its claims lapse and its parts are orphans at once.
    assert catalog_rows(cfg, "SELECT status FROM runs") == [("failed",)]

    monkeypatch.setattr(Warehouse, "commit", real_commit)
    res = ingest(cfg, source=str(src))
    assert (res.read, res.normalized, res.duplicates) == (12, 12, 0)
    assert not any(p.exists() for p in orphans)
    assert len(load_split(cfg, "train", heldout_hours=0)) == 12
    assert ingest(cfg, source=str(src)).read == 0


def three_days(src: Path) -> Path:
    """One capture file on each of three days, four conversations each."""
    for d in range(3):
        t = T0 + timedelta(days=d)
        layout_file(src, t, "f.jsonl", [chat(10 * d + i, t) for i in range(4)])
    return src


def test_a_day_is_written_once_files_move_past_it_and_commits_name_only_written_parts(tmp_path, monkeypatch):
    cfg, src = make_cfg(tmp_path), three_days(tmp_path / "cap")
    monkeypatch.setattr(ingest_mod, "PART_MIN_ROWS", 3)
    events = []
    real_add, real_flush = ingest_mod._Run.add, ingest_mod._Run._flush_day

    def add(self, fr):
        events.append(("add", fr.obj.hour.date()))
        real_add(self, fr)

    def flush(self, d):
        events.append(("flush", d))
        real_flush(self, d)

    monkeypatch.setattr(ingest_mod._Run, "add", add)
    monkeypatch.setattr(ingest_mod._Run, "_flush_day", flush)
    res = ingest(cfg, source=str(src), workers=1)
    days = [(T0 + timedelta(days=d)).date() for d in range(3)]
    # Each day is handed to the writer while the next day's file is being added, not at the end.
    assert events == [("add", days[0]), ("add", days[1]), ("flush", days[0]), ("add", days[2]), ("flush", days[1]),
                      ("flush", days[2])]
    assert (res.read, res.normalized) == (12, 12)
    files = catalog_rows(cfg, 'SELECT dt, "rows" FROM parquet_files ORDER BY dt')
    assert files == [(d, 4) for d in days]
    assert len(load_split(cfg, "train", heldout_hours=0)) == 12


def test_a_failed_part_write_fails_the_run_commits_nothing_and_the_next_run_completes(tmp_path, monkeypatch):
    cfg, src = make_cfg(tmp_path), three_days(tmp_path / "cap")
    monkeypatch.setattr(ingest_mod, "PART_MIN_ROWS", 1)
    real_write = Warehouse.write_part
    written = []

    def write_part(self, table, dt, *a):
        if dt == (T0 + timedelta(days=1)).date():
            time.sleep(0.5)  # slow, so the final commit is queued before the failure is seen
            raise OSError(28, "No space left on device")
        written.append(real_write(self, table, dt, *a)[0])
        return written[-1], 1

    monkeypatch.setattr(Warehouse, "write_part", write_part)
    with pytest.raises(OSError, match="No space left"):
        ingest(cfg, source=str(src), workers=1)
    assert written, "a part must have been written before the failure"
    assert catalog_rows(cfg, "SELECT (SELECT count(*) FROM manifest), (SELECT count(*) FROM parquet_files)") == [(0, 0)]
    assert load_split(cfg, "train", heldout_hours=0) == []

    monkeypatch.setattr(Warehouse, "write_part", real_write)
    res = ingest(cfg, source=str(src))
    assert (res.read, res.normalized) == (12, 12)
    assert not any(Path(p).exists() for p in written)  # the failed run's parts were orphans, now removed
    assert len(load_split(cfg, "train", heldout_hours=0)) == 12


def test_vanished_object_is_reported_and_the_run_completes(tmp_path, monkeypatch):
    cfg = make_cfg(tmp_path)
    src = tmp_path / "cap"
    real = layout_file(src, T0, "a.jsonl", [chat(1, T0)])
    ghost = real.with_name("ghost.jsonl")
    real_list = ingest_mod.list_objects

    def listing(*a, **kw):
        yield from real_list(*a, **kw)
        yield SourceObject(str(ghost), 10, "10-1", "ep", "AllTraffic", T0)  # listed, then deleted

    monkeypatch.setattr(ingest_mod, "list_objects", listing)
    res = ingest(cfg, source=str(src))
    assert (res.read, res.normalized, res.missing_objects, res.objects) == (1, 1, 1, 1)
    assert catalog_rows(cfg, "SELECT source_uri FROM manifest") == [(str(real),)]


def test_redaction_on_by_default_and_switchable(tmp_path):
    text = "I am bob@example.com, card 4111 1111 1111 1111, key AKIAIOSFODNN7EXAMPLE"
    for redact, tag in ((True, "on"), (False, "off")):
        cfg = make_cfg(tmp_path / tag, capture={"redact": redact})
        layout_file(tmp_path / tag / "cap", T0, "p.jsonl", [chat(1, T0, text=text), chat(2, T0, text=text + " again")])
        res = ingest(cfg, source=str(tmp_path / tag / "cap"))
        value = load_split(cfg, "train", heldout_hours=0)[0]["conversations"][0]["value"]
        if redact:
            assert res.redactions == {"EMAIL": 2, "CARD": 2, "AWS_ACCESS_KEY": 2}
            assert value.startswith("I am [REDACTED_EMAIL], card [REDACTED_CARD], key [REDACTED_AWS_ACCESS_KEY]")
        else:
            assert res.redactions == {} and "bob@example.com" in value


def test_heldout_split_by_time_export_and_stats(tmp_path):
    cfg = make_cfg(tmp_path, capture={"heldout_hours": 2})
    src = tmp_path / "cap"
    for h in range(6):
        t = T0 + timedelta(hours=h)
        # Hour 5 replays hour 0's first conversation: it must stay in train only.
        layout_file(src, t, "f.jsonl", [chat(10 * h + i, t + timedelta(minutes=i)) for i in range(3)] + ([chat(0, t)] if h == 5 else []))
    res = ingest(cfg, source=str(src))
    assert (res.normalized, res.duplicates) == (18, 1)
    train, held = load_split(cfg, "train"), load_split(cfg, "heldout")
    # Latest conversation: 15:02, cutoff 13:02 → hours 14 and 15 (all) are held out, 13:00–13:02 is not.
    assert len(held) == 6 and len(train) == 12
    assert min(r["inference_time"] for r in held) > max(r["inference_time"] for r in train)
    assert not {r["content_hash"] for r in train} & {r["content_hash"] for r in held}
    out = tmp_path / "held.jsonl"
    assert export(cfg, "heldout", out) == 6
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == 6 and all(set(t) == {"from", "value"} for r in lines for t in r["conversations"])
    assert {"id", "event_id", "inference_time", "endpoint", "variant", "source_uri", "format", "content_hash"} <= set(lines[0])
    st = stats(cfg)
    assert st["conversations"] == 18 and st["splits"] == {"heldout": 6, "train": 12}
    assert st["formats"] == {"openai_chat": 18} and st["endpoints"] == {"ep": 18}
    assert sum(st["days"].values()) == 18
    assert st["tokens"]["p50"] == 4  # "question N" + "answer N": 2 + 2 words
    # Fractions of an hour: the last 30 minutes hold only hour 15's three conversations.
    assert len(load_split(cfg, "heldout", heldout_hours=0.5)) == 3


def test_worker_pool_matches_inline(tmp_path):
    src = tmp_path / "cap"
    write_layout(src, 600, per_file=100, seed=5)
    results = []
    for workers in (1, 2):
        cfg = make_cfg(tmp_path / f"w{workers}")
        res = ingest(cfg, source=str(src), workers=workers)
        assert reconciles(res)
        rows = load_split(cfg, "train", heldout_hours=0)
        results.append((res.summary() | {"run_id": None}, sorted(r["content_hash"] for r in rows)))
    assert results[0] == results[1]
    assert results[0][0]["normalized"] > 400 and results[0][0]["skipped"] > 0
    # Tables come back from the workers through shared-memory files; none may be left behind.
    assert not glob.glob(os.path.join(ingest_mod.handoff_dir(), ingest_mod.handoff_prefix(os.getpid()) + "*"))


def test_the_pool_starts_for_what_is_listed_and_ends_when_nothing_of_it_is_new(tmp_path, monkeypatch):
    # The pool starts before the catalog says which listed files are new (its workers import
    # meanwhile); a re-run that finds none new ends it and runs nothing in it.
    monkeypatch.setattr(ingest_mod, "POOL_MIN_BYTES", 0)
    pools = []
    start = ingest_mod._start_pool
    monkeypatch.setattr(ingest_mod, "_start_pool", lambda *a: pools.append(start(*a)) or pools[-1])
    src = tmp_path / "cap"
    write_layout(src, 200, per_file=50, seed=3)
    cfg = make_cfg(tmp_path)
    first = ingest(cfg, source=str(src))
    assert reconciles(first) and first.read == 200 and first.normalized > 100
    again = ingest(cfg, source=str(src))
    assert reconciles(again) and (again.objects, again.read, again.normalized) == (0, 0, 0)
    assert len(pools) == 2 and all(p is not None for p in pools)
    for p in pools:  # both ended, their workers gone
        assert not any(w.is_alive() for w in p._pool)
    assert not glob.glob(os.path.join(ingest_mod.handoff_dir(), ingest_mod.handoff_prefix(os.getpid()) + "*"))


def test_cli_ingest_stats_export(tmp_path):
    from app.cli import app

    cfg = make_cfg(tmp_path)
    cfg_file = tmp_path / "c.toml"
    cfg_file.write_text(dump_toml(cfg))
    runner = CliRunner()
    r = runner.invoke(app, ["ingest", "--source", str(DATACAPTURE), "--config", str(cfg_file), "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert list(out) == ["read", "normalized", "duplicates", "stitched", "quarantined", "skipped", "superseded",
                         "redactions", "run_id"]
    assert out["normalized"] == 3 and out["quarantined"] == 0 and out["read"] == out["normalized"] + out["skipped"]
    r = runner.invoke(app, ["ingest", "--source", str(DATACAPTURE), "--config", str(cfg_file), "--json"])
    assert json.loads(r.stdout)["read"] == 0
    r = runner.invoke(app, ["dataset", "stats", "--config", str(cfg_file), "--json"])
    assert r.exit_code == 0, r.output
    st = json.loads(r.stdout)
    assert st["conversations"] == 3 and st["skip_reasons"] == {"not_llm_traffic": out["skipped"]}
    dest = tmp_path / "h.jsonl"
    r = runner.invoke(app, ["dataset", "export", "--split", "heldout", "--out", str(dest), "--config", str(cfg_file), "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["rows"] == 3
    assert len(dest.read_text().splitlines()) == 3
    r = runner.invoke(app, ["dataset", "export", "--split", "nope", "--config", str(cfg_file)])
    assert r.exit_code == 2 and "'nope' is not one of 'train', 'heldout'" in r.output  # a usage error


def test_names_and_text_with_quotes_go_into_the_catalog_as_they_are(tmp_path):
    """Values reach the catalog as SQL literals (capture.warehouse._lit): quotes in a file name or a
    quarantined line are data, never SQL."""
    cfg = make_cfg(tmp_path)
    name = "it's'; DROP TABLE manifest; --.jsonl"
    f = layout_file(tmp_path / "cap", T0, name, [chat(1, T0, text="what's 'this'?"), "{'bad': 'json'} \\ '"])
    res = ingest(cfg, source=str(tmp_path / "cap"))
    assert (res.normalized, res.quarantined) == (1, 1)
    assert catalog_rows(cfg, "SELECT source_uri FROM manifest") == [(str(f),)]
    assert catalog_rows(cfg, "SELECT excerpt FROM quarantine") == [("{'bad': 'json'} \\ '",)]
    assert load_split(cfg, "train", heldout_hours=0)[0]["conversations"][0]["value"] == "what's 'this'?"
    assert ingest(cfg, source=str(tmp_path / "cap")).read == 0


def test_the_catalog_tables_files_are_merged_past_a_threshold(tmp_path, monkeypatch):
    cfg = make_cfg(tmp_path)
    monkeypatch.setattr(ingest_mod, "COMPACT_FILES", 3)
    files = []
    for k in range(4):  # each run commits more rows than DuckLake keeps inline: one file per run
        layout_file(tmp_path / "cap", T0, f"{k}.jsonl", [chat(100 * k + i, T0) for i in range(20)])
        assert ingest(cfg, source=str(tmp_path / "cap")).normalized == 20
        wh = Warehouse(cfg)
        with wh.session() as con:
            files.append(con.execute(f"SELECT count(*) FROM ducklake_list_files('{wh.catalog.name}', "
                                     "'content_hashes')").fetchall()[0][0])
        wh.close()
    # A commit counts the files before its own: the fourth run finds three, and merges them with its own.
    assert files == [1, 2, 3, 1]
    assert catalog_rows(cfg, "SELECT count(*), count(DISTINCT content_hash) FROM content_hashes") == [(80, 80)]
    assert len(load_split(cfg, "train", heldout_hours=0)) == 80


def test_a_live_writers_files_and_parts_are_left_to_it_until_that_writer_fails(tmp_path):
    cfg = make_cfg(tmp_path)
    src = tmp_path / "cap"
    a = layout_file(src, T0, "a.jsonl", [chat(1, T0)])
    layout_file(src, T0, "b.jsonl", [chat(2, T0)])
    # Another writer (its lease running) claimed a.jsonl, and wrote a part it has not committed yet.
    wh = Warehouse(cfg)
    other = "20250501T000000Z-0000beef"
    claimed = wh.begin_run(other, str(src), None, None, [o for o in list_objects(str(src)) if o.uri == str(a)])
    assert [o.uri for o in claimed] == [str(a)]
    part, _ = wh.write_part(SCHEMA.empty_table(), T0.date(), other, 1)
    # A part no run of this catalog wrote (a warehouse from before it, another catalog's), however old.
    stranger, _ = wh.write_part(SCHEMA.empty_table(), T0.date(), "20240101T000000Z-00000000", 1)
    os.utime(stranger, (0, 0))
    first = ingest(cfg, source=str(src))
    assert (first.objects, first.normalized) == (1, 1)
    assert catalog_rows(cfg, "SELECT source_uri FROM manifest") == [(str(src / "ep/AllTraffic/2025/05/01/10/b.jsonl"),)]
    assert Path(part).exists()  # orphan clean-up leaves a live writer's part alone
    # That writer stops on an error: its claim lapses and its part is an orphan; the next run reads the file.
    wh.fail_run(other)
    wh.close()
    second = ingest(cfg, source=str(src))
    assert (second.objects, second.normalized) == (1, 1)
    assert not Path(part).exists()
    assert ingest(cfg, source=str(src)).objects == 0
    assert Path(stranger).exists()


def test_read_failing_mid_file_drops_that_file_and_retries_it(tmp_path, monkeypatch):
    cfg = make_cfg(tmp_path)
    src = tmp_path / "cap"
    layout_file(src, T0, "a.jsonl", [chat(1, T0), chat(2, T0)])
    layout_file(src, T0, "b.jsonl", [chat(3, T0)])
    real_iter = ingest_mod.iter_blocks

    def flaky(uri, **kw):
        # Small blocks: one line each, so the failure comes after a block was decoded.
        for i, block in enumerate(real_iter(uri, **{**kw, "block_size": 64})):
            if uri.endswith("a.jsonl") and i == 1:
                raise ConnectionResetError("peer went away")
            yield block

    monkeypatch.setattr(ingest_mod, "iter_blocks", flaky)
    res = ingest(cfg, source=str(src))
    assert (res.objects, res.missing_objects, res.read, res.normalized) == (1, 1, 1, 1)
    monkeypatch.setattr(ingest_mod, "iter_blocks", real_iter)
    again = ingest(cfg, source=str(src))
    assert (again.objects, again.read, again.normalized) == (1, 2, 2)


def test_layout_key_round_trips_through_the_reader(tmp_path):
    from capture.sources import layout_key, parse_layout

    when = datetime(2025, 7, 8, 9, 10, 11, 123000, tzinfo=timezone.utc)
    key = layout_key("ep", "AllTraffic", when)
    assert key.startswith("ep/AllTraffic/2025/07/08/09/10-11-123-") and key.endswith(".jsonl")
    assert parse_layout(key) == ("ep", "AllTraffic", datetime(2025, 7, 8, 9, tzinfo=timezone.utc))
    write(tmp_path / "cap" / key, [chat(1, when)])
    write(tmp_path / "cap" / (key + ".tmp"), [chat(2, when)])  # in-progress file: ignored
    res = ingest(make_cfg(tmp_path), source=str(tmp_path / "cap"), endpoint="ep")
    assert (res.objects, res.normalized) == (1, 1)


def test_worker_hands_tables_over_in_shared_memory_or_through_the_pipe(tmp_path):
    src = tmp_path / "cap"
    write_layout(src, 50, per_file=50, seed=3)
    obj = next(iter(ingest_mod.list_objects(str(src))))
    opts = ingest_mod.FileOptions()
    direct = ingest_mod.process_file(obj, opts)
    handed = ingest_mod.hand_over(ingest_mod.process_file(obj, opts))
    assert handed.table is None and os.path.exists(handed.table_file)
    assert handed.table_file.startswith(ingest_mod.handoff_dir())
    assert ingest_mod.take_over(handed.table_file).equals(direct.table)
    assert not os.path.exists(handed.table_file)
    piped = ingest_mod.hand_over(ingest_mod.process_file(obj, opts), directory=str(tmp_path / "missing"))
    assert piped.table_file is None and piped.table.equals(direct.table)


def test_parquet_parts_are_snappy(tmp_path):
    """The baseline's codec (and pyarrow's and DuckDB's default): cheaper to write than zstd."""
    import pyarrow.parquet as pq

    cfg = make_cfg(tmp_path)
    layout_file(tmp_path / "cap", T0, "a.jsonl", [chat(1, T0), chat(2, T0)])
    assert ingest(cfg, source=str(tmp_path / "cap")).normalized == 2
    parts = glob.glob(str(Path(cfg.warehouse.uri) / "**" / "*.parquet"), recursive=True)
    meta = pq.ParquetFile(parts[0]).metadata
    assert parts and {meta.row_group(0).column(i).compression for i in range(meta.num_columns)} == {"SNAPPY"}
    # Min/max statistics where a reader filters (time, endpoint...), none on the text.
    with_stats = {meta.row_group(0).column(i).path_in_schema for i in range(meta.num_columns)
                  if meta.row_group(0).column(i).is_stats_set}
    assert {"inference_time", "endpoint", "dt", "run_id"} <= with_stats
    assert not with_stats & {"conversations.list.element.value", "messages", "content_hash", "id"}


def test_pool_workers_start_with_their_environment_and_the_parent_env_is_restored(tmp_path, monkeypatch):
    for k in ingest_mod.WORKER_ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "12345")  # set by the user: kept
    # The initializer runs in the spawned workers; they report what they saw through a file.
    out = tmp_path / "env.txt"
    monkeypatch.setenv("DRAFTER_TEST_ENV_OUT", str(out))
    src = tmp_path / "cap"
    for h in range(2):
        t = T0 + timedelta(hours=h)
        layout_file(src, t, "f.jsonl", [chat(10 * h + i, t) for i in range(3)])
    res = ingest(make_cfg(tmp_path), source=str(src), workers=2, on_worker_start=_record_worker_env)
    assert (res.read, res.normalized) == (6, 6)
    # (a worker the pool ends before it starts writes nothing)
    assert set(out.read_text().splitlines()) == {f"1 {32 << 20} 12345"}
    assert "OPENBLAS_NUM_THREADS" not in os.environ and "MALLOC_MMAP_THRESHOLD_" not in os.environ
    assert os.environ["MALLOC_TRIM_THRESHOLD_"] == "12345"


def _record_worker_env():
    with open(os.environ["DRAFTER_TEST_ENV_OUT"], "a") as f:
        f.write(" ".join(os.environ.get(k, "unset") for k in ingest_mod.WORKER_ENV) + "\n")
