"""The promotion gate as a pure function over bench JSON (no services)."""

import pytest

from loop.gate import INCONCLUSIVE, PASSED, REJECTED, aa_noise, bootstrap_verdict, check, decide
from settings.config import GateConfig


def bench(acc=(0.3, 0.1, 0.5), tps=(5.0, 1.0, 9.0), live_tps=100.0, concs=(1,), aa_acc=(0.0, 0.0, 0.0),
          aa_tps=(0.0, -0.5, 0.5), failed=(0, 0)):
    diffs = {"mean_acceptance_length": {"estimate": acc[0], "ci": [acc[1], acc[2]], "confidence": 0.9}}
    aa = {"mean_acceptance_length": {"estimate": aa_acc[0], "ci": [aa_acc[1], aa_acc[2]]}}
    per = {"live": {"by_concurrency": {}}, "candidate": {"by_concurrency": {}}}
    for c in concs:
        diffs[f"c{c}"] = {"output_tok_per_s": {"estimate": tps[0], "ci": [tps[1], tps[2]]}}
        aa[f"c{c}"] = {"output_tok_per_s": {"estimate": aa_tps[0], "ci": [aa_tps[1], aa_tps[2]]}}
        per["live"]["by_concurrency"][str(c)] = {"output_tok_per_s": live_tps, "failed": failed[1]}
        per["candidate"]["by_concurrency"][str(c)] = {"output_tok_per_s": live_tps, "failed": failed[0]}
    return {"differences": diffs, "aa_control": aa, "per_head": per}


def test_passes_only_when_both_lower_bounds_clear_margin_and_noise():
    v = decide(bench(), GateConfig(min_acceptance_gain=0.02, min_throughput_gain=0.0))
    assert v.passed and v.label == PASSED and v.to_json()["verdict"] == "passed"
    assert [c["status"] for c in v.checks] == [PASSED, PASSED]


def test_acceptance_interval_below_margin_rejects_with_reason():
    v = decide(bench(acc=(0.005, 0.0, 0.01)), GateConfig(min_acceptance_gain=0.02))
    assert v.status == REJECTED and not v.passed
    assert "mean_acceptance_length" in v.reason and "not better by the margin" in v.reason


def test_point_estimate_alone_never_promotes():
    # Large estimate, interval straddling zero: not confident either way.
    v = decide(bench(tps=(20.0, -3.0, 40.0)), GateConfig(min_acceptance_gain=0.0, min_throughput_gain=0.0))
    assert not v.passed and v.status == INCONCLUSIVE and "output_tok_per_s@c1" in v.reason


def test_throughput_margin_is_relative_to_live():
    # +5 tok/s, lower bound 1.0, A/A ±0.5 on a live 100 tok/s: passes a 0.4% margin, not a 2% one.
    assert decide(bench(), GateConfig(min_acceptance_gain=0.0, min_throughput_gain=0.004)).passed
    v = decide(bench(), GateConfig(min_acceptance_gain=0.0, min_throughput_gain=0.02))
    assert not v.passed and "margin 2" in v.reason


def test_every_concurrency_must_improve():
    b = bench(concs=(1, 4))
    b["differences"]["c4"]["output_tok_per_s"] = {"estimate": -10.0, "ci": [-12.0, -8.0]}
    v = decide(b, GateConfig())
    assert v.status == REJECTED and "c4" in v.reason and "c1" not in v.reason


def test_a_wide_aa_spread_makes_a_clear_looking_difference_inconclusive():
    """Under load the A/A control (the same head twice) differs by up to 15 tok/s: a −8 tok/s
    candidate interval is within what identical heads show, so no verdict is claimed."""
    b = bench(tps=(-10.0, -12.0, -8.0), aa_tps=(6.0, -3.0, 15.0))
    v = decide(b, GateConfig(min_acceptance_gain=0.0))
    assert v.status == INCONCLUSIVE and "within the run's noise" in v.reason
    # The same candidate interval on a quiet run (A/A ±0.5) is a clear rejection...
    assert decide(bench(tps=(-10.0, -12.0, -8.0)), GateConfig(min_acceptance_gain=0.0)).status == REJECTED
    # ...and a gain must clear the noise too, not just zero.
    assert decide(bench(tps=(10.0, 8.0, 12.0), aa_tps=(0.0, -9.0, 9.0)), GateConfig()).status == INCONCLUSIVE
    assert decide(bench(tps=(10.0, 8.0, 12.0), aa_tps=(0.0, -7.0, 7.0)), GateConfig()).status == PASSED


def test_a_clear_loss_rejects_even_when_another_check_is_inconclusive():
    b = bench(acc=(-0.4, -0.5, -0.3), tps=(1.0, -5.0, 7.0))
    v = decide(b, GateConfig())
    assert v.status == REJECTED and "mean_acceptance_length" in v.reason


def test_missing_interval_or_control_is_inconclusive_never_passed():
    b = bench()
    b["differences"]["mean_acceptance_length"] = {"estimate": None, "ci": [None, None]}
    v = decide(b, GateConfig())
    assert v.status == INCONCLUSIVE and "no confidence interval" in v.reason
    b = bench()
    del b["aa_control"]
    v = decide(b, GateConfig())
    assert v.status == INCONCLUSIVE and "no A/A control" in v.reason
    assert not decide({"differences": {}}, GateConfig()).passed


def test_a_candidate_that_fails_requests_is_rejected():
    v = decide(bench(failed=(3, 0)), GateConfig())
    assert v.status == REJECTED and "failed 3 requests" in v.reason


@pytest.mark.parametrize("lo,hi,noise,margin,want", [
    (0.5, 1.0, 0.4, 0.0, PASSED), (0.5, 1.0, 0.5, 0.0, INCONCLUSIVE),
    (-1.0, -0.5, 0.4, 0.0, REJECTED), (-1.0, -0.5, 0.6, 0.0, INCONCLUSIVE),
    (0.05, 0.1, 0.0, 0.1, REJECTED), (0.05, 0.15, 0.0, 0.1, INCONCLUSIVE),
])
def test_check_boundaries(lo, hi, noise, margin, want):
    c = check("x", {"estimate": (lo + hi) / 2, "ci": [lo, hi]}, {"ci": [-noise, noise]}, margin, "u")
    assert c["status"] == want and c["aa_noise"] == noise


def test_aa_noise_is_the_largest_open_difference():
    assert aa_noise({"ci": [-0.2, 0.7]}) == 0.7 and aa_noise({"ci": [-3.0, 1.0]}) == 3.0
    assert aa_noise(None) is None and aa_noise({"ci": [None, None]}) is None


def test_bootstrap_verdict_says_why():
    v = bootstrap_verdict()
    assert v.passed and "bootstrap" in v.reason and v.to_json()["verdict"] == "passed"
