"""`adapt eval --step-times`: the K that pays per batch size, from measured step times and the head's acceptance."""

import json

import pytest
import typer

from app.commands.head import _k_choice


def test_step_times_from_a_learning_curve_result_give_a_k_per_batch_size(tmp_path):
    head, target = tmp_path / "head", tmp_path / "target"
    head.mkdir()
    target.mkdir()
    (head / "config.json").write_text(json.dumps({"num_hidden_layers": 1}))
    (target / "config.json").write_text(json.dumps({"num_hidden_layers": 10}))
    times = {"1x0": 10.0, "1x1": 10.0, "1x2": 10.0, "64x0": 10.0, "64x1": 20.0, "64x2": 30.0}
    result = tmp_path / "learning_curve.json"
    result.write_text(json.dumps({"k_choice": {"step_seconds": times}}))
    got = _k_choice(head, result, [0.5, 0.2], None, target)
    assert [(c["batch_size"], c["k"]) for c in got["per_batch_size"]] == [(1, 2), (64, 0)]
    assert got["schedule"] == [[1, 63, 2], [64, 64, 0]]  # as --json prints it
    # a bare {"BxK": seconds} file reads the same
    bare = tmp_path / "times.json"
    bare.write_text(json.dumps(times))
    assert _k_choice(head, bare, [0.5, 0.2], None, target) == got


def test_step_times_without_a_batch_sizes_k0_fail_with_the_file_named(tmp_path, capsys):
    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text(json.dumps({"num_hidden_layers": 1}))
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 10}))
    bad = tmp_path / "times.json"
    bad.write_text(json.dumps({"4x1": 1.0}))
    with pytest.raises(typer.Exit):
        _k_choice(head, bad, [0.5], None, tmp_path)
    # fail() writes to stdout as JSON when an earlier command in this process ran with --json.
    got = capsys.readouterr()
    text = got.err + got.out
    assert f"--step-times {bad}" in text and "batch size 4" in text
