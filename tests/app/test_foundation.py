"""Foundation: config, doctor, model fixtures and the three real services."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx

from settings.config import dump_toml, load_config
from tests.paths import REPO_ROOT


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(
        [sys.executable, "-m", "app", *args], capture_output=True, text=True, cwd=REPO_ROOT,
        env={**os.environ, **(env or {})}, timeout=300,
    )


def test_default_config_keeps_state_under_one_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("ADAPT_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("ADAPT_CONFIG", raising=False)
    cfg = load_config()
    state = str(tmp_path / "state")
    assert cfg.state_dir == state
    for value in (cfg.capture.source, cfg.warehouse.uri, cfg.warehouse.catalog, cfg.mlflow.artifact_location, cfg.head.heads_dir):
        assert value.startswith(state), value
    assert cfg.mlflow.tracking_uri == f"sqlite:///{state}/mlflow/mlflow.db"


def test_user_config_overrides_only_its_keys_and_roundtrips(tmp_path, monkeypatch):
    monkeypatch.delenv("ADAPT_CONFIG", raising=False)
    user = tmp_path / "cfg.toml"
    user.write_text(f'state_dir = "{tmp_path}/s"\n[serving]\nreplicas = 3\n[capture]\nsource = "s3://bucket/capture"\n')
    cfg = load_config(user)
    assert cfg.serving.replicas == 3 and cfg.capture.source == "s3://bucket/capture"
    assert cfg.serving.router_port == 8000  # untouched default
    assert cfg.warehouse.uri == f"{tmp_path}/s/warehouse"
    again = tmp_path / "again.toml"
    again.write_text(dump_toml(cfg))
    assert load_config(again).to_json() | {"source_file": None} == cfg.to_json() | {"source_file": None}


def test_bad_config_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[serving]\nreplicas = -1\n")
    res = run_cli("config", "--config", str(bad), "--json")
    assert res.returncode == 2
    assert "replicas" in json.loads(res.stdout)["error"] and "Traceback" not in res.stderr  # --json: a JSON error
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("[serving]\nreplicaz = 1\n")
    res = run_cli("config", "--config", str(unknown))
    assert res.returncode == 2 and "replicaz" in res.stderr


def test_tiny_model_loads_and_generates(tiny_model):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    ids = tok.apply_chat_template([{"role": "user", "content": "write python code"}], add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 8
    assert sum(p.numel() for p in model.parameters()) < 2_000_000


def test_smollm2_cache_is_converted_once_and_verified(smollm2_model):
    from targets import model_zoo

    info = json.loads((smollm2_model / model_zoo.READY_MARKER).read_text())
    assert info["gguf_sha256"] == model_zoo.SMOLLM2_GGUF_SHA256
    cfg = json.loads((smollm2_model / "config.json").read_text())
    assert cfg["hidden_size"] == 576 and cfg["num_hidden_layers"] == 30
    assert "quantization_config" not in cfg
    assert (smollm2_model / "model.safetensors").stat().st_size > 200_000_000
    mtime = (smollm2_model / "model.safetensors").stat().st_mtime
    assert model_zoo.ensure_smollm2(smollm2_model.parent) == smollm2_model
    assert (smollm2_model / "model.safetensors").stat().st_mtime == mtime  # cached, not rebuilt


def test_doctor_reports_every_component_ok(tmp_path, smollm2_model, s3_server):
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(
        f'state_dir = "{tmp_path}/state"\n[target]\nmodel_cache = "{smollm2_model.parent}"\n'
        f'[s3]\nendpoint_url = "{s3_server.endpoint_url}"\n[capture]\nsource = "s3://{s3_server.bucket}/capture"\n'
    )
    res = run_cli("doctor", "--config", str(cfg), "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads(res.stdout)
    assert report["ok"] is True
    for name in ("python", "vllm", "model_cache", "s3", "catalog", "mlflow", "airflow"):
        assert report["components"][name]["ok"], (name, report["components"][name])
    assert report["components"]["vllm"]["info"]["parallel_drafting"] is True
    assert s3_server.bucket in report["components"]["s3"]["info"]["buckets"]


def test_doctor_fails_clearly_when_model_cache_missing_and_changes_nothing(tmp_path):
    from app.supported import VLLM_INTERNALS

    cfg = tmp_path / "cfg.toml"
    cfg.write_text(f'state_dir = "{tmp_path}/state"\n[target]\nmodel_cache = "{tmp_path}/nothing"\n')
    res = run_cli("doctor", "--config", str(cfg), "--json", env={"AIRFLOW_HOME": str(tmp_path / "airflow-home")})
    assert res.returncode == 1
    report = json.loads(res.stdout)
    assert report["ok"] is False
    assert "adapt models prepare" in report["components"]["model_cache"]["detail"]
    # The installed vLLM has every internal the hot-swap uses; no GPU here, so nothing of CUDA is checked.
    assert report["components"]["vllm"]["info"]["internals"] == {it.what: "ok" for it in VLLM_INTERNALS}
    assert report["components"]["vllm"]["ok"] and report["components"]["gpu"]["detail"].startswith("no NVIDIA GPU")
    # Read-only: no state directory (no MLflow database), no Airflow home.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cfg.toml"]


def test_s3_server_roundtrip(s3_server):
    c = s3_server.client()
    c.put_object(Bucket=s3_server.bucket, Key="foundation/hello.txt", Body=b"hello")
    keys = [o["Key"] for o in c.list_objects_v2(Bucket=s3_server.bucket, Prefix="foundation/")["Contents"]]
    assert keys == ["foundation/hello.txt"]


def test_mlflow_server_stores_artifacts_in_s3(mlflow_server, s3_server, tmp_path):
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=mlflow_server.tracking_uri)
    exp = client.create_experiment("foundation-smoke")
    run = client.create_run(exp)
    client.log_metric(run.info.run_id, "acceptance_length", 2.5)
    f = tmp_path / "note.txt"
    f.write_text("artifact")
    client.log_artifact(run.info.run_id, str(f))
    assert client.get_run(run.info.run_id).data.metrics["acceptance_length"] == 2.5
    objs = s3_server.client().list_objects_v2(Bucket=s3_server.bucket, Prefix="mlflow-artifacts/")
    assert any(o["Key"].endswith("note.txt") for o in objs.get("Contents", []))


def test_vllm_server_serves_tiny_model_with_peagle_head(vllm_server):
    models = httpx.get(vllm_server.url + "/v1/models", timeout=10).json()
    assert models["data"][0]["id"] == "target"
    body = {"model": "target", "prompt": "def add(a, b):", "max_tokens": 24, "temperature": 0}
    r = httpx.post(vllm_server.url + "/v1/completions", json=body, timeout=120)
    r.raise_for_status()
    assert r.json()["usage"]["completion_tokens"] > 0
    metrics = vllm_server.metrics()
    drafts = [l for l in metrics.splitlines() if l.startswith("vllm:spec_decode_num_drafts")]
    assert drafts and float(drafts[0].rsplit(" ", 1)[1]) > 0, "the P-EAGLE head did not draft"
