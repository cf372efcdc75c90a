"""Rewards of the scored groups -> group-relative advantages (+ SEED-GRPO modulation, overlong handling) ->
the right-padded training batch.

Each config field that shapes advantages is read here, in one place, so the step never touches an algorithm
variant itself.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import torch

from ..collect.groups import Group
from ..config import Config, ConfigError
from ..rl.advantages import combine_rewards, compute_advantages
from ..rl.overlong import overlong_keep_mask, soft_overlong_penalty
from ..rl.semantic_entropy import group_semantic_entropy, modulate_advantages
from ..world import World
from .batching import RolloutBatch, build_rollout_batch


@dataclass
class AdvantageInfo:
    """What the advantage phase reports for the step's metrics."""

    num_zero_variance: int  # groups whose rewards were all equal (advantage 0)
    num_nonfinite: int  # non-finite rewards masked out
    semantic_entropy: float  # mean SE (nats) of the trained groups' answers, always computed


def _rewards(groups: list[Group], cfg: Config) -> torch.Tensor:
    """[P, G] rewards: the task's totals, or (advantage.component_weights set) a re-weighted sum of the
    components; then the soft overlong penalty when enabled."""
    weights = cfg.algorithm.advantage.component_weights
    if weights:
        seen = {k for g in groups for r in g.rewards for k in r.components}
        unknown = sorted(set(weights) - seen)
        if unknown and seen:  # (all rewards failing leaves no components to compare against)
            raise ConfigError(f"algorithm.advantage.component_weights names {unknown}, but the task's rewards have "
                              f"the components {sorted(seen)}: fix the names")
        names = sorted(seen | set(weights))
        comps = {n: torch.tensor([[r.components.get(n, 0.0) for r in g.rewards] for g in groups]) for n in names}
        rewards = combine_rewards(comps, weights).double()  # [P, G]
    else:
        rewards = torch.tensor([g.totals for g in groups], dtype=torch.float64)  # [P, G]
    o = cfg.algorithm.overlong
    if o.soft_punish:
        lengths = torch.tensor([[len(c) for c in g.completion_ids] for g in groups])  # [P, G]
        max_len = o.max_len or cfg.rollout.max_new_tokens
        rewards = rewards + soft_overlong_penalty(lengths.flatten(), max_len, o.cache_len).view_as(rewards)
    return rewards


def _semantic_entropy(groups: list[Group], task, cfg: Config) -> torch.Tensor:
    """[P] semantic entropy of each group's final answers under the task's equivalence."""
    answers = [[r.answer for r in g.rewards] for g in groups]
    seq_logp = torch.tensor([[statistics.fmean(lp) if lp else 0.0 for lp in g.logprobs] for g in groups])  # [P, G]
    return group_semantic_entropy(answers, task.equivalent, cfg.algorithm.semantic_entropy, seq_logp)


def _step_rewards(rewards: torch.Tensor | None, cfg: Config, world: World) -> torch.Tensor | None:
    """[P_all, G] the rewards of every rank's groups in rank order (= one process's step), when an estimator
    needs more than each group's own (batch_std's batch std); None otherwise. A collective under torchrun:
    every rank calls it, groups or not."""
    if world.size == 1 or cfg.algorithm.advantage.estimator != "batch_std":
        return None
    shares = [r for r in world.gather(rewards) if r is not None]  # [P_r, G] each
    return torch.cat(shares) if shares else None


def rollout_batch(groups: list[Group], cfg: Config, task, pad_id: int,
                  world: World | None = None) -> tuple[RolloutBatch | None, AdvantageInfo]:
    """Group advantages (+ SEED-GRPO modulation, overlong filtering) -> a right-padded RolloutBatch.
    world: this rank's place under torchrun (`groups` are then its share of the step's)."""
    rewards = _rewards(groups, cfg) if groups else None  # [P, G]
    step_rewards = _step_rewards(rewards, cfg, world or World())
    if not groups:
        return None, AdvantageInfo(0, 0, math.nan)
    a = cfg.algorithm
    result = compute_advantages(rewards, a.advantage, batch_rewards=step_rewards)
    se = _semantic_entropy(groups, task, cfg)  # [P]
    adv = modulate_advantages(result.advantages, se, a.semantic_entropy) if a.semantic_entropy.enabled \
        else result.advantages  # [P, G]
    keep = result.valid.clone()  # [P, G]
    if a.overlong.filter_truncated:
        keep &= overlong_keep_mask([f for g in groups for f in g.finish_reasons]).view_as(keep)
    G = len(groups[0].completion_ids)
    batch = build_rollout_batch(
        prompt_ids=[g.prompt_ids for g in groups for _ in range(G)],
        completion_ids=[c for g in groups for c in g.completion_ids],
        sampler_logprobs=[lp for g in groups for lp in g.logprobs],
        advantages=adv.reshape(-1).float(),
        completion_keep=keep.reshape(-1).tolist(),
        pad_id=pad_id,
        share_prompts=cfg.memory.share_prompt_forward,
        loss_masks=[m for g in groups for m in g.loss_masks] if groups[0].loss_masks is not None else None,
    )
    return batch, AdvantageInfo(result.num_zero_variance, result.num_nonfinite, float(se.mean()))
