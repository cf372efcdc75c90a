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
from .batching import RolloutBatch, micro_batches

OOM_KNOBS = (
    "memory.micro_batch_tokens (tokens per forward/backward), rollout.max_tokens_in_flight (generation), "
    "rollout.group_size / rollout.prompts_per_step (rows per step), rollout.max_new_tokens, "
    "memory.activation_checkpointing=1, or set memory.auto_halve_micro_batch=true"
)


class NonFiniteError(RuntimeError):
    """Too many consecutive updates with NaN/inf loss or gradient."""


def sequence_logprobs(model, batch: RolloutBatch, *, temperature: float, chunk_size: int,
                      with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each completion token under `model`: [b, T] (0 off the completion), entropy likewise.

    Only completion positions go through the LM head (chunked), never the [b, T, V] logits of the prompt.
    """
    hidden = model(batch.input_ids[:, :-1], return_hidden=True)  # [b, T-1, D]
    mask = batch.completion_mask[:, 1:].bool()  # [b, T-1]
    targets = batch.input_ids[:, 1:][mask]  # [N]
    logp, ent = token_logprobs(hidden[mask], model.lm_head.weight, targets, temperature=temperature,
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
    """[B, T] log-probs of all rows, computed micro-batch by micro-batch (old / reference policy)."""
    out = torch.zeros(batch.input_ids.shape)  # [B, T]
    for rows in micro_batches(batch.lengths.tolist(), token_budget):
        idx = torch.tensor(rows)
        sub = batch.select(idx).to(model.device)
        logp, _ = sequence_logprobs(model, sub, temperature=temperature, chunk_size=chunk_size)
        out[idx, : logp.shape[1]] = logp.float().cpu()
    return out


@dataclass
class UpdateStats:
    loss: float
    metrics: dict[str, float]  # token-weighted means of the loss function's metrics
    tokens: int


def accumulate_gradients(model, batch: RolloutBatch, loss_fn, token_budget: int, *, temperature: float,
                         chunk_size: int) -> UpdateStats:
    """One pass: forward/backward every micro-batch, gradients summed in .grad.

    loss_fn(logp [b,T], entropy [b,T], micro_batch, num_tokens) -> (loss, metrics); it must normalise by
    num_tokens (the step's total), which is why the per-micro-batch losses simply add up.
    """
    num_tokens = max(1, batch.active_tokens())
    total_loss, sums = 0.0, {}
    for rows in micro_batches(batch.lengths.tolist(), token_budget):
        sub = batch.select(torch.tensor(rows)).to(model.device)
        logp, ent = sequence_logprobs(model, sub, temperature=temperature, chunk_size=chunk_size,
                                      with_entropy=True)
        loss, metrics = loss_fn(logp, ent, sub, num_tokens)
        loss.backward()
        total_loss += float(loss.detach())
        weight = sub.active_tokens()
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + float(v) * weight
    return UpdateStats(total_loss, {k: v / num_tokens for k, v in sums.items()}, num_tokens)


def clip_and_check(model, max_norm: float) -> float:
    """Global grad norm (clipped to max_norm when > 0). Returns inf/nan untouched so the caller can skip."""
    params = [p for p in model.parameters() if p.grad is not None]
    if max_norm > 0:
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm, error_if_nonfinite=False))
    norms = torch.stack([p.grad.detach().float().norm() for p in params])
    return float(norms.norm())


def is_finite(*values: float) -> bool:
    return all(math.isfinite(v) for v in values)
