"""What the evaluate step's target work costs on a held-out set, three ways side by side in one run.

  generated, held-out order   the target answers every prompt again, batches taken in the set's order
                              (how the step ran before: a batch pads to its longest prompt)
  generated, by length        the same answers, batches of similar prompt lengths (what it does now for
                              requests without a served answer)
  served                      greedy requests whose answers the capture holds as token ids: nothing is
                              answered again, only the forward that gives the heads their aux states

Every arm then drafts with the same two heads (``evaluation.offline.acceptance``); the per-prompt counts
of the three must agree (the served answers are the by-length arm's own answers, stored as the router
stores them), and the script says whether they do.

    python benchmarks/offline_eval.py [--rows 32] [--rounds 2] [--device auto] [--json]
    python benchmarks/offline_eval.py --write-rows rows.json        # the held-out requests, for a GPU host
    python benchmarks/offline_eval.py --rows-file rows.json --target DIR --random-weights   # there

The held-out set is the demo's: the requests of its last 12 general ShareGPT conversations, turn by
turn (up to 3 turns, each answer cut to 300 characters, as the demo's 64-token answers are short).
``--random-weights`` gives the target (its config and tokenizer from ``--target``) random weights of its
shape: the time is the same, the answers are not the model's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from adapt.checkpoint import init_random_head, load_head  # noqa: E402
from adapt.hidden_states import TargetRunner  # noqa: E402
from evaluation.offline import acceptance, prepare_sequences, served_answer, target_placement  # noqa: E402

MAX_NEW_TOKENS = 32  # [bench] max_tokens of the demo
BATCH = 8  # compare_heads' default (--batch)


def demo_rows(n: int, conversations: int = 12) -> list[dict]:
    """The demo's general held-out conversations (its held-out general ones, then the general ones after
    them, as the demo picks them) as one request per turn (the prompt up to that turn)."""
    from app.demo import demo_traffic, split_heldout
    from settings.config import load_config

    cfg = load_config()
    d = cfg.demo
    first = d.general_conversations - len(split_heldout([None] * d.general_conversations, d.heldout_fraction)[1])
    more = d.model_copy(update={"general_conversations": first + conversations})
    rows = []
    for conv in demo_traffic(cfg.cache_dir, more)["general"][first:]:
        turns = conv["conversations"]
        for g in [i for i, t in enumerate(turns) if t["from"] == "gpt"][:3]:
            req = [dict(t, value=t["value"][:300]) if t["from"] == "gpt" else dict(t) for t in turns[:g + 1]]
            if any(t["from"] == "human" for t in req[:-1]):
                rows.append({"id": f"{conv['id']}-{g}", "conversations": req, "temperature": 0.0})
    return rows[:n]


def random_target(src: Path, dtype: torch.dtype) -> Path:
    """A copy of ``src``'s config and tokenizer with random weights of its shape."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(tempfile.mkdtemp(prefix="offline-eval-target-"))
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".bin", ".gguf")) and not f.name.startswith("."):
            shutil.copy(f, out / f.name)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out), dtype=dtype).save_pretrained(out)
    return out


def served_rows(runner: TargetRunner, rows: list[dict], prompts: list[list[int]], seqs) -> list[dict]:
    """``rows`` as the router captures greedy requests: the answer's text and its prompt and output ids."""
    out = []
    for row, prompt, s in zip(rows, prompts, seqs):
        answer = s.seq[s.prompt_len:]
        text = runner.tokenizer.decode(answer, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        out.append({**row, "conversations": row["conversations"][:-1] + [{"from": "gpt", "value": text}],
                    "prompt_token_ids": prompt, "output_token_ids": answer, "finish_reason": "length"})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=32, help="held-out requests at most (the demo's bootstrap has 32)")
    ap.add_argument("--conversations", type=int, default=12, help="held-out conversations (the demo's: 12)")
    ap.add_argument("--rows-file", type=Path, help="held-out requests written by --write-rows")
    ap.add_argument("--write-rows", type=Path, help="write the held-out requests to this file and stop")
    ap.add_argument("--target", type=Path, help="target directory (default: the config's, converted)")
    ap.add_argument("--random-weights", action="store_true")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--rounds", type=int, default=1, help="each arm this many times, interleaved")
    ap.add_argument("--batch", type=int, default=BATCH, help="prompts generated at a time")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    batch = args.batch

    if args.write_rows:
        rows = demo_rows(args.rows, args.conversations)
        args.write_rows.write_text(json.dumps(rows))
        print(f"wrote {len(rows)} held-out requests to {args.write_rows}")
        return
    rows = (json.loads(args.rows_file.read_text())[:args.rows] if args.rows_file
            else demo_rows(args.rows, args.conversations))
    target = args.target
    if target is None:
        from settings.config import load_config
        from targets.model_zoo import ensure_target

        cfg = load_config()
        target = Path(ensure_target(cfg.target.model, cfg.target.model_cache))
    dtype, device_map = target_placement(args.device)
    if args.random_weights:
        target = random_target(Path(target), dtype)
    tmp = Path(tempfile.mkdtemp(prefix="offline-eval-heads-"))
    heads = [load_head(init_random_head(target, tmp / name, k=3, seed=i, draft_vocab_size=8192))[0]
             for i, name in enumerate(("candidate", "live"))]
    runner = TargetRunner(target, heads[0].config.aux_layer_ids, device=args.device, dtype=dtype,
                          device_map=device_map)
    heads = [h.to(runner.device) for h in heads]
    k = heads[0].config.num_speculative_tokens
    cuda = runner.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    prompts = [runner.prompt_ids(r) for r in rows]

    def by_heldout_order():
        # One call per batch of the set's order: each batch pads to its own longest prompt, as before.
        return [s for i in range(0, len(prompts), batch)
                for s in prepare_sequences(runner, prompts[i:i + batch], MAX_NEW_TOKENS, k, batch)]

    def by_length():
        return prepare_sequences(runner, prompts, MAX_NEW_TOKENS, k, batch)

    def served():
        got = [served_answer(runner.tokenizer, r) for r in captured]
        if any(g is None for g in got):
            raise RuntimeError("a served row was not taken as served")
        return prepare_sequences(runner, [g[0] for g in got], MAX_NEW_TOKENS, k, batch, answers=[g[1] for g in got])

    by_length()  # warm-up (kernels, allocator), and the answers the served arm stores
    captured = served_rows(runner, rows, prompts, by_length())
    arms = {"generated, held-out order": by_heldout_order, "generated, by length": by_length, "served": served}
    times: dict[str, list[float]] = {a: [] for a in arms}
    counts: dict[str, list] = {}
    for r in range(args.rounds):
        for name in (list(arms) if r % 2 == 0 else list(reversed(arms))):
            sync()
            t0 = time.perf_counter()
            seqs = arms[name]()
            sync()
            times[name].append(time.perf_counter() - t0)
            counts[name] = [acceptance(h, seqs, MAX_NEW_TOKENS)["per_prompt"] for h in heads]
    base = statistics.median(times["generated, held-out order"])
    result = {
        "device": torch.cuda.get_device_name(runner.device) if cuda else "cpu",
        "dtype": str(dtype).replace("torch.", ""), "random_weights": args.random_weights, "rows": len(rows),
        "prompt_tokens": sum(len(p) for p in prompts), "max_new_tokens": MAX_NEW_TOKENS, "batch": batch,
        "seconds": {a: [round(t, 3) for t in ts] for a, ts in times.items()},
        "speedup_vs_heldout_order": {a: round(base / statistics.median(ts), 2) for a, ts in times.items()},
        "same_counts": {a: c == counts["generated, by length"] for a, c in counts.items()},
    }
    if args.json:
        print(json.dumps(result))
        return
    print(f"{result['rows']} held-out requests, {result['prompt_tokens']} prompt tokens, {MAX_NEW_TOKENS} new "
          f"tokens each, batches of {batch}; {result['device']}, {result['dtype']}"
          + (", random weights" if args.random_weights else ""))
    for a, ts in times.items():
        rounds = ", ".join(f"{t:.2f}" for t in ts)
        print(f"  {a:28s} {statistics.median(ts):7.2f} s (rounds {rounds})  {result['speedup_vs_heldout_order'][a]:.2f}x"
              f"  per-prompt counts as by length: {result['same_counts'][a]}")


if __name__ == "__main__":
    main()
