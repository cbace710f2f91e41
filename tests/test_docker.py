"""docker/compose.yaml and the images: structure, references, profiles.

`docker compose config` validates the file when the compose plugin is installed (CI);
this environment has only the docker client, so the same properties are also checked
structurally with PyYAML.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import yaml

DOCKER = Path(__file__).resolve().parents[1] / "docker"


def compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


SECRETS = ("ADAPT_ADMIN_TOKEN", "S3_ACCESS_KEY", "S3_SECRET_KEY", "POSTGRES_PASSWORD")


def test_compose_config_validates_when_the_plugin_exists(tmp_path):
    docker = shutil.which("docker")
    has_plugin = docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0
    if has_plugin:
        cmd = [docker, "compose", "-f", str(DOCKER / "compose.yaml"), "--profile", "gpu", "--profile", "cpu",
               "--profile", "tools", "--profile", "expose", "config", "-q"]
        env = {k: v for k, v in os.environ.items() if k not in SECRETS}
        empty = tmp_path / "empty.env"
        empty.write_text("")
        p = subprocess.run([*cmd[:1], "compose", "--env-file", str(empty), *cmd[2:]], capture_output=True,
                           text=True, env=env)
        assert p.returncode != 0 and "ADAPT_ADMIN_TOKEN" in p.stderr + p.stdout  # no secret: no stack
        p = subprocess.run(cmd, capture_output=True, text=True, env=env | {k: "x" * 32 for k in SECRETS})
        assert p.returncode == 0, p.stderr
    c = compose()
    assert set(c) <= {"name", "services", "volumes", "networks", "x-adapt-env", "x-adapt-volumes", "x-airflow",
                      "x-s3", "x-mlflow"}


def test_stack_has_every_service_with_built_or_pinned_images():
    s = compose()["services"]
    need = {"s3", "postgres", "mlflow", "airflow-apiserver", "airflow-scheduler", "airflow-dag-processor",
            "airflow-init", "pool-gpu", "pool-cpu", "router", "controller", "worker"}
    assert need <= set(s)
    for name, svc in s.items():
        assert "image" in svc or "build" in svc, name
        if "build" in svc:
            df = svc["build"]["dockerfile"]
            assert (DOCKER.parent / df).is_file(), f"{name}: {df} missing"
        if "image" in svc and "build" not in svc:
            assert re.search(r":[\w.-]+$", svc["image"]) and not svc["image"].endswith(":latest"), name
    for dep_svc in s.values():
        for dep in (dep_svc.get("depends_on") or {}):
            assert dep in s


def test_gpu_profile_reserves_nvidia_and_pool_exposes_only_the_router():
    s = compose()["services"]
    gpu = s["pool-gpu"]
    assert gpu["profiles"] == ["gpu"]
    dev = gpu["deploy"]["resources"]["reservations"]["devices"][0]
    assert dev["driver"] == "nvidia" and "gpu" in dev["capabilities"]
    assert s["pool-cpu"]["profiles"] == ["cpu"]
    for p in ("pool-gpu", "pool-cpu"):
        # Only the router; replicas' RPC stays on the container's loopback, the host side on its loopback.
        assert s[p]["ports"] == ["${ROUTER_BIND:-127.0.0.1}:8000:8000"]
        assert "pool" in s[p]["networks"]["default"]["aliases"]
    assert "http://pool:8000" in s["controller"]["command"]
    # Postgres serves both MLflow and Airflow.
    assert "postgres:5432/mlflow" in " ".join(s["mlflow"]["command"])
    assert "postgres:5432/airflow" in s["airflow-scheduler"]["environment"]["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]
    assert "CREATE DATABASE mlflow" in (DOCKER / "postgres-init.sql").read_text()


def test_dockerfiles_pin_bases_and_the_replica_carries_the_worker_extension():
    files = {p.name: p.read_text() for p in DOCKER.glob("*.Dockerfile")}
    assert set(files) == {"worker.Dockerfile", "replica.Dockerfile", "router.Dockerfile", "airflow.Dockerfile",
                          "mlflow.Dockerfile"}
    for name, text in files.items():
        froms = re.findall(r"^FROM\s+(\S+)", text, re.M)
        assert froms, name
        for f in froms:
            assert f.startswith("${") or (":" in f and not f.endswith(":latest")), (name, f)
    assert "vllm/vllm-openai:v0.32.0" in files["replica.Dockerfile"]  # CUDA base
    assert "COPY serving" in files["replica.Dockerfile"]  # serving.hotswap, loaded by --worker-extension-cls
    assert "apache/airflow:3.3.2" in files["airflow.Dockerfile"] and "COPY --chown=airflow:root dags" in files["airflow.Dockerfile"]
    assert "mlflow==3.17.2" in files["mlflow.Dockerfile"]


def test_compose_config_file_loads_as_an_adapt_config(monkeypatch):
    from settings.config import load_config

    monkeypatch.setenv("ADAPT_TARGET", "tiny")
    cfg = load_config(DOCKER / "adapt.compose.toml")
    assert cfg.mlflow.tracking_uri == "http://mlflow:5000" and cfg.mlflow.registered_model == "drafter-tiny-default"
    assert cfg.capture.source.startswith("s3://") and cfg.serving.host == "0.0.0.0"


def test_compose_ships_no_secret_and_publishes_only_the_router_on_loopback():
    """The issue: ADAPT_ADMIN_TOKEN defaulted to change-me, S3 keys to drafter/drafter-secret, Postgres to
    drafter; the router bound 0.0.0.0:8000 and MLflow (5000), S3 (8333), Airflow (8080) were published."""
    text = (DOCKER / "compose.yaml").read_text()
    for name in SECRETS:
        refs = re.findall(r"\$\{" + name + r"(:?[-?=+])?([^}]*)\}", text)
        assert refs and all(op == ":?" for op, _ in refs), (name, refs)  # required, no default
    for weak in ("change-me", "drafter-secret", ":-drafter}"):
        assert weak not in text, weak
    services = compose()["services"]
    published = {name: svc["ports"] for name, svc in services.items() if svc.get("ports")}
    default = {name for name in published if "expose" not in services[name].get("profiles", [])}
    assert default == {"pool-gpu", "pool-cpu"}  # the router, in whichever pool profile runs
    for name, ports in published.items():
        for port in ports:
            host = port.rsplit(":", 2)[0]
            assert host in ("${ROUTER_BIND:-127.0.0.1}", "${EXPOSE_BIND:-127.0.0.1}"), (name, port)
    exposed = {name: ports[0].rsplit(":", 1)[1] for name, ports in published.items() if name not in default}
    assert exposed == {"mlflow-exposed": "5000", "s3-exposed": "8333", "airflow-exposed": "8080"}
    assert "0.0.0.0" not in " ".join(services["controller"]["command"])


def test_env_example_names_every_secret_empty_and_env_is_ignored():
    example = dict(line.split("=", 1) for line in (DOCKER / ".env.example").read_text().splitlines()
                   if line and not line.startswith("#"))
    assert {k: example[k] for k in SECRETS} == {k: "" for k in SECRETS}
    assert example["ROUTER_BIND"] == example["EXPOSE_BIND"] == "127.0.0.1"
    ignored = subprocess.run(["git", "check-ignore", "-q", str(DOCKER / ".env")], cwd=DOCKER.parent)
    assert ignored.returncode == 0


def test_s3_starts_with_an_owner_only_identity_from_the_env(tmp_path):
    """SeaweedFS 3.80 reads no key from its environment: the start command writes -s3.config from them."""
    services = compose()["services"]
    for name, run in (("s3", "weed server"), ("s3-exposed", "weed s3")):
        (script,) = services[name]["command"]
        assert run in script and "-config=/tmp/s3.json" in script.replace("-s3.config=", "-config=")
        out = tmp_path / f"{name}.json"
        # What compose hands to /bin/sh ($$ is compose's escape of $), with weed stood in for.
        sh = script.replace("$$", "$").replace("/tmp/s3.json", str(out)).split("&& exec")[0]
        env = {"PATH": os.environ["PATH"], "AWS_ACCESS_KEY_ID": "AKIA-test", "AWS_SECRET_ACCESS_KEY": "s3cr3t-Value_1",
               "S3_IDENTITY": compose()["x-s3"]["environment"]["S3_IDENTITY"]}
        subprocess.run(["/bin/sh", "-c", sh], check=True, env=env)
        ident = json.loads(out.read_text())["identities"]
        assert ident == [{"name": "drafter", "credentials": [{"accessKey": "AKIA-test", "secretKey": "s3cr3t-Value_1"}],
                          "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]
        assert stat.S_IMODE(out.stat().st_mode) == 0o600
