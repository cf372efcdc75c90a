"""A step's training rows: rewards of the scored groups -> group-relative advantages (+ SEED-GRPO modulation,
overlong handling) -> the right-padded `TrainBatch`; and its token-budget micro-batches.

The update phase runs forward/backward over many rows of very different lengths. Packing rows sorted by
length into micro-batches whose padded size (rows x longest row) stays under a token budget keeps padding
waste low and peak activation memory bounded, whatever the mix of lengths.

With prompt sharing (train/forward.py) the G rows of a prompt run the prompt once: a micro-batch then
holds whole groups, and its size counts each prompt once (prompts x longest prompt + rows x longest
completion).

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
from ..rl.advantages import combine_rewards, compute_advantages, overlong_keep_mask, soft_overlong_penalty
from ..rl.semantic_entropy import group_semantic_entropy, modulate_advantages
from ..world import World


@dataclass
class TrainBatch:
    """One step's training rows: prompt + completion, right-padded.

    Position t of `*_logp` and `completion_mask` refers to the token input_ids[:, t] (predicted from t-1).
    `prompt_index` says which rows share their prompt: the update forward then runs each prompt once
    (train/forward.py); None runs every row whole (the plain forward, same numbers).
    """

    input_ids: torch.Tensor  # [B, T] long, right-padded with pad_id
    completion_mask: torch.Tensor  # [B, T] float, 1 on completion tokens that get a gradient (never on prompts)
    advantages: torch.Tensor  # [B] float
    lengths: torch.Tensor  # [B] long, real tokens per row (prompt + completion)
    prompt_lengths: torch.Tensor  # [B] long, prompt tokens per row
    sampler_logp: torch.Tensor  # [B, T] float, the sampler's full-softmax log-probs (0 off the completion)
    prompt_index: torch.Tensor | None = None  # [B] long, equal <=> identical prompt tokens; None: no sharing
    old_logp: torch.Tensor | None = None  # [B, T] policy log-probs before the update (mu > 1)
    ref_logp: torch.Tensor | None = None  # [B, T] reference log-probs (beta > 0)

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]

    def active_tokens(self) -> int:
        """Completion tokens that carry gradient: the global normaliser of one optimizer step."""
        return int(self.completion_mask.sum().item())

    def active_rows(self) -> int:
        """Rows with at least one active token: the step's sequence count for per-sequence aggregations."""
        return int((self.completion_mask.sum(1) > 0).sum().item())

    def to(self, device) -> TrainBatch:
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return TrainBatch(*(move(getattr(self, f)) for f in self.__dataclass_fields__))

    def select(self, rows: torch.Tensor) -> TrainBatch:
        """The rows `rows` (index tensor), trimmed to their longest row."""
        T = int(self.lengths[rows].max().item())
        pick = lambda t: None if t is None else t[rows, :T]  # noqa: E731
        return TrainBatch(
            input_ids=self.input_ids[rows, :T],
            completion_mask=self.completion_mask[rows, :T],
            advantages=self.advantages[rows],
            lengths=self.lengths[rows],
            prompt_lengths=self.prompt_lengths[rows],
            sampler_logp=self.sampler_logp[rows, :T],
            prompt_index=None if self.prompt_index is None else self.prompt_index[rows],
            old_logp=pick(self.old_logp),
            ref_logp=pick(self.ref_logp),
        )


def rows_with_signal(batch: TrainBatch) -> TrainBatch | None:
    """The rows with a nonzero advantage and at least one active token; None when there are none.

    For a loss where zero advantage means zero gradient (rl.losses.zero_advantage_is_inert) the other rows add
    exactly nothing to the update, only compute (in a zero-variance group: all G rows and the prompt). The step's
    loss normalisers must be counted before (train.step.step_totals), so the kept rows' gradients are unchanged.
    """
    keep = (batch.advantages != 0) & (batch.completion_mask.sum(1) > 0)  # [B]
    if bool(keep.all()):
        return batch
    if not bool(keep.any()):
        return None
    return batch.select(torch.nonzero(keep).flatten())


def build_train_batch(
    prompt_ids: list[list[int]],
    completion_ids: list[list[int]],
    sampler_logprobs: list[list[float]],
    advantages: torch.Tensor,
    completion_keep: list[bool],
    pad_id: int,
    share_prompts: bool = True,
    loss_masks: list[list[int]] | None = None,
) -> TrainBatch:
    """Concatenate prompt_ids[i] + completion_ids[i] per row; completion_keep[i]=False masks a row out.

    loss_masks: per row, one 0/1 per completion token (multi-turn rollouts: 0 on tool tokens, which the
    policy did not sample); multiplied into the completion mask. None: every completion token is trained.

    share_prompts: rows with identical prompt tokens get one prompt_index (any rows, not only a group's),
    so the update runs that prompt once; left None when no prompt has two rows (nothing to share).
    """
    B = len(completion_ids)
    lengths = [len(p) + len(c) for p, c in zip(prompt_ids, completion_ids)]
    T = max(lengths)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)  # [B, T]
    mask = torch.zeros(B, T)  # [B, T]
    sampler = torch.zeros(B, T)  # [B, T]
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        input_ids[i, : len(p) + len(c)] = torch.tensor(p + c, dtype=torch.long)
        if completion_keep[i] and c:
            mask[i, len(p) : len(p) + len(c)] = 1.0 if loss_masks is None else _row_mask(loss_masks[i], len(c))
        sampler[i, len(p) : len(p) + len(c)] = torch.tensor(sampler_logprobs[i], dtype=torch.float32)
    return TrainBatch(
        input_ids=input_ids,
        completion_mask=mask,
        advantages=advantages.float(),
        lengths=torch.tensor(lengths, dtype=torch.long),
        prompt_lengths=torch.tensor([len(p) for p in prompt_ids], dtype=torch.long),
        sampler_logp=sampler,
        prompt_index=shared_prompt_index(prompt_ids) if share_prompts else None,
    )


def _row_mask(loss_mask: list[int], n: int) -> torch.Tensor:
    """[n] float 0/1 of one row's loss mask; its length must be the completion's."""
    if len(loss_mask) != n:
        raise ValueError(f"a loss mask has {len(loss_mask)} entries for a completion of {n} tokens")
    return torch.tensor(loss_mask, dtype=torch.float32).clamp(0.0, 1.0)


def shared_prompt_index(prompt_ids: list[list[int]]) -> torch.Tensor | None:
    """[B] long: rows with identical prompt tokens share an index (first-seen order); None if none repeat."""
    seen: dict[tuple[int, ...], int] = {}
    index = [seen.setdefault(tuple(p), len(seen)) for p in prompt_ids]
    return torch.tensor(index, dtype=torch.long) if len(seen) < len(index) else None


def plan_micro_batches(batch: TrainBatch, token_budget: int) -> list[list[int]]:
    """Row indices of each micro-batch: whole prompt groups when the batch shares prompts, else by length."""
    if batch.prompt_index is None:
        return micro_batches(batch.lengths.tolist(), token_budget)
    return group_micro_batches(batch.prompt_index.tolist(), batch.prompt_lengths.tolist(), batch.lengths.tolist(),
                               token_budget)


def micro_batches(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Row indices grouped so that (rows x longest row) <= token_budget, rows sorted by length (longest first).

    A row longer than the budget gets a micro-batch of its own (it cannot be split without changing the
    loss); the longest rows go first so an out-of-memory error shows up at the first micro-batch.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        width = max(longest, lengths[i])
        if current and width * (len(current) + 1) > token_budget:
            groups.append(current)
            current, width = [], lengths[i]
        current.append(i)
        longest = width
    if current:
        groups.append(current)
    return groups


def group_micro_batches(prompt_index: list[int], prompt_lengths: list[int], lengths: list[int],
                        token_budget: int) -> list[list[int]]:
    """Micro-batches of whole prompt groups with prompts x longest prompt + rows x longest completion <= budget.

    Groups go longest row first; a group that alone exceeds the budget is cut into row chunks that fit
    (each chunk runs the prompt again: still exact, just less shared), a single row being the smallest.
    """
    groups: dict[int, list[int]] = {}
    for i, g in enumerate(prompt_index):
        groups.setdefault(g, []).append(i)
    units: list[list[int]] = []  # groups, or chunks of a group too big for one micro-batch
    for rows in groups.values():
        rows.sort(key=lambda i: (-lengths[i], i))
        units.extend(_split_group(rows, prompt_lengths, lengths, token_budget))
    units.sort(key=lambda u: (-lengths[u[0]], u[0]))
    out: list[list[int]] = []
    current: list[int] = []
    for unit in units:
        if current and _shared_cost(current + unit, prompt_index, prompt_lengths, lengths) > token_budget:
            out.append(current)
            current = []
        current = current + unit
    if current:
        out.append(current)
    return out


def _shared_cost(rows: list[int], prompt_index: list[int], prompt_lengths: list[int], lengths: list[int]) -> int:
    """Padded tokens of a shared-prompt micro-batch: distinct prompts x longest prompt + rows x longest completion."""
    prompts = {prompt_index[i] for i in rows}
    longest_prompt = max(prompt_lengths[i] for i in rows)
    longest_completion = max(lengths[i] - prompt_lengths[i] for i in rows)
    return len(prompts) * longest_prompt + len(rows) * longest_completion


def _split_group(rows: list[int], prompt_lengths: list[int], lengths: list[int], token_budget: int) -> list[list[int]]:
    """One group's rows (longest first) in chunks of k rows with prompt + k x longest completion <= budget."""
    prompt = prompt_lengths[rows[0]]
    completion = max(1, lengths[rows[0]] - prompt)
    k = max(1, (token_budget - prompt) // completion)
    return [rows[i : i + k] for i in range(0, len(rows), k)]


# ----------------------------------------------------------------------------------------------------
# Rewards -> advantages -> the batch


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


def train_batch(groups: list[Group], cfg: Config, task, pad_id: int,
                  world: World | None = None) -> tuple[TrainBatch | None, AdvantageInfo]:
    """Group advantages (+ SEED-GRPO modulation, overlong filtering) -> a right-padded TrainBatch.
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
    batch = build_train_batch(
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
