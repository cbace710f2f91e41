"""The DAG files import cleanly and wire exactly the cycle's steps, one pair of DAGs per configured endpoint
with each task's timeout, queue and pool from its config, and a failed task is announced (no services; a
subprocess keeps Airflow's home and config out of the test process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.paths import REPO_ROOT
from tests.services import JsonHTTPServer

PROBE = r"""
import json, os, sys
from airflow.dag_processing.dagbag import DagBag
def bag():
  b = DagBag("dags")
  out = {"errors": {k: str(v) for k, v in b.import_errors.items()}, "dags": {}}
  for dag_id, d in b.dags.items():
    out["dags"][dag_id] = {
        "tasks": [t.task_id for t in d.topological_sort()] if hasattr(d, "topological_sort") else sorted(d.task_ids),
        "upstream": {t.task_id: sorted(t.upstream_task_ids) for t in d.tasks},
        "catchup": d.catchup, "max_active_runs": d.max_active_runs,
        "schedule": str(d.schedule), "retries": {t.task_id: t.retries for t in d.tasks},
        "params": sorted(d.params.keys()),
        "config_param": d.params.get_param("config").value if "config" in d.params else None,
        "queues": {t.task_id: t.queue for t in d.tasks}, "pools": {t.task_id: t.pool for t in d.tasks},
        "callbacks": {t.task_id: bool(t.on_failure_callback) for t in d.tasks},
        "timeouts": {t.task_id: t.execution_timeout.total_seconds() if t.execution_timeout else None
                     for t in d.tasks},
        "outlets": {t.task_id: [getattr(o, "uri", str(o)) for o in (t.outlets or [])] for t in d.tasks},
    }
  return out
outs = []
for config in json.loads(sys.argv[1]):  # one DagBag per ADAPT_CONFIG: the DAG files read it when parsed
  if config:
    os.environ["ADAPT_CONFIG"] = config
  outs.append(bag())
print("JSON" + json.dumps(outs))
"""


def airflow_env(home: Path, **extra: str) -> dict:
    """The environment of an Airflow process with its home in ``home`` (and no ADAPT_CONFIG but ``extra``'s)."""
    env = {k: v for k, v in os.environ.items() if k != "ADAPT_CONFIG"}
    return {**env, "AIRFLOW_HOME": str(home), "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}", "PYTHONPATH": str(REPO_ROOT),
            **extra}


def probe(tmp_path: Path, *configs: str | None, **extra: str) -> list[dict]:
    """The DAGs (and import errors) the DAG folder yields under each ADAPT_CONFIG of ``configs``, in one process."""
    env = airflow_env(tmp_path, **extra)
    p = subprocess.run([sys.executable, "-c", PROBE, json.dumps(list(configs) or [None])], cwd=REPO_ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("JSON")][-1]
    return json.loads(line[4:])


def test_dags_import_and_wire_the_cycle_steps(tmp_path: Path):
    from loop.airflow_tasks import OPTION_KEYS
    from loop.cycle import STEPS

    [out] = probe(tmp_path)
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
    # Every task announces its failure; nothing routed away from Airflow's default queue and pool unless asked.
    assert all(c for d in out["dags"].values() for c in d["callbacks"].values())
    assert set(n["queues"].values()) == {"default"} and set(n["pools"].values()) == {"default_pool"}


def test_one_pair_of_dags_per_endpoint_with_its_own_timeouts_queues_and_pools(tmp_path: Path):
    """And a bad endpoint list is an import error naming the file at fault."""
    from loop.cycle import STEPS

    gpu = ('[airflow]\nname = "{name}"\nretries = 1\nschedule = "0 3 * * *"\nqueue = "cpu"\n'
           'step_queue = {{train = "gpu", evaluate = "gpu", bench = "gpu"}}\n'
           'step_pool = {{train = "gpu_slots", bench = "gpu_slots"}}\n'
           'step_timeout_minutes = {{train = 900}}\n')
    for name in ("chat", "code"):
        (tmp_path / f"{name}.toml").write_text(f'state_dir = "{tmp_path}/{name}"\n' + gpu.format(name=name))
    main = tmp_path / "main.toml"
    main.write_text(f'[airflow]\nendpoints = ["{tmp_path}/chat.toml", "{tmp_path}/code.toml"]\n')
    (tmp_path / "a.toml").write_text('[airflow]\nname = "same"\nstep_queue = {trian = "gpu"}\n')
    bad = tmp_path / "bad.toml"
    bad.write_text(f'[airflow]\nendpoints = ["{tmp_path}/a.toml"]\n')
    out, broken = probe(tmp_path, str(main), str(bad), ADAPT__AIRFLOW__STEP_POOL='{bench = "big_gpu_slots"}')
    assert broken["errors"] and all(f"{tmp_path}/a.toml: [airflow] step_queue names no task: trian" in e
                                    for e in broken["errors"].values())
    assert out["errors"] == {}
    assert set(out["dags"]) == {f"drafter_{kind}_{name}" for kind in ("nightly_adaptation", "reconcile")
                                for name in ("chat", "code")}
    for name in ("chat", "code"):
        n = out["dags"][f"drafter_nightly_adaptation_{name}"]
        assert n["config_param"] == str(tmp_path / f"{name}.toml") and n["schedule"] == "0 3 * * *"
        assert n["queues"] == {t: "gpu" if t in ("train", "evaluate", "bench") else "cpu"
                               for t in ["begin", *STEPS, "report"]}
        # ADAPT__AIRFLOW__STEP_POOL wins over every endpoint's file, key by key, as a file over the default.
        assert n["pools"]["train"] == "gpu_slots" and n["pools"]["bench"] == "big_gpu_slots"
        assert n["pools"]["gate"] == "default_pool"
        assert n["timeouts"]["train"] == 900 * 60 and n["timeouts"]["bench"] == 240 * 60  # the rest keep defaults
        assert set(n["retries"].values()) == {1}
        assert out["dags"][f"drafter_reconcile_{name}"]["queues"] == {"reconcile": "cpu"}


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


class Webhook(JsonHTTPServer):
    """A chat webhook on loopback that records what it is sent."""

    def __init__(self) -> None:
        self.posts: list[dict] = []
        super().__init__()
        self.url += "/hook"

    def handle(self, path: str, headers, body) -> tuple[int, None]:
        self.posts.append(body)
        return 200, None


def test_a_failed_step_under_dag_test_is_announced_and_recorded_in_the_cycle(tmp_path: Path, airflow_home: Path):
    """dag.test() runs an endpoint's nightly DAG for real; its ingest fails (the capture source does not exist), and
    the failure callback posts to the webhook and records the failure in the cycle's state. Nothing heavy runs."""
    from loop.airflow_tasks import cycle_id_for
    from loop.cycle import summary
    from settings.config import load_config

    hook = Webhook()
    cfg = tmp_path / "fail.toml"
    cfg.write_text(f'state_dir = "{tmp_path}/state"\n[capture]\nsource = "{tmp_path}/no-capture"\n'
                   '[airflow]\nname = "fail"\nretries = 0\n')
    code = ("import sys; from dags.drafter_nightly_adaptation import drafter_nightly_adaptation_fail as dag; "
            "dr = dag.test(); print('DAGRUN', dr.run_id, dr.state)")
    try:
        p = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                           env=airflow_env(airflow_home, ADAPT_CONFIG=str(cfg), ADAPT_FAILURE_WEBHOOK=hook.url,
                                           AIRFLOW__CORE__DAGS_FOLDER=str(REPO_ROOT / "dags")))
    finally:
        hook.close()
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("DAGRUN")]
    assert line, p.stdout[-3000:] + p.stderr[-3000:]
    _, run_id, state = line[-1].split(" ", 2)
    assert state.endswith("failed")
    [post] = hook.posts
    assert post["text"].startswith(f"drafter-adapt: drafter_nightly_adaptation_fail.ingest failed (run {run_id}")
    assert f"FileNotFoundError: capture source {tmp_path}/no-capture does not exist" in post["text"]
    out = summary(load_config(cfg), cycle_id_for({}, run_id))
    assert [(f["task_id"], f["error"].split(":")[0]) for f in out["failures"]] == [("ingest", "FileNotFoundError")]
    assert list(out["steps"]) == []  # the cycle resumes at ingest once the capture is there


def test_the_train_task_runs_torchrun_ranks_when_the_config_says_several_gpus(tmp_path, monkeypatch):
    """[training] gpus = 2: the DAG's train task (the cycle's train step) starts the step worker under the
    torchrun command `adapt train --gpus 2` uses, the config in the ranks' environment (they share no stdin);
    gpus = 1 trains in the task's own process. The ranks' DDP training itself is tested with 2 gloo ranks
    in tests/adapt/test_train.py; here only the wiring, with the launch faked."""
    from adapt.launch import torchrun_prefix
    from loop import airflow_tasks as at
    from loop import cycle
    from settings.config import Config

    launched: list[dict] = []
    real_popen = subprocess.Popen

    class FakeRanks:
        def __init__(self, cmd, stdin=None, env=None):
            launched.append({"cmd": cmd, "stdin": stdin, "env": env})
            Path(cmd[-1]).write_text(json.dumps({"steps": 3, "ranks": 2}))
            self.returncode = 0

        def communicate(self, data=None):
            launched[-1]["data"] = data
            return None, None

    def popen(cmd, *a, **kw):  # the step's launch is faked; anything else (git, MLflow) runs
        if "loop.step_worker" not in cmd:
            return real_popen(cmd, *a, **kw)
        return FakeRanks(cmd, kw.get("stdin"), kw.get("env"))

    class NoTracking:  # MLflow's store costs up to a minute to create on a loaded machine; not what is tested
        def __init__(self, *a):
            pass

        def __getattr__(self, name):
            return lambda *a, **kw: None

    monkeypatch.setattr(subprocess, "Popen", popen)
    monkeypatch.setattr(cycle.tracking, "CycleRun", NoTracking)
    monkeypatch.setattr(cycle.Cycle, "registry", None)
    monkeypatch.setattr(cycle, "STEPS", ("train",))
    monkeypatch.setattr(cycle, "train_here", lambda cx, state: {"steps": 1, "ranks": 1})
    cfg_file = tmp_path / "g2.toml"
    cfg_file.write_text(f'state_dir = "{tmp_path}/s"\n[training]\ngpus = 2\n')
    params = {"config": str(cfg_file)}
    cid = at.begin(params, "manual__gpus2")
    at.step("train", cid, params)
    assert at.load_state(at.config(params), cid)["steps"]["train"]["ranks"] == 2
    [run] = launched
    out_json = str(Path(run["cmd"][-1]))
    assert run["cmd"] == torchrun_prefix(2) + ["-m", "loop.step_worker", "train", "af-manual__gpus2", out_json]
    assert run["stdin"] == subprocess.DEVNULL and run["data"] is None
    assert Config.model_validate_json(run["env"][cycle.CONFIG_ENV]).training.gpus == 2
    one = at.config(params)
    one.training.gpus = 1
    assert cycle.step_train(cycle.Cycle(one), {}, cycle.CycleOptions())["ranks"] == 1 and len(launched) == 1


def test_the_step_worker_reads_its_config_from_the_environment_and_only_rank_0_answers(tmp_path, monkeypatch):
    from loop import cycle, step_worker
    from settings.config import load_config

    cfg = load_config(overrides={"state_dir": str(tmp_path)})
    cx = cycle.Cycle(cfg)
    state = cx.load_state("c1")
    cx.save_state(state)
    seen = []
    monkeypatch.setitem(cycle.IN_PROCESS, "train", lambda cx, st: seen.append(cx.cfg.state_dir) or {"ok": 1})
    monkeypatch.setattr(step_worker, "die_with_parent", lambda: None)
    for rank in ("1", "0"):
        monkeypatch.setenv(cycle.CONFIG_ENV, cfg.model_dump_json())
        monkeypatch.setenv("RANK", rank)
        out = tmp_path / f"out{rank}.json"
        assert step_worker.main(["train", "c1", str(out)]) == 0
        assert out.is_file() == (rank == "0")
    assert seen == [cfg.state_dir] * 2 and json.loads((tmp_path / "out0.json").read_text()) == {"ok": 1}


def test_the_train_step_under_torchrun_starts_its_ranks_and_says_why_they_failed(tmp_path):
    """The real launch (2 gloo ranks, about 10 s): each rank reads the config from its environment and the
    cycle from the store; here they fail (no snapshot yet) and the step's error names why, not only
    torchrun's summary; the config's secret is nowhere on disk."""
    from loop import cycle
    from tests.config_support import make_cfg

    cx = cycle.Cycle(make_cfg(tmp_path, serving={"admin_token": "a-secret-token-of-the-pool"},
                              training={"gpus": 2, "device": "cpu"}))
    state = cx.load_state("c1")
    cx.save_state(state)
    try:
        cycle.step_train(cx, state, cycle.CycleOptions())
        raise AssertionError("the ranks trained without a snapshot")
    except cycle.CycleError as exc:
        msg = str(exc)
    assert "exited with code 1" in msg and "step 'snapshot' has not run in cycle c1" in msg.splitlines()[1]
    log = (cx.dir("c1") / "train.log").read_text()
    # Both ranks started (torchrun's summary names rank 1 whether it failed on its own or was stopped
    # when rank 0 failed first, before writing its error: which one wins is a race).
    assert "step 'snapshot' has not run in cycle c1" in log and "local_rank: 1" in log
    assert not any("a-secret-token-of-the-pool" in p.read_text(errors="replace")
                   for p in cx.dir("c1").rglob("*") if p.is_file())
