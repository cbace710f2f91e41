"""Promotion gate: a pure decision over replay-benchmark results and ``[gate]``.

A candidate passes only if, with the configured confidence, both
* mean acceptance length improves by more than ``min_acceptance_gain`` (absolute,
  in tokens per verification step), and
* output tok/s improves by more than ``min_throughput_gain`` (a fraction of the
  live head's tok/s) at every benchmarked concurrency.
"With confidence" means the lower bound of the bootstrap interval of the
difference (candidate − live, ``serving.bench.summarize``) is above the margin
and above zero: a point estimate alone never promotes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

PASSED = "passed"
REJECTED = "rejected"


@dataclass
class Verdict:
    passed: bool
    reason: str
    checks: list[dict[str, Any]] = field(default_factory=list)

    @property
    def label(self) -> str:
        return PASSED if self.passed else REJECTED

    def to_json(self) -> dict[str, Any]:
        return {"verdict": self.label, **asdict(self)}


def _check(name: str, diff: dict[str, Any] | None, margin: float, unit: str) -> dict[str, Any]:
    diff = diff or {}
    est = diff.get("estimate")
    ci = diff.get("ci") or [None, None]
    lo = ci[0]
    out = {"name": name, "estimate": est, "ci": ci, "margin": margin, "unit": unit}
    if est is None or lo is None:
        out.update(ok=False, why=f"{name}: no confidence interval (too few successful benchmark requests)")
    elif lo > max(margin, 0.0):
        out.update(ok=True, why=f"{name}: lower bound {lo:.4g} > margin {margin:.4g} {unit}")
    else:
        out.update(ok=False, why=f"{name}: lower bound {lo:.4g} (estimate {est:.4g}) not above "
                                 f"margin {max(margin, 0.0):.4g} {unit}")
    return out


def decide(bench: dict[str, Any], gate: Any) -> Verdict:
    """Verdict for one benchmark result (``serving.bench`` JSON) under ``gate`` (``GateConfig``)."""
    diffs = bench.get("differences") or {}
    checks = [_check("mean_acceptance_length", diffs.get("mean_acceptance_length"), gate.min_acceptance_gain,
                     "tokens")]
    concs = [k for k in diffs if k.startswith("c") and k[1:].isdigit()]
    if not concs:
        checks.append({"name": "output_tok_per_s", "ok": False, "why": "benchmark has no throughput results"})
    for c in sorted(concs, key=lambda k: int(k[1:])):
        live = (((bench.get("per_head") or {}).get("live") or {}).get("by_concurrency") or {}).get(c[1:]) or {}
        live_tps = live.get("output_tok_per_s")
        # The throughput margin is relative; the bootstrap difference is absolute tok/s.
        margin = gate.min_throughput_gain * live_tps if live_tps else 0.0
        checks.append(_check(f"output_tok_per_s@{c}", diffs[c].get("output_tok_per_s"), margin, "tok/s"))
    failed = [c for c in checks if not c["ok"]]
    if failed:
        return Verdict(False, "; ".join(c["why"] for c in failed), checks)
    return Verdict(True, "; ".join(c["why"] for c in checks), checks)


def bootstrap_verdict() -> Verdict:
    """The first head of a registered model has nothing to beat: it passes, and says so."""
    return Verdict(True, "bootstrap: no Production version and no live head to compare against", [])
