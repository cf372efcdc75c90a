"""Per-token log-probs (and entropy) of given target tokens, computed in chunks of tokens.

Why chunked: a Qwen vocabulary has 151,936 entries, so the logits of 8k completion tokens alone are
8192 x 151936 x 4 bytes = 5 GB in fp32 -- more than the whole model on a consumer GPU. The training loop only
needs one number per token (the log-prob of the sampled token, optionally the entropy), so we compute the
logits a chunk of tokens at a time, reduce them to those numbers, and throw the chunk away. The backward
pass recomputes each chunk's logits from the saved hidden states and LM-head weight (a custom autograd
Function), so the peak extra memory is O(chunk_size x vocab) in both passes instead of O(tokens x vocab).

Temperature: the sampler draws from softmax(logits / T); the importance ratio needs log-probs of the SAME
distribution, so we divide the logits by T here exactly as the sampler does (temperature=1 is a no-op).

Precision: with bf16 hidden states / weights the matmul runs in the input dtype (tensor cores) and the
log-softmax is done in fp32 per chunk; float64 inputs stay float64 (used by the exactness tests).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

DEFAULT_CHUNK_SIZE = 1024


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Log-softmax dtype: at least fp32 (bf16/fp16 -> fp32; fp64 stays fp64)."""
    return torch.promote_types(dtype, torch.float32)


def _chunk_stats(h: torch.Tensor, weight: torch.Tensor, t: torch.Tensor, temperature: float):
    """Scaled logits z [n, V] (compute dtype, a fresh buffer), log-normaliser lse [n], target log-prob [n]."""
    z = h @ weight.t()  # [n, V]
    z = z.to(_compute_dtype(h.dtype))  # no-op for fp32/fp64
    if temperature != 1.0:
        z.div_(temperature)
    lse = torch.logsumexp(z, dim=-1)  # [n]
    logp = z.gather(1, t[:, None]).squeeze(1) - lse  # [n]
    return z, lse, logp


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """logp[i] = log softmax(hidden[i] @ W^T / T)[targets[i]] and entropy[i], chunked over i.

    Saves only (hidden, weight, targets); backward recomputes every chunk's logits. Work buffers are
    updated in place so a chunk costs one or two [chunk, V] tensors at a time.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_size, with_entropy):
        n_tok = hidden.shape[0]
        out_dtype = _compute_dtype(hidden.dtype)
        logp = torch.empty(n_tok, dtype=out_dtype, device=hidden.device)  # [N]
        ent = torch.empty(n_tok, dtype=out_dtype, device=hidden.device) if with_entropy else None  # [N]
        for s in range(0, n_tok, chunk_size):
            e = min(s + chunk_size, n_tok)
            z, lse, lp = _chunk_stats(hidden[s:e], weight, targets[s:e], temperature)
            logp[s:e] = lp
            if with_entropy:
                logp_all = z.sub_(lse[:, None])  # [n, V] log p, in place
                ent[s:e] = -torch.linalg.vecdot(logp_all.exp(), logp_all)  # H = -sum p log p
            del z  # free this chunk's [n, V] before the next one is allocated
        ctx.save_for_backward(hidden, weight, targets)
        ctx.temperature, ctx.chunk_size, ctx.with_entropy = temperature, chunk_size, with_entropy
        # An output the loss never used (entropy logged as a metric only) then arrives in backward as None
        # rather than zeros, so backward skips the entropy-gradient passes over every [chunk, V] buffer.
        ctx.set_materialize_grads(False)
        return logp, ent

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp, grad_ent):
        hidden, weight, targets = ctx.saved_tensors
        temp, chunk = ctx.temperature, ctx.chunk_size
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        cdt = _compute_dtype(hidden.dtype)
        use_ent = grad_ent is not None and ctx.with_entropy
        if grad_logp is None:  # only the entropy was used
            grad_logp = torch.zeros(hidden.shape[0], dtype=cdt, device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_h else None  # [N, D]
        grad_w = torch.zeros(weight.shape, dtype=cdt, device=weight.device) if need_w else None  # [V, D]
        for s in range(0, hidden.shape[0], chunk):
            e = min(s + chunk, hidden.shape[0])
            h, t = hidden[s:e], targets[s:e]
            g_lp = grad_logp[s:e, None].to(cdt)  # [n, 1]
            z, lse, _ = _chunk_stats(h, weight, t, temp)
            logp_all = z.sub_(lse[:, None])  # [n, V] log p, in place
            p = logp_all.exp()  # [n, V]
            # d logp_i / d z_ij = onehot_ij - p_ij
            # d H_i / d z_ij = -p_ij (log p_ij + H_i)
            # => dL/dz_ij = g_lp_i onehot_ij - p_ij (g_lp_i + g_ent_i (log p_ij + H_i))
            if use_ent:
                g_ent = grad_ent[s:e, None].to(cdt)  # [n, 1]
                ent = -torch.linalg.vecdot(p, logp_all)  # [n]
                coef = logp_all.add_(ent[:, None]).mul_(g_ent).add_(g_lp)  # [n, V], reuses the z buffer
                gz = p.mul_(coef).neg_()  # [n, V]
                del coef
            else:
                gz = p.mul_(-g_lp)  # [n, V]
            gz.scatter_add_(1, t[:, None], g_lp)
            if temp != 1.0:
                gz.div_(temp)  # chain rule through z = logits / T
            gz = gz.to(hidden.dtype)  # [n, V]; no-op for fp32/fp64
            if need_h:
                grad_h[s:e] = gz @ weight  # [n, D]
            if need_w:
                if grad_w.dtype == gz.dtype:
                    grad_w.addmm_(gz.t(), h)  # [V, D] += [V, n] @ [n, D], no temporary
                else:
                    grad_w += gz.t() @ h  # bf16 product, fp32 accumulation across chunks
            del z, logp_all, p, gz  # free this chunk's [n, V] buffers before the next chunk
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None, None


def _check_inputs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature, chunk_size):
    if hidden.dim() != 2 or weight.dim() != 2:
        raise ValueError(
            f"token_logprobs expects hidden [N, D] and weight [V, D]; got hidden {tuple(hidden.shape)} and "
            f"weight {tuple(weight.shape)} (flatten the completion positions of [B, T, D] to [N, D] first)"
        )
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden size mismatch: hidden {tuple(hidden.shape)} vs weight {tuple(weight.shape)} (last dims differ)"
        )
    if targets.shape != (hidden.shape[0],):
        raise ValueError(
            f"targets {tuple(targets.shape)} must be [N] with N = hidden.shape[0]; hidden {tuple(hidden.shape)}"
        )
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"targets must be integer token ids, got dtype {targets.dtype}")
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= weight.shape[0]):
        raise ValueError(
            f"target ids must lie in [0, {weight.shape[0]}); got min {int(targets.min())}, max {int(targets.max())}"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (the sampler's temperature), got {temperature}")
    if int(chunk_size) < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each target token under softmax(hidden @ weight^T / temperature), chunked over tokens.

    hidden [N, D] (final-normed hidden states at the positions that PREDICT the targets), weight [V, D]
    (model.lm_head.weight), targets [N] token ids. Returns (logp [N], entropy [N] or None) in
    max(fp32, input dtype). Both outputs are differentiable w.r.t. hidden and weight; the full [N, V] logits
    tensor never exists -- peak extra memory is a few [chunk_size, V] buffers.
    """
    _check_inputs(hidden, weight, targets, temperature, chunk_size)
    logp, ent = _ChunkedTokenLogprobs.apply(
        hidden, weight, targets.long(), float(temperature), int(chunk_size), bool(with_entropy)
    )
    return logp, ent


def naive_token_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference implementation (materialises [N, V]); for tests and benchmarks only."""
    z = (hidden @ weight.t()).to(_compute_dtype(hidden.dtype)) / temperature  # [N, V]
    logp_all = torch.log_softmax(z, dim=-1)  # [N, V]
    ent = -(logp_all.exp() * logp_all).sum(-1)  # [N]
    return logp_all.gather(1, targets.long()[:, None]).squeeze(1), ent
