"""Two workers with separate local disks, sharing only S3 and MLflow, run one cycle's steps alternately.

What a multi-worker Airflow does: each task of the nightly DAG may land on another worker.
Worker A and worker B each have their own state directory (cycle directories, heads); the
capture, the warehouse (Parquet in the bucket, its catalog in PostgreSQL), the cycle store and
MLflow (its artifacts in the same bucket) are all they share. Every step runs for real
except the replay bench of cycle 2, which is simulated (``tests/bench_sim.py``; the real
bench and gate are tested in tests/loop/test_gate_e2e.py): it writes its ``bench.json`` on one
worker, and the register step on the other reads the speed-up over no speculation from it.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from capture.synth import write_layout
from loop import cycle, gate as gate_mod
from rollout.registry import Registry, speedups
from settings.config import load_config
from tests.bench_sim import simulated_bench
from tests.capture_support import catalog_rows

pytestmark = pytest.mark.services
T0 = datetime(2025, 3, 1, tzinfo=timezone.utc)


def upload(s3_server, local_root: Path, prefix: str) -> None:
    c = s3_server.client()
    for p in sorted(local_root.rglob("*")):
        if p.is_file():
            c.upload_file(str(p), s3_server.bucket, f"{prefix}/{p.relative_to(local_root).as_posix()}")


def worker(name: str, tmp: Path, s3_server, mlflow_server, tiny_model: Path, catalog: str):
    b = s3_server.bucket
    return load_config(overrides={
        "state_dir": str(tmp / name),  # this worker's own disk
        "target": {"model": str(tiny_model)},
        "s3": {"endpoint_url": s3_server.endpoint_url, "region": s3_server.region},
        "capture": {"source": f"s3://{b}/mw-capture", "endpoint": "ep", "redact": False, "heldout_hours": 1},
        "warehouse": {"uri": f"s3://{b}/mw-warehouse", "catalog": catalog},
        "cycle": {"store": f"s3://{b}/mw-cycles"},
        "mlflow": {"tracking_uri": mlflow_server.tracking_uri, "artifact_location": "",
                   "registered_model": "drafter-multi-worker"},
        "head": {"num_speculative_tokens": 3, "draft_vocab_size": 256},
        "training": {"max_steps": 3, "batch_tokens": 256, "max_seq_len": 128, "warmup_steps": 0,
                     "checkpoint_steps": 1, "device": "cpu", "seed": 0},
        "bench": {"concurrencies": [1], "max_prompts": 3, "max_tokens": 8, "rounds": 1, "nospec_reference": True},
        "serving": {"vllm_args": ["--enforce-eager"]},  # engines start about a minute sooner
    })


def local_files(cfg, cid: str) -> set[str]:
    d = Path(cfg.state_dir) / "cycles" / cid
    return {p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file()} if d.is_dir() else set()


def test_two_workers_sharing_only_s3_and_mlflow_run_one_cycle_alternately(
        s3_server, mlflow_server, shared_catalog, tiny_model, tmp_path, monkeypatch):
    import evaluation.bench

    a = worker("a", tmp_path, s3_server, mlflow_server, tiny_model, shared_catalog)
    b = worker("b", tmp_path, s3_server, mlflow_server, tiny_model, shared_catalog)
    write_layout(tmp_path / "cap1", 40, endpoint="ep", seed=1, start=T0)
    write_layout(tmp_path / "cap1", 12, endpoint="ep", seed=2, start=T0 + timedelta(hours=3))
    upload(s3_server, tmp_path / "cap1", "mw-capture")

    # Cycle 1 (bootstrap: nothing in Production, no live head): A, B, A, B, ... step by step.
    c1 = "c-mw-1"
    for i, step in enumerate(cycle.STEPS):
        cycle.run_step(a if i % 2 == 0 else b, c1, step)
    # B made the snapshot from the catalog A's ingest committed: B never ingested anything.
    state = cycle.load_state(a, c1)
    assert state["steps"]["snapshot"]["train"]["rows"] > 0 and state["steps"]["snapshot"]["heldout"]["rows"] > 0
    # B trained; A, which only wrote state (nothing to compare in a bootstrap), never read the training snapshot.
    assert "head/model.safetensors" in local_files(b, c1) and "train.parquet" not in local_files(a, c1)
    assert state["steps"]["promote"]["promoted"] is True
    v1 = state["steps"]["register"]["version"]
    assert Registry(a).production().version == v1 == Registry(b).production().version

    # New traffic; cycle 2 starts on B, the other way round.
    write_layout(tmp_path / "cap2", 24, endpoint="ep", seed=3, start=T0 + timedelta(hours=6))
    write_layout(tmp_path / "cap2", 8, endpoint="ep", seed=4, start=T0 + timedelta(hours=9))
    upload(s3_server, tmp_path / "cap2", "mw-capture")
    calls: list = []
    monkeypatch.setattr(evaluation.bench, "bench_heads", simulated_bench([(0.0, 1.5)], calls))
    # The offline comparison runs for real; its verdict is left to the simulated bench (the
    # pre-screen's own decisions: tests/loop/test_gate.py, and in a real cycle tests/app/test_demo.py).
    monkeypatch.setattr(gate_mod, "prescreen", lambda out, gate: None)
    c2 = "c-mw-2"
    for i, step in enumerate(cycle.STEPS):
        cycle.run_step(b if i % 2 == 0 else a, c2, step)
    state = cycle.load_state(b, c2)
    ing = state["steps"]["ingest"]
    # B's ingest read only the new records: A's run is in the shared catalog.
    assert ing["read"] == 24 + 8, ing
    # B took the parent from MLflow (base), A trained from it, B evaluated A's head fetched from the
    # store, A's bench wrote what B's register read (the speed-up over no speculation, tagged on the version).
    assert state["steps"]["base"]["parent_version"] == v1
    assert "head/model.safetensors" in local_files(b, c2) and "offline_eval.json" in local_files(b, c2)
    assert calls and "bench-1/bench.json" in local_files(a, c2) and "bench-1/bench.json" in local_files(b, c2)
    assert state["steps"]["gate"]["passed"] and state["steps"]["promote"]["promoted"]
    v2 = state["steps"]["register"]["version"]
    assert int(v2) == int(v1) + 1 and Registry(b).production().version == v2
    # The simulated candidate runs at 1.5 against no speculation's 0.8.
    sp = speedups(Registry(a).production().tags)
    assert sp and all(x == pytest.approx(1.5 / 0.8, rel=0.1) for x in sp.values()), sp
    # Both workers see the same catalog: one ingest run per cycle.
    for w in (a, b):
        assert catalog_rows(w, "SELECT count(*) FROM runs") == [(2,)]
