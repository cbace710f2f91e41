"""The replay bench's result, typed: what ``bench.json`` holds and every reader reads.

One owner for the layout: per-arm figures keyed by integer concurrency, the prompt-group
clusters the gate pools across attempts, candidate − reference intervals, the A/A control,
the speed-up over no speculation, the headline a person reads first and the MLflow metrics.
``to_json`` writes schema :data:`SCHEMA_VERSION`; ``from_json`` also reads schema 2 (the
layout before this module), rebuilding its clusters from the per-request records.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from evaluation.stats import (CANDIDATE, CONTROL, LIVE, NOSPEC, Cluster, ClusterSums, Interval, contrast,
                              log_ratio)
from serving.metrics import SpecDelta

# The layout of bench.json: bumped whenever a field changes meaning or moves.
# 3: typed result; integer concurrency keys; prompt-group clusters; differences against the live head
#    and its A/A control pooled, as cluster t-intervals.
SCHEMA_VERSION = 3
READABLE = (2, 3)

THROUGHPUT_FIGURES = ("output_tok_per_s", "tpot_ms", "itl_ms", "ttft_ms")
PERCENTILES = (50, 90, 99)


def _num(x: Any) -> float | None:
    if x is None or isinstance(x, bool):
        return None
    x = float(x)
    return None if math.isnan(x) or math.isinf(x) else x


def spec_to_json(s: SpecDelta | None) -> dict | None:
    return None if s is None else s.to_json()


def spec_from_json(d: dict | None) -> SpecDelta | None:
    if not d:
        return None
    return SpecDelta(seconds=d.get("seconds", 0.0), drafts=d.get("drafts", 0.0), draft_tokens=d.get("draft_tokens", 0.0),
                     accepted=d.get("accepted_tokens", d.get("accepted", 0.0)),
                     per_pos=list(d.get("accepted_per_pos") or []))


@dataclass
class Latency:
    """Latency distribution in ms, as ``vllm bench serve`` names it (``mean_ttft_ms``, ``p99_ttft_ms``, ...)."""

    mean: float | None = None
    median: float | None = None
    std: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None

    @classmethod
    def of(cls, values_s: list[float]) -> "Latency":
        import numpy as np

        xs = np.asarray([x for x in values_s if not math.isnan(x)], dtype=float) * 1000
        if xs.size == 0:
            return cls()
        p = np.percentile(xs, PERCENTILES)
        return cls(float(xs.mean()), float(np.median(xs)), float(xs.std()), *(float(v) for v in p))

    def named(self, name: str) -> dict[str, float | None]:
        return {f"{k}_{name}_ms": getattr(self, k) for k in ("mean", "median", "std", "p50", "p90", "p99")}


@dataclass
class ArmFigures:
    """One arm at one concurrency: every request it sent, whatever the other arms did."""

    requests: int = 0
    failed: int = 0
    output_tokens: int = 0
    wall_s: float = 0.0
    output_tok_per_s: float | None = None
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    itl_ms: float | None = None
    ttft: Latency = field(default_factory=Latency)
    tpot: Latency = field(default_factory=Latency)
    itl: Latency = field(default_factory=Latency)
    e2el: Latency = field(default_factory=Latency)

    def figures(self) -> dict[str, float | None]:
        """Flat figures, named as ``vllm bench serve`` and the MLflow metrics name them."""
        out: dict[str, float | None] = {"requests": self.requests, "failed": self.failed,
                                        "output_tokens": self.output_tokens, "wall_s": self.wall_s,
                                        "output_tok_per_s": self.output_tok_per_s, "ttft_ms": self.ttft_ms,
                                        "tpot_ms": self.tpot_ms, "itl_ms": self.itl_ms}
        for name in ("ttft", "tpot", "itl", "e2el"):
            out.update(getattr(self, name).named(name))
        return out

    def to_json(self) -> dict:
        return self.figures()

    @classmethod
    def from_json(cls, d: dict) -> "ArmFigures":
        lat = {name: Latency(**{k: _num(d.get(f"{k}_{name}_ms")) for k in ("mean", "median", "std", "p50", "p90", "p99")})
               for name in ("ttft", "tpot", "itl", "e2el")}
        return cls(int(d.get("requests", 0)), int(d.get("failed", 0)), int(d.get("output_tokens", 0)),
                   float(d.get("wall_s", 0.0) or 0.0), _num(d.get("output_tok_per_s")), _num(d.get("ttft_ms")),
                   _num(d.get("tpot_ms")), _num(d.get("itl_ms")), **lat)


@dataclass
class Arm:
    """What one arm measured: spec-decode counters over the run, figures per concurrency."""

    spec: SpecDelta | None
    by_concurrency: dict[int, ArmFigures]

    @property
    def mean_acceptance_length(self) -> float | None:
        return None if self.spec is None else _num(self.spec.mean_acceptance_length)

    @property
    def failed(self) -> int:
        return sum(f.failed for f in self.by_concurrency.values())

    def to_json(self) -> dict:
        return {"spec": spec_to_json(self.spec), "by_concurrency": {str(c): f.to_json() for c, f in self.by_concurrency.items()}}

    @classmethod
    def from_json(cls, d: dict) -> "Arm":
        return cls(spec_from_json(d.get("spec")),
                   {int(str(c).lstrip("c")): ArmFigures.from_json(f) for c, f in (d.get("by_concurrency") or {}).items()})


@dataclass
class Comparison:
    """Intervals of one contrast: acceptance (at the lowest concurrency) and throughput figures per concurrency."""

    mean_acceptance_length: Interval
    by_concurrency: dict[int, dict[str, Interval]]

    def tok_per_s(self, c: int) -> Interval | None:
        return (self.by_concurrency.get(c) or {}).get("output_tok_per_s")

    def to_json(self) -> dict:
        return {"mean_acceptance_length": self.mean_acceptance_length.to_json(),
                "by_concurrency": {str(c): {k: v.to_json() for k, v in m.items()} for c, m in self.by_concurrency.items()}}

    @classmethod
    def from_json(cls, d: dict | None, confidence: float) -> "Comparison | None":
        if not d:
            return None
        if "by_concurrency" in d:
            byc = d["by_concurrency"]
        else:  # schema 2: "c4": {...} beside the acceptance
            byc = {k[1:]: v for k, v in d.items() if k.startswith("c") and k[1:].isdigit()}
        return cls(Interval.from_json(d.get("mean_acceptance_length"), confidence),
                   {int(c): {k: Interval.from_json(v, confidence) for k, v in m.items()} for c, m in byc.items()})


@dataclass
class HeadRef:
    path: str
    sha256: str
    version: str | None = None
    spec: str | None = None
    num_speculative_tokens: int | None = None

    def to_json(self) -> dict:
        return {"path": self.path, "sha256": self.sha256, "version": self.version, "spec": self.spec,
                "num_speculative_tokens": self.num_speculative_tokens}

    @classmethod
    def from_json(cls, d: dict) -> "HeadRef":
        return cls(d.get("path", ""), d.get("sha256", ""), None if d.get("version") is None else str(d["version"]),
                   d.get("spec"), d.get("num_speculative_tokens"))


@dataclass
class RequestRecord:
    """One request sent: which arm, slot and prompt, its outcome and its latencies."""

    arm: str
    round: int
    slot: int
    concurrency: int
    prompt: int
    ok: bool
    output_tokens: int = 0
    ttft_ms: float | None = None
    e2el_ms: float | None = None
    tpot_ms: float | None = None
    itls_ms: list[float] = field(default_factory=list)
    drafts: float | None = None
    accepted: float | None = None
    error: str | None = None

    def to_json(self) -> dict:
        return dict(self.__dict__)

    @classmethod
    def from_json(cls, d: dict) -> "RequestRecord":
        return cls(**{k: d.get(k) for k in cls.__dataclass_fields__ if k in d})


@dataclass
class BenchResult:
    """A replay bench: who was measured, on what, and what came out."""

    arms: dict[str, Arm]
    clusters: list[Cluster]
    differences: Comparison
    aa_control: Comparison | None
    speedup_vs_nospec: dict[int, dict[str, Interval]]
    concurrencies: list[int]
    rounds: int
    confidence: float
    seed: int = 0
    group_size: int = 4
    requests: int = 0  # held-out prompts replayed
    first_prompt: int = 0  # the number of the first (a cycle's later attempts replay new prompts, numbered on)
    prompts_at: dict[int, int] = field(default_factory=dict)  # prompts replayed per concurrency (per round)
    heads: dict[str, HeadRef] = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION
    created_at: str | None = None
    environment: dict[str, Any] = field(default_factory=dict)
    bench_url: str | None = None
    nospec_url: str | None = None
    heldout_overlap: dict[str, Any] | None = None
    slots: int = 0
    order: list[list[str]] = field(default_factory=list)
    # Why the bench ran fewer rounds than planned (``rounds`` is what it ran, ``planned_rounds`` the plan), or None.
    stopped: str | None = None
    planned_rounds: int = 0  # 0: as many as it ran
    # How each arm's head went in before its turn (in place or by restart), and every block and request:
    # written for people and tools to audit a run; no decision reads them.
    swaps: list[dict[str, Any]] = field(default_factory=list)
    blocks: list[dict[str, Any]] = field(default_factory=list)
    request_records: list[RequestRecord] = field(default_factory=list)
    json_path: str | None = None
    plot_path: str | None = None

    # -- readers ----------------------------------------------------------------------------

    @property
    def after_first_round(self) -> bool:
        """Whether this is a first round of an attempt that planned more (a look after its first round)."""
        return self.rounds == 1 and self.planned_rounds > 1

    @property
    def roles(self) -> list[str]:
        return list(self.arms)

    def tok_per_s(self, role: str, c: int) -> float | None:
        f = self.arms[role].by_concurrency.get(c) if role in self.arms else None
        return None if f is None else f.output_tok_per_s

    def failed(self, role: str) -> int:
        return self.arms[role].failed if role in self.arms else 0

    def speedup(self, role: str = CANDIDATE) -> dict[int, float]:
        """``role``'s measured tok/s over no speculation per concurrency (empty: not measured)."""
        return {c: round(v[role].estimate, 4) for c, v in sorted(self.speedup_vs_nospec.items())
                if role in v and v[role].estimate is not None}

    def headline(self) -> dict[str, Any]:
        """The few numbers a person reads first: each difference with the A/A control beside it."""
        out: dict[str, Any] = {}
        for role, arm in self.arms.items():
            out[role] = {"mean_acceptance_length": arm.mean_acceptance_length,
                         "output_tok_per_s": {str(c): f.output_tok_per_s for c, f in arm.by_concurrency.items()}}
            head = self.heads.get(LIVE if role == CONTROL else role)
            if head is not None and role != CONTROL:
                out[role]["sha256"] = head.sha256[:12]
        aa = self.aa_control
        out["delta_mean_acceptance_length"] = {**self.differences.mean_acceptance_length.to_json(),
                                               "aa": aa.mean_acceptance_length.to_json() if aa else None}
        out["delta_output_tok_per_s"] = {
            str(c): {**m["output_tok_per_s"].to_json(),
                     "aa": aa.tok_per_s(c).to_json() if aa and aa.tok_per_s(c) else None}
            for c, m in self.differences.by_concurrency.items()}
        if self.speedup_vs_nospec:
            out["speedup_vs_nospec"] = {str(c): {r: v[r].estimate for r in v} for c, v in self.speedup_vs_nospec.items()}
        if self.heldout_overlap is not None:
            out["heldout_repeating_training"] = self.heldout_overlap.get("repeats_training")
        return out

    def metrics(self) -> dict[str, float]:
        """The result as MLflow metrics: per arm acceptance and figures, intervals, A/A, speed-ups."""
        m: dict[str, float] = {}

        def put(k: str, v: Any) -> None:
            v = _num(v)
            if v is not None:
                m[k] = v

        for role, arm in self.arms.items():
            if arm.spec is not None:
                put(f"replay.{role}.mean_acceptance_length", arm.spec.mean_acceptance_length)
                put(f"replay.{role}.acceptance_rate", arm.spec.acceptance_rate)
                for i, x in enumerate(arm.spec.acceptance_per_pos):
                    put(f"replay.{role}.acceptance_per_pos_pos{i}", x)
            for c, f in arm.by_concurrency.items():
                for k, v in f.figures().items():
                    if k in BENCH_FIGURES:
                        put(f"replay.{role}.c{c}.{k}", v)

        def put_iv(key: str, iv: Interval) -> None:
            put(f"{key}.estimate", iv.estimate)
            put(f"{key}.ci_low", iv.lo)
            put(f"{key}.ci_high", iv.hi)

        for prefix, comp in (("delta", self.differences), ("aa", self.aa_control)):
            if comp is None:
                continue
            put_iv(f"{prefix}.mean_acceptance_length", comp.mean_acceptance_length)
            for c, figs in comp.by_concurrency.items():
                for k, iv in figs.items():
                    put_iv(f"{prefix}.c{c}.{k}", iv)
        for c, by_role in self.speedup_vs_nospec.items():
            for role, iv in by_role.items():
                put_iv(f"speedup_vs_nospec.c{c}.{role}", iv)
        return m

    # -- serialization ----------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION, "created_at": self.created_at, "environment": self.environment,
            "heads": {r: h.to_json() for r, h in self.heads.items()}, "bench_url": self.bench_url,
            "nospec_url": self.nospec_url, "requests": self.requests, "concurrencies": self.concurrencies,
            "rounds": self.rounds, "confidence": self.confidence, "seed": self.seed, "group_size": self.group_size,
            "first_prompt": self.first_prompt, "prompts_at": {str(c): n for c, n in self.prompts_at.items()},
            "heldout_overlap": self.heldout_overlap,
            "summary": self.headline(),
            "arms": {r: a.to_json() for r, a in self.arms.items()},
            "differences": self.differences.to_json(),
            "aa_control": self.aa_control.to_json() if self.aa_control else None,
            "speedup_vs_nospec": {str(c): {r: iv.to_json() for r, iv in v.items()}
                                  for c, v in self.speedup_vs_nospec.items()},
            "clusters": [c.to_json() for c in self.clusters],
            "slots": self.slots, "order": self.order, "stopped": self.stopped,
            "planned_rounds": self.planned_rounds or self.rounds, "swaps": self.swaps,
            "blocks": self.blocks,
            "request_records": [r.to_json() for r in self.request_records],
            "json_path": self.json_path, "plot_path": self.plot_path,
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2, default=str)

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(self.dumps())
        return path

    @classmethod
    def load(cls, path: str | Path) -> "BenchResult":
        p = Path(path)
        try:
            d = json.loads(p.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{p} is not a bench result (not JSON: {exc})") from None
        return cls.from_json(d)

    @classmethod
    def from_json(cls, d: dict[str, Any] | str) -> "BenchResult":
        if isinstance(d, str):
            d = json.loads(d)
        version = d.get("schema_version")
        if version not in READABLE:
            raise ValueError(f"bench result schema {version!r} is not one this version reads ({READABLE})")
        conf = float(d.get("confidence") or (d.get("differences") or {}).get("mean_acceptance_length", {}).get(
            "confidence") or 0.9)
        records = [RequestRecord.from_json(r) for r in d.get("request_records") or []]
        rounds = d.get("rounds") or 0
        if version == 2:
            rounds = len(rounds) if isinstance(rounds, list) else rounds  # schema 2: the per-round figures
            arms_d = d["per_head"]
            clusters = clusters_from_records(records, list(d.get("arms") or arms_d))
            speed = {int(k[1:]): {r: Interval.from_json(v, conf) for r, v in by.items()}
                     for k, by in (d.get("speedup_vs_nospec") or {}).items()}
        else:
            arms_d = d["arms"]
            clusters = [Cluster.from_json(c) for c in d.get("clusters") or []]
            speed = {int(k): {r: Interval.from_json(v, conf) for r, v in by.items()}
                     for k, by in (d.get("speedup_vs_nospec") or {}).items()}
        return cls(
            arms={r: Arm.from_json(a) for r, a in arms_d.items()}, clusters=clusters,
            differences=Comparison.from_json(d["differences"], conf)
            or Comparison(Interval.empty(conf), {}),
            aa_control=Comparison.from_json(d.get("aa_control"), conf), speedup_vs_nospec=speed,
            concurrencies=[int(c) for c in d.get("concurrencies") or []], rounds=int(rounds),
            confidence=conf, seed=int(d.get("seed") or 0), group_size=int(d.get("group_size") or 0),
            requests=int(d.get("requests") or 0), first_prompt=int(d.get("first_prompt") or 0),
            prompts_at={int(c): int(n) for c, n in (d.get("prompts_at") or {}).items()},
            heads={r: HeadRef.from_json(h) for r, h in (d.get("heads") or {}).items()},
            schema_version=version, created_at=d.get("created_at"), environment=d.get("environment") or {},
            bench_url=d.get("bench_url"), nospec_url=d.get("nospec_url"), heldout_overlap=d.get("heldout_overlap"),
            slots=int(d.get("slots") or 0), order=d.get("order") or [], stopped=d.get("stopped"),
            planned_rounds=int(d.get("planned_rounds") or rounds),
            swaps=d.get("swaps") or [],
            blocks=d.get("blocks") or [], request_records=records, json_path=d.get("json_path"),
            plot_path=d.get("plot_path"))


# Per arm and concurrency, the figures logged to MLflow (the means and the percentiles).
BENCH_FIGURES = ("output_tok_per_s", "tpot_ms", "ttft_ms", "itl_ms", *(
    f"{p}_{n}_ms" for n in ("ttft", "tpot", "itl", "e2el") for p in ("median", "p90", "p99")))


def clusters_from_records(records: list[RequestRecord], arms: list[str]) -> list[Cluster]:
    """Prompt-group clusters from per-request records (how a schema-2 file is read)."""
    from evaluation.stats import pool_clusters

    slots: dict[int, dict[str, list[RequestRecord]]] = {}
    for r in records:
        slots.setdefault(r.slot, {}).setdefault(r.arm, []).append(r)
    per_group: list[Cluster] = []
    for by_arm in slots.values():
        any_arm = next(iter(by_arm.values()))
        prompts = sorted({r.prompt for r in any_arm})
        c = any_arm[0].concurrency
        ok = {p for p in prompts if all(any(r.prompt == p and r.ok for r in by_arm.get(a, [])) for a in arms
                                        if a in by_arm)}
        cl = Cluster(c, prompts, 1)
        for a in arms:
            s = cl.arms.setdefault(a, ClusterSums())
            for r in by_arm.get(a, []):
                if r.prompt in ok:
                    ms = (lambda x: math.nan if x is None else x / 1000)
                    s.add_request(r.output_tokens, ms(r.e2el_ms), ms(r.ttft_ms), ms(r.tpot_ms),
                                  [x / 1000 for x in r.itls_ms], math.nan if r.drafts is None else r.drafts,
                                  r.accepted or 0.0)
        per_group.append(cl)
    return pool_clusters([per_group])


def compare_all(clusters: list[Cluster], arms: list[str], concurrencies: list[int], confidence: float
                ) -> tuple[Comparison, Comparison | None, dict[int, dict[str, Interval]]]:
    """Candidate − reference (live and A/A control pooled), the A/A control (control − live), speed-ups."""
    ref = [LIVE, CONTROL] if CONTROL in arms else [LIVE]
    c1 = min(concurrencies)

    def comp(x: str, ys: list[str]) -> Comparison:
        return Comparison(contrast(clusters, "mean_acceptance_length", c1, x, ys, confidence),
                          {c: {k: contrast(clusters, k, c, x, ys, confidence) for k in THROUGHPUT_FIGURES}
                           for c in concurrencies})

    diffs = comp(CANDIDATE, ref)
    aa = comp(CONTROL, [LIVE]) if CONTROL in arms else None
    speed = {}
    if NOSPEC in arms:
        speed = {c: {r: log_ratio(clusters, "output_tok_per_s", c, r, NOSPEC, confidence) for r in (CANDIDATE, LIVE)}
                 for c in concurrencies}
    return diffs, aa, speed


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return sum(xs) / len(xs) if xs else math.nan


def sum_spec(ds: list[SpecDelta]) -> SpecDelta | None:
    if not ds:
        return None
    n = max((len(d.per_pos) for d in ds), default=0)
    return SpecDelta(
        seconds=sum(d.seconds for d in ds), drafts=sum(d.drafts for d in ds),
        draft_tokens=sum(d.draft_tokens for d in ds), accepted=sum(d.accepted for d in ds),
        per_pos=[sum(d.per_pos[i] if i < len(d.per_pos) else 0.0 for d in ds) for i in range(n)])


def arm_figures(blocks: list[dict], latencies: bool = True) -> ArmFigures:
    """Figures of some blocks of one arm: wall throughput, latency means and distributions."""
    res = [r for b in blocks for r in b["results"] if r.ok]
    tokens = sum(r.output_tokens for r in res)
    wall = sum(b["wall"] for b in blocks)
    f = ArmFigures(requests=len(res), failed=sum(not r.ok for b in blocks for r in b["results"]), output_tokens=tokens,
                   wall_s=wall, output_tok_per_s=_num(tokens / wall) if wall > 0 else None,
                   ttft_ms=_num(_mean([r.ttft for r in res]) * 1000), tpot_ms=_num(_mean([r.tpot for r in res]) * 1000),
                   itl_ms=_num(_mean([x for r in res for x in r.itls]) * 1000))
    if latencies:
        f.ttft, f.tpot = Latency.of([r.ttft for r in res]), Latency.of([r.tpot for r in res])
        f.itl, f.e2el = Latency.of([x for r in res for x in r.itls]), Latency.of([r.latency for r in res])
    return f


def request_records(blocks: list[dict]) -> list[RequestRecord]:
    """One record per request sent."""
    ms = (lambda x: _num(x * 1000))
    return [RequestRecord(b["role"], b["round"], b["slot"], b["concurrency"], p, r.ok, r.output_tokens, ms(r.ttft),
                          ms(r.latency), ms(r.tpot), [round(x * 1000, 3) for x in r.itls], _num(r.drafts),
                          _num(r.accepted), r.error)
            for b in blocks for p, r in zip(b["prompts"], b["results"])]


def analyze(blocks: list[dict], arms: list[str], concurrencies: list[int], confidence: float,
            records: bool = True) -> BenchResult:
    """Everything a bench measured, as a result: per-arm figures, clusters, intervals, A/A, speed-ups.

    ``records=False`` leaves out the per-request records and latency distributions (the
    simulator's many runs need only what the gate reads).
    """
    from evaluation.stats import clusters_from_blocks

    per_arm = {}
    for role in arms:
        mine = [b for b in blocks if b["role"] == role]
        per_arm[role] = Arm(sum_spec([b["spec"] for b in mine if b["spec"] is not None]),
                            {c: arm_figures([b for b in mine if b["concurrency"] == c], records) for c in concurrencies})
    clusters = clusters_from_blocks(blocks, arms)
    diffs, aa, speed = compare_all(clusters, arms, concurrencies, confidence)
    return BenchResult(arms=per_arm, clusters=clusters, differences=diffs, aa_control=aa, speedup_vs_nospec=speed,
                       concurrencies=list(concurrencies), rounds=len({b["round"] for b in blocks}),
                       confidence=confidence, request_records=request_records(blocks) if records else [])
