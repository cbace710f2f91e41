"""`adapt doctor`: the supported-versions table it checks (vLLM and its hot-swap internals, torch, the GPU
driver and CUDA where a GPU exists, MLflow, Airflow), and that it changes nothing it looks at."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys

import pytest

from settings.config import load_config
from tests.paths import REPO_ROOT


def test_a_missing_internal_is_named_with_what_was_looked_for(monkeypatch):
    """The table's mechanics, on stdlib stand-ins (importing vLLM costs tens of seconds here): the real table
    against the installed vLLM is checked by test_doctor_reports_every_component_ok below."""
    from app import supported
    from app.commands import doctor

    table = (supported.Internal("present", "json.decoder", "JSONDecoder.decode"),
             supported.Internal("present, mentioning", "json.decoder", "JSONDecoder.__init__", "self.strict"),
             supported.Internal("a renamed entry point", "json.decoder", "JSONDecoder.decode_v2"),
             supported.Internal("a dropped attribute", "json.decoder", "JSONDecoder.__init__", "self.no_such"),
             supported.Internal("a moved module", "json.no_such_module", "x"))
    monkeypatch.setattr(supported, "VLLM_INTERNALS", table)
    got = doctor.vllm_internals()
    assert got["present"] == got["present, mentioning"] == "ok"
    assert got["a renamed entry point"].startswith("missing: AttributeError")
    assert got["a dropped attribute"] == ("missing: LookupError: json.decoder.JSONDecoder.__init__ no longer "
                                          "mentions self.no_such")
    assert got["a moved module"].startswith("missing: ModuleNotFoundError")


@pytest.mark.parametrize("version,ok", [("0.32.0", True), ("0.32.3.post1", True), ("0.33.0", True),
                                        ("0.31.2", False), ("0.34.0rc1", False), ("2.13.0+cpu", False)])
def test_versions_outside_the_table_are_refused(version, ok):
    from app import supported

    vllm = next(s for s in supported.VERSIONS if s.name == "vllm")
    assert supported.in_range(version, vllm) is ok


def test_the_gpu_check_wants_a_driver_for_cuda_13_and_skips_hosts_without_a_gpu():
    from app.commands import doctor

    cfg = load_config()
    c = doctor.check_gpu(cfg)  # this machine: no NVIDIA GPU, for real
    assert c.ok and not c.required and "no NVIDIA GPU" in c.detail
    old = doctor.check_gpu(cfg, driver=lambda: "570.124.06")
    assert not old.ok and "NVIDIA driver 570.124.06 is older than 580, the oldest that runs CUDA 13.0" in old.detail
    new = doctor.check_gpu(cfg, driver=lambda: "580.65.06")
    assert "older than" not in new.detail and new.info["driver"] == "580.65.06"
    # The CPU torch of this environment on a GPU host is a mistake the check names.
    assert not new.ok and "is a CPU build on a GPU host: install with DRAFTER_ADAPT_EXTRA=gpu" in new.detail


def test_the_mlflow_check_reads_a_local_store_without_changing_it(tmp_path):
    from app.commands import doctor

    cfg = load_config(overrides={"state_dir": str(tmp_path / "state")})
    c = doctor.check_mlflow(cfg)
    assert c.ok and "no local store yet" in c.detail and not (tmp_path / "state").exists()
    db = tmp_path / "mlflow.db"
    con = sqlite3.connect(db)
    con.executescript("CREATE TABLE experiments (id INTEGER); INSERT INTO experiments VALUES (0);"
                      "CREATE TABLE registered_models (name TEXT); CREATE TABLE alembic_version (version_num TEXT);"
                      "INSERT INTO alembic_version VALUES ('abc123');")
    con.close()
    before = (db.stat().st_mtime_ns, db.read_bytes())
    cfg = load_config(overrides={"state_dir": str(tmp_path / "state"), "mlflow": {"tracking_uri": f"sqlite:///{db}"}})
    c = doctor.check_mlflow(cfg)
    assert c.ok and c.info | {"tracking_uri": ""} == {"tracking_uri": "", "experiments": 1, "registered_models": 0,
                                                       "schema": "abc123"}
    assert (db.stat().st_mtime_ns, db.read_bytes()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlflow.db"]


@pytest.mark.parametrize("version,ok", [("3.11.7", True), ("3.12.1", True), ("3.10.14", False), ("3.13.0", False)])
def test_python_versions_outside_the_table_are_refused(version, ok):
    from app import supported

    python = next(s for s in supported.VERSIONS if s.name == "python")
    assert supported.in_range(version, python) is ok


def _fake_server(routes: dict[str, tuple[int, str]]):
    """An HTTP server answering ``routes`` ({path: (status, text)}), 404 elsewhere, on loopback."""
    from starlette.responses import PlainTextResponse

    from tests.services import LoopbackServer, free_port

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        status, text = routes.get(scope["path"], (404, "not found"))
        await PlainTextResponse(text, status)(scope, receive, send)

    return LoopbackServer(app, free_port())


@pytest.mark.parametrize("server,ok", [("3.4.0", True), ("2.9.2", True), ("2.8.1", False), (None, False)])
def test_the_mlflow_check_wants_a_supported_tracking_server(tmp_path, server, ok):
    from app.commands import doctor

    routes = {"/health": (200, "OK")}
    if server:
        routes["/version"] = (200, server)
    with _fake_server(routes) as srv:
        cfg = load_config(overrides={"state_dir": str(tmp_path), "mlflow": {"tracking_uri": srv.url}})
        c = doctor.check_mlflow(cfg)
    assert c.ok is ok, c.detail
    if server == "2.8.1":
        assert "the tracking server is MLflow 2.8.1; this release supports servers >=2.9,<4.0" in c.detail
    if server is None:
        assert "does not say its version" in c.detail


def test_a_replica_or_agent_serving_vllm_dev_routes_fails_the_doctor(tmp_path, monkeypatch):
    from app.commands import doctor

    token = "kq3V9-pXo2_LmZr7TbW8yNcE4fHs"
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    base = {"state_dir": str(tmp_path)}
    # Nothing running, nothing attached.
    c = doctor.check_replicas(load_config(overrides={**base, "serving": {"replicas": 0}}))
    assert c.ok and "unset" in c.detail
    # An agent without dev routes (404 there), and one that is a dev-mode vLLM (200 on /collective_rpc).
    with _fake_server({"/health": (200, "")}) as safe, \
            _fake_server({"/health": (200, ""), "/collective_rpc": (200, "{}")}) as dev:
        cfg = load_config(overrides={**base, "serving": {"replicas": 0, "attach_agents": [safe.url],
                                                         "agent_token": token}})
        c = doctor.check_replicas(cfg)
        assert c.ok and c.info["probed"] == [safe.url]
        cfg = load_config(overrides={**base, "serving": {"replicas": 0, "attach_agents": [safe.url, dev.url],
                                                         "agent_token": token}})
        c = doctor.check_replicas(cfg)
        assert not c.ok and c.required
        assert f"{dev.url} exposes vLLM's dev route /collective_rpc (HTTP 200)" in c.detail
        # A dev-mode replica on the pool's own port is found too.
        port = int(dev.url.rsplit(":", 1)[1])
        c = doctor.check_replicas(load_config(overrides={**base, "serving": {"replicas": 1, "base_port": port}}))
        assert not c.ok and "exposes vLLM's dev route" in c.detail
    # The variable itself, wherever the doctor runs.
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    c = doctor.check_replicas(load_config(overrides={**base, "serving": {"replicas": 0}}))
    assert not c.ok and "VLLM_SERVER_DEV_MODE is set here" in c.detail


def test_the_report_says_where_the_configuration_came_from(tmp_path, monkeypatch):
    from app.commands import doctor

    f = tmp_path / "adapt.toml"
    f.write_text('[serving]\nreplicas = 2\n')
    monkeypatch.setenv("ADAPT__GATE__MAX_ATTEMPTS", "3")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.internal:5000")
    c = doctor.check_config(load_config(f))
    assert c.ok and c.info == {"file": str(f), "environment": ["ADAPT__GATE__MAX_ATTEMPTS", "MLFLOW_TRACKING_URI"]}
    f.write_text('[mlflow]\ntracking_uri = "https://from-the-file"\n')
    assert doctor.check_config(load_config(f)).info["environment"] == ["ADAPT__GATE__MAX_ATTEMPTS"]  # the file won


@pytest.mark.parametrize("text,version", [
    ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.65.06  Sun Jul 27 07:09:40 UTC 2025\n", "580.65.06"),
    ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.133.20  Release Build  (dvs-builder@U16)\n",
     "570.133.20"),
    ("something else\n", None),
])
def test_the_driver_version_is_read_from_the_kernel_modules_proc_entry(text, version):
    from app.commands.doctor import driver_from_proc

    assert driver_from_proc(text) == version


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(
        [sys.executable, "-m", "app", *args], capture_output=True, text=True, cwd=REPO_ROOT,
        env={**os.environ, **(env or {})}, timeout=300,
    )


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
