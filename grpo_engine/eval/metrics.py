"""Sampling-based accuracy metrics over n completions per problem.

pass@k uses the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on
Code"): with n samples of which c are correct, pass@k = 1 - C(n-c, k) / C(n, k), computed as a running
product so that large n does not overflow. maj@k is majority voting over the first k samples' final
answers, clustered with the task's own equivalence (so "0.5" and "1/2" vote together).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from ..rl.semantic_entropy import cluster_answers


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n (c correct) is correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    fail = 1.0
    for i in range(n - c + 1, n + 1):
        fail *= 1.0 - k / i
    return 1.0 - fail


def majority_answer(answers: Sequence[str | None], equivalent: Callable[[str, str], bool]) -> str | None:
    """The answer of the largest equivalence cluster (rl.semantic_entropy.cluster_answers: the clusters
    semantic entropy counts; first seen wins ties); None answers never vote. An equivalence check that
    raises counts as "not equivalent"."""
    ids = cluster_answers(answers, equivalent)
    sizes = Counter(i for i, a in zip(ids, answers) if a is not None)
    if not sizes:
        return None
    best = max(sizes, key=lambda k: (sizes[k], -k))
    return answers[ids.index(best)]


def maj_at_k(
    answers: Sequence[str | None],
    reference_is: Callable[[str], bool],
    equivalent: Callable[[str, str], bool],
    k: int,
) -> float:
    """1.0 if the majority answer of the first k samples is correct, else 0.0."""
    if not 1 <= k <= len(answers):
        raise ValueError(f"maj@{k} needs at least {k} samples, got {len(answers)}")
    winner = majority_answer(answers[:k], equivalent)
    return float(winner is not None and reference_is(winner))
