"""The registry's record of a benchmark against no speculation, and what `adapt pool status` says of it."""

from __future__ import annotations

import json

from settings.config import load_config


def test_pool_status_says_plainly_when_production_is_slower_than_no_speculation(tiny_model, tmp_path):
    from adapt.checkpoint import init_random_head
    from app.commands.serving import _production_warnings
    from rollout.registry import T_SPEEDUP, Registry, import_head, slower_than_nospec, speedups

    cfg = load_config(overrides={"state_dir": str(tmp_path), "target": {"model": str(tiny_model)},
                                 "mlflow": {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
                                            "artifact_location": str(tmp_path / "artifacts"),
                                            "registered_model": "drafter-units"}})
    assert _production_warnings(cfg) == []  # nothing in Production: nothing to say
    head = init_random_head(tiny_model, tmp_path / "head", k=3, seed=0, draft_vocab_size=256)
    reg = Registry(cfg)
    v = import_head(cfg, head)
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
