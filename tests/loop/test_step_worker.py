"""Train and evaluate in a child process (CycleOptions.step_processes): config on stdin, state from the store,
failures raised with the child's own reason. Its success path runs in the demo's e2e test (tests/app/test_demo.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from loop import cycle, step_worker
from settings.config import Config
from tests.config_support import make_cfg


@pytest.fixture
def cx(tmp_path: Path):
    return cycle.Cycle(make_cfg(tmp_path, serving={"admin_token": "a-secret-token-of-the-pool"}))


def test_the_config_crosses_as_json_unchanged(cx):
    assert Config.model_validate_json(cx.cfg.model_dump_json()) == cx.cfg


def test_a_failing_step_raises_with_the_childs_reason_and_leaves_no_secret_on_disk(cx):
    state = cx.load_state("c20261127T000000Z")
    cx.save_state(state)  # what run_step records before a step: the child reads it from the store
    with pytest.raises(cycle.CycleError) as e:
        cycle.in_own_process("train", cx, state)
    msg = str(e.value)
    assert "exited with code 1" in msg and "step 'snapshot' has not run in cycle c20261127T000000Z" in msg
    d = cx.dir("c20261127T000000Z")
    assert (d / "train.log").is_file() and not (d / ".train.out.json").exists()
    assert not any("a-secret-token-of-the-pool" in p.read_text(errors="replace")
                   for p in d.rglob("*") if p.is_file())


def test_evaluate_decides_its_skips_before_starting_a_process(cx, monkeypatch):
    monkeypatch.setattr(cycle, "in_own_process", lambda *a: pytest.fail("no process for a skipped evaluation"))
    opts = cycle.CycleOptions(step_processes=True)
    state = {"cycle_id": "c1", "steps": {"snapshot": {}, "train": {}, "base": {"live_path": None}}}
    assert "bootstrap" in cycle.step_evaluate(cx, state, opts)["skipped"]


def test_worker_refuses_an_unknown_step(capsys):
    assert step_worker.main(["bench", "c1", "/tmp/x.json"]) == 2
    assert "train,evaluate" in capsys.readouterr().err
