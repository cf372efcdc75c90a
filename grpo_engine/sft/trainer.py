"""Supervised warm start: teach a model the answer format before GRPO.

GRPO learns only from groups whose completions differ in reward, so a model that never produces a
parseable answer gets no signal at all. A short supervised phase on (prompt, reference completion) pairs
fixes that; the demo uses it to bring a random tiny model to "sometimes right" before reinforcement.
Only completion tokens are scored: the prompt is context, not a target (with an empty prompt the first
completion token is context too: nothing precedes it to predict it).

A prefix every row of a batch starts with (e.g. a system prompt that declares tools: 165 of SmolLM2's ~250 tokens
per row in the tools demo) runs once per batch, with gradients, and every row attends to its keys and values
(`shared_prefix_length`, `PrefixKV`): the same loss and gradients as running it in every row, for a fraction of
the compute.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..config import SFTConfig
from ..config.training import lr_factor
from ..model.transformer import Transformer


@dataclass
class SFTBatch:
    """Right-padded prompt+completion rows; loss_mask marks the positions whose NEXT token is a target."""

    input_ids: torch.Tensor  # [B, T] long
    loss_mask: torch.Tensor  # [B, T-1] bool, True where input_ids[:, t+1] is a completion token


def target_flags(pair: tuple) -> list[bool]:
    """Which completion tokens of a pair are targets. With an empty prompt nothing precedes the first completion
    token, so no position predicts it: it is context, and the targets start at the second token."""
    flags = list(pair[2]) if len(pair) > 2 else [True] * len(pair[1])
    return [False, *flags[1:]] if not pair[0] and flags else flags


def make_sft_batch(pairs: list[tuple], pad_id: int, device) -> SFTBatch:
    """pairs of (prompt ids, completion ids) or (prompt ids, completion ids, per-completion-token target flags:
    False for tokens that are context, e.g. a tool's response in a teacher's conversation) -> one batch."""
    rows = [pair[0] + pair[1] for pair in pairs]
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), T - 1, dtype=torch.bool)
    for i, (pair, r) in enumerate(zip(pairs, rows)):
        ids[i, : len(r)] = torch.tensor(r)
        flags = target_flags(pair)  # [C]: completion token k sits at p + k and is predicted at position p + k - 1
        p, skip = len(pair[0]), 0 if pair[0] else 1  # an empty prompt's first token is predicted nowhere
        mask[i, p + skip - 1 : len(r) - 1] = torch.tensor(flags[skip:], dtype=torch.bool)
    return SFTBatch(ids.to(device), mask.to(device))


def check_pairs(pairs: list[tuple]) -> None:
    """Refuse a pair with nothing to learn (no completion, or an empty prompt and a one-token completion): the
    loss is a mean over target tokens, so a batch of such pairs would be NaN."""
    for k, pair in enumerate(pairs):
        if not any(target_flags(pair)):
            raise ValueError(
                f"SFT pair {k} (prompt of {len(pair[0])} tokens, completion of {len(pair[1])}) has no target "
                f"token: give it a completion, and with an empty prompt at least two completion tokens (the first "
                f"has nothing before it to be predicted from; a BOS prompt makes it a target)"
            )


class PrefixKV:
    """The model's cache protocol (model/transformer.py KVCacheLike) for a shared prefix: the prefix pass (batch 1)
    records each layer's keys/values with their autograd history; every later pass attends to them, expanded to
    its batch, followed by its own (the expand's backward sums the rows' gradients into the one prefix pass)."""

    def __init__(self, num_layers: int):
        self.k: list[torch.Tensor | None] = [None] * num_layers  # per layer [1, H_kv, L, D]
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.start = 0
        self.recording = True

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.recording:
            self.k[layer], self.v[layer] = k, v
            return k, v
        B = k.shape[0]
        return (torch.cat([self.k[layer].expand(B, -1, -1, -1), k], dim=2),
                torch.cat([self.v[layer].expand(B, -1, -1, -1), v], dim=2))


def shared_prefix_length(batch: SFTBatch) -> int:
    """Input positions [0, L) that every row has in common and that predict no target (so their hidden states are
    not needed): the prefix one pass can run for the whole batch. 0 for a single row."""
    ids, mask = batch.input_ids[:, :-1], batch.loss_mask  # [B, T-1]
    if ids.shape[0] < 2:
        return 0
    common = int((ids == ids[:1]).all(0).long().cumprod(0).sum())
    first_target = int(mask.any(0).long().argmax()) if bool(mask.any()) else ids.shape[1]
    return min(common, first_target)


def sft_loss(model: Transformer, batch: SFTBatch) -> torch.Tensor:
    """Mean next-token cross-entropy over completion tokens (logits only at those positions); a prefix shared by
    every row runs once (see the module docstring)."""
    ids, mask = batch.input_ids[:, :-1], batch.loss_mask  # [B, T-1]
    L = shared_prefix_length(batch)
    if L < 2:
        hidden = model(ids, return_hidden=True)  # [B, T-1, D]
    else:
        prefix = PrefixKV(len(model.layers))
        model(ids[:1, :L], cache=prefix, return_hidden=True)  # records the keys/values; no target sits here
        prefix.recording = False
        hidden, mask = model(ids[:, L:], cache=prefix, return_hidden=True), mask[:, L:]  # [B, T-1-L, D]
    targets = batch.input_ids[:, 1:][batch.loss_mask]  # [N], row-major: mask[:, :L] holds no target
    logits = model.logits(hidden[mask])  # [N, V]
    return F.cross_entropy(logits.float(), targets)


def lr_at(step: int, cfg: SFTConfig) -> float:
    """Linear warmup, then cosine decay to 0: the schedule of GRPO's optimizer (config/training.py)."""
    return cfg.lr * lr_factor(step, total=cfg.steps, warmup=cfg.warmup_steps, kind="cosine", min_ratio=0.0)


def train_sft(
    model: Transformer,
    pairs: list[tuple[list[int], list[int]]],
    cfg: SFTConfig,
    pad_id: int,
    on_step=None,
) -> list[float]:
    """Train on tokenised (prompt, completion) pairs; returns the loss of every step.

    on_step(step, loss) is called after each step (progress bars, logging).
    """
    if not pairs:
        raise ValueError("SFT needs at least one (prompt, completion) pair")
    check_pairs(pairs)
    rng = random.Random(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, cfg.adam_beta2), weight_decay=cfg.weight_decay)
    model.train()
    losses = []
    order: list[int] = []
    for step in range(cfg.steps):
        while len(order) < cfg.batch_size:  # a dataset smaller than the batch: whole epochs until it is full
            fresh = list(range(len(pairs)))
            rng.shuffle(fresh)
            order += fresh
        idx, order = order[: cfg.batch_size], order[cfg.batch_size :]
        batch = make_sft_batch([pairs[i] for i in idx], pad_id, model.device)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        loss = sft_loss(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(step, losses[-1])
    model.eval()
    return losses
