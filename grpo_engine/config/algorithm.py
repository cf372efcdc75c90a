"""The algorithm sections: policy loss, advantages, semantic entropy, overlong handling, dynamic sampling,
and the reference policy of the KL term.

The names offered here (LOSSES, AGGREGATIONS, ...) are the keys of the rl library's tables; a test keeps
the two in sync, so validating a config never runs library code.
"""

from __future__ import annotations

from dataclasses import dataclass

from .fields import inline, one_of, option, require, section

LOSSES = ("grpo", "dapo", "dr_grpo", "gspo", "cispo", "sapo")
RATIO_LEVELS = ("token", "sequence")
AGGREGATIONS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3")
ROLLOUT_CORRECTIONS = ("none", "tis", "mis")
CORRECTION_LEVELS = ("token", "sequence")
ADVANTAGE_ESTIMATORS = ("grpo", "dr_grpo", "batch_std", "none")
MODULATIONS = ("linear", "exp", "focal")
SE_PROBABILITIES = ("count", "likelihood")
REFERENCE_MODES = ("none", "frozen", "hard_reset", "mixin")


@dataclass(frozen=True)
class LossConfig:
    """Policy loss; `loss` picks a preset, the None-valued fields below override its choices."""

    loss: str = option("grpo", "preset: grpo | dapo | dr_grpo | gspo | cispo | sapo (see PRESETS)")
    ratio_level: str | None = option(None, "override: token | sequence (None: preset)")
    eps_low: float | None = option(None, "lower clip: ratio >= 1 - eps_low (None: preset)")
    eps_high: float | None = option(None, "upper clip: ratio <= 1 + eps_high (None: preset; DAPO clip-higher 0.28)")
    dual_clip_c: float | None = option(None, "dual clip for A < 0: loss <= -c * A (c > 1, e.g. 3.0); None = off")
    cispo_max_weight: float = option(5.0, "CISPO: IS weight clipped to <= this (ScaleRL's eps_max)")
    cispo_min_weight: float = option(0.0, "CISPO: IS weight clipped to >= this (0 = no lower clip, as MiniMax-M1)")
    sapo_tau_pos: float = option(1.0, "SAPO: gate temperature for tokens with A > 0 (larger = sharper gate)")
    sapo_tau_neg: float = option(1.05, "SAPO: gate temperature for tokens with A < 0")
    aggregation: str | None = option(
        None, "override: seq-mean-token-mean | token-mean | seq-mean-token-sum-norm")
    max_completion_len: int | None = option(
        None, "Dr. GRPO constant normaliser (max new tokens); needed for *-sum-norm")
    kl_estimator: str = option("k3", "k1 | k2 | k3 (Schulman's estimators of KL(pi || pi_ref))")
    beta: float = option(0.0, "KL coefficient; 0 = no KL term and no reference model at all")
    kl_clamp: float = option(20.0, "|log(pi_ref / pi)| clamped to this before k2/k3 (exp overflow guard)")
    entropy_coef: float = option(0.0, "entropy bonus: loss -= entropy_coef * mean entropy (needs entropy input)")
    entropy_top_quantile: float = option(
        1.0, "policy gradient only on the top-q entropy tokens (0.2 = top 20%); 1 = all")
    rollout_correction: str = option(
        "none", "sampler/trainer mismatch correction: none | tis (weight min(pi_train / pi_sampler, cap)) | "
        "mis (mask ratios outside [1/cap, cap])", ROLLOUT_CORRECTIONS)
    rollout_correction_cap: float = option(2.0, "C of rollout_correction: the TIS cap / the MIS band [1/C, C]")
    rollout_correction_level: str = option(
        "token", "ratio of rollout_correction per token, or per sequence (exp of the summed log ratio)",
        CORRECTION_LEVELS)

    def __post_init__(self) -> None:
        one_of("algorithm", self.loss, LOSSES, "loss")
        if self.ratio_level is not None:
            one_of("algorithm", self.ratio_level, RATIO_LEVELS, "ratio_level")
        if self.aggregation is not None:
            one_of("algorithm", self.aggregation, AGGREGATIONS, "aggregation")
        one_of("algorithm", self.kl_estimator, KL_ESTIMATORS, "kl_estimator")
        require(self.eps_low is None or 0 <= self.eps_low < 1, f"algorithm.eps_low={self.eps_low} must be in [0, 1)")
        require(self.eps_high is None or self.eps_high >= 0, f"algorithm.eps_high={self.eps_high} must be >= 0")
        require(self.dual_clip_c is None or self.dual_clip_c > 1,
                f"algorithm.dual_clip_c must be > 1 (e.g. 3.0) or None, got {self.dual_clip_c}")
        require(0 <= self.cispo_min_weight <= self.cispo_max_weight,
                "algorithm: need 0 <= cispo_min_weight <= cispo_max_weight")
        require(0 < self.entropy_top_quantile <= 1,
                f"algorithm.entropy_top_quantile must be in (0, 1], got {self.entropy_top_quantile}")
        require(self.beta >= 0 and self.entropy_coef >= 0,
                f"algorithm.beta and entropy_coef must be >= 0, got {self.beta}, {self.entropy_coef}")
        require(self.kl_clamp > 0, f"algorithm.kl_clamp must be > 0, got {self.kl_clamp}")
        require(self.max_completion_len is None or self.max_completion_len >= 0,
                "algorithm.max_completion_len must be >= 0 (0 or None: rollout.max_new_tokens)")
        require(self.sapo_tau_pos > 0 and self.sapo_tau_neg > 0,
                f"algorithm.sapo_tau_pos and sapo_tau_neg must be > 0, got {self.sapo_tau_pos}, {self.sapo_tau_neg}")
        one_of("algorithm", self.rollout_correction, ROLLOUT_CORRECTIONS, "rollout_correction")
        one_of("algorithm", self.rollout_correction_level, CORRECTION_LEVELS, "rollout_correction_level")
        require(self.rollout_correction_cap > 1,
                f"algorithm.rollout_correction_cap must be > 1 (e.g. 2.0), got {self.rollout_correction_cap}")


@dataclass(frozen=True)
class AdvantageConfig:
    """How rewards become advantages."""

    estimator: str = option(
        "grpo", "grpo: (r-mean)/(std+eps) | dr_grpo: r-mean | batch_std: (r-mean)/batch std | none: r")
    eps: float = option(1e-6, "added to the std in the denominator")
    std_unbiased: bool = option(
        True, "Bessel-corrected group std (as TRL / DeepSeekMath code); False: population std")
    zero_variance_tol: float = option(
        0.0, "a group is \"zero variance\" when max - min of its finite rewards <= this")
    component_weights: dict[str, float] = option({}, "reward component -> weight; {} = all 1")

    def __post_init__(self) -> None:
        one_of("algorithm.advantage", self.estimator, ADVANTAGE_ESTIMATORS, "advantage estimator")
        require(self.eps >= 0, f"algorithm.advantage.eps must be >= 0, got {self.eps}")
        require(self.zero_variance_tol >= 0, "algorithm.advantage.zero_variance_tol must be >= 0")
        bad = {k: v for k, v in self.component_weights.items() if not _finite(v)}
        require(not bad, f"algorithm.advantage.component_weights {bad} must be finite numbers")


@dataclass(frozen=True)
class SemanticEntropyConfig:
    """Semantic-entropy advantage modulation (SEED-GRPO) and difficulty scoring."""

    enabled: bool = option(False, "off by default: advantages are plain group-relative ones")
    alpha: float = option(1.0, "strength: x = alpha * SE / log G; 0 = identical to plain GRPO")
    modulation: str = option(
        "linear", "f(x): linear 1 - x (clamped at 0) | exp e^-x | focal (1 - x)^focal_gamma")
    focal_gamma: float = option(2.0, "exponent of the focal modulation")
    probability: str = option(
        "count", "p_k: count (cluster size / G) | likelihood (length-normalised likelihood mass)")

    def __post_init__(self) -> None:
        one_of("algorithm.semantic_entropy", self.modulation, MODULATIONS, "modulation")
        one_of("algorithm.semantic_entropy", self.probability, SE_PROBABILITIES, "probability")
        require(self.alpha >= 0, f"algorithm.semantic_entropy: alpha must be >= 0, got {self.alpha}")


@dataclass(frozen=True)
class OverlongConfig:
    """Handling of completions that reach the length limit."""

    filter_truncated: bool = option(False, "mask completions with finish_reason \"length\" out of the loss")
    soft_punish: bool = option(False, "add DAPO's soft overlong penalty to the reward")
    max_len: int = option(0, "L_max: the generation limit (max_new_tokens); needed for soft_punish")
    cache_len: int = option(0, "L_cache: penalty ramps over the last cache_len tokens before max_len")

    def __post_init__(self) -> None:
        require(self.max_len >= 0 and self.cache_len >= 0, "algorithm.overlong.max_len / cache_len must be >= 0")


@dataclass(frozen=True)
class GroupFilterConfig:
    """DAPO dynamic sampling."""

    enabled: bool = option(False, "drop groups whose rewards are all equal and resample")
    max_rounds: int = option(3, "cap on sampling rounds per step (the loop trains on what it has when reached)")
    tol: float = option(0.0, "rewards within tol of each other count as equal")

    def __post_init__(self) -> None:
        require(self.max_rounds >= 1, "algorithm.group_filter.max_rounds must be >= 1")
        require(self.tol >= 0, "algorithm.group_filter.tol must be >= 0")


@dataclass(frozen=True)
class AlgorithmSection:
    """The policy loss (`policy_loss`, whose fields are written at this level: algorithm.loss=dapo,
    algorithm.beta=0.04) and the rest of the algorithm: advantages, semantic entropy, overlong handling, dynamic
    sampling, passes per batch."""

    policy_loss: LossConfig = inline(LossConfig, "the policy loss (rl/losses.py resolve makes it the step's loss)")
    mu: int = option(1, "policy-gradient passes over each rollout batch (> 1 computes old log-probs first)")
    advantage: AdvantageConfig = section(AdvantageConfig, "group-relative advantage estimator")
    semantic_entropy: SemanticEntropyConfig = section(
        SemanticEntropyConfig, "SEED-GRPO modulation (the step's mean semantic entropy is always logged)")
    overlong: OverlongConfig = section(OverlongConfig, "truncated completions (max_len 0 = rollout.max_new_tokens)")
    group_filter: GroupFilterConfig = section(GroupFilterConfig, "DAPO dynamic sampling of informative groups")
    random_reward: bool = option(False, "a control experiment: each completion's reward is a seeded coin flip (0 or "
                                        "1) instead of the task's, before dynamic sampling and advantages; accuracy "
                                        "is still the task's answer check (grpo demo --control random-reward)")

    def __post_init__(self) -> None:
        require(self.mu >= 1, "algorithm.mu must be >= 1")


@dataclass(frozen=True)
class ReferenceConfig:
    """The reference policy behind the KL penalty (ignored when the loss's beta is 0)."""

    mode: str = option(
        "frozen", "none | frozen (initial policy) | hard_reset (copy policy every N steps) | mixin (TR-DPO)")
    update_every: int = option(0, "hard_reset / mixin: steps between updates (> 0 for those modes)")
    mixin_alpha: float = option(0.5, "mixin: ref <- alpha * policy + (1 - alpha) * ref")
    park_on_cpu: bool = option(
        False, "keep the reference on CPU; move it to the policy's device only for its pass")

    def __post_init__(self) -> None:
        one_of("reference", self.mode, REFERENCE_MODES, "reference mode")
        require(self.mode not in ("hard_reset", "mixin") or self.update_every >= 1,
                f"reference: reference mode {self.mode!r} needs update_every >= 1, got {self.update_every}")
        require(0 < self.mixin_alpha <= 1, f"reference: mixin_alpha must be in (0, 1], got {self.mixin_alpha}")


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and x == x and abs(x) != float("inf")
