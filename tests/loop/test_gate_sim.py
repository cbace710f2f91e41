"""The gate against the simulator that tries to fool it (``evaluation.simulate``): false promotions stay at
the stated level, and a really better head is promoted (cheap: a few hundred simulated cycles).

The full calibration and power table is ``benchmarks/gate_sim.py`` (docs/benchmarks.md).
"""

from __future__ import annotations

from evaluation.bench import plan
from evaluation.result import analyze
from evaluation.simulate import Heads, World, loaded, quiet, simulate
from evaluation.stats import CANDIDATE, CONTROL, LIVE
from loop.gate import PASSED, decide
from settings.config import GateConfig

ARMS = [CANDIDATE, LIVE, CONTROL]


def cycle(heads: Heads, noise, gate: GateConfig, seed: int, prompts: int = 32, concs=(1, 4)) -> str:
    world = World.make(prompts, heads, seed)
    results = []
    for attempt in range(gate.max_attempts):
        slots = plan(ARMS, prompts, list(concs), 2, 4, seed * 7 + attempt, gate.min_clusters)
        results.append(analyze(simulate(slots, heads, noise, world, seed * 1000 + attempt), ARMS, list(concs),
                               gate.confidence, records=False))
        v = decide(results, gate)
        if v.final:
            break
    return v.status


def test_a_head_no_faster_is_promoted_at_most_at_the_stated_level_even_over_four_pooled_attempts():
    """Throughput exactly equal at c=1, clearly better at c=4, acceptance far above its margin: only the c=1
    check stands between this head and a promotion (the null that tests the level hardest). Heavy-tailed,
    bursty, autocorrelated load; 4 pooled attempts each."""
    gate = GateConfig(max_attempts=4)
    heads = Heads({CANDIDATE: 1.0, LIVE: 1.0, CONTROL: 1.0}, {CANDIDATE: 1.8, LIVE: 1.5, CONTROL: 1.5},
                  speed_at={4: 1.3})
    for noise in (quiet(), loaded()):
        promoted = sum(cycle(heads, noise, gate, seed) == PASSED for seed in range(150))
        assert promoted <= 150 * gate.level + 5, promoted  # 7.5 expected at exactly the level


def test_a_head_at_the_acceptance_margin_is_promoted_at_most_at_the_level_with_six_prompts():
    gate = GateConfig()
    heads = Heads({CANDIDATE: 1.2, LIVE: 1.0, CONTROL: 1.0}, {CANDIDATE: 1.52, LIVE: 1.5, CONTROL: 1.5})
    promoted = sum(cycle(heads, quiet(), gate, seed, prompts=6, concs=(1,)) == PASSED for seed in range(200))
    assert promoted <= 200 * gate.level + 6, promoted


def test_a_head_ten_percent_faster_and_better_by_a_tenth_is_promoted_at_quiet_noise():
    gate = GateConfig()
    heads = Heads({CANDIDATE: 1.1, LIVE: 1.0, CONTROL: 1.0}, {CANDIDATE: 1.6, LIVE: 1.5, CONTROL: 1.5})
    promoted = sum(cycle(heads, quiet(), gate, seed) == PASSED for seed in range(40))
    assert promoted >= 32, promoted  # 80%
