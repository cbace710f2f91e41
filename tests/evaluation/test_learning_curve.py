"""benchmarks/learning_curve.py in its tiny mode: it runs end to end on a CPU with vLLM, MLflow, Airflow,
boto3 and DuckDB unimportable (what a bare GPU host lacks), from a local ShareGPT file."""

from __future__ import annotations

import gzip
import json
import os
import random
import subprocess
import sys

from capture.overlap import normalize
from tests.paths import REPO_ROOT

BLOCKED = ("vllm", "mlflow", "airflow", "boto3", "botocore", "duckdb")
WORDS = "the of and to in is you that it for on are as with they be this have from or one had by word".split()

# A None entry in sys.modules is what an absent package looks like to both ``import`` (ImportError)
# and ``importlib.util.find_spec`` (None), which libraries use to probe for optional packages.
RUN = """
import runpy, sys
for name in {blocked!r}:
    sys.modules[name] = None
sys.argv = ["learning_curve.py"] + {argv!r}
runpy.run_path("benchmarks/learning_curve.py", run_name="__main__")
"""


def sharegpt_json(path, n: int = 40) -> None:
    rng = random.Random(0)
    rows = []
    for i in range(n):
        code = i % 2 == 0
        # Every fourth question is asked again under another id: the copy must never train if one is held out.
        q = f"question number {i - i % 4 if i % 4 == 3 else i}: " + " ".join(rng.choice(WORDS) for _ in range(8))
        if i % 4 == 3:
            q = rows[-3]["conversations"][0]["value"].upper()  # same question, other case: equal once normalized
        a = ("```python\nprint(1)\n```\n" if code else "") + " ".join(rng.choice(WORDS) for _ in range(20))
        rows.append({"id": f"c{i}", "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]})
    path.write_text(json.dumps(rows))


def load_benchmark():
    import importlib.util

    spec = importlib.util.spec_from_file_location("learning_curve", REPO_ROOT / "benchmarks" / "learning_curve.py")
    lc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lc)
    return lc


def test_tiny_learning_curve_runs_without_the_services_a_gpu_host_lacks(tmp_path):
    data, out, cache = tmp_path / "sharegpt.json", tmp_path / "curve.json", tmp_path / "out" / "onpolicy.jsonl.gz"
    sharegpt_json(data)
    argv = ["--tiny", "--sharegpt", str(data), "--work-dir", str(tmp_path / "work"), "--out", str(out),
            "--cache-out", str(cache), "--points", "6", "12", "--max-epochs", "3", "--device", "cpu",
            "--budget-minutes", "0"]  # no wall-time cap: a loaded machine must not change what is asserted
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-c", RUN.format(blocked=BLOCKED, argv=argv)], cwd=REPO_ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    res = json.loads(out.read_text())
    assert res["partial"] is False and not res["skipped"]
    assert res["heldout"]["prompts"] == 8 and res["heldout"]["heldout_code"] == 4
    assert res["heldout"]["heldout_repeating_training"] == 0
    assert [pt["conversations"] for pt in res["points"]] == [6, 12]
    for pt in res["points"]:
        acc = pt["acceptance"]
        # one validation loss per epoch run; the exported head is the best epoch's
        assert 1 <= len(pt["validation"]) <= 3 and pt["epochs"] == len(pt["validation"])
        assert pt["best_validation_loss"] == min(v["loss"] for v in pt["validation"])
        assert pt["stopped"] in ("converged", "max_epochs") and pt["tokens"] > 0 and pt["train_tok_s"] > 0
        assert 1.0 <= acc["mean_acceptance_length"] <= 1 + res["k"] and len(acc["acceptance_rate_per_pos"]) == res["k"]
        assert acc["num_prompts"] == 8 and set(pt["by_domain"]) == {"code", "general"}
        assert pt["attention"] in ("sdpa", "segment")
    kc = res["k_choice"]
    assert [c["batch_size"] for c in kc["per_batch_size"]] == [1, 2, 4, 8]
    assert all(0 <= c["k"] <= res["k"] for c in kc["per_batch_size"]) and kc["schedule"][0][0] == 1
    assert "learning curve" in p.stdout and ("MISSED" in p.stdout or "MET" in p.stdout)
    assert "num_speculative_tokens_per_batch_size" in p.stdout
    # The answers (12 training rows and 4 validation rows) came back through --cache-out, for a later run.
    lc = load_benchmark()
    answers = lc.read_cache([cache.parent], json.loads(gzip.open(cache, "rt").readline())["meta"])
    assert len(answers) == 16
    # No training conversation asks a held-out question (case and spacing aside).
    train_ids = set(answers)
    rows = json.loads(data.read_text())
    train_q = {normalize(r["conversations"][0]["value"]) for r in rows if r["id"] in train_ids}
    held_q = {normalize(r["conversations"][0]["value"]) for r in rows} - train_q
    assert len(held_q) >= 8 and not (held_q & train_q)


class FakeRunner:
    """TargetRunner's generation surface: a prompt's ids are its text's length in ones; answers say how long it was."""

    class Tok:
        eos_token_id = 0

        def decode(self, ids, skip_special_tokens=True):
            return f"answer {len(ids)}"

    def __init__(self):
        self.tokenizer = self.Tok()
        self.batches = []

    def prompt_ids(self, row):
        return [1] * len(row["conversations"][0]["value"])

    def greedy_batch(self, prompts, max_new, stop):
        self.batches.append([len(p) for p in prompts])
        return [[5] * max_new for _ in prompts]


def test_generation_answers_only_what_the_cache_lacks_in_length_sorted_bounded_batches(tmp_path):
    import argparse
    import time

    lc = load_benchmark()
    rows = [{"id": f"r{i}", "conversations": [{"from": "human", "value": "x" * (10 + (i * 7) % 13)}]} for i in range(10)]
    meta = {"target": "sha", "max_new_tokens": 4}
    lc.write_cache(tmp_path / "old.jsonl.gz", meta, {"r0": "kept", "r1": "kept"})
    lc.write_cache(tmp_path / "other.jsonl.gz", {"target": "other", "max_new_tokens": 4}, {"r2": "stale"})
    answers = lc.read_cache([tmp_path / "old.jsonl.gz", tmp_path / "other.jsonl.gz"], meta)
    assert answers == {"r0": "kept", "r1": "kept"}  # another target's answers are not this one's
    runner, saves = FakeRunner(), []
    args = argparse.Namespace(gen_batch=4, gen_batch_tokens=4 * 20, gen_max_tokens=4, save_every=1e9)
    g = lc.generate(runner, rows, answers, args, time.monotonic() + 60, lambda: saves.append(len(answers)))
    assert g["answers"] == 8 and g["tokens"] == 32 and saves == [10]
    assert answers["r0"] == "kept" and answers["r5"] == "answer 4"
    flat = [n for b in runner.batches for n in b]
    assert flat == sorted(flat) and len(flat) == 8
    # a batch holds at most gen_batch prompts and gen_batch_tokens prompt-plus-answer tokens (plan_batches)
    assert all(len(b) <= 4 and len(b) * (max(b) + 4) <= 80 for b in runner.batches)
    # a spent budget answers nothing, and says so by its count
    assert lc.generate(FakeRunner(), rows + [{"id": "new", "conversations": [{"from": "human", "value": "y"}]}],
                       answers, args, time.monotonic() - 1, lambda: None)["answers"] == 0


def test_generation_batches_are_the_fewest_that_fit_and_keep_the_long_tail_together():
    """Every step of a batch costs whatever its size, so the plan is the fewest batches within both limits;
    the two long prompts share one batch instead of leaving small short-end batches behind them."""
    lc = load_benchmark()
    # six short prompts and two long ones; all eight padded to the longest would need 8 * 64 > 200 tokens
    assert lc.plan_batches([5] * 6 + [50, 60], 8, 200, 4) == [5, 3]

    def fewest(lengths, cap, budget, max_new):  # every contiguous partition, by dynamic programming
        best = [0] + [None] * len(lengths)
        for i in range(1, len(lengths) + 1):
            for j in range(i):
                fits = i - j <= cap and (i - j == 1 or (i - j) * (lengths[i - 1] + max_new) <= budget)
                if fits and best[j] is not None and (best[i] is None or best[j] + 1 < best[i]):
                    best[i] = best[j] + 1
        return best[-1]

    rng = random.Random(3)
    for _ in range(200):
        lengths = sorted(rng.choice([rng.randint(1, 20), rng.randint(20, 400)]) for _ in range(rng.randint(1, 30)))
        cap, budget, max_new = rng.randint(1, 12), rng.randint(50, 2000), rng.randint(1, 16)
        plan = lc.plan_batches(lengths, cap, budget, max_new)
        assert sum(plan) == len(lengths) and len(plan) == fewest(lengths, cap, budget, max_new)
        at = 0
        for n in plan:  # each batch within both limits (a single prompt over the budget still goes alone)
            assert n <= cap and (n == 1 or n * (lengths[at + n - 1] + max_new) <= budget)
            at += n


def test_a_cache_cut_short_keeps_the_rows_before_the_cut(tmp_path):
    lc = load_benchmark()
    meta = {"target": "sha", "max_new_tokens": 4}
    lc.write_cache(tmp_path / "onpolicy.jsonl.gz", meta, {f"r{i}": "a" * 200 for i in range(200)})
    blob = (tmp_path / "onpolicy.jsonl.gz").read_bytes()
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "onpolicy.jsonl.gz").write_bytes(blob[: len(blob) * 2 // 3])
    got = lc.read_cache([tmp_path / "cut"], meta)
    assert 0 < len(got) < 200 and all(v == "a" * 200 for v in got.values())


def test_no_training_first_turn_near_repeats_a_heldout_one_even_when_its_later_turns_differ():
    """A conversation trains on its first turn: one whose first turn nearly repeats a held-out question must
    leave the pool even when its later turns, beside that first turn, put it under the near threshold."""
    import argparse

    from capture.overlap import overlap
    from traffic import sharegpt

    lc = load_benchmark()
    rng = random.Random(1)
    rows = []
    for i in range(24):
        code = "```python\nprint(1)\n```\n" if i % 2 else ""
        q = code + f"question {i}: " + " ".join(rng.choice(WORDS) for _ in range(30))
        more = [{"from": "human", "value": " ".join(rng.choice(WORDS) for _ in range(60))}, {"from": "gpt", "value": "ok"}]
        rows.append({"id": f"short{i}", "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": "a"}]})
        # the same question with one more word (a near repeat, not an exact one), then a long other exchange
        rows.append({"id": f"long{i}", "conversations": [{"from": "human", "value": q + " please"},
                                                         {"from": "gpt", "value": "a"}, *more, *more]})
    data = sharegpt.parse(json.dumps(rows))
    sel = lc.select(data, argparse.Namespace(max_turn_chars=2000, heldout=8, points=[30]))
    assert overlap(sel["pool"], sel["heldout"])["repeats_training"] == 0
    assert sel["hygiene"]["dropped_for_repeating_heldout"] >= 6 and len(sel["pool"]) == 30  # held-out ones' twins


def test_generation_halves_its_batches_after_running_out_of_memory():
    import argparse
    import time

    lc = load_benchmark()

    class SmallDevice(FakeRunner):
        def greedy_batch(self, prompts, max_new, stop):
            if len(prompts) > 2:
                raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return super().greedy_batch(prompts, max_new, stop)

    rows = [{"id": f"r{i}", "conversations": [{"from": "human", "value": "x" * (10 + i)}]} for i in range(8)]
    runner, answers = SmallDevice(), {}
    args = argparse.Namespace(gen_batch=8, gen_batch_tokens=10**6, gen_max_tokens=3, save_every=1e9)
    g = lc.generate(runner, rows, answers, args, time.monotonic() + 60, lambda: None)
    assert g["answers"] == 8 and len(answers) == 8 and args.gen_batch == 2  # 8, then 4, then 2
    assert all(len(b) <= 2 for b in runner.batches)
