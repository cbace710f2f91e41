"""The replay bench's plan and statistics on simulated measurements (no services).

What the gate must never do is promote a head that is not better, whatever the
machine did during the run: drift, load that comes and goes, jitter.
"""

from __future__ import annotations

import pytest

from evaluation.bench import CANDIDATE, CONTROL, LIVE, NOSPEC, RequestResult, Slot, analyze, arm_orders, plan
from loop.gate import PASSED, REJECTED, decide
from settings.config import GateConfig
from tests.bench_sim import ARMS, CONCS, N, simulate, slots_for

SAME = {CANDIDATE: 1.0, LIVE: 1.0, CONTROL: 1.0}
SAME_AL = {CANDIDATE: 1.5, LIVE: 1.5, CONTROL: 1.5}


def run(slots, speed, seed=0, **kw):
    arms = [a for a in (CANDIDATE, LIVE, CONTROL, NOSPEC) if any(a in s.order for s in slots)]
    return analyze(simulate(slots, speed, seed=seed, **kw), arms, CONCS, confidence=0.9, n_boot=1000, seed=seed)


@pytest.mark.parametrize("arms", [[CANDIDATE, LIVE, CONTROL], [CANDIDATE, LIVE, CONTROL, NOSPEC]])
def test_orders_are_seeded_and_counterbalanced(arms):
    from collections import Counter

    o = arm_orders(arms, seed=3)
    assert o == arm_orders(arms, seed=3) and o != arm_orders(arms, seed=5)
    positions = Counter((a, r.index(a)) for r in o for a in arms)
    assert len(set(positions.values())) == 1 and len(positions) == len(arms) ** 2  # every arm, every position
    follows = Counter((r[i], r[i + 1]) for r in o for i in range(len(arms) - 1))
    assert len(set(follows.values())) == 1 and len(follows) == len(arms) * (len(arms) - 1)  # every predecessor


def test_plan_covers_every_prompt_with_every_arm_in_slots_of_at_least_two_waves():
    slots = plan(ARMS, 10, [1, 4], rounds=2, group_size=4, seed=0)
    for r in (0, 1):
        for c in (1, 4):
            mine = [s for s in slots if s.round == r and s.concurrency == c]
            assert sorted(p for s in mine for p in s.prompts) == list(range(10))
            assert all(len(s.prompts) <= max(4, 2 * c) for s in mine)
    assert all(sorted(s.order) == sorted(ARMS) for s in slots)


def test_pairing_resolves_a_real_gain_that_prompt_variety_would_hide():
    res = run(slots_for(), {CANDIDATE: 1.10, LIVE: 1.0, CONTROL: 1.0})
    d = res["differences"]["c1"]["output_tok_per_s"]
    assert d["pairs"] == 2 * N and d["ci"][0] > 0  # +10%, prompts 4x apart: resolved because pairs share the prompt
    aa = res["aa_control"]["c1"]["output_tok_per_s"]
    assert max(abs(aa["ci"][0]), abs(aa["ci"][1])) < d["ci"][0]
    assert res["differences"]["mean_acceptance_length"]["estimate"] == pytest.approx(0.3)
    assert [r["round"] for r in res["rounds"]] == [0, 1]
    assert res["rounds"][0]["by_concurrency"]["1"]["candidate_minus_live_tok_per_s"] > 0


def test_a_fixed_order_on_a_slowing_machine_fakes_a_gain_the_counterbalanced_plan_does_not():
    # Candidate always first, live second (the old bench's order): the machine slows as it goes.
    fixed = [Slot(s.round, s.concurrency, s.prompts, [CANDIDATE, LIVE]) for s in slots_for()]
    res = run(fixed, {CANDIDATE: 1.0, LIVE: 1.0}, drift=0.005, al=SAME_AL)
    assert res["differences"]["c1"]["output_tok_per_s"]["ci"][0] > 0  # a confident "gain" for identical heads
    balanced = run(slots_for(seed=1), SAME, drift=0.005, al=SAME_AL)
    d = balanced["differences"]["c1"]["output_tok_per_s"]
    assert d["ci"][0] < 0 < d["ci"][1]
    assert decide(balanced, GateConfig(min_acceptance_gain=0.0)).status != PASSED


def test_the_aa_control_keeps_even_a_fixed_order_from_promoting():
    fixed = [Slot(s.round, s.concurrency, s.prompts, [CANDIDATE, LIVE, CONTROL]) for s in slots_for()]
    res = run(fixed, SAME, drift=0.01, al={CANDIDATE: 1.6, LIVE: 1.5, CONTROL: 1.5})
    assert res["differences"]["c1"]["output_tok_per_s"]["ci"][0] > 0  # biased by the order...
    assert decide(res, GateConfig(min_acceptance_gain=0.0)).status != PASSED  # ...and the A/A shows it


def test_load_that_comes_and_goes_widens_intervals_instead_of_faking_differences():
    """±40% load from slot to slot, ±10% jitter: identical speeds never pass and are rarely called worse
    with confidence; a really faster head still passes most runs."""
    gate = GateConfig(min_acceptance_gain=0.0)
    same, better = [], []
    for seed in range(20):
        same.append(decide(run(slots_for(seed=seed), SAME, seed=seed, load=0.4, jitter=0.1,
                               al={CANDIDATE: 1.6, LIVE: 1.5, CONTROL: 1.5}), gate).status)
        better.append(decide(run(slots_for(seed=seed), {CANDIDATE: 1.4, LIVE: 1.0, CONTROL: 1.0}, seed=seed,
                                 load=0.4, jitter=0.1, al={CANDIDATE: 1.9, LIVE: 1.5, CONTROL: 1.5}), gate).status)
    assert PASSED not in same and same.count(REJECTED) <= 2, same
    assert better.count(PASSED) >= 16 and REJECTED not in better, better


def test_identical_heads_are_not_better_whatever_the_load():
    for seed, load in ((0, 0.0), (1, 0.4)):
        v = decide(run(slots_for(seed=seed), SAME, seed=seed, load=load, al=SAME_AL),
                   GateConfig(min_acceptance_gain=0.0))
        assert v.status == REJECTED and "mean_acceptance_length: not better" in v.reason


def test_speedup_over_no_speculation_is_a_paired_ratio():
    slots = slots_for(arms=[CANDIDATE, LIVE, CONTROL, NOSPEC])
    res = run(slots, {CANDIDATE: 1.3, LIVE: 0.9, CONTROL: 0.9, NOSPEC: 1.0}, load=0.2)
    sp = res["speedup_vs_nospec"]
    assert sp["c1"]["candidate"]["estimate"] == pytest.approx(1.3, rel=0.03)
    assert sp["c4"]["live"]["estimate"] == pytest.approx(0.9, rel=0.03)
    lo, hi = sp["c4"]["live"]["ci"]
    assert lo < 0.9 < hi and hi < 1.0  # slower than no speculation, and the interval says so
    assert res["per_head"][NOSPEC]["spec"] is None


def test_failed_requests_are_left_out_of_the_pairs():
    blocks = simulate(slots_for(), SAME)
    for b in blocks:
        if b["role"] == CANDIDATE and b["concurrency"] == 1 and 0 in b["prompts"]:
            b["results"][b["prompts"].index(0)] = RequestResult(ok=False, error="HTTP 500")
    res = analyze(blocks, ARMS, CONCS, 0.9, 200)
    assert res["differences"]["c1"]["output_tok_per_s"]["pairs"] == 2 * N - 2
    assert res["aa_control"]["c1"]["output_tok_per_s"]["pairs"] == 2 * N  # the control's pairs are all there
    assert res["per_head"][CANDIDATE]["by_concurrency"]["1"]["failed"] == 2
    assert decide(res, GateConfig()).status == REJECTED


def test_figures_carry_the_percentiles_and_names_of_vllm_bench_serve():
    from evaluation.stats import request_records

    blocks = simulate(slots_for(), SAME, load=0.2, jitter=0.1)
    res = analyze(blocks, ARMS, CONCS, 0.9, 200)
    f = res["per_head"][CANDIDATE]["by_concurrency"]["1"]
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert f[f"p50_{name}_ms"] == pytest.approx(f[f"median_{name}_ms"])
        assert f[f"p50_{name}_ms"] <= f[f"p90_{name}_ms"] <= f[f"p99_{name}_ms"] and f[f"std_{name}_ms"] >= 0
    assert f["completed"] == f["requests"] == 2 * N and f["output_throughput"] == f["output_tok_per_s"]
    records = request_records(blocks)
    assert len(records) == len(ARMS) * len(CONCS) * 2 * N
    r = next(x for x in records if x["arm"] == CANDIDATE and x["concurrency"] == 1)
    assert set(r) >= {"arm", "round", "slot", "prompt", "ok", "output_tokens", "ttft_ms", "e2el_ms", "itls_ms", "drafts"}
