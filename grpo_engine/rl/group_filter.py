"""Group filtering (DAPO dynamic sampling, Yu et al. 2025): keep only groups whose rewards differ.

A group whose G completions all got the same reward has zero advantage everywhere and contributes no
gradient, only cost. DAPO over-samples: the loop keeps drawing rounds of prompts until it has
`target_groups` informative groups (or hits its round cap), then trains on exactly those. The loop owns
sampling; this module is the pure bookkeeping: which groups of which round to keep.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .advantages import zero_variance_groups


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
