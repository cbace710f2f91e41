"""`adapt demo` configuration (the demo itself runs from scripts/demo.sh)."""

from adapt.config import load_config
from adapt.demo import demo_config, with_overrides


def test_demo_has_its_own_state_and_an_admin_token(tmp_path, monkeypatch):
    monkeypatch.delenv("ADAPT_ADMIN_TOKEN", raising=False)
    monkeypatch.delenv("ADAPT_CONFIG", raising=False)
    monkeypatch.setenv("ADAPT_STATE_DIR", str(tmp_path))
    base = load_config()
    assert base.serving.resolved_admin_token() == ""
    cfg = demo_config(base)
    assert cfg.state_dir == str(tmp_path / "demo")
    assert cfg.warehouse.uri.startswith(str(tmp_path / "demo"))
    # swaps need a token: without one the router refuses the controller
    assert len(cfg.serving.admin_token) >= 16
    monkeypatch.setenv("ADAPT_ADMIN_TOKEN", "from-env")
    assert demo_config(base).serving.admin_token == "from-env"


def test_with_overrides_validates(tmp_path, monkeypatch):
    monkeypatch.setenv("ADAPT_STATE_DIR", str(tmp_path))
    cfg = with_overrides(load_config(), capture={"heldout_hours": 0.01}, training={"max_steps": 7})
    assert cfg.capture.heldout_hours == 0.01 and cfg.training.max_steps == 7
    import pydantic
    import pytest

    with pytest.raises(pydantic.ValidationError):
        with_overrides(load_config(), training={"max_steps": -1})
