"""The controller's watch decisions on live acceptance: drift trigger (to Airflow's REST API), cooldown, rollback.

The live figures come from a stubbed ``/admin/status``; tests/loop/test_loop.py takes the
same decisions from a real pool's counters (the rollback) end to end.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from settings.config import load_config


class FakeAirflow:
    """Airflow 3's ``POST /api/v2/dags/{dag}/dagRuns``, recording what it was sent."""

    def __init__(self, status: int = 200) -> None:
        self.requests: list[dict[str, Any]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": body})
                reply = json.dumps({"dag_run_id": f"manual__{len(outer.requests)}"} if status == 200
                                   else {"detail": "Not authenticated"}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def served(tiny_model, tmp_path):
    """A Production version benchmarked at mean acceptance length 2.0, and the config to watch it with."""
    from adapt.checkpoint import init_random_head
    from rollout.controller import BENCH_METRIC
    from rollout.registry import Registry, import_head

    def config(**controller: Any):
        return load_config(overrides={
            "state_dir": str(tmp_path), "target": {"model": str(tiny_model)}, "controller": controller,
            "mlflow": {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
                       "artifact_location": str(tmp_path / "artifacts"), "registered_model": "drafter-watch"}})

    cfg = config()
    head = init_random_head(tiny_model, tmp_path / "head", k=3, seed=0, draft_vocab_size=256)
    v = import_head(cfg, head)
    reg = Registry(cfg)
    reg.promote(v.version)
    reg.client.log_metric(v.run_id, BENCH_METRIC, 2.0)
    return config, v.version


def watching(cfg, version: str, live: float, drafts: float, **kw: Any):
    """A controller whose pool reports ``live`` mean acceptance length over ``drafts`` drafts (two replicas)."""
    from rollout.controller import Controller

    ctl = Controller(cfg, router_url="http://127.0.0.1:9", **kw)
    ctl.serving_version = version
    half = drafts / 2
    ctl.pool_status = lambda: {"replicas": [  # type: ignore[method-assign]
        {"url": f"r{i}", "healthy": True, "live_acceptance": {"drafts": half, "accepted_tokens": (live - 1) * half}}
        for i in range(2)]}
    return ctl


def test_controller_thresholds_come_from_config_and_must_be_ordered():
    cfg = load_config()
    c = cfg.controller
    assert (c.rollback_fraction, c.drift_fraction, c.drift_cooldown_s, c.min_live_drafts) == (0.7, 0.9, 21600, 50)
    with pytest.raises(ValueError, match="drift_fraction .* is below rollback_fraction"):
        load_config(overrides={"controller": {"rollback_fraction": 0.8, "drift_fraction": 0.75}})


def test_drift_triggers_the_nightly_dag_through_airflows_api_once_per_cooldown(served, monkeypatch):
    from rollout.controller import NIGHTLY_DAG

    config, version = served
    airflow = FakeAirflow()
    monkeypatch.setenv("ADAPT_AIRFLOW_URL", airflow.url + "/")
    monkeypatch.setenv("ADAPT_AIRFLOW_TOKEN", "airflow-jwt")
    try:
        ctl = watching(config(), version, live=1.6, drafts=80)  # 0.8 of the benchmarked 2.0
        ev = ctl.watch()
        assert ev is not None and ev["event"] == "drift_trigger", ev
        assert ev["version"] == version and ev["ratio"] == pytest.approx(0.8) and ev["result"] == "manual__1"
        [req] = airflow.requests
        assert req["path"] == f"/api/v2/dags/{NIGHTLY_DAG}/dagRuns" and req["auth"] == "Bearer airflow-jwt"
        assert req["body"]["conf"]["reason"] == "live acceptance drift" and req["body"]["conf"]["live"] == 1.6
        assert req["body"]["logical_date"]
        assert ctl.watch() is None and len(airflow.requests) == 1  # inside the cooldown: nothing more

        again = watching(config(drift_cooldown_s=0), version, live=1.6, drafts=80)
        assert again.watch()["event"] == again.watch()["event"] == "drift_trigger"
        assert len(airflow.requests) == 3
    finally:
        airflow.close()


def test_no_decision_on_too_few_drafts_or_within_the_drift_band(served, monkeypatch):
    config, version = served
    monkeypatch.delenv("ADAPT_AIRFLOW_URL", raising=False)
    assert watching(config(), version, live=1.0, drafts=40).watch() is None  # below min_live_drafts: no verdict
    assert watching(config(min_live_drafts=30), version, live=1.9, drafts=40).watch() is None  # 0.95 ≥ 0.9
    # Without ADAPT_AIRFLOW_URL the drift is still reported, with nothing triggered.
    ev = watching(config(min_live_drafts=30), version, live=1.7, drafts=40).watch()
    assert ev["event"] == "drift_trigger" and ev["result"] is None


def test_a_failing_trigger_is_reported_and_the_watch_goes_on(served, monkeypatch):
    config, version = served
    airflow = FakeAirflow(status=401)
    monkeypatch.setenv("ADAPT_AIRFLOW_URL", airflow.url)
    monkeypatch.delenv("ADAPT_AIRFLOW_TOKEN", raising=False)
    try:
        ev = watching(config(), version, live=1.6, drafts=80).watch()
        assert ev["event"] == "drift_trigger" and ev["result"].startswith("trigger failed:") and "401" in ev["result"]
        assert airflow.requests[0]["auth"] is None  # no token configured: none sent
    finally:
        airflow.close()


def test_a_drop_below_the_rollback_fraction_without_a_previous_version_says_so_once(served, monkeypatch):
    config, version = served
    monkeypatch.delenv("ADAPT_AIRFLOW_URL", raising=False)
    ctl = watching(config(), version, live=1.2, drafts=80)  # 0.6 < 0.7
    ev = ctl.watch()
    assert ev["event"] == "rollback_impossible" and ev["version"] == version
    assert "no previous Production version" in ev["reason"]
    # Once per version; the drop still asks for adaptation.
    assert ctl.watch()["event"] == "drift_trigger" and ctl.watch() is None
    assert [e["event"] for e in ctl.events] == ["rollback_impossible", "drift_trigger"]
