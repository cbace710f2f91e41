"""Replay benchmark: candidate vs live head on one dedicated bench replica.

Held-out conversations are replayed with their original sampling parameters
(``max_tokens`` capped by ``[bench].max_tokens``). Heads alternate between
interleaved rounds (A, B, A, B, …) on the same replica, swapped in place, so both
see the same machine state. Acceptance comes from deltas of vLLM's spec-decode
counters; latency (TTFT, ITL, TPOT) and output tok/s from streamed responses.
Differences (candidate − live) get bootstrap confidence intervals.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from serving.admin import ReplicaAdmin
from serving.metrics import MEASURE_TIMEOUT, SpecDelta, afetch_snapshot


@dataclass
class BenchRequest:
    route: str  # "/v1/chat/completions" or "/v1/completions"
    body: dict[str, Any]


@dataclass
class RequestResult:
    ok: bool
    output_tokens: int = 0
    ttft: float = math.nan
    latency: float = math.nan
    itls: list[float] = field(default_factory=list)
    drafts: float = math.nan  # per-request spec counters, only measured at concurrency 1
    accepted: float = math.nan
    error: str | None = None

    @property
    def tpot(self) -> float:
        if self.output_tokens > 1:
            return (self.latency - self.ttft) / (self.output_tokens - 1)
        return math.nan


# -- held-out traffic -------------------------------------------------------------

def rows_to_requests(rows: list[dict], model: str, max_tokens_cap: int, limit: int) -> list[BenchRequest]:
    """ShareGPT rows (``capture.split``) → requests with their original sampling parameters."""
    out: list[BenchRequest] = []
    for row in rows:
        turns = row.get("conversations") or []
        # Replay the prompt: everything before the last assistant turn.
        last_gpt = max((i for i, t in enumerate(turns) if t.get("from") == "gpt"), default=len(turns))
        prompt_turns = turns[:last_gpt]
        if not any(t.get("from") == "human" for t in prompt_turns):
            continue
        params: dict[str, Any] = {"model": model}
        mt = row.get("max_tokens")
        params["max_tokens"] = min(int(mt), max_tokens_cap) if mt else max_tokens_cap
        if row.get("temperature") is not None:
            params["temperature"] = float(row["temperature"])
        if row.get("top_p") is not None:
            params["top_p"] = float(row["top_p"])
        if row.get("raw") or row.get("format") == "openai_completion":
            text = "".join(t["value"] for t in prompt_turns if t.get("from") == "human")
            out.append(BenchRequest("/v1/completions", {**params, "prompt": text}))
        else:
            role = {"system": "system", "human": "user", "gpt": "assistant"}
            msgs = [{"role": role.get(t["from"], "user"), "content": t["value"]} for t in prompt_turns]
            out.append(BenchRequest("/v1/chat/completions", {**params, "messages": msgs}))
        if len(out) >= limit:
            break
    return out


def load_heldout(cfg, heldout: str | None) -> list[dict]:
    """ShareGPT rows from a JSONL export, or the warehouse's held-out split."""
    if heldout:
        p = Path(heldout)
        if not p.is_file():
            raise FileNotFoundError(f"held-out file {p} does not exist (export one with the capture CLI)")
        return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    from capture.split import load_split

    rows = load_split(cfg, "heldout")
    if not rows:
        raise ValueError("the warehouse has no held-out conversations: ingest capture first or pass --heldout")
    return rows


# -- one request, streamed ----------------------------------------------------------

async def stream_one(client: httpx.AsyncClient, url: str, req: BenchRequest, timeout: float = 600.0) -> RequestResult:
    body = {**req.body, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    last = None
    res = RequestResult(ok=False)
    n_chunks = 0
    try:
        async with client.stream("POST", url + req.route, json=body, timeout=timeout) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if ev.get("usage"):
                    res.output_tokens = int(ev["usage"].get("completion_tokens") or 0)
                choices = ev.get("choices") or []
                piece = ""
                if choices:
                    c = choices[0]
                    piece = c.get("text") or (c.get("delta") or {}).get("content") or ""
                if not piece:
                    continue
                now = time.perf_counter()
                if last is None:
                    res.ttft = now - t0
                else:
                    res.itls.append(now - last)
                last = now
                n_chunks += 1
        res.latency = time.perf_counter() - t0
        if res.output_tokens == 0:
            res.output_tokens = n_chunks
        res.ok = True
    except (httpx.HTTPError, ValueError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    return res


async def run_block(url: str, reqs: list[BenchRequest], concurrency: int) -> dict[str, Any]:
    """All requests at ``concurrency``; spec counters before/after (and per request at 1)."""
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        before = await afetch_snapshot(client, url, MEASURE_TIMEOUT)
        results: list[RequestResult] = []
        t0 = time.perf_counter()
        if concurrency == 1:
            prev = before
            for rq in reqs:
                res = await stream_one(client, url, rq)
                snap = await afetch_snapshot(client, url, MEASURE_TIMEOUT)
                d = snap.minus(prev)
                res.drafts, res.accepted = d.drafts, d.accepted
                prev = snap
                results.append(res)
        else:
            sem = asyncio.Semaphore(concurrency)

            async def go(rq: BenchRequest) -> RequestResult:
                async with sem:
                    return await stream_one(client, url, rq)

            results = list(await asyncio.gather(*(go(rq) for rq in reqs)))
        wall = time.perf_counter() - t0
        after = await afetch_snapshot(client, url, MEASURE_TIMEOUT)
    return {"results": results, "wall": wall, "spec": after.minus(before)}


# -- statistics ----------------------------------------------------------------------

def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return statistics.fmean(xs) if xs else math.nan


def _ci(samples: list[float], confidence: float) -> list[float]:
    s = sorted(x for x in samples if not math.isnan(x))
    if not s:
        return [math.nan, math.nan]
    lo = s[int((1 - confidence) / 2 * (len(s) - 1))]
    hi = s[int((1 + confidence) / 2 * (len(s) - 1))]
    return [lo, hi]


def bootstrap_diff(a: list[Any], b: list[Any], stat, n: int = 1000, confidence: float = 0.9,
                   seed: int = 0) -> dict[str, Any]:
    """Estimate and percentile CI of ``stat(a) - stat(b)``, resampling each side's items."""
    if not a or not b:
        return {"estimate": None, "ci": [None, None], "confidence": confidence}
    rng = random.Random(seed)
    est = stat(a) - stat(b)
    diffs = []
    for _ in range(n):
        ra = [a[rng.randrange(len(a))] for _ in a]
        rb = [b[rng.randrange(len(b))] for _ in b]
        diffs.append(stat(ra) - stat(rb))
    lo, hi = _ci(diffs, confidence)
    return {"estimate": _clean(est), "ci": [_clean(lo), _clean(hi)], "confidence": confidence}


def _clean(x: Any) -> Any:
    return None if isinstance(x, float) and (math.isnan(x) or math.isinf(x)) else x


def _acc_len(items: list[RequestResult]) -> float:
    d = sum(r.drafts for r in items if not math.isnan(r.drafts))
    a = sum(r.accepted for r in items if not math.isnan(r.accepted))
    return 1.0 + a / d if d > 0 else math.nan


def _toks_per_s(c: int):
    def stat(items: list[RequestResult]) -> float:
        lat = sum(r.latency for r in items)
        return c * sum(r.output_tokens for r in items) / lat if lat > 0 else math.nan
    return stat


def _mean_of(attr: str):
    def stat(items: list[RequestResult]) -> float:
        if attr == "itl":
            return _mean([x for r in items for x in r.itls])
        return _mean([getattr(r, attr) for r in items])
    return stat


def summarize(blocks: list[dict], concurrencies: list[int], confidence: float, n_boot: int) -> dict[str, Any]:
    """Per-head figures and candidate − live differences with bootstrap CIs."""
    per_head: dict[str, Any] = {}
    pooled: dict[tuple[str, int], list[RequestResult]] = {}
    for role in ("candidate", "live"):
        spec_total: SpecDelta | None = None
        by_c = {}
        for c in concurrencies:
            bl = [b for b in blocks if b["role"] == role and b["concurrency"] == c]
            res = [r for b in bl for r in b["results"] if r.ok]
            pooled[(role, c)] = res
            tokens = sum(r.output_tokens for r in res)
            wall = sum(b["wall"] for b in bl)
            sd = _sum_spec([b["spec"] for b in bl])
            spec_total = sd if spec_total is None else _sum_spec([spec_total, sd])
            by_c[str(c)] = {
                "requests": len(res), "failed": sum(not r.ok for b in bl for r in b["results"]),
                "output_tokens": tokens, "output_tok_per_s": _clean(tokens / wall if wall > 0 else math.nan),
                "ttft_ms": _clean(_mean([r.ttft for r in res]) * 1000),
                "tpot_ms": _clean(_mean([r.tpot for r in res]) * 1000),
                "itl_ms": _clean(_mean([x for r in res for x in r.itls]) * 1000),
                "spec": sd.to_dict(),
            }
        per_head[role] = {"spec": spec_total.to_dict() if spec_total else None, "by_concurrency": by_c}
    diffs: dict[str, Any] = {}
    c1 = min(concurrencies)
    diffs["mean_acceptance_length"] = bootstrap_diff(pooled[("candidate", c1)], pooled[("live", c1)], _acc_len,
                                                     n_boot, confidence)
    for c in concurrencies:
        a, b = pooled[("candidate", c)], pooled[("live", c)]
        diffs[f"c{c}"] = {
            "output_tok_per_s": bootstrap_diff(a, b, _toks_per_s(c), n_boot, confidence),
            "tpot_ms": _scale(bootstrap_diff(a, b, _mean_of("tpot"), n_boot, confidence), 1000),
            "itl_ms": _scale(bootstrap_diff(a, b, _mean_of("itl"), n_boot, confidence), 1000),
            "ttft_ms": _scale(bootstrap_diff(a, b, _mean_of("ttft"), n_boot, confidence), 1000),
        }
    return {"per_head": per_head, "differences": diffs}


def _scale(d: dict, k: float) -> dict:
    d["estimate"] = None if d["estimate"] is None else d["estimate"] * k
    d["ci"] = [None if x is None else x * k for x in d["ci"]]
    return d


def _sum_spec(ds: list[SpecDelta]) -> SpecDelta:
    n = max((len(d.per_pos) for d in ds), default=0)
    return SpecDelta(
        seconds=sum(d.seconds for d in ds), drafts=sum(d.drafts for d in ds),
        draft_tokens=sum(d.draft_tokens for d in ds), accepted=sum(d.accepted for d in ds),
        per_pos=[sum(d.per_pos[i] if i < len(d.per_pos) else 0.0 for d in ds) for i in range(n)])


# -- the benchmark ---------------------------------------------------------------------

async def run_bench(url: str, heads: dict[str, dict[str, Any]], reqs: list[BenchRequest], *,
                    concurrencies: list[int], rounds: int, confidence: float = 0.9, n_boot: int = 1000,
                    restart=None) -> dict[str, Any]:
    """Alternate ``heads`` (``{"candidate": {...}, "live": {...}}`` with path/sha256/version) on ``url``.

    ``restart(head_path)`` is called when a head cannot be swapped in place
    (different shapes); without it such a pair is an error.
    """
    admin = ReplicaAdmin(url)
    blocks: list[dict] = []
    swaps: list[dict] = []
    original = await admin.head_info()
    try:
        await _rounds(admin, url, heads, reqs, concurrencies, rounds, restart, blocks, swaps)
    finally:
        # Leave an attached replica on the head it had (in place when shapes allow).
        if original.get("path"):
            try:
                await admin.load_head(original["path"], original.get("version"), original.get("sha256"))
            except Exception:  # noqa: BLE001
                if restart is not None:
                    await asyncio.to_thread(restart, original["path"])
    summary = summarize(blocks, concurrencies, confidence, n_boot)
    summary["swaps"] = swaps
    summary["blocks"] = [{
        "role": b["role"], "round": b["round"], "concurrency": b["concurrency"], "wall_s": b["wall"],
        "requests": len(b["results"]), "failed": sum(not r.ok for r in b["results"]),
        "errors": sorted({r.error for r in b["results"] if r.error})[:3], "spec": b["spec"].to_dict(),
    } for b in blocks]
    return summary


async def _rounds(admin: ReplicaAdmin, url: str, heads: dict, reqs: list[BenchRequest], concurrencies: list[int],
                  rounds: int, restart, blocks: list[dict], swaps: list[dict]) -> None:
    for rnd in range(rounds):
        for role in ("candidate", "live"):
            h = heads[role]
            t = time.perf_counter()
            try:
                info = await admin.load_head(h["path"], h.get("version"), h["sha256"])
                how = "inplace"
            except Exception as exc:  # noqa: BLE001
                if restart is None or "restart needed" not in str(exc):
                    raise
                await asyncio.to_thread(restart, h["path"])
                info = await admin.head_info()
                how = "restart"
            if info.get("sha256") != h["sha256"]:
                raise RuntimeError(f"bench replica reports {info.get('sha256')} instead of {h['sha256']}")
            swaps.append({"round": rnd, "role": role, "how": how, "ms": (time.perf_counter() - t) * 1000})
            # Warm-up request so the first timed request does not pay for the swap.
            async with httpx.AsyncClient() as c:
                await stream_one(c, url, reqs[0])
            for conc in concurrencies:
                b = await run_block(url, reqs, conc)
                b.update(role=role, round=rnd, concurrency=conc)
                blocks.append(b)


def run_bench_cli(cfg, *, candidate: str, live: str, heldout: str | None, url: str | None, out: Path | None,
                  concurrencies: list[int] | None = None, rounds: int | None = None,
                  max_prompts: int | None = None) -> dict[str, Any]:
    """``adapt bench``: resolve heads, start (or use) a bench replica, run, write JSON + PNG."""
    from adapt.checkpoint import validate_head
    from adapt.model_zoo import ensure_target
    from serving.plots import plot_bench
    from serving.pool import bench_replica_spec
    from serving.replica import ReplicaProcess
    from serving.serve import served_name
    from serving.swap import resolve_head

    target = ensure_target(cfg.target.model, cfg.target.model_cache)
    dl = Path(cfg.head.heads_dir) / "downloaded"
    heads = {}
    for role, spec in (("candidate", candidate), ("live", live)):
        d, ver = resolve_head(spec, dl, cfg.mlflow.tracking_uri)
        info = validate_head(d, target)
        heads[role] = {"path": str(info.path), "sha256": info.sha256, "spec": spec,
                       "version": ver or info.manifest.get("version") or info.sha256[:12],
                       "num_speculative_tokens": info.num_speculative_tokens}
    model = served_name(cfg)
    rows = load_heldout(cfg, heldout)
    reqs = rows_to_requests(rows, model, cfg.bench.max_tokens, max_prompts or cfg.bench.max_prompts)
    if not reqs:
        raise ValueError("no replayable held-out conversations")
    concs = list(concurrencies or cfg.bench.concurrencies)
    proc = None
    if url is None:
        spec = bench_replica_spec(cfg, target, heads["live"]["path"], model, concs)
        proc = ReplicaProcess(spec, Path(cfg.state_dir) / "serving" / "logs" / "bench-replica.log")
        proc.start()
        url = spec.url

    def restart(head_path: str) -> None:
        if proc is None:
            raise RuntimeError("heads differ in shape and the bench replica is attached: cannot restart it")
        proc.stop()
        proc.start(head_path)
        proc.wait_healthy()

    try:
        if proc is not None:
            proc.wait_healthy()
        summary = asyncio.run(run_bench(url, heads, reqs, concurrencies=concs,
                                        rounds=rounds or cfg.bench.rounds, confidence=cfg.gate.confidence,
                                        restart=restart))
    finally:
        if proc is not None:
            proc.stop()
    out = Path(out or Path(cfg.state_dir) / "bench" / time.strftime("%Y%m%dT%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
    result = {"heads": heads, "bench_url": url, "requests": len(reqs), "concurrencies": concs,
              "rounds": rounds or cfg.bench.rounds, **summary}
    result["summary"] = headline(result)
    json_path = out / "bench.json"
    json_path.write_text(json.dumps(result, indent=2, default=str))
    plot_path = plot_bench(result, out / "bench.png")
    result["json_path"], result["plot_path"] = str(json_path), str(plot_path)
    json_path.write_text(json.dumps(result, indent=2, default=str))
    return result


def headline(result: dict[str, Any]) -> dict[str, Any]:
    """The few numbers a person reads first."""
    ph, df = result["per_head"], result["differences"]
    out: dict[str, Any] = {}
    for role in ("candidate", "live"):
        s = ph[role]["spec"] or {}
        out[role] = {"sha256": result["heads"][role]["sha256"][:12],
                     "mean_acceptance_length": s.get("mean_acceptance_length"),
                     "output_tok_per_s": {c: ph[role]["by_concurrency"][c]["output_tok_per_s"]
                                          for c in ph[role]["by_concurrency"]}}
    out["delta_mean_acceptance_length"] = df["mean_acceptance_length"]
    out["delta_output_tok_per_s"] = {k[1:]: v["output_tok_per_s"] for k, v in df.items() if k.startswith("c")}
    return out
