"""The configuration's layers (embedded default, MLFLOW_TRACKING_URI, file, ADAPT__SECTION__KEY, overrides)
and the errors a user sees for a bad value: the key, the value and where it came from."""

from __future__ import annotations

import pytest

from settings.config import ConfigError, dump_toml, env_overrides, load_config


@pytest.fixture()
def env(monkeypatch, tmp_path):
    """A clean environment with the state under tmp_path; returns monkeypatch.setenv."""
    monkeypatch.delenv("ADAPT_CONFIG", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("ADAPT_STATE_DIR", str(tmp_path / "state"))
    return monkeypatch.setenv


def write(tmp_path, text: str):
    f = tmp_path / "adapt.toml"
    f.write_text(text)
    return f


def test_every_key_can_be_set_from_the_environment_typed(env, tmp_path):
    env("ADAPT__SERVING__REPLICAS", "3")
    env("ADAPT__BENCH__CONCURRENCIES", "[1, 8]")
    env("ADAPT__SERVING__VLLM_ARGS", '["--tensor-parallel-size", "2"]')
    env("ADAPT__SERVING__NUM_SPECULATIVE_TOKENS_PER_BATCH_SIZE", "[[1, 8, 3], [9, 64, 0]]")
    env("ADAPT__BENCH__NOSPEC_REFERENCE", "true")
    env("ADAPT__GATE__CONFIDENCE", "0.95")
    env("ADAPT__SERVING__CPU_RESERVED_CORES", "")  # an optional key: empty means unset
    env("ADAPT__CACHE_DIR", str(tmp_path / "cache"))
    env("ADAPT__HEAD__HEADS_DIR", "${state_dir}/my-heads")  # substituted like a file's value
    cfg = load_config()
    assert cfg.serving.replicas == 3 and cfg.bench.concurrencies == [1, 8]
    assert cfg.serving.vllm_args == ["--tensor-parallel-size", "2"]
    assert cfg.serving.num_speculative_tokens_per_batch_size == [(1, 8, 3), (9, 64, 0)]
    assert cfg.bench.nospec_reference is True and cfg.gate.confidence == 0.95
    assert cfg.serving.cpu_reserved_cores is None
    assert cfg.cache_dir == str(tmp_path / "cache") and cfg.head.heads_dir == f"{tmp_path}/state/my-heads"


def test_environment_wins_over_the_file_and_the_callers_overrides_over_both(env, tmp_path):
    f = write(tmp_path, "[serving]\nreplicas = 2\nrouter_port = 9000\n")
    env("ADAPT__SERVING__REPLICAS", "5")
    cfg = load_config(f)
    assert (cfg.serving.replicas, cfg.serving.router_port) == (5, 9000)
    assert load_config(f, overrides={"serving": {"replicas": 7}}).serving.replicas == 7


def test_mlflow_tracking_uri_beats_the_embedded_default_but_not_a_file(env, tmp_path):
    state = tmp_path / "state"
    assert load_config().mlflow.tracking_uri == f"sqlite:///{state}/mlflow/mlflow.db"
    env("MLFLOW_TRACKING_URI", "http://mlflow.internal:5000")
    assert load_config().mlflow.tracking_uri == "http://mlflow.internal:5000"
    f = write(tmp_path, '[mlflow]\ntracking_uri = "https://from-the-file"\n')
    assert load_config(f).mlflow.tracking_uri == "https://from-the-file"
    env("ADAPT__MLFLOW__TRACKING_URI", "https://from-adapt-env")
    assert load_config(f).mlflow.tracking_uri == "https://from-adapt-env"


@pytest.mark.parametrize("var,value,says", [
    ("ADAPT__SERVING__REPLICAZ", "1",
     "ADAPT__SERVING__REPLICAZ: unknown key 'replicaz' in [serving] (did you mean 'replicas'?)"),
    ("ADAPT__SERVIN__REPLICAS", "1", "ADAPT__SERVIN__REPLICAS: unknown section or top-level key 'servin'"),
    ("ADAPT__SERVING__REPLICAS", "many", "ADAPT__SERVING__REPLICAS: [serving] replicas: Input should be a valid int"),
    ("ADAPT__SERVING__REPLICAS", "-1",
     "ADAPT__SERVING__REPLICAS: [serving] replicas: Input should be greater than or equal to 0 (got '-1')"),
    ("ADAPT__BENCH__CONCURRENCIES", "1,4", "ADAPT__BENCH__CONCURRENCIES='1,4': expected a TOML array"),
    ("ADAPT__A__B__C", "1", "ADAPT__A__B__C: expected ADAPT__SECTION__KEY"),
    ("ADAPT__SOURCE_FILE", "x", "unknown section or top-level key 'source_file'"),
])
def test_a_bad_environment_value_names_its_variable(env, var, value, says):
    env(var, value)
    with pytest.raises(ConfigError) as e:
        load_config()
    assert says in str(e.value), str(e.value)


def test_a_bad_file_value_names_the_file_and_the_key_not_pydantics_raw_message(env, tmp_path):
    f = write(tmp_path, "[serving]\nreplicaz = 1\n")
    with pytest.raises(ConfigError) as e:
        load_config(f)
    assert str(e.value) == (f"invalid configuration: config file {f}: unknown key 'replicaz' in [serving] "
                            "(did you mean 'replicas'?)")
    assert "extra_forbidden" not in str(e.value) and "pydantic" not in str(e.value)
    f = write(tmp_path, "[serving\n")
    with pytest.raises(ConfigError, match=f"config file {f} is not valid TOML"):
        load_config(f)
    # A check across keys names every source that set one of them.
    f = write(tmp_path, "[controller]\nrollback_fraction = 0.8\n")
    env("ADAPT__CONTROLLER__DRIFT_FRACTION", "0.75")
    with pytest.raises(ConfigError) as e:
        load_config(f)
    says = f"ADAPT__CONTROLLER__DRIFT_FRACTION, config file {f}: [controller]: controller.drift_fraction"
    assert says in str(e.value)


def test_env_overrides_reads_only_the_double_underscore_prefix():
    frag, origin = env_overrides({"ADAPT_CONFIG": "x.toml", "ADAPT_ADMIN_TOKEN": "t", "ADAPT__GATE__MAX_ATTEMPTS": "3",
                                  "AIRFLOW__CORE__EXECUTOR": "LocalExecutor"})
    assert frag == {"gate": {"max_attempts": "3"}} and origin == {("gate", "max_attempts"): "ADAPT__GATE__MAX_ATTEMPTS"}


def test_default_config_keeps_state_under_one_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("ADAPT_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("ADAPT_CONFIG", raising=False)
    cfg = load_config()
    state = str(tmp_path / "state")
    assert cfg.state_dir == state
    for value in (cfg.capture.source, cfg.warehouse.uri, cfg.warehouse.catalog, cfg.mlflow.artifact_location, cfg.head.heads_dir):
        assert value.startswith(state), value
    assert cfg.mlflow.tracking_uri == f"sqlite:///{state}/mlflow/mlflow.db"


def test_user_config_overrides_only_its_keys_and_roundtrips(tmp_path, monkeypatch):
    monkeypatch.delenv("ADAPT_CONFIG", raising=False)
    user = tmp_path / "cfg.toml"
    user.write_text(f'state_dir = "{tmp_path}/s"\n[serving]\nreplicas = 3\n[capture]\nsource = "s3://bucket/capture"\n')
    cfg = load_config(user)
    assert cfg.serving.replicas == 3 and cfg.capture.source == "s3://bucket/capture"
    assert cfg.serving.router_port == 8000  # untouched default
    assert cfg.warehouse.uri == f"{tmp_path}/s/warehouse"
    again = tmp_path / "again.toml"
    again.write_text(dump_toml(cfg))
    assert load_config(again).to_json() | {"source_file": None} == cfg.to_json() | {"source_file": None}
