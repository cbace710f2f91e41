"""The promotion gate's rules on constructed benches (no services).

Each bench is built from per-prompt-group figures, so every rule is checked against
numbers worked out by hand: the one-sided levels, the minimum number of groups, the A/A
control voiding an attempt, attempts pooled, each look at its share of the level.
"""

from __future__ import annotations

import math

import pytest

from evaluation.result import Arm, ArmFigures, BenchResult, RequestRecord, compare_all
from evaluation.stats import CANDIDATE, CONTROL, LIVE, Cluster, ClusterSums, look_level
from loop.gate import (INCONCLUSIVE, PASSED, REJECTED, Verdict, acceptance_repeats, attempt_levels,
                       bootstrap_verdict, decide, offline_check, power_plan, prescreen, round_futility, round_look,
                       size_attempts)
from settings.config import GateConfig

BASE = [30.0, 28.0, 33.0, 31.0, 29.0, 35.0, 27.0, 32.0]  # the live head's tok/s per prompt group


def bench(gain=(3.0, 2.0, 4.0, 3.5, 2.5, 3.0, 4.0, 2.0), al=(0.3, 0.2, 0.4, 0.3, 0.25, 0.35, 0.3, 0.3),
          aa=(0.1, -0.2, 0.0, 0.2, -0.1, 0.1, -0.1, 0.0), concs=(1,), failed=(0, 0), base=BASE) -> BenchResult:
    """Per group: candidate = live + gain tok/s and + al acceptance; control = live + aa tok/s."""
    clusters = []
    for c in concs:
        for g, live in enumerate(base):
            def sums(tps: float, al_: float) -> ClusterSums:
                return ClusterSums(requests=4, tokens=100.0 * tps, latency_s=100.0 * c, drafts=100.0 if c == 1 else 0,
                                   accepted=100.0 * (al_ - 1) if c == 1 else 0)
            clusters.append(Cluster(c, [g], 2, {CANDIDATE: sums(live + gain[g], 1.5 + al[g]),
                                                LIVE: sums(live, 1.5), CONTROL: sums(live + aa[g], 1.5)}))
    arms = [CANDIDATE, LIVE, CONTROL]
    diffs, aa_c, _ = compare_all(clusters, arms, list(concs), 0.9)
    per = {r: Arm(None, {c: ArmFigures(failed=failed[0] if r == CANDIDATE else failed[1] if r == LIVE else 0)
                         for c in concs}) for r in arms}
    return BenchResult(arms=per, clusters=clusters, differences=diffs, aa_control=aa_c, speedup_vs_nospec={},
                       concurrencies=list(concs), rounds=2, confidence=0.9)


ONE = GateConfig(max_attempts=1)


def test_passes_only_when_every_lower_bound_clears_its_margin():
    v = decide(bench(), ONE)
    assert v.passed and v.label == PASSED and v.to_json()["verdict"] == "passed"
    assert [c.name for c in v.checks] == ["mean_acceptance_length", "output_tok_per_s@c1"]
    assert all(c.level == pytest.approx(0.05) and c.clusters == 8 for c in v.checks)
    assert all(c.ci[0] > c.margin for c in v.checks)


def test_confidence_is_the_one_sided_level_of_each_check():
    assert GateConfig().level == pytest.approx(0.05) and GateConfig(confidence=0.8).level == pytest.approx(0.1)
    # A gain whose one-sided 5% bound is just below zero but whose 10% bound is above it.
    gain = (1.0, -0.6, 1.4, 0.2, -0.4, 1.2, 0.3, -0.1)
    assert decide(bench(gain=gain), ONE).status == INCONCLUSIVE
    assert decide(bench(gain=gain), GateConfig(max_attempts=1, confidence=0.8)).status == PASSED


def test_acceptance_below_margin_rejects_with_reason():
    v = decide(bench(al=(0.01,) * 8), ONE)
    assert v.status == REJECTED and not v.passed
    assert "mean_acceptance_length: not better by the margin" in v.reason


def test_a_point_estimate_alone_never_promotes():
    v = decide(bench(gain=(8.0, -6.0, 9.0, -5.0, 7.0, -4.0, 6.0, -3.0)), ONE)
    assert v.status == INCONCLUSIVE and "output_tok_per_s@c1: cannot tell yet" in v.reason


def test_the_throughput_margin_is_relative_to_the_reference():
    # +3 tok/s on about 30.6: beyond a 5% margin (1.5 tok/s), not beyond 15% (4.6 tok/s)
    assert decide(bench(), GateConfig(max_attempts=1, min_throughput_gain=0.05)).passed
    v = decide(bench(), GateConfig(max_attempts=1, min_throughput_gain=0.15))
    assert v.status == REJECTED
    c = next(c for c in v.checks if c.name == "output_tok_per_s@c1")
    assert c.margin == pytest.approx(0.15 * sum(BASE) / 8, rel=0.01) and c.ci[1] <= c.margin


def test_every_concurrency_must_improve():
    b = bench(concs=(1, 4))
    for cl in b.clusters:
        if cl.concurrency == 4:
            cl.arms[CANDIDATE].tokens = cl.arms[LIVE].tokens * 0.8
    v = decide(b, ONE)
    assert v.status == REJECTED and "output_tok_per_s@c4: not better" in v.reason and "c1" not in v.reason


def test_non_inferiority_is_an_option_for_throughput():
    flat = bench(gain=(0.2, -0.3, 0.1, -0.1, 0.3, -0.2, 0.0, 0.1))
    assert decide(flat, ONE).status != PASSED  # the default demands better throughput
    ni = GateConfig(max_attempts=1, throughput_test="non_inferiority", throughput_tolerance=0.05)
    v = decide(flat, ni)
    assert v.passed and next(c for c in v.checks if c.name == "output_tok_per_s@c1").margin < 0


def test_fewer_groups_than_the_minimum_is_inconclusive():
    v = decide(bench(base=BASE[:5], gain=(3.0,) * 5, al=(0.3,) * 5, aa=(0.0,) * 5), GateConfig(max_attempts=4))
    assert v.status == INCONCLUSIVE and "5 prompt groups measured, the gate needs 6" in v.reason
    assert v.final and v.reason.startswith("inconclusive after 1 benchmark(s)")  # more rounds add no groups
    assert decide(bench(base=BASE[:5], gain=(3.0,) * 5, al=(0.3,) * 5, aa=(0.0,) * 5),
                  GateConfig(max_attempts=1, min_clusters=5)).passed


def test_an_aa_control_that_leaves_out_zero_voids_the_attempt():
    """The live head measured against itself is 1.5 tok/s faster in every group: load changed under the
    bench. The candidate's clear gain is not trusted; the attempt is void."""
    v = decide(bench(aa=(1.5, 1.4, 1.6, 1.5, 1.3, 1.7, 1.5, 1.4)), ONE)
    assert v.status == INCONCLUSIVE and v.voided == [1]
    assert "attempt 1 void" in v.reason and "load changed under the bench" in v.reason


def test_attempts_pool_and_are_tested_at_the_spent_level():
    """Two attempts each too noisy alone; pooled (the same groups, twice the rounds) they pass at the
    level of look 2 of 2. Each look's level is 0.05 / 2, not 0.05."""
    gate = GateConfig(max_attempts=2)
    a = bench(gain=(3.5, -1.5, 4.0, -0.5, 2.5, -1.0, 4.0, 1.0))
    b = bench(gain=(-1.0, 3.5, -0.5, 4.0, -1.0, 2.5, 1.0, 4.0))
    first = decide([a], gate)
    assert first.status == INCONCLUSIVE and not first.final and first.level == pytest.approx(0.025)
    assert first.level < 0.05 and "inconclusive after" not in first.reason
    assert decide([b], ONE).passed and decide([b], gate).status == INCONCLUSIVE  # b alone passes only at 0.05
    second = decide([a, b], gate)
    assert second.passed and second.attempts == 2
    assert decide([b, a], gate).passed  # pooling does not depend on the order


def test_a_look_that_passes_at_005_can_stay_inconclusive_when_more_looks_are_planned():
    gain = (3.0, -1.0, 4.0, 0.0, 2.5, -0.5, 4.0, 1.0)
    assert decide(bench(gain=gain), ONE).passed
    v = decide(bench(gain=gain), GateConfig(max_attempts=4))
    assert v.status == INCONCLUSIVE and v.level == pytest.approx(look_level(0.05, 4)) == pytest.approx(0.0125)


def test_a_voided_attempt_joins_no_pool():
    gate = GateConfig(max_attempts=3)
    good = bench(gain=(3.0, -1.0, 4.0, 0.0, 2.5, -0.5, 4.0, 1.0))
    void = bench(gain=(30.0,) * 8, aa=(1.5, 1.4, 1.6, 1.5, 1.3, 1.7, 1.5, 1.4))
    v = decide([good, void], gate)
    assert v.status == INCONCLUSIVE and v.voided == [2]
    third = decide([good, void, good], gate)
    assert third.voided == [2] and third.status == INCONCLUSIVE and "inconclusive after 3 benchmark(s)" in third.reason
    c = next(c for c in third.checks if c.name == "output_tok_per_s@c1")
    assert c.estimate == pytest.approx(sum((3.0, -1.0, 4.0, 0.0, 2.5, -0.5, 4.0, 1.0)) / 8, abs=0.02)  # not +30


NEAR_MARGIN = (0.05, -0.02, 0.06, 0.0, 0.04, -0.01, 0.05, 0.02)  # acceptance gain per group: mean 0.024


def replayed(res: BenchResult, rounds: int = 2, vary: bool = False, arms: tuple[str, ...] | None = None,
             control_differs: bool = False) -> BenchResult:
    """``res`` with the request records of ``rounds`` replays of each group's prompt by each arm (or ``arms``),
    drafting and accepting the same every time unless ``vary`` (the candidate) or ``control_differs``."""
    res.request_records = [RequestRecord(arm, rnd, 0, 1, cl.prompts[0], True, 32, drafts=24.0,
                                         accepted=7.0 + (rnd if vary and arm == CANDIDATE else 0)
                                         + (1 if control_differs and arm == CONTROL else 0))
                           for rnd in range(rounds) for cl in res.clusters for arm in cl.arms
                           if arms is None or arm in arms]
    return res


def test_an_acceptance_check_that_replays_cannot_change_ends_the_attempts():
    """Greedy acceptance repeats exactly on a replay: when the next attempt would replay the same prompt groups,
    an acceptance check that cannot tell now cannot tell then either, and the candidate cannot pass."""
    gate = GateConfig(max_attempts=2)
    first = replayed(bench(al=NEAR_MARGIN))
    assert acceptance_repeats([first])
    open_ = decide([first], gate)  # new prompt groups still to come: measure again
    assert open_.status == INCONCLUSIVE and not open_.final
    assert next(c for c in open_.checks if c.name == "mean_acceptance_length").status == INCONCLUSIVE
    v = decide([first], gate, more_prompts=False)
    assert v.status == INCONCLUSIVE and v.final and v.reason.startswith("inconclusive after 1 benchmark(s)")
    assert "replay the same prompt groups" in v.reason and "cannot pass" in v.reason
    # a second attempt on the same groups would have given the same interval (same level at every look)
    again = decide([first, replayed(bench(al=NEAR_MARGIN))], gate)
    acc = [next(c for c in x.checks if c.name == "mean_acceptance_length") for x in (open_, again)]
    assert acc[0].ci == pytest.approx(acc[1].ci) and acc[1].status == INCONCLUSIVE


def test_replays_that_differ_or_were_not_recorded_keep_the_attempts_going():
    gate = GateConfig(max_attempts=2)
    for res in (replayed(bench(al=NEAR_MARGIN), vary=True), bench(al=NEAR_MARGIN),  # sampled, no records
                replayed(bench(al=NEAR_MARGIN), rounds=1, arms=(CANDIDATE, LIVE)),  # nothing replayed yet
                replayed(bench(al=NEAR_MARGIN), rounds=1, control_differs=True)):  # the A/A replay differs
        assert not acceptance_repeats([res])
        assert not decide([res], gate, more_prompts=False).final
    # an acceptance check that passes leaves throughput, which replays do change, to more attempts
    noisy_tps = replayed(bench(gain=(3.5, -1.5, 4.0, -0.5, 2.5, -1.0, 4.0, 1.0)))
    v = decide([noisy_tps], gate, more_prompts=False)
    assert v.status == INCONCLUSIVE and not v.final


def test_an_attempt_stops_after_a_round_when_its_acceptance_cannot_pass():
    """One round shows acceptance repeating (the A/A control replays the live head's prompts); an acceptance check
    that cannot pass then stays so through the rounds left, which the bench does not run."""
    gate = GateConfig(max_attempts=2)
    partial = replayed(bench(al=NEAR_MARGIN), rounds=1)
    why = round_futility([partial], gate)
    assert why and "cannot tell yet" in why and "cannot move it" in why
    # the interval it read is the one the whole attempt's look would have read: the same check
    full = decide([replayed(bench(al=NEAR_MARGIN))], gate)
    acc = next(c for c in full.checks if c.name == "mean_acceptance_length")
    assert acc.status == INCONCLUSIVE and f"[{acc.ci[0]:.4g}, {acc.ci[1]:.4g}]" in why
    worse = replayed(bench(al=tuple(-0.2 for _ in NEAR_MARGIN)), rounds=1)
    assert "not better by the margin" in round_futility([worse], gate)
    # acceptance that passes leaves the rounds to throughput; replays that differ prove nothing
    assert round_futility([replayed(bench(), rounds=1)], gate) is None
    assert round_futility([replayed(bench(al=NEAR_MARGIN), rounds=1, control_differs=True)], gate) is None
    assert round_futility([bench(al=NEAR_MARGIN)], gate) is None  # no request records
    # pooled with an earlier attempt, as the look will be: a strong first attempt carries a weak second
    assert round_futility([replayed(bench()), replayed(bench(al=NEAR_MARGIN), rounds=1)], gate) is None


def first_round(res: BenchResult, planned: int = 2) -> BenchResult:
    """``res`` as the first round of an attempt that planned ``planned`` rounds."""
    res.rounds, res.planned_rounds = 1, planned
    return res


def test_the_looks_of_an_attempt_share_its_level():
    for share, rounds, want in ((0.0, 2, (0.0, 0.025)), (0.25, 2, (0.00625, 0.01875)), (0.25, 1, (0.0, 0.025))):
        gate = GateConfig(max_attempts=2, first_round_share=share)
        first, last = attempt_levels(gate, 2, rounds)
        assert (first, last) == pytest.approx(want)
        assert 2 * (first + last) == pytest.approx(gate.level)  # every look of the cycle: at most alpha


def test_a_clearly_better_candidate_is_promoted_at_the_look_after_the_first_round():
    gate = GateConfig(max_attempts=2, first_round_share=0.25)
    first, last = attempt_levels(gate, 2, 2)
    why = round_look([first_round(replayed(bench(), rounds=1))], gate)
    assert why and why.startswith("every check passed at the look after the first round")
    v = decide([first_round(replayed(bench(), rounds=1))], gate)  # what the cycle then reads: the same look
    assert v.passed and v.level == pytest.approx(first)
    # throughput at that look's level; acceptance, which the rounds repeat, at the attempt's (one test)
    assert {c.name: c.level for c in v.checks} == pytest.approx({"mean_acceptance_length": 0.025,
                                                                 "output_tok_per_s@c1": first})
    # a whole attempt is read at its last look's level, never at the first one's
    whole = decide([bench()], gate)
    assert whole.passed and whole.level == pytest.approx(last)
    # without the share there is no such look: the rounds go on
    assert round_look([first_round(replayed(bench(), rounds=1))], GateConfig(max_attempts=2)) is None


def test_a_candidate_better_only_within_the_last_looks_level_runs_its_rounds():
    """At the first round's smaller level a modest gain cannot show: no stop, and the same data read at the last
    look's level would pass (the rounds left then decide)."""
    gate = GateConfig(max_attempts=2, first_round_share=0.25)
    modest = dict(gain=(1.0, -0.2, 2.0, 0.4, 1.6, 0.0, 1.8, 0.5))
    assert round_look([first_round(replayed(bench(**modest), rounds=1))], gate) is None
    assert decide([bench(**modest)], gate).passed
    v = decide([first_round(bench(**modest))], gate)  # such a round alone, read as the cycle would read it
    assert not v.passed and v.level == pytest.approx(attempt_levels(gate, 2, 2)[1])
    assert v.status == INCONCLUSIVE and "stopped after 1 of 2 rounds" in v.reason


def test_acceptance_keeps_the_attempts_whole_level_when_replays_repeat_it():
    """Repeating replays give both looks of an attempt the same acceptance interval: one test at the attempt's
    level; throughput, which rounds move, has the look's. Where replays differ, acceptance has the look's too."""
    gate = GateConfig(max_attempts=2, first_round_share=0.25)
    first, last = attempt_levels(gate, 2, 2)
    near = dict(al=(0.05, 0.0, 0.07, 0.01, 0.06, 0.0, 0.07, 0.03))  # a lower bound between the two levels' bounds
    for replays, want in ((replayed(bench(**near)), 0.025), (replayed(bench(**near), vary=True), last),
                          (bench(**near), last)):  # repeats, sampled, no records
        acc = next(c for c in decide([replays], gate).checks if c.name == "mean_acceptance_length")
        assert acc.level == pytest.approx(want)
    strict = next(c for c in decide([replayed(bench(**near), vary=True)], gate).checks
                  if c.name == "mean_acceptance_length")
    whole = next(c for c in decide([replayed(bench(**near))], gate).checks if c.name == "mean_acceptance_length")
    assert whole.ci[0] > strict.ci[0]
    tps = next(c for c in decide([replayed(bench(**near))], gate).checks if c.name == "output_tok_per_s@c1")
    assert tps.level == pytest.approx(last)


def test_a_candidate_that_fails_requests_is_rejected():
    v = decide(bench(failed=(3, 0)), ONE)
    assert v.status == REJECTED and "failed 3 requests" in v.reason


def test_the_verdict_survives_its_json():
    v = decide(bench(), GateConfig())
    back = Verdict.from_json(v.to_json())
    assert back.to_json() == v.to_json() and back.checks[0].ok


def test_bootstrap_verdict_says_why():
    v = bootstrap_verdict()
    assert v.passed and "bootstrap" in v.reason and v.to_json()["verdict"] == "passed"


def test_power_plan_from_a_bench():
    p = power_plan(bench(), GateConfig())
    tps = p["output_tok_per_s@c1"]
    assert tps["groups"] == 8 and tps["sd_per_group"] > 0 and 0 < tps["power"] <= 1
    assert tps["groups_for_target"] >= 6 and p["mean_acceptance_length"]["effect_beyond_margin"] == pytest.approx(0.08)
    assert tps["prompts_for_target"] == tps["groups_for_target"]  # one prompt per group in this bench
    noisy = power_plan(bench(gain=(8.0, -6.0, 9.0, -5.0, 7.0, -4.0, 6.0, -3.0)), GateConfig())["output_tok_per_s@c1"]
    assert noisy["power"] < tps["power"] and noisy["groups_for_target"] > tps["groups_for_target"]


def offline(cand: list[tuple[int, int]], live: list[tuple[int, int]]) -> dict:
    """compare_heads' shape: per-prompt [drafts, accepted] of each head."""
    return {CANDIDATE: {"per_prompt": [list(x) for x in cand]}, LIVE: {"per_prompt": [list(x) for x in live]}}


def test_the_offline_prescreen_rejects_a_candidate_confidently_not_better():
    live = [(50, 10 + i) for i in range(8)]  # acceptance length 1.2 .. 1.34 per prompt
    same = offline([(50, a + (1 if i % 2 else -1)) for i, (_, a) in enumerate(live)], live)  # ±0.02 per prompt
    v = prescreen(same, GateConfig())
    assert v is not None and v.status == REJECTED and v.final and "offline" in v.reason
    c = offline_check(same, GateConfig())
    assert c.ci[1] <= 0.02  # the rejection's reason: the upper bound is at or below the margin


def test_the_offline_prescreen_never_promotes_and_lets_the_bench_decide_otherwise():
    live = [(50, 10 + i) for i in range(8)]
    better = offline([(50, a + 10) for _, a in live], live)  # +0.2 per prompt
    assert offline_check(better, GateConfig()).status == PASSED and prescreen(better, GateConfig()) is None
    noisy = offline([(50, a + (15 if i % 2 else -14)) for i, (_, a) in enumerate(live)], live)
    lenient = GateConfig(offline_futility=False)
    assert offline_check(noisy, lenient).status == INCONCLUSIVE and prescreen(noisy, lenient) is None
    few = offline([(50, 10)] * 3, [(50, 10)] * 3)  # fewer prompts than min_clusters: no decision
    for gate in (GateConfig(), lenient):
        assert offline_check(few, gate).status == INCONCLUSIVE and prescreen(few, gate) is None


def test_the_offline_futility_rule_rejects_what_the_benchs_acceptance_check_could_not_pass():
    """A candidate a little better offline, but not by the margin at the level a bench look of acceptance gets
    (α / max_attempts), is refused before any engine time; one that passes at that level goes on to the bench."""
    live = [(50, 10 + i) for i in range(12)]
    slight = offline([(50, a + (3 if i % 2 else 0)) for i, (_, a) in enumerate(live)], live)  # +0.03 on average
    gate = GateConfig()
    assert offline_check(slight, gate).status == INCONCLUSIVE  # not confidently worse: the old rule benches it
    v = prescreen(slight, gate)
    assert v is not None and v.status == REJECTED and v.final and "would not pass" in v.reason
    assert v.level == pytest.approx(gate.level / gate.max_attempts) and v.checks[0].ci[0] < gate.min_acceptance_gain
    assert prescreen(slight, GateConfig(offline_futility=False)) is None
    clear = offline([(50, a + (4 if i % 2 else 3)) for i, (_, a) in enumerate(live)], live)  # +0.07, tight
    assert prescreen(clear, gate) is None


def test_the_attempts_are_sized_from_the_last_cycles_noise_within_twice_the_default_budget():
    """A quiet machine keeps the default bench; a noisy one gets more prompts per attempt (new ones for every
    attempt where the held-out set has them, in smaller groups only then), or the same prompts replayed more
    often where the set is small, never more than twice the default's replays, never more prompts than the
    held-out set holds; the cheapest shape that reaches [gate] power_target, else the most powerful; with no
    earlier bench, the default."""
    from settings.config import BenchConfig

    b = BenchConfig()
    none = size_attempts([], GateConfig(), b, 1000)
    assert (none.prompts, none.rounds, none.group_size, none.budget) == (32, 2, 4, 1.0) and "no earlier" in none.why
    quiet = size_attempts([bench()] * 3, GateConfig(), b, 1000)
    assert (quiet.prompts, quiet.rounds, quiet.budget) == (32, 2, 1.0) and quiet.power >= 0.95
    loud_gain, loud_aa = (16.0, -12.0, 18.0, -10.0, 14.0, -8.0, 12.0, -6.0), (4.0, -5.0, 3.0, -4.0, 5.0, -3.0, 4.0, -4.0)
    loud = bench(gain=loud_gain, aa=loud_aa)
    busy = size_attempts([loud] * 3, GateConfig(), b, 1000, target=0.8)
    assert 1.0 < busy.budget <= 2.0 and busy.prompts * busy.rounds > 64 and 0.8 <= busy.power < 0.95
    assert (busy.prompts, busy.rounds, busy.group_size) == (96, 1, 4)  # the cheapest that does: one round, 1.5x
    sure = size_attempts([loud] * 3, GateConfig(), b, 1000)  # the default target, 95%: shorter turns too
    assert (sure.prompts, sure.rounds, sure.group_size, sure.budget) == (128, 1, 2, 2.0) and sure.power >= 0.95
    assert sure.power == pytest.approx(math.prod(sure.predicted.values()))  # a promotion needs every check
    few = size_attempts([loud], GateConfig(), b, 32)  # nothing bigger to replay than 32 prompts: more rounds
    assert (few.prompts, few.rounds, few.group_size, few.budget) == (32, 4, 4, 2.0) and few.power < 0.5
    louder = bench(gain=tuple(1.5 * x for x in loud_gain), aa=tuple(1.5 * x for x in loud_aa))
    most = size_attempts([louder], GateConfig(), b, 1000)
    assert most.budget == 2.0 and most.power < 0.95 and "no shape within 2x" in most.why  # the most powerful
    capped = size_attempts([loud] * 3, GateConfig(most_budget=1.0), b, 1000)  # the demo's cap: no more replays
    assert capped.budget == 1.0 and capped.prompts * capped.rounds == 64 and "within 1x" in capped.why
    assert busy.to_json()["prompts"] == busy.prompts and set(busy.predicted) == {"mean_acceptance_length",
                                                                                 "output_tok_per_s@c1"}


def test_a_weaker_check_at_one_concurrency_gets_more_of_the_replays_where_the_held_out_set_has_the_prompts():
    """Benches at c=1 and c=4 with the same noise per group: c=4 cuts fewer groups (each holds a wave), so its
    check is the weaker; within the same replays the sizing gives c=4 more of the prompts and c=1 fewer, and
    predicts more power than any even shape; a held-out set without the prompts keeps every concurrency even."""
    from settings.config import BenchConfig

    b = BenchConfig()
    loud = bench(gain=(16.0, -12.0, 18.0, -10.0, 14.0, -8.0, 12.0, -6.0), aa=(4.0, -5.0, 3.0, -4.0, 5.0, -3.0, 4.0,
                                                                                -4.0), concs=(1, 4))
    split = size_attempts([loud] * 3, GateConfig(), b, 1000)
    assert split.prompts_at == {1: 112, 4: 144} and split.prompts == 144 and split.budget == 2.0
    assert "112 at c=1, 144 at c=4 prompts" in split.why and split.to_json()["prompts_at"] == {"1": 112, "4": 144}
    assert split.predicted["output_tok_per_s@c4"] > size_attempts([loud] * 3, GateConfig(), b, 1000,
                                                                   target=0.8).predicted["output_tok_per_s@c4"]
    small = size_attempts([loud] * 3, GateConfig(), b, 130)  # 144 prompts are more than the set has
    assert small.prompts_at == {} and small.prompts <= 130
