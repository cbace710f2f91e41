"""Ingest benchmark: N synthetic capture records → warehouse, against a naive baseline, in one run.

    python benchmarks/ingest.py --n 1000000

Synthetic traffic (capture.synth: OpenAI chat, streamed chat, completions, TGI,
JumpStart chat in BASE64, 5% tabular CSV, 2% replays, and 40% reasoning and tool-call
traffic as vLLM writes it, a quarter of it with token ids; ``--mix plain`` leaves those out,
as the mix was before) is generated once and cached under --data. Each contender then runs
in its own fresh process so that its peak RSS (resource.getrusage, self and children) is
its own:

* ``capture``: ``capture.ingest.ingest`` (decode, normalize, redact, dedupe, Parquet, catalog):
  worker processes decode each file a chunk of lines at a time (``capture.batchpath``; the
  lines it declines go through the per-line path) and hand tables back in shared memory.
* ``naive``: a ``json.loads`` loop into a pandas DataFrame, then ``to_parquet`` — the
  outer capture JSON only, no payload decoding, redaction or dedupe.
* ``duckdb-floor``: DuckDB's multi-threaded C++ JSON reader over the outer documents,
  nothing else — a floor for any vectorized rewrite, printed beside the two.

Several writers at once (``--writers 1 2 4``): for each count, that many ``ingest`` processes
start together on one warehouse and one catalog, each on a window of the capture hours
overlapping its neighbours' by an hour (those files go to whichever claims them first). It
prints records/s over the wall time of all of them, then checks what a fresh reader sees:
no conversation lost (as many as one writer stores), none twice, and the counts of every
writer reconciling (``read = normalized + duplicates + stitched + quarantined + skipped``,
the records read summing to N). ``--catalog postgres:host=... user=...`` puts the catalog in
that PostgreSQL server, as workers share it (a new database per writer count, made there;
the password from ``PGPASSWORD``); without it the catalog is a local file the writers take
turns on.

    python benchmarks/ingest.py --n 1000000 --writers 1 2 4 --catalog "postgres:host=127.0.0.1 user=drafter"
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from adapt.memory import available_bytes  # noqa: E402  (after the path: run as a script)

T0 = datetime(2025, 1, 1, tzinfo=timezone.utc)


def _gen_chunk(args: tuple[str, int, int, int, str]) -> int:
    from capture.synth import DEFAULT_MIX, PLAIN_MIX, write_layout

    root, k, n, per_file, mix = args
    write_layout(root, n, per_file=per_file, seed=k, start=T0 + timedelta(seconds=k * n),
                 mix=PLAIN_MIX if mix == "plain" else DEFAULT_MIX)
    return n


def generate(data: Path, n: int, per_file: int, mix: str = "exchange") -> None:
    """Write ``n`` records (2 processes); a marker file makes later runs reuse them."""
    marker = data / ".complete"
    if marker.exists():
        return
    shutil.rmtree(data, ignore_errors=True)
    data.mkdir(parents=True)
    chunks = max(2, n // 100_000)
    sizes = [n // chunks + (1 if i < n % chunks else 0) for i in range(chunks)]
    t = time.time()
    with mp.get_context("spawn").Pool(2) as pool:
        pool.map(_gen_chunk, [(str(data), k, sizes[k], per_file, mix) for k in range(chunks)])
    marker.write_text(str(n))
    print(f"generated {n} records in {time.time() - t:.0f}s under {data}", file=sys.stderr)


def _rss_mb() -> dict[str, float]:
    # Linux reports ru_maxrss in KiB; children = the largest single worker. CPU seconds
    # (self + workers) are reported too: on a shared machine they vary less than wall time.
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"self_mb": round(me.ru_maxrss / 1024, 1), "largest_child_mb": round(kids.ru_maxrss / 1024, 1),
            "peak_rss_mb": round((me.ru_maxrss + kids.ru_maxrss) / 1024, 1),
            "cpu_s": round(me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime, 2)}


def run_capture(data: Path, state: Path, workers: int | None) -> dict:
    from settings.config import load_config
    from capture.ingest import ingest

    cfg = load_config(overrides={"state_dir": str(state)})
    t = time.perf_counter()
    res = ingest(cfg, source=str(data), workers=workers)
    dt = time.perf_counter() - t
    return {"seconds": dt, "records": res.read, "summary": res.summary(), **_rss_mb()}


def run_writer(data: Path, state: Path, warehouse: str, catalog: str, since: str, until: str,
               workers: int | None) -> dict:
    """One of several writers: ingest a window of the capture hours into the shared warehouse."""
    from capture.ingest import ingest
    from settings.config import load_config

    cfg = load_config(overrides={"state_dir": str(state), "warehouse": {"uri": warehouse, "catalog": catalog}})
    t = time.perf_counter()
    res = ingest(cfg, source=str(data), since=since, until=until, endpoint="", workers=workers)
    return {"seconds": time.perf_counter() - t, "objects": res.objects, **res.summary(), **_rss_mb()}


def _hours(data: Path) -> list[datetime]:
    """The layout hours that hold capture files, in order."""
    hours = {datetime(*map(int, p.parent.relative_to(data).parts[-4:]), tzinfo=timezone.utc)
             for p in data.rglob("*.jsonl")}
    return sorted(hours)


def run_writers(data: Path, counts: list[int], catalog: str, workers: int | None) -> list[dict]:
    """For each writer count: that many writers at once on one fresh warehouse; their rate and what they stored."""
    from capture.warehouse import Warehouse
    from settings.config import load_config

    hours = _hours(data)
    out = []
    for n in counts:
        root = Path(tempfile.mkdtemp(prefix=f"bench-writers-{n}-"))
        try:
            warehouse = str(root / "warehouse")
            cat = catalog or str(root / "catalog.ducklake")
            if catalog.startswith("postgres:"):  # one database per count: each starts empty
                cat = _new_database(catalog, f"bench_{n}_{os.getpid()}")
            # Contiguous windows of hours, each one hour into the next one's.
            cuts = [hours[round(k * len(hours) / n)] for k in range(n)] + [hours[-1] + timedelta(hours=1)]
            procs = []
            t = time.perf_counter()
            for k in range(n):
                until = min(cuts[k + 1] + timedelta(hours=1), cuts[-1])
                cmd = [sys.executable, __file__, "--child", "writer", "--data", str(data), "--warehouse", warehouse,
                       "--catalog", cat, "--since", cuts[k].isoformat(), "--until", until.isoformat(),
                       "--state", str(root / f"w{k}")] + (["--workers", str(workers)] if workers else [])
                procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                              env={**os.environ, "PYTHONPATH": str(REPO)}))
            results = []
            for p in procs:
                so, se = p.communicate()
                if p.returncode != 0:
                    sys.exit(f"a writer failed:\n{se[-3000:]}")
                results.append(json.loads(so.strip().splitlines()[-1]))
            wall = time.perf_counter() - t
            cfg = load_config(overrides={"state_dir": str(root / "reader"),
                                         "warehouse": {"uri": warehouse, "catalog": cat}})
            wh = Warehouse(cfg)
            try:
                hashes = wh.read_conversations(columns=["content_hash"]).column("content_hash")
                files = wh.sql("SELECT count(*), count(DISTINCT source_uri) FROM manifest")[0]
            finally:
                wh.close()
            tot = {k: sum(r[k] for r in results) for k in ("read", "normalized", "duplicates", "stitched",
                                                            "quarantined", "skipped", "superseded", "objects")}
            visible, distinct = len(hashes), len(set(hashes.to_pylist()))
            out.append({
                "writers": n, "seconds": round(wall, 2), "records": tot["read"],
                "records_per_s": round(tot["read"] / wall), "visible": visible, "duplicated": visible - distinct,
                "objects": tot["objects"], "manifest_files": files[0], "manifest_distinct": files[1],
                "reconciles": all(r["read"] == r["normalized"] + r["duplicates"] + r["stitched"] + r["quarantined"]
                                  + r["skipped"] for r in results) and tot["normalized"] - tot["superseded"] == visible,
                "per_writer": [{k: r[k] for k in ("seconds", "objects", "read", "normalized", "duplicates",
                                                  "peak_rss_mb")} for r in results],
            })
            print(f"[writers {n}] {json.dumps(out[-1])}", file=sys.stderr, flush=True)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    return out


def _new_database(catalog: str, name: str) -> str:
    """Create database ``name`` on the server of a ``postgres:`` catalog setting; the setting naming it."""
    import re

    import duckdb

    from capture.catalog import extension_path

    conn = re.sub(r"(^|\s)dbname=\S+", " ", catalog[len("postgres:"):]).strip()
    con = duckdb.connect(config={"autoinstall_known_extensions": False, "autoload_known_extensions": False})
    con.execute(f"LOAD '{extension_path('postgres_scanner')}'")
    con.execute(f"ATTACH '{conn} dbname=postgres' AS pg (TYPE postgres)")
    con.execute(f"CALL postgres_execute('pg', 'CREATE DATABASE {name}', use_transaction := false)")
    con.close()
    return f"postgres:{conn} dbname={name}"


def run_naive(data: Path, state: Path, limit: int | None) -> dict:
    import pandas as pd

    t = time.perf_counter()
    rows = []
    n = 0
    for p in sorted(data.rglob("*.jsonl")):
        if limit is not None and n >= limit:
            break
        with open(p, "rb") as f:
            for line in f:
                rows.append(json.loads(line))
                n += 1
    df = pd.DataFrame(rows)
    state.mkdir(parents=True, exist_ok=True)
    df.to_parquet(state / "naive.parquet")
    dt = time.perf_counter() - t
    return {"seconds": dt, "records": n, **_rss_mb()}


def run_duckdb_floor(data: Path) -> dict:
    """DuckDB's C++ JSON reader, 2 threads, over the outer capture documents only.

    Not a contender: a floor. It parses no payload, redacts, hashes and writes
    nothing, so no vectorized rewrite of the product could beat this time.
    """
    import duckdb

    side = "STRUCT(data VARCHAR, encoding VARCHAR, observedContentType VARCHAR)"
    cols = {"captureData": f"STRUCT(endpointInput {side}, endpointOutput {side})",
            "eventMetadata": "STRUCT(eventId VARCHAR, inferenceId VARCHAR, inferenceTime VARCHAR)"}
    con = duckdb.connect()
    con.execute(f"SET threads={os.cpu_count() or 1}")
    t = time.perf_counter()
    # sum(length(...)) makes DuckDB materialize both payload strings of every record
    # (a bare count(*) lets it skip the parse altogether).
    n, chars = con.execute(
        "SELECT count(*), sum(length(captureData.endpointInput.data) + length(captureData.endpointOutput.data)) "
        "FROM read_json(?, format='newline_delimited', columns=?, maximum_object_size=33554432)",
        [str(data / "**" / "*.jsonl"), cols]).fetchone()
    if not chars:
        raise RuntimeError("duckdb floor read no payload text")
    dt = time.perf_counter() - t
    return {"seconds": dt, "records": n, **_rss_mb()}


def warm_page_cache(data: Path) -> None:
    """Read every capture file once, so that it is in the page cache."""
    for p in sorted(data.rglob("*.jsonl")):
        with open(p, "rb", buffering=0) as f:
            while f.read(8 << 20):
                pass


def _median_by(key, rows: list[dict]) -> dict:
    """The row of median ``key`` (the lower middle one of an even count)."""
    return sorted(rows, key=key)[(len(rows) - 1) // 2]


def child(which: str, data: Path, workers: int | None, limit: int | None, args: argparse.Namespace) -> None:
    if which == "writer":
        print(json.dumps(run_writer(data, args.state, args.warehouse, args.catalog, args.since, args.until, workers)))
        return
    state = Path(tempfile.mkdtemp(prefix=f"bench-{which}-"))
    try:
        if which == "duckdb-floor":
            out = run_duckdb_floor(data)
        else:
            out = run_capture(data, state, workers) if which == "capture" else run_naive(data, state, limit)
    finally:
        shutil.rmtree(state, ignore_errors=True)
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=100_000, help="synthetic records (README figure: 1000000)")
    ap.add_argument("--per-file", type=int, default=5_000, help="records per capture file")
    ap.add_argument("--workers", type=int, default=None, help="ingest worker processes (default: config, 2)")
    ap.add_argument("--data", type=Path, default=None, help="where generated capture files are cached")
    ap.add_argument("--mix", choices=("exchange", "plain"), default="exchange",
                    help="synthetic traffic: with reasoning and tool calls (capture.synth.DEFAULT_MIX), or without")
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--naive-n", type=int, default=None,
                    help="records the naive baseline reads (default: all that fit in half the available memory; "
                         "it holds every parsed record, ~8 KB each)")
    ap.add_argument("--no-floor", action="store_true", help="skip the DuckDB outer-parse floor")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the contenders this many times, back to back per round; report medians (README: 3)")
    ap.add_argument("--writers", type=int, nargs="+", default=None,
                    help="measure this many writers at once on one warehouse, for each count given (e.g. 1 2 4)")
    ap.add_argument("--catalog", default="",
                    help="with --writers: a postgres:... setting (a database is made there per count) "
                         "(default: a local catalog file per count)")
    ap.add_argument("--child", choices=("capture", "naive", "duckdb-floor", "writer"), help=argparse.SUPPRESS)
    for hidden in ("--warehouse", "--since", "--until"):
        ap.add_argument(hidden, default="", help=argparse.SUPPRESS)
    ap.add_argument("--state", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    data = args.data or Path(tempfile.gettempdir()) / "drafter-adapt-bench" / f"ingest-{args.n}-{args.per_file}-{args.mix}"
    if args.child:
        child(args.child, data, args.workers, args.naive_n, args)
        return

    generate(data, args.n, args.per_file, args.mix)
    if args.writers:
        writers_main(args, data)
        return
    size = sum(p.stat().st_size for p in data.rglob("*.jsonl"))
    naive_n = args.naive_n or min(args.n, int(available_bytes(8 << 30) * 0.5 / 8192))
    contenders = ("capture",) + (() if args.no_baseline else ("naive",)) + (() if args.no_floor else ("duckdb-floor",))
    rounds: list[dict[str, dict]] = []
    for i in range(args.rounds):
        # Every contender reads the same files; read them once first so that none of them pays
        # for the disk (this VM's kernel pages out file cache left unread for about a minute).
        warm_page_cache(data)
        this = {}
        for which in contenders:
            cmd = [sys.executable, __file__, "--child", which, "--n", str(args.n), "--per-file", str(args.per_file),
                   "--data", str(data), "--naive-n", str(naive_n)] + (["--workers", str(args.workers)] if args.workers else [])
            proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
            if proc.returncode != 0:
                sys.exit(f"{which} failed:\n{proc.stderr[-3000:]}")
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            r["records_per_s"] = round(r["records"] / r["seconds"])
            r["seconds"] = round(r["seconds"], 2)
            this[which] = r
            print(f"[round {i + 1} {which}] {json.dumps(r)}", file=sys.stderr, flush=True)
        rounds.append(this)
    # Each contender's median round (by time) stands for it; the ratios are the medians of the
    # per-round ratios, each of two runs made back to back (this machine's speed drifts).
    results = {which: _median_by(lambda r: r["seconds"], [rd[which] for rd in rounds]) for which in contenders}
    out = {"n": args.n, "input_mb": round(size / 2**20, 1), "cpus": os.cpu_count(), **results}
    if "naive" in results:
        # Rates, not times: the naive baseline may have read fewer records (memory).
        speedups = [rd["capture"]["records_per_s"] / rd["naive"]["records_per_s"] for rd in rounds]
        cpu_ratios = [(rd["naive"]["cpu_s"] / rd["naive"]["records"]) / (rd["capture"]["cpu_s"] / rd["capture"]["records"])
                      for rd in rounds]
        out["speedup_vs_naive"] = round(statistics.median(speedups), 2)
        out["speedup_per_round"] = [round(x, 2) for x in speedups]
        out["cpu_ratio_vs_naive"] = round(statistics.median(cpu_ratios), 2)
        if "duckdb-floor" in results:
            out["floor_speedup_vs_naive"] = round(statistics.median(
                [rd["duckdb-floor"]["records_per_s"] / rd["naive"]["records_per_s"] for rd in rounds]), 2)
    if args.json:
        print(json.dumps(out))
        return
    print(f"{args.n} records, {out['input_mb']} MiB of capture JSONL, {out['cpus']} CPUs"
          + (f", median of {args.rounds} rounds" if args.rounds > 1 else ""))
    for which, r in results.items():
        print(f"  {which:8s} {r['records']:>9,d} rec {r['seconds']:8.2f} s  {r['records_per_s']:>9,d} records/s  {r['cpu_s']:7.1f} CPU-s  "
              f"peak RSS {r['peak_rss_mb']:6.0f} MB (main {r['self_mb']:.0f}, largest worker {r['largest_child_mb']:.0f})")
    if "speedup_vs_naive" in out:
        print(f"  capture is {out['speedup_vs_naive']}x the naive baseline in records/s "
              f"({out['cpu_ratio_vs_naive']}x in CPU time per record)"
              + (f"; per round: {', '.join(f'{x}x' for x in out['speedup_per_round'])}" if args.rounds > 1 else ""))
    if "floor_speedup_vs_naive" in out:
        print(f"  duckdb-floor (C++ read_json of the outer documents only, nothing else) is "
              f"{out['floor_speedup_vs_naive']}x the naive baseline: the ceiling of a vectorized rewrite here")
    if "summary" in results["capture"]:
        print("  capture counts:", json.dumps(results["capture"]["summary"]))


def writers_main(args: argparse.Namespace, data: Path) -> None:
    catalog = args.catalog
    warm_page_cache(data)
    rows = run_writers(data, args.writers, catalog, args.workers)
    where = "PostgreSQL" if catalog.startswith("postgres:") else "a local file"
    out = {"n": args.n, "cpus": os.cpu_count(), "catalog": where, "writers": rows}
    if args.json:
        print(json.dumps(out))
        return
    print(f"{args.n} records, {out['cpus']} CPUs, catalog in {where}")
    for r in rows:
        ok = r["duplicated"] == 0 and r["visible"] == rows[0]["visible"] and r["reconciles"] and r["records"] == args.n
        print(f"  {r['writers']} writer(s): {r['seconds']:7.2f} s  {r['records_per_s']:>9,d} records/s  "
              f"{r['visible']:,d} conversations visible, {r['visible'] - rows[0]['visible']:+d} vs one writer, "
              f"{r['duplicated']} duplicated, counts {'reconcile' if r['reconciles'] else 'DO NOT reconcile'}, "
              f"{r['manifest_files']} files committed once each: {r['manifest_files'] == r['manifest_distinct']}"
              f"  {'OK' if ok else 'FAILED'}")


if __name__ == "__main__":
    main()
