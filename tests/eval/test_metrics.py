"""pass@k and maj@k against hand-computed values."""

from math import comb

import pytest

from grpo_engine.eval.metrics import maj_at_k, majority_answer, pass_at_k


@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (4, 1, 1, 0.25),
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (10, 0, 5, 0.0),
        (10, 10, 1, 1.0),
        (8, 3, 6, 1.0),  # fewer than k wrong samples: some correct one is always drawn
    ],
)
def test_pass_at_k_hand_computed(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_pass_at_k_matches_binomial_formula_for_large_n():
    n, c, k = 200, 7, 16
    assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k), rel=1e-12)


def test_pass_at_k_rejects_bad_counts():
    with pytest.raises(ValueError, match="n=3, c=4, k=1"):
        pass_at_k(3, 4, 1)


def numeric_eq(a, b):
    return float(a) == float(b)


def test_majority_clusters_equivalent_answers():
    # "0.5" and ".5" form one cluster of 2 and beat "3" (1); None never votes
    assert majority_answer(["3", "0.5", None, ".5"], numeric_eq) == "0.5"
    assert majority_answer([None, None], numeric_eq) is None
    assert majority_answer(["2", "3"], numeric_eq) == "2"  # tie: first seen


def test_maj_at_k_uses_first_k_samples():
    answers = ["7", "7", "5", "5", "5"]
    is_five = lambda a: float(a) == 5
    assert maj_at_k(answers, is_five, numeric_eq, k=3) == 0.0
    assert maj_at_k(answers, is_five, numeric_eq, k=5) == 1.0
    with pytest.raises(ValueError, match="maj@6 needs at least 6 samples"):
        maj_at_k(answers, is_five, numeric_eq, k=6)
