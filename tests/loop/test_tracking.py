"""The cycle's MLflow run as a reviewer sees it (sqlite MLflow, tiny head; the steps' work is stubbed,
the logging is real): opened at the first step, figures per step, the head as a logged model the
registered version points at, the gate's table as the version's description."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loop import cycle, tracking
from settings.config import load_config


@pytest.fixture
def setup(tmp_path, tiny_model):
    from adapt.checkpoint import init_random_head

    cfg = load_config(overrides={
        "state_dir": str(tmp_path / "state"), "target": {"model": str(tiny_model)},
        "mlflow": {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "artifact_location": str(tmp_path / "art"),
                   "registered_model": "drafter-tracking"}})
    head = init_random_head(tiny_model, tmp_path / "head", k=3, seed=0, draft_vocab_size=256)
    return cfg, head, tmp_path


def stub_steps(head: Path, tmp: Path, fail_at: str | None = None):
    """Step functions that return what the real ones record (the logging under test is real)."""
    from headspec.validate import validate_head

    info = validate_head(head)
    (tmp / "train.json").write_text(json.dumps({"loss_curve": [3.0, 2.5, 2.0, 1.8]}))
    (tmp / "eval.json").write_text("{}")
    for split in ("train", "heldout"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"content_hash": ["a"], "format": ["chat"], "endpoint": ["ep"]}), tmp / f"{split}.parquet")
    gate = {"verdict": "passed", "passed": True, "reason": "better by more than the margin", "attempts": 1,
            "checks": [{"name": "mean_acceptance_length", "status": "passed", "estimate": 0.3, "ci": [0.2, 0.4],
                        "aa_ci": [0.0, 0.0], "margin": 0.02, "unit": "tokens", "level": 0.05, "clusters": 8}]}
    outs = {
        "ingest": {"read": 10, "normalized": 9, "duplicates": 1, "quarantined": 0, "skipped": 0},
        "snapshot": {"train": {"path": str(tmp / "train.parquet"), "id": "t" * 64, "rows": 8},
                     "heldout": {"path": str(tmp / "heldout.parquet"), "id": "h" * 64, "rows": 2, "measured_rows": 2},
                     "heldout_overlap": {"repeats_training": 0}},
        "base": {"parent_version": None, "parent_sha256": None, "live_version": None, "live_path": None,
                 "live_sha256": None},
        "train": {"head_path": str(head), "head_sha256": info.sha256, "num_speculative_tokens": 3, "steps": 4,
                  "tokens": 100, "tokens_per_s": 9.0, "final_depth_loss": [1.0, 2.0, 3.0],
                  "final_depth_acc": [0.5, 0.3, 0.1], "train_json": str(tmp / "train.json")},
        "evaluate": {"candidate": {"mean_acceptance_length": 1.4, "acceptance_rate_per_pos": [0.3, 0.1, 0.0]},
                     "json_path": str(tmp / "eval.json")},
        "bench": {"skipped": "bootstrap"},
        "gate": gate,
    }

    def make(name):
        def f(cfg, state, opts):
            if name == fail_at:
                raise RuntimeError(f"{name} broke")
            return outs[name]
        return f

    funcs = {n: make(n) for n in outs}
    funcs.update({n: cycle.STEP_FUNCS[n] for n in ("log_run", "register", "promote")})
    return funcs


def test_the_run_opens_at_the_first_step_and_logs_each_step_as_it_finishes(setup, monkeypatch):
    from rollout.registry import Registry

    cfg, head, tmp = setup
    monkeypatch.setattr(cycle, "STEP_FUNCS", stub_steps(head, tmp, fail_at="evaluate"))
    cycle.run_step(cfg, "c1", "ingest")
    reg = Registry(cfg)
    run = reg.client.get_run(cycle.load_state(cfg, "c1")["tracking"]["run_id"])
    assert run.info.status == "RUNNING" and run.data.metrics["ingest.read"] == 10.0  # visible while the cycle runs
    for step in ("snapshot", "base", "train"):
        cycle.run_step(cfg, "c1", step)
    with pytest.raises(RuntimeError, match="evaluate broke"):
        cycle.run_step(cfg, "c1", "evaluate")
    run = reg.client.get_run(run.info.run_id)
    assert run.info.status == "FAILED" and run.data.tags["adapt.failed_step"] == "evaluate"
    curve = reg.client.get_metric_history(run.info.run_id, "train.loss")
    assert [(m.step, m.value) for m in curve] == [(0, 3.0), (1, 2.5), (2, 2.0), (3, 1.8)]  # one point per step
    model_id = cycle.load_state(cfg, "c1")["tracking"]["model_id"]
    model = reg.client.get_logged_model(model_id)
    assert model.source_run_id == run.info.run_id and model.params["num_speculative_tokens"] == "3"
    assert {a.path for a in reg.client.list_logged_model_artifacts(model_id)} >= {"config.json", "model.safetensors",
                                                                                   "manifest.json"}

    # The same cycle resumed (by any worker) reopens the same run and finishes it.
    monkeypatch.setattr(cycle, "STEP_FUNCS", stub_steps(head, tmp))
    out = cycle.run_cycle(cfg, "c1")
    run = reg.client.get_run(run.info.run_id)
    assert run.info.status == "FINISHED" and len(reg.client.search_runs([reg.experiment_id()])) == 1
    assert run.data.metrics["offline.candidate.mean_acceptance_length"] == 1.4
    assert run.data.metrics["timing.evaluate_s"] >= 0 and run.data.tags["gate_verdict"] == "passed"
    mv = reg.get(out["version"])
    assert mv.source == f"models:/{model_id}" and "| mean_acceptance_length | passed |" in mv.description
    # The registered head downloads like any version (the controller and the next cycle do this).
    local = reg.download_head(out["version"], tmp / "dl")
    assert (local / "model.safetensors").read_bytes() == (head / "model.safetensors").read_bytes()


def test_gate_table_reads_as_a_review():
    from loop.gate import Verdict

    t = tracking.gate_table(Verdict.from_json({
        "verdict": "inconclusive", "attempts": 2, "level": 0.0304, "voided": [1], "reason": "cannot tell yet",
        "checks": [{"name": "output_tok_per_s@c1", "status": "inconclusive", "estimate": 1.5, "ci": [-0.5, 3.5],
                    "aa_ci": [-2.0, 1.0], "margin": 0.0, "unit": "tok/s", "clusters": 9}]}))
    assert t.startswith("**Gate: inconclusive** after 2 benchmark(s) (each bound a one-sided 0.0304 test)")
    assert "| output_tok_per_s@c1 | inconclusive | +1.5 [-0.5, +3.5] | [-2, +1] | 0 tok/s | 9 |" in t
    assert "Voided by the A/A control: attempt(s) 1." in t
