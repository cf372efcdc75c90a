"""Group-relative advantages on an explicit [P, G] layout (P prompts, G completions each), and the decisions
taken on the same rewards: which groups carry signal (DAPO dynamic sampling, `select_groups`) and DAPO's
overlong handling (`soft_overlong_penalty` on the reward, `overlong_keep_mask` on the loss).

Row p holds the G completions of prompt p, in the order the sampler returned them (row i of a flat rollout
belongs to prompt i // G), so `rewards.view(P, G)` is the layout. Each estimator is a small function chosen
by name (see ESTIMATORS); formulas and citations are in docs/algorithms.md.

Guarantees the training loop relies on:
* the input rewards are never modified (advantages are a new tensor, rewards are returned as a copy);
* a group whose (finite) rewards are all equal gets advantage 0 and is reported -- never NaN from 0/0;
* a non-finite reward (NaN/inf from a broken reward function) is excluded from its group's statistics,
  gets advantage 0, is marked invalid (so the loop can mask that completion) and is counted.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial

import torch

from ..config.algorithm import AdvantageConfig


@dataclass
class AdvantageResult:
    """Advantages of one rollout batch, with what was masked and why."""

    advantages: torch.Tensor  # [P, G] float
    rewards: torch.Tensor  # [P, G] the (combined) rewards, a copy; NaN where the reward was non-finite
    valid: torch.Tensor  # [P, G] bool: reward was finite (mask invalid completions out of the loss)
    zero_variance: torch.Tensor  # [P] bool: group carried no relative signal (all finite rewards equal)
    num_zero_variance: int  # number of zero-variance groups
    num_nonfinite: int  # number of non-finite rewards that were masked


def combine_rewards(components: Mapping[str, torch.Tensor], weights: Mapping[str, float] | None = None) -> torch.Tensor:
    """Weighted sum of reward components, each [P, G]; a component missing from `weights` has weight 1.

    A weight for a component that does not exist is an error (a typo in the config would silently do
    nothing otherwise).
    """
    if not components:
        raise ValueError("combine_rewards needs at least one reward component")
    weights = dict(weights or {})
    unknown = set(weights) - set(components)
    if unknown:
        raise ValueError(f"weights given for unknown reward components {sorted(unknown)}; have {sorted(components)}")
    names = list(components)
    shape = components[names[0]].shape
    total = torch.zeros(shape, dtype=torch.float32)
    for name in names:
        r = components[name]
        if r.shape != shape:
            raise ValueError(
                f"reward component {name!r} has shape {tuple(r.shape)} but {names[0]!r} has {tuple(shape)}"
            )
        total = total + weights.get(name, 1.0) * r.float()
    return total  # [P, G]


def _masked_group_stats(r: torch.Tensor, valid: torch.Tensor, unbiased: bool):
    """Mean and std over the valid entries of each row. r [P, G] (zeros where invalid), valid [P, G]."""
    cnt = valid.sum(1, keepdim=True).clamp_min(1)  # [P, 1]
    mean = (r * valid).sum(1, keepdim=True) / cnt  # [P, 1]
    sq = (((r - mean) * valid) ** 2).sum(1, keepdim=True)  # [P, 1]
    denom = (cnt - 1).clamp_min(1) if unbiased else cnt
    return mean, (sq / denom).sqrt()


def _grpo(r, valid, mean, std, cfg):  # DeepSeekMath (Shao et al. 2024)
    return (r - mean) / (std + cfg.eps)


def _dr_grpo(r, valid, mean, std, cfg):  # Dr. GRPO (Liu et al. 2025): no std division
    return r - mean


def _scale(r: torch.Tensor, valid: torch.Tensor, unbiased: bool) -> torch.Tensor:
    """Std (0-d) of the valid entries of r [P, G] (zeros where invalid)."""
    n = valid.sum().clamp_min(1)
    bmean = (r * valid).sum() / n
    bvar = (((r - bmean) * valid) ** 2).sum() / ((n - 1).clamp_min(1) if unbiased else n)
    return bvar.sqrt()


def _finite(rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rewards [P, G] -> (fp32 rewards with non-finite entries zeroed [P, G], which entries were finite [P, G])."""
    r_in = rewards.detach().float()
    valid = torch.isfinite(r_in)
    return torch.where(valid, r_in, torch.zeros_like(r_in)), valid


def batch_reward_std(rewards: torch.Tensor, unbiased: bool) -> torch.Tensor:
    """Std (0-d) of the finite entries of rewards [P, G]: the scale of the batch_std estimator."""
    return _scale(*_finite(rewards), unbiased)


def _batch_std(r, valid, mean, std, cfg, scale=None):  # group mean, batch std (Liu et al. 2025, "Tricks or Traps?")
    """scale: the std of a batch wider than `r` (data-parallel: every rank's rewards); default r's own."""
    centred = (r - mean) * valid  # [P, G]
    scale = _scale(r, valid, cfg.std_unbiased) if scale is None else scale
    return centred / (scale + cfg.eps)


def _none(r, valid, mean, std, cfg):  # plain REINFORCE: the reward itself
    return r.clone()


Estimator = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AdvantageConfig], torch.Tensor]
ESTIMATORS: dict[str, Estimator] = {"grpo": _grpo, "dr_grpo": _dr_grpo, "batch_std": _batch_std, "none": _none}


def zero_variance_groups(rewards: torch.Tensor, tol: float = 0.0) -> torch.Tensor:
    """Bool [P]: the group carries no relative signal -- fewer than two finite rewards, or all of its finite
    rewards within `tol` of each other. rewards [P, G]. The one definition the advantages, dynamic sampling
    and the step's metrics all use."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [P, G] (prompts x group size), got shape {tuple(rewards.shape)}")
    valid = torch.isfinite(rewards)  # [P, G]
    hi = torch.where(valid, rewards, torch.full_like(rewards, -float("inf"))).amax(1)  # [P]
    lo = torch.where(valid, rewards, torch.full_like(rewards, float("inf"))).amin(1)  # [P]
    return (valid.sum(1) < 2) | ~(hi - lo > tol)


def compute_advantages(rewards: torch.Tensor, cfg: AdvantageConfig | None = None,
                       batch_rewards: torch.Tensor | None = None) -> AdvantageResult:
    """Advantages [P, G] from rewards [P, G] with the estimator named by cfg.estimator.

    Zero-variance groups get advantage exactly 0 under every estimator (under "none" too: a group where every
    completion scored the same says nothing about which completion was better). Non-finite rewards are
    masked, counted and get advantage 0. batch_rewards [P', G]: the whole step's rewards when `rewards` is only
    a share of it (data-parallel ranks), so batch_std divides by the step's std, not the share's.
    """
    cfg = cfg or AdvantageConfig()
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [P, G] (prompts x group size), got shape {tuple(rewards.shape)}")
    r_in = rewards.detach().float()
    r, valid = _finite(r_in)  # [P, G] each
    mean, std = _masked_group_stats(r, valid, cfg.std_unbiased)  # [P, 1] each
    zero_var = zero_variance_groups(r_in, cfg.zero_variance_tol)  # [P]
    estimator = ESTIMATORS[cfg.estimator]
    if cfg.estimator == "batch_std" and batch_rewards is not None:
        estimator = partial(_batch_std, scale=batch_reward_std(batch_rewards, cfg.std_unbiased))
    adv = estimator(r, valid, mean, std, cfg)  # [P, G]
    adv = torch.where(valid & ~zero_var[:, None], adv, torch.zeros_like(adv))
    return AdvantageResult(
        advantages=adv,
        rewards=torch.where(valid, r_in, torch.full_like(r_in, float("nan"))),
        valid=valid,
        zero_variance=zero_var,
        num_zero_variance=int(zero_var.sum()),
        num_nonfinite=int((~valid).sum()),
    )


# ---- group filtering (DAPO dynamic sampling, Yu et al. 2025) ---------------------------------------------
# A group whose G completions all got the same reward has zero advantage everywhere and contributes no
# gradient, only cost. DAPO over-samples: the loop keeps drawing rounds of prompts until it has
# `target_groups` informative groups (or hits its round cap), then trains on exactly those. The loop owns
# sampling; select_groups is the bookkeeping: which groups of which round to keep.


@dataclass(frozen=True)
class GroupSelection:
    """Which groups to train on, in sampling order."""

    keep: list[tuple[int, int]]  # (round, group index within that round), at most target_groups entries
    num_informative: int  # informative groups seen over all rounds (may exceed len(keep))


def select_groups(rounds: Sequence[torch.Tensor], target_groups: int, tol: float = 0.0) -> GroupSelection:
    """Select informative groups (at least two finite rewards that differ by more than tol) from the reward
    tensors [P_r, G] of the rounds sampled so far.

    The loop calls this after every round and draws prompts for the groups still missing, until it has
    target_groups or reaches its round cap; it then trains on the kept groups.
    """
    if target_groups < 1:
        raise ValueError(f"target_groups must be >= 1, got {target_groups}")
    keep, informative = [], 0
    for r, rewards in enumerate(rounds):
        ok = ~zero_variance_groups(rewards, tol)  # [P_r]
        informative += int(ok.sum())
        keep += [(r, int(p)) for p in torch.nonzero(ok).flatten().tolist()]
    return GroupSelection(keep[:target_groups], informative)


# ---- overlong completions (DAPO, Yu et al. 2025) ---------------------------------------------------------
# A completion cut at max_new_tokens has no final answer, so its reward says "wrong" for a reasoning that may
# have been fine -- noise. Two remedies, usable together: mask truncated completions out of the loss
# (overlong_keep_mask), or add a length penalty to the reward before advantages that ramps linearly from 0 to
# -1 over the last `cache_len` tokens before `max_len` (soft_overlong_penalty).


def overlong_keep_mask(finish_reason: Sequence[str]) -> torch.Tensor:
    """Bool [N]: True for completions to keep in the loss (stopped on their own), False for truncated ones."""
    unknown = sorted(set(finish_reason) - {"stop", "length"})
    if unknown:
        raise ValueError(f"finish_reason must be 'stop' or 'length', got {unknown}")
    return torch.tensor([r != "length" for r in finish_reason], dtype=torch.bool)


def soft_overlong_penalty(lengths: torch.Tensor, max_len: int, cache_len: int) -> torch.Tensor:
    """DAPO soft overlong punishment R_length(|y|) for completion lengths [N] -> [N] float, in [-1, 0].

        0                                 if |y| <= L_max - L_cache
        (L_max - L_cache - |y|) / L_cache if L_max - L_cache < |y| <= L_max
        -1                                if |y| > L_max
    """
    if not 0 < cache_len <= max_len:
        raise ValueError(f"need 0 < cache_len <= max_len, got cache_len={cache_len}, max_len={max_len}")
    n = lengths.float()  # [N]
    ramp = ((max_len - cache_len) - n) / cache_len  # [N], negative inside the cache window
    return torch.where(n > max_len, torch.full_like(n, -1.0), ramp.clamp(max=0.0))
