"""`adapt demo`'s preflight: a machine without the memory or cores the demo needs is told so before anything starts."""

import pytest
from typer.testing import CliRunner

from app import preflight
from app.preflight import DEMO_MEMORY, MachineTooSmall, check


def meminfo(tmp_path, available_gib: float):
    p = tmp_path / "meminfo"
    p.write_text(f"MemTotal:       16000000 kB\nMemFree:         1000000 kB\n"
                 f"MemAvailable:   {int(available_gib * 2**20)} kB\nBuffers:          12345 kB\n")
    return p


@pytest.fixture(autouse=True)
def _check_on(monkeypatch):
    monkeypatch.delenv(preflight.SKIP_ENV, raising=False)


def test_need_is_the_larger_of_training_and_the_benchmark():
    m = preflight.DemoMemory(demo=1.0, engine=2.0, trainer=5.0, bench_engines=2, margin=0.5)
    assert m.need_gib(1) == 1.0 + max(2.0 + 5.0, 3 * 2.0) + 0.5
    assert m.need_gib(3) == 1.0 + max(6.0 + 5.0, 5 * 2.0) + 0.5


def test_enough_memory_and_cores_passes(tmp_path):
    check(1, meminfo(tmp_path, DEMO_MEMORY.need_gib(1) + 0.1), cores=2)


def test_too_little_memory_says_what_it_needs_and_what_lowers_it(tmp_path):
    need = DEMO_MEMORY.need_gib(2)
    with pytest.raises(MachineTooSmall) as e:
        check(2, meminfo(tmp_path, 5.5), cores=2)
    msg = str(e.value)
    assert f"{need:.1f} GiB" in msg and "5.5 GiB available" in msg
    assert "[serving] replicas" in msg and "to 1" in msg and f"{preflight.SKIP_ENV}=0" in msg
    assert "cores" not in msg


def test_too_few_cores(tmp_path):
    with pytest.raises(MachineTooSmall, match="needs 2 CPU cores and this process may use 1"):
        check(1, meminfo(tmp_path, 64), cores=1)


def test_unreadable_meminfo_checks_cores_only(tmp_path):
    check(1, tmp_path / "absent", cores=2)
    assert preflight.mem_available_gib(tmp_path / "absent") is None


def test_skipped_on_request(tmp_path, monkeypatch):
    monkeypatch.setenv(preflight.SKIP_ENV, "0")
    check(1, meminfo(tmp_path, 0.5), cores=1)


def test_adapt_demo_stops_before_starting_anything(tmp_path, monkeypatch):
    import app.demo
    from app.cli import app as cli

    monkeypatch.setenv("ADAPT_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("ADAPT_CONFIG", raising=False)
    monkeypatch.setattr(preflight, "mem_available_gib", lambda meminfo=None: 3.0)
    started = []
    monkeypatch.setattr(app.demo, "run_demo", lambda *a, **k: started.append(1))
    r = CliRunner().invoke(cli, ["demo"])
    assert r.exit_code == 1 and not started
    assert "adapt demo cannot run here" in r.output and "3.0 GiB available" in r.output
    assert not (tmp_path / "state").exists()
