"""`adapt demo`: the whole product on one machine, end to end, with real parts.

1. start a pool of the target in vLLM behind the capturing router, serving a cold-start
   (untrained) P-EAGLE head, plus a dedicated bench replica;
2. replay general ShareGPT conversations (real users' multi-turn chat, turn by turn with the
   target's own answers) through the router, so they are captured;
3. cycle 1 bootstraps a base head from that traffic, benchmarks it against the cold head,
   gates, registers and promotes it, and the pool hot-swaps to it;
4. replay drifted traffic (code-heavy ShareGPT conversations, BFCL tool calls) through the router;
5. cycle 2 adapts the Production head to the captured drift: train, offline eval, replay
   benchmark against the live head, gate, register, promote, hot-swap;
6. roll back by moving the previous version to Production in the registry, and time how
   long the controller takes to make the pool follow.

Sizes live in ``[demo]`` of the config; progress goes to stderr, the report to stdout.
"""

from __future__ import annotations

import datetime as dt
import json
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

from settings.config import Config, load_config

Log = Callable[[str], None]


def stderr_log(t0: float) -> Log:
    def log(msg: str) -> None:
        sys.stderr.write(f"[demo {time.monotonic() - t0:7.1f}s] {msg}\n")
        sys.stderr.flush()

    return log


def demo_config(cfg: Config) -> Config:
    """The demo's own config: the user's, with state in ``<state_dir>/demo``.

    Swaps are admin actions and the router refuses them without a token, so when none is
    configured the demo makes a one-off token for its own pool and controller.
    """
    import secrets

    token = cfg.serving.resolved_admin_token() or secrets.token_urlsafe(24)
    return load_config(cfg.source_file, overrides={"state_dir": str(Path(cfg.state_dir) / "demo"),
                                                   "serving": {"admin_token": token}})


def with_overrides(cfg: Config, **sections: dict[str, Any]) -> Config:
    """A copy of ``cfg`` with some section fields replaced (validated)."""
    data = cfg.model_dump()
    for name, values in sections.items():
        data[name] = {**data[name], **values}
    return Config.model_validate(data)


# --- traffic ---------------------------------------------------------------------------


def demo_traffic(cache_dir: str, d) -> dict[str, list[dict]]:
    """The demo's conversations as ShareGPT rows: general ones, and the drift (code-heavy + tool calls)."""
    from traffic import public_prompts, sharegpt

    convs = [c for c in sharegpt.stable_order(sharegpt.load(cache_dir).conversations, "demo")
             if len(c.user_turns[0]) <= d.max_turn_chars]
    general, code = sharegpt.general_and_code(convs)
    tools = [{"id": p["id"], "conversations": [{"from": "system" if m["role"] == "system" else "human",
                                                 "value": m["content"]} for m in p["messages"]]}
             for p in public_prompts.bfcl(cache_dir)[: d.tool_prompts]]
    drift = [c.to_row() for c in code[: d.drifted_conversations]] + tools
    drift.sort(key=lambda r: r["id"])  # code and tool calls mixed, the same way every run
    return {"general": [c.to_row() for c in general[: d.general_conversations]], "drifted": drift}


def send_phases(stack, model: str, rows: list[dict], dcfg, log: Log, label: str) -> dict[str, Any]:
    """Replay ``rows`` turn by turn through the router: the first part, a quiet gap, then the held-out part.

    Returns the replay counts and the gap's midpoint (UTC): what came after it is held out.
    """
    from traffic.replay import replay

    n_hold = max(1, round(len(rows) * dcfg.heldout_fraction))
    kw = dict(max_tokens=dcfg.max_tokens, max_turns=dcfg.max_turns, concurrency=dcfg.concurrency, rate=dcfg.rate)
    a = replay(stack.url, model, rows[:-n_hold], **kw).to_json()
    log(f"{label}: {a['turns_ok']}/{a['turns_sent']} turns ok in {a['conversations']} conversations "
        f"({a['context_full']} ended at the context limit), {a['output_tokens']} tokens at {a['output_tok_per_s']} tok/s")
    time.sleep(dcfg.gap_seconds / 2)
    gap_mid = dt.datetime.now(dt.timezone.utc)
    time.sleep(dcfg.gap_seconds / 2)
    b = replay(stack.url, model, rows[-n_hold:], **kw).to_json()
    log(f"{label} (held-out period): {b['turns_ok']}/{b['turns_sent']} turns ok in {b['conversations']} conversations")
    return {"train_phase": a, "heldout_phase": b, "gap_mid": gap_mid}


def wait_captured(stack, expected: int, timeout: float = 60) -> dict[str, int]:
    """Wait until the router's capture writer has written ``expected`` records in total."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        counts = dict(stack.writer.counts)
        if counts["written"] >= expected:
            return counts
        time.sleep(0.5)
    raise TimeoutError(f"capture wrote {stack.writer.counts['written']} of {expected} records")


def heldout_hours_for(cfg: Config, gap_mid: dt.datetime) -> tuple[float, dict[str, Any]]:
    """Hold out exactly what was served after ``gap_mid``: ingest, then measure from the newest record.

    Returns the held-out hours and the ingest's summary: this is the cycle's real ingest, so the
    cycle's own ingest step finds nothing new (``read: 0``) and the report shows this one.
    """
    import pyarrow.compute as pc

    from capture.ingest import ingest
    from capture.warehouse import Warehouse

    summary = ingest(cfg).summary()
    wh = Warehouse(cfg)
    try:
        t = wh.read_conversations(columns=["inference_time"])
    finally:
        wh.close()
    latest = pc.max(t.column("inference_time")).as_py()
    return max((latest - gap_mid).total_seconds(), 1.0) / 3600, summary


# --- registry / pool views ---------------------------------------------------------------


def registry_view(cfg: Config) -> list[dict[str, Any]]:
    from rollout.registry import Registry

    reg = Registry(cfg)
    return reg.describe_all()


def pool_heads(stack) -> list[dict[str, Any]]:
    st = stack.run_coro(_status(stack))
    return [{"url": r["url"], "head_version": r["head_version"], "head_sha256": (r["head_sha256"] or "")[:12],
             "healthy": r["healthy"]} for r in st["replicas"]]


async def _status(stack) -> dict[str, Any]:
    return stack.pool.status()


def move_to_production_by_hand(cfg: Config, version: str) -> None:
    """What a person does in the MLflow UI: transition a version's stage to Production."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=cfg.mlflow.tracking_uri)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        client.transition_model_version_stage(cfg.mlflow.registered_model, version, "Production",
                                              archive_existing_versions=True)


def wait_pool_serves(stack, sha256: str, timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        heads = pool_heads(stack)
        if heads and all(h["head_sha256"] == sha256[:12] for h in heads if h["healthy"]):
            return time.monotonic() - t0
        time.sleep(0.25)
    raise TimeoutError(f"pool did not serve {sha256[:12]} within {timeout}s: {pool_heads(stack)}")


# --- the demo --------------------------------------------------------------------------------


def bench_figures(summary: dict[str, Any]) -> dict[str, Any]:
    """Before (live) / after (candidate) figures from a cycle's replay benchmark, with the A/A
    control beside each difference and the speed-up over no speculation where it was measured."""
    from evaluation.result import BenchResult

    bench = summary["steps"].get("bench") or {}
    if bench.get("skipped") or not bench.get("json_path"):
        return {}
    full = BenchResult.load(summary["artifacts"]["bench_json"])
    out: dict[str, Any] = {}
    for role, name in (("live", "before"), ("candidate", "after")):
        arm = full.arms[role]
        spec = arm.spec.to_json() if arm.spec else {}
        out[name] = {
            "head_version": full.heads[role].version,
            "mean_acceptance_length": arm.mean_acceptance_length,
            "acceptance_per_position": spec.get("acceptance_per_pos"),
            "output_tok_per_s": {str(c): f.output_tok_per_s for c, f in arm.by_concurrency.items()},
            "tpot_ms": {str(c): f.tpot_ms for c, f in arm.by_concurrency.items()},
            "ttft_ms": {str(c): f.ttft_ms for c, f in arm.by_concurrency.items()},
            "speedup_vs_nospec": {str(c): x for c, x in full.speedup(role).items()},
        }
    if "nospec" in full.arms:
        out["nospec"] = {"output_tok_per_s": {str(c): f.output_tok_per_s
                                              for c, f in full.arms["nospec"].by_concurrency.items()}}
    out["differences"] = full.differences.to_json()
    aa = full.aa_control
    out["aa_control"] = aa.to_json() if aa else None
    out["attempts"] = len(bench.get("attempts") or [1])
    out["verdict"] = (bench.get("verdict") or {}).get("verdict")
    out["heldout_overlap"] = {k: v for k, v in (full.heldout_overlap or {}).items() if k != "matches"}
    out["plot"] = summary["artifacts"]["bench_plot"]
    return out


def slower_than_nospec(figures: dict[str, Any], name: str = "after") -> list[str]:
    """Concurrencies where a head measured slower than serving without speculation, in words."""
    sp = (figures.get(name) or {}).get("speedup_vs_nospec") or {}
    return [f"at concurrency {c} this head is slower than serving without speculation ({x:.2f}x)"
            for c, x in sp.items() if x is not None and x < 1.0]


def _demo_cycle(cfg: Config, opts, stack, gap_mid: dt.datetime, steps: int, report: dict[str, Any],
                key: str, log: Log) -> dict[str, Any]:
    """One cycle over what was captured, holding out what came after ``gap_mid``; records it in ``report``."""
    from loop.cycle import run_cycle

    hours, ingested = heldout_hours_for(cfg, gap_mid)
    log(f"{key}: ingested {json.dumps(ingested)}")
    c = run_cycle(with_overrides(cfg, capture={"heldout_hours": hours},
                                 training={"max_steps": steps, "max_minutes": cfg.demo.train_minutes}), opts=opts)
    log(f"{key}: version {c['version']} {c['verdict']} ({c['reason']}); pool: {pool_heads(stack)}")
    report[key] = {k: c[k] for k in ("cycle_id", "version", "verdict", "reason", "promoted", "artifacts", "timings")}
    report[key]["ingest"] = ingested
    report[key]["bench"] = bench_figures(c)
    for w in slower_than_nospec(report[key]["bench"]):
        log(f"{key}: version {c['version']}: {w}")
    return c


def rollback_skip_reason(c1: dict[str, Any], c2: dict[str, Any]) -> str | None:
    """Why the demo cannot show a rollback after these two cycles (None: it can)."""
    if not c2["promoted"]:
        return f"cycle 2 did not promote a new version ({c2['verdict']}), so there is nothing newer to roll back from"
    if not c1["promoted"]:
        return (f"cycle 1's version was {c1['verdict']} and never served, so there is no earlier Production "
                "version to roll back to")
    return None


def run_demo(user_cfg: Config, log: Log) -> dict[str, Any]:
    """Run the demo; returns the report (also written to ``<state_dir>/demo/report.json``)."""
    from adapt.checkpoint import init_random_head
    from headspec.validate import validate_head
    from rollout.controller import Controller
    from loop.cycle import CycleOptions
    from serving.pool import bench_replica_spec
    from serving.replica import ReplicaProcess
    from serving.serve import ServingStack, served_name
    from targets.model_zoo import ensure_target

    t_start = time.monotonic()
    cfg = demo_config(user_cfg)
    d = user_cfg.demo
    root = Path(cfg.state_dir)
    if d.fresh and root.exists():
        log(f"removing the previous demo state in {root}")
        shutil.rmtree(root)
    root.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"state_dir": str(root), "target": cfg.target.model,
                              "config": {"demo": d.model_dump(), "head": cfg.head.model_dump()}}

    log(f"target model: {cfg.target.model}")
    target = ensure_target(cfg.target.model, cfg.target.model_cache)
    traffic = demo_traffic(cfg.cache_dir, d)
    log(f"traffic: {len(traffic['general'])} general ShareGPT conversations, then {len(traffic['drifted'])} "
        "drifted ones (code-heavy ShareGPT and BFCL tool calls), replayed turn by turn")

    cold = init_random_head(target, Path(cfg.head.heads_dir) / "cold-start", k=cfg.head.num_speculative_tokens,
                            draft_vocab_size=cfg.head.draft_vocab_size,
                            aux_layer_ids=cfg.head.aux_layer_ids or None, num_layers=cfg.head.num_layers)
    model = served_name(cfg.target)
    k, concs = cfg.head.num_speculative_tokens, cfg.bench.concurrencies
    bench_spec = bench_replica_spec(cfg.serving, k, target, cold, model, concs)
    nospec_spec = bench_replica_spec(cfg.serving, k, target, None, model, concs)
    bench = ReplicaProcess(bench_spec, root / "serving" / "logs" / "bench-replica.log")
    nospec = ReplicaProcess(nospec_spec, root / "serving" / "logs" / "bench-nospec-replica.log")
    log(f"starting {cfg.serving.replicas} serving replica(s) + router on :{cfg.serving.router_port}, "
        f"a bench replica and a replica without speculation as the bench's reference "
        f"(vLLM engine start takes about a minute each)")
    bench.start()
    nospec.start()
    stack = ServingStack(cfg, head_dir=cold, target_dir=target)
    controller = None
    try:
        stack.start()
        bench.wait_healthy()
        nospec.wait_healthy()
        log(f"pool up at {stack.url}: {pool_heads(stack)}")
        opts = CycleOptions(live_head=str(cold), bench_url=bench_spec.url, nospec_url=nospec_spec.url,
                            router_url=stack.url, progress=lambda m: log(f"  {m}"))

        # --- general chat → bootstrap ---
        g = send_phases(stack, model, traffic["general"], d, log, "general chat")
        sent = g["train_phase"]["turns_ok"] + g["heldout_phase"]["turns_ok"]
        wait_captured(stack, sent)
        log("cycle 1 (bootstrap from general chat): ingest → snapshot → train → eval → bench → gate → register → promote")
        c1 = _demo_cycle(cfg, opts, stack, g["gap_mid"], d.bootstrap_steps, report, "cycle1", log)

        # --- drifted traffic → adaptation ---
        t = send_phases(stack, model, traffic["drifted"], d, log, "drifted traffic (code, tool calls)")
        wait_captured(stack, sent + t["train_phase"]["turns_ok"] + t["heldout_phase"]["turns_ok"])
        report["traffic"] = {"general": _strip(g), "drifted": _strip(t)}
        log("cycle 2 (nightly adaptation to the drift), training from the Production head")
        c2 = _demo_cycle(cfg, opts, stack, t["gap_mid"], d.adapt_steps, report, "cycle2", log)
        report["registry_after_cycles"] = registry_view(cfg)
        report["pool_after_cycles"] = pool_heads(stack)

        # --- rollback by stage change, followed by the controller daemon ---
        skip = rollback_skip_reason(c1, c2)
        if skip:
            report["rollback"] = {"skipped": skip}
        else:
            controller = Controller(cfg, router_url=stack.url, poll_seconds=1.0).start()
            old = str(c1["version"])
            sha = validate_head(report["cycle1"]["artifacts"]["head"]).sha256
            log(f"rollback: moving version {old} to Production in the registry (as in the MLflow UI)")
            t_move = time.monotonic()
            move_to_production_by_hand(cfg, old)
            follow = wait_pool_serves(stack, sha, timeout=60)
            log(f"the pool serves version {old} again after {follow:.1f}s")
            report["rollback"] = {"to_version": old, "pool_followed_after_s": round(follow, 2),
                                  "pool": pool_heads(stack), "registry": registry_view(cfg),
                                  "controller_events": list(controller.events)[-5:]}
            del t_move
    finally:
        if controller is not None:
            controller.stop()
        stack.stop()
        bench.stop()
        nospec.stop()
    report["total_seconds"] = round(time.monotonic() - t_start, 1)
    (root / "report.json").write_text(json.dumps(report, indent=2, default=str))
    return report


def _strip(phases: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in phases.items() if k != "gap_mid"}


def _num(x: Any, fmt: str = ".2f") -> str:
    return "n/a" if x is None else format(x, fmt)


def render(report: dict[str, Any]) -> str:
    """A person-readable summary of the demo report."""
    lines = [f"drafter-adapt demo — target {report['target']}, {report['total_seconds']:.0f}s total", ""]
    for key, title in (("cycle1", "cycle 1: bootstrap from general chat"), ("cycle2", "cycle 2: adapt to drifted traffic")):
        c = report.get(key)
        if not c:
            continue
        b = c.get("bench") or {}
        tries = f", {b['attempts']} benchmark runs" if b.get("attempts", 1) > 1 else ""
        lines.append(f"{title}: version {c['version']} → {c['verdict']}{tries}"
                     f"{' and promoted' if c.get('promoted') else ', not promoted'} ({c['reason']})")
        if c.get("ingest"):
            i = c["ingest"]
            lines.append(f"  ingest: read {i['read']}, normalized {i['normalized']}, duplicates {i['duplicates']}, "
                         f"quarantined {i['quarantined']}, skipped {i['skipped']}")
        for name in ("before", "after"):
            if name in b:
                f = b[name]
                per_pos = ", ".join(_num(x) for x in (f["acceptance_per_position"] or []))
                tps = ", ".join(f"c{c_}={_num(v, '.1f')}" for c_, v in f["output_tok_per_s"].items())
                sp = ", ".join(f"c{c_}={_num(v)}x" for c_, v in (f.get("speedup_vs_nospec") or {}).items())
                lines.append(f"  {name:<6} head {str(f['head_version'])[:14]:<14} acceptance length "
                             f"{_num(f['mean_acceptance_length'])}  per position [{per_pos}]  tok/s {tps}"
                             + (f"  vs no speculation {sp}" if sp else ""))
        if "nospec" in b:
            tps = ", ".join(f"c{c_}={_num(v, '.1f')}" for c_, v in b["nospec"]["output_tok_per_s"].items())
            lines.append(f"  no speculation{'':<12}tok/s {tps}")
        if b.get("differences"):
            d, aa = b["differences"], b.get("aa_control") or {}

            def aa_ci(iv: dict | None, fmt: str) -> str:
                ci = (iv or {}).get("ci") or [None, None]
                return "n/a" if ci[0] is None else f"[{ci[0]:{fmt}}, {ci[1]:{fmt}}]"

            parts = [f"acceptance length {_num(d['mean_acceptance_length']['estimate'], '+.3f')} "
                     f"(A/A {aa_ci(aa.get('mean_acceptance_length'), '+.3f')})"]
            parts += [f"tok/s c{c_} {_num(v['output_tok_per_s']['estimate'], '+.1f')} "
                      f"(A/A {aa_ci(((aa.get('by_concurrency') or {}).get(c_) or {}).get('output_tok_per_s'), '+.1f')})"
                      for c_, v in d["by_concurrency"].items()]
            lines.append("  after − before (live and its A/A control pooled): " + ", ".join(parts))
        ov = b.get("heldout_overlap") or {}
        if ov:
            lines.append(f"  held-out: {ov.get('repeats_training', 0)} of {ov.get('heldout', 0)} conversations repeat "
                         f"a training prompt{' (left out of the bench)' if ov.get('excluded') else ''}")
        for w in slower_than_nospec(b):
            lines.append(f"  NOTE: {w}")
        if b.get("plot"):
            lines.append(f"  plot: {b['plot']}")
    serving = report.get("pool_after_cycles") or []
    if serving:
        lines.append("")
        lines.append("pool after the cycles serves version(s) "
                     + ", ".join(sorted({str(h["head_version"]) for h in serving})))
    rb = report.get("rollback") or {}
    lines.append("")
    if "to_version" in rb:
        lines.append(f"rollback: version {rb['to_version']} moved to Production; pool followed in {rb['pool_followed_after_s']}s")
    else:
        lines.append(f"rollback: {rb.get('skipped')}")
    lines.append("registry:")
    for v in rb.get("registry") or report.get("registry_after_cycles") or []:
        lines.append(f"  {json.dumps(v, default=str)}")
    lines.append(f"report: {report['state_dir']}/report.json")
    return "\n".join(lines)
