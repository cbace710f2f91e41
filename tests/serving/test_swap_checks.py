"""The swap's smoke check: what greedy texts after a swap say about the target and the head."""

from serving.swap import greedy_divergence

REF = ["the cat sat on the mat and then it slept", "def f(x): return x + 1", "help me with python code"]


def test_identical_texts_pass():
    assert greedy_divergence(REF, list(REF)) is None


def test_one_late_flip_is_rounding_not_a_broken_swap():
    late = [REF[0][:30] + " and dreamed", REF[1], REF[2]]  # the first 30 of 41 characters agree
    assert greedy_divergence(REF, late) is None


def test_one_early_flip_is_rounding_too():
    # A near tie flipped by the batch shape (live traffic shares the batch) can come at any token.
    assert greedy_divergence(REF, ["a dog", REF[1], REF[2]]) is None


def test_flips_on_more_than_a_third_of_the_prompts_fail_the_swap():
    two = [REF[0][:30] + " and dreamed", REF[1][:15] + "2", REF[2]]
    assert "[0, 1] (more than a third)" in greedy_divergence(REF, two)
    broken = ["x", "y", "z"]  # a broken target changes every prompt from the start
    assert "[0, 1, 2] (more than a third)" in greedy_divergence(REF, broken)


def test_a_missing_answer_fails_the_swap():
    assert "no greedy text for smoke prompts [2]" in greedy_divergence(REF, REF[:2])


def test_acceptance_is_compared_only_for_a_head_that_never_served():
    from serving.swap import SwapController

    sc = SwapController.__new__(SwapController)
    sc.collapse_fraction = 0.5
    ref = {"texts": REF, "mean_acceptance_length": 1.4}
    got = {"texts": list(REF), "mean_acceptance_length": 1.0}
    assert "acceptance collapsed: mean acceptance length 1.000 vs 1.400" in sc._check_smoke(ref, got)
    assert sc._check_smoke(ref, got, check_acceptance=False) is None  # a rollback to a head that served
    assert "more than a third" in sc._check_smoke(ref, {**got, "texts": ["x", "y", REF[2]]}, check_acceptance=False)
