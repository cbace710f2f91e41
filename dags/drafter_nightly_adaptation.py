"""Nightly adaptation: one `adapt cycle` per run, one task per step, passing only the cycle id.

One DAG per configured endpoint (``[airflow] endpoints``, else one for $ADAPT_CONFIG). All logic lives in
``loop.cycle`` (via ``loop.airflow_tasks``); a cleared or retried run resumes its cycle, and a step never
creates a second model version. Timeouts, queues and pools come from each endpoint's ``[airflow]``.
"""

from __future__ import annotations

import pendulum
from airflow.sdk import Asset, Param, dag, get_current_context, task

from loop import airflow_tasks as at

SNAPSHOT = Asset(name=at.SNAPSHOT_ASSET[0], uri=at.SNAPSHOT_ASSET[1])


def params(spec: at.DagSpec) -> dict:
    s = ["null", "string"]
    return {"config": Param(spec.config, type=s, description="adapt config TOML (default: the endpoint's)"),
            "cycle_id": Param(None, type=s, description="resume this cycle instead of the run's own"),
            "live_head": Param(None, type=s, description="live head while nothing is the champion"),
            "bench_url": Param(None, type=s, description="existing bench replica URL"),
            "nospec_url": Param(None, type=s, description="existing replica without speculation (reference arm)"),
            "router_url": Param(None, type=s, description="swap this router's pool after promotion")}


def nightly(spec: at.DagSpec):
    @dag(dag_id=spec.nightly_id, schedule=spec.airflow.schedule, start_date=pendulum.datetime(2025, 1, 1, tz="UTC"),
         catchup=False, max_active_runs=1, default_args=spec.default_args(), params=params(spec),
         tags=["drafter-adapt", spec.name or "default"], doc_md=__doc__)
    def drafter_nightly_adaptation():
        @task(task_id="begin", **spec.task_args("begin"))
        def begin() -> str:
            ctx = get_current_context()
            interval = (ctx.get("data_interval_start"), ctx.get("data_interval_end"))
            return at.begin(ctx["params"], ctx["run_id"], interval)

        def step(name: str):
            @task(task_id=name, outlets=[SNAPSHOT] if name == "snapshot" else [], **spec.task_args(name))
            def run(cycle_id: str) -> str:
                ctx = get_current_context()
                out = at.step(name, cycle_id, ctx["params"])
                if name == "snapshot":
                    ctx["outlet_events"][SNAPSHOT].extra = at.snapshot_event(cycle_id, ctx["params"])
                return out
            return run

        @task(task_id="report", **spec.task_args("report"))
        def report(cycle_id: str) -> dict:
            return at.report(cycle_id, get_current_context()["params"])

        cid = begin()
        for name in at.STEPS:
            cid = step(name)(cid)
        report(cid)

    return drafter_nightly_adaptation()


for _spec in at.dag_specs():
    globals()[_spec.nightly_id] = nightly(_spec)
