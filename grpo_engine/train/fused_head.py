"""The fused LM-head backward, for per-token losses (rl.losses.is_tokenwise): the head yields the log-probs and
their gradients in one chunked pass (3 vocabulary-sized products instead of 4), so the [N, V] logits are never
held with a graph.

`objective(logp [b, T], entropy=..., sampler_logp=...) -> (loss, metrics)` is the micro-batch's loss with every
other input bound (train/update.py: grpo_loss); it is evaluated once per head chunk for the chunk's gradients
(the other positions hold placeholders, which a per-token loss does not look at) and once for the metrics.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from ..rl.logprobs import HeadGemm, token_logprobs_with_grads
from .batch import RolloutBatch
from .forward import completion_hidden, scatter_completion

Objective = Callable[..., tuple[torch.Tensor, dict[str, float]]]


def fused_head_backward(model, sub: RolloutBatch, objective: Objective, *, temperature: float, chunk_size: int,
                        entropy_grad: bool, correction: bool, gemm: HeadGemm | None = None) -> dict[str, float]:
    """Back-propagate `objective` through the model with the head's gradients from its own pass; returns the
    metrics. entropy_grad: the loss has an entropy term; correction: it reweights by the sampler's log-probs.

    The LM-head gradient is added straight into weight.grad, and the embedding's gradient arrives sparse and is
    added into a dense .grad in place: with a tied 151,936 x 512 embedding that keeps two [V, D] temporaries
    (2 x 311 MB) out of every micro-batch.
    """
    with sparse_embedding_grad(model):
        hidden, targets, mask = completion_hidden(model, sub)  # [N, D] (with graph), [N], [b, T-1]
    weight = model.lm_head.weight
    into = dense_grad(weight) if weight.requires_grad else None
    if into is not None and into.dtype != torch.promote_types(weight.dtype, torch.float32):
        into = None  # bf16 weights: the head accumulates in fp32 and we add once below
    head = token_logprobs_with_grads(
        hidden.detach(), weight.detach(), targets, _token_grad_fn(sub, mask, objective, entropy_grad, correction),
        temperature=temperature, chunk_size=chunk_size, with_entropy=True, weight_grad=weight.requires_grad,
        grad_weight_out=into, gemm=gemm,
    )
    if weight.requires_grad and into is None:
        weight.grad += head.grad_weight
    with torch.no_grad():
        _, metrics = objective(scatter_completion(head.logp, mask), entropy=scatter_completion(head.entropy, mask))
    if hidden.requires_grad:
        if model.embed.weight.requires_grad:
            dense_grad(model.embed.weight)  # so the sparse embedding gradient is added in place
        hidden.backward(head.grad_hidden)
    return metrics


def _token_grad_fn(sub: RolloutBatch, mask: torch.Tensor, objective: Objective, entropy_grad: bool,
                   correction: bool):
    """dL/dlogp and dL/dentropy of the tokens of one head chunk, from the objective itself.

    The chunk's values go into a [b, T] log-prob tensor whose other entries are placeholders (the old
    log-probs, or 0); for a per-token loss the gradient at the chunk's positions does not depend on them.
    """
    rows, cols = mask.nonzero(as_tuple=True)  # [N] each, row-major like the head's tokens
    cols = cols + 1  # mask[:, t] marks the token at position t + 1
    placeholder = sub.old_logp if sub.old_logp is not None else torch.zeros(sub.input_ids.shape)  # [b, T]
    # per chunk only the gradient is kept: sampler log-probs only when the correction needs them, so the mismatch
    # metrics (host syncs) are not recomputed for every chunk; the metrics pass reports them once
    sampler_logp = sub.sampler_logp if correction else None

    def token_grad(start: int, end: int, logp: torch.Tensor, ent: torch.Tensor | None):
        idx = (rows[start:end], cols[start:end])
        with torch.enable_grad():
            lp_leaf = logp.detach().requires_grad_()  # [n]
            full_lp = placeholder.to(device=logp.device, dtype=logp.dtype).index_put(idx, lp_leaf)  # [b, T]
            leaves, full_ent = [lp_leaf], None
            if ent is not None:
                ent_leaf = ent.detach().requires_grad_(entropy_grad)  # [n]
                full_ent = torch.zeros_like(full_lp).index_put(idx, ent_leaf)  # [b, T]
                leaves += [ent_leaf] if entropy_grad else []
            loss, _ = objective(full_lp, entropy=full_ent, sampler_logp=sampler_logp, with_metrics=False)
            grads = torch.autograd.grad(loss, leaves, allow_unused=True)
        g_lp = torch.zeros_like(logp) if grads[0] is None else grads[0]
        return g_lp, grads[1] if len(grads) > 1 else None

    return token_grad


def zero_grads(model) -> None:
    """A zero .grad for every trainable parameter without one: an optimizer step then moves the weights as with a
    zero gradient (Adam's momentum, weight decay) instead of skipping them."""
    for p in model.parameters():
        if p.requires_grad:
            dense_grad(p)


def dense_grad(param: torch.Tensor) -> torch.Tensor:
    """param.grad, created as zeros when missing (a dense tensor that gradients are accumulated into)."""
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    return param.grad


@contextlib.contextmanager
def sparse_embedding_grad(model):
    """Inside: the token embedding's backward yields a sparse gradient (only the rows of the batch's tokens).

    Callers must give embed.weight a dense .grad before backward (`dense_grad`), so autograd adds the sparse
    rows into it in place instead of building a [V, D] dense temporary.
    """
    embed, before = model.embed, model.embed.sparse
    embed.sparse = embed.weight.requires_grad
    try:
        yield
    finally:
        embed.sparse = before
