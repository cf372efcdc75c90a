"""Rollout correction: the sampler's token log-probs against the trainer's, as metrics and as a loss weight.

The sampler (rollout/sampling.py) records each sampled token's log-prob under the temperature-scaled FULL
softmax, the same distribution the trainer's log-probs describe (rl/logprobs.py divides by the same
temperature). The two still differ by numerics: a bf16 decode with a KV cache is not the training forward.
The policy gradient assumes the tokens came from pi_train; they came from pi_sampler. Per token

    log rho = log pi_train - log pi_sampler          (detached)

where pi_train is the policy before this step's updates: the detached current log-probs when there is a
single pass (mu = 1, old_logp None), the old log-probs otherwise. Each correction (CORRECTIONS, by name)
turns log rho into a detached weight on the token's policy-gradient term:

    none   w = 1
    tis    w = min(rho, C)                  truncated importance sampling
    mis    w = 1 if 1/C <= rho <= C else 0  masked importance sampling

At the sequence level (LEVELS) rho is exp(sum of the sequence's token log ratios), one weight per sequence.
Masked tokens keep counting in the loss's normalisers, so micro-batch gradients still add up exactly.
Metrics (`mismatch_metrics`): mean / max |log rho| and the k3 estimate of KL(pi_sampler || pi_train) per
token, exp(log rho) - log rho - 1, averaged over completion tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class Correction:
    """What a correction hands the loss."""

    weight: torch.Tensor  # [B, T] detached weight on each token's policy-gradient term (1 = untouched)
    hit: torch.Tensor  # [B, T] bool: the correction capped (tis) or masked (mis) this token


# ---- level: token log ratios [B, T] -> the log ratio each token's weight is computed from [B, T] ----------


def _token_level(log_rho: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return log_rho  # [B, T]


def _sequence_level(log_rho: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log of the sequence's likelihood ratio: the sum over its completion tokens, broadcast to its tokens."""
    return (log_rho * mask).sum(1, keepdim=True).expand_as(log_rho)  # [B, T]


LEVELS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "token": _token_level,
    "sequence": _sequence_level,
}


# ---- correction: log ratio [B, T] and log C -> weights. Worked in log space: a long sequence's summed ------
# ---- log ratio can be far past exp's range, and min(rho, C) = exp(min(log rho, log C)) never overflows. ----


def _none(log_rho: torch.Tensor, log_cap: float) -> Correction:
    return Correction(torch.ones_like(log_rho), torch.zeros_like(log_rho, dtype=torch.bool))


def _tis(log_rho: torch.Tensor, log_cap: float) -> Correction:
    """w = min(rho, C): unbiased below the cap, bounded variance above it."""
    return Correction(torch.exp(log_rho.clamp(max=log_cap)), log_rho > log_cap)


def _mis(log_rho: torch.Tensor, log_cap: float) -> Correction:
    """w = 1 inside [1/C, C], 0 outside: a token the sampler and the trainer disagree on teaches nothing."""
    outside = log_rho.abs() > log_cap
    return Correction((~outside).to(log_rho.dtype), outside)


CORRECTIONS: dict[str, Callable[[torch.Tensor, float], Correction]] = {"none": _none, "tis": _tis, "mis": _mis}


def rollout_correction(train_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor,
                       loss) -> Correction:
    """The correction `loss` (an rl.losses.ResolvedLoss) names, of the tokens in mask [B, T] (bool); padding gets
    weight 1 and no hit.

    train_logp [B, T]: pi_train's log-probs (detached here); sampler_logp [B, T]: the sampler's.
    """
    m = mask.to(train_logp.dtype)  # [B, T]
    d = train_logp.detach() - sampler_logp.to(train_logp.dtype)  # [B, T]
    log_rho = torch.where(mask, d, torch.zeros_like(d))  # [B, T], 0 off the mask (where, not * m: inf * 0 = NaN)
    level = LEVELS[loss.rollout_correction_level](log_rho, m)  # [B, T]
    c = CORRECTIONS[loss.rollout_correction](level, math.log(loss.rollout_correction_cap))
    return Correction(torch.where(mask, c.weight, torch.ones_like(c.weight)), c.hit & mask)


def mismatch_metrics(train_logp: torch.Tensor, sampler_logp: torch.Tensor,
                     mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """mismatch_mean_abs / mismatch_max_abs of log pi_train - log pi_sampler and mismatch_k3 (KL(sampler ||
    train) per token) over the tokens of mask [B, T] (bool) whose sampler log-prob is finite; 0 without such
    tokens. 0-dim tensors on the inputs' device: no host sync (policy_loss reads all its metrics at once)."""
    d = (train_logp.detach() - sampler_logp.to(train_logp.dtype)).double()  # [B, T] log rho
    keep = mask & torch.isfinite(d)  # [B, T]
    n = keep.sum().clamp_min(1)
    a = torch.where(keep, d, torch.zeros_like(d))  # [B, T], 0 off the tokens counted
    return {
        "mismatch_mean_abs": a.abs().sum() / n,
        "mismatch_max_abs": a.abs().max() if a.numel() else a.new_zeros(()),
        "mismatch_k3": (torch.exp(a) - a - 1).sum() / n,
    }
