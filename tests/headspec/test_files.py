"""The target's identity (what every head is validated against) is hashed once per file, size and mtime:
in memory within a process, on disk across processes."""

from __future__ import annotations

import json
import os

import pytest

from headspec import files


@pytest.fixture()
def target(tmp_path):
    """A sharded target: config.json and two weight files (bytes: only their hashes matter here)."""
    d = tmp_path / "target"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "hidden_size": 8, "vocab_size": 32}))
    for i in (1, 2):
        (d / f"model-0000{i}-of-00002.safetensors").write_bytes(os.urandom(4096) * i)
    return d


@pytest.fixture()
def hashed(monkeypatch):
    """The files hashed, by name, as target_identity reads them (a new process: no memory cache)."""
    names: list[str] = []
    real = files.sha256_file

    def counting(path, *a, **kw):
        names.append(os.path.basename(path))
        return real(path, *a, **kw)

    monkeypatch.setattr(files, "sha256_file", counting)
    monkeypatch.setattr(files, "_IDENTITY_CACHE", {})
    return names


def test_a_target_is_hashed_once_then_only_what_changed(target, tmp_path, hashed, monkeypatch):
    cache = tmp_path / "cache"
    first = files.target_identity(target, cache)
    assert sorted(hashed) == ["config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    monkeypatch.setattr(files, "_IDENTITY_CACHE", {})
    assert files.target_identity(target, None) == first and len(hashed) == 6  # the same, hashed without a cache
    hashed.clear()
    monkeypatch.setattr(files, "_IDENTITY_CACHE", {})  # another process
    assert files.target_identity(target, cache) == first and hashed == []
    # A changed shard (new mtime) is hashed again, alone, and changes the identity.
    shard = target / "model-00002-of-00002.safetensors"
    shard.write_bytes(b"other weights")
    monkeypatch.setattr(files, "_IDENTITY_CACHE", {})
    changed = files.target_identity(target, cache)
    assert hashed == ["model-00002-of-00002.safetensors"] and changed["weights_sha256"] != first["weights_sha256"]
    assert changed["config_sha256"] == first["config_sha256"]


def test_a_broken_or_unwritable_cache_costs_only_the_hashing(target, tmp_path, hashed, monkeypatch):
    cache = tmp_path / "cache"
    want = files.target_identity(target, cache)
    [entry] = list(cache.iterdir())
    entry.write_text("{not json")
    monkeypatch.setattr(files, "_IDENTITY_CACHE", {})
    hashed.clear()
    assert files.target_identity(target, cache) == want and len(hashed) == 3
    assert json.loads(entry.read_text())["dir"] == str(target.resolve())  # rewritten
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache directory would be")
    monkeypatch.setattr(files, "_IDENTITY_CACHE", {})
    assert files.target_identity(target, blocked / "cache") == want


def test_the_default_cache_lives_under_drafter_adapt_home_or_where_adapt_identity_cache_says(tmp_path, monkeypatch):
    monkeypatch.delenv(files.IDENTITY_CACHE_ENV, raising=False)
    monkeypatch.setenv("DRAFTER_ADAPT_HOME", str(tmp_path / "home"))
    assert files.identity_cache_dir() == tmp_path / "home" / "target-identity"
    monkeypatch.setenv(files.IDENTITY_CACHE_ENV, str(tmp_path / "elsewhere"))
    assert files.identity_cache_dir() == tmp_path / "elsewhere"
