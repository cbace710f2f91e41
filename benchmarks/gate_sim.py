"""How often does the gate promote what it should not, and what it should? Measured on a simulator.

The simulator (``evaluation.simulate``) produces what the real bench measures, following
the real plan (``evaluation.bench.plan``), with the noise that fooled the earlier gate:
heavy-tailed turns and requests, autocorrelated load with bursts, a slow drift, and a
candidate whose advantage varies from prompt to prompt. Every run is analysed
(``evaluation.result.analyze``) and decided (``loop.gate.decide``) by the product's own
code, attempts pooled as a cycle pools them (``loop.cycle.step_bench``).

Scenarios, each at every setting:

* **null, throughput at c=1**: acceptance well above its margin, throughput 30% better at
  c=4 but exactly equal at c=1: one check alone stands in the way of a promotion, the
  configuration where an intersection of tests is at its stated level (with several
  checks at their null it is far below it);
* **null, acceptance**: throughput clearly better, acceptance exactly at the margin;
* **equal quality**: the same mean speed and acceptance, different per-prompt strengths;
* **better**: 10% faster and +0.1 acceptance (the power target).

For the nulls the false-promotion rate must stay at or below the gate's level
(``(1 - confidence) / 2``); for "better", power should reach 80% at quiet noise and the
default size. Under load, the script also finds the number of held-out prompts that
would give 80% power. Prints a table with Clopper-Pearson 95% intervals; writes JSON.

    python benchmarks/gate_sim.py [--runs 2000] [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from evaluation.bench import plan  # noqa: E402
from evaluation.result import analyze  # noqa: E402
from evaluation.simulate import Heads, Noise, World, loaded, quiet, simulate  # noqa: E402
from evaluation.stats import CANDIDATE, CONTROL, LIVE, NOSPEC, clopper_pearson  # noqa: E402
from loop.gate import INCONCLUSIVE, PASSED, decide  # noqa: E402
from settings.config import BenchConfig, GateConfig  # noqa: E402


@dataclass
class Setting:
    name: str
    prompts: int
    concurrencies: list[int]
    rounds: int
    attempts: int


def scenarios(margin: float) -> dict[str, Heads]:
    base = {LIVE: 1.0, CONTROL: 1.0, NOSPEC: 1.1}
    acc = {LIVE: 1.5, CONTROL: 1.5}
    return {
        "null, throughput at c=1": Heads({**base, CANDIDATE: 1.0}, {**acc, CANDIDATE: 1.8}, speed_at={4: 1.3}),
        "null, acceptance": Heads({**base, CANDIDATE: 1.15}, {**acc, CANDIDATE: 1.5 + margin}),
        "equal quality": Heads({**base, CANDIDATE: 1.0}, {**acc, CANDIDATE: 1.5}, speed_by_prompt=0.08,
                               acceptance_by_prompt=0.12),
        "better (+10% tok/s, +0.1 acc.)": Heads({**base, CANDIDATE: 1.10}, {**acc, CANDIDATE: 1.6}),
    }


def cycle_verdict(s: Setting, heads: Heads, noise: Noise, gate: GateConfig, bench: BenchConfig, seed: int) -> str:
    """One cycle: a fresh world (held-out prompts), attempts measured and pooled until the gate decides."""
    arms = [CANDIDATE, LIVE, CONTROL]
    world = World.make(s.prompts, heads, seed)
    results = []
    for attempt in range(s.attempts):
        slots = plan(arms, s.prompts, s.concurrencies, s.rounds, bench.group_size, seed * 7 + attempt,
                     gate.min_clusters)
        blocks = simulate(slots, heads, noise, world, noise_seed=seed * 1000 + attempt)
        results.append(analyze(blocks, arms, s.concurrencies, gate.confidence, records=False))
        v = decide(results, gate)
        if v.final:
            break
    return v.status


def rate(settings: list[Setting], noises: dict[str, Noise], runs: int, gate_base: GateConfig, bench: BenchConfig,
         log) -> list[dict]:
    rows = []
    for s in settings:
        gate = gate_base.model_copy(update={"max_attempts": s.attempts})
        for nname, noise in noises.items():
            for scen, heads in scenarios(gate.min_acceptance_gain).items():
                t = time.perf_counter()
                verdicts = [cycle_verdict(s, heads, noise, gate, bench, seed) for seed in range(runs)]
                k = verdicts.count(PASSED)
                lo, hi = clopper_pearson(k, runs)
                rows.append({"setting": s.name, "prompts": s.prompts, "concurrencies": s.concurrencies,
                             "rounds": s.rounds, "attempts": s.attempts, "noise": nname, "scenario": scen,
                             "promoted": k, "runs": runs, "rate": k / runs, "ci95": [lo, hi],
                             "rejected": verdicts.count("rejected"), "inconclusive": verdicts.count(INCONCLUSIVE)})
                log(f"{s.name:<34} {nname:<6} {scen:<31} promoted {k:>5}/{runs} = {k / runs:6.1%} "
                    f"[{lo:.1%}, {hi:.1%}] ({time.perf_counter() - t:.0f}s)")
    return rows


def prompts_for_power(noise: Noise, gate: GateConfig, bench: BenchConfig, runs: int, log, sizes: list[int],
                      target: float = 0.8) -> list[dict]:
    """Under load: power of the 'better' head as the held-out set grows (c = 1 and 4, 2 rounds, 2 attempts)."""
    heads = scenarios(gate.min_acceptance_gain)["better (+10% tok/s, +0.1 acc.)"]
    out = []
    for n in sizes:
        s = Setting(f"{n} prompts", n, [1, 4], 2, gate.max_attempts)
        k = sum(cycle_verdict(s, heads, noise, gate, bench, seed) == PASSED for seed in range(runs))
        lo, hi = clopper_pearson(k, runs)
        out.append({"prompts": n, "promoted": k, "runs": runs, "rate": k / runs, "ci95": [lo, hi]})
        log(f"loaded, better head, {n:>3} prompts: power {k}/{runs} = {k / runs:.1%} [{lo:.1%}, {hi:.1%}]")
        if k / runs >= target:
            break
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=2000, help="simulated cycles per scenario and setting")
    ap.add_argument("--power-runs", type=int, default=400, help="cycles per size when searching the size for 80%%")
    ap.add_argument("--quick", action="store_true", help="200 runs, for a look")
    ap.add_argument("--sizes", type=int, nargs="+", default=[32, 64, 128, 192, 256, 320, 384, 512],
                    help="held-out prompts tried for 80%% power under load (stops at the first that reaches it)")
    ap.add_argument("--power-only", action="store_true", help="only the size search under load")
    ap.add_argument("--out", type=Path, default=REPO / "gate_sim.json")
    args = ap.parse_args()
    if args.quick:
        args.runs, args.power_runs = 200, 100
    t0 = time.monotonic()

    def log(msg: str) -> None:
        sys.stderr.write(f"[gate-sim {time.monotonic() - t0:7.1f}s] {msg}\n")
        sys.stderr.flush()

    gate, bench = GateConfig(), BenchConfig()
    d = Setting("default (32 prompts, c=1,4, 2 rounds)", bench.max_prompts, list(bench.concurrencies), bench.rounds,
                gate.max_attempts)
    settings = [d,
                Setting("default, 4 attempts", d.prompts, d.concurrencies, d.rounds, 4),
                Setting("6 held-out prompts, c=1", 6, [1], 2, gate.max_attempts),
                Setting("6 held-out prompts, c=1, 4 attempts", 6, [1], 2, 4)]
    rows = [] if args.power_only else rate(settings, {"quiet": quiet(), "loaded": loaded()}, args.runs, gate, bench, log)
    sizes = prompts_for_power(loaded(), gate, bench, args.power_runs, log, args.sizes)
    level = gate.level
    lines = [f"gate on the simulator: level {level:.3g} per check (confidence {gate.confidence}), margins "
             f"+{gate.min_acceptance_gain} acceptance / +{gate.min_throughput_gain:.0%} tok/s, min "
             f"{gate.min_clusters} prompt groups, A/A voids at {gate.aa_confidence:.0%}; {args.runs} simulated "
             "cycles per row, Clopper-Pearson 95% intervals", "",
             f"{'setting':<38} {'noise':<7} {'scenario':<31} {'promoted':>9}  {'95% CI':<16} rejected inconclusive"]
    for r in rows:
        lines.append(f"{r['setting']:<38} {r['noise']:<7} {r['scenario']:<31} {r['rate']:>8.1%}  "
                     f"[{r['ci95'][0]:.1%}, {r['ci95'][1]:.1%}]{'':<3} {r['rejected']:>8} {r['inconclusive']:>12}")
    bad = [r for r in rows if r["scenario"].startswith(("null", "equal")) and r["ci95"][0] > level]
    lines += ["", "under load, the 'better' head's power by held-out prompts (c=1,4, 2 rounds, "
              f"{gate.max_attempts} attempts): " + ", ".join(f"{x['prompts']}: {x['rate']:.0%}" for x in sizes),
              "", f"false-promotion rate above the level (lower CI bound > {level:.3g}) in {len(bad)} rows",
              f"total {time.monotonic() - t0:.0f}s; result: {args.out}"]
    args.out.write_text(json.dumps({"rows": rows, "power_by_prompts_loaded": sizes, "level": level,
                                    "runs": args.runs}, indent=1))
    print("\n".join(lines))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
