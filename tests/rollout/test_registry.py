"""The registry: the champion alias, the previous one and the Production stage kept together, rollback by
alias, the record of a benchmark against no speculation, and what `adapt pool status` says of it; and the
MLflow server the tests start keeps its artifacts in S3, as a deployed registry does."""

from __future__ import annotations

import json
import warnings

import pytest

from settings.config import dump_toml, load_config
from tests.config_support import make_cfg


@pytest.fixture(scope="module")
def registry_db(tiny_model, tmp_path_factory):
    """One sqlite registry for the module (creating one costs seconds) and two heads; each test registers
    its own model name in it."""
    from adapt.checkpoint import init_random_head

    d = tmp_path_factory.mktemp("registry")
    return d, [init_random_head(tiny_model, d / f"head{i}", k=3, seed=i, draft_vocab_size=256) for i in range(3)]


@pytest.fixture()
def cfg(registry_db, tiny_model, tmp_path, request):
    db, _ = registry_db
    name = "drafter-" + request.node.name[5:45].replace("_", "-")
    return make_cfg(tmp_path, state_dir=tmp_path, target={"model": str(tiny_model)},
                    mlflow={"tracking_uri": f"sqlite:///{db / 'mlflow.db'}", "artifact_location": str(db / "artifacts"),
                            "registered_model": name})


def versions(cfg, heads) -> list[str]:
    from rollout.registry import import_head

    return [str(import_head(cfg, h).version) for h in heads]


def test_mlflow_server_stores_artifacts_in_s3(mlflow_server, s3_server, tmp_path):
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=mlflow_server.tracking_uri)
    exp = client.create_experiment("foundation-smoke")
    run = client.create_run(exp)
    client.log_metric(run.info.run_id, "acceptance_length", 2.5)
    f = tmp_path / "note.txt"
    f.write_text("artifact")
    client.log_artifact(run.info.run_id, str(f))
    assert client.get_run(run.info.run_id).data.metrics["acceptance_length"] == 2.5
    objs = s3_server.client().list_objects_v2(Bucket=s3_server.bucket, Prefix="mlflow-artifacts/")
    assert any(o["Key"].endswith("note.txt") for o in objs.get("Contents", []))


def test_promotion_moves_alias_and_stage_and_keeps_the_previous_champion(cfg, registry_db):
    from rollout.registry import PREVIOUS_ALIAS, T_PREVIOUS, Registry

    v1, v2, v3 = versions(cfg, registry_db[1])
    reg = Registry(cfg)
    assert reg.champion() is None and reg.sync() is None and reg.aliases() == {}
    assert reg.promote(v1) == {"version": v1, "previous": None}
    assert reg.aliases() == {"champion": v1} and reg.stage_version() == v1
    assert reg.promote(v2) == {"version": v2, "previous": v1}
    assert reg.aliases() == {"champion": v2, PREVIOUS_ALIAS: v1} and reg.stage_version() == v2
    assert reg.get(v1).current_stage == "Archived" and reg.get(v2).tags[T_PREVIOUS] == v1
    assert str(reg.champion().version) == v2 and reg.previous_production(v2) == v1
    listed = {d["version"]: d["aliases"] for d in reg.describe_all()}
    assert {str(k): v for k, v in listed.items()} == {v1: [PREVIOUS_ALIAS], v2: ["champion"], v3: []}
    # Both moved by hand since the last sync, to different versions: the alias (MLflow 3's way) wins.
    reg.client.set_registered_model_alias(reg.name, "champion", v3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        reg.client.transition_model_version_stage(reg.name, v1, "Production", archive_existing_versions=True)
    assert str(reg.champion().version) == v3  # read-only: nothing moved yet
    assert reg.stage_version() == v1
    moved = reg.sync()
    assert moved["decided_by"] == "alias" and moved["version"] == v3 and moved["previous"] == v2
    assert reg.stage_version() == v3 and reg.aliases() == {"champion": v3, PREVIOUS_ALIAS: v2}
    assert reg.sync() is None


def test_adapt_rollback_moves_the_champion_back_to_the_previous_one_or_to_n(cfg, registry_db, tmp_path):
    from typer.testing import CliRunner

    from app.cli import app
    from rollout.registry import Registry

    v1, v2 = versions(cfg, registry_db[1][:2])
    f = tmp_path / "c.toml"
    f.write_text(dump_toml(cfg))
    runner = CliRunner()
    r = runner.invoke(app, ["rollback", "--config", str(f), "--json"])
    assert r.exit_code == 1 and "has no 'previous' version to roll back to" in json.loads(r.stdout)["error"]
    reg = Registry(cfg)
    reg.promote(v1)
    reg.promote(v2)
    r = runner.invoke(app, ["rollback", "--config", str(f), "--json"])
    out = json.loads(r.stdout)
    assert r.exit_code == 0 and (out["production"], out["previous"], out["alias"]) == (v1, v2, v1), r.output
    assert reg.aliases() == {"champion": v1, "previous": v2} and reg.stage_version() == v1
    r = runner.invoke(app, ["rollback", "--to", "99", "--config", str(f), "--json"])
    err = json.loads(r.stdout)["error"]
    assert r.exit_code == 1 and err == f"no version 99 of {reg.name} in the registry at {cfg.mlflow.tracking_uri}"
    r = runner.invoke(app, ["registry", "list", "--config", str(f), "--json"])
    listed = json.loads(r.stdout)
    assert (listed["champion"], listed["previous"], str(listed["production"])) == (v1, v2, v1)


def test_pool_status_says_plainly_when_production_is_slower_than_no_speculation(cfg, registry_db):
    from app.commands.serving import _production_warnings
    from rollout.registry import T_SPEEDUP, Registry, import_head, slower_than_nospec, speedups

    assert _production_warnings(cfg) == []  # nothing in Production: nothing to say
    reg = Registry(cfg)
    v = import_head(cfg, registry_db[1][0])
    reg.promote(v.version)
    assert _production_warnings(cfg) == []  # never benchmarked against no speculation
    reg.client.set_model_version_tag(reg.name, v.version, T_SPEEDUP, json.dumps({"1": 1.31, "4": 0.93}))
    warnings = _production_warnings(cfg)
    assert len(warnings) == 1
    assert f"version {v.version} was measured slower than serving without speculation at concurrency 4 (0.93x)" \
        in warnings[0]
    assert speedups(reg.get(v.version).tags) == {1: 1.31, 4: 0.93}
    assert slower_than_nospec("7", {T_SPEEDUP: json.dumps({"1": 1.2})}) == []


def test_pool_status_survives_an_unreachable_registry(tmp_path):
    from app.commands.serving import _production_warnings

    cfg = load_config(overrides={"state_dir": str(tmp_path),
                                 "mlflow": {"tracking_uri": "http://127.0.0.1:9", "artifact_location": "",
                                            "registered_model": "x"}})
    import os

    os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"
    try:
        w = _production_warnings(cfg)
    finally:
        os.environ.pop("MLFLOW_HTTP_REQUEST_MAX_RETRIES")
    assert len(w) == 1 and w[0].startswith("registry unreachable")


def person_moves_stage_after_first_read(reg, version):
    """Make ``reg``'s first stage read be followed at once by a person moving ``version`` to Production (as
    in the MLflow UI); returns the unpatched stage reader."""
    read_stage, calls = reg.stage_version, []

    def stage_then_person_moves():
        seen = read_stage()
        if not calls:  # the person's click lands just after the first read
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                reg.client.transition_model_version_stage(reg.name, version, "Production",
                                                          archive_existing_versions=True)
        calls.append(seen)
        return seen

    reg.stage_version = stage_then_person_moves
    return read_stage


def test_a_move_by_hand_during_a_sync_is_never_undone(cfg, registry_db):
    """A person moves the stage while the controller syncs, right after it read the registry: the sync
    decides on that one read (nothing to do) and leaves the move for the next sync, which follows it."""
    from rollout.registry import Registry

    v1, v2, _ = versions(cfg, registry_db[1])
    reg = Registry(cfg)
    reg.promote(v1)
    read_stage = person_moves_stage_after_first_read(reg, v2)
    assert reg.sync() is None  # it saw the agreed state, and wrote nothing
    assert read_stage() == v2  # the person's move stands
    moved = reg.sync()
    assert moved["alias"] == {"from": v1, "to": v2} and moved["decided_by"] == "stage"
    assert str(reg.champion().version) == v2 and reg.alias_version() == v2


def test_the_champion_that_serves_is_the_one_the_sync_decided(cfg, registry_db):
    """A stage moved by hand just after the sync's read is not served on a later read before the alias
    follows it: otherwise the pool could serve v2 while the alias still names v1, and a person who then
    moves the alias back to v1 changes nothing, and the next sync takes the pool to v2 for good."""
    from rollout.registry import Registry

    v1, v2, _ = versions(cfg, registry_db[1])
    reg = Registry(cfg)
    reg.promote(v1)
    person_moves_stage_after_first_read(reg, v2)
    assert reg.sync_champion() == (v1, None)  # what it read: serve v1 this pass
    assert str(reg.champion().version) == v2  # a read after the move would have said v2, alias still on v1
    assert reg.sync_champion() == (v2, {"alias": {"from": v1, "to": v2}, "previous": v1, "version": v2,
                                        "decided_by": "stage"})
    assert reg.alias_version() == v2  # the pool follows v2 only now, with the alias: moving it back is a move


def test_a_registry_without_stages_keeps_the_champion_by_aliases_alone(cfg, registry_db, tmp_path):
    """Unity Catalog has no stages: with stages off (detected from its registry URI, or set), promotion, a
    sync after a move by hand and the rollback command move the aliases only, and never call a stage API."""
    from typer.testing import CliRunner

    from app.cli import app
    from rollout.registry import PREVIOUS_ALIAS, Registry

    assert not cfg.mlflow.model_copy(update={"registry_uri": "databricks-uc"}).use_stages()
    assert not cfg.mlflow.model_copy(update={"registry_uri": "databricks-uc://profile"}).use_stages()
    assert cfg.mlflow.use_stages() and not cfg.mlflow.model_copy(update={"stages": "off"}).use_stages()
    cfg = cfg.model_copy(update={"mlflow": cfg.mlflow.model_copy(update={"stages": "off"})})
    v1, v2, v3 = versions(cfg, registry_db[1])
    reg = Registry(cfg)
    assert not reg.stages

    def no_stages(*a, **k):
        raise AssertionError("a stage API was called on a registry without stages")

    reg.client.transition_model_version_stage = no_stages
    reg.client.get_latest_versions = no_stages
    assert reg.promote(v1) == {"version": v1, "previous": None}
    assert reg.promote(v2) == {"version": v2, "previous": v1}
    assert reg.aliases() == {"champion": v2, PREVIOUS_ALIAS: v1} and reg.stage_version() is None
    assert reg.get(v2).current_stage == "None" and str(reg.champion().version) == v2
    assert {d["stage"] for d in reg.describe_all()} == {None}
    # A person moves the alias back (a rollback by hand): the sync follows it and records where it came from.
    reg.client.set_registered_model_alias(reg.name, "champion", v3)
    moved = reg.sync()
    assert moved == {"previous": v2, "version": v3, "decided_by": "alias"}
    assert reg.aliases() == {"champion": v3, PREVIOUS_ALIAS: v2} and reg.sync() is None
    # `adapt rollback` with stages off: the alias alone.
    f = tmp_path / "c.toml"
    f.write_text(dump_toml(cfg))
    r = CliRunner().invoke(app, ["rollback", "--config", str(f), "--json"])
    out = json.loads(r.stdout)
    assert r.exit_code == 0 and (out["production"], out["previous"], out["stages"]) == (v2, v3, False), r.output
    assert Registry(cfg).aliases() == {"champion": v2, PREVIOUS_ALIAS: v3}
    assert Registry(cfg).get(v2).current_stage == "None"
    r = CliRunner().invoke(app, ["registry", "list", "--config", str(f)])
    assert r.exit_code == 0 and f"v{v2:>3} -" in r.stdout, r.output


def test_the_registry_uri_is_honoured_apart_from_the_tracking_server(cfg, registry_db, tmp_path, monkeypatch):
    """MLFLOW_REGISTRY_URI (or [mlflow].registry_uri) names the registry: versions are registered there, the
    candidate runs stay on the tracking server, and models:/ heads resolve from the registry."""
    import mlflow

    from headspec.resolve import resolve_head
    from rollout.registry import Registry

    other = f"sqlite:///{tmp_path / 'registry.db'}"
    monkeypatch.setenv("MLFLOW_REGISTRY_URI", other)
    c = load_config(overrides={"state_dir": str(tmp_path), "target": cfg.target.model_dump(),
                               "mlflow": {"tracking_uri": cfg.mlflow.tracking_uri,
                                          "artifact_location": cfg.mlflow.artifact_location,
                                          "registered_model": cfg.mlflow.registered_model}})
    assert c.mlflow.registry_uri == other and c.mlflow.resolved_registry_uri() == other
    (v1,) = versions(c, registry_db[1][:1])
    reg = Registry(c)
    assert reg.registry_uri == other and reg.tracking_uri == cfg.mlflow.tracking_uri
    assert [str(v.version) for v in mlflow.MlflowClient(other, other).search_model_versions(
        f"name = '{reg.name}'")] == [v1]
    tracking_only = mlflow.MlflowClient(cfg.mlflow.tracking_uri, cfg.mlflow.tracking_uri)
    assert tracking_only.search_model_versions(f"name = '{reg.name}'") == []
    assert tracking_only.get_run(reg.get(v1).run_id)  # the run is on the tracking server
    # models:/ resolves from the registry (the file's setting too, without the variable).
    monkeypatch.delenv("MLFLOW_REGISTRY_URI")
    got, version = resolve_head(f"models:/{reg.name}/{v1}", tmp_path / "dl", cfg.mlflow.tracking_uri,
                                registry_uri=other)
    assert version == v1 and (got / "config.json").is_file()
