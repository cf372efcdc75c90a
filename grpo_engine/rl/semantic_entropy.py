"""Semantic entropy of a group's final answers, SEED-GRPO advantage modulation, and difficulty scoring.

Semantic entropy (Kuhn et al. 2023; Farquhar et al. 2024) measures how much a model's answers to one prompt
disagree in MEANING: completions are clustered by semantic equivalence of their final answers ("1/2",
"0.5" and "\\frac{1}{2}" are one cluster for math), and SE = -sum_k p_k log p_k over clusters. A prompt the
model answers consistently has SE near 0; one where every sample says something different has SE = log G.

SEED-GRPO (Chen et al. 2025) uses it to temper the policy update on prompts the model is unsure about:
    A_hat = A * f(alpha * SE / log G),   f in {linear 1 - x, exp e^-x, focal (1 - x)^gamma}
so high-uncertainty prompts (likely noisy reward signal) move the policy less. alpha = 0 is plain GRPO.

The same score ranks a dataset from easy (low SE) to hard for a curriculum.

The equivalence relation comes from the task (`Task.equivalent(a, b)`); unparseable answers (None) are
never equivalent to anything, so each is its own cluster.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from ..config.algorithm import SemanticEntropyConfig

Equivalent = Callable[[str, str], bool]


def cluster_answers(answers: Sequence[str | None], equivalent: Equivalent) -> list[int]:
    """Cluster id per answer: an answer joins the first cluster whose first member it is equivalent to.

    Comparing with one representative per cluster (the first member) keeps it O(G x clusters) and
    deterministic even when the task's relation is not perfectly transitive. None -> its own cluster. An
    equivalence check that raises (model output is untrusted input) counts as "not equivalent".
    """
    reps: list[str] = []  # representative answer per cluster
    ids: list[int] = []
    for a in answers:
        found = -1
        if a is not None:
            for k, rep in enumerate(reps):
                if rep is not None and _safe_equivalent(equivalent, a, rep):
                    found = k
                    break
        if found < 0:
            reps.append(a)
            found = len(reps) - 1
        ids.append(found)
    return ids


def _safe_equivalent(equivalent: Equivalent, a: str, b: str) -> bool:
    try:
        return bool(equivalent(a, b))
    except Exception:  # a crash on a weird answer must not crash the run; it just is not a match
        return False


def cluster_probabilities(cluster_ids: Sequence[int], seq_logp: Sequence[float] | None = None) -> torch.Tensor:
    """p_k [K] over clusters: counts / G, or (with seq_logp) each cluster's share of the total likelihood mass.

    seq_logp[i] is completion i's LENGTH-NORMALISED log-likelihood (mean token log-prob), so long
    completions are not penalised for their length; the mass of a cluster is sum_i exp(seq_logp[i]).
    """
    ids = torch.tensor(list(cluster_ids), dtype=torch.long)  # [G]
    if ids.numel() == 0:
        raise ValueError("cluster_probabilities needs at least one completion")
    k = int(ids.max()) + 1
    if seq_logp is None:
        mass = torch.bincount(ids, minlength=k).double()  # [K]
        return mass / mass.sum()
    lp = torch.as_tensor(seq_logp, dtype=torch.float64)  # [G]
    if lp.shape != ids.shape:
        raise ValueError(f"seq_logp has shape {tuple(lp.shape)} but cluster_ids has shape {tuple(ids.shape)}")
    if not torch.isfinite(lp).all():
        raise ValueError("seq_logp contains non-finite values; mask or drop those completions first")
    w = torch.softmax(lp, 0)  # [G], exp(lp_i) / sum_j exp(lp_j), computed stably
    return torch.zeros(k, dtype=torch.float64).index_add_(0, ids, w)


def semantic_entropy(cluster_ids: Sequence[int], seq_logp: Sequence[float] | None = None) -> float:
    """SE = -sum_k p_k log p_k (nats) over the clusters of one group."""
    p = cluster_probabilities(cluster_ids, seq_logp)
    p = p[p > 0]
    return float(-(p * p.log()).sum())


def group_semantic_entropy(
    answers: Sequence[Sequence[str | None]],
    equivalent: Equivalent,
    cfg: SemanticEntropyConfig | None = None,
    seq_logp: torch.Tensor | None = None,
) -> torch.Tensor:
    """SE per prompt [P] from the final answers [P][G] (and length-normalised log-likelihoods [P, G])."""
    cfg = cfg or SemanticEntropyConfig()
    if cfg.probability == "likelihood" and seq_logp is None:
        raise ValueError("probability='likelihood' needs seq_logp [P, G] (mean token log-prob per completion)")
    out = []
    for p, group in enumerate(answers):
        ids = cluster_answers(group, equivalent)
        lp = seq_logp[p].tolist() if cfg.probability == "likelihood" else None
        out.append(semantic_entropy(ids, lp))
    return torch.tensor(out, dtype=torch.float32)  # [P]


def _linear(x, cfg):
    return (1 - x).clamp_min(0)


def _exp(x, cfg):
    return torch.exp(-x)


def _focal(x, cfg):
    return (1 - x.clamp(max=1)) ** cfg.focal_gamma


MODULATIONS: dict[str, Callable[[torch.Tensor, SemanticEntropyConfig], torch.Tensor]] = {
    "linear": _linear,
    "exp": _exp,
    "focal": _focal,
}


def modulation_weights(se: torch.Tensor, group_size: int, cfg: SemanticEntropyConfig) -> torch.Tensor:
    """f(alpha * SE / log G) per prompt [P]; 1 where SE = 0, non-increasing in SE."""
    if group_size < 2:
        raise ValueError(f"semantic entropy needs a group size >= 2, got {group_size}")
    x = cfg.alpha * se.float() / math.log(group_size)  # [P], in [0, alpha]
    return MODULATIONS[cfg.modulation](x, cfg)


def modulate_advantages(advantages: torch.Tensor, se: torch.Tensor, cfg: SemanticEntropyConfig) -> torch.Tensor:
    """SEED-GRPO: A_hat [P, G] = A [P, G] * f(alpha * SE [P] / log G). Returns a new tensor."""
    if advantages.dim() != 2 or se.shape != advantages.shape[:1]:
        raise ValueError(
            f"advantages must be [P, G] and se [P]; got advantages {tuple(advantages.shape)}, se {tuple(se.shape)}"
        )
    w = modulation_weights(se, advantages.shape[1], cfg)  # [P]
    return advantages * w[:, None].to(advantages.dtype)


def difficulty_scores(
    answers_per_example: Sequence[Sequence[str | None]], equivalent: Equivalent
) -> list[float]:
    """Difficulty in [0, 1] per example: SE of its sampled answers / log G (0 = always the same answer)."""
    scores = []
    for group in answers_per_example:
        if len(group) < 2:
            raise ValueError(f"difficulty scoring needs >= 2 samples per example, got {len(group)}")
        scores.append(semantic_entropy(cluster_answers(group, equivalent)) / math.log(len(group)))
    return scores


def curriculum_order(scores: Sequence[float]) -> list[int]:
    """Example indices from easy (low SE) to hard; ties keep dataset order."""
    return sorted(range(len(scores)), key=lambda i: scores[i])
