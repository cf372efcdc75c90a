"""Inputs of rl.losses.policy_loss: shape checks, advantage broadcasting, loss normalisers, finite masking.

Split from losses.py so that file holds the loss's math; every function here is about what goes in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config.algorithm import LossConfig


def check_inputs(c: LossConfig, mask: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    """Shapes agree with mask [B, T], and the inputs the config's terms need are there."""
    if c.rollout_correction != "none" and tensors["sampler_logp"] is None:
        raise ValueError(f"rollout_correction {c.rollout_correction!r} needs sampler_logp (the sampler's log-probs)")
    if c.beta > 0 and tensors["ref_logp"] is None:
        raise ValueError("cfg.beta > 0 needs ref_logp (reference-policy log-probs); set beta=0 to train without KL")
    if (c.entropy_coef > 0 or c.entropy_top_quantile < 1) and tensors["entropy"] is None:
        raise ValueError("entropy_coef > 0 or entropy_top_quantile < 1 needs the entropy [B, T] input")
    if mask.dim() != 2:
        raise ValueError(f"mask must be [B, T], got shape {tuple(mask.shape)}")
    for name, t in tensors.items():
        if t is not None and t.shape != mask.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)} but mask has shape {tuple(mask.shape)}")


def normalisers(m: torch.Tensor, num_tokens_total, num_seqs_total) -> tuple[float, float]:
    """Active tokens and sequences the aggregation divides by: the whole step's when given, else this call's."""
    n_tok = float(num_tokens_total) if num_tokens_total is not None else float(m.sum().clamp_min(1))
    n_seq = float(num_seqs_total) if num_seqs_total is not None else float((m.sum(1) > 0).sum().clamp_min(1))
    if n_tok <= 0 or n_seq <= 0:
        raise ValueError(f"num_tokens_total and num_seqs_total must be > 0, got {num_tokens_total}, {num_seqs_total}")
    return n_tok, n_seq


def broadcast_advantages(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] per-sequence or [B, T] per-token advantages -> [B, T]."""
    if advantages.shape == mask.shape[:1]:
        return advantages[:, None].expand_as(mask)
    if advantages.shape != mask.shape:
        raise ValueError(
            f"advantages has shape {tuple(advantages.shape)} but mask has shape {tuple(mask.shape)}; "
            f"expected [B] or [B, T]"
        )
    return advantages


@dataclass
class Finite:
    mask: torch.Tensor  # [B, T] bool: active tokens whose every input is finite
    num_nonfinite: torch.Tensor  # 0-dim: active tokens dropped because an input was NaN or inf


def finite_inputs(mask, logp, old, adv, *optional) -> Finite:
    """Drop active tokens with a non-finite input: one NaN would turn the whole loss (and every weight) into NaN.

    optional: the [B, T] inputs the config uses, or None (ref_logp, entropy, sampler_logp)."""
    finite = torch.isfinite(logp) & torch.isfinite(old) & torch.isfinite(adv)  # [B, T]
    for t in optional:
        if t is not None:
            finite &= torch.isfinite(t)
    mask_in = mask.bool()
    return Finite(mask=mask_in & finite, num_nonfinite=(mask_in & ~finite).sum())
