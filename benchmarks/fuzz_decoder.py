"""Differential mutation fuzzer for the native capture decoder and redaction gate.

    python benchmarks/fuzz_decoder.py --seconds 60            # native vs Python paths
    python benchmarks/fuzz_decoder.py --seconds 60 --sanitize # the same, native module under ASan + UBSan

Seeds are the real fixture lines (``../shared/fixtures/datacapture``) and synthetic records of
every format (``capture.synth``). Each round mutates them, structurally (the seeded mutator of
tests/capture_support.py: fields, numbers, escapes, encodings, nesting) and byte-wise
(flips, splices, truncations, hostile tokens), then checks, on chunks of lines:

* decoder: the native decoder (``capture/_native``) against the msgspec batch path, the oracle of
  tests/capture_support.py (the native path may decline more; whatever it decides must match);
* splitting: ``decode_block`` over a buffer of the lines against the same lines one by one;
* gates: the native redaction gate flags a superset of RE2's GATE, and both flag every string
  the redactor changes (tests/capture_support.py), on the decoded turns and on the raw lines.

It prints counts and exits 1 on the first disagreement, after writing the lines involved under
``--out``; a crash or a sanitizer report ends the process non-zero too.

``--sanitize`` builds the module with ``-fsanitize=address,undefined`` into a temporary directory
and re-runs this script in a child whose python preloads the ASan runtime (an ASan-built shared
object cannot load into an uninstrumented interpreter otherwise):
``LD_PRELOAD=$(cc -print-file-name=libasan.so)``, with ``ASAN_OPTIONS=detect_leaks=0`` (the
interpreter's own allocations are not leaks of ours) and ``halt_on_error=1`` for both runtimes,
so any report fails the run. ``PYTHONMALLOC=malloc`` and ``ARROW_DEFAULT_MEMORY_POOL=system``
put Python's and Arrow's buffers on malloc, where ASan sees a read past their end.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

FIXTURES = REPO.parent / "shared" / "fixtures" / "datacapture"
MAX_LINE = 8 << 20
CHUNK = 256
# Byte strings that decoders find hard: escapes, surrogates, numbers at the edges, UTF-8 edge cases.
TOKENS = [b"\\ud800", b"\\udc00", b"\\u0000", b"\\u00e9", b"\\", b'"', b"\\\"", b"{", b"}", b"[", b"]", b",", b":",
          b"null", b"true", b"1e999", b"-0", b"NaN", b"9" * 40, b"\x00", b"\xff", b"\xc0\x80", b"\xed\xa0\x80",
          b"\xf4\x90\x80\x80", b"\xe2\x80\xa8", b"\r", b"\n", b"\xef\xbb\xbf", b"data: ", b"[DONE]",
          b'"encoding": "BASE64"', b'"role": "user"', b"AKIA", b"ghp_", b"-----BEGIN ", b"eyJ", b"@", b"1234-5678-"]


def seeds(n_synth: int, seed: int) -> list[bytes]:
    from capture.sources import iter_lines
    from capture.synth import lines as synth_lines

    out = [line for p in sorted(FIXTURES.glob("*.jsonl")) for line in iter_lines(str(p))]
    if not out:
        raise SystemExit(f"no fixture lines under {FIXTURES}")
    return out + [line.encode() for line in synth_lines(n_synth, seed=seed)]


def havoc(rng: random.Random, data: bytes, pool: list[bytes]) -> bytes:
    """A few random byte-level edits of ``data``."""
    b = bytearray(data)
    for _ in range(rng.choice([1, 1, 2, 4, 8])):
        k = rng.randrange(7)
        i = rng.randrange(len(b) + 1)
        if k == 0 and b:
            b[min(i, len(b) - 1)] = rng.randrange(256)
        elif k == 1:
            b[i:i] = rng.choice(TOKENS)
        elif k == 2 and b:
            j = rng.randrange(i, len(b) + 1)
            del b[i:j][: rng.choice([1, 2, 8, 64])]
        elif k == 3 and b:
            j = min(len(b), i + rng.choice([1, 4, 32, 256]))
            b[i:i] = b[i:j] * rng.choice([2, 3, 50])
        elif k == 4:
            other = rng.choice(pool)
            b[i:] = other[rng.randrange(len(other) + 1):]  # splice: this line's head, another's tail
        elif k == 5:
            del b[i:]
        else:
            b[i:i] = bytes([rng.choice(b"\"\\{}[],:0123456789eE+-. \t")]) * rng.choice([1, 2, 33])
    return bytes(b).replace(b"\n", b" ")  # one line each


def mutated(rng: random.Random, pool: list[bytes], text_pool, i: int) -> bytes:
    from tests.capture_support import mutated_line

    r = rng.random()
    if r < 0.35:
        return mutated_line(rng, text_pool, i).replace(b"\n", b" ")
    base = rng.choice(pool) if r < 0.8 else mutated_line(rng, text_pool, i).replace(b"\n", b" ")
    return havoc(rng, base, pool)


def check_chunk(lines: list[bytes]) -> None:
    """Every oracle on one chunk; raises AssertionError on a disagreement."""
    from capture import batchpath
    from tests.capture_support import assert_superset, check, gates_cover_the_redactor

    check(lines)
    # The native decoder finds the lines in a buffer itself: as one chunk, the same outcome.
    block = b"\n".join(lines) + b"\n"
    got = batchpath.decode_block(block, 0, 1, len(lines), MAX_LINE, None)
    want = batchpath.decode_chunk(lines, 1, MAX_LINE, None)
    assert (got.lines, got.end) == (len(lines), len(block)), (got.lines, got.end)
    assert got.declined == want.declined and got.skips == want.skips and got.batch.equals(want.batch)
    texts = [line.decode("utf-8", "replace") for line in lines]
    values = want.batch.column("conversations").flatten().field("value").to_pylist() if want.batch.num_rows else []
    strings = [t for t in texts + values if "\x00" not in t]
    assert_superset(strings)
    gates_cover_the_redactor(strings)


def fuzz(seconds: float, max_lines: int, seed: int, out: Path) -> int:
    from capture import native
    from capture.synth import TextPool

    mod = native.load()
    rng = random.Random(seed)
    text_pool = TextPool(random.Random(seed + 1))
    pool = seeds(300, seed)
    t_end = time.monotonic() + seconds
    n = rounds = 0
    print(f"[fuzz] native module {mod.__file__}; {len(pool)} seed lines; seed {seed}", flush=True)
    while time.monotonic() < t_end and n < max_lines:
        lines = [mutated(rng, pool, text_pool, n + k) for k in range(CHUNK)]
        try:
            check_chunk(lines)
        except AssertionError as exc:
            out.mkdir(parents=True, exist_ok=True)
            path = out / f"disagreement-{seed}-{rounds}.jsonl"
            path.write_bytes(b"".join(line + b"\n" for line in lines))
            print(f"[fuzz] DISAGREEMENT after {n} lines: {str(exc)[:2000]}\n[fuzz] lines written to {path}", flush=True)
            return 1
        n += len(lines)
        rounds += 1
        if rng.random() < 0.05:  # keep interesting survivors as seeds
            pool.extend(rng.sample(lines, 8))
    print(json.dumps({"lines": n, "chunks": rounds, "disagreements": 0, "seed": seed,
                      "sanitized": bool(os.environ.get("FUZZ_NATIVE_SO"))}), flush=True)
    return 0


def build_sanitized(tmp: Path) -> Path:
    """The native module compiled with ASan and UBSan (abort on the first report)."""
    from capture import native

    return native.build_into(tmp, ["-O1", "-g", "-fPIC", "-shared", "-std=gnu11", "-fno-omit-frame-pointer",
                                   "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=30.0, help="stop after this long")
    ap.add_argument("--max-lines", type=int, default=10**9, help="stop after this many lines")
    ap.add_argument("--seed", type=int, default=int(time.time()) % 100_000)
    ap.add_argument("--sanitize", action="store_true", help="run the native module under ASan + UBSan")
    ap.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "drafter-adapt-fuzz")
    args = ap.parse_args()
    so = os.environ.get("FUZZ_NATIVE_SO")
    if so:  # the sanitized child: load that build instead of the normal one
        from capture import native

        native.load(Path(so))
    if args.sanitize and not so:
        from capture import native

        with tempfile.TemporaryDirectory(prefix="fuzz-asan-") as tmp:
            built = build_sanitized(Path(tmp))
            runtime = subprocess.run([native._compiler(), "-print-file-name=libasan.so"], capture_output=True,
                                     text=True, check=True).stdout.strip()
            env = os.environ | {
                "FUZZ_NATIVE_SO": str(built), "LD_PRELOAD": runtime,
                # Every buffer from malloc, which ASan watches: not pymalloc's arenas, nor Arrow's jemalloc.
                "PYTHONMALLOC": "malloc", "ARROW_DEFAULT_MEMORY_POOL": "system",
                "ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1:abort_on_error=1",
                "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1",
            }
            cmd = [sys.executable, __file__, "--seconds", str(args.seconds), "--max-lines", str(args.max_lines),
                   "--seed", str(args.seed), "--out", str(args.out)]
            return subprocess.run(cmd, env=env).returncode
    return fuzz(args.seconds, args.max_lines, args.seed, args.out)


if __name__ == "__main__":
    sys.exit(main())
