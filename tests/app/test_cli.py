"""The `adapt` command line as a user meets it: help text, --version, JSON errors, no secret printed."""

from __future__ import annotations

import json
import re
import tomllib

import pytest
from typer.testing import CliRunner

from app import __version__
from app.cli import app
from tests.paths import REPO_ROOT

runner = CliRunner()


def commands(group=None, prefix=()):
    """Every leaf command path of the CLI."""
    import typer.main

    cmd = typer.main.get_command(app) if group is None else group
    for name, sub in getattr(cmd, "commands", {}).items():
        if getattr(sub, "commands", None):
            yield from commands(sub, prefix + (name,))
        else:
            yield prefix + (name,)


def test_version_is_the_projects():
    assert __version__ == tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["version"]
    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0 and r.output.strip() == f"drafter-adapt {__version__}"


@pytest.mark.parametrize("path", sorted(commands()), ids=" ".join)
def test_help_shows_config_section_names_as_written(path):
    r = runner.invoke(app, [*path, "--help"], terminal_width=200)
    assert r.exit_code == 0, r.output
    assert "(default: ." not in r.output and "Override ." not in r.output  # "[section]" eaten as markup
    sections = set(re.findall(r"\[(\w+)\]\.\w+", r.output))
    assert sections <= {"target", "s3", "capture", "warehouse", "mlflow", "head", "training", "serving", "bench",
                        "gate", "cycle", "controller", "airflow", "demo"}, sections


def test_every_command_with_an_option_that_names_a_section_keeps_it():
    r = runner.invoke(app, ["train", "--help"], terminal_width=200)
    assert "[training].max_steps" in r.output and "[head].heads_dir" in r.output


def test_errors_under_json_are_json(tmp_path):
    r = runner.invoke(app, ["registry", "list", "--json", "--config", str(tmp_path / "missing.toml")])
    assert r.exit_code == 2
    err = json.loads(r.stdout)
    assert err["exit_code"] == 2 and "does not exist" in err["error"]
    r = runner.invoke(app, ["registry", "list", "--config", str(tmp_path / "missing.toml")])
    assert r.exit_code == 2 and r.stdout == "" and "error: cannot load config" in r.stderr


def test_config_never_prints_the_admin_token(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'state_dir = "{tmp_path}"\n[serving]\nadmin_token = "s3cr3t-token-of-a-good-length-1234"\n')
    for args in (["config", "--json", "--config", str(cfg)], ["config", "--config", str(cfg)]):
        r = runner.invoke(app, args)
        assert r.exit_code == 0 and "s3cr3t" not in r.output and "***" in r.output


def test_bench_refuses_a_bench_replica_off_this_worker(tmp_path):
    """Heads go into the bench replica by local path over its loopback RPC: a remote URL fails before anything runs."""
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'state_dir = "{tmp_path}"\n')
    r = runner.invoke(app, ["bench", "--candidate", "a", "--live", "b", "--url", "http://10.1.2.3:8000",
                            "--json", "--config", str(cfg)])
    err = json.loads(r.stdout)
    assert r.exit_code == err["exit_code"] != 0 and "is not on loopback" in err["error"], r.output
    assert not (tmp_path / "bench").exists()
