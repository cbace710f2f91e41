"""What a router worker's capture costs on the request path: the journal's write per record vs the batching queue.

A router worker (``[serving] router_workers`` > 1) writes each capture record to its journal file when
the request is answered (``serving.capture_journal.JournalWriter.offer``: one ``write``); the single
router process only queues it (``serving.capture_writer.CaptureWriter.offer``) and writes batches on
a thread later. Both are timed side by side here, in CPU time of the calling thread per record, on
records of ``--bytes`` bytes (a chat request and its answer of ~200 tokens: about 4 KB).

    python benchmarks/capture_journal.py [--records 20000] [--rounds 3] [--bytes 4000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bytes", type=int, default=4000)
    args = ap.parse_args()

    from serving.capture_journal import JournalWriter
    from serving.capture_writer import CaptureWriter

    half = args.bytes // 2
    line = json.dumps({"captureData": {"endpointInput": {"data": "x" * half}, "endpointOutput": {"data": "y" * half}}})
    work = Path(tempfile.mkdtemp(prefix="capture-journal-"))
    out: dict[str, list[float]] = {"journal": [], "queue": []}

    async def run() -> None:
        writers = {"journal": JournalWriter(str(work / "j"), "ep", spool=work / "j" / ".spool" / "worker-0"),
                   "queue": CaptureWriter(str(work / "q"), "ep", max_queue=args.records + 1)}
        for w in writers.values():
            w.start()
        for _ in range(args.rounds):
            for name, w in writers.items():  # side by side, alternating
                t = time.process_time()
                for _ in range(args.records):
                    w.offer(line)
                out[name].append((time.process_time() - t) / args.records * 1e6)
                await asyncio.sleep(1.5)  # the queue's writer empties it; the journal publishes its files
        for w in writers.values():
            await w.close()
            assert w.counts["written"] == args.records * args.rounds, (w.counts, args.records * args.rounds)

    try:
        asyncio.run(run())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for name, xs in out.items():
        print(f"{name:<8} {len(line):>6} B records: " + ", ".join(f"{x:.1f}" for x in xs)
              + " us of the caller's CPU per record (each round)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
