"""`adapt demo` configuration (the demo itself runs from scripts/demo.sh)."""

import pytest

from app.demo import demo_config, with_overrides
from settings.config import load_config


def test_demo_has_its_own_state_and_an_admin_token(tmp_path, monkeypatch):
    monkeypatch.delenv("ADAPT_ADMIN_TOKEN", raising=False)
    monkeypatch.delenv("ADAPT_CONFIG", raising=False)
    monkeypatch.setenv("ADAPT_STATE_DIR", str(tmp_path))
    base = load_config()
    assert base.serving.resolved_admin_token() == ""
    cfg = demo_config(base)
    assert cfg.state_dir == str(tmp_path / "demo")
    assert cfg.warehouse.uri.startswith(str(tmp_path / "demo"))
    # swaps need a token: without one the router refuses the controller
    assert len(cfg.serving.admin_token) >= 16
    monkeypatch.setenv("ADAPT_ADMIN_TOKEN", "from-env")
    assert demo_config(base).serving.admin_token == "from-env"


def test_with_overrides_validates(tmp_path, monkeypatch):
    monkeypatch.setenv("ADAPT_STATE_DIR", str(tmp_path))
    cfg = with_overrides(load_config(), capture={"heldout_hours": 0.01}, training={"max_steps": 7})
    assert cfg.capture.heldout_hours == 0.01 and cfg.training.max_steps == 7
    import pydantic

    with pytest.raises(pydantic.ValidationError):
        with_overrides(load_config(), training={"max_steps": -1})


def test_heldout_hours_for_ingests_and_returns_that_ingest(tmp_path, monkeypatch):
    """The demo ingests before each cycle to place the held-out cut; the report keeps that ingest's counts."""
    from datetime import timedelta

    from app.demo import heldout_hours_for
    from tests.capture_support import T0 as t0
    from tests.capture_support import chat, layout_file

    monkeypatch.delenv("ADAPT_CONFIG", raising=False)
    src = tmp_path / "cap"
    layout_file(src, t0, "f.jsonl", [chat(i, t0 + timedelta(minutes=20 * i)) for i in range(4)])
    cfg = load_config(overrides={"state_dir": str(tmp_path / "state"), "capture": {"source": str(src)}})
    hours, ingested = heldout_hours_for(cfg, t0 + timedelta(minutes=30))  # the newest record is at +60 min
    assert hours == pytest.approx(0.5)
    assert (ingested["read"], ingested["normalized"]) == (4, 4)
    hours, again = heldout_hours_for(cfg, t0 + timedelta(minutes=30))
    assert hours == pytest.approx(0.5) and again["read"] == 0


@pytest.mark.services
def test_demo_runs_end_to_end_on_the_tiny_target_through_promotion_and_rollback(tiny_model, tmp_path, monkeypatch):
    """The whole `adapt demo` on the tiny target, small sizes.

    Tiny random heads rarely clear the real gate, so the gate is made to pass here:
    what this test pins is the wiring after it (promotion, hot-swap, rollback by
    stage change followed by the controller, the report), which a rejected cycle
    never reaches. The real gate reaches passed and rejected end to end in test_gate_e2e
    (and inconclusive in test_loop).
    """
    import json

    from loop import gate
    from app.demo import render, run_demo
    from settings.config import dump_toml
    from tests.services import free_ports

    monkeypatch.delenv("ADAPT_CONFIG", raising=False)
    monkeypatch.setattr(gate, "decide", lambda bench, g: gate.Verdict(gate.PASSED, "forced to pass by the test", []))
    base, router = free_ports(2)
    cfg = load_config(overrides={
        "state_dir": str(tmp_path / "state"), "target": {"model": str(tiny_model)},
        "head": {"draft_vocab_size": 256},
        "serving": {"base_port": base, "router_port": router},
        "training": {"batch_tokens": 1024},
        "bench": {"concurrencies": [1, 2], "max_prompts": 4, "max_tokens": 16, "rounds": 1},
        "demo": {"general_conversations": 6, "drifted_conversations": 4, "tool_prompts": 2, "max_turns": 2,
                 "max_turn_chars": 400, "max_tokens": 16, "concurrency": 4, "gap_seconds": 2, "bootstrap_steps": 6,
                 "adapt_steps": 6, "train_minutes": 1},
    })
    cfg_file = tmp_path / "demo.toml"
    cfg_file.write_text(dump_toml(cfg))
    lines: list[str] = []
    report = run_demo(load_config(cfg_file), lines.append)

    assert report["cycle1"]["promoted"] and report["cycle2"]["promoted"]
    assert report["pool_after_cycles"][0]["head_version"] == str(report["cycle2"]["version"]) == "2"
    rb = report["rollback"]
    assert rb["to_version"] == "1" and rb["pool_followed_after_s"] < 30
    assert all(h["head_version"] == "1" for h in rb["pool"])
    prod = [v for v in rb["registry"] if v.get("stage") == "Production"]
    assert [str(v["version"]) for v in prod] == ["1"] and prod[0]["aliases"] == ["champion"]  # alias follows the stage
    assert all(v["aliases"] == [] for v in rb["registry"] if str(v["version"]) != "1")
    sent = {}
    for key, phase in (("cycle1", "general"), ("cycle2", "drifted")):
        tr = report["traffic"][phase]
        sent[key] = tr["train_phase"]["turns_ok"] + tr["heldout_phase"]["turns_ok"]
        assert tr["train_phase"]["conversations"] + tr["heldout_phase"]["conversations"] == 6
        b = report[key]["bench"]
        assert b["before"]["mean_acceptance_length"] >= 1.0 and b["after"]["output_tok_per_s"]
        i = report[key]["ingest"]  # what this cycle ingested (its own ingest step then reads nothing new)
        assert i["read"] == sent[key]
        assert i["read"] == i["normalized"] + i["duplicates"] + i["stitched"] + i["quarantined"] + i["skipped"]
    saved = json.loads((tmp_path / "state" / "demo" / "report.json").read_text())
    assert saved["rollback"]["to_version"] == "1"
    text = render(report)
    assert "rollback: version 1 moved to Production" in text and "cycle 2: adapt to drifted traffic" in text
    assert f"  ingest: read {sent['cycle2']}, normalized" in text
    assert any("the pool serves version 1 again" in line for line in lines)


def test_demo_traffic_is_real_conversations_general_then_code_and_tools(tmp_path_factory):
    from app.demo import demo_traffic
    from settings.config import DemoConfig

    d = DemoConfig(general_conversations=5, drifted_conversations=4, tool_prompts=3, max_turn_chars=300)
    t = demo_traffic(str(tmp_path_factory.getbasetemp() / "prompt-wheels"), d)
    assert len(t["general"]) == 5 and len(t["drifted"]) == 7
    assert not any("```" in turn["value"] for r in t["general"] for turn in r["conversations"])
    code = [r for r in t["drifted"] if any("```" in turn["value"] for turn in r["conversations"])]
    assert len(code) == 4 and sum(r["id"].startswith("simple_python") for r in t["drifted"]) == 3
    for r in t["general"] + code:
        assert len(next(x["value"] for x in r["conversations"] if x["from"] == "human")) <= 300
    assert t == demo_traffic(str(tmp_path_factory.getbasetemp() / "prompt-wheels"), d)  # the same every run


def _cycle_summary(tmp_path, name, speed, al, verdict, promoted, version):
    """A cycle summary whose bench JSON comes from the real analysis of simulated measurements."""
    from evaluation.bench import CANDIDATE, CONTROL, LIVE, NOSPEC, HeadRef, analyze
    from tests.bench_sim import CONCS, simulate, slots_for

    arms = [CANDIDATE, LIVE, CONTROL, NOSPEC]
    res = analyze(simulate(slots_for(arms=arms), speed, al=al), arms, CONCS, 0.9)
    res.heads = {"candidate": HeadRef("c", "c" * 64, version), "live": HeadRef("l", "l" * 64, "cold")}
    res.requests, res.heldout_overlap = 24, {"heldout": 26, "repeats_training": 2, "excluded": True}
    d = tmp_path / name
    d.mkdir()
    res.write(d / "bench.json")
    return {"cycle_id": name, "version": version, "verdict": verdict, "reason": f"{verdict} because", "promoted": promoted,
            "timings": {},
            "artifacts": {"bench_json": str(d / "bench.json"), "bench_plot": str(d / "bench.png")},
            "steps": {"bench": {"json_path": "bench.json", "plot_path": "bench.png",
                                "attempts": [{"verdict": "inconclusive"}, {"verdict": verdict}]}}}


def test_report_of_a_rejected_then_passed_demo_says_what_happened(tmp_path):
    """Cycle 1 rejected, cycle 2 passed and served: the summary shows both benches, who serves, and why
    there is no rollback (nothing was ever in Production before version 2)."""
    from evaluation.bench import CANDIDATE, CONTROL, LIVE, NOSPEC
    from app.demo import bench_figures, render

    c1 = _cycle_summary(tmp_path, "c1", {CANDIDATE: 0.8, LIVE: 1.0, CONTROL: 1.0, NOSPEC: 1.1},
                        {CANDIDATE: 1.1, LIVE: 1.2, CONTROL: 1.2}, "rejected", False, "1")
    c2 = _cycle_summary(tmp_path, "c2", {CANDIDATE: 1.3, LIVE: 1.0, CONTROL: 1.0, NOSPEC: 0.9},
                        {CANDIDATE: 1.6, LIVE: 1.2, CONTROL: 1.2}, "passed", True, "2")
    report = {"target": "smollm2", "total_seconds": 1800.0, "state_dir": str(tmp_path)}
    for key, c in (("cycle1", c1), ("cycle2", c2)):
        report[key] = {k: c[k] for k in ("cycle_id", "version", "verdict", "reason", "promoted")}
        report[key]["bench"] = bench_figures(c)
    report["pool_after_cycles"] = [{"url": "u", "head_version": "2", "head_sha256": "c" * 12, "healthy": True}]
    registry = [{"version": "1", "stage": "None", "tags": {"gate_verdict": "rejected"}},
                {"version": "2", "stage": "Production", "tags": {"gate_verdict": "passed"}}]
    report["registry_after_cycles"] = registry
    report["rollback"] = {"skipped": "cycle 1's version was rejected and never served, so there is no earlier "
                                     "Production version to roll back to"}
    text = render(report)
    assert "cycle 1: bootstrap from general chat: version 1 → rejected, 2 benchmark runs, not promoted" in text
    assert "cycle 2: adapt to drifted traffic: version 2 → passed, 2 benchmark runs and promoted" in text
    assert text.count("  before head cold") == 2 and "  after  head 2" in text and "  after  head 1" in text
    assert text.count("  no speculation") == 2 and "(A/A [" in text
    assert "2 of 26 conversations repeat a training prompt (left out of the bench)" in text
    assert "pool after the cycles serves version(s) 2" in text
    assert "did not promote" not in text and "no earlier Production version to roll back to" in text
    assert text.count('"stage": "Production"') == 1 and '"version": "1"' in text  # the registry is listed
    # cycle 1's candidate was measured slower than no speculation: said plainly
    assert "NOTE: at concurrency 1 this head is slower than serving without speculation" in text


def test_demo_skips_rollback_for_the_right_reason(tmp_path, monkeypatch):
    """The rollback decision itself (run_demo's branch) for the three cycle outcomes."""
    from app.demo import rollback_skip_reason

    assert rollback_skip_reason({"promoted": True}, {"promoted": True}) is None
    assert "cycle 2 did not promote" in rollback_skip_reason({"promoted": True}, {"promoted": False,
                                                                                   "verdict": "inconclusive"})
    assert "no earlier Production version" in rollback_skip_reason({"promoted": False, "verdict": "rejected"},
                                                                   {"promoted": True})
