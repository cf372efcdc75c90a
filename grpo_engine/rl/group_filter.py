"""Group filtering (DAPO dynamic sampling, Yu et al. 2025): keep only groups whose rewards differ.

A group whose G completions all got the same reward has zero advantage everywhere and contributes no
gradient, only cost. DAPO over-samples: the loop keeps drawing rounds of prompts until it has
`target_groups` informative groups (or hits its round cap), then trains on exactly those. The loop owns
sampling; this module is the pure bookkeeping: which groups of which round to keep.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from .advantages import zero_variance_groups

T = TypeVar("T")


def informative_groups(rewards: torch.Tensor, tol: float = 0.0) -> torch.Tensor:
    """Bool [P]: group has at least two finite rewards that differ by more than tol. rewards [P, G]."""
    return ~zero_variance_groups(rewards, tol)


@dataclass(frozen=True)
class GroupSelection:
    """Which groups to train on, in sampling order."""

    keep: list[tuple[int, int]]  # (round, group index within that round), at most target_groups entries
    num_informative: int  # informative groups seen over all rounds (may exceed len(keep))
    num_dropped: int  # zero-variance groups dropped
    done: bool  # True when len(keep) == target_groups: stop sampling


def select_groups(rounds: Sequence[torch.Tensor], target_groups: int, tol: float = 0.0) -> GroupSelection:
    """Select informative groups from the reward tensors [P_r, G] of the rounds sampled so far.

    The loop calls this after every round; it stops when `done` or when it reaches its round cap, then
    gathers the kept groups' records with `take_groups`.
    """
    if target_groups < 1:
        raise ValueError(f"target_groups must be >= 1, got {target_groups}")
    keep, informative, dropped = [], 0, 0
    for r, rewards in enumerate(rounds):
        ok = informative_groups(rewards, tol)  # [P_r]
        informative += int(ok.sum())
        dropped += int((~ok).sum())
        keep += [(r, int(p)) for p in torch.nonzero(ok).flatten().tolist()]
    keep = keep[:target_groups]
    return GroupSelection(keep, informative, dropped, done=len(keep) == target_groups)


def take_groups(rows_per_round: Sequence[Sequence[T]], selection: GroupSelection, group_size: int) -> list[T]:
    """Gather the per-completion rows (G contiguous rows per group) of the kept groups, in order."""
    out: list[T] = []
    for r, p in selection.keep:
        rows = rows_per_round[r]
        if len(rows) < (p + 1) * group_size:
            raise ValueError(f"round {r} has {len(rows)} rows, too few for group {p} of size {group_size}")
        out.extend(rows[p * group_size : (p + 1) * group_size])
    return out
