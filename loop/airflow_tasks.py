"""What the Airflow DAGs call: each task is one library call taking and returning small ids, plus what the
DAG files need at parse time (which DAGs to make, each task's timeout, queue and pool) and the failure
callback.

Importable and testable without Airflow; ``dags/`` only wires these together.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from loop.cycle import CycleOptions, load_state, run_step, save_state, summary
from loop.steps import STEPS
from rollout.airflow import dag_ids
from settings.config import AirflowConfig, Config, ConfigError, load_config

log = logging.getLogger("adapt.airflow")

OPTION_KEYS = ("live_head", "bench_url", "nospec_url", "router_url", "data_interval")
# The tasks around the steps, which [airflow] step_queue / step_pool / step_timeout_minutes may also name.
EXTRA_TASKS = ("begin", "report", "reconcile")
# Their timeouts (minutes) when the config names none: they read and write small state.
EXTRA_TIMEOUT_MINUTES = {"begin": 5, "report": 5, "reconcile": 9}
# What the snapshot step produces, for data-aware scheduling downstream.
SNAPSHOT_ASSET = ("drafter_adapt_training_snapshot", "x-drafter-adapt://training-snapshot")


@dataclass(frozen=True)
class DagSpec:
    """One endpoint's pair of DAGs, as the DAG files make them."""

    name: str
    config: str | None  # the endpoint's config file (the runs' default ``config`` param); None: $ADAPT_CONFIG
    airflow: AirflowConfig = field(default_factory=AirflowConfig)

    @property
    def nightly_id(self) -> str:
        return dag_ids(self.name)[0]

    @property
    def reconcile_id(self) -> str:
        return dag_ids(self.name)[1]

    def task_args(self, task: str) -> dict[str, Any]:
        """``execution_timeout``, and ``queue`` / ``pool`` where configured (else Airflow's defaults)."""
        a = self.airflow
        minutes = a.step_timeout_minutes.get(task, EXTRA_TIMEOUT_MINUTES.get(task))
        if minutes is None:
            raise ConfigError(f"[airflow] step_timeout_minutes has no timeout for {task!r}")
        out: dict[str, Any] = {"execution_timeout": _dt.timedelta(minutes=minutes)}
        queue, pool = a.step_queue.get(task, a.queue), a.step_pool.get(task, a.pool)
        if queue:
            out["queue"] = queue
        if pool:
            out["pool"] = pool
        return out

    def default_args(self) -> dict[str, Any]:
        return {"retries": self.airflow.retries, "retry_delay": _dt.timedelta(minutes=self.airflow.retry_delay_minutes),
                "on_failure_callback": on_task_failure}


def _check_task_names(cfg: Config, where: str) -> None:
    known = set(STEPS) | set(EXTRA_TASKS)
    for key in ("step_timeout_minutes", "step_queue", "step_pool"):
        unknown = sorted(set(getattr(cfg.airflow, key)) - known)
        if unknown:
            raise ConfigError(f"{where}: [airflow] {key} names no task: {', '.join(unknown)} "
                              f"(tasks: {', '.join([*STEPS, *EXTRA_TASKS])})")


def dag_specs(cfg: Config | None = None) -> list[DagSpec]:
    """The DAG pairs to make: one per config file in ``[airflow] endpoints`` (each named by its own
    ``[airflow] name``), else one for this config. Raises ConfigError naming the file at fault."""
    cfg = cfg or load_config()
    here = cfg.source_file or "the embedded default config"
    if not cfg.airflow.endpoints:
        _check_task_names(cfg, here)
        return [DagSpec(cfg.airflow.name, cfg.source_file, cfg.airflow)]
    specs: list[DagSpec] = []
    for path in cfg.airflow.endpoints:
        try:
            ecfg = load_config(path)
        except FileNotFoundError as exc:
            raise ConfigError(f"{here}: [airflow] endpoints lists {path}, which does not exist") from exc
        _check_task_names(ecfg, path)
        if not ecfg.airflow.name:
            raise ConfigError(f"{path}: [airflow] name is empty; with several endpoints each names its DAGs")
        if ecfg.airflow.endpoints:
            raise ConfigError(f"{path}: an endpoint's config lists endpoints of its own")
        specs.append(DagSpec(ecfg.airflow.name, ecfg.source_file, ecfg.airflow))
    names = [s.name for s in specs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(f"{here}: [airflow] endpoints: two configs have the name {', '.join(dupes)}")
    return specs


def config(params: Mapping[str, Any] | None) -> Config:
    """The config named by the DAG run's ``config`` param, else ``$ADAPT_CONFIG``, else the default."""
    return load_config((params or {}).get("config") or None)


def cycle_id_for(params: Mapping[str, Any] | None, dag_run_id: str) -> str:
    """``params.cycle_id`` or one derived from the DAG run id: clearing/retrying a DAG run resumes its cycle."""
    cid = (params or {}).get("cycle_id")
    return cid or "af-" + re.sub(r"[^A-Za-z0-9_.-]+", "_", dag_run_id).strip("_.")[:120]


def begin(params: Mapping[str, Any] | None, dag_run_id: str, data_interval: tuple[Any, Any] | None = None) -> str:
    """Create (or find) the cycle and record the run's options (and its data interval) in its state;
    returns the cycle id."""
    cfg = config(params)
    cid = cycle_id_for(params, dag_run_id)
    state = load_state(cfg, cid)
    state.setdefault("options", {}).update({k: (params or {}).get(k) for k in OPTION_KEYS if (params or {}).get(k)})
    if data_interval and all(data_interval) and not (params or {}).get("cycle_id"):
        state["options"]["data_interval"] = [t.isoformat() if hasattr(t, "isoformat") else str(t)
                                             for t in data_interval]
    state["dag_run_id"] = dag_run_id
    save_state(cfg, state)
    return cid


def step(name: str, cycle_id: str, params: Mapping[str, Any] | None) -> str:
    """Run one cycle step with the options recorded by :func:`begin`; returns the cycle id for the next task."""
    cfg = config(params)
    opts = load_state(cfg, cycle_id).get("options", {})
    run_step(cfg, cycle_id, name, CycleOptions(**{k: opts.get(k) for k in OPTION_KEYS}))
    return cycle_id


def snapshot_event(cycle_id: str, params: Mapping[str, Any] | None) -> dict[str, Any]:
    """The extra of the snapshot asset's event: which cycle, which snapshots, how many rows."""
    snap = load_state(config(params), cycle_id)["steps"].get("snapshot") or {}
    return {"cycle_id": cycle_id, **{f"{split}_snapshot_id": snap[split]["id"] for split in ("train", "heldout")
                                      if split in snap},
            **{f"{split}_rows": snap[split]["rows"] for split in ("train", "heldout") if split in snap}}


def report(cycle_id: str, params: Mapping[str, Any] | None) -> dict[str, Any]:
    """The cycle summary minus per-step details (what the last task pushes to XCom)."""
    out = summary(config(params), cycle_id)
    out.pop("steps", None)
    return out


def reconcile(params: Mapping[str, Any] | None) -> dict[str, Any]:
    """One controller pass (for the reconcile DAG): registry → pool, then the acceptance watch."""
    from rollout.controller import Controller

    ctl = Controller(config(params), router_url=(params or {}).get("router_url") or None)
    ctl.step()
    return {**ctl.health(), "events": list(ctl.events)}


def on_task_failure(context: Mapping[str, Any]) -> dict[str, Any]:
    """Airflow's ``on_failure_callback`` for every task (after its last retry): one JSON log line, the failure
    recorded in the cycle's state (``adapt cycle`` and the report show it), and a POST of ``{"text": ...}`` to
    ``[airflow] failure_webhook`` when one is set. Never raises: a callback's error would hide the task's."""
    ti = context.get("ti") or context.get("task_instance")
    dag_run = context.get("dag_run")
    params = context.get("params") or {}
    run_id = str(context.get("run_id") or getattr(dag_run, "run_id", "") or "")
    event = {"event": "task_failed", "dag_id": getattr(ti, "dag_id", None), "task_id": getattr(ti, "task_id", None),
             "run_id": run_id, "try_number": getattr(ti, "try_number", None),
             "error": f"{type(context.get('exception')).__name__}: {context.get('exception')}"
             if context.get("exception") is not None else None,
             "log_url": getattr(ti, "log_url", None)}
    try:
        cfg = config(params)
    except Exception as exc:  # noqa: BLE001 - the config may be why the task failed
        event["callback_error"] = f"config: {exc}"
        log.error(json.dumps(event, default=str))
        return event
    if run_id:
        event["cycle_id"] = cycle_id_for(params, run_id)
        try:
            state = load_state(cfg, event["cycle_id"])
            state.setdefault("failures", []).append({k: event[k] for k in ("task_id", "try_number", "error")}
                                                    | {"at": _dt.datetime.now(_dt.timezone.utc).isoformat()})
            save_state(cfg, state)
        except Exception as exc:  # noqa: BLE001
            event["callback_error"] = f"cycle state: {type(exc).__name__}: {exc}"
    hook = cfg.airflow.resolved_failure_webhook()
    if hook:
        import httpx

        text = (f"drafter-adapt: {event['dag_id']}.{event['task_id']} failed (run {run_id}, try "
                f"{event['try_number']}): {event['error']}" + (f"\n{event['log_url']}" if event["log_url"] else ""))
        try:
            httpx.post(hook, json={"text": text, "event": event}, timeout=10).raise_for_status()
            event["notified"] = True
        except Exception as exc:  # noqa: BLE001 - the URL is a secret: name the error only
            event["callback_error"] = f"failure webhook: {type(exc).__name__}"
    log.error(json.dumps(event, default=str))
    return event


__all__ = ["STEPS", "SNAPSHOT_ASSET", "DagSpec", "dag_specs", "begin", "step", "snapshot_event", "report",
           "reconcile", "on_task_failure", "cycle_id_for", "config"]
