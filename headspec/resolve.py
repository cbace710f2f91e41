"""Head references → local head directories.

A head is named by a directory, an MLflow model URI (``models:/name/3``,
``runs:/<run id>/head``) or an S3 URI of a head directory (``s3://bucket/prefix``);
the remote ones are downloaded under ``download_dir`` and the local directory is
returned with the registered version when there is one.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from headspec.files import WEIGHTS


# References another host can fetch by itself: the registry's and S3's (not a path, not file://).
REMOTE_SCHEMES = ("s3://", "models:/", "runs:/")


def is_remote_ref(spec: str) -> bool:
    """Whether ``spec`` names a head by a URI that any host with credentials can fetch."""
    return spec.startswith(REMOTE_SCHEMES)


def is_local_ref(spec: str) -> bool:
    """Whether ``spec`` is a directory path (not a URI of any kind)."""
    return "://" not in spec and not spec.startswith(("models:/", "runs:/"))


def resolve_head(spec: str, download_dir: str | Path, tracking_uri: str | None = None,
                 s3_client_kwargs: dict[str, Any] | None = None,
                 registry_uri: str | None = None) -> tuple[Path, str | None]:
    """A head reference → (local dir, registered version or None).

    ``models:/`` references are looked up in ``registry_uri``, else ``MLFLOW_REGISTRY_URI``, else the
    tracking server (MLflow's own order).
    """
    if spec.startswith("s3://"):
        return _from_s3(spec, Path(download_dir), s3_client_kwargs or {}), None
    if is_local_ref(spec):
        return Path(spec).expanduser().absolute(), None
    import mlflow

    if tracking_uri:
        mlflow.set_tracking_uri(tracking_uri)
    registry = registry_uri or os.environ.get("MLFLOW_REGISTRY_URI") or tracking_uri
    version = None
    if spec.startswith("models:/"):
        parts = spec[len("models:/"):].split("/")
        version = parts[1] if len(parts) > 1 else None
    dst = Path(download_dir) / ("mlflow-" + spec.replace(":/", "-").replace("/", "-"))
    dst.mkdir(parents=True, exist_ok=True)
    with _registry(registry):
        local = Path(mlflow.artifacts.download_artifacts(artifact_uri=spec, dst_path=str(dst)))
    return _head_dir_in(local), version


@contextmanager
def _registry(uri: str | None) -> Iterator[None]:
    """MLflow's ``models:/`` lookup reads only its process-wide registry URI, and setting that also
    exports ``MLFLOW_REGISTRY_URI``, which every later config and client of this process would then
    read: both are put back after the call."""
    import mlflow

    if not uri:
        yield
        return
    saved = os.environ.get("MLFLOW_REGISTRY_URI")
    mlflow.set_registry_uri(uri)
    try:
        yield
    finally:
        mlflow.set_registry_uri("")  # back to MLflow's own order: the variable, else the tracking URI
        if saved is None:
            os.environ.pop("MLFLOW_REGISTRY_URI", None)
        else:
            os.environ["MLFLOW_REGISTRY_URI"] = saved


def _head_dir_in(local: Path) -> Path:
    """Registered models may wrap the head in a sub-directory; find its config.json."""
    if not (local / "config.json").is_file():
        found = sorted(p.parent for p in local.rglob("config.json") if (p.parent / WEIGHTS).is_file())
        if found:
            return found[0]
    return local


def _from_s3(uri: str, download_dir: Path, client_kwargs: dict[str, Any]) -> Path:
    import boto3

    bucket, _, prefix = uri[len("s3://"):].partition("/")
    prefix = prefix.rstrip("/") + "/" if prefix else ""
    dst = download_dir / ("s3-" + uri[len("s3://"):].strip("/").replace("/", "-"))
    s3 = boto3.client("s3", **client_kwargs)
    found = False
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            rel = obj["Key"][len(prefix):]
            if not rel or rel.endswith("/"):
                continue
            out = dst / rel
            if ".." in Path(rel).parts:
                raise ValueError(f"{uri}: object key {obj['Key']!r} escapes the head directory")
            out.parent.mkdir(parents=True, exist_ok=True)
            s3.download_file(bucket, obj["Key"], str(out))
            found = True
    if not found:
        raise FileNotFoundError(f"no objects under {uri}")
    return _head_dir_in(dst)
