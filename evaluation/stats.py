"""Statistics of a replay bench: per-arm figures, paired differences, the A/A control.

Within a slot every arm replays the same prompts within seconds of each other, so the
slot is the unit of pairing: request i of the candidate and request i of the live head
share the prompt and (nearly) the moment. Differences are estimated on the pairs and
their confidence intervals come from resampling slots, the same slots for both sides
(a paired cluster bootstrap): what prompts share cancels, and load that varies from
slot to slot widens the interval instead of biasing the estimate. The A/A control (the
live head against itself, in the same slots) shows what is left: how far apart two
identical heads measure in this run (:func:`aa_noise`).
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from serving.metrics import SpecDelta

CANDIDATE, LIVE, CONTROL, NOSPEC = "candidate", "live", "control", "nospec"


def aa_noise(aa: dict[str, Any] | None) -> float | None:
    """The largest difference the A/A control's interval leaves open (None: no control measured)."""
    ci = (aa or {}).get("ci") or [None, None]
    if ci[0] is None or ci[1] is None:
        return None
    return max(abs(ci[0]), abs(ci[1]))


_FIELDS = ("tokens", "latency", "ttft_sum", "ttft_n", "tpot_sum", "tpot_n", "itl_sum", "itl_n",
           "drafts", "accepted", "ok")


def slot_sums(blocks: list[dict], role: str, c: int, keep: dict[int, set[int]] | None = None) -> dict[str, Any]:
    """Per-slot sums of one arm at one concurrency (arrays over that concurrency's slots, in slot order).

    ``keep[slot]`` limits a slot to the prompts every compared arm answered.
    """
    import numpy as np

    mine = sorted((b for b in blocks if b["role"] == role and b["concurrency"] == c), key=lambda b: b["slot"])
    a = {k: np.zeros(len(mine)) for k in _FIELDS}
    for j, b in enumerate(mine):
        for p, r in zip(b["prompts"], b["results"]):
            if not r.ok or (keep is not None and p not in keep.get(b["slot"], ())):
                continue
            a["ok"][j] += 1
            a["tokens"][j] += r.output_tokens
            a["latency"][j] += r.latency
            if not math.isnan(r.ttft):
                a["ttft_sum"][j] += r.ttft
                a["ttft_n"][j] += 1
            if not math.isnan(r.tpot):
                a["tpot_sum"][j] += r.tpot
                a["tpot_n"][j] += 1
            a["itl_sum"][j] += sum(r.itls)
            a["itl_n"][j] += len(r.itls)
            if not math.isnan(r.drafts):
                a["drafts"][j] += r.drafts
                a["accepted"][j] += r.accepted
    return a


def _answered(blocks: list[dict], roles: tuple[str, ...], c: int) -> dict[int, set[int]]:
    """Per slot, the prompts that every one of ``roles`` answered (failed requests drop the pair)."""
    out: dict[int, set[int]] = {}
    for b in blocks:
        if b["concurrency"] != c or b["role"] not in roles:
            continue
        ok = {p for p, r in zip(b["prompts"], b["results"]) if r.ok}
        out[b["slot"]] = ok if b["slot"] not in out else out[b["slot"]] & ok
    return out


def _ratio(num, den):
    import numpy as np

    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1), np.nan)


# stat(arrays, idx, c) -> one value per row of idx (idx: [B, m] slot indices).
STATS = {
    "mean_acceptance_length": lambda a, idx, c: 1 + _ratio(a["accepted"][idx].sum(-1), a["drafts"][idx].sum(-1)),
    "output_tok_per_s": lambda a, idx, c: c * _ratio(a["tokens"][idx].sum(-1), a["latency"][idx].sum(-1)),
    "tpot_ms": lambda a, idx, c: 1000 * _ratio(a["tpot_sum"][idx].sum(-1), a["tpot_n"][idx].sum(-1)),
    "itl_ms": lambda a, idx, c: 1000 * _ratio(a["itl_sum"][idx].sum(-1), a["itl_n"][idx].sum(-1)),
    "ttft_ms": lambda a, idx, c: 1000 * _ratio(a["ttft_sum"][idx].sum(-1), a["ttft_n"][idx].sum(-1)),
}


def paired(blocks: list[dict], x: str, y: str, stat: str, c: int, confidence: float, n_boot: int, seed: int,
           how: str = "diff") -> dict[str, Any]:
    """Estimate and paired cluster-bootstrap CI of ``stat(x) - stat(y)`` (or ``x / y`` with how="ratio")."""
    import numpy as np

    keep = _answered(blocks, (x, y), c)
    a, b = slot_sums(blocks, x, c, keep), slot_sums(blocks, y, c, keep)
    n = len(a["ok"])
    out: dict[str, Any] = {"estimate": None, "ci": [None, None], "confidence": confidence,
                           "pairs": int(a["ok"].sum()), "slots": n}
    if n == 0 or a["ok"].sum() == 0:
        return out
    f = STATS[stat]
    op = np.subtract if how == "diff" else _ratio
    full = np.arange(n)[None, :]
    est = float(op(f(a, full, c), f(b, full, c))[0])
    idx = np.random.default_rng(seed).integers(0, n, size=(n_boot, n))
    boots = op(f(a, idx, c), f(b, idx, c))
    boots = boots[~np.isnan(boots)]
    out["estimate"] = _clean(est)
    if boots.size:
        lo, hi = np.quantile(boots, [(1 - confidence) / 2, (1 + confidence) / 2])
        out["ci"] = [_clean(float(lo)), _clean(float(hi))]
    return out


def _clean(x: Any) -> Any:
    return None if isinstance(x, float) and (math.isnan(x) or math.isinf(x)) else x


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return statistics.fmean(xs) if xs else math.nan


def _sum_spec(ds: list[SpecDelta]) -> SpecDelta:
    n = max((len(d.per_pos) for d in ds), default=0)
    return SpecDelta(
        seconds=sum(d.seconds for d in ds), drafts=sum(d.drafts for d in ds),
        draft_tokens=sum(d.draft_tokens for d in ds), accepted=sum(d.accepted for d in ds),
        per_pos=[sum(d.per_pos[i] if i < len(d.per_pos) else 0.0 for d in ds) for i in range(n)])


PERCENTILES = (50, 90, 99)


def latency_summary(name: str, values_s: list[float]) -> dict[str, Any]:
    """``mean_/median_/std_/p50_/p90_/p99_<name>_ms`` of latencies in seconds, as ``vllm bench serve`` names them."""
    import numpy as np

    xs = np.asarray([x for x in values_s if not math.isnan(x)], dtype=float) * 1000
    if xs.size == 0:
        return {f"{k}_{name}_ms": None for k in ("mean", "median", "std", *(f"p{p}" for p in PERCENTILES))}
    out = {f"mean_{name}_ms": float(xs.mean()), f"median_{name}_ms": float(np.median(xs)),
           f"std_{name}_ms": float(xs.std())}
    out.update({f"p{p}_{name}_ms": float(np.percentile(xs, p)) for p in PERCENTILES})
    return out


def _arm_figures(bl: list[dict]) -> dict[str, Any]:
    """Figures of some blocks of one arm: wall throughput, latency means and percentiles, spec counters."""
    res = [r for b in bl for r in b["results"] if r.ok]
    tokens = sum(r.output_tokens for r in res)
    wall = sum(b["wall"] for b in bl)
    specs = [b["spec"] for b in bl if b["spec"] is not None]
    out = {
        "requests": len(res), "failed": sum(not r.ok for b in bl for r in b["results"]),
        "output_tokens": tokens, "wall_s": wall,
        "output_tok_per_s": _clean(tokens / wall if wall > 0 else math.nan),
        "ttft_ms": _clean(_mean([r.ttft for r in res]) * 1000),
        "tpot_ms": _clean(_mean([r.tpot for r in res]) * 1000),
        "itl_ms": _clean(_mean([x for r in res for x in r.itls]) * 1000),
        "spec": _sum_spec(specs).to_dict() if specs else None,
        # The fields of `vllm bench serve` results, for readers (and tools) that know those.
        "completed": len(res), "duration": wall, "total_output_tokens": tokens,
        "request_throughput": _clean(len(res) / wall if wall > 0 else math.nan),
        "output_throughput": _clean(tokens / wall if wall > 0 else math.nan),
    }
    for name, values in (("ttft", [r.ttft for r in res]), ("tpot", [r.tpot for r in res]),
                         ("itl", [x for r in res for x in r.itls]), ("e2el", [r.latency for r in res])):
        out.update({k: _clean(v) for k, v in latency_summary(name, values).items()})
    return out


def request_records(blocks: list[dict]) -> list[dict[str, Any]]:
    """One record per request sent: which arm, slot and prompt, its outcome and its latencies."""
    out = []
    for b in blocks:
        for p, r in zip(b["prompts"], b["results"]):
            out.append({"arm": b["role"], "round": b["round"], "slot": b["slot"], "concurrency": b["concurrency"],
                        "prompt": p, "ok": r.ok, "output_tokens": r.output_tokens,
                        "ttft_ms": _clean(r.ttft * 1000), "e2el_ms": _clean(r.latency * 1000),
                        "tpot_ms": _clean(r.tpot * 1000), "itls_ms": [round(x * 1000, 3) for x in r.itls],
                        "drafts": _clean(r.drafts), "accepted": _clean(r.accepted), "error": r.error})
    return out


def analyze(blocks: list[dict], arms: list[str], concurrencies: list[int], confidence: float, n_boot: int,
            seed: int = 0) -> dict[str, Any]:
    """Per-arm figures, paired candidate − live differences, the A/A control, speed-up vs no speculation."""
    per_head: dict[str, Any] = {}
    for role in arms:
        mine = [b for b in blocks if b["role"] == role]
        specs = [b["spec"] for b in mine if b["spec"] is not None]
        per_head[role] = {
            "spec": _sum_spec(specs).to_dict() if specs else None,
            "by_concurrency": {str(c): _arm_figures([b for b in mine if b["concurrency"] == c])
                               for c in concurrencies},
        }

    def compare(x: str, y: str) -> dict[str, Any]:
        c1 = min(concurrencies)
        out: dict[str, Any] = {"mean_acceptance_length": paired(blocks, x, y, "mean_acceptance_length", c1,
                                                                confidence, n_boot, seed)}
        for c in concurrencies:
            out[f"c{c}"] = {k: paired(blocks, x, y, k, c, confidence, n_boot, seed)
                            for k in ("output_tok_per_s", "tpot_ms", "itl_ms", "ttft_ms")}
        return out

    result: dict[str, Any] = {"arms": arms, "per_head": per_head, "differences": compare(CANDIDATE, LIVE),
                              "aa_control": compare(CONTROL, LIVE) if CONTROL in arms else {}}
    if NOSPEC in arms:
        result["speedup_vs_nospec"] = {
            f"c{c}": {role: paired(blocks, role, NOSPEC, "output_tok_per_s", c, confidence, n_boot, seed, how="ratio")
                      for role in (CANDIDATE, LIVE)}
            for c in concurrencies}
    result["rounds"] = []
    for r in sorted({b["round"] for b in blocks}):
        by_c = {}
        for c in concurrencies:
            fig = {role: _arm_figures([b for b in blocks if b["round"] == r and b["role"] == role
                                       and b["concurrency"] == c]) for role in arms}
            row: dict[str, Any] = {role: {"output_tok_per_s": f["output_tok_per_s"],
                                          "mean_acceptance_length": (f["spec"] or {}).get("mean_acceptance_length")}
                                   for role, f in fig.items()}
            tps = {role: f["output_tok_per_s"] for role, f in fig.items()}
            if tps.get(CANDIDATE) is not None and tps.get(LIVE) is not None:
                row["candidate_minus_live_tok_per_s"] = tps[CANDIDATE] - tps[LIVE]
            if tps.get(CONTROL) is not None and tps.get(LIVE) is not None:
                row["control_minus_live_tok_per_s"] = tps[CONTROL] - tps[LIVE]
            by_c[str(c)] = row
        result["rounds"].append({"round": r, "by_concurrency": by_c})
    return result


