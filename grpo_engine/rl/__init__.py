"""RL math as pure functions: log-probs, advantages, losses, semantic entropy, overlong and group filtering.

Formulas, citations and the config values that select each variant: docs/algorithms.md.
"""

from ..config.algorithm import (
    AdvantageConfig,
    GroupFilterConfig,
    LossConfig,
    OverlongConfig,
    SemanticEntropyConfig,
)
from .advantages import AdvantageResult, combine_rewards, compute_advantages
from .group_filter import GroupSelection, informative_groups, select_groups, take_groups
from .logprobs import token_logprobs
from .losses import policy_loss
from .overlong import overlong_keep_mask, soft_overlong_penalty
from .semantic_entropy import (
    cluster_answers,
    curriculum_order,
    difficulty_scores,
    group_semantic_entropy,
    modulate_advantages,
    semantic_entropy,
)

__all__ = [
    "AdvantageConfig",
    "AdvantageResult",
    "GroupFilterConfig",
    "GroupSelection",
    "LossConfig",
    "OverlongConfig",
    "SemanticEntropyConfig",
    "cluster_answers",
    "combine_rewards",
    "compute_advantages",
    "curriculum_order",
    "difficulty_scores",
    "group_semantic_entropy",
    "informative_groups",
    "modulate_advantages",
    "overlong_keep_mask",
    "policy_loss",
    "select_groups",
    "semantic_entropy",
    "soft_overlong_penalty",
    "take_groups",
    "token_logprobs",
]
