"""Promotion gate: a pure decision over replay-benchmark results and ``[gate]``.

A candidate is promoted only if, at once,
* mean acceptance length improves by more than ``min_acceptance_gain`` (absolute,
  in tokens per verification step), and
* output tok/s improves by more than ``min_throughput_gain`` (a fraction of the
  live head's tok/s) at every benchmarked concurrency.

Each check reads two intervals from the same benchmark run (``evaluation.bench``):
the paired-bootstrap interval ``[lo, hi]`` of candidate − live, and the A/A
control's interval (the live head against itself). The A/A spread ``noise`` (the
largest difference its interval leaves open) is how far apart identical heads
measure in this run; a machine under load, or an order effect, widens it. So a
check

* **passes** when ``lo − noise > margin``: better by the margin, and by more than
  identical heads differ;
* **fails** when ``hi + noise ≤ margin``: not better by the margin, even granting
  the run all of its noise;
* is **inconclusive** otherwise: the run cannot tell, so it is measured again.

The verdict is *rejected* if any check fails, *passed* if all pass, else
*inconclusive*; a point estimate alone never promotes, and neither does an
inconclusive verdict.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from evaluation.stats import aa_noise

PASSED = "passed"
REJECTED = "rejected"
INCONCLUSIVE = "inconclusive"


@dataclass
class Verdict:
    status: str
    reason: str
    checks: list[dict[str, Any]] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.status == PASSED

    @property
    def label(self) -> str:
        return self.status

    def to_json(self) -> dict[str, Any]:
        return {"verdict": self.status, "passed": self.passed, "reason": self.reason, "checks": self.checks}


def check(name: str, diff: dict[str, Any] | None, aa: dict[str, Any] | None, margin: float,
          unit: str) -> dict[str, Any]:
    """One gated figure: passed / rejected / inconclusive, with the numbers and a sentence."""
    diff = diff or {}
    est, (lo, hi) = diff.get("estimate"), (diff.get("ci") or [None, None])
    noise = aa_noise(aa)
    margin = max(margin, 0.0)
    out = {"name": name, "estimate": est, "ci": [lo, hi], "aa_ci": (aa or {}).get("ci"), "aa_noise": noise,
           "margin": margin, "unit": unit}
    if est is None or lo is None or hi is None:
        return {**out, "status": INCONCLUSIVE, "ok": False,
                "why": f"{name}: no confidence interval (too few successful paired requests)"}
    if noise is None:
        return {**out, "status": INCONCLUSIVE, "ok": False,
                "why": f"{name}: no A/A control in this benchmark, so its noise is unknown"}
    span = f"[{lo:.4g}, {hi:.4g}] (estimate {est:.4g}), A/A noise ±{noise:.3g}, margin {margin:.4g} {unit}"
    if lo - noise > margin:
        return {**out, "status": PASSED, "ok": True, "why": f"{name}: better beyond the noise: {span}"}
    if hi + noise <= margin:
        return {**out, "status": REJECTED, "ok": False, "why": f"{name}: not better by the margin: {span}"}
    return {**out, "status": INCONCLUSIVE, "ok": False, "why": f"{name}: within the run's noise: {span}"}


def decide(bench: dict[str, Any], gate: Any) -> Verdict:
    """Verdict for one benchmark result (``evaluation.bench`` JSON) under ``gate`` (``GateConfig``)."""
    diffs = bench.get("differences") or {}
    aa = bench.get("aa_control") or {}
    per_head = bench.get("per_head") or {}
    checks = []
    failed = {role: sum((v or {}).get("failed", 0)
                        for v in ((per_head.get(role) or {}).get("by_concurrency") or {}).values())
              for role in ("candidate", "live")}
    if failed["candidate"] > failed["live"]:
        checks.append({"name": "requests", "status": REJECTED, "ok": False,
                       "why": f"requests: the candidate failed {failed['candidate']} requests, "
                              f"the live head {failed['live']}"})
    checks.append(check("mean_acceptance_length", diffs.get("mean_acceptance_length"),
                        aa.get("mean_acceptance_length"), gate.min_acceptance_gain, "tokens"))
    concs = sorted((k for k in diffs if k.startswith("c") and k[1:].isdigit()), key=lambda k: int(k[1:]))
    if not concs:
        checks.append({"name": "output_tok_per_s", "status": INCONCLUSIVE, "ok": False,
                       "why": "benchmark has no throughput results"})
    for c in concs:
        live = ((per_head.get("live") or {}).get("by_concurrency") or {}).get(c[1:]) or {}
        live_tps = live.get("output_tok_per_s")
        # The throughput margin is relative; the paired difference is absolute tok/s.
        margin = gate.min_throughput_gain * live_tps if live_tps else 0.0
        checks.append(check(f"output_tok_per_s@{c}", diffs[c].get("output_tok_per_s"),
                            (aa.get(c) or {}).get("output_tok_per_s"), margin, "tok/s"))
    statuses = {c["status"] for c in checks}
    status = REJECTED if REJECTED in statuses else PASSED if statuses == {PASSED} else INCONCLUSIVE
    shown = [c for c in checks if c["status"] == status] if status != PASSED else checks
    return Verdict(status, "; ".join(c["why"] for c in shown), checks)


def bootstrap_verdict() -> Verdict:
    """The first head of a registered model has nothing to beat: it passes, and says so."""
    return Verdict(PASSED, "bootstrap: no Production version and no live head to compare against", [])
