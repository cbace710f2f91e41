"""Nightly adaptation: one `adapt cycle`, one task per step, passing only the cycle id.

All logic lives in ``loop.cycle`` (via ``loop.airflow_tasks``); a cleared or retried
run resumes its cycle, and a step never creates a second model version.
"""

from __future__ import annotations

from datetime import timedelta

import pendulum
from airflow.sdk import Asset, Param, dag, get_current_context, task

from loop import airflow_tasks as at

PARAMS = {
    "config": Param(None, type=["null", "string"], description="adapt config TOML (default $ADAPT_CONFIG)"),
    "cycle_id": Param(None, type=["null", "string"], description="resume this cycle instead of the run's own"),
    "live_head": Param(None, type=["null", "string"], description="live head while nothing is in Production"),
    "bench_url": Param(None, type=["null", "string"], description="existing bench replica URL"),
    "nospec_url": Param(None, type=["null", "string"],
                        description="existing replica without speculation (the bench's reference arm)"),
    "router_url": Param(None, type=["null", "string"], description="swap this router's pool after promotion"),
}


SNAPSHOT = Asset(name=at.SNAPSHOT_ASSET[0], uri=at.SNAPSHOT_ASSET[1])


def _step(name: str):
    @task(task_id=name, execution_timeout=timedelta(minutes=at.STEP_TIMEOUT_MINUTES[name]),
          outlets=[SNAPSHOT] if name == "snapshot" else [])
    def run(cycle_id: str) -> str:
        ctx = get_current_context()
        out = at.step(name, cycle_id, ctx["params"])
        if name == "snapshot":
            ctx["outlet_events"][SNAPSHOT].extra = at.snapshot_event(cycle_id, ctx["params"])
        return out

    return run


@dag(
    dag_id="drafter_nightly_adaptation",
    schedule="@daily",
    start_date=pendulum.datetime(2025, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    default_args={"retries": 2, "retry_delay": timedelta(minutes=5)},
    params=PARAMS,
    tags=["drafter-adapt"],
    doc_md=__doc__,
)
def drafter_nightly_adaptation():
    @task(execution_timeout=timedelta(minutes=5))
    def begin() -> str:
        ctx = get_current_context()
        return at.begin(ctx["params"], ctx["run_id"], (ctx.get("data_interval_start"), ctx.get("data_interval_end")))

    @task(execution_timeout=timedelta(minutes=5))
    def report(cycle_id: str) -> dict:
        return at.report(cycle_id, get_current_context()["params"])

    cid = begin()
    for name in at.STEPS:
        cid = _step(name)(cid)
    report(cid)


dag = drafter_nightly_adaptation()
