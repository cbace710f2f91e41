"""Cycle state machinery without services: ordering, resume, skip, metrics/params flattening."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loop import cycle, tracking
from tests.bench_sim import simulated_bench
from tests.config_support import make_cfg


@pytest.fixture
def cfg(tmp_path: Path):
    return make_cfg(tmp_path)


def test_steps_run_in_order_once_and_resume(cfg, monkeypatch):
    calls = []

    def fake(name):
        def f(c, state, opts):
            calls.append(name)
            if name == "train" and calls.count("train") == 1:
                raise RuntimeError("killed")
            return {"step": name, "seen": sorted(state["steps"])}
        return f

    monkeypatch.setattr(cycle, "STEP_FUNCS", {s: fake(s) for s in cycle.STEPS})
    with pytest.raises(cycle.CycleError, match="needs"):
        cycle.run_step(cfg, "c1", "bench")
    with pytest.raises(RuntimeError, match="killed"):
        cycle.run_cycle(cfg, "c1")
    assert cycle.latest_unfinished(cfg) == "c1"
    assert list(cycle.load_state(cfg, "c1")["steps"]) == ["ingest", "snapshot", "base"]
    out = cycle.run_cycle(cfg)  # no id: resumes the unfinished cycle
    assert out["cycle_id"] == "c1" and out["complete"]
    # Each step ran once except the one that crashed.
    assert calls == ["ingest", "snapshot", "base", "train", *cycle.STEPS[3:]]
    assert cycle.latest_unfinished(cfg) is None
    cycle.run_cycle(cfg, "c1")
    assert calls.count("promote") == 1  # a finished cycle is a no-op
    with pytest.raises(ValueError):
        cycle.cycle_dir(cfg, "../escape")


def test_metrics_and_params_name_every_figure(cfg, tmp_path: Path):
    from evaluation.result import HeadRef, analyze
    from tests.bench_sim import simulate, slots_for

    arms = ["candidate", "live", "control", "nospec"]
    bench = analyze(simulate(slots_for(arms=arms), {"candidate": 1.3, "live": 0.9, "control": 0.9, "nospec": 1.0}),
                    arms, [1, 4], 0.9)
    bench.heads = {"candidate": HeadRef("c", "c" * 64), "live": HeadRef("l", "l" * 64)}
    bench.write(tmp_path / "bench.json")
    state = {"cycle_id": "c9", "steps": {
        "snapshot": {"train": {"id": "a" * 64, "rows": 10}, "heldout": {"id": "b" * 64, "rows": 3},
                     "heldout_overlap": {"heldout": 3, "repeats_training": 1}},
        "base": {"parent_version": "4", "parent_sha256": "p", "live_version": "4", "live_sha256": "p"},
        "train": {"steps": 3, "tokens": 100, "tokens_per_s": 9.0, "final_depth_loss": [1.0, 2.0],
                  "final_depth_acc": [0.5, 0.25], "head_sha256": "h"},
        "evaluate": {"candidate": {"acceptance_rate_per_pos": [0.7, 0.5], "mean_acceptance_length": 2.2,
                                   "per_prompt": [[10, 12], [8, 9]]},
                     "live": {"acceptance_rate_per_pos": [0.6, 0.4], "mean_acceptance_length": 2.0,
                              "per_prompt": [[10, 10], [8, 8]]},
                     "check": {"estimate": 0.2, "ci": [0.1, 0.3], "status": "inconclusive"}, "json_path": "x"},
        "bench": {"json_path": str(tmp_path / "bench.json"), "attempts": [{"attempt": 1}, {"attempt": 2}]},
        "gate": {"passed": True},
    }}
    m = tracking.run_metrics(state)
    assert m["replay.candidate.mean_acceptance_length"] == pytest.approx(1.8)
    assert m["replay.live.c1.ttft_ms"] == bench.arms["live"].by_concurrency[1].ttft_ms
    assert m["replay.candidate.acceptance_per_pos_pos1"] == pytest.approx(0.2)
    assert m["delta.mean_acceptance_length.ci_low"] == pytest.approx(0.3)
    assert m["delta.c4.output_tok_per_s.ci_high"] == bench.differences.tok_per_s(4).hi
    assert m["offline.candidate.acceptance_rate_per_pos_pos0"] == 0.7 and m["train.final_depth_acc_pos1"] == 0.25
    assert m["offline.live.mean_acceptance_length"] == 2.0 and m["offline.difference.ci_pos1"] == 0.3
    assert not any("per_prompt" in k for k in m)  # per-prompt counts stay in offline_eval.json
    assert m["gate.passed"] == 1.0
    assert m["aa.c1.output_tok_per_s.ci_high"] == bench.aa_control.tok_per_s(1).hi
    assert m["aa.mean_acceptance_length.estimate"] == 0.0
    assert m["speedup_vs_nospec.c1.candidate.estimate"] == pytest.approx(1.3, rel=0.01)
    assert m["speedup_vs_nospec.c4.live.ci_low"] == bench.speedup_vs_nospec[4]["live"].lo
    assert m["bench.attempts"] == 2.0 and m["heldout.repeats_training"] == 1.0
    assert cycle.speedup_vs_nospec(cycle.Cycle(cfg), state) == {"1": bench.speedup()[1], "4": bench.speedup()[4]}
    p = tracking.run_params(cfg, state)
    assert p["parent_version"] == "4" and p["train_snapshot_id"] == "a" * 64 and p["gate.confidence"] == "0.9"
    assert p["training.depth_weights"] == "[1.0, 0.8, 0.6]"


def bench_state(cid: str) -> dict:
    return {"cycle_id": cid, "steps": {"snapshot": {"heldout": {"jsonl": "h.jsonl"}}, "base": {"live_path": "live"},
                                       "train": {"head_path": "cand"}}}


def test_an_inconclusive_bench_is_measured_again_pooled_and_decided_once(cfg, monkeypatch):
    """The bench step's re-measurement loop, on simulated runs analysed for real: a loaded run cannot tell,
    the next (quiet) one is pooled with it and the gate passes the pool; the gate step reuses that verdict."""
    import evaluation.bench

    from loop import gate as gate_mod

    calls: list = []
    decided: list = []
    real_decide = gate_mod.decide
    monkeypatch.setattr(gate_mod, "decide", lambda rs, g, more_prompts: decided.append(len(rs)) or real_decide(
        rs, g, more_prompts))
    # loaded: cannot tell; then quiet: clearly better
    monkeypatch.setattr(evaluation.bench, "bench_heads", simulated_bench([(0.4, 1.0), (0.0, 1.5)], calls))
    cx = cycle.Cycle(cfg)
    state = bench_state("rm")
    out = cycle.step_bench(cx, state, cycle.CycleOptions())
    assert [a["verdict"] for a in out["attempts"]] == ["inconclusive", "passed"] and calls == [0, 1]
    assert decided == [1, 2]  # the second look judged both attempts together
    assert out["verdict"]["attempts"] == 2 and out["verdict"]["level"] < cfg.gate.level
    state["steps"]["bench"] = out
    g = cycle.step_gate(cx, state, cycle.CycleOptions())
    assert g == out["verdict"] and g["passed"] and decided == [1, 2]  # recorded once, reused
    # A re-run of the step reuses the attempts already written (no new measurement).
    again = cycle.step_bench(cx, state, cycle.CycleOptions())
    assert [a["verdict"] for a in again["attempts"]] == ["inconclusive", "passed"] and calls == [0, 1]


def test_the_gate_is_told_whether_another_attempt_brings_new_prompt_groups(cfg, monkeypatch):
    """A held-out set of one batch replays the same groups in every attempt; one of two batches brings new
    ones to attempt 2 only (loop.gate.decide's ``more_prompts``)."""
    import evaluation.bench

    from loop import gate as gate_mod

    real_decide = gate_mod.decide
    told: list = []
    monkeypatch.setattr(gate_mod, "decide", lambda rs, g, more_prompts: told.append(more_prompts) or real_decide(
        rs, g, more_prompts))
    for rows, cid in ((cfg.bench.max_prompts + 2, "one"), (2 * cfg.bench.max_prompts, "two"), (None, "unknown")):
        told.clear()
        monkeypatch.setattr(evaluation.bench, "bench_heads", simulated_bench([(0.4, 1.0), (0.4, 1.0)], []))
        state = bench_state(cid)
        if rows is not None:
            state["steps"]["snapshot"]["heldout"]["measured_rows"] = rows
        cycle.step_bench(cycle.Cycle(cfg), state, cycle.CycleOptions())
        assert told == {"one": [False, False], "two": [True, False], "unknown": [True, True]}[cid]


def test_each_attempt_asks_the_gate_after_every_round_whether_the_rounds_left_can_change_its_look(cfg, monkeypatch):
    """The bench's ``stop_after_round`` is the gate's :func:`loop.gate.round_look` on the cycle's attempts so
    far and the newest one's result up to that round."""
    import evaluation.bench

    from loop import gate as gate_mod

    seen: list = []
    monkeypatch.setattr(gate_mod, "round_look", lambda rs, g: seen.append([r.seed for r in rs]) or None)
    sim = simulated_bench([(0.4, 1.0), (0.4, 1.0)], [])

    def bench(c, bp, progress=None):
        res = sim(c, bp, progress)
        assert bp.stop_after_round(res) is None  # the simulated result stands in for the attempt's first round
        return res

    monkeypatch.setattr(evaluation.bench, "bench_heads", bench)
    out = cycle.step_bench(cycle.Cycle(cfg), bench_state("rounds"), cycle.CycleOptions())
    assert len(out["attempts"]) == 2 and seen == [[cfg.bench.seed], [cfg.bench.seed, cfg.bench.seed + 1]]


def test_no_speculation_is_measured_in_the_first_attempt_only(cfg, monkeypatch):
    """A repeat attempt narrows the gate's intervals, which never read the no-speculation arm: that arm runs
    in the first attempt, and the speed-up the cycle records and registers comes from it."""
    import evaluation.bench

    calls: list = []
    real = simulated_bench([(0.4, 1.0), (0.4, 1.0)], calls)
    asked: list = []
    monkeypatch.setattr(evaluation.bench, "bench_heads",
                        lambda c, bp, progress=None: asked.append((bp.nospec, bp.nospec_url)) or real(c, bp, progress))
    cx = cycle.Cycle(cfg)
    state = bench_state("ns")
    out = cycle.step_bench(cx, state, cycle.CycleOptions(nospec_url="http://127.0.0.1:9"))
    assert len(out["attempts"]) == 2 and asked == [(True, "http://127.0.0.1:9"), (False, "http://127.0.0.1:9")]
    assert out["nospec_json_path"] == "bench-1/bench.json" and out["json_path"] == "bench-2/bench.json"
    state["steps"]["bench"] = out
    speedup = cycle.speedup_vs_nospec(cx, state)
    assert set(speedup) == {"1", "4"} and all(1.1 < x < 1.4 for x in speedup.values())  # 1.0 / 0.8, measured
    m = tracking.run_metrics(state, resolve=lambda p: cx.local(state, p))
    assert m["speedup_vs_nospec.c1.candidate.estimate"] == pytest.approx(speedup["1"], abs=1e-4)
    cx.save_state(state)
    assert cycle.summary(cfg, "ns", cx)["artifacts"]["nospec_bench_json"].endswith("ns/bench-1/bench.json")
    # Without a reference replica no attempt measures it, and nothing claims a speed-up.
    asked.clear()
    real = simulated_bench([(0.4, 1.0), (0.4, 1.0)], calls)
    none = cycle.step_bench(cx, bench_state("ns2"), cycle.CycleOptions())
    assert asked[0][0] is None and none["nospec_json_path"] is None
    state["steps"]["bench"] = none
    assert cycle.speedup_vs_nospec(cx, state) == {}


def test_inconclusive_after_every_attempt_is_recorded_as_such(cfg, monkeypatch):
    import evaluation.bench

    monkeypatch.setattr(evaluation.bench, "bench_heads", simulated_bench([(0.4, 1.0), (0.4, 1.0)], []))
    cx = cycle.Cycle(cfg)
    state = bench_state("rm2")
    state["steps"]["bench"] = cycle.step_bench(cx, state, cycle.CycleOptions())
    g = cycle.step_gate(cx, state, cycle.CycleOptions())
    assert len(state["steps"]["bench"]["attempts"]) == cfg.gate.max_attempts == 2
    assert g["verdict"] == "inconclusive" and not g["passed"] and g["reason"].startswith("inconclusive after 2")


def test_a_cycle_builds_its_collaborators_once(cfg, monkeypatch):
    """One store and one registry for all the steps of a cycle, handed to every step."""
    from loop import store as store_mod
    from rollout import registry as reg_mod

    built = {"store": 0, "registry": 0}
    real = store_mod.CycleStore.__init__

    def counting(self, c):
        built["store"] += 1
        real(self, c)

    class Registry:
        def __init__(self, c):
            built["registry"] += 1

    monkeypatch.setattr(store_mod.CycleStore, "__init__", counting)
    monkeypatch.setattr(reg_mod, "Registry", Registry)
    seen = []

    def fake(name):
        def f(cx, state, opts):
            seen.append(cx)
            return {"step": name}
        return f

    monkeypatch.setattr(cycle, "STEP_FUNCS", {s: fake(s) for s in cycle.STEPS})
    monkeypatch.setattr(tracking, "CycleRun", lambda *a, **k: _NoRun())
    cycle.run_cycle(cfg, "once")
    assert len({id(c) for c in seen}) == 1 and built == {"store": 1, "registry": 1}


class _NoRun:
    def __getattr__(self, name):
        return lambda *a, **k: None


def test_the_last_cycles_noise_sizes_this_cycles_attempts(cfg, monkeypatch):
    """step_bench sizes its attempts from the benches of the cycles before it (loop.gate.size_attempts):
    the default shape with no history or after quiet benches; after busy ones a larger shape within the
    budget cap, which every attempt's bench is asked for."""
    import evaluation.bench

    asked: list = []
    cx = cycle.Cycle(cfg)

    def run(cid: str, runs: list) -> dict:
        real = simulated_bench(runs, [])
        monkeypatch.setattr(evaluation.bench, "bench_heads", lambda c, bp, progress=None: asked.append(
            (cid, bp.max_prompts, bp.rounds, bp.group_size, bp.prompts_at)) or real(c, bp, progress))
        state = bench_state(cid)
        state["steps"]["snapshot"]["heldout"]["measured_rows"] = 1000  # plenty of held-out traffic
        state["steps"]["bench"] = cycle.step_bench(cx, state, cycle.CycleOptions())
        cx.save_state(state)
        return state["steps"]["bench"]["size"]

    default = (cfg.bench.max_prompts, cfg.bench.rounds, cfg.bench.group_size)
    first = run("c1", [(0.0, 1.5)])
    assert (first["prompts"], first["rounds"], first["group_size"]) == default and "no earlier bench" in first["why"]
    quiet = run("c2", [(0.0, 1.5)])
    assert (quiet["prompts"], quiet["rounds"], quiet["group_size"]) == default and quiet["power"] >= 0.8
    run("c3", [(0.8, 1.0), (0.8, 1.0)])
    run("c4", [(0.8, 1.0), (0.8, 1.0)])
    busy = run("c5", [(0.8, 1.0), (0.8, 1.0)])
    shape = (busy["prompts"], busy["rounds"], busy["group_size"])
    assert shape != default and 1.0 < busy["budget"] <= 2.0, busy
    assert busy["power"] < quiet["power"]
    # both attempts take the sized shape, the prompts per concurrency too where they differ
    at = {int(c): n for c, n in busy["prompts_at"].items()} or None
    assert [a[1:] for a in asked if a[0] == "c5"] == [(*shape, at)] * 2


def test_a_fine_tune_trains_on_the_traffic_since_its_parents_data(cfg, monkeypatch, tmp_path):
    """The train step hands the trainer the rows after the parent's newest trained row as new, the rest as
    replay (adapt.data.split_new: unit-tested in tests/adapt/test_layout.py); a bootstrap gets every row."""
    from datetime import datetime, timezone
    from types import SimpleNamespace

    import pyarrow as pa
    import pyarrow.parquet as pq

    import adapt.train
    import headspec.validate

    cx = cycle.Cycle(cfg)
    d = cx.dir("c1")
    d.mkdir(parents=True, exist_ok=True)
    times = [datetime(2026, 11, 29, 12, m, tzinfo=timezone.utc) for m in (0, 10, 20, 30)]
    pq.write_table(pa.table({"content_hash": ["a", "b", "c", "d"], "inference_time": times}), d / "train.parquet")
    (d / "parent").mkdir()
    (d / "parent" / "manifest.json").write_text(
        json.dumps({"data_snapshot": {"data_until": "2026-11-29T12:10:00+00:00", "content_hashes": ["a"]}}))
    seen: dict = {}

    def fake_train(cfg, rows, base, out_dir, replay=None, **kw):
        seen.update(new=[r["content_hash"] for r in rows], old=[r["content_hash"] for r in replay or []], base=base)
        return SimpleNamespace(out_dir=out_dir, steps=1, tokens=1, tokens_per_s=1.0, final_depth_loss=[],
                               final_depth_acc=[], data_snapshot="s", num_examples=len(rows), to_json=lambda: {})

    monkeypatch.setattr(adapt.train, "train", fake_train)
    monkeypatch.setattr(headspec.validate, "validate_head",
                        lambda *a, **k: SimpleNamespace(sha256="h", num_speculative_tokens=3))
    monkeypatch.setattr(cycle, "_target", lambda cfg: tmp_path)
    state = {"cycle_id": "c1", "steps": {"snapshot": {"train": {"path": "train.parquet"}},
                                         "base": {"parent_path": "parent"}}}
    out = cycle.train_here(cx, state)
    assert seen == {"new": ["c", "d"], "old": ["a", "b"], "base": str(d / "parent")}
    assert out["new_rows"] == 2 and out["older_rows"] == 2
    state["steps"]["base"]["parent_path"] = None  # a bootstrap: everything is new
    out = cycle.train_here(cx, state)
    assert seen == {"new": ["a", "b", "c", "d"], "old": [], "base": None} and out["older_rows"] == 0
