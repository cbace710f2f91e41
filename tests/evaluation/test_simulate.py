"""The gate's simulator (``evaluation.simulate``): its fast cluster sums are the analysis' own (no services)."""

from __future__ import annotations

import pytest

from evaluation.bench import plan
from evaluation.result import analyze
from evaluation.simulate import Heads, World, bench_result, blocks_of, clusters_of, draw, heavy, quiet
from evaluation.stats import CANDIDATE, CONTROL, LIVE, NOSPEC


@pytest.mark.parametrize("arms", [[CANDIDATE, LIVE, CONTROL], [CANDIDATE, LIVE, CONTROL, NOSPEC]])
def test_the_fast_clusters_are_what_the_analysis_builds_from_the_blocks(arms):
    """The simulation's thousands of cycles skip the blocks; what the gate reads must not change by it."""
    heads = Heads(speed_at={4: 1.2})
    world = World.make(64, heads, 3)
    slots = plan(arms, 32, [1, 4], 2, 4, seed=5, first_prompt=32)
    d = draw(slots, heads, heavy(), world, 7)
    slow = analyze(blocks_of(d), arms, [1, 4], 0.9).clusters
    fast = clusters_of(d)
    assert [c.key for c in slow] == [c.key for c in fast] and all(c.prompts[0] >= 32 for c in fast)
    for a, b in zip(slow, fast):
        assert a.rounds == b.rounds == 2 and set(a.arms) == set(b.arms) == set(arms)
        for role in arms:
            for k, v in a.arms[role].to_json().items():
                if k not in ("itl_sum_s", "itl_n"):
                    assert getattr(b.arms[role], k) == pytest.approx(v, rel=1e-9, abs=1e-12), (role, k)
    r = bench_result(slots, heads, heavy(), world, 7, [1, 4], 0.9)
    assert [c.key for c in r.clusters] == [c.key for c in fast] and set(r.arms) == set(arms)


def test_the_same_seed_draws_the_same_run_and_heavy_noise_is_noisier():
    heads = Heads()
    world = World.make(32, heads, 1)
    slots = plan([CANDIDATE, LIVE, CONTROL], 32, [1], 2, 4, seed=0)
    a, b = draw(slots, heads, heavy(), world, 3), draw(slots, heads, heavy(), world, 3)
    assert (a.latency == b.latency).all()
    spread = {name: draw(slots, heads, n, world, 3).latency.std() for name, n in (("quiet", quiet()), ("heavy", heavy()))}
    assert spread["heavy"] > spread["quiet"]
    # greedy acceptance repeats exactly: the same prompt drafts the same in every round and under any load
    c = draw(slots, heads, quiet(), world, 4)
    assert (a.acceptance == c.acceptance).all()
