"""The `adapt` command line as a user meets it: the conventions every command keeps (-h, usage errors exit 2,
--config and --json, no traceback), help text, --version, JSON errors, no secret printed. In-process (CliRunner)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib

import pytest
from typer.testing import CliRunner

from app import __version__
from app.cli import app
from tests.paths import REPO_ROOT

runner = CliRunner()


def commands(group=None, prefix=(), groups=False):
    """Every leaf command path of the CLI (with ``groups``, the paths of the command groups instead)."""
    import typer.main

    cmd = typer.main.get_command(app) if group is None else group
    for name, sub in getattr(cmd, "commands", {}).items():
        if getattr(sub, "commands", None):
            if groups:
                yield prefix + (name,)
            yield from commands(sub, prefix + (name,), groups)
        elif not groups:
            yield prefix + (name,)


def command(path):
    import typer.main

    cmd = typer.main.get_command(app)
    for name in path:
        cmd = cmd.commands[name]
    return cmd


LEAVES = sorted(commands())


@pytest.mark.parametrize("path", LEAVES, ids=" ".join)
def test_every_command_keeps_the_cli_conventions(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # whatever a command would write by mistake lands here, and is looked for
    for flag in ("-h", "--help"):
        r = runner.invoke(app, [*path, flag], terminal_width=200)
        assert r.exit_code == 0 and r.output.startswith("Usage: adapt " + " ".join(path)), (flag, r.output)
    # An unknown option is a usage error: exit 2, with the usage line and the option named.
    r = runner.invoke(app, [*path, "--no-such-option"])
    assert r.exit_code == 2 and "No such option: --no-such-option" in r.output and r.exception.__class__ is SystemExit
    cmd = command(path)
    names = {o for p in cmd.params for o in p.opts}
    assert {"--config", "--json"} <= names, f"adapt {' '.join(path)} lacks --config or --json"
    required = [p for p in cmd.params if p.required]
    if required:  # leaving one out is a usage error too
        r = runner.invoke(app, list(path))
        assert r.exit_code == 2 and "Missing" in r.output, r.output
    # With its required values given, a missing config file stops it before it does anything: exit 2, as JSON.
    args = [a for p in required for a in (["1"] if p.param_type_name == "argument" else [p.opts[0], "1"])]
    r = runner.invoke(app, [*path, *args, "--config", str(tmp_path / "missing.toml"), "--json"])
    err = json.loads(r.stdout)
    assert r.exit_code == err["exit_code"] == 2 and "missing.toml does not exist" in err["error"], r.output
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("path", sorted(commands(groups=True)), ids=" ".join)
def test_every_command_group_answers_h_and_a_bare_call_with_its_usage(path):
    r = runner.invoke(app, [*path, "-h"])
    assert r.exit_code == 0 and "Commands:" in r.output
    r = runner.invoke(app, list(path))
    assert r.exit_code == 2 and "Commands:" in r.output  # no subcommand: a usage error, with the list


@pytest.mark.parametrize("args,says", [
    (["dataset", "export", "--split", "foo"], "'foo' is not one of 'train', 'heldout'"),
    (["cycle", "--step", "bogus"], "'bogus' is not one of 'ingest', 'snapshot'"),
    (["cycle", "--step", "eval"], "'eval' is not one of"),
    (["rollback", "--to", "abc"], "Invalid value for '--to'"),
    (["rollback", "--to", "0"], "Invalid value for '--to'"),
    (["ingest", "--since", "yesterday-ish"], "cannot parse time 'yesterday-ish'"),
    (["eval", "--head", "h", "--limit", "0"], "Invalid value for '--limit'"),
])
def test_bad_option_values_are_usage_errors(args, says, tmp_path):
    r = runner.invoke(app, [*args, "--config", str(tmp_path / "missing.toml")])
    assert r.exit_code == 2 and says in r.output and "Traceback" not in r.output, r.output


def test_cycle_help_lists_the_steps_it_runs():
    from loop.steps import STEPS

    out = runner.invoke(app, ["cycle", "-h"], terminal_width=400).output
    assert " → ".join(STEPS) in " ".join(out.split())
    assert "evaluate" in out and " eval " not in out


def test_registry_import_of_a_missing_directory_names_it(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'state_dir = "{tmp_path}"\n')
    r = runner.invoke(app, ["registry", "import", str(tmp_path / "nonexistent"), "--config", str(cfg)])
    assert r.exit_code == 1 and r.exception.__class__ is SystemExit, r.output
    assert r.stderr == f"error: no head directory at {tmp_path / 'nonexistent'} (no config.json)\n"
    assert not (tmp_path / "mlflow").exists()  # nothing created on the way


def test_pool_status_with_nothing_running_says_so_before_asking_for_a_token(tmp_path, monkeypatch):
    from tests.services import free_port

    monkeypatch.delenv("ADAPT_ADMIN_TOKEN", raising=False)
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'state_dir = "{tmp_path}"\n')
    url = f"http://127.0.0.1:{free_port()}"
    for args in (["pool", "status", "--url", url], ["swap", str(tmp_path), "--url", url]):
        r = runner.invoke(app, [*args, "--config", str(cfg), "--json"])
        err = json.loads(r.stdout)
        assert r.exit_code == 1 and err["error"].startswith(f"nothing answers at {url} (ConnectError)"), err
        assert "token" not in err["error"]


def test_head_init_and_import_refuse_to_replace_their_output_without_force(tmp_path, tiny_model, tiny_head):
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'state_dir = "{tmp_path}"\n[head]\ndraft_vocab_size = 256\n')
    out = tmp_path / "head"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    for args in (["head", "init"], ["head", "import", str(tiny_head)]):
        r = runner.invoke(app, [*args, "--out", str(out), "--target", str(tiny_model), "--config", str(cfg)])
        assert r.exit_code == 1 and f"{out} exists: pass --force to replace it" in r.stderr, r.output
        assert [p.name for p in out.iterdir()] == ["keep.txt"]
    r = runner.invoke(app, ["head", "init", "--out", str(out), "--force", "--target", str(tiny_model),
                            "--config", str(cfg), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["sha256"] and (out / "config.json").is_file() and not (out / "keep.txt").exists()


def test_an_unexpected_error_is_one_line_and_adapt_debug_shows_its_traceback(tmp_path, monkeypatch):
    import app.commands.loop as loop_cmds

    def boom(cfg):
        raise RuntimeError("registry exploded")

    monkeypatch.setattr(loop_cmds, "registry_list", boom)
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'state_dir = "{tmp_path}"\n')
    r = runner.invoke(app, ["registry", "list", "--config", str(cfg)])
    assert r.exit_code == 1 and r.stderr.startswith("error: RuntimeError: registry exploded (this is unexpected: "
                                                    "ADAPT_DEBUG=1 prints the traceback")
    r = runner.invoke(app, ["registry", "list", "--config", str(cfg)], env={"ADAPT_DEBUG": "1"})
    assert isinstance(r.exception, RuntimeError) and str(r.exception) == "registry exploded"


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


def test_pool_status_shows_the_controllers_warnings(tmp_path, monkeypatch):
    """A router and a controller answering on loopback (stand-ins: their own tests run the real ones)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    routes = {"/health": {"status": "ok"},
              "/admin/status": {"replicas": [{"url": "http://127.0.0.1:8100", "healthy": True, "draining": False,
                                              "head_sha256": "ab" * 32, "head_version": "3", "live_acceptance": None}]},
              "/ctl/health": {"status": "ok", "serving_version": "3", "last_error": None,
                              "warnings": ["the early Airflow trigger for version 3 failed after 3 of 3 attempts: x"]}}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = json.dumps(routes[self.path]).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setenv("ADAPT_ADMIN_TOKEN", "t" * 32)
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'state_dir = "{tmp_path}"\n')
    try:
        r = runner.invoke(app, ["pool", "status", "--url", url, "--controller-url", url + "/ctl", "--config", str(cfg)])
    finally:
        server.shutdown()
        server.server_close()
    assert r.exit_code == 0, r.output
    assert f"controller {url}/ctl: ok, serving version 3" in r.stdout
    assert "WARNING: the early Airflow trigger for version 3 failed after 3 of 3 attempts" in r.stdout


def test_commands_live_at_module_level_in_one_annotated_style():
    """Options and arguments are declared as ``Annotated[T, typer.Option(...)] = default``, and no command is
    defined inside another function, so each command reads on its own."""
    import ast

    for f in sorted((REPO_ROOT / "app").rglob("*.py")):
        tree = ast.parse(f.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef):
                defaults = [*node.args.defaults, *node.args.kw_defaults]
                assert not any(isinstance(d, ast.Call) and getattr(d.func, "attr", "") in ("Option", "Argument")
                               for d in defaults if d is not None), f"{f.name}:{node.name}: typer.Option as a default"
                inner = [n for n in ast.walk(node) if isinstance(n, ast.FunctionDef) and n is not node]
                assert not any(isinstance(dec, ast.Call) and getattr(dec.func, "attr", "") == "command"
                               for n in inner for dec in n.decorator_list), f"{f.name}:{node.name}: a command inside"


def test_config_masks_secrets_set_from_the_environment(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'state_dir = "{tmp_path}"\n')
    env = {"ADAPT__AIRFLOW__PASSWORD": "hunter2-airflow", "ADAPT__AIRFLOW__FAILURE_WEBHOOK": "https://hooks/s3cr3t",
           "ADAPT__SERVING__REPLICAS": "5"}
    r = runner.invoke(app, ["config", "--json", "--config", str(cfg)], env=env)
    out = json.loads(r.stdout)
    assert out["airflow"]["password"] == out["airflow"]["failure_webhook"] == "***" and out["serving"]["replicas"] == 5
    assert "hunter2" not in r.output and "s3cr3t" not in r.output


def test_a_registry_command_against_an_mlflow_that_does_not_answer_fails_in_seconds(tmp_path, monkeypatch):
    import time

    from tests.services import free_port

    for var in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT"):
        monkeypatch.delenv(var, raising=False)  # MLflow's defaults, as a user has them (conftest restores them)
    uri = f"http://127.0.0.1:{free_port()}"
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'state_dir = "{tmp_path}"\n[mlflow]\ntracking_uri = "{uri}"\nartifact_location = ""\n')
    t0 = time.monotonic()
    r = runner.invoke(app, ["rollback", "--to", "3", "--config", str(cfg), "--json"])
    err = json.loads(r.stdout)["error"]
    assert r.exit_code == 1 and err.startswith("MLflow: ") and uri in err, err
    assert time.monotonic() - t0 < 60  # MLflow's own default retries for minutes


def test_bad_config_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[serving]\nreplicas = -1\n")
    res = runner.invoke(app, ["config", "--config", str(bad), "--json"])
    assert res.exit_code == 2
    assert "replicas" in json.loads(res.stdout)["error"] and "Traceback" not in res.stderr  # --json: a JSON error
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("[serving]\nreplicaz = 1\n")
    res = runner.invoke(app, ["config", "--config", str(unknown)])
    assert res.exit_code == 2 and "replicaz" in res.stderr


def test_cli_validate_reports_error_as_json(random_head, tiny_model, tmp_path):
    copy = tmp_path / "h"
    shutil.copytree(random_head, copy)
    (copy / "model.bin").write_bytes(b"x")
    res = runner.invoke(app, ["head", "validate", str(copy), "--target", str(tiny_model), "--json"])
    assert res.exit_code == 1
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["ok"] is False and "pickle" in out["error"]


def test_sigterm_runs_a_commands_cleanup_and_exits_143(tmp_path):
    """A command killed with SIGTERM (Airflow's task kill, a container stop) runs its ``finally``, which is
    where the demo and the bench stop the vLLM replicas they started; Python's default would skip it."""
    script = tmp_path / "cmd.py"
    script.write_text(
        "import subprocess, sys, time\n"
        "from app import cli\n"
        "@cli.app.command('hold')\n"
        "def hold() -> None:\n"
        "    child = subprocess.Popen(['sleep', '600'], start_new_session=True)\n"  # as a replica is started
        f"    open({str(tmp_path / 'child')!r}, 'w').write(str(child.pid))\n"
        "    try:\n"
        "        time.sleep(600)\n"
        "    finally:\n"
        "        child.kill(); child.wait()\n"
        "sys.argv = ['adapt', 'hold']\n"
        "cli.main()\n")
    proc = subprocess.Popen([sys.executable, str(script)], cwd=REPO_ROOT)
    child = tmp_path / "child"
    deadline = time.monotonic() + 60
    while not child.exists() or not child.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, "the command did not start"
        time.sleep(0.1)
    pid = int(child.read_text())
    proc.send_signal(signal.SIGTERM)
    try:
        assert proc.wait(timeout=30) == 143
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
