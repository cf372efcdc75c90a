"""Update phase of a step: log-probs of rollout rows, micro-batched policy-gradient passes, optimizer step.

Global token normalisation: the loss of every micro-batch is divided by the completion-token count of the
WHOLE optimizer step (computed before the passes), so accumulating gradients over micro-batches gives
exactly the gradient of one big batch, whatever the split.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from ..kernels.onednn import weight_grads_in_place
from ..rl.logprobs import token_logprobs, token_logprobs_with_grads
from ..rl.losses import LossConfig, is_tokenwise, policy_loss
from ..world import World
from .batching import RolloutBatch, plan_micro_batches
from .distributed import accumulating, sum_gradients
from .shared_prompt import shared_prompt_hidden

OOM_KNOBS = (
    "memory.micro_batch_tokens (tokens per forward/backward), rollout.max_tokens_in_flight (generation), "
    "rollout.group_size / rollout.prompts_per_step (rows per step), rollout.max_new_tokens, "
    "memory.activation_checkpointing=1, or set memory.auto_halve_micro_batch=true"
)


class NonFiniteError(RuntimeError):
    """Too many consecutive updates with NaN/inf loss or gradient, or an update that made the weights NaN/inf."""


def weights_finite(model, world: World) -> bool:
    """Every trainable parameter finite (one fused reduction, one host sync); under fsdp2 each rank checks its shards.

    Frozen weights are not checked: no update changes them, and a quantized base (NF4) has no norm kernel.
    """
    params = [p.detach() for p in model.parameters() if p.requires_grad]
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
    bad = bool(local) and not torch.isfinite(torch.stack([n.float() for n in torch._foreach_norm(local)]).sum())
    return world.sum([float(bad)])[0] == 0


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


def _scatter(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """values [N] at the True positions of mask [b, T-1] -> [b, T] (0 elsewhere; position t+1 <- mask[:, t])."""
    out = torch.zeros((mask.shape[0], mask.shape[1] + 1), dtype=values.dtype, device=values.device)  # [b, T]
    out[:, 1:][mask] = values
    return out


def sequence_logprobs(model, batch: RolloutBatch, *, temperature: float, chunk_size: int,
                      with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each completion token under `model`: [b, T] (0 off the completion), entropy likewise.

    Only completion positions go through the LM head (chunked), never the [b, T, V] logits of the prompt.
    """
    hidden, targets, mask = completion_hidden(model, batch)  # [N, D], [N], [b, T-1]
    logp, ent = token_logprobs(hidden, model.lm_head.weight, targets, temperature=temperature,
                               chunk_size=chunk_size, with_entropy=with_entropy)  # [N], [N] | None
    return _scatter(logp, mask), None if ent is None else _scatter(ent, mask)


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
    metrics: dict[str, float]  # policy_loss metrics combined over micro-batches (see combine_metrics)
    tokens: int  # active completion tokens of the step


_SUMMED = ("loss", "pg_loss", "active_tokens", "num_nonfinite")


def combine_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """Micro-batch metrics -> step metrics: sums for additive ones, min / max for ratio and mismatch extremes, and
    an active-token-weighted mean for the rest (kl_mean, entropy_mean, clip fractions, ratio_mean, mismatch)."""
    weight = sum(p["active_tokens"] for p in parts) or 1.0
    out = {}
    for key in parts[0]:
        values = [p[key] for p in parts]
        if key in _SUMMED:
            out[key] = sum(values)
        elif key == "ratio_min":
            out[key] = min(values)
        elif key in ("ratio_max", "mismatch_max_abs"):
            out[key] = max(values)
        else:
            out[key] = sum(v * p["active_tokens"] for v, p in zip(values, parts)) / weight
    return out


def accumulate_gradients(model, batch: RolloutBatch, loss_cfg: LossConfig, token_budget: int, *,
                         temperature: float, chunk_size: int, fused_head: bool = True,
                         totals: tuple[int, int] | None = None) -> UpdateStats:
    """One pass: forward/backward every micro-batch through rl.policy_loss, gradients summed in .grad.

    policy_loss gets the WHOLE step's active tokens and sequences as its normalisers (`totals`, summed over
    ranks when data-parallel; default: this batch's), so the micro-batch losses (and gradients) add up exactly
    to those of one big batch, whatever the split. With `fused_head`
    and a per-token loss (rl.losses.is_tokenwise) the LM head's gradients are computed in its forward pass
    (`_fused_micro_batch`); otherwise autograd runs through the chunked head (`_autograd_micro_batch`).
    """
    if totals is None:  # one process: this batch is the whole step
        totals = (batch.active_tokens(), batch.active_rows())
    totals = (max(1, totals[0]), max(1, totals[1]))
    step = _fused_micro_batch if fused_head and is_tokenwise(loss_cfg) else _autograd_micro_batch
    parts = []
    for rows in plan_micro_batches(batch, token_budget):
        sub = batch.select(torch.tensor(rows)).to(model.device)
        parts.append(step(model, sub, loss_cfg, totals, temperature=temperature, chunk_size=chunk_size))
    combined = combine_metrics(parts)
    return UpdateStats(combined["loss"], combined, totals[0])


def _autograd_micro_batch(model, sub: RolloutBatch, cfg: LossConfig, totals: tuple[int, int], *,
                          temperature: float, chunk_size: int) -> dict[str, float]:
    """Any loss: log-probs with a graph, policy_loss, backward (the head recomputes its logits)."""
    logp, ent = sequence_logprobs(model, sub, temperature=temperature, chunk_size=chunk_size,
                                  with_entropy=True)  # [b, T] each
    loss, metrics = policy_loss(logp, sub.old_logp, sub.ref_logp, sub.advantages, sub.completion_mask, cfg,
                                entropy=ent, sampler_logp=sub.sampler_logp, num_tokens_total=totals[0],
                                num_seqs_total=totals[1])
    loss.backward()
    return metrics


def _fused_micro_batch(model, sub: RolloutBatch, cfg: LossConfig, totals: tuple[int, int], *,
                       temperature: float, chunk_size: int) -> dict[str, float]:
    """Per-token losses: the head yields log-probs and its input gradients in one pass (3 vocab matmuls, not 4).

    The LM-head gradient is added straight into weight.grad, and the embedding's gradient arrives sparse and
    is added into a dense .grad in place: with a tied 151,936 x 512 embedding that keeps two [V, D] temporaries
    (2 x 311 MB) out of every micro-batch. The loss value and metrics come from policy_loss on the
    (graph-free) log-probs, as in the autograd path.
    """
    with _sparse_embedding_grad(model):
        hidden, targets, mask = completion_hidden(model, sub)  # [N, D] (with graph), [N], [b, T-1]
    weight = model.lm_head.weight
    into = _dense_grad(weight) if weight.requires_grad else None
    if into is not None and into.dtype != torch.promote_types(weight.dtype, torch.float32):
        into = None  # bf16 weights: the head accumulates in fp32 and we add once below
    head = token_logprobs_with_grads(
        hidden.detach(), weight.detach(), targets, _token_grad_fn(sub, mask, cfg, totals),
        temperature=temperature, chunk_size=chunk_size, with_entropy=True, weight_grad=weight.requires_grad,
        grad_weight_out=into,
    )
    if weight.requires_grad and into is None:
        weight.grad += head.grad_weight
    logp, ent = _scatter(head.logp, mask), _scatter(head.entropy, mask)  # [b, T] each
    with torch.no_grad():
        _, metrics = policy_loss(logp, sub.old_logp, sub.ref_logp, sub.advantages, sub.completion_mask, cfg,
                                 entropy=ent, sampler_logp=sub.sampler_logp, num_tokens_total=totals[0],
                                 num_seqs_total=totals[1])
    if hidden.requires_grad:
        if model.embed.weight.requires_grad:
            _dense_grad(model.embed.weight)  # so the sparse embedding gradient is added in place
        hidden.backward(head.grad_hidden)
    return metrics


def zero_grads(model) -> None:
    """A zero .grad for every trainable parameter without one: an optimizer step then moves the weights as with a
    zero gradient (Adam's momentum, weight decay) instead of skipping them."""
    for p in model.parameters():
        if p.requires_grad:
            _dense_grad(p)


def _dense_grad(param: torch.Tensor) -> torch.Tensor:
    """param.grad, created as zeros when missing (a dense tensor that gradients are accumulated into)."""
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    return param.grad


@contextlib.contextmanager
def _sparse_embedding_grad(model):
    """Inside: the token embedding's backward yields a sparse gradient (only the rows of the batch's tokens).

    Callers must give embed.weight a dense .grad before backward (`_dense_grad`), so autograd adds the sparse
    rows into it in place instead of building a [V, D] dense temporary.
    """
    embed, before = model.embed, model.embed.sparse
    embed.sparse = embed.weight.requires_grad
    try:
        yield
    finally:
        embed.sparse = before


def _token_grad_fn(sub: RolloutBatch, mask: torch.Tensor, cfg: LossConfig, totals: tuple[int, int]):
    """dL/dlogp and dL/dentropy of the tokens of one head chunk, from policy_loss itself.

    The chunk's values go into a [b, T] log-prob tensor whose other entries are placeholders (the old
    log-probs, or 0); for a per-token loss the gradient at the chunk's positions does not depend on them.
    """
    rows, cols = mask.nonzero(as_tuple=True)  # [N] each, row-major like the head's tokens
    cols = cols + 1  # mask[:, t] marks the token at position t + 1
    placeholder = sub.old_logp if sub.old_logp is not None else torch.zeros(sub.input_ids.shape)  # [b, T]
    wants_entropy_grad = cfg.entropy_coef > 0
    # per chunk only the gradient is kept: sampler log-probs only when the correction needs them, so the mismatch
    # metrics (host syncs) are not recomputed for every chunk; the micro-batch's metrics pass reports them once
    sampler_logp = sub.sampler_logp if cfg.rollout_correction != "none" else None

    def token_grad(start: int, end: int, logp: torch.Tensor, ent: torch.Tensor | None):
        idx = (rows[start:end], cols[start:end])
        with torch.enable_grad():
            lp_leaf = logp.detach().requires_grad_()  # [n]
            full_lp = placeholder.to(device=logp.device, dtype=logp.dtype).index_put(idx, lp_leaf)  # [b, T]
            leaves, full_ent = [lp_leaf], None
            if ent is not None:
                ent_leaf = ent.detach().requires_grad_(wants_entropy_grad)  # [n]
                full_ent = torch.zeros_like(full_lp).index_put(idx, ent_leaf)  # [b, T]
                leaves += [ent_leaf] if wants_entropy_grad else []
            loss, _ = policy_loss(full_lp, sub.old_logp, sub.ref_logp, sub.advantages, sub.completion_mask, cfg,
                                  entropy=full_ent, sampler_logp=sampler_logp, num_tokens_total=totals[0],
                                  num_seqs_total=totals[1])
            grads = torch.autograd.grad(loss, leaves, allow_unused=True)
        g_lp = torch.zeros_like(logp) if grads[0] is None else grads[0]
        return g_lp, grads[1] if len(grads) > 1 else None

    return token_grad


def clip_and_check(model, max_norm: float) -> float:
    """Global grad norm (clipped to max_norm when > 0; sharded gradients included). Returns inf/nan untouched
    so the caller can skip the step."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, error_if_nonfinite=False)
    if hasattr(norm, "full_tensor"):  # a DTensor (FSDP2): the same value on every rank
        norm = norm.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(grads, max_norm, norm)
    return float(norm)


def is_finite(*values: float) -> bool:
    return all(math.isfinite(v) for v in values)


# ----------------------------------------------------------------------------------------------------
# The update phase of a step: mu passes, each ending in one optimizer step


@dataclass
class UpdateOutcome:
    stats: UpdateStats | None  # the last pass's loss and metrics (None when there was nothing to train on)
    grad_norm: float
    skipped: bool  # no optimizer step was taken (empty batch, or a NaN/inf loss or gradient)
    nonfinite: bool  # skipped because the loss or the gradient norm was NaN/inf
    micro_tokens: int  # the micro-batch token budget the passes ran with (halved on CUDA OOM when allowed)
    loss: float = math.nan  # the last pass's loss over all ranks (`stats` is this rank's share, None without rows)


@dataclass(frozen=True)
class UpdateSettings:
    """The config values the update phase reads (memory.*, optimizer.*, algorithm.mu)."""

    loss: LossConfig
    mu: int
    grad_clip: float
    temperature: float
    chunk_size: int
    auto_halve: bool  # memory.auto_halve_micro_batch


def update_policy(model, optimizer, batch: RolloutBatch | None, s: UpdateSettings, micro_tokens: int,
                  message=print, world: World | None = None, totals: tuple[int, int] | None = None) -> UpdateOutcome:
    """mu passes over the batch, each: zero grads, accumulate micro-batches, sum over ranks, clip, check
    finite, step. `totals`: the step's active tokens and rows over all ranks (default: this batch's); a rank
    whose batch is None still takes part (its gradients are zeros) as long as some rank has data.

    A NaN/inf loss or gradient skips the update (no optimizer step: the weights stay as they were); the caller
    counts those and stops the run after optimizer.max_nonfinite_steps in a row.
    """
    world = world or World()
    if totals is None and batch is not None:
        totals = (batch.active_tokens(), batch.active_rows())
    if totals is None:  # no rank has anything to train on
        return UpdateOutcome(None, math.nan, True, False, micro_tokens)
    stats, grad_norm, loss = None, math.nan, math.nan
    for _ in range(s.mu):
        optimizer.zero_grad(set_to_none=True)
        # fsdp2 reduces gradients from autograd hooks, which a gradient written straight into .grad would bypass
        with accumulating(model, world), weight_grads_in_place(world.strategy != "fsdp2"):
            if batch is not None:
                stats, micro_tokens = run_pass(model, batch, s, micro_tokens, message, totals, world.size == 1)
            elif world.size == 1:  # no row carries gradient (every advantage 0): the loss is 0 and the optimizer
                zero_grads(model)  # steps all the same
                stats = UpdateStats(0.0, {}, 0)
        sum_gradients(model, world)
        grad_norm = clip_and_check(model, s.grad_clip)
        loss = world.sum([stats.loss if stats is not None else 0.0])[0]  # each rank's share of the step's loss
        if not is_finite(loss, grad_norm):
            optimizer.zero_grad(set_to_none=True)
            return UpdateOutcome(stats, grad_norm, True, True, micro_tokens, loss)
        optimizer.step()
        if not weights_finite(model, world):  # finite gradients can still overflow the weights (a huge lr)
            raise NonFiniteError(f"the optimizer step made weights NaN/inf (loss {loss:.4g}, grad norm "
                                 f"{grad_norm:.4g}): lower optimizer.lr")
    return UpdateOutcome(stats, grad_norm, False, False, micro_tokens, loss)


def run_pass(model, batch: RolloutBatch, s: UpdateSettings, micro_tokens: int, message,
             totals: tuple[int, int], may_retry: bool = True) -> tuple[UpdateStats, int]:
    """One forward/backward pass over the batch; on CUDA OOM optionally halve the micro-batch and retry (one
    process only: a rank retrying alone would leave the others waiting in a collective)."""
    while True:
        try:
            stats = accumulate_gradients(model, batch, s.loss, micro_tokens, temperature=s.temperature,
                                         chunk_size=s.chunk_size, totals=totals)
            return stats, micro_tokens
        except torch.OutOfMemoryError as e:
            model.zero_grad(set_to_none=True)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            longest = int(batch.lengths.max())
            if not (s.auto_halve and may_retry) or micro_tokens // 2 < longest:
                raise torch.OutOfMemoryError(
                    f"out of memory in the update with memory.micro_batch_tokens={micro_tokens} "
                    f"(longest row {longest} tokens). Lower one of: {OOM_KNOBS}. ({e})") from e
            micro_tokens //= 2
            message(f"out of memory: halving memory.micro_batch_tokens to {micro_tokens} and retrying")
