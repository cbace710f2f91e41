"""Reconcile/health: one controller pass every 10 minutes (a backstop for `adapt controller`)."""

from __future__ import annotations

from datetime import timedelta

import pendulum
from airflow.sdk import Param, dag, get_current_context, task

from loop import airflow_tasks as at


@dag(
    dag_id="drafter_reconcile",
    schedule=timedelta(minutes=10),
    start_date=pendulum.datetime(2025, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    default_args={"retries": 1, "retry_delay": timedelta(minutes=1)},
    params={"config": Param(None, type=["null", "string"]), "router_url": Param(None, type=["null", "string"])},
    tags=["drafter-adapt"],
    doc_md=__doc__,
)
def drafter_reconcile():
    @task(execution_timeout=timedelta(minutes=9))
    def reconcile() -> dict:
        return at.reconcile(get_current_context()["params"])

    reconcile()


dag = drafter_reconcile()
