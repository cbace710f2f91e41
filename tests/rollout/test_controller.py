"""The controller's watch decisions on live acceptance: drift trigger (to Airflow's REST API), cooldown, rollback.

The live figures come from a stubbed ``/admin/status``; tests/loop/test_loop.py takes the
same decisions from a real pool's counters (the rollback) end to end.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from settings.config import load_config
from tests.services import JsonHTTPServer


def jwt(exp: float, n: int) -> str:
    """An unsigned JWT with an ``exp`` claim (the client reads it, never verifies it)."""
    import base64

    def b64(obj: dict) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).decode().rstrip("=")

    return f"{b64({'alg': 'HS512'})}.{b64({'sub': 'adapt', 'exp': exp, 'n': n})}.sig"


class FakeAirflow(JsonHTTPServer):
    """Airflow 3's ``POST /api/v2/dags/{dag}/dagRuns`` (and ``POST /auth/token`` for ``user``/``pw``, issuing
    JWTs valid ``token_ttl`` seconds), recording what it was sent. ``status`` answers every trigger; with
    ``statuses``, the triggers take them in turn."""

    def __init__(self, status: int = 200, statuses: list[int] | None = None, token_ttl: float = 3600) -> None:
        self.requests: list[dict[str, Any]] = []
        self.issued: list[str] = []
        self.status, self.statuses, self.token_ttl = status, list(statuses or []), token_ttl
        super().__init__()

    def handle(self, path: str, headers, body) -> tuple[int, dict]:
        if path == "/auth/token":
            ok = body == {"username": "user", "password": "pw"}
            if ok:
                import time

                self.issued.append(jwt(time.time() + self.token_ttl, len(self.issued)))
            return (201, {"access_token": self.issued[-1]}) if ok else (401, {"detail": "Invalid credentials"})
        self.requests.append({"path": path, "auth": headers.get("Authorization"), "body": body})
        code = self.statuses.pop(0) if self.statuses else self.status
        if self.issued and headers.get("Authorization") != f"Bearer {self.issued[-1]}":
            code = 401  # a stale token
        return code, ({"dag_run_id": f"manual__{len(self.requests)}"} if code == 200
                      else {"detail": "Not authenticated" if code == 401 else "Service Unavailable"})


@pytest.fixture(scope="module")
def registry_db(tiny_model, tmp_path_factory):
    """One sqlite registry for the module (creating one costs seconds) and a head to register; each test
    registers its own model name in it."""
    from adapt.checkpoint import init_random_head

    d = tmp_path_factory.mktemp("registry")
    return d, init_random_head(tiny_model, d / "head", k=3, seed=0, draft_vocab_size=256)


@pytest.fixture()
def served(tiny_model, tmp_path, registry_db, request):
    """A champion benchmarked at mean acceptance length 2.0, and the config to watch it with."""
    from rollout.controller import BENCH_METRIC
    from rollout.registry import Registry, import_head

    db, head = registry_db
    name = "drafter-" + request.node.name[:40].replace("_", "-")

    def config(**controller: Any):
        return load_config(overrides={
            "state_dir": str(tmp_path), "target": {"model": str(tiny_model)}, "controller": controller,
            "mlflow": {"tracking_uri": f"sqlite:///{db / 'mlflow.db'}",
                       "artifact_location": str(db / "artifacts"), "registered_model": name}})

    cfg = config()
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


def airflow_config(config, **airflow: Any):
    """``config()`` with ``[airflow]`` keys set (the trigger reads them when the controller is built)."""
    cfg = config()
    return cfg.model_copy(update={"airflow": cfg.airflow.model_copy(update=airflow)})


def test_the_trigger_trades_credentials_for_a_jwt_keeps_it_and_renews_it(served, monkeypatch):
    import time

    from rollout.airflow import jwt_expiry

    config, version = served
    airflow = FakeAirflow()
    monkeypatch.setenv("ADAPT_AIRFLOW_USERNAME", "user")
    monkeypatch.setenv("ADAPT_AIRFLOW_PASSWORD", "pw")
    monkeypatch.delenv("ADAPT_AIRFLOW_TOKEN", raising=False)
    try:
        ctl = watching(airflow_config(config, url=airflow.url), version, live=1.6, drafts=80)
        ctl.trigger_cooldown_s = 0
        assert ctl.watch()["result"] == "manual__1" and ctl.watch()["result"] == "manual__2"
        assert len(airflow.issued) == 1  # one token, kept while it is valid
        assert [r["auth"] for r in airflow.requests] == [f"Bearer {airflow.issued[0]}"] * 2
        airflow.issued.append(jwt(time.time() + 3600, 99))  # the server no longer takes the kept one
        assert ctl.watch()["result"] == "manual__4"  # refused once (401), renewed, sent again
        assert len(airflow.issued) == 3 and airflow.requests[-1]["auth"] == f"Bearer {airflow.issued[-1]}"
        # A token within a minute of its expiry is renewed before it is used.
        client = ctl.trigger.client
        client._expires = time.time() + 30
        ctl.watch()
        assert len(airflow.issued) == 4 and jwt_expiry(airflow.issued[-1]) > time.time() + 3000
        # Wrong credentials: a clear error naming the user and the server, never the password.
        monkeypatch.setenv("ADAPT_AIRFLOW_PASSWORD", "wrong")
        ev = watching(airflow_config(config, url=airflow.url), version, live=1.6, drafts=80).watch()
        assert f"POST {airflow.url}/auth/token refused the credentials of 'user': 401" in ev["result"]
        assert "wrong" not in ev["result"]
    finally:
        airflow.close()


def test_an_airflow_connection_names_the_server_and_the_credentials():
    from rollout.airflow import AirflowError, connection_endpoint, endpoint_from_config
    from settings.config import AirflowConfig

    env = {"AIRFLOW_CONN_ADAPT_API": "https://adapt%40corp:p%2Fw@airflow.example:8443"}
    e = connection_endpoint("adapt_api", env)
    assert (e.url, e.username, e.password) == ("https://airflow.example:8443", "adapt@corp", "p/w")
    assert "p/w" not in repr(e)
    env = {"AIRFLOW_CONN_ADAPT_API": json.dumps({"conn_type": "http", "host": "airflow-apiserver", "port": 8080,
                                                 "login": "adapt", "password": "pw", "schema": "http"})}
    e = endpoint_from_config(AirflowConfig(connection="adapt_api"), env)
    assert (e.url, e.username, e.password) == ("http://airflow-apiserver:8080", "adapt", "pw")
    with pytest.raises(AirflowError, match="AIRFLOW_CONN_NOPE is not set"):
        connection_endpoint("nope", {})


def test_a_failed_trigger_is_retried_and_a_trigger_that_gives_up_stays_in_the_health_report(served, monkeypatch):
    config, version = served
    monkeypatch.delenv("ADAPT_AIRFLOW_USERNAME", raising=False)
    monkeypatch.delenv("ADAPT_AIRFLOW_TOKEN", raising=False)
    flaky = FakeAirflow(statuses=[503, 503, 200])
    try:
        ctl = watching(airflow_config(config, url=flaky.url, trigger_attempts=3, trigger_retry_s=0), version,
                       live=1.6, drafts=80)
        ev = ctl.watch()
        assert ev["result"].startswith("trigger failed: AirflowError: POST ") and "503" in ev["result"]
        assert "(attempt 1 of 3; again in 0 s)" in ev["result"]
        h = ctl.health()
        assert h["drift_trigger"]["state"] == "retrying" and "retrying after 1 of 3 attempts" in h["warnings"][0]
        ctl.retry_trigger()
        ctl.retry_trigger()
        assert len(flaky.requests) == 3 and ctl.health()["drift_trigger"] | {"ts": 0} == {
            "state": "ok", "attempts": 3, "dag_run_id": "manual__3", "ts": 0, "version": version}
        assert ctl.health()["warnings"] == []
        assert [e["event"] for e in ctl.events] == ["drift_trigger_failed", "drift_trigger", "drift_trigger_failed",
                                                    "drift_trigger_retried"]
    finally:
        flaky.close()
    down = FakeAirflow(status=503)
    try:
        ctl = watching(airflow_config(config, url=down.url, trigger_attempts=2, trigger_retry_s=0), version,
                       live=1.6, drafts=80)
        ctl.watch()
        ctl.retry_trigger()
        gave_up = [e for e in ctl.events if e["event"] == "drift_trigger_gave_up"]
        assert len(gave_up) == 1 and gave_up[0]["level"] == "error" and "503" in gave_up[0]["error"]
        h = ctl.health()
        assert h["drift_trigger"]["state"] == "failed" and "failed after 2 of 2 attempts" in h["warnings"][0]
        ctl.retry_trigger()
        assert len(down.requests) == 2  # given up: no more tries until the next drift
    finally:
        down.close()


def test_the_controller_follows_the_champion_alias_moved_back_as_it_follows_a_stage(served, tiny_model, monkeypatch):
    """A person moves ``champion`` back in the MLflow UI (or a version to Production): the controller brings the
    other one along, keeps ``previous``, and swaps the pool."""
    from adapt.checkpoint import init_random_head
    from rollout.controller import Controller
    from rollout.registry import PREVIOUS_ALIAS, T_PREVIOUS, T_SHA, Registry, import_head

    monkeypatch.delenv("ADAPT_AIRFLOW_URL", raising=False)
    config, v1 = served
    cfg = config()
    reg = Registry(cfg)
    v2 = import_head(cfg, init_random_head(tiny_model, tiny_model.parent / "follow-alias-head", k=3, seed=5,
                                           draft_vocab_size=256)).version
    sha = {v: reg.get(v).tags[T_SHA] for v in (v1, v2)}
    assert reg.promote(v2) == {"version": str(v2), "previous": str(v1)}  # the registry speaks versions as str
    assert reg.alias_version() == str(v2) and reg.alias_version(PREVIOUS_ALIAS) == str(v1)

    served_sha = {"now": sha[v1]}
    ctl = Controller(cfg, router_url="http://127.0.0.1:9")
    ctl.pool_status = lambda: {"replicas": [{"url": "r0", "healthy": True, "head_sha256": served_sha["now"]}]}
    swaps = []

    checked = []

    def swap(version, served_before=False):
        swaps.append(version)
        checked.append(served_before)
        served_sha["now"] = sha[version]
        return {"ok": True, "mode": "inplace"}

    ctl._swap = swap
    assert ctl.reconcile()["event"] == "swapped" and swaps == [v2]

    reg.client.set_registered_model_alias(reg.name, "champion", v1)  # the UI's alias edit
    ev = ctl.reconcile()
    assert ev["event"] == "swapped" and ev["version"] == v1 and swaps == [v2, v1]
    synced = [e for e in ctl.events if e["event"] == "registry_synced"][-1]
    assert synced["decided_by"] == "alias" and synced["stage"] == {"from": str(v2), "to": str(v1)}
    assert reg.get(v1).current_stage == "Production" and reg.get(v2).current_stage == "Archived"
    assert reg.alias_version(PREVIOUS_ALIAS) == str(v2) and reg.get(v1).tags[T_PREVIOUS] == str(v2)
    assert ctl.reconcile()["event"] == "in_sync"

    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        reg.client.transition_model_version_stage(reg.name, v2, "Production", archive_existing_versions=True)
    assert ctl.reconcile()["version"] == v2 and swaps == [v2, v1, v2]
    # Going back to a version that served is a rollback: the swap skips the smoke prompts' acceptance
    # comparison (heads for different traffic accept differently on them); the first swaps to each do not.
    assert checked == [False, False, True] and reg.get(v2).tags["adapt.served"] == "true"
    assert reg.alias_version() == str(v2) and reg.alias_version(PREVIOUS_ALIAS) == str(v1)
    assert [e["decided_by"] for e in ctl.events if e["event"] == "registry_synced"] == ["alias", "stage"]

    # A stage moved just after a pass's sync read it: that pass serves what its sync decided, and the pool
    # follows the move only once the alias names it too, so moving the alias back is a real move.
    read_stage, moved_by_hand = ctl.registry.stage_version, []

    def stage_then_person_moves():
        seen = read_stage()
        if not moved_by_hand:
            moved_by_hand.append(True)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                reg.client.transition_model_version_stage(reg.name, v1, "Production", archive_existing_versions=True)
        return seen

    ctl.registry.stage_version = stage_then_person_moves
    alias_at_swap = []
    ctl._swap = lambda version, served_before=False: (alias_at_swap.append(reg.alias_version()), swap(version))[1]
    assert ctl.reconcile()["event"] == "in_sync" and swaps == [v2, v1, v2]
    assert ctl.reconcile()["version"] == v1 and swaps == [v2, v1, v2, v1] and alias_at_swap == [str(v1)]
