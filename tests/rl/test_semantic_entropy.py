"""Semantic entropy: hand-computed entropies, math-equivalence clustering, SEED-GRPO modulation, curriculum."""

import math

import pytest
import torch
from math_verify import parse, verify

from grpo_engine.rl.advantages import compute_advantages
from grpo_engine.rl.semantic_entropy import (
    SemanticEntropyConfig,
    cluster_answers,
    curriculum_order,
    difficulty_scores,
    group_semantic_entropy,
    modulate_advantages,
    modulation_weights,
    semantic_entropy,
)


def math_equivalent(a: str, b: str) -> bool:
    """Stand-in for the MATH task's equivalence (the task module supplies the real one)."""
    return bool(verify(parse(f"${a}$"), parse(f"${b}$")))


@pytest.mark.parametrize(
    "ids, expected",
    [
        ([0, 0, 0, 0], 0.0),
        ([0, 0, 1, 1], math.log(2)),  # 0.693147
        ([0, 0, 0, 1], 0.562335),  # -(0.75 ln 0.75 + 0.25 ln 0.25)
        ([0, 1, 2, 3], math.log(4)),  # 1.386294
    ],
)
def test_count_entropy_hand_computed(ids, expected):
    assert semantic_entropy(ids) == pytest.approx(expected, abs=1e-6)


def test_likelihood_entropy_hand_computed():
    # cluster masses: {0: 0.2 + 0.2, 1: 0.6} -> p = (0.4, 0.6) -> SE = 0.673012
    lp = [math.log(0.2), math.log(0.2), math.log(0.6)]
    assert semantic_entropy([0, 0, 1], lp) == pytest.approx(0.673012, abs=1e-6)
    # masses need not sum to 1: only their ratios matter (length-normalised likelihoods)
    assert semantic_entropy([0, 0, 1], [v - 3.0 for v in lp]) == pytest.approx(0.673012, abs=1e-6)


def test_math_equivalence_clustering():
    answers = ["1/2", "0.5", "\\frac{1}{2}", "2", None, None, "1/3"]
    ids = cluster_answers(answers, math_equivalent)
    assert ids == [0, 0, 0, 1, 2, 3, 4]  # None answers are singletons
    # p = (3, 1, 1, 1, 1) / 7
    expected = -(3 / 7) * math.log(3 / 7) - 4 * (1 / 7) * math.log(1 / 7)
    assert semantic_entropy(ids) == pytest.approx(expected)


def test_raising_equivalence_is_not_a_match():
    def boom(a, b):
        raise RuntimeError("parser crashed")

    assert cluster_answers(["1", "1"], boom) == [0, 1]


def test_modulation_hand_computed():
    se = torch.tensor([0.0, math.log(2), math.log(4)])  # G = 4: x = SE / ln 4 = 0, 0.5, 1
    lin = modulation_weights(se, 4, SemanticEntropyConfig(modulation="linear"))
    torch.testing.assert_close(lin, torch.tensor([1.0, 0.5, 0.0]))
    ex = modulation_weights(se, 4, SemanticEntropyConfig(modulation="exp"))
    torch.testing.assert_close(ex, torch.tensor([1.0, math.exp(-0.5), math.exp(-1.0)]))
    foc = modulation_weights(se, 4, SemanticEntropyConfig(modulation="focal", focal_gamma=2.0))
    torch.testing.assert_close(foc, torch.tensor([1.0, 0.25, 0.0]))
    half = modulation_weights(se, 4, SemanticEntropyConfig(alpha=0.5))
    torch.testing.assert_close(half, torch.tensor([1.0, 0.75, 0.5]))


@pytest.mark.parametrize("modulation", ["linear", "exp", "focal"])
def test_modulation_monotone_in_se(modulation):
    se = torch.linspace(0, math.log(8), 50)
    w = modulation_weights(se, 8, SemanticEntropyConfig(modulation=modulation, alpha=0.9))
    assert (w[1:] < w[:-1]).all()  # strictly decreasing while x < 1
    assert w[0] == 1.0 and (w >= 0).all()


def test_alpha_zero_is_plain_grpo():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    answers = [["1/2", "3", "4", "0.5"], ["7", "7", "8", "9"]]
    adv = compute_advantages(rewards).advantages
    se = group_semantic_entropy(answers, math_equivalent)
    assert se[0] == pytest.approx(1.039721, abs=1e-5)  # clusters (2, 1, 1) of 4
    assert torch.equal(modulate_advantages(adv, se, SemanticEntropyConfig(alpha=0.0)), adv)
    modulated = modulate_advantages(adv, se, SemanticEntropyConfig(alpha=1.0))
    torch.testing.assert_close(modulated[0], adv[0] * (1 - 1.039721 / math.log(4)), atol=1e-5, rtol=0)


def test_group_se_with_likelihood():
    cfg = SemanticEntropyConfig(probability="likelihood")
    lp = torch.log(torch.tensor([[0.2, 0.2, 0.6]]))
    se = group_semantic_entropy([["1", "1", "2"]], lambda a, b: a == b, cfg, seq_logp=lp)
    assert se.item() == pytest.approx(0.673012, abs=1e-6)
    with pytest.raises(ValueError, match="seq_logp"):
        group_semantic_entropy([["1", "1"]], lambda a, b: a == b, cfg)


def test_difficulty_and_curriculum_order():
    examples = [["1", "2", "3", "4"], ["5", "5", "5", "5"], ["1", "1", "2", "2"]]
    scores = difficulty_scores(examples, lambda a, b: a == b)
    assert scores == pytest.approx([1.0, 0.0, 0.5])
    assert curriculum_order(scores) == [1, 2, 0]


def test_bad_inputs():
    with pytest.raises(ValueError, match=r"advantages \(2, 3\), se \(3,\)"):
        modulate_advantages(torch.zeros(2, 3), torch.zeros(3), SemanticEntropyConfig())
    with pytest.raises(ValueError, match="modulation"):
        modulation_weights(torch.zeros(1), 4, SemanticEntropyConfig(modulation="cosine"))
    with pytest.raises(ValueError, match="non-finite"):
        semantic_entropy([0, 1], [0.0, float("nan")])
