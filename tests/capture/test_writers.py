"""Several ingest runs writing one warehouse at once (capture.warehouse: claims, leases, reconciling commits).

The services tests run each writer as a process of its own, with its own state directory,
sharing only the S3 bucket and the catalog in PostgreSQL, as workers of a deployment do.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from capture.catalog import CatalogError, probe
from capture.ingest import ingest
from capture.warehouse import Warehouse
from settings.config import dump_toml, load_config
from tests.capture_support import T0, catalog_rows, chain, chat, layout_file, reconciles
from tests.config_support import make_cfg

REPO = Path(__file__).resolve().parents[2]


def asked(row: dict) -> tuple[str, ...]:
    """A stored conversation by its user turns: which conversation it is, and how long."""
    return tuple(t["value"] for t in row["conversations"] if t["from"] == "human")


def stored(cfg) -> list[tuple[str, ...]]:
    """Every conversation a fresh reader of the warehouse sees, sorted (a repeat would show twice)."""
    wh = Warehouse(cfg)
    try:
        return sorted(asked(r) for r in wh.read_conversations().to_pylist())
    finally:
        wh.close()


def totals(results: list[dict]) -> dict[str, int]:
    return {k: sum(r[k] for r in results) for k in ("read", "normalized", "duplicates", "stitched", "quarantined",
                                                   "skipped", "superseded")}


def reconciling(cfg, tmp_path: Path, monkeypatch) -> list[str]:
    """Writer A decided its rows before writer B committed overlapping ones; A's commit comes second.

    B stores D (which A holds too), the 3-turn S (A holds its 2-turn prefix) and the 1-turn U
    (A holds its 3-turn extension). A's commit drops D as a duplicate and its S prefix as
    stitched (its part is rewritten without them) and supersedes B's U. Returns the names of
    the parts left.
    """
    mine, theirs = tmp_path / "a", tmp_path / "b"
    s, u = chain("s", 3), chain("u", 3)
    layout_file(mine, T0, "a.jsonl", [chat(1, T0), chat(2, T0), s[1], u[2]])
    layout_file(theirs, T0, "b.jsonl", [chat(1, T0), chat(3, T0), s[2], u[0]])
    real = Warehouse.commit
    interleaved: list[dict] = []
    first: list[str] = []

    def commit_after_the_other_writer(self, run_id, cp):
        if not first:  # A, about to commit: B runs from start to end first
            first.append(run_id)
            interleaved.append(ingest(cfg, source=str(theirs)).summary())
        return real(self, run_id, cp)

    monkeypatch.setattr(Warehouse, "commit", commit_after_the_other_writer)
    a = ingest(cfg, source=str(mine))
    monkeypatch.setattr(Warehouse, "commit", real)
    (b,) = interleaved
    assert (b["normalized"], b["duplicates"], b["superseded"]) == (4, 0, 0)
    assert (a.read, a.normalized, a.duplicates, a.stitched, a.superseded) == (4, 2, 1, 1, 1) and reconciles(a)
    want = sorted([("question 1",), ("question 2",), ("question 3",), tuple(f"s question {k}" for k in range(3)),
                   tuple(f"u question {k}" for k in range(3))])
    assert stored(cfg) == want
    # What was committed agrees with what A reported, file by file and in the run's totals.
    assert catalog_rows(cfg, "SELECT normalized, duplicates, stitched FROM manifest WHERE run_id = ?", [a.run_id]) == [
        (2, 1, 1)]
    assert catalog_rows(cfg, "SELECT normalized, duplicates, stitched, superseded FROM runs WHERE run_id = ?",
                        [a.run_id]) == [(2, 1, 1, 1)]
    assert catalog_rows(cfg, 'SELECT sum("rows") FROM parquet_files WHERE run_id = ?', [a.run_id]) == [(2,)]
    assert a.normalized + b["normalized"] - a.superseded == len(want)
    again = ingest(cfg, source=str(mine))
    assert (again.read, again.objects) == (0, 0)
    wh = Warehouse(cfg)
    try:
        infos = wh.fs.get_file_info(pafs.FileSelector(wh.base, recursive=True))
    finally:
        wh.close()
    # A's part holds only its two rows: the part written before reconciling is gone.
    parts = sorted(i.base_name for i in infos if i.base_name.startswith("part-"))
    assert len(parts) == 2 and any(a.run_id in p and "-r1." in p for p in parts)
    return parts


def test_a_commit_reconciles_with_what_another_writer_committed_meanwhile(tmp_path, monkeypatch):
    reconciling(make_cfg(tmp_path), tmp_path, monkeypatch)


def test_the_same_on_s3_and_the_shared_catalog(s3_server, shared_catalog, tmp_path, monkeypatch):
    cfg = load_config(overrides={
        "state_dir": str(tmp_path / "state"),
        "s3": {"endpoint_url": s3_server.endpoint_url, "region": s3_server.region},
        "warehouse": {"uri": f"s3://{s3_server.bucket}/r-{uuid.uuid4().hex[:8]}/warehouse", "catalog": shared_catalog},
    })
    reconciling(cfg, tmp_path, monkeypatch)


def test_a_shared_catalog_never_holds_its_password_in_the_config(tmp_path):
    cfg = load_config(overrides={"state_dir": str(tmp_path),
                                 "warehouse": {"catalog": "postgres:host=db dbname=catalog user=u password=hunter2"}})
    with pytest.raises(CatalogError, match="PGPASSWORD"):
        Warehouse(cfg)


# -- real writers: processes of their own, one bucket, the catalog in PostgreSQL ---------------------------


def captures(root: Path) -> tuple[int, list[tuple[str, ...]]]:
    """Nine hourly capture files whose conversations overlap across files: three chats in every
    file, three 3-turn chats with one turn in each of three files, six chats of its own, a bad
    line and an empty one. Returns the number of lines and the conversations they hold, longest."""
    n = 0
    for h in range(9):
        t = T0 + timedelta(hours=h)
        k = chain(f"k{h % 3}", 3, t0=T0 + timedelta(hours=h % 3), step=timedelta(hours=3))[h // 3]
        lines = [chat(100 * (h + 1) + i, t) for i in range(6)] + [chat(i, t) for i in range(3)] + [k, "{bad", ""]
        layout_file(root, t, "f.jsonl", lines)
        n += len(lines)
    want = [(f"question {100 * (h + 1) + i}",) for h in range(9) for i in range(6)] + [(f"question {i}",) for i in range(3)]
    want += [tuple(f"k{c} question {j}" for j in range(3)) for c in range(3)]
    return n, sorted(want)


@pytest.fixture
def shared(s3_server, shared_catalog, tmp_path):
    """Captures in the bucket, and a config per worker: its own state directory, the shared warehouse and catalog."""
    prefix = f"w-{uuid.uuid4().hex[:8]}"
    n, want = captures(tmp_path / "cap")
    client = s3_server.client()
    for p in sorted((tmp_path / "cap").rglob("*.jsonl")):
        client.upload_file(str(p), s3_server.bucket, f"{prefix}/capture/{p.relative_to(tmp_path / 'cap').as_posix()}")

    def worker(name: str, **warehouse) -> Path:
        cfg = load_config(overrides={
            "state_dir": str(tmp_path / name),
            "s3": {"endpoint_url": s3_server.endpoint_url, "region": s3_server.region},
            "capture": {"source": f"s3://{s3_server.bucket}/{prefix}/capture", "endpoint": "ep"},
            "warehouse": {"uri": f"s3://{s3_server.bucket}/{prefix}/warehouse", "catalog": shared_catalog, **warehouse},
        })
        path = tmp_path / f"{name}.toml"
        path.write_text(dump_toml(cfg))
        return path

    return worker, n, want


def cli(config: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "app", "ingest", "--config", str(config), "--json", *args],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finished(p: subprocess.Popen) -> dict:
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-3000:]
    return json.loads(out)


def test_writers_at_once_store_every_conversation_once(shared):
    worker, n_lines, want = shared
    first = load_config(path=worker("w0"))
    assert "not made yet" in probe(first.warehouse)  # looking (adapt doctor) makes nothing
    # Three workers started together on overlapping windows: hours 3 and 6 are in two windows each.
    hours = [(0, 4), (3, 7), (6, 9)]
    procs = [cli(worker(f"w{i}"), "--since", (T0 + timedelta(hours=a)).isoformat(),
                 "--until", (T0 + timedelta(hours=b)).isoformat()) for i, (a, b) in enumerate(hours)]
    results = [finished(p) for p in procs]
    for r in results:
        assert r["read"] == r["normalized"] + r["duplicates"] + r["stitched"] + r["quarantined"] + r["skipped"], r
    t = totals(results)
    # Every line read once over the writers, and every conversation visible once to a fresh reader.
    assert t["read"] == n_lines and (t["quarantined"], t["skipped"]) == (9, 9)
    reader = load_config(path=worker("reader"))  # a fourth worker, which wrote nothing
    assert stored(reader) == want
    assert t["normalized"] - t["superseded"] == len(want)
    assert catalog_rows(reader, "SELECT count(*), count(DISTINCT source_uri) FROM manifest") == [(9, 9)]
    assert catalog_rows(reader, "SELECT count(*) FROM runs WHERE status = 'complete'") == [(3,)]
    assert probe(reader.warehouse).endswith("11 tables")
    # The catalog's tables outgrew what DuckLake keeps inline: their Parquet went to the bucket too.
    assert Warehouse(reader).fs.get_file_info(pafs.FileSelector(f"{Warehouse(reader).base}/_lake", recursive=True))
    # A re-run reads nothing new.
    assert ingest(load_config(path=worker("late"))).read == 0


# The writer kills itself (SIGKILL: no clean-up of any kind) at one point of its commit: when
# called (its parts are written), or inside the transaction (its catalog rows are in, uncommitted).
KILLED_AT = {
    "parts written, before the commit": "Warehouse.commit",
    "inside the commit's transaction": "Warehouse._write",
}


@pytest.mark.parametrize("where", sorted(KILLED_AT))
def test_a_writer_killed_at_any_point_loses_nothing_and_counts_nothing_twice(shared, where):
    worker, n_lines, want = shared
    # A lease of a few seconds: short, and still renewed in time on a loaded machine.
    config = worker("doomed", lease_s=3.0)
    target = KILLED_AT[where]
    code = (
        "import os, signal, sys\n"
        "from capture.warehouse import Warehouse\n"
        f"real = {target}\n"
        "def killed(self, *a, **kw):\n"
        f"    {'real(self, *a, **kw)' if target.endswith('_write') else 'pass'}\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        f"{target} = killed\n"
        "from app.cli import main\n"
        f"sys.argv = ['adapt', 'ingest', '--config', {str(config)!r}, '--json']\n"
        "main()\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == -signal.SIGKILL, p.stderr[-3000:]
    cfg = load_config(path=config)
    assert catalog_rows(cfg, "SELECT count(*) FROM parquet_files") == [(0,)]  # nothing of it is visible
    (dead,), = catalog_rows(cfg, "SELECT run_id FROM runs WHERE status = 'running'")
    assert part_names(cfg, dead), "the writer must die with its parts written"
    # Its lease lapses: the next writer reads every file, and stores every conversation once.
    time.sleep(3.2)
    survivor = load_config(path=worker("survivor", lease_s=1.0))
    first = ingest(survivor)
    assert first.read == n_lines and first.normalized - first.superseded == len(want) and reconciles(first)
    assert stored(survivor) == want
    # The dead writer's parts are deleted by the first run a lease (the cleaner's) after its lease lapsed.
    time.sleep(1.2)
    again = ingest(survivor)
    assert again.read == 0 and stored(survivor) == want
    assert not part_names(cfg, dead)


def part_names(cfg, run_id: str) -> list[str]:
    wh = Warehouse(cfg)
    infos = wh.fs.get_file_info(pafs.FileSelector(wh.base, recursive=True, allow_not_found=True))
    return [i.base_name for i in infos if i.base_name.startswith(f"part-{run_id}-")]
