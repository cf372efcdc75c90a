"""Overlong completions (DAPO, Yu et al. 2025): filter truncated ones out of the loss, or punish length softly.

A completion cut at max_new_tokens has no final answer, so its reward says "wrong" for a reasoning that may
have been fine -- noise. Two remedies, usable together:
* overlong filtering: mask truncated completions out of the loss (`overlong_keep_mask`);
* soft overlong punishment: add a length penalty that ramps linearly from 0 to -1 over the last
  `cache_len` tokens before `max_len` (`soft_overlong_penalty`), added to the reward before advantages.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


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
