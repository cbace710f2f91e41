"""The typed bench result: one layout on disk, read back the same; schema-2 files still load."""

from __future__ import annotations

import json

import pytest

from evaluation.result import SCHEMA_VERSION, BenchResult, HeadRef, analyze
from evaluation.stats import CANDIDATE, CONTROL, LIVE, NOSPEC
from tests.bench_sim import CONCS, simulate, slots_for
from tests.paths import REPO_ROOT

SCHEMA2 = REPO_ROOT / "tests" / "data" / "bench-schema2.json"


def _result():
    arms = [CANDIDATE, LIVE, CONTROL, NOSPEC]
    res = analyze(simulate(slots_for(arms=arms), {CANDIDATE: 1.2, LIVE: 1.0, CONTROL: 1.0, NOSPEC: 1.1}, load=0.1),
                  arms, CONCS, 0.9)
    res.heads = {"candidate": HeadRef("/h/c", "c" * 64, "2"), "live": HeadRef("/h/l", "l" * 64, "1")}
    res.prompts_at = {1: 24, 4: 32}
    return res


def test_a_result_survives_its_json(tmp_path):
    res = _result()
    back = BenchResult.load(res.write(tmp_path / "bench.json"))
    assert back.to_json() == json.loads(json.dumps(res.to_json(), default=str))
    assert back.schema_version == SCHEMA_VERSION == 3
    assert sorted(back.arms[CANDIDATE].by_concurrency) == [1, 4]  # integer keys, one spelling
    on_disk = json.loads((tmp_path / "bench.json").read_text())
    assert list(on_disk["arms"][CANDIDATE]["by_concurrency"]) == ["1", "4"]
    assert list(on_disk["differences"]["by_concurrency"]) == ["1", "4"]
    assert back.differences.tok_per_s(4).estimate == res.differences.tok_per_s(4).estimate
    assert back.prompts_at == {1: 24, 4: 32} and on_disk["prompts_at"] == {"1": 24, "4": 32}


def test_metrics_and_headline_come_from_the_result():
    res = _result()
    m = res.metrics()
    assert m["replay.candidate.mean_acceptance_length"] == pytest.approx(1.8)
    assert m["replay.live.c4.output_tok_per_s"] == res.tok_per_s(LIVE, 4)
    assert m["delta.c1.output_tok_per_s.ci_low"] == res.differences.tok_per_s(1).lo
    assert m["aa.mean_acceptance_length.estimate"] == 0.0 and "speedup_vs_nospec.c4.candidate.estimate" in m
    h = res.headline()
    assert h["delta_output_tok_per_s"]["4"]["aa"]["clusters"] == 6 and h["candidate"]["sha256"] == "c" * 12


def test_a_schema2_file_written_before_the_typed_result_still_loads():
    """tests/data/bench-schema2.json was written by the schema-2 code: its figures, intervals and heads read
    back, concurrencies keyed by integers, and its clusters rebuilt from the per-request records."""
    raw = json.loads(SCHEMA2.read_text())
    assert raw["schema_version"] == 2 and "c1" in raw["differences"] and "per_head" in raw
    res = BenchResult.load(SCHEMA2)
    assert res.schema_version == 2 and res.concurrencies == [1, 2] and res.rounds == 2
    assert res.roles == [CANDIDATE, LIVE, CONTROL, NOSPEC]
    assert res.tok_per_s(CANDIDATE, 2) == raw["per_head"]["candidate"]["by_concurrency"]["2"]["output_tok_per_s"]
    assert res.arms[CANDIDATE].mean_acceptance_length == pytest.approx(1.6)
    assert res.differences.tok_per_s(1).ci == raw["differences"]["c1"]["output_tok_per_s"]["ci"]
    assert res.aa_control.mean_acceptance_length.estimate == 0.0
    assert res.speedup() == {c: round(raw["speedup_vs_nospec"][f"c{c}"]["candidate"]["estimate"], 4) for c in (1, 2)}
    assert res.heads["candidate"].version == "2" and res.heldout_overlap["repeats_training"] == 2
    # The clusters, rebuilt from the records: 8 prompts in groups of 4 at c=1, 4 at c=2, both rounds merged.
    assert [(c.concurrency, c.prompts, c.rounds) for c in res.clusters] == [
        (1, [0, 1, 2, 3], 2), (1, [4, 5, 6, 7], 2), (2, [0, 1, 2, 3], 2), (2, [4, 5, 6, 7], 2)]
    assert res.clusters[0].arms[CANDIDATE].requests == 8 and res.clusters[0].arms[CANDIDATE].drafts > 0
    # ...so the gate can judge an old file too (two groups: too few for a verdict).
    from loop.gate import INCONCLUSIVE, decide
    from settings.config import GateConfig

    v = decide(res, GateConfig())
    assert v.status == INCONCLUSIVE and "2 prompt groups measured, the gate needs 6" in v.reason
    assert res.metrics()["delta.c1.output_tok_per_s.estimate"] == raw["differences"]["c1"]["output_tok_per_s"]["estimate"]


def test_a_file_of_another_schema_or_not_json_is_refused_clearly(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"schema_version": 99}))
    with pytest.raises(ValueError, match="schema 99"):
        BenchResult.load(tmp_path / "a.json")
    (tmp_path / "b.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a bench result"):
        BenchResult.load(tmp_path / "b.json")
