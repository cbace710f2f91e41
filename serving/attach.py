"""What to run for a replica the pool does not start: its command lines, or a Kubernetes manifest.

``adapt replica command`` prints these from the pool's own config, so an attached replica serves
exactly what a started one would (target, K, dynamic K, engine sizing, ``serving.vllm_args``,
served name) (docs/deploy.md, "Attached replicas"): ``adapt replica fetch-head URI DIR`` (an
init container), then ``adapt agent --embed ... -- vllm serve MODEL ...``: one process holds vLLM's
engine, serves vLLM's OpenAI routes and the agent's admin routes behind a bearer token, and swaps
heads by calling vLLM's weight-update protocol in-process. No ``VLLM_SERVER_DEV_MODE``: vLLM's
unauthenticated dev routes exist nowhere.

The replica's line carries ``--weight-transfer-config '{"backend": "drafter_adapt_head"}'``
(``serving.head_transfer``, found through this repository's plugin directory on ``PYTHONPATH``).
Secrets (the agent token, S3 keys) are never part of the output: the shell recipe names the
variables to export from a secret store, and the manifest reads them from a Kubernetes Secret.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from serving.pool import replica_specs, tensor_parallel
from serving.replica import IN_PROCESS_WORKER_ENV, vllm_serve_argv, worker_in_engine_core
from settings.config import Config

# Variables the agent (and the head fetch) read from the environment; their values are secrets.
# All but the agent token are optional: a registry or bucket may need no credentials, or get them otherwise.
SECRET_ENV = {"ADAPT_AGENT_TOKEN": "agent-token", "AWS_ACCESS_KEY_ID": "aws-access-key-id",
              "AWS_SECRET_ACCESS_KEY": "aws-secret-access-key", "MLFLOW_TRACKING_TOKEN": "mlflow-tracking-token",
              "MLFLOW_TRACKING_USERNAME": "mlflow-tracking-username",
              "MLFLOW_TRACKING_PASSWORD": "mlflow-tracking-password"}


@dataclass
class Scheduling:
    """Where the pods go and what they reserve: CPU/memory requests (and limits), a node selector and
    tolerations (``key=value:Effect``, ``key:Effect``, ``key=value``; no effect: every effect)."""

    cpu: str = ""  # e.g. "8": the engine's scheduler, tokenizer and the agent share it
    memory: str = ""  # e.g. "64Gi": the model loads through host memory, and the CPU swap space
    cpu_limit: str = ""
    memory_limit: str = ""
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[str] = field(default_factory=list)

    def resources(self, gpus: int) -> dict[str, Any]:
        requests = {k: v for k, v in (("cpu", self.cpu), ("memory", self.memory)) if v}
        limits: dict[str, Any] = {k: v for k, v in (("cpu", self.cpu_limit), ("memory", self.memory_limit)) if v}
        if gpus:
            limits["nvidia.com/gpu"] = gpus
        return {k: v for k, v in (("requests", requests), ("limits", limits)) if v}

    def pod_fields(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.node_selector:
            out["nodeSelector"] = dict(self.node_selector)
        if self.tolerations:
            out["tolerations"] = [parse_toleration(t) for t in self.tolerations]
        return out


def parse_toleration(text: str) -> dict[str, str]:
    """``key=value:Effect`` / ``key:Effect`` / ``key=value`` / ``key`` as a Kubernetes toleration."""
    rest, _, effect = text.partition(":")
    key, eq, value = rest.partition("=")
    if not key.strip() or (effect and effect not in ("NoSchedule", "PreferNoSchedule", "NoExecute")):
        raise ValueError(f"toleration {text!r}: give key=value:Effect, key:Effect or key=value "
                         "(Effect: NoSchedule, PreferNoSchedule or NoExecute)")
    out = {"key": key.strip(), "operator": "Equal" if eq else "Exists"}
    if eq:
        out["value"] = value
    if effect:
        out["effect"] = effect
    return out


def parse_node_selector(items: list[str]) -> dict[str, str]:
    """``["k=v", ...]`` as a node selector."""
    out = {}
    for it in items:
        k, eq, v = it.partition("=")
        if not eq or not k.strip():
            raise ValueError(f"node selector {it!r}: give key=value")
        out[k.strip()] = v.strip()
    return out


@dataclass
class Recipe:
    """The programs of an attached replica (argv and plain environment of each).

    ``replica`` is the ``vllm serve`` line, the tail of ``agent`` (after ``--``): it runs inside the agent.
    """

    fetch: list[str]
    replica: list[str]
    agent: list[str]
    env: dict[str, str]  # of the fetch and the agent
    agent_port: int
    replica_port: int
    tls: bool
    gpus: int = 1
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"mode": "embedded", "fetch": {"argv": self.fetch, "env": self.env}, "vllm_serve": self.replica,
                "agent": {"argv": self.agent, "env": self.env, "secret_env": sorted(SECRET_ENV)},
                "agent_port": self.agent_port, "gpus": self.gpus, "notes": self.notes}


def recipe(cfg: Config, *, head_uri: str, target_dir: str, heads_dir: str, repo_dir: str, served_name: str,
           replica_port: int | None = None, agent_port: int | None = None, agent_host: str = "0.0.0.0",
           cpu: bool = False, python: str = "python3", tls_cert: str = "", tls_key: str = "") -> Recipe:
    """The command lines of one attached replica and its agent, from the pool's config."""
    s = cfg.serving
    replica_port = s.base_port if replica_port is None else replica_port
    agent_port = s.agent_port if agent_port is None else agent_port
    heads = PurePosixPath(heads_dir)
    first = str(heads / "initial")
    # The replica owns what its pod or host gives it: no device list (Kubernetes or the host picks).
    spec = replica_specs(s, cfg.head.num_speculative_tokens, target_dir, first, 1, served_name,
                         base_port=replica_port, cpu=True)[0]
    replica = vllm_serve_argv(spec, cpu=cpu, python=python)
    sources = ["--tracking-uri", cfg.mlflow.tracking_uri]
    if cfg.mlflow.registry_uri:
        sources += ["--registry-uri", cfg.mlflow.registry_uri]
    if cfg.s3.endpoint_url:
        sources += ["--s3-endpoint", cfg.s3.endpoint_url]
    fetch = [python, "-m", "app", "replica", "fetch-head", head_uri, first, "--target", target_dir, *sources]
    agent = [python, "-m", "app", "agent", "--host", agent_host, "--port", str(agent_port),
             "--target", target_dir, "--heads-dir", str(heads / "fetched"), *sources]
    if tls_cert:
        agent += ["--tls-cert", tls_cert, "--tls-key", tls_key]
    agent = [*agent, "--embed", "--", *replica]
    notes = []
    if not re.match(r"^(https?|databricks)", cfg.mlflow.tracking_uri) or "127.0.0.1" in cfg.mlflow.tracking_uri \
            or "localhost" in cfg.mlflow.tracking_uri:
        notes.append(f"the MLflow tracking URI {cfg.mlflow.tracking_uri} is local to the pool's host: set "
                     "[mlflow].tracking_uri to a server the replica's host reaches (models:/ heads come from it)")
    if "127.0.0.1" in cfg.s3.endpoint_url or "localhost" in cfg.s3.endpoint_url:
        notes.append(f"the S3 endpoint {cfg.s3.endpoint_url} is local to the pool's host: set [s3].endpoint_url "
                     "to one the replica's host reaches")
    env = {"PYTHONPATH": repo_dir}
    if cpu:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(spec.kv_cache_gib)
    if worker_in_engine_core(spec, cpu):
        env[IN_PROCESS_WORKER_ENV] = "0"
    return Recipe(fetch, replica, agent, env, agent_port, replica_port, bool(tls_cert),
                  gpus=0 if cpu else tensor_parallel(s), notes=notes)


def shell_text(r: Recipe) -> str:
    """The recipe as shell lines (``env K=V argv...``), with what to set from a secret store."""
    def line(env: dict[str, str], argv: list[str]) -> str:
        return shlex.join(["env", *(f"{k}={v}" for k, v in env.items()), *argv])

    scheme = "https" if r.tls else "http"
    out = [
        "# An attached replica and its agent (docs/deploy.md, \"Attached replicas\").",
        "# Export from your secret store first (never written here): ADAPT_AGENT_TOKEN, the pool's",
        "# [serving].agent_token; AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY when heads come from S3;",
        "# MLFLOW_TRACKING_TOKEN, or MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, when the",
        "# tracking server asks for credentials.",
        "# 1. Fetch and validate the first head:",
        line(r.env, r.fetch),
    ]
    gpus = f" on {r.gpus} GPU(s) of its own (CUDA_VISIBLE_DEVICES)" if r.gpus else ""
    out += [f"# 2. The agent, holding the replica's engine{gpus}: vLLM's routes and the agent's behind",
            "#    the token; heads swapped through vLLM's weight-update protocol in-process (no dev mode).",
            "#    After `--`: the replica's exact `vllm serve` line.",
            line(r.env, r.agent)]
    out += [f"# In the pool's config: [serving] attach_agents = [\"{scheme}://<this host>:{r.agent_port}\"]",
            *(f"# NOTE: {n}" for n in r.notes)]
    return "\n".join(out) + "\n"


def k8s_manifest(r: Recipe, *, name: str, image: str, replicas: int, secret: str, model_pvc: str,
                 namespace: str = "default", target_dir: str, heads_dir: str, gpus: int | None = None,
                 tls_secret: str = "", sched: Scheduling | None = None) -> list[dict[str, Any]]:
    """A headless Service and a StatefulSet: one pod per replica, every pod's agent with a stable DNS
    name to attach: one container, the agent holding the engine and the pod's GPUs, with the CPU and
    memory requests, node selector and tolerations of ``sched``."""
    gpus = r.gpus if gpus is None else gpus
    sched = sched or Scheduling()
    labels = {"app.kubernetes.io/name": name, "app.kubernetes.io/part-of": "drafter-adapt"}
    secret_env = [{"name": var, "valueFrom": {"secretKeyRef": {"name": secret, "key": key,
                                                               "optional": var != "ADAPT_AGENT_TOKEN"}}}
                  for var, key in SECRET_ENV.items()]
    plain = [{"name": k, "value": v} for k, v in r.env.items()]
    model = {"name": "model", "mountPath": target_dir, "readOnly": True}
    heads_rw = {"name": "heads", "mountPath": heads_dir}
    dshm = {"name": "dshm", "mountPath": "/dev/shm"}
    scheme = "HTTPS" if r.tls else "HTTP"
    resources = sched.resources(gpus)
    fetch = {"name": "fetch-head", "image": image, "command": r.fetch,
             "env": plain + [e for e in secret_env if e["name"] != "ADAPT_AGENT_TOKEN"],
             "volumeMounts": [model, heads_rw]}
    agent_mounts = [model, heads_rw]
    if tls_secret:
        agent_mounts.append({"name": "agent-tls", "mountPath": "/tls", "readOnly": True})
    agent = {
        "name": "agent", "image": image, "command": r.agent, "env": plain + secret_env,
        "ports": [{"name": "agent", "containerPort": r.agent_port}],
        "volumeMounts": agent_mounts,
        "readinessProbe": {"httpGet": {"path": "/health", "port": "agent", "scheme": scheme}, "periodSeconds": 5},
        "livenessProbe": {"tcpSocket": {"port": "agent"}, "periodSeconds": 20},
        "securityContext": {"allowPrivilegeEscalation": False},
    }
    # The engine loads inside the agent: it answers /health once the model is loaded.
    agent["volumeMounts"] = agent_mounts + [dshm]
    agent["startupProbe"] = {"httpGet": {"path": "/health", "port": "agent", "scheme": scheme},
                             "periodSeconds": 10, "failureThreshold": 180}
    if resources:
        agent["resources"] = resources
    containers = [agent]
    volumes: list[dict[str, Any]] = [
        {"name": "model", "persistentVolumeClaim": {"claimName": model_pvc, "readOnly": True}},
        {"name": "heads", "emptyDir": {}},
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
    ]
    if tls_secret:
        volumes.append({"name": "agent-tls", "secret": {"secretName": tls_secret}})
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": namespace,
                                                                     "labels": labels},
               "spec": {"clusterIP": "None", "selector": labels,
                        "ports": [{"name": "agent", "port": r.agent_port, "targetPort": "agent"}]}}
    sts = {"apiVersion": "apps/v1", "kind": "StatefulSet",
           "metadata": {"name": name, "namespace": namespace, "labels": labels},
           "spec": {"serviceName": name, "replicas": replicas, "podManagementPolicy": "Parallel",
                    "selector": {"matchLabels": labels},
                    "template": {"metadata": {"labels": labels},
                                 "spec": {"automountServiceAccountToken": False, "initContainers": [fetch],
                                          "containers": containers, "volumes": volumes,
                                          **sched.pod_fields()}}}}
    return [service, sts]


def agent_urls(r: Recipe, *, name: str, replicas: int, namespace: str = "default") -> list[str]:
    """The agents' URLs for ``[serving].attach_agents``: one stable DNS name per pod."""
    scheme = "https" if r.tls else "http"
    return [f"{scheme}://{name}-{i}.{name}.{namespace}.svc:{r.agent_port}" for i in range(replicas)]


def to_yaml(docs: list[Any], header: tuple[str, ...] | list[str] = ()) -> str:
    """YAML documents (block style; strings as JSON, which YAML reads as double-quoted scalars)."""
    def scalar(v: Any) -> str:
        if v is None:
            return "null"
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        return json.dumps(str(v))

    def inline(v: Any) -> str:
        return "{}" if v == {} else "[]" if v == [] else scalar(v)

    def key(k: str) -> str:
        return k if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_./-]*", k) and k not in ("null", "true", "false") \
            else json.dumps(k)

    def emit(v: Any, indent: int) -> list[str]:
        pad = "  " * indent
        if isinstance(v, dict):
            out = []
            for k, x in v.items():
                if isinstance(x, (dict, list)) and x:
                    out.append(f"{pad}{key(k)}:")
                    out += emit(x, indent + 1)
                else:
                    out.append(f"{pad}{key(k)}: {inline(x)}")
            return out
        if isinstance(v, list):
            out = []
            for x in v:
                if not (isinstance(x, (dict, list)) and x):
                    out.append(f"{pad}- {inline(x)}")
                    continue
                sub = emit(x, indent + 1)
                out.append(pad + "- " + sub[0].lstrip())
                out += sub[1:]
            return out
        return [pad + scalar(v)]

    lines = [f"# {h}" for h in header]
    for i, d in enumerate(docs):
        if i or header:
            lines.append("---")
        lines += emit(d, 0)
    return "\n".join(lines) + "\n"
