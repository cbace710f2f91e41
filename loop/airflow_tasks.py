"""What the Airflow DAGs call: each task is one library call taking and returning small ids.

Importable and testable without Airflow; ``dags/`` only wires these together.
"""

from __future__ import annotations

import re
from typing import Any

from loop.cycle import STEPS, CycleOptions, load_state, run_step, save_state, summary
from settings.config import Config, load_config

OPTION_KEYS = ("live_head", "bench_url", "nospec_url", "router_url", "data_interval")
# Longest a step may run before Airflow fails it (minutes); retries then resume the cycle.
STEP_TIMEOUT_MINUTES = {"ingest": 120, "snapshot": 30, "base": 30, "train": 480, "evaluate": 120, "bench": 240,
                        "gate": 10, "log_run": 60, "register": 15, "promote": 30}
# What the snapshot step produces, for data-aware scheduling downstream.
SNAPSHOT_ASSET = ("drafter_adapt_training_snapshot", "x-drafter-adapt://training-snapshot")


def config(params: dict[str, Any] | None) -> Config:
    """The config named by the DAG run's ``config`` param, else ``$ADAPT_CONFIG``, else the default."""
    return load_config((params or {}).get("config") or None)


def cycle_id_for(params: dict[str, Any] | None, dag_run_id: str) -> str:
    """``params.cycle_id`` or one derived from the DAG run id: clearing/retrying a DAG run resumes its cycle."""
    cid = (params or {}).get("cycle_id")
    return cid or "af-" + re.sub(r"[^A-Za-z0-9_.-]+", "_", dag_run_id).strip("_.")[:120]


def begin(params: dict[str, Any] | None, dag_run_id: str, data_interval: tuple[Any, Any] | None = None) -> str:
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


def step(name: str, cycle_id: str, params: dict[str, Any] | None) -> str:
    """Run one cycle step with the options recorded by :func:`begin`; returns the cycle id for the next task."""
    cfg = config(params)
    opts = load_state(cfg, cycle_id).get("options", {})
    run_step(cfg, cycle_id, name, CycleOptions(**{k: opts.get(k) for k in OPTION_KEYS}))
    return cycle_id


def snapshot_event(cycle_id: str, params: dict[str, Any] | None) -> dict[str, Any]:
    """The extra of the snapshot asset's event: which cycle, which snapshots, how many rows."""
    snap = load_state(config(params), cycle_id)["steps"].get("snapshot") or {}
    return {"cycle_id": cycle_id, **{f"{split}_snapshot_id": snap[split]["id"] for split in ("train", "heldout")
                                      if split in snap},
            **{f"{split}_rows": snap[split]["rows"] for split in ("train", "heldout") if split in snap}}


def report(cycle_id: str, params: dict[str, Any] | None) -> dict[str, Any]:
    """The cycle summary minus per-step details (what the last task pushes to XCom)."""
    out = summary(config(params), cycle_id)
    out.pop("steps", None)
    return out


def reconcile(params: dict[str, Any] | None) -> dict[str, Any]:
    """One controller pass (for the reconcile DAG): registry → pool, then the acceptance watch."""
    from rollout.controller import Controller

    ctl = Controller(config(params), router_url=(params or {}).get("router_url") or None)
    ctl.step()
    return {**ctl.health(), "events": list(ctl.events)}


__all__ = ["STEPS", "STEP_TIMEOUT_MINUTES", "SNAPSHOT_ASSET", "begin", "step", "snapshot_event", "report", "reconcile",
           "cycle_id_for", "config"]
