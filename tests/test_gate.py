"""The promotion gate as a pure function over bench JSON (no services)."""

from adapt.config import GateConfig
from adapt.gate import bootstrap_verdict, decide


def bench(acc=(0.3, 0.1, 0.5), tps=(5.0, 1.0, 9.0), live_tps=100.0, concs=(1,)):
    diffs = {"mean_acceptance_length": {"estimate": acc[0], "ci": [acc[1], acc[2]], "confidence": 0.9}}
    per = {}
    for c in concs:
        diffs[f"c{c}"] = {"output_tok_per_s": {"estimate": tps[0], "ci": [tps[1], tps[2]]}}
        per[str(c)] = {"output_tok_per_s": live_tps}
    return {"differences": diffs, "per_head": {"live": {"by_concurrency": per}}}


def test_passes_only_when_both_lower_bounds_clear_margins():
    v = decide(bench(), GateConfig(min_acceptance_gain=0.02, min_throughput_gain=0.0))
    assert v.passed and v.label == "passed"
    assert [c["ok"] for c in v.checks] == [True, True]


def test_acceptance_lower_bound_below_margin_rejects_with_reason():
    v = decide(bench(acc=(0.3, 0.01, 0.5)), GateConfig(min_acceptance_gain=0.02))
    assert not v.passed and v.label == "rejected"
    assert "mean_acceptance_length" in v.reason and "0.01" in v.reason


def test_point_estimate_alone_never_promotes():
    # Large estimate, interval straddling zero: not confident.
    v = decide(bench(tps=(20.0, -3.0, 40.0)), GateConfig(min_acceptance_gain=0.0, min_throughput_gain=0.0))
    assert not v.passed and "output_tok_per_s@c1" in v.reason


def test_throughput_margin_is_relative_to_live():
    # +5 tok/s lower bound 1.0 on a live 100 tok/s: passes a 0.5% margin, fails a 2% one.
    assert decide(bench(), GateConfig(min_acceptance_gain=0.0, min_throughput_gain=0.005)).passed
    v = decide(bench(), GateConfig(min_acceptance_gain=0.0, min_throughput_gain=0.02))
    assert not v.passed and "margin 2" in v.reason


def test_every_concurrency_must_improve():
    b = bench(concs=(1, 4))
    b["differences"]["c4"]["output_tok_per_s"] = {"estimate": -1.0, "ci": [-2.0, 0.5]}
    v = decide(b, GateConfig())
    assert not v.passed and "c4" in v.reason and "c1" not in v.reason


def test_missing_interval_rejects():
    b = bench()
    b["differences"]["mean_acceptance_length"] = {"estimate": None, "ci": [None, None]}
    v = decide(b, GateConfig())
    assert not v.passed and "no confidence interval" in v.reason
    assert not decide({"differences": {}}, GateConfig()).passed


def test_bootstrap_verdict_says_why():
    v = bootstrap_verdict()
    assert v.passed and "bootstrap" in v.reason and v.to_json()["verdict"] == "passed"
