"""The gate against the simulator that tries to fool it (``evaluation.simulate``): false promotions stay at
the stated level on every path, and a really better head is promoted (cheap: a few hundred simulated cycles).

The full calibration and power table is ``benchmarks/gate_sim.py`` (docs/benchmarks.md).
"""

from __future__ import annotations

from evaluation.bench import cycle_seed, plan
from evaluation.simulate import Heads, World, bench_result, heavy, quiet
from evaluation.stats import CANDIDATE, CONTROL, LIVE, NOSPEC
from loop.gate import INCONCLUSIVE, PASSED, decide
from settings.config import GateConfig

ARMS = [CANDIDATE, LIVE, CONTROL]


def cycle(heads: Heads, noise, gate: GateConfig, seed: int, prompts: int = 32, concs=(1, 4), nospec: bool = False,
          batches: int = 1, rounds: int = 2) -> str:
    """One cycle as ``loop.cycle.step_bench`` runs it: orders seeded from its id, the no-speculation arm in
    the first attempt only, attempt n on prompt batch n (``batches`` new ones, else the same again)."""
    world = World.make(prompts * batches, heads, seed)
    arrays = world.arrays()
    results = []
    for n in range(1, gate.max_attempts + 1):
        arms = ARMS + ([NOSPEC] if nospec and n == 1 else [])
        slots = plan(arms, prompts, list(concs), rounds, 4, cycle_seed(f"t{seed}", n - 1), gate.min_clusters,
                     first_prompt=((n - 1) % batches) * prompts)
        results.append(bench_result(slots, heads, noise, world, seed * 1000 + n, list(concs), gate.confidence,
                                    arrays))
        v = decide(results, gate)
        if v.status != INCONCLUSIVE or v.final:
            break
    return v.status


def test_a_head_no_faster_at_c1_is_promoted_at_most_at_the_stated_level_on_every_path():
    """Throughput exactly equal at c=1, clearly better at c=4, acceptance far above its margin: only the c=1
    check stands between this head and a promotion (the null that tests the level hardest). Quiet and heavy
    bursty load; with and without the no-speculation arm in the first attempt (the prompt groups must not
    change with it); 4 pooled attempts."""
    gate = GateConfig(max_attempts=4)
    heads = Heads({CANDIDATE: 1.0, LIVE: 1.0, CONTROL: 1.0, NOSPEC: 1.1}, {CANDIDATE: 1.8, LIVE: 1.5, CONTROL: 1.5},
                  speed_at={4: 1.3})
    for noise in (quiet(), heavy()):
        for nospec in (False, True):
            promoted = sum(cycle(heads, noise, gate, seed, nospec=nospec) == PASSED for seed in range(120))
            assert promoted <= 120 * gate.level + 4, (noise, nospec, promoted)  # 6 expected at exactly the level


def test_a_head_at_the_acceptance_margin_is_promoted_at_most_at_the_level_with_six_prompts():
    gate = GateConfig()
    heads = Heads({CANDIDATE: 1.2, LIVE: 1.0, CONTROL: 1.0}, {CANDIDATE: 1.52, LIVE: 1.5, CONTROL: 1.5})
    promoted = sum(cycle(heads, quiet(), gate, seed, prompts=6, concs=(1,)) == PASSED for seed in range(200))
    assert promoted <= 200 * gate.level + 6, promoted


def test_a_head_ten_percent_faster_and_better_by_a_tenth_is_promoted_at_quiet_noise():
    gate = GateConfig()
    heads = Heads({CANDIDATE: 1.1, LIVE: 1.0, CONTROL: 1.0}, {CANDIDATE: 1.6, LIVE: 1.5, CONTROL: 1.5})
    promoted = sum(cycle(heads, quiet(), gate, seed) == PASSED for seed in range(40))
    assert promoted >= 34, promoted  # 85%


def test_new_prompt_groups_give_power_on_a_busy_machine_that_replays_cannot():
    """Heavy bursty load: replaying the same 32 prompts again adds no prompt groups; one round of 128 new
    prompts per attempt (twice the default's replays) pools four times the groups."""
    gate = GateConfig()
    heads = Heads({CANDIDATE: 1.1, LIVE: 1.0, CONTROL: 1.0}, {CANDIDATE: 1.6, LIVE: 1.5, CONTROL: 1.5})
    replayed = sum(cycle(heads, heavy(), gate, seed) == PASSED for seed in range(40))
    fresh = sum(cycle(heads, heavy(), gate, seed, prompts=128, batches=2, rounds=1) == PASSED for seed in range(40))
    assert fresh >= replayed + 12 and fresh >= 16, (replayed, fresh)
