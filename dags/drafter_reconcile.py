"""Reconcile/health: one controller pass every 10 minutes (a backstop for `adapt controller`), one DAG per
configured endpoint."""

from __future__ import annotations

from datetime import timedelta

import pendulum
from airflow.sdk import Param, dag, get_current_context, task

from loop import airflow_tasks as at


def reconcile_dag(spec: at.DagSpec):
    @dag(dag_id=spec.reconcile_id, schedule=timedelta(minutes=10), start_date=pendulum.datetime(2025, 1, 1, tz="UTC"),
         catchup=False, max_active_runs=1,
         default_args={**spec.default_args(), "retries": 1, "retry_delay": timedelta(minutes=1)},
         params={"config": Param(spec.config, type=["null", "string"]),
                 "router_url": Param(None, type=["null", "string"])},
         tags=["drafter-adapt", spec.name or "default"], doc_md=__doc__)
    def drafter_reconcile():
        @task(task_id="reconcile", **spec.task_args("reconcile"))
        def reconcile() -> dict:
            return at.reconcile(get_current_context()["params"])

        reconcile()

    return drafter_reconcile()


for _spec in at.dag_specs():
    globals()[_spec.reconcile_id] = reconcile_dag(_spec)
