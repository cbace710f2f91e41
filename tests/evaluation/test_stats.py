"""The statistics under the gate: t-quantiles, cluster t-intervals, rounds merged per group, sequential levels, power."""

from __future__ import annotations

import math
import random

import pytest

from evaluation.result import analyze
from evaluation.stats import (CANDIDATE, CONTROL, LIVE, Cluster, ClusterSums, clusters_needed, contrast,
                              look_level, normal_ppf, pocock_level, pool_clusters, power, t_cdf, t_interval, t_ppf)
from tests.bench_sim import ARMS, CONCS, simulate, slots_for


@pytest.mark.parametrize("p,df,want", [(0.95, 1, 6.313752), (0.95, 5, 2.015048), (0.975, 7, 2.364624),
                                       (0.995, 3, 5.840909), (0.9, 30, 1.310415), (0.95, math.inf, 1.644854)])
def test_t_quantiles_match_the_tables(p, df, want):
    assert t_ppf(p, df) == pytest.approx(want, abs=1e-5)
    assert t_cdf(want, df) == pytest.approx(p, abs=1e-6) and t_ppf(1 - p, df) == pytest.approx(-want, abs=1e-5)


def test_the_t_interval_is_mean_plus_minus_t_times_the_standard_error():
    xs = [1.0, 2.0, 4.0, 3.0, 5.0, 6.0]
    iv = t_interval(xs, 0.9)
    sd = math.sqrt(sum((x - 3.5) ** 2 for x in xs) / 5)
    half = t_ppf(0.95, 5) * sd / math.sqrt(6)
    assert (iv.estimate, iv.lo, iv.hi, iv.clusters) == (pytest.approx(3.5), pytest.approx(3.5 - half),
                                                         pytest.approx(3.5 + half), 6)
    assert iv.sd == pytest.approx(sd)
    one = t_interval([2.0], 0.9)
    assert one.estimate == 2.0 and one.lo is None and one.clusters == 1  # one cluster: no interval at all


def test_the_t_interval_covers_at_its_level_with_few_clusters():
    """Six skewed clusters: the t-interval's one-sided miss rate stays near 5% (a normal quantile's would not)."""
    rng = random.Random(0)
    miss_t = miss_z = 0
    n = 4000
    for _ in range(n):
        xs = [rng.gauss(0, 1) for _ in range(6)]
        iv = t_interval(xs, 0.9)
        miss_t += iv.lo > 0
        m, sd = sum(xs) / 6, iv.sd
        miss_z += m - normal_ppf(0.95) * sd / math.sqrt(6) > 0
    assert abs(miss_t / n - 0.05) < 0.012 and miss_z / n > 0.065


def test_rounds_of_a_group_are_one_cluster():
    """Two rounds replay the same prompt groups: the intervals have as many clusters as groups, not slots,
    and with greedy acceptance (the same in both rounds) the acceptance interval does not narrow."""
    one = analyze(simulate(slots_for(rounds=1), {CANDIDATE: 1.1, LIVE: 1.0, CONTROL: 1.0}), ARMS, CONCS, 0.9)
    two = analyze(simulate(slots_for(rounds=2), {CANDIDATE: 1.1, LIVE: 1.0, CONTROL: 1.0}), ARMS, CONCS, 0.9)
    assert [c.rounds for c in two.clusters] == [2] * len(two.clusters)
    assert two.differences.tok_per_s(1).clusters == one.differences.tok_per_s(1).clusters == 6
    assert two.differences.tok_per_s(1).pairs == 2 * one.differences.tok_per_s(1).pairs


def _cluster(prompts, c, rounds, **arms):
    return Cluster(c, prompts, rounds, {a: ClusterSums(requests=len(prompts), tokens=t, latency_s=lat)
                                        for a, (t, lat) in arms.items()})


def test_attempts_pool_group_by_group():
    a = [_cluster([0, 1], 1, 2, candidate=(100, 10), live=(100, 12)), _cluster([2, 3], 1, 2, candidate=(50, 5),
                                                                                  live=(50, 5))]
    b = [_cluster([0, 1], 1, 2, candidate=(100, 10), live=(100, 8))]
    pooled = pool_clusters([a, b])
    assert [(c.prompts, c.rounds) for c in pooled] == [([0, 1], 4), ([2, 3], 2)]
    assert pooled[0].arms[LIVE].tokens == 200 and pooled[0].arms[LIVE].latency_s == 20


def test_a_relative_margin_is_tested_exactly_and_shown_as_a_difference():
    cl = [_cluster([i], 1, 1, candidate=(110 + i, 10), live=(100 + i, 10), control=(100 + i, 10)) for i in range(6)]
    plain = contrast(cl, "output_tok_per_s", 1, CANDIDATE, [LIVE, CONTROL], 0.9)
    rel = contrast(cl, "output_tok_per_s", 1, CANDIDATE, [LIVE, CONTROL], 0.9, ref_factor=1.05)
    assert plain.estimate == pytest.approx(1.0) and rel.estimate == pytest.approx(1.0)
    # Same units, another statistic: x − 1.05·ref varies with the reference from group to group, x − ref does not.
    assert plain.sd == pytest.approx(0.0, abs=1e-12) and rel.sd == pytest.approx(0.05 * 0.1 * math.sqrt(3.5), rel=1e-6)
    assert plain.lo == pytest.approx(1.0) and rel.lo < 1.0 < rel.hi


def test_pocock_levels_match_the_published_boundaries():
    # one-sided 0.05: z = 1.645, 1.875, 1.992, 2.067, 2.122 for 1-5 equally spaced looks (Pocock 1977)
    for looks, z in ((1, 1.645), (2, 1.875), (3, 1.992), (4, 2.067), (5, 2.122)):
        assert normal_ppf(1 - pocock_level(0.05, looks)) == pytest.approx(z, abs=2e-3)


def test_pocock_keeps_the_false_promotion_rate_over_pooled_looks():
    """Null data looked at after each of 4 attempts, each pooled with the earlier ones: testing every look at
    0.05 promotes far more than 5%; Pocock's level keeps it at 5%."""
    rng = random.Random(1)
    n, hits_naive, hits_pocock = 4000, 0, 0
    lvl = pocock_level(0.05, 4)
    for _ in range(n):
        xs: list[float] = []
        naive = pocock = False
        for _look in range(4):
            xs += [rng.gauss(0, 1) for _ in range(25)]
            z = sum(xs) / math.sqrt(len(xs))
            naive |= z > normal_ppf(0.95)
            pocock |= z > normal_ppf(1 - lvl)
        hits_naive += naive
        hits_pocock += pocock
    assert hits_naive / n > 0.10 and abs(hits_pocock / n - 0.05) < 0.012


def test_power_and_the_clusters_it_needs():
    assert power(1.0, 1.0, 8, 0.05) == pytest.approx(0.84, abs=0.04)  # d = 1 with 8 clusters
    j = clusters_needed(0.5, 1.0, 0.05, 0.8)
    assert power(0.5, 1.0, j, 0.05) >= 0.8 > power(0.5, 1.0, j - 1, 0.05)
    assert clusters_needed(10.0, 1.0, 0.05, 0.8, min_clusters=6) == 6  # never below the gate's minimum
    assert clusters_needed(0.001, 1.0, 0.05, 0.8, most=100) is None


def test_clopper_pearson_matches_the_beta_quantiles():
    # Beta(k, n-k+1) at 2.5% and Beta(k+1, n-k) at 97.5% (the exact interval), from tables
    from evaluation.stats import clopper_pearson

    assert clopper_pearson(0, 16) == (0.0, pytest.approx(0.20591, abs=1e-5))
    assert clopper_pearson(12, 16) == (pytest.approx(0.47623, abs=1e-5), pytest.approx(0.92734, abs=1e-5))
    assert clopper_pearson(100, 2000) == (pytest.approx(0.04086, abs=1e-5), pytest.approx(0.06048, abs=1e-5))


def test_the_looks_of_a_cycle_split_the_level():
    assert look_level(0.05, 1) == 0.05 and look_level(0.05, 2) == pytest.approx(0.025)
    assert look_level(0.05, 4) == pytest.approx(0.0125) and look_level(0.05, 4) < pocock_level(0.05, 4)

