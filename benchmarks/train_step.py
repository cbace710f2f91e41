"""Training speed on this device: featurization and the step of every attention backend, side by side.

With a target of SmolLM2-135M's shapes and random weights (``smollm2-shaped``, built once from
its config; nothing to download; what a step costs does not depend on the weights) and synthetic
conversations of ShareGPT-like lengths, in one run and through the product's own trainer
(:class:`adapt.recipe.TrainRecipe`: its featurization, collate, loss and step):

* featurization: tokens per second of one target forward per example and of the batched
  forwards (:meth:`adapt.features.TargetFeatures.compute_many`) on the same examples, and how
  far apart their features are;
* what ``[training] attention = "auto"`` picks here, with what it measured;
* per attention backend: training-step tokens per second with every feature cached, timed in
  ``--rounds`` rounds of ``--steps`` steps (the backends interleaved, each round on the same
  batches, a backend's round cut after ``--round-seconds``; median and range over the rounds),
  and ``max_abs_diff``: the largest difference of its loss and gradients from a dense fp32
  reference (SDPA's math kernel with the dense mask) on the first batch; on CUDA also the host
  synchronisations one step makes;
* ``end_to_end_tok_s``: one epoch with the auto-picked backend, every token featurized once
  (batched) and trained once.

``segment`` is the example-by-example backend every run used before: the baseline.

    python benchmarks/train_step.py [--quick] [--json] [--batch-tokens N] [--device auto|cpu|cuda]

``--json`` prints ``{"device", "auto", "backends": {name: {"tok_s", "max_abs_diff", ...}}, ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
import warnings
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WORDS = ("the of and to in is you that it he was for on are as with his they at be this have from or one had by "
         "word but not what all were we when your can said there use an each which she do how their if will up "
         "def return import class self print while else elif try except lambda yield json tool call function "
         "name value list dict int str float true false none user question answer code python data model").split()


def conversations(n: int, seed: int, max_words: int) -> list[dict]:
    """ShareGPT-like rows: a prompt of 10-300 words and an answer of 30-600 (log-uniform), random words."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        q = int(min(max_words // 3, 10 * (30 ** rng.random())))
        a = int(min(max_words, 30 * (20 ** rng.random())))
        rows.append({"content_hash": f"bench-{seed}-{i}", "conversations": [
            {"from": "human", "value": " ".join(rng.choice(WORDS) for _ in range(q))},
            {"from": "gpt", "value": " ".join(rng.choice(WORDS) for _ in range(a))}]})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--target", default="smollm2-shaped", help="smollm2-shaped (default), smollm2, tiny or a directory")
    ap.add_argument("--batch-tokens", type=int, default=None, help="default 512 on a CPU, 8192 on CUDA")
    ap.add_argument("--max-seq-len", type=int, default=1024)
    ap.add_argument("--conversations", type=int, default=None, help="default 64 on a CPU, 1024 on CUDA")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per backend per round (default 20)")
    ap.add_argument("--rounds", type=int, default=None, help="default 5 (3 on CUDA)")
    ap.add_argument("--round-seconds", type=float, default=20.0,
                    help="a backend's steps in one round stop after this long (at least one step): the slow "
                         "reference backend then times fewer batches instead of holding the run")
    ap.add_argument("--per-example", type=int, default=None,
                    help="examples featurized one by one for the comparison (default: all; 6 with --quick)")
    ap.add_argument("--backends", nargs="+", default=None, help="default: every backend this device trains with")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    ap.add_argument("--quick", action="store_true", help="fewer conversations, steps and rounds (minutes on a CPU)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    t_start = time.perf_counter()

    import torch

    from adapt.attention import Pick, candidates
    from adapt.device import pick_device
    from adapt.memory import heap_kept_between_steps
    from adapt.recipe import TrainRecipe
    from settings.config import load_config

    if args.threads:
        torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    cuda = device.type == "cuda"
    batch_tokens = args.batch_tokens or (8192 if cuda else 512)
    n_conv = args.conversations or (1024 if cuda else (24 if args.quick else 64))
    steps = args.steps or (6 if args.quick else 20)
    rounds = args.rounds or (3 if args.quick or cuda else 5)
    backends = args.backends or candidates(device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def log(msg: str) -> None:
        print(f"[train_step {time.perf_counter() - t_start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    work = Path(tempfile.mkdtemp(prefix="train-step-"))
    cfg = load_config(overrides={"state_dir": str(work / "state"), "target": {"model": args.target},
                                 "training": {"batch_tokens": batch_tokens, "max_seq_len": args.max_seq_len,
                                              "max_steps": 1 << 40, "device": str(device), "attention": "auto",
                                              "warmup_steps": 0}})
    recipe = TrainRecipe(cfg, work / "head", progress=False)
    log(f"device {device}, target {args.target}, {n_conv} conversations, batch_tokens {batch_tokens}")
    recipe.setup(conversations(n_conv, 0, args.max_seq_len // 2))
    tf, exs = recipe.features, recipe.examples
    tokens = sum(len(e) for e in exs)

    # --- featurization: one forward per example against batched forwards, same examples ---
    tf.compute_many(exs[:4])  # warm-up: first-call kernel selection is not what featurization costs
    tf.compute(exs[0])
    sync()
    t0 = time.perf_counter()
    many = tf.compute_many(exs)
    sync()
    t_many = time.perf_counter() - t0
    n_one = args.per_example or (6 if args.quick else len(exs))
    one_tokens = sum(len(e) for e in exs[:n_one])
    t0 = time.perf_counter()
    one = [tf.compute(e) for e in exs[:n_one]]
    sync()
    t_one = time.perf_counter() - t0
    rel = max(float((a.aux_hidden.float() - b.aux_hidden.float()).abs().max() / b.aux_hidden.float().abs().max())
              for a, b in zip(many, one))
    for i, f in enumerate(many):
        tf._keep(i, f)
    featurize = {"tokens": tokens, "batched_tok_s": round(tokens / t_many, 1),
                 "per_example_tok_s": round(one_tokens / t_one, 1), "per_example_tokens": one_tokens,
                 "batched_vs_per_example": round((tokens / t_many) / (one_tokens / t_one), 3),
                 "aux_max_rel_diff": rel, "batch_tokens": tf.batch_tokens, "cached": len(tf.cache),
                 "dtype": str(tf.runner.dtype).replace("torch.", "")}
    log(f"featurization: batched {featurize['batched_tok_s']:.0f} tok/s, one by one "
        f"{featurize['per_example_tok_s']:.0f} tok/s ({featurize['batched_vs_per_example']:.2f}x), "
        f"{len(tf.cache)}/{len(exs)} cached")

    # --- what auto picks here ---
    recipe.state.attention = ""
    pick = recipe._pick_attention(0)
    log(f"auto picks {pick.backend}: {pick.to_json()['median_ms']} ms per forward+backward")

    # --- each backend's loss and gradients against a dense fp32 reference (SDPA's math kernel) ---
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from adapt.loss import peagle_loss

    model, k = recipe.model, recipe.model.config.num_speculative_tokens
    feats0 = recipe._features(0)

    def loss_and_grads(backend: str | None) -> tuple[torch.Tensor, dict]:
        model.zero_grad(set_to_none=True)
        b = recipe._batch(feats0, 0, backend or "sdpa")
        b.aux_hidden = b.aux_hidden.float()
        if backend is None:
            with sdpa_kernel(SDPBackend.MATH):
                logits = model(**{**b.model_inputs(), "segments": None}, select=b.valid_index)
        else:
            logits = model(**b.drafter_inputs(), attention=b.attention(backend), select=b.valid_index)
        out = peagle_loss(logits, b, model.d2t, cfg.training.depth_weights, k)
        out.loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return out.loss.detach(), grads

    ref_loss, ref_grads = loss_and_grads(None)
    diffs = {}
    for b in backends:
        loss, grads = loss_and_grads(b)
        gd = max(float((grads[n] - ref_grads[n]).abs().max()) for n in ref_grads)
        diffs[b] = {"loss_abs_diff": float((loss - ref_loss).abs()), "grad_max_abs_diff": gd,
                    "max_abs_diff": max(gd, float((loss - ref_loss).abs()))}

    # --- the step of each backend, cached features, interleaved rounds on the same batches ---
    result = {b: {"tok_s_rounds": []} for b in backends}
    with heap_kept_between_steps() if not cuda else nullcontext():
        for b in backends:  # warm-up (compilation, kernel selection) on batches the rounds do not time
            recipe.attention = Pick(b, how="configured")
            # flex compiles again once batch shapes vary (then for any shape): three batches cover that.
            for s in range(3 if b == "flex" else 1):
                recipe._step(10_000 + s, 0.0)
            sync()
        for r in range(rounds):
            for b in (backends if r % 2 == 0 else list(reversed(backends))):
                recipe.attention = Pick(b, how="configured")
                ntok = 0
                sync()
                t0 = time.perf_counter()
                for s in range(steps):
                    _, n = recipe._step(r * steps + s, 0.0)
                    ntok += n
                    if s + 1 < steps and time.perf_counter() - t0 > args.round_seconds:
                        sync()
                        if time.perf_counter() - t0 > args.round_seconds:
                            break
                sync()
                result[b]["tok_s_rounds"].append(round(ntok / (time.perf_counter() - t0), 1))
            log(f"round {r + 1}/{rounds}: " + ", ".join(f"{b} {result[b]['tok_s_rounds'][-1]:.0f}" for b in backends)
                + " tok/s")
    if cuda:  # host synchronisations inside one step (torch's sync debug mode warns at each)
        for b in backends:
            recipe.attention = Pick(b, how="configured")
            torch.cuda.set_sync_debug_mode("warn")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                recipe._step(20_000, 0.0)
                sync()
            torch.cuda.set_sync_debug_mode(0)
            result[b]["syncs_per_step"] = sum("synchroniz" in str(w.message) for w in caught)
    for b in backends:
        t = result[b]["tok_s_rounds"]
        result[b].update(tok_s=round(statistics.median(t), 1), tok_s_min=min(t), tok_s_max=max(t), **diffs[b])
    base = result.get("segment", {}).get("tok_s")
    for b in backends:
        if base:
            result[b]["vs_segment"] = round(result[b]["tok_s"] / base, 3)
    step_tok_s = result.get(pick.backend, {}).get("tok_s")
    out = {
        "device": str(device), "device_name": torch.cuda.get_device_name(device) if cuda else "cpu",
        "auto": pick.backend, "backends": result, "auto_measured": pick.to_json(), "featurize": featurize,
        "end_to_end_tok_s": round(1 / (1 / featurize["batched_tok_s"] + 1 / step_tok_s), 1) if step_tok_s else None,
        "target": args.target, "batch_tokens": batch_tokens, "max_seq_len": args.max_seq_len,
        "conversations": len(exs), "tokens": tokens, "steps_per_round": steps, "rounds": rounds,
        "bf16_autocast": recipe.bf16, "threads": torch.get_num_threads(), "torch": torch.__version__,
        "seconds": round(time.perf_counter() - t_start, 1),
    }
    recipe.cleanup()
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"device {out['device']} ({out['device_name']}), torch {out['torch']}, {out['threads']} threads, "
          f"bf16 autocast {out['bf16_autocast']}; target {args.target}; {len(exs)} conversations, {tokens} tokens; "
          f"batch_tokens {batch_tokens}")
    print(f"featurization ({featurize['dtype']}): batched {featurize['batched_tok_s']:.0f} tok/s, one forward per "
          f"example {featurize['per_example_tok_s']:.0f} tok/s ({featurize['batched_vs_per_example']:.2f}x); aux "
          f"states differ by at most {featurize['aux_max_rel_diff']:.4f} of their largest value")
    print(f"{'backend':<9} {'tok/s':>9} {'range':>17} {'vs segment':>10} {'max |diff|':>11}"
          + (f" {'syncs/step':>10}" if cuda else ""))
    for b in backends:
        x = result[b]
        print(f"{b:<9} {x['tok_s']:>9.0f} {x['tok_s_min']:>8.0f}-{x['tok_s_max']:<8.0f} "
              f"{x.get('vs_segment', float('nan')):>9.2f}x {x['max_abs_diff']:>11.2e}"
              + (f" {x['syncs_per_step']:>10}" if cuda else ""))
    print(f"auto picks {pick.backend} (measured {pick.to_json()['median_ms']} ms per forward+backward); "
          f"one epoch end to end (featurize + train): {out['end_to_end_tok_s']} tok/s")
    print(f"{rounds} rounds of {steps} steps per backend; {out['seconds']:.0f}s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
