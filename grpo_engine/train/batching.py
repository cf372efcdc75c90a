"""Rollout batch record and token-budget micro-batches.

The update phase runs forward/backward over many rows of very different lengths. Packing rows sorted by
length into micro-batches whose padded size (rows x longest row) stays under a token budget keeps padding
waste low and peak activation memory bounded, whatever the mix of lengths.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RolloutBatch:
    """One step's training rows: prompt + completion, right-padded.

    Position t of `*_logp` and `completion_mask` refers to the token input_ids[:, t] (predicted from t-1).
    """

    input_ids: torch.Tensor  # [B, T] long, right-padded with pad_id
    completion_mask: torch.Tensor  # [B, T] float, 1 on completion tokens that get a gradient
    advantages: torch.Tensor  # [B] float
    lengths: torch.Tensor  # [B] long, real tokens per row (prompt + completion)
    sampler_logp: torch.Tensor  # [B, T] float, log-probs the sampler reported (0 off the completion)
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

    def to(self, device) -> RolloutBatch:
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return RolloutBatch(*(move(getattr(self, f)) for f in self.__dataclass_fields__))

    def select(self, rows: torch.Tensor) -> RolloutBatch:
        """The rows `rows` (index tensor), trimmed to their longest row."""
        T = int(self.lengths[rows].max().item())
        pick = lambda t: None if t is None else t[rows, :T]  # noqa: E731
        return RolloutBatch(
            input_ids=self.input_ids[rows, :T],
            completion_mask=self.completion_mask[rows, :T],
            advantages=self.advantages[rows],
            lengths=self.lengths[rows],
            sampler_logp=self.sampler_logp[rows, :T],
            old_logp=pick(self.old_logp),
            ref_logp=pick(self.ref_logp),
        )


def build_rollout_batch(
    prompt_ids: list[list[int]],
    completion_ids: list[list[int]],
    sampler_logprobs: list[list[float]],
    advantages: torch.Tensor,
    completion_keep: list[bool],
    pad_id: int,
) -> RolloutBatch:
    """Concatenate prompt_ids[i] + completion_ids[i] per row; completion_keep[i]=False masks a row out."""
    B = len(completion_ids)
    lengths = [len(p) + len(c) for p, c in zip(prompt_ids, completion_ids)]
    T = max(lengths)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)  # [B, T]
    mask = torch.zeros(B, T)  # [B, T]
    sampler = torch.zeros(B, T)  # [B, T]
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        input_ids[i, : len(p) + len(c)] = torch.tensor(p + c, dtype=torch.long)
        if completion_keep[i] and c:
            mask[i, len(p) : len(p) + len(c)] = 1.0
        sampler[i, len(p) : len(p) + len(c)] = torch.tensor(sampler_logprobs[i], dtype=torch.float32)
    return RolloutBatch(
        input_ids=input_ids,
        completion_mask=mask,
        advantages=advantages.float(),
        lengths=torch.tensor(lengths, dtype=torch.long),
        sampler_logp=sampler,
    )


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
