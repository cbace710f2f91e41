import json

import pytest

from evaluation.spec_k import best_k, expected_tokens, per_batch_size_schedule, table_cost


def test_expected_tokens_sums_the_first_positions_rates():
    rates = [0.4, 0.1, 0.02]
    assert expected_tokens(rates, 0) == 1.0
    assert expected_tokens(rates, 2) == pytest.approx(1.5)
    with pytest.raises(ValueError):
        expected_tokens(rates, 4)


def test_best_k_falls_as_verification_gets_dear():
    rates = [0.4, 0.1, 0.02]
    # batch 1: verifying more tokens costs almost nothing; batch 64: each verified token costs in full
    seconds = {}
    for k in range(4):
        seconds[(1, k)] = 10.0 + 0.1 * k
        seconds[(8, k)] = 10.0 + 2.0 * k
        seconds[(64, k)] = 10.0 * (1 + k)
    choices = best_k(rates, table_cost(seconds), [1, 8, 64])
    assert [c.k for c in choices] == [3, 1, 0]
    assert choices[0].speedup == pytest.approx(1.52 / 10.3 * 10.0)
    assert choices[1].tokens_per_step == pytest.approx(1.4) and choices[2].speedup == 1.0
    assert per_batch_size_schedule(choices, last=256) == [(1, 7, 3), (8, 63, 1), (64, 256, 0)]
    # ranges with the same k merge; max_k bounds the choice
    assert [c.k for c in best_k(rates, table_cost(seconds), [1, 8], max_k=1)] == [1, 1]
    assert per_batch_size_schedule(best_k(rates, table_cost(seconds), [1, 8], max_k=1)) == [(1, 8, 1)]


def test_a_missing_step_time_is_named():
    with pytest.raises(KeyError, match="batch size 2, k=1"):
        best_k([0.5], table_cost({(2, 0): 1.0}), [2])


def test_verification_cost_adds_the_drafter_share_and_ignores_noise_that_makes_more_tokens_cheaper():
    from evaluation.spec_k import parse_step_seconds, verification_cost

    seconds = parse_step_seconds({"1x0": 10.0, "1x1": 9.0, "1x2": 12.0})
    assert seconds[(1, 2)] == 12.0
    cost = verification_cost(seconds, head_layers=1, target_layers=10)
    assert cost(1, 0) == 10.0
    assert cost(1, 1) == pytest.approx(10.0 + 0.1 * 10.0)  # 9.0 read as 10.0: never cheaper than k=0
    assert cost(1, 2) == pytest.approx(12.0 + 0.1 * 10.0)
    with pytest.raises(ValueError, match="BATCHxK"):
        parse_step_seconds({"8-2": 1.0})
    with pytest.raises(KeyError, match="batch size 4"):
        cost(4, 1)


def test_propose_reads_step_times_as_the_learning_curve_writes_them(tmp_path):
    from evaluation.spec_k import load_step_seconds, propose

    seconds = {f"{b}x{k}": (10.0 + 0.1 * k if b == 1 else 10.0 * (1 + k)) for b in (1, 64) for k in range(3)}
    nested = tmp_path / "lc.json"
    nested.write_text(json.dumps({"points": [], "k_choice": {"step_seconds": seconds}}))
    flat = tmp_path / "flat.json"
    flat.write_text(json.dumps(seconds))
    assert load_step_seconds(nested) == load_step_seconds(flat)
    p = propose([0.4, 0.1], load_step_seconds(flat), head_layers=1, target_layers=30)
    assert [c.k for c in p.per_batch_size] == [2, 0]
    assert p.to_json()["schedule"] == [[1, 63, 2], [64, 64, 0]]
    empty = tmp_path / "empty.json"
    empty.write_text("{}")
    with pytest.raises(ValueError, match="no step times"):
        load_step_seconds(empty)
