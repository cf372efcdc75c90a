"""Update phase of a step: mu passes over the batch, each accumulating micro-batch gradients of the GRPO loss and
ending in one optimizer step.

Global token normalisation: the loss of every micro-batch is divided by the completion-token count of the
WHOLE optimizer step (computed before the passes), so accumulating gradients over micro-batches gives
exactly the gradient of one big batch, whatever the split.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass

import torch

from ..rl.losses import ResolvedLoss, is_tokenwise, policy_loss
from ..world import World
from .batch import TrainBatch, plan_micro_batches
from .distributed import accumulating, sum_gradients
from .forward import sequence_logprobs
from .fused_head import FusedHead, zero_grads

OOM_KNOBS = (
    "memory.micro_batch_tokens (tokens per forward/backward), rollout.max_tokens_in_flight (generation), "
    "rollout.group_size / rollout.prompts_per_step (rows per step), rollout.max_new_tokens, "
    "memory.activation_checkpointing=all, or set memory.auto_halve_micro_batch=true"
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


@dataclass
class UpdateStats:
    loss: float  # the pass's loss (micro-batch losses add up to it: each is its share of the whole step)
    metrics: dict[str, float]  # policy_loss metrics combined over micro-batches (see combine_metrics)
    tokens: int  # active completion tokens of the step
    micro_tokens: int = 0  # the micro-batch token budget the pass ended with (halved on CUDA OOM when allowed)


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


def grpo_loss(model, sub: TrainBatch, loss: ResolvedLoss, totals: tuple[int, int], *, temperature: float,
              chunk_size: int, fused: bool) -> dict[str, float]:
    """The GRPO objective of one micro-batch, back-propagated into .grad; returns its metrics.

        L = agg_t[ -surrogate(pi / pi_old, A) ] + beta * agg_t[ KL(pi || pi_ref) ] - entropy_coef * agg_t[ H(pi) ]

    with the ratio, surrogate (clip / CISPO / SAPO), aggregation and KL estimator chosen once from rl.losses'
    tables, and agg_t normalised by the WHOLE step's tokens / sequences (`totals`), so the micro-batches'
    gradients add up to the one-batch gradient.

    `fused` (a per-token loss, rl.losses.is_tokenwise): the fused LM head (train/fused_head.py says what it saves
    and why only per-token losses) yields its chunks one at a time, and L is back-propagated here once per chunk,
    with that chunk's log-probs and entropies in place (the other positions: placeholders that a per-token term
    never reads); the head turns the chunk's gradients into its own, and dL/dhidden goes through the body.
    Otherwise autograd runs through the chunked head (any loss: GSPO's sequence ratio, top-entropy masking).
    """
    objective = functools.partial(
        policy_loss, old_logp=sub.old_logp, ref_logp=sub.ref_logp, advantages=sub.advantages,
        mask=sub.completion_mask, loss=loss, sampler_logp=sub.sampler_logp, num_tokens_total=totals[0],
        num_seqs_total=totals[1])
    if not fused:
        logp, entropy = sequence_logprobs(model, sub, temperature=temperature, chunk_size=chunk_size,
                                          with_entropy=True)  # [b, T] each
        value, metrics = objective(logp, entropy=entropy)
        value.backward()
        return metrics
    head = FusedHead(model, sub, temperature=temperature, chunk_size=chunk_size,
                     entropy_grad=loss.entropy_coef > 0)
    # per chunk the gradient only: the sampler's log-probs only when the correction needs them (the mismatch
    # metrics, host syncs, are computed once below)
    sampler_logp = sub.sampler_logp if loss.rollout_correction != "none" else None
    for chunk in head.chunks():
        logp, entropy = head.place(chunk)  # [b, T] each: the chunk's tokens are leaves
        value, _ = objective(logp, entropy=entropy, sampler_logp=sampler_logp, with_metrics=False)
        value.backward()  # into the chunk's leaves
        head.backward(chunk)  # -> the chunk's rows of dL/dhidden and its share of dL/dweight
    grad_hidden = head.body_grad()  # [N, D] (the head's weight gradient is in weight.grad now)
    with torch.no_grad():
        logp, entropy = head.values()  # [b, T] each
        _, metrics = objective(logp, entropy=entropy)
    if grad_hidden is not None:
        head.hidden.backward(grad_hidden)  # through the transformer body
    return metrics


def accumulate_gradients(model, batch: TrainBatch, loss: ResolvedLoss, token_budget: int, *,
                         temperature: float, chunk_size: int, fused_head: bool = True,
                         totals: tuple[int, int] | None = None, halve_on_oom: bool = False,
                         message=print) -> UpdateStats:
    """One pass: `grpo_loss` of every micro-batch (token budget `token_budget`), gradients summed in .grad.

    `totals`: the WHOLE step's active tokens and sequences (summed over ranks when data-parallel; default: this
    batch's). halve_on_oom: on CUDA OOM, halve the budget and run the pass again (one process only: a rank
    retrying alone would leave the others waiting in a collective); the budget used is in the result.
    """
    if totals is None:  # one process: this batch is the whole step
        totals = (batch.active_tokens(), batch.active_rows())
    totals = (max(1, totals[0]), max(1, totals[1]))
    # the fused LM head (3 vocabulary-sized products per chunk, not 4) is exact for per-token losses only: why in
    # train/fused_head.py
    fused = fused_head and is_tokenwise(loss)
    while True:
        try:
            parts = []
            for rows in plan_micro_batches(batch, token_budget):
                sub = batch.select(torch.tensor(rows)).to(model.device)
                parts.append(grpo_loss(model, sub, loss, totals, temperature=temperature, chunk_size=chunk_size,
                                       fused=fused))
            combined = combine_metrics(parts)
            return UpdateStats(combined["loss"], combined, totals[0], token_budget)
        except torch.OutOfMemoryError as e:
            token_budget = _halved_budget(model, batch, token_budget, halve_on_oom, e, message)


def _halved_budget(model, batch: TrainBatch, budget: int, allowed: bool, error: Exception, message) -> int:
    """The budget for a retry after CUDA OOM, or the OOM again with the knobs that lower memory named."""
    model.zero_grad(set_to_none=True)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    longest = int(batch.lengths.max())
    if not allowed or budget // 2 < longest:
        raise torch.OutOfMemoryError(
            f"out of memory in the update with memory.micro_batch_tokens={budget} "
            f"(longest row {longest} tokens). Lower one of: {OOM_KNOBS}. ({error})") from error
    message(f"out of memory: halving memory.micro_batch_tokens to {budget // 2} and retrying")
    return budget // 2


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

    loss: ResolvedLoss  # the algorithm section's policy loss, resolved once (train/step.py update_settings)
    mu: int
    grad_clip: float
    temperature: float
    chunk_size: int
    auto_halve: bool  # memory.auto_halve_micro_batch
    fused_head: bool = True  # per-token losses take the fused LM-head backward (train/fused_head.py)


# GRADS_FIRST: on the CPU every gradient is allocated (as zeros) before the pass's first micro-batch rather than by
# its backward, among the micro-batch's activations. glibc's heap then keeps the gradients together and their
# release after the update leaves one large hole, not many that later requests do not fit (the peak RSS this saves:
# docs/memory.md). Zeros plus the first micro-batch's gradient are that gradient to the bit.


def update_policy(model, optimizer, batch: TrainBatch | None, s: UpdateSettings, micro_tokens: int,
                  message=print, world: World | None = None, totals: tuple[int, int] | None = None,
                  scheduler=None, keep_grads: bool = False) -> UpdateOutcome:
    """mu passes over the batch, each: accumulate micro-batch gradients, sum over ranks, clip, check finite,
    step; then the LR schedule advances once and the gradients are freed (unless keep_grads), so the next rollout
    does not hold a copy of the weights' size. `totals`: the step's active tokens and
    rows over all ranks (default: this batch's); a rank whose batch is None still takes part (its gradients are
    zeros) as long as some rank has data.

    A NaN/inf loss or gradient skips the update (no optimizer step: the weights stay as they were); the caller
    counts those and stops the run after optimizer.max_nonfinite_steps in a row.
    """
    world = world or World()
    if totals is None and batch is not None:
        totals = (batch.active_tokens(), batch.active_rows())
    outcome = UpdateOutcome(None, math.nan, True, False, micro_tokens)  # no rank has anything to train on
    for _ in range(s.mu if totals is not None else 0):
        optimizer.zero_grad(set_to_none=True)
        if model.device.type == "cpu" and world.strategy != "fsdp2":
            zero_grads(model)  # why: GRADS_FIRST
        # fsdp2 reduces gradients from autograd hooks, which a gradient written straight into .grad would bypass
        with accumulating(model, world), model.kernels.weight_grads_in_place(world.strategy != "fsdp2"):
            if batch is not None:
                outcome.stats = accumulate_gradients(
                    model, batch, s.loss, outcome.micro_tokens, temperature=s.temperature, chunk_size=s.chunk_size,
                    fused_head=s.fused_head, totals=totals, halve_on_oom=s.auto_halve and world.size == 1,
                    message=message)
                outcome.micro_tokens = outcome.stats.micro_tokens
            elif world.size == 1:  # no row carries gradient (every advantage 0): the loss is 0 and the optimizer
                zero_grads(model)  # steps all the same
                outcome.stats = UpdateStats(0.0, {}, 0)
        if not optimizer_step(model, optimizer, s, world, outcome):
            break
    _advance_schedule(scheduler)
    if not keep_grads:
        optimizer.zero_grad(set_to_none=True)
    return outcome


def optimizer_step(model, optimizer, s: UpdateSettings, world: World, outcome: UpdateOutcome) -> bool:
    """Sum the pass's gradients over ranks, clip, and step unless the loss or the norm is NaN/inf; the outcome
    records it. Returns whether the step was taken."""
    sum_gradients(model, world)
    outcome.grad_norm = clip_and_check(model, s.grad_clip)
    stats = outcome.stats
    outcome.loss = world.sum([stats.loss if stats is not None else 0.0])[0]  # each rank's share of the loss
    outcome.nonfinite = outcome.skipped = not (math.isfinite(outcome.loss) and math.isfinite(outcome.grad_norm))
    if outcome.skipped:
        return False
    optimizer.step()
    if not weights_finite(model, world):  # finite gradients can still overflow the weights (a huge lr)
        raise NonFiniteError(f"the optimizer step made weights NaN/inf (loss {outcome.loss:.4g}, grad norm "
                             f"{outcome.grad_norm:.4g}): lower optimizer.lr")
    return True


def _advance_schedule(scheduler) -> None:
    """One LR-schedule step per GRPO step, updated or not (a step whose groups were all filtered still uses up
    its learning rate), so the first step may advance it before any optimizer.step(): torch's warning about that
    order is expected here and silenced."""
    if scheduler is None:
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
        scheduler.step()

