"""Featurization: the target's forward for training features, in bf16 and in fp32, side by side.

A capped training cycle on CPU spends most of its first epoch running the target
(:class:`adapt.features.TargetFeatures`). This runs the same real conversations
(ShareGPT, code and general, tokenized as training tokenizes them) through the
target in both precisions, in alternating order over ``--rounds`` rounds, and prints:

* tokens per second of each precision, per round, and the fp32/bf16 ratio with its
  spread over the rounds;
* how far the fp32 features are from bf16 ones: relative error of the aux hidden
  states (and bf16 against itself recomputed, which must be 0), and how often the
  target's argmax on labelled rows agrees between the two.

What ``[training] dtype = "auto"`` picks on this machine is printed too.

    python benchmarks/featurize.py [--conversations 24] [--rounds 3] [--target smollm2|tiny|DIR] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--conversations", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-seq-len", type=int, default=1024)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import torch

    from adapt.data import tokenize_rows
    from adapt.device import use_bf16_autocast
    from adapt.features import TargetFeatures
    from headspec.config import default_aux_layer_ids
    from settings.config import load_config
    from targets.model_zoo import ensure_target
    from traffic import sharegpt

    cfg = load_config()
    target = ensure_target(args.target, cfg.target.model_cache)
    convs = sharegpt.stable_order(sharegpt.load(cfg.cache_dir).conversations, "featurize")
    general, code = sharegpt.general_and_code(convs)
    half = args.conversations // 2
    rows = [c.to_row() for c in code[:half] + general[: args.conversations - half]]

    from transformers import AutoConfig

    tcfg = AutoConfig.from_pretrained(target)
    aux_ids = default_aux_layer_ids(tcfg.num_hidden_layers)
    draft_ids = torch.arange(min(32000, tcfg.vocab_size))
    cpu = torch.device("cpu")
    arms = {"bf16": TargetFeatures(target, aux_ids, draft_ids, cpu, cache_bytes=0, dtype=torch.bfloat16),
            "fp32": TargetFeatures(target, aux_ids, draft_ids, cpu, cache_bytes=0, dtype=torch.float32)}
    examples = tokenize_rows(arms["bf16"].runner.tokenizer, rows, args.max_seq_len)
    tokens = sum(len(e) for e in examples)
    for arm in arms.values():  # warm-up: first-call kernel selection is not what a step costs
        arm.compute(examples[0])

    rounds: list[dict[str, float]] = []
    kept: dict[str, list] = {}
    for r in range(args.rounds):
        order = ["bf16", "fp32"] if r % 2 == 0 else ["fp32", "bf16"]
        tok_s = {}
        for name in order:
            t0 = time.perf_counter()
            feats = [arms[name].compute(ex) for ex in examples]
            tok_s[name] = tokens / (time.perf_counter() - t0)
            if r == 0:
                kept[name] = feats
            elif name == "bf16" and r == 1:
                kept["bf16_again"] = feats
        tok_s["ratio"] = tok_s["fp32"] / tok_s["bf16"]
        rounds.append(tok_s)
        print(f"round {r + 1}: bf16 {tok_s['bf16']:.0f} tok/s, fp32 {tok_s['fp32']:.0f} tok/s, "
              f"fp32/bf16 {tok_s['ratio']:.2f}x", file=sys.stderr, flush=True)

    def rel_err(a_name: str, b_name: str) -> float:
        num = sum(float((a.aux_hidden.float() - b.aux_hidden.float()).norm() ** 2)
                  for a, b in zip(kept[a_name], kept[b_name]))
        den = sum(float(b.aux_hidden.float().norm() ** 2) for b in kept[b_name])
        return (num / den) ** 0.5

    rows_total = sum(len(f.logit_rows) for f in kept["bf16"])
    agree = sum(int((a.target_argmax[a.logit_rows] == b.target_argmax[b.logit_rows]).sum())
                for a, b in zip(kept["fp32"], kept["bf16"]))
    ratios = [r["ratio"] for r in rounds]
    result = {
        "target": Path(target).name, "threads": torch.get_num_threads(),
        "auto_picks": "bf16" if use_bf16_autocast("auto", cpu) else "fp32",
        "conversations": len(examples), "tokens": tokens, "rounds": rounds,
        "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
        "aux_rel_err_fp32_vs_bf16": rel_err("fp32", "bf16"),
        "aux_rel_err_bf16_vs_bf16": rel_err("bf16_again", "bf16") if "bf16_again" in kept else None,
        "labelled_rows": rows_total, "argmax_agreement": agree / rows_total,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"target {result['target']}, {result['threads']} threads, {len(examples)} conversations, {tokens} tokens")
    print(f"{'round':>5}  {'bf16 tok/s':>10}  {'fp32 tok/s':>10}  {'fp32/bf16':>9}")
    for i, r in enumerate(rounds, 1):
        print(f"{i:>5}  {r['bf16']:>10.0f}  {r['fp32']:>10.0f}  {r['ratio']:>8.2f}x")
    print(f"fp32/bf16: median {result['ratio_median']:.2f}x (rounds {result['ratio_min']:.2f}x to "
          f"{result['ratio_max']:.2f}x)")
    again = result["aux_rel_err_bf16_vs_bf16"]
    print(f"aux hidden, fp32 vs bf16: relative error {result['aux_rel_err_fp32_vs_bf16']:.4f}"
          + (f" (bf16 recomputed vs bf16: {again:.4f})" if again is not None else ""))
    print(f"target argmax on {rows_total} labelled rows: fp32 and bf16 agree on "
          f"{100 * result['argmax_agreement']:.2f}%")
    print(f'[training] dtype = "auto" picks {result["auto_picks"]} on this machine')
    return 0


if __name__ == "__main__":
    sys.exit(main())
