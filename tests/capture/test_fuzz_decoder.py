"""benchmarks/fuzz_decoder.py in CI size: the differential fuzzer, plain and under ASan + UBSan.

Longer runs: ``python benchmarks/fuzz_decoder.py --seconds 600 [--sanitize]``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.paths import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT))

from benchmarks import fuzz_decoder  # noqa: E402  (after the path, as the benchmarks run)


def run(tmp_path: Path, *args: str) -> dict:
    p = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "fuzz_decoder.py"), "--seed", "23",
                        "--out", str(tmp_path), *args], capture_output=True, text=True, cwd=REPO_ROOT, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_native_and_python_paths_agree_on_mutated_lines(tmp_path):
    out = run(tmp_path, "--seconds", "6")
    assert out["disagreements"] == 0 and out["lines"] >= 1024 and not out["sanitized"]


def test_under_address_and_undefined_behaviour_sanitizers(tmp_path):
    out = run(tmp_path, "--seconds", "3", "--sanitize")
    assert out["sanitized"] and out["lines"] >= 256


def test_a_disagreement_fails_the_run_and_keeps_the_lines(tmp_path, monkeypatch):
    seen = []

    def oracle(lines):
        seen.append(lines)
        if len(seen) == 2:
            raise AssertionError("planted")

    monkeypatch.setattr(fuzz_decoder, "check_chunk", oracle)
    assert fuzz_decoder.fuzz(60, 10**6, 5, tmp_path) == 1
    (kept,) = tmp_path.glob("disagreement-5-1.jsonl")
    assert kept.read_bytes().split(b"\n")[:-1] == seen[1]
