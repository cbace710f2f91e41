"""Conversation stitching (capture.stitch): each multi-turn conversation is kept once, at its longest.

Chains are capture records as the router writes them (capture.records.make_capture_record: the request
carries the whole history, the response the new answer), plus real SageMaker records from the shared
fixtures extended into chains. Every case checks that the counts reconcile and that a re-run is a no-op.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import random
import subprocess
import sys
from datetime import timedelta

import pyarrow as pa
import pytest

from capture import backend, stitch
from capture import ingest as ingest_mod
from capture.ingest import content_hash, ingest, process_file
from capture.split import export, load_split, split_table, stats
from capture.warehouse import TURN
from tests.capture_support import (T0, catalog_rows, chain, layout_file, obj_of, reconciles, record,
                                   same_file_result, write)
from tests.config_support import make_cfg
from tests.paths import DATACAPTURE


def rows(cfg) -> list[dict]:
    return load_split(cfg, "train", heldout_hours=0)


def shapes(cfg) -> list[tuple[str, ...]]:
    """Each stored conversation's user turns, sorted: which conversations (and how long) the warehouse holds."""
    return sorted(tuple(t["value"] for t in r["conversations"] if t["from"] == "human") for r in rows(cfg))


def catalog(cfg, sql: str) -> list[tuple]:
    return catalog_rows(cfg, sql)


def run(cfg, src, **kw):
    res = ingest(cfg, source=str(src), **kw)
    assert reconciles(res), res.summary()
    return res


def counts(res) -> tuple[int, int, int, int]:
    return res.normalized, res.duplicates, res.stitched, res.superseded


def no_op_again(cfg, src) -> None:
    before = shapes(cfg)
    again = run(cfg, src)
    assert (again.read, again.normalized, again.superseded) == (0, 0, 0)
    assert shapes(cfg) == before


Q = [f"c question {k}" for k in range(3)]


# -- where the chain arrives ------------------------------------------------------------------

def test_within_one_file_only_the_longest_is_kept(tmp_path):
    cfg, src = make_cfg(tmp_path), tmp_path / "cap"
    layout_file(src, T0, "a.jsonl", chain("c", 3))
    res = run(cfg, src)
    assert (res.read, *counts(res)) == (3, 1, 0, 2, 0)
    (row,) = rows(cfg)
    assert [t["from"] for t in row["conversations"]] == ["system", "human", "gpt"] * 1 + ["human", "gpt"] * 2
    assert row["event_id"] == "c-2" and row["inference_time"] == T0 + timedelta(minutes=2)
    # Per file, the manifest counts them too.
    assert catalog(cfg, "SELECT normalized, duplicates, stitched FROM manifest") == [(1, 0, 2)]
    assert catalog(cfg, "SELECT normalized, stitched, superseded FROM runs") == [(1, 2, 0)]
    # The prefix hashes of the stored row are catalogued (two assistant turns before its last).
    assert catalog(cfg, "SELECT count(*), count(DISTINCT content_hash) FROM prefix_hashes") == [(2, 1)]
    no_op_again(cfg, src)


@pytest.mark.parametrize("workers", [1, 2])
def test_across_files_of_one_run(tmp_path, workers):
    cfg, src = make_cfg(tmp_path), tmp_path / "cap"
    for k, line in enumerate(chain("c", 3, step=timedelta(hours=1))):
        layout_file(src, T0 + timedelta(hours=k), f"{k}.jsonl", [line])
    res = run(cfg, src, workers=workers)
    assert (res.read, *counts(res)) == (3, 1, 0, 2, 0)
    assert shapes(cfg) == [tuple(Q)]
    # The prefixes were dropped before they were written: no part, hash or superseded entry names them.
    assert catalog(cfg, 'SELECT sum("rows") FROM parquet_files') == [(1,)]
    assert catalog(cfg, "SELECT count(*) FROM content_hashes") == [(1,)]
    assert catalog(cfg, "SELECT count(*) FROM superseded") == [(0,)]
    # The manifest keeps each file's counts as decided when it was read; the run's totals move them.
    assert catalog(cfg, "SELECT sum(normalized), sum(stitched) FROM manifest") == [(3, 0)]
    assert catalog(cfg, "SELECT normalized, stitched FROM runs") == [(1, 2)]
    no_op_again(cfg, src)


def test_prefix_written_before_its_extension_arrives_in_the_same_run(tmp_path, monkeypatch):
    """A checkpoint after every file: the first turns are written and committed before the last arrives."""
    monkeypatch.setattr(ingest_mod, "CHECKPOINT_BYTES", 0)
    cfg, src = make_cfg(tmp_path), tmp_path / "cap"
    for k, line in enumerate(chain("c", 3, step=timedelta(hours=1))):
        layout_file(src, T0 + timedelta(hours=k), f"{k}.jsonl", [line])
    res = run(cfg, src)
    assert (res.read, *counts(res)) == (3, 1, 0, 2, 0)
    assert shapes(cfg) == [tuple(Q)]
    assert catalog(cfg, 'SELECT sum("rows") FROM parquet_files') == [(3,)]  # parts are never rewritten ...
    assert catalog(cfg, "SELECT count(*) FROM superseded") == [(2,)]  # ... the catalog hides the prefixes
    assert len(rows(cfg)) == 1
    no_op_again(cfg, src)


def test_across_runs_prefix_first_then_extension(tmp_path):
    cfg, src = make_cfg(tmp_path), tmp_path / "cap"
    lines = chain("c", 3, step=timedelta(hours=1))
    layout_file(src, T0, "0.jsonl", lines[:2])
    first = run(cfg, src)
    assert counts(first) == (1, 0, 1, 0) and shapes(cfg) == [tuple(Q[:2])]
    layout_file(src, T0 + timedelta(hours=2), "1.jsonl", lines[2:])
    second = run(cfg, src)
    assert (second.read, *counts(second)) == (1, 1, 0, 0, 1)
    assert shapes(cfg) == [tuple(Q)]
    gone = catalog(cfg, "SELECT s.content_hash, s.by_hash, s.run_id FROM superseded s")
    assert len(gone) == 1 and gone[0][2] == second.run_id
    assert gone[0][1] == rows(cfg)[0]["content_hash"]
    # Every reader leaves the superseded row out: split, export, stats.
    assert split_table(cfg).num_rows == 1
    assert export(cfg, "heldout", tmp_path / "h.jsonl") + export(cfg, "train", tmp_path / "t.jsonl") == 1
    st = stats(cfg)
    assert st["conversations"] == 1 and (st["stitched"], st["superseded"]) == (1, 1)
    no_op_again(cfg, src)


def test_across_runs_extension_first_then_prefix(tmp_path):
    cfg, src = make_cfg(tmp_path), tmp_path / "cap"
    lines = chain("c", 3, step=timedelta(hours=1))
    layout_file(src, T0 + timedelta(hours=2), "1.jsonl", lines[2:])
    first = run(cfg, src)
    assert counts(first) == (1, 0, 0, 0)
    layout_file(src, T0, "0.jsonl", lines[:2])
    second = run(cfg, src)
    assert (second.read, *counts(second)) == (2, 0, 0, 2, 0)
    assert shapes(cfg) == [tuple(Q)]
    assert catalog(cfg, "SELECT count(*) FROM superseded") == [(0,)]
    no_op_again(cfg, src)


# -- adversarial chains -------------------------------------------------------------------------

ORDERINGS = list(itertools.permutations(range(3)))


def branching(conv: str = "c") -> list[str]:
    """A shared first turn, then two different second turns (a regenerated or forked chat)."""
    a = chain(conv, 2)
    b = chain(conv, 2, edit={1: f"{conv} another question 1"})
    assert a[0] == b[0]
    return [a[0], a[1], b[1]]


@pytest.mark.parametrize("order", ORDERINGS)
def test_branching_keeps_both_leaves_in_any_order(tmp_path, order):
    lines = branching()
    want = sorted([(Q[0], Q[1]), (Q[0], "c another question 1")])
    # All in one file, in this order.
    cfg, src = make_cfg(tmp_path / "file"), tmp_path / "file" / "cap"
    layout_file(src, T0, "a.jsonl", [lines[i] for i in order])
    res = run(cfg, src)
    assert counts(res) == (2, 0, 1, 0) and shapes(cfg) == want
    no_op_again(cfg, src)
    # One run per record, in this order.
    cfg, src = make_cfg(tmp_path / "runs"), tmp_path / "runs" / "cap"
    total = []
    for k, i in enumerate(order):
        layout_file(src, T0 + timedelta(hours=k), f"{k}.jsonl", [lines[i]])
        total.append(counts(run(cfg, src)))
    assert shapes(cfg) == want
    normalized, _, stitched, superseded = map(sum, zip(*total))
    assert normalized - superseded == 2 and stitched + superseded == 1  # the shared turn, once
    no_op_again(cfg, src)


def test_edited_history_is_another_conversation(tmp_path):
    cfg, src = make_cfg(tmp_path), tmp_path / "cap"
    original = chain("c", 1)
    edited = chain("c", 2, edit={0: "c question 0, reworded"})  # turn 1 edited, then continued
    layout_file(src, T0, "a.jsonl", original + edited[1:])
    res = run(cfg, src)
    assert counts(res) == (2, 0, 0, 0)
    assert shapes(cfg) == sorted([(Q[0],), ("c question 0, reworded", Q[1])])
    # An edited system prompt, or an edited answer, is another conversation as well.
    layout_file(src, T0, "b.jsonl", chain("c", 2, system="Be verbose.")[1:])
    assert counts(run(cfg, src)) == (1, 0, 0, 0)
    other_answer = record([("system", "Be brief."), ("user", Q[0]), ("assistant", "c ANSWER 0"), ("user", Q[1])],
                          "c answer 1", T0, "x")
    layout_file(src, T0, "c.jsonl", [other_answer])
    assert counts(run(cfg, src)) == (1, 0, 0, 0)
    assert len(rows(cfg)) == 4
    no_op_again(cfg, src)


def test_a_duplicate_is_still_a_duplicate(tmp_path):
    cfg, src = make_cfg(tmp_path), tmp_path / "cap"
    lines = chain("c", 2)
    replay = json.loads(lines[1])
    replay["eventMetadata"]["eventId"] = "replayed"  # the same exchange served again
    layout_file(src, T0, "a.jsonl", [lines[1], json.dumps(replay), lines[0]])
    res = run(cfg, src)
    assert (res.read, *counts(res)) == (3, 1, 1, 1, 0)
    # The longest row replayed in a later run: a duplicate, not stitched (no proper prefix).
    layout_file(src, T0 + timedelta(hours=1), "b.jsonl", [json.dumps(replay)])
    assert counts(run(cfg, src)) == (0, 1, 0, 0)
    # The prefix replayed in a later run: stitched.
    layout_file(src, T0 + timedelta(hours=2), "c.jsonl", [lines[0]])
    assert counts(run(cfg, src)) == (0, 0, 1, 0)
    assert shapes(cfg) == [tuple(Q[:2])]
    no_op_again(cfg, src)


def test_a_stored_row_replayed_beside_its_extension(tmp_path):
    """Turn 1 stored; then a file with turn 1 again and turn 2: the stored row is superseded, counted once."""
    cfg, src = make_cfg(tmp_path), tmp_path / "cap"
    lines = chain("c", 2)
    layout_file(src, T0, "a.jsonl", lines[:1])
    assert counts(run(cfg, src)) == (1, 0, 0, 0)
    layout_file(src, T0 + timedelta(hours=1), "b.jsonl", [lines[0], lines[1], lines[0]])
    res = run(cfg, src)
    assert (res.read, *counts(res)) == (3, 1, 1, 1, 1)
    assert shapes(cfg) == [tuple(Q[:2])]
    no_op_again(cfg, src)


@pytest.mark.parametrize("order", ORDERINGS)
def test_reordered_arrival_in_one_file(tmp_path, order):
    cfg, src = make_cfg(tmp_path), tmp_path / "cap"
    lines = chain("c", 3)
    other = chain("d", 2)  # an unrelated conversation interleaved
    layout_file(src, T0, "a.jsonl", [other[0]] + [lines[i] for i in order] + [other[1]])
    res = run(cfg, src)
    assert (res.read, *counts(res)) == (5, 2, 0, 3, 0)
    assert shapes(cfg) == sorted([tuple(Q), ("d question 0", "d question 1")])
    no_op_again(cfg, src)


def test_many_interleaved_chains_across_files_and_runs_match_one_big_file(tmp_path):
    """Twenty conversations of up to six turns, their records shuffled over files and runs: the same warehouse
    as when all of them arrive in one file."""
    rng = random.Random(3)
    lines = [line for c in range(20) for line in chain(f"c{c}", rng.randint(1, 6), step=timedelta(minutes=7))]
    ref_cfg, ref_src = make_cfg(tmp_path / "ref"), tmp_path / "ref" / "cap"
    layout_file(ref_src, T0, "all.jsonl", lines)
    ref = run(ref_cfg, ref_src)
    assert ref.normalized == 20 and ref.stitched == len(lines) - 20
    rng.shuffle(lines)
    cfg, src = make_cfg(tmp_path / "mixed"), tmp_path / "mixed" / "cap"
    live = 0
    for r in range(4):
        part = lines[r::4]
        for f in range(3):
            layout_file(src, T0 + timedelta(hours=r), f"{r}-{f}.jsonl", part[f::3])
        res = run(cfg, src)
        live += res.normalized - res.superseded
    assert shapes(cfg) == shapes(ref_cfg) and live == 20
    no_op_again(cfg, src)


# -- the time split ---------------------------------------------------------------------------------

@pytest.mark.parametrize("runs", ["one", "prefix-first", "extension-first"])
def test_split_never_divides_a_conversation(tmp_path, runs):
    """Turns 1-2 before the held-out cut, turn 3 after it: only the 3-turn row exists, held out."""
    cfg, src = make_cfg(tmp_path, capture={"heldout_hours": 2}), tmp_path / "cap"
    t3 = T0 + timedelta(hours=5)
    lines = [record([("user", Q[0])], "c answer 0", T0, "c-0"),
             record([("user", Q[0]), ("assistant", "c answer 0"), ("user", Q[1])], "c answer 1",
                    T0 + timedelta(hours=1), "c-1"),
             record([("user", Q[0]), ("assistant", "c answer 0"), ("user", Q[1]), ("assistant", "c answer 1"),
                     ("user", Q[2])], "c answer 2", t3, "c-2")]
    other = record([("user", "unrelated")], "yes", T0 + timedelta(minutes=30), "d")
    batches = {"one": [lines + [other]], "prefix-first": [lines[:2] + [other], lines[2:]],
               "extension-first": [lines[2:], lines[:2] + [other]]}[runs]
    for k, batch in enumerate(batches):
        layout_file(src, T0 + timedelta(hours=k), f"{k}.jsonl", batch)
        run(cfg, src)
    t = split_table(cfg)
    got = sorted((len(c), s) for c, s in zip(t.column("conversations").to_pylist(), t.column("split").to_pylist()))
    assert got == [(2, "train"), (6, "heldout")]
    (held,) = load_split(cfg, "heldout")
    assert held["inference_time"] == t3 and held["event_id"] == "c-2"
    assert [r["event_id"] for r in load_split(cfg, "train")] == ["d"]
    no_op_again(cfg, src)


# -- real capture records -------------------------------------------------------------------------------

def real_chain() -> tuple[list[str], list[tuple[str, str]]]:
    """The three real JumpStart records of the fixture, made one chat: record k asks prompt k with the first k
    exchanges as history. Each keeps its real metadata, parameters and answer; the request becomes the JumpStart
    chat shape (``{"inputs": [[messages]]}``) and the response BASE64 ``[{"generation": ...}]``, as
    llm-capture.schema.json describes them."""
    real = [json.loads(line) for line in (DATACAPTURE / "llm-jumpstart-llama31.jsonl").read_text().splitlines()]
    exchanges = []
    for rec in real:
        req = json.loads(rec["captureData"]["endpointInput"]["data"])
        resp = json.loads(rec["captureData"]["endpointOutput"]["data"])
        exchanges.append((req["inputs"], resp["generated_text"]))
    out, history = [], []
    for rec, (prompt, answer) in zip(real, exchanges):
        history.append({"role": "user", "content": prompt})
        req = json.loads(rec["captureData"]["endpointInput"]["data"])
        req["inputs"] = [list(history)]
        rec["captureData"]["endpointInput"]["data"] = json.dumps(req)
        body = json.dumps([{"generation": {"role": "assistant", "content": answer}}]).encode()
        rec["captureData"]["endpointOutput"].update(data=base64.b64encode(body).decode(), encoding="BASE64",
                                                    observedContentType=None)
        out.append(json.dumps(rec))
        history.append({"role": "assistant", "content": answer})
    return out, exchanges


def test_real_records_extended_into_a_chain(tmp_path):
    lines, exchanges = real_chain()
    cfg, src = make_cfg(tmp_path), tmp_path / "cap"
    # The real single-turn records first: three conversations.
    layout_file(src, T0, "real.jsonl", [ln.rstrip("\n") for ln in
                                        (DATACAPTURE / "llm-jumpstart-llama31.jsonl").read_text().splitlines()])
    first = run(cfg, src)
    assert counts(first) == (3, 0, 0, 0)
    # Then the chain, its records in reverse: the first real exchange is the chain's first turn, so the row the
    # first run stored is a prefix of the chain and is superseded; the other two real rows stay (another start).
    layout_file(src, T0 + timedelta(hours=1), "chain.jsonl", lines[::-1])
    second = run(cfg, src)
    assert (second.read, *counts(second)) == (3, 1, 0, 2, 1)
    got = shapes(cfg)
    prompts = [p for p, _ in exchanges]
    assert got == sorted([tuple(prompts), (prompts[1],), (prompts[2],)])
    (longest,) = [r for r in rows(cfg) if len(r["conversations"]) == 6]
    assert [t["value"] for t in longest["conversations"]] == [v for pair in exchanges for v in pair]
    assert longest["format"] == "jumpstart_chat" and longest["event_id"] == "4d403029-158f-47f3-ba2f-614f7a678e33"
    no_op_again(cfg, src)


# -- native decoder and Python fallback ----------------------------------------------------------------

def test_native_and_python_fallback_stitch_alike(tmp_path):
    lines = chain("c", 4) + branching("b") + chain("e", 3, edit={0: "é 😀 edited"}) + real_chain()[0]
    lines += [lines[1], lines[0]]  # in-file replays of prefixes
    path = write(tmp_path / "f.jsonl", lines)
    same_file_result(obj_of(path))
    fr = process_file(obj_of(path), ingest_mod.FileOptions())
    assert fr.file_stitched == 8 and fr.file_duplicates == 2 and fr.table.num_rows == len(lines) - 10 == 5
    results = []
    for fallback in (False, True):
        cfg, src = make_cfg(tmp_path / str(fallback)), tmp_path / str(fallback) / "cap"
        half = len(lines) // 2
        layout_file(src, T0, "0.jsonl", lines[half:])
        layout_file(src, T0 + timedelta(hours=1), "1.jsonl", lines[:half])
        with backend.python_fallback() if fallback else contextlib.nullcontext():
            res = [run(cfg, src), run(cfg, src)]
        results.append(([r.summary() | {"run_id": None} for r in res], shapes(cfg),
                        catalog(cfg, "SELECT prefix_hash, content_hash FROM prefix_hashes ORDER BY ALL"),
                        catalog(cfg, "SELECT content_hash, by_hash FROM superseded ORDER BY ALL")))
    assert results[0] == results[1]


def test_no_pandas_import_when_stitching(tmp_path):
    """Stitching runs in the workers and the parent, which never import pandas (see test_capture_native)."""
    src = tmp_path / "cap"
    lines = chain("c", 3, step=timedelta(hours=1))
    layout_file(src, T0, "0.jsonl", [lines[1], lines[0]] + branching("b"))
    layout_file(src, T0 + timedelta(hours=1), "1.jsonl", [lines[2]])
    layout_file(src, T0 + timedelta(hours=2), "2.jsonl", chain("d", 1))
    code = ("import sys\nfrom pathlib import Path\nfrom settings.config import load_config\n"
            "from capture import ingest as m\nfrom capture.records import make_capture_record\n"
            f"cfg = load_config(overrides={{'state_dir': {str(tmp_path / 'state')!r}}})\n"
            f"r = m.ingest(cfg, source={str(src)!r}, endpoint='', workers=1)\n"
            "assert (r.normalized, r.stitched) == (4, 3), r\n"
            f"Path({str(src)!r}, 'ep/AllTraffic/2025/05/01/12/3.jsonl').write_text({chain('d', 2)[1]!r} + '\\n')\n"
            f"r = m.ingest(cfg, source={str(src)!r}, endpoint='', workers=1)\n"
            "assert (r.normalized, r.superseded) == (1, 1), r\n"
            "assert 'pandas' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


# -- the pieces --------------------------------------------------------------------------------------------

def test_prefix_hashes_are_content_hashes_of_the_turns_up_to_each_inner_assistant_turn():
    rng = random.Random(4)
    speakers = ["system", "human", "gpt"]
    texts = ["", "a", "é😀", "x" * 300, "gpt", "中文\u2028"]
    convs = [[(rng.choice(speakers), rng.choice(texts)) for _ in range(rng.randrange(0, 9))] for _ in range(400)]
    want_rows, want = [], []
    for r, turns in enumerate(convs):
        for k in range(1, len(turns)):
            if turns[k - 1][0] == "gpt":
                want_rows.append(r)
                want.append(content_hash(turns[:k]))
    # Sliced, as a table's chunk may be.
    arr = pa.array([[]] + [[{"from": f, "value": v} for f, v in t] for t in convs], pa.list_(TURN)).slice(1)
    table = pa.table({"conversations": arr})
    got = stitch.table_prefixes(table)
    assert got.hashes.to_pylist() == want and got.rows.tolist() == want_rows
    with backend.python_fallback():
        assert stitch.table_prefixes(table).hashes.to_pylist() == want
    empty = stitch.table_prefixes(table.slice(0, 0))
    assert len(empty) == 0
