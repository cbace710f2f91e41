"""How often does the gate promote what it should not, and what it should? Measured on a simulator.

The simulator (``evaluation.simulate``) produces what the real bench measures, following
the real plan (``evaluation.bench.plan``), with the noise that fooled the earlier gate:
heavy-tailed (Student-t(3)) turns and requests, AR(1) load with bursts (in the *heavy*
scenario short ones, that often slow a single arm's turn), latency spikes, prompts 4x apart
in speed, a candidate whose advantage varies from prompt to prompt, greedy acceptance that
repeats exactly across rounds and attempts. Every run is decided by the product's own gate
(``loop.gate.decide``) on the clusters the analysis would build (``evaluation.simulate.
clusters_of``, the same sums as ``evaluation.result.analyze``; a test checks they agree),
attempts pooled and stopped as a cycle does (``loop.cycle.step_bench``): orders seeded from
the cycle's id, the no-speculation arm in the first attempt only on the *nospec* path (the
demo; a DAG given ``nospec_url``), later attempts on new held-out prompt groups while the
held-out set has them, every attempt shaped by ``loop.gate.size_attempts`` from three
earlier cycles' benches on the same machine.

Settings: *plentiful held-out* (production: new prompt groups for every attempt) and *32
held-out prompts* (the default size; every attempt replays them, as the demo does).
Scenarios, each check at its margin with the others clearly passing (where an intersection
of tests is at its stated level): *null acceptance*, *null tok/s at c=1*, *null tok/s at
c=4*; and *better* (+10% tok/s, +0.1 acceptance: the power). Prints a table with
Clopper-Pearson 95% intervals, the prompt replays each cycle spent against the default
bench's most (2 attempts of 32 prompts x 2 rounds), and run times; writes JSON.

    python benchmarks/gate_sim.py [--runs 4000] [--power-runs 2000] [--quick]

``--aa-offset 0.015`` makes the A/A control 1.5% faster than the live head in every run (a
steady offset between identical arms, as a real machine sometimes shows) to see what voiding
on it costs in power.
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

from evaluation.bench import cycle_seed, plan  # noqa: E402
from evaluation.simulate import Heads, Noise, World, bench_result, heavy, quiet  # noqa: E402
from evaluation.stats import CANDIDATE, CONTROL, LIVE, NOSPEC, clopper_pearson  # noqa: E402
from loop.gate import INCONCLUSIVE, PASSED, AttemptSize, decide, size_attempts  # noqa: E402
from settings.config import BenchConfig, GateConfig  # noqa: E402

SPEC = [CANDIDATE, LIVE, CONTROL]
PLENTY = 1_000_000


@dataclass
class Setting:
    name: str
    heldout: int  # held-out prompts the cycle may replay
    nospec: bool  # the no-speculation arm in the first attempt


def scenarios(margin: float, aa_offset: float = 0.0) -> dict[str, Heads]:
    base = {LIVE: 1.0, CONTROL: 1.0 + aa_offset, NOSPEC: 1.1}
    acc = {LIVE: 1.5, CONTROL: 1.5}
    return {
        "null acceptance": Heads({**base, CANDIDATE: 1.3}, {**acc, CANDIDATE: 1.5 + margin}),
        "null tok/s c=1": Heads({**base, CANDIDATE: 1.0}, {**acc, CANDIDATE: 1.8}, speed_at={4: 1.3}),
        "null tok/s c=4": Heads({**base, CANDIDATE: 1.0}, {**acc, CANDIDATE: 1.8}, speed_at={1: 1.3}),
        "better (+10%, +0.1)": Heads({**base, CANDIDATE: 1.10}, {**acc, CANDIDATE: 1.6}),
    }


def sized(noise: Noise, heldout: int, gate: GateConfig, bench: BenchConfig, seed: int = 10**6,
          most_budget: float = 2.0, aa_offset: float = 0.0) -> AttemptSize:
    """The attempts' shape ``loop.gate.size_attempts`` picks after three default benches on this machine."""
    heads = Heads()
    heads.speed[CONTROL] += aa_offset
    world = World.make(bench.max_prompts, heads, seed)
    recent = [bench_result(plan(SPEC, bench.max_prompts, list(bench.concurrencies), bench.rounds, bench.group_size,
                                seed + k, gate.min_clusters), heads, noise, world, seed + k,
                           list(bench.concurrencies), gate.confidence) for k in range(3)]
    return size_attempts(recent, gate, bench, heldout, most_budget=most_budget)


def cycle(s: Setting, size: AttemptSize, heads: Heads, noise: Noise, gate: GateConfig, bench: BenchConfig,
          seed: int) -> tuple[str, int]:
    """One cycle: its held-out prompts, attempts measured and pooled until the gate decides; prompt replays spent."""
    concs = list(bench.concurrencies)
    p = min(size.prompts, s.heldout)
    batches = max(1, min(gate.max_attempts, s.heldout // p))
    world = World.make(p * batches, heads, seed)
    arrays = world.arrays()
    results, spent, cid = [], 0, f"sim{seed}"
    for n in range(1, gate.max_attempts + 1):
        arms = SPEC + ([NOSPEC] if s.nospec and n == 1 else [])
        slots = plan(arms, p, concs, size.rounds, size.group_size, cycle_seed(cid, bench.seed + n - 1),
                     gate.min_clusters, first_prompt=((n - 1) % batches) * p, prompts_at=size.prompts_at)
        results.append(bench_result(slots, heads, noise, world, seed * 1000 + n, concs, gate.confidence, arrays))
        spent += sum(len(x.prompts) for x in slots) / len(concs)  # per arm and concurrency
        v = decide(results, gate)
        if v.status != INCONCLUSIVE or v.final:
            break
    return v.status, spent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=4000, help="simulated cycles per null cell")
    ap.add_argument("--power-runs", type=int, default=2000, help="simulated cycles per power cell")
    ap.add_argument("--quick", action="store_true", help="400 and 200 cycles, for a look")
    ap.add_argument("--noise", nargs="+", default=["quiet", "heavy"], choices=["quiet", "heavy"])
    ap.add_argument("--settings", nargs="+", default=["plentiful", "32"], choices=["plentiful", "32"])
    ap.add_argument("--nospec", choices=["both", "yes", "no"], default="both",
                    help="the paths: with the no-speculation arm in the first attempt, without, or both")
    ap.add_argument("--no-beyond", action="store_true", help="skip the heavy power beyond twice the budget")
    ap.add_argument("--aa-offset", type=float, default=0.0,
                    help="the A/A control this much faster than the live head in every run (a steady offset "
                         "between identical arms that the design does not cancel, e.g. 0.015)")
    ap.add_argument("--out", type=Path, default=REPO / "gate_sim.json")
    args = ap.parse_args()
    if args.quick:
        args.runs, args.power_runs = 400, 200
    t0 = time.monotonic()

    def log(msg: str) -> None:
        sys.stderr.write(f"[gate-sim {time.monotonic() - t0:7.1f}s] {msg}\n")
        sys.stderr.flush()

    gate, bench = GateConfig(), BenchConfig()
    today = gate.max_attempts * bench.max_prompts * bench.rounds  # the default bench's most prompt replays
    noises = {"quiet": quiet(), "heavy": heavy()}
    settings = []
    for st in args.settings:
        held = PLENTY if st == "plentiful" else bench.max_prompts
        for nospec in {"both": (False, True), "yes": (True,), "no": (False,)}[args.nospec]:
            label = "plentiful held-out" if st == "plentiful" else f"{bench.max_prompts} held-out prompts"
            settings.append(Setting(f"{label}{', nospec arm' if nospec else ''}", held, nospec))
    rows = []
    for s in settings:
        for nname in args.noise:
            noise = noises[nname]
            size = sized(noise, s.heldout, gate, bench, aa_offset=args.aa_offset)
            log(f"{s.name}, {nname}: {size.why}")
            for scen, heads in scenarios(gate.min_acceptance_gain, args.aa_offset).items():
                runs = args.power_runs if scen.startswith("better") else args.runs
                t = time.perf_counter()
                out = [cycle(s, size, heads, noise, gate, bench, seed) for seed in range(runs)]
                k = sum(v == PASSED for v, _ in out)
                lo, hi = clopper_pearson(k, runs)
                spent = sum(x for _, x in out) / runs
                rows.append({"setting": s.name, "noise": nname, "scenario": scen, "promoted": k, "runs": runs,
                             "rate": k / runs, "ci95": [lo, hi], "rejected": sum(v == "rejected" for v, _ in out),
                             "shape": [size.prompts, size.rounds, size.group_size], "predicted_power": size.power,
                             "prompts_at": size.prompts_at,
                             "replays_per_cycle": spent, "budget_vs_default_most": spent / today,
                             "seconds": time.perf_counter() - t})
                log(f"{s.name:<32} {nname:<5} {scen:<20} promoted {k:>5}/{runs} = {k / runs:6.2%} "
                    f"[{lo:.2%}, {hi:.2%}], {spent / today:.2f}x the default's most replays "
                    f"({time.perf_counter() - t:.0f}s)")
    beyond = []
    if "heavy" in args.noise and "plentiful" in args.settings and args.nospec != "yes" and not args.no_beyond:
        # What 80% power takes on the heavy machine when the budget may grow past twice the default's.
        s = Setting("plentiful held-out", PLENTY, False)
        big = sized(noises["heavy"], PLENTY, gate, bench, most_budget=4.0, aa_offset=args.aa_offset)
        heads = scenarios(gate.min_acceptance_gain, args.aa_offset)["better (+10%, +0.1)"]
        t = time.perf_counter()
        out = [cycle(s, big, heads, noises["heavy"], gate, bench, seed) for seed in range(args.power_runs // 4)]
        k = sum(v == PASSED for v, _ in out)
        lo, hi = clopper_pearson(k, len(out))
        spent = sum(x for _, x in out) / len(out)
        beyond.append({"shape": [big.prompts, big.rounds, big.group_size], "predicted_power": big.power,
                       "promoted": k, "runs": len(out), "rate": k / len(out), "ci95": [lo, hi],
                       "budget_vs_default_most": spent / today})
        log(f"heavy, better head, up to 4x the budget: {big.why}; power {k}/{len(out)} = {k / len(out):.1%} "
            f"[{lo:.1%}, {hi:.1%}], {spent / today:.2f}x ({time.perf_counter() - t:.0f}s)")
    level = gate.level
    lines = [f"gate on the simulator: {level:.3g} per check (confidence {gate.confidence}), "
             f"{gate.max_attempts} attempts at {level / gate.max_attempts:.4g} each, margins +{gate.min_acceptance_gain} "
             f"acceptance / +{gate.min_throughput_gain:.0%} tok/s, min {gate.min_clusters} prompt groups; "
             "Clopper-Pearson 95% intervals; budget: prompt replays per cycle (per arm and concurrency) over the "
             f"default bench's most ({today})", "",
             f"{'setting':<32} {'noise':<6} {'shape (prompts x rounds, group)':<32} {'scenario':<20} "
             f"{'promoted':>9}  {'95% CI':<18} {'budget':>6}"]
    for r in rows:
        at = "/".join(str(n) for n in r["prompts_at"].values()) if r["prompts_at"] else r["shape"][0]
        shape = f"{at} x {r['shape'][1]}, groups of {r['shape'][2]}"
        lines.append(f"{r['setting']:<32} {r['noise']:<6} {shape:<32} {r['scenario']:<20} {r['rate']:>8.2%}  "
                     f"[{r['ci95'][0]:.2%}, {r['ci95'][1]:.2%}]  {r['budget_vs_default_most']:>5.2f}x")
    for b in beyond:
        lines.append(f"heavy, plentiful held-out, better head, budget up to 4x: {b['shape'][0]} x {b['shape'][1]}, "
                     f"groups of {b['shape'][2]}: {b['rate']:.1%} [{b['ci95'][0]:.1%}, {b['ci95'][1]:.1%}], "
                     f"{b['budget_vs_default_most']:.2f}x")
    over = [r for r in rows if r["scenario"].startswith("null") and r["ci95"][1] > level]
    lines += ["", f"null cells whose upper bound is above {level:.3g}: {len(over)} of "
              f"{sum(r['scenario'].startswith('null') for r in rows)}",
              f"total {time.monotonic() - t0:.0f}s; result: {args.out}"]
    args.out.write_text(json.dumps({"rows": rows, "beyond_budget": beyond, "level": level}, indent=1))
    print("\n".join(lines))
    return 1 if any(r["ci95"][0] > level for r in rows if r["scenario"].startswith("null")) else 0


if __name__ == "__main__":
    sys.exit(main())
