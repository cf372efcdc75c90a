"""Update phase of a step: log-probs of rollout rows, micro-batched policy-gradient passes, optimizer step.

Global token normalisation: the loss of every micro-batch is divided by the completion-token count of the
WHOLE optimizer step (computed before the passes), so accumulating gradients over micro-batches gives
exactly the gradient of one big batch, whatever the split.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..rl.logprobs import token_logprobs
from ..rl.losses import LossConfig, policy_loss
from .batching import RolloutBatch, plan_micro_batches
from .shared_prompt import shared_prompt_hidden

OOM_KNOBS = (
    "memory.micro_batch_tokens (tokens per forward/backward), rollout.max_tokens_in_flight (generation), "
    "rollout.group_size / rollout.prompts_per_step (rows per step), rollout.max_new_tokens, "
    "memory.activation_checkpointing=1, or set memory.auto_halve_micro_batch=true"
)


class NonFiniteError(RuntimeError):
    """Too many consecutive updates with NaN/inf loss or gradient."""


def completion_hidden(model, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Final hidden states at the positions that predict completion tokens, and those tokens.

    Returns (hidden [N, D], targets [N], mask [b, T-1]); mask[i, t] marks that position t of row i predicts
    the completion token input_ids[i, t + 1], in the row-major order of hidden / targets. Rows that share a
    prompt (batch.prompt_index) run it once (train/shared_prompt.py); otherwise every row runs whole.
    """
    if batch.prompt_index is not None:
        return shared_prompt_hidden(model, batch)
    return plain_completion_hidden(model, batch)


def plain_completion_hidden(model, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """completion_hidden with every row's prompt + completion through the model (no sharing)."""
    hidden = model(batch.input_ids[:, :-1], return_hidden=True)  # [b, T-1, D]
    mask = batch.completion_mask[:, 1:].bool()  # [b, T-1]
    return hidden[mask], batch.input_ids[:, 1:][mask], mask


def sequence_logprobs(model, batch: RolloutBatch, *, temperature: float, chunk_size: int,
                      with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each completion token under `model`: [b, T] (0 off the completion), entropy likewise.

    Only completion positions go through the LM head (chunked), never the [b, T, V] logits of the prompt.
    """
    hidden, targets, mask = completion_hidden(model, batch)  # [N, D], [N], [b, T-1]
    logp, ent = token_logprobs(hidden, model.lm_head.weight, targets, temperature=temperature,
                               chunk_size=chunk_size, with_entropy=with_entropy)  # [N], [N] | None
    out = torch.zeros(batch.input_ids.shape, dtype=logp.dtype, device=logp.device)  # [b, T]
    out[:, 1:][mask] = logp
    ent_out = None
    if ent is not None:
        ent_out = torch.zeros(batch.input_ids.shape, dtype=ent.dtype, device=ent.device)
        ent_out[:, 1:][mask] = ent
    return out, ent_out


@torch.no_grad()
def batch_logprobs(model, batch: RolloutBatch, token_budget: int, *, temperature: float,
                   chunk_size: int) -> torch.Tensor:
    """[B, T] log-probs of all rows, micro-batch by micro-batch, in eval mode (old / reference policy)."""
    out = torch.zeros(batch.input_ids.shape)  # [B, T]
    was_training = model.training
    model.eval()  # no (LoRA) dropout: these are the log-probs of the policy itself
    try:
        for rows in plan_micro_batches(batch, token_budget):
            idx = torch.tensor(rows)
            sub = batch.select(idx).to(model.device)
            logp, _ = sequence_logprobs(model, sub, temperature=temperature, chunk_size=chunk_size)
            out[idx, : logp.shape[1]] = logp.float().cpu()
    finally:
        model.train(was_training)
    return out


@dataclass
class UpdateStats:
    loss: float  # the pass's loss (micro-batch losses add up to it: each is its share of the whole step)
    metrics: dict[str, float]  # policy_loss metrics combined over micro-batches (see _combine)
    tokens: int  # active completion tokens of the step


_SUMMED = ("loss", "pg_loss", "active_tokens", "num_nonfinite")


def _combine(parts: list[dict[str, float]]) -> dict[str, float]:
    """Micro-batch metrics -> step metrics: sums for additive ones, min / max for ratio extremes, and an
    active-token-weighted mean for the rest (kl_mean, entropy_mean, clip fractions, ratio_mean)."""
    weight = sum(p["active_tokens"] for p in parts) or 1.0
    out = {}
    for key in parts[0]:
        values = [p[key] for p in parts]
        if key in _SUMMED:
            out[key] = sum(values)
        elif key == "ratio_min":
            out[key] = min(values)
        elif key == "ratio_max":
            out[key] = max(values)
        else:
            out[key] = sum(v * p["active_tokens"] for v, p in zip(values, parts)) / weight
    return out


def accumulate_gradients(model, batch: RolloutBatch, loss_cfg: LossConfig, token_budget: int, *,
                         temperature: float, chunk_size: int) -> UpdateStats:
    """One pass: forward/backward every micro-batch through rl.policy_loss, gradients summed in .grad.

    policy_loss gets the WHOLE step's active tokens and sequences as its normalisers, so the micro-batch
    losses (and gradients) add up exactly to those of one big batch, whatever the split.
    """
    num_tokens, num_seqs = max(1, batch.active_tokens()), max(1, batch.active_rows())
    parts = []
    for rows in plan_micro_batches(batch, token_budget):
        sub = batch.select(torch.tensor(rows)).to(model.device)
        logp, ent = sequence_logprobs(model, sub, temperature=temperature, chunk_size=chunk_size,
                                      with_entropy=True)  # [b, T] each
        loss, metrics = policy_loss(logp, sub.old_logp, sub.ref_logp, sub.advantages, sub.completion_mask,
                                    loss_cfg, entropy=ent, num_tokens_total=num_tokens, num_seqs_total=num_seqs)
        loss.backward()
        parts.append(metrics)
    combined = _combine(parts)
    return UpdateStats(combined["loss"], combined, num_tokens)


def clip_and_check(model, max_norm: float) -> float:
    """Global grad norm (clipped to max_norm when > 0). Returns inf/nan untouched so the caller can skip."""
    params = [p for p in model.parameters() if p.grad is not None]
    if max_norm > 0:
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm, error_if_nonfinite=False))
    norms = torch.stack([p.grad.detach().float().norm() for p in params])
    return float(norms.norm())


def is_finite(*values: float) -> bool:
    return all(math.isfinite(v) for v in values)
