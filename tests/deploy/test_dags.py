"""The DAG files import cleanly and wire exactly the cycle's steps (no services; a subprocess keeps
Airflow's home and config out of the test process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.paths import REPO_ROOT

PROBE = r"""
import json
from airflow.dag_processing.dagbag import DagBag
b = DagBag("dags")
out = {"errors": {k: str(v) for k, v in b.import_errors.items()}, "dags": {}}
for dag_id, d in b.dags.items():
    out["dags"][dag_id] = {
        "tasks": [t.task_id for t in d.topological_sort()] if hasattr(d, "topological_sort") else sorted(d.task_ids),
        "upstream": {t.task_id: sorted(t.upstream_task_ids) for t in d.tasks},
        "catchup": d.catchup, "max_active_runs": d.max_active_runs,
        "schedule": str(d.schedule), "retries": {t.task_id: t.retries for t in d.tasks},
        "params": sorted(d.params.keys()),
        "timeouts": {t.task_id: t.execution_timeout.total_seconds() if t.execution_timeout else None
                     for t in d.tasks},
        "outlets": {t.task_id: [getattr(o, "uri", str(o)) for o in (t.outlets or [])] for t in d.tasks},
    }
print("JSON" + json.dumps(out))
"""


def probe(tmp_path: Path) -> dict:
    env = {**os.environ, "AIRFLOW_HOME": str(tmp_path), "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
           "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{tmp_path / 'airflow.db'}", "PYTHONPATH": str(REPO_ROOT)}
    p = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("JSON")][-1]
    return json.loads(line[4:])


def test_dags_import_and_wire_the_cycle_steps(tmp_path: Path):
    from loop.airflow_tasks import OPTION_KEYS
    from loop.cycle import STEPS

    out = probe(tmp_path)
    assert out["errors"] == {}
    assert set(out["dags"]) == {"drafter_nightly_adaptation", "drafter_reconcile"}
    n = out["dags"]["drafter_nightly_adaptation"]
    assert n["catchup"] is False and n["max_active_runs"] == 1
    assert n["schedule"] in ("@daily", "0 0 * * *")
    assert all(r >= 1 for r in n["retries"].values())
    chain = ["begin", *STEPS, "report"]
    # A strict chain: each task waits for exactly the previous one.
    assert n["upstream"] == {t: ([chain[i - 1]] if i else []) for i, t in enumerate(chain)}
    assert {"config", "cycle_id", "live_head", "bench_url", "router_url"} <= set(n["params"])
    # Every option a cycle records can be given as a param, except the interval, which is the run's own.
    assert set(OPTION_KEYS) - {"data_interval"} <= set(n["params"])
    r = out["dags"]["drafter_reconcile"]
    assert list(r["upstream"]) == ["reconcile"] and r["max_active_runs"] == 1 and r["catchup"] is False
    # Every task is bounded in time, and the snapshot is an asset for data-aware scheduling.
    assert all(t is not None and t > 0 for d in out["dags"].values() for t in d["timeouts"].values())
    assert n["timeouts"]["train"] > n["timeouts"]["gate"]
    assert n["outlets"]["snapshot"] == ["x-drafter-adapt://training-snapshot"] and not n["outlets"]["train"]


def test_dag_files_only_wire_library_calls():
    for f in (REPO_ROOT / "dags").glob("*.py"):
        src = f.read_text()
        assert len(src.splitlines()) < 80, f"{f.name} holds logic; move it into loop/"
        assert "from loop import airflow_tasks" in src


def test_airflow_task_ids_are_safe_and_stable():
    from loop.airflow_tasks import cycle_id_for

    cid = cycle_id_for({}, "scheduled__2025-01-02T00:00:00+00:00")
    assert cid == cycle_id_for(None, "scheduled__2025-01-02T00:00:00+00:00")  # a retried run resumes its cycle
    assert "/" not in cid and ":" not in cid and cid.startswith("af-")
    assert cycle_id_for({"cycle_id": "c1"}, "x") == "c1"


def test_a_scheduled_run_ingests_its_data_interval_plus_the_late_hours(tmp_path, monkeypatch):
    from datetime import datetime, timezone

    from loop import airflow_tasks as at
    from loop import cycle

    cfg_file = tmp_path / "c.toml"
    cfg_file.write_text(f'state_dir = "{tmp_path}"\n[capture]\nlate_hours = 3\n')
    seen = {}

    def fake_ingest(cfg, since=None, until=None, **kw):
        seen.update(since=since, until=until)

        class R:
            def summary(self):
                return {"read": 0}
        return R()

    monkeypatch.setattr("capture.ingest.ingest", fake_ingest)
    start, end = datetime(2025, 3, 1, tzinfo=timezone.utc), datetime(2025, 3, 2, tzinfo=timezone.utc)
    cid = at.begin({"config": str(cfg_file)}, "scheduled__2025-03-02", (start, end))
    monkeypatch.setattr(cycle, "STEPS", ("ingest",))
    at.step("ingest", cid, {"config": str(cfg_file)})
    assert seen == {"since": datetime(2025, 2, 28, 21, tzinfo=timezone.utc), "until": end}
    assert at.snapshot_event(cid, {"config": str(cfg_file)}) == {"cycle_id": cid}
