"""Target identity: what each process that validates a head pays to identify the target, with and without
the on-disk hash cache (headspec/files.py), side by side.

Every head is checked against the target's identity, which includes the sha256 of every weight file. Each
round runs three fresh processes (nothing cached in memory) in turn: without a disk cache, with an empty
one (hash and write it), and with the one just written. It prints the time of the ``target_identity`` call
alone in each, their medians and spread over the rounds, the hashing rate, and what that rate means for a
target of ``--extrapolate-gb`` (arithmetic, not a measurement).

    python benchmarks/identity.py [--target smollm2|tiny|DIR] [--rounds 5] [--extrapolate-gb 140] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CHILD = r"""
import json, sys, time
from headspec.files import target_identity
mode, target, cache = sys.argv[1:4]
t = time.perf_counter()
target_identity(target, None if mode == "none" else cache)
print(json.dumps({"seconds": time.perf_counter() - t}))
"""


def one(mode: str, target: Path, cache: Path) -> float:
    out = subprocess.run([sys.executable, "-c", CHILD, mode, str(target), str(cache)], cwd=REPO, check=True,
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    return json.loads(out.stdout.strip().splitlines()[-1])["seconds"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--extrapolate-gb", type=float, default=140.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from settings.config import load_config
    from targets.model_zoo import ensure_target

    target = Path(ensure_target(args.target, load_config().target.model_cache))
    size = sum(p.stat().st_size for p in [target / "config.json", *target.glob("*.safetensors")])
    times: dict[str, list[float]] = {"no cache": [], "empty cache": [], "warm cache": []}
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory() as d:
            cache = Path(d) / "cache"
            times["no cache"].append(one("none", target, cache))
            times["empty cache"].append(one("disk", target, cache))
            times["warm cache"].append(one("disk", target, cache))
    med = {k: statistics.median(v) for k, v in times.items()}
    rate = size / med["no cache"]
    out = {"target": str(target), "bytes": size, "rounds": args.rounds,
           "seconds": {k: {"median": round(med[k], 4), "min": round(min(v), 4), "max": round(max(v), 4)}
                       for k, v in times.items()},
           "hash_mb_per_s": round(rate / 1e6, 1),
           "extrapolated": {"gb": args.extrapolate_gb, "no_cache_s": round(args.extrapolate_gb * 1e9 / rate, 1)},
           "warm_over_none": round(med["warm cache"] / med["no cache"], 5)}
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"target {target} ({size / 1e6:.0f} MB), {args.rounds} rounds of three fresh processes")
    for k, v in out["seconds"].items():
        print(f"  {k:<12} median {v['median'] * 1000:9.1f} ms  [{v['min'] * 1000:.1f}, {v['max'] * 1000:.1f}]")
    print(f"  hashing at {out['hash_mb_per_s']} MB/s; a {args.extrapolate_gb:g} GB target at that rate (arithmetic): "
          f"{out['extrapolated']['no_cache_s'] / 60:.1f} min per process without the cache")
    return 0


if __name__ == "__main__":
    sys.exit(main())
