"""benchmarks/learning_curve.py in its tiny mode: it runs end to end on a CPU with vLLM, MLflow, Airflow,
boto3 and DuckDB unimportable (what a bare GPU host lacks), from a local ShareGPT file."""

from __future__ import annotations

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


def test_tiny_learning_curve_runs_without_the_services_a_gpu_host_lacks(tmp_path):
    data, out = tmp_path / "sharegpt.json", tmp_path / "curve.json"
    sharegpt_json(data)
    argv = ["--tiny", "--sharegpt", str(data), "--work-dir", str(tmp_path / "work"), "--out", str(out),
            "--points", "6", "12", "--epochs", "2", "--device", "cpu"]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-c", RUN.format(blocked=BLOCKED, argv=argv)], cwd=REPO_ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    res = json.loads(out.read_text())
    assert res["heldout"]["prompts"] == 8 and res["heldout"]["heldout_code"] == 4
    assert res["heldout"]["heldout_repeating_training"] == 0
    assert [pt["conversations"] for pt in res["points"]] == [6, 12]
    for pt in res["points"]:
        acc = pt["acceptance"]
        assert pt["steps"] == pt["steps_planned"] >= 2 and pt["tokens"] > 0 and pt["train_tok_s"] > 0
        assert 1.0 <= acc["mean_acceptance_length"] <= 1 + res["k"] and len(acc["acceptance_rate_per_pos"]) == res["k"]
        assert acc["num_prompts"] == 8 and set(pt["by_domain"]) == {"code", "general"}
        assert pt["attention"] in ("sdpa", "segment")
    assert "learning curve" in p.stdout and "MISSED" in p.stdout or "MET" in p.stdout
    # No training conversation asks a held-out question (case and spacing aside).
    work = tmp_path / "work" / "conversations"
    train_q = {normalize(json.loads(line)["conversations"][0]["value"])
               for f in work.glob("*.jsonl") for line in f.read_text().splitlines()}
    rows = json.loads(data.read_text())
    held_q = {normalize(r["conversations"][0]["value"]) for r in rows} - train_q
    assert len(held_q) >= 8 and not (held_q & train_q)


def test_no_training_first_turn_near_repeats_a_heldout_one_even_when_its_later_turns_differ():
    """A conversation trains on its first turn: one whose first turn nearly repeats a held-out question must
    leave the pool even when its later turns, beside that first turn, put it under the near threshold."""
    import argparse
    import importlib.util

    from capture.overlap import overlap
    from traffic import sharegpt

    spec = importlib.util.spec_from_file_location("learning_curve", REPO_ROOT / "benchmarks" / "learning_curve.py")
    lc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lc)
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
