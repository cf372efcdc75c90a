"""Per-token log-probs (and entropy) of given target tokens, computed in chunks of tokens.

Why chunked: a Qwen vocabulary has 151,936 entries, so the logits of 8k completion tokens alone are
8192 x 151936 x 4 bytes = 5 GB in fp32 -- more than the whole model on a consumer GPU. The training loop only
needs one number per token (the log-prob of the sampled token, optionally the entropy), so we compute the
logits a chunk of tokens at a time, reduce them to those numbers, and reuse the chunk's buffers for the next
chunk. Peak extra memory is one or two [chunk_size, V] buffers instead of O(tokens x vocab).

Two entry points:
* `token_logprobs`: a custom autograd Function. Its backward recomputes each chunk's logits from the saved
  hidden states and LM-head weight, so one update costs four vocab-sized matmuls (forward, recompute,
  grad-hidden, grad-weight). Works for any loss.
* `token_logprobs_with_grads`: for losses that are a SUM OF PER-TOKEN TERMS (token-level ratios: GRPO, DAPO,
  Dr. GRPO, CISPO, KL, entropy bonus), the loss gradient of token i depends only on token i's own log-prob and
  entropy. The caller passes that per-token gradient as a function, and the gradients w.r.t. hidden and weight
  are computed in the same pass as the log-probs: three vocab-sized matmuls, no recompute. On the CPU
  benchmark shape the LM head is most of an update, so this is the trainer's fast path. `head_chunks` is the
  same pass with the loop handed to the caller: the trainer's grpo_loss evaluates and back-propagates the loss
  of each chunk itself (train/update.py, train/fused_head.py).

The chunk buffers are allocated once per call and written with `out=`: a fresh 150 MB tensor per chunk costs
page faults on every first touch, which made the forward matmul about 2x slower than the same matmul into a
reused buffer on the 2-core CPU machine (see docs/benchmarks.md).

Soft-capping (Gemma 3's final_logit_softcapping c): the logits are c * tanh(logits / c) before the temperature,
as the model's and the sampler's are; the chunk keeps their derivative 1 - tanh^2 in one more [chunk, V] buffer
for the backward (only when c is set).

Temperature: the sampler draws from softmax(logits / T); the importance ratio needs log-probs of the SAME
distribution, so we divide the logits by T here exactly as the sampler does (temperature=1 is a no-op).

Precision: with bf16 hidden states / weights the matmul runs in the input dtype (tensor cores) and the
softmax is done in fp32 per chunk; float64 inputs stay float64 (used by the exactness tests).

GEMMs: the chunk's three products with the head weight (its logits, the input gradient, the weight gradient added
into an fp32 grad_w) run on torch's GEMM unless the caller hands in a `HeadGemm` (`gemm=model.kernels.head`):
kernels/ measures on the machine whether another GEMM (oneDNN on some CPUs) is faster and sets its choice in the
model's `Kernels` (model/kernels_slot.py). The math here imports no kernel code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable

from ..model.kernels_slot import Accumulate, HeadGemm, Product
from ..model.transformer import soft_cap

DEFAULT_CHUNK_SIZE = 1024

# token_grad(start, end, logp [n], entropy [n] | None) -> (dL/dlogp [n], dL/dentropy [n] | None)
TokenGradFn = Callable[[int, int, torch.Tensor, "torch.Tensor | None"], "tuple[torch.Tensor, torch.Tensor | None]"]


def _usable(gemm: HeadGemm | None, hidden: torch.Tensor, weight: torch.Tensor) -> HeadGemm | None:
    """gemm, or None where it does not take these inputs (they run torch's products)."""
    if gemm is None or (gemm.accepts is not None and not gemm.accepts(hidden, weight)):
        return None
    return gemm


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax dtype: at least fp32 (bf16/fp16 -> fp32; fp64 stays fp64)."""
    return torch.promote_types(dtype, torch.float32)


class _ChunkBuffers:
    """Work buffers reused by every chunk: [chunk, V] logits (none when a HeadGemm's `logits` product makes
    them, as oneDNN allocates its own output), log-probabilities, and a few rows of probabilities; and the
    chunk's products with the head weight (`logits`, `grad_input`: a HeadGemm's, or None for torch's).

    On the CPU the log-softmax is written over the logits in place (checked exact in tests), so a chunk
    costs one [chunk, V] buffer; on CUDA the log-softmax gets its own buffer, since in-place use of that
    kernel is not something torch documents. Probabilities are formed a few rows at a time in `q`.
    """

    def __init__(self, chunk: int, vocab: int, dtype: torch.dtype, device: torch.device, n_tok: int,
                 gemm: HeadGemm | None = None, softcap: float | None = None):
        rows = max(1, min(chunk, n_tok))
        self.softcap = softcap
        self.dcap = torch.empty(rows, vocab, dtype=dtype, device=device) if softcap else None  # [chunk, V]
        on_cpu = torch.device(device).type == "cpu"
        self.logits = gemm.logits if gemm is not None else None
        self.grad_input = gemm.grad_input if gemm is not None else None
        self.grad_weight = gemm.grad_weight if gemm is not None else None
        self.z = torch.empty(rows, vocab, dtype=dtype, device=device) if self.logits is None else None  # [chunk, V]
        self.logq = self.z if on_cpu or self.z is None else torch.empty_like(self.z)  # [chunk, V]
        budget = (2 << 20) if on_cpu else (64 << 20)  # bytes: about a core's L2 on the CPU
        self.block = max(1, min(rows, budget // (vocab * (torch.finfo(dtype).bits // 8))))
        self.q = torch.empty(self.block, vocab, dtype=dtype, device=device)  # [block, V] probabilities


@dataclass
class _Chunk:
    """One chunk's softmax; `logq` is a view of the shared buffer."""

    logq: torch.Tensor  # [n, V] log softmax(z), z = logits / T
    logp: torch.Tensor  # [n] log-prob of the target token
    ent: torch.Tensor | None  # [n] entropy H = -sum_j q_j log q_j
    bufs: _ChunkBuffers
    dcap: torch.Tensor | None = None  # [n, V] d capped / d raw logits = 1 - tanh^2 (soft-capping only)


def _softmax_chunk(h, weight, t, temperature: float, bufs: _ChunkBuffers, with_entropy: bool) -> _Chunk:
    """Logits of h [n, D] into the buffers, reduced to log-probs of t [n] (and entropies).

    torch's fused log_softmax works row by row in cache, and the entropy is summed a few rows at a time,
    so the [n, V] chunk crosses memory a handful of times instead of once per elementwise op.
    """
    n = h.shape[0]
    if bufs.logits is not None:  # the GEMM kernels/ chose for the head's forward
        z = bufs.logits(h, weight)  # [n, V], a fresh buffer
    else:
        z = bufs.z[:n]  # [n, V]
        if h.dtype == z.dtype:
            torch.mm(h, weight.t(), out=z)
        else:
            z.copy_(h @ weight.t())  # bf16 matmul, fp32 softmax
    dcap = bufs.dcap[:n] if bufs.softcap else None  # [n, V]: the cap's derivative 1 - tanh^2, for the backward
    soft_cap(z, bufs.softcap or None, inplace=True, derivative=dcap)  # z = c * tanh(z / c)
    if temperature != 1.0:
        z.div_(temperature)
    logq = torch.log_softmax(z, dim=-1, out=z if bufs.logq is None else bufs.logq[:n])  # [n, V]
    logp = logq.gather(1, t[:, None]).squeeze(1)  # [n]
    ent = None
    if with_entropy:
        ent = torch.empty(n, dtype=z.dtype, device=z.device)  # [n]
        for r0, r1 in _chunks(n, bufs.block):
            q = torch.exp(logq[r0:r1], out=bufs.q[: r1 - r0])  # [r, V]
            ent[r0:r1] = -_row_dot(q, logq[r0:r1])
    return _Chunk(logq, logp, ent, bufs, dcap)


def _row_dot(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """sum_j x_ij y_ij per row, [n, V] x [n, V] -> [n], with no [n, V] temporary.

    torch.linalg.vecdot (and (x * y).sum(-1)) materialise the [n, V] product first. On the CPU, one BLAS dot per
    row (n is a few cache-sized rows): 10-16x faster than a batched [1, V] x [V, 1] matmul there
    (docs/benchmarks.md); on a GPU one batched matmul, not n kernel launches.
    """
    if x.device.type == "cpu":
        return torch.stack([torch.dot(a, b) for a, b in zip(x, y, strict=True)])
    return torch.bmm(x[:, None, :], y[:, :, None]).view(-1)


def _logit_grad(c: _Chunk, t, g_lp, g_ent, temperature: float) -> torch.Tensor:
    """dL/dlogits [n, V] (in place in c.logq) from dL/dlogp g_lp [n] and dL/dH g_ent [n] or None.

    d logp_i / d z_ij = onehot_ij - q_ij and d H_i / d z_ij = -q_ij (log q_ij + H_i), so
    dL/dz_ij = g_lp_i onehot_ij - q_ij (g_lp_i + g_ent_i (log q_ij + H_i)); logits = T z adds a 1/T.
    """
    x = c.logq  # [n, V]
    g_lp = g_lp.to(x.dtype)[:, None]  # [n, 1]
    if g_ent is None:
        gz = x.exp_().mul_(-g_lp)  # [n, V]
    else:
        g_ent = g_ent.to(x.dtype)[:, None]  # [n, 1]
        for r0, r1 in _chunks(x.shape[0], c.bufs.block):
            q = torch.exp(x[r0:r1], out=c.bufs.q[: r1 - r0])  # [r, V]
            x[r0:r1].add_(c.ent[r0:r1, None]).mul_(g_ent[r0:r1]).add_(g_lp[r0:r1]).mul_(q).neg_()
        gz = x
    gz.scatter_add_(1, t[:, None], g_lp)
    if temperature != 1.0:
        gz.div_(temperature)
    if c.dcap is not None:  # through the soft cap
        gz.mul_(c.dcap)
    return gz


def _apply_logit_grad(gz, h, weight, grad_h_rows, grad_w, grad_input: Product | None = None,
                      grad_weight: Accumulate | None = None) -> None:
    """grad_h_rows [n, D] = gz @ W (by `grad_input` when given) and grad_w [V, D] += gz^T h (by `grad_weight`
    when given and grad_w is a contiguous tensor of gz's dtype), skipping either when it is None."""
    gz = gz.to(h.dtype)  # [n, V]; no-op for fp32/fp64
    if grad_h_rows is not None:
        if grad_input is not None:  # the GEMM kernels/ chose for this weight's input gradient
            grad_h_rows.copy_(grad_input(gz, weight))  # [n, V] @ [V, D]
        else:
            torch.mm(gz, weight, out=grad_h_rows)
    if grad_w is not None:
        if grad_weight is not None and grad_w.dtype == gz.dtype and grad_w.is_contiguous():
            grad_weight(grad_w, gz, h)  # the kernel plan's accumulation
        elif grad_w.dtype == gz.dtype:
            grad_w.addmm_(gz.t(), h)  # [V, D] += [V, n] @ [n, D], no temporary
        else:
            grad_w += gz.t() @ h  # bf16 product, fp32 accumulation across chunks


def _chunks(n_tok: int, chunk: int):
    for s in range(0, n_tok, chunk):
        yield s, min(s + chunk, n_tok)


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """logp[i] = log softmax(hidden[i] @ W^T / T)[targets[i]] and entropy[i], chunked over i.

    Saves only (hidden, weight, targets); backward recomputes every chunk's logits.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_size, with_entropy, gemm, softcap):
        n_tok, cdt = hidden.shape[0], _compute_dtype(hidden.dtype)
        logp = torch.empty(n_tok, dtype=cdt, device=hidden.device)  # [N]
        ent = torch.empty(n_tok, dtype=cdt, device=hidden.device) if with_entropy else None  # [N]
        bufs = _ChunkBuffers(chunk_size, weight.shape[0], cdt, hidden.device, n_tok, gemm, softcap)
        for s, e in _chunks(n_tok, chunk_size):
            c = _softmax_chunk(hidden[s:e], weight, targets[s:e], temperature, bufs, with_entropy)
            logp[s:e] = c.logp
            if with_entropy:
                ent[s:e] = c.ent
        ctx.save_for_backward(hidden, weight, targets)
        ctx.temperature, ctx.chunk_size, ctx.with_entropy, ctx.gemm = temperature, chunk_size, with_entropy, gemm
        ctx.softcap = softcap
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
        n_tok, cdt = hidden.shape[0], _compute_dtype(hidden.dtype)
        use_ent = grad_ent is not None and ctx.with_entropy
        if grad_logp is None:  # only the entropy was used
            grad_logp = torch.zeros(n_tok, dtype=cdt, device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_h else None  # [N, D]
        grad_w = torch.zeros(weight.shape, dtype=cdt, device=weight.device) if need_w else None  # [V, D]
        bufs = _ChunkBuffers(chunk, weight.shape[0], cdt, hidden.device, n_tok, ctx.gemm, ctx.softcap)
        for s, e in _chunks(n_tok, chunk):
            h, t = hidden[s:e], targets[s:e]
            c = _softmax_chunk(h, weight, t, temp, bufs, use_ent)
            gz = _logit_grad(c, t, grad_logp[s:e], grad_ent[s:e] if use_ent else None, temp)
            _apply_logit_grad(gz, h, weight, grad_h[s:e] if need_h else None, grad_w, bufs.grad_input,
                              bufs.grad_weight)
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None, None, None, None


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
    gemm: HeadGemm | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each target token under softmax(hidden @ weight^T / temperature), chunked over tokens.

    hidden [N, D] (final-normed hidden states at the positions that PREDICT the targets), weight [V, D]
    (model.lm_head.weight), targets [N] token ids. Returns (logp [N], entropy [N] or None) in
    max(fp32, input dtype). Both outputs are differentiable w.r.t. hidden and weight; the full [N, V] logits
    tensor never exists -- peak extra memory is one (CPU) or two (CUDA) [chunk_size, V] buffers.
    gemm: the head's GEMMs (`model.kernels.head`), None for torch's.
    softcap: the model's final_logit_softcapping (logits c * tanh(logits / c) before the temperature), or None.
    """
    _check_inputs(hidden, weight, targets, temperature, chunk_size)
    logp, ent = _ChunkedTokenLogprobs.apply(
        hidden, weight, targets.long(), float(temperature), int(chunk_size), bool(with_entropy),
        _usable(gemm, hidden, weight), softcap
    )
    return logp, ent


@dataclass
class HeadGrads:
    """What `token_logprobs_with_grads` returns: values and the loss's gradients w.r.t. the head inputs."""

    logp: torch.Tensor  # [N] log-prob of each target (no autograd graph)
    entropy: torch.Tensor | None  # [N] entropy of each position's distribution, when asked for
    grad_hidden: torch.Tensor  # [N, D] dL/dhidden, in hidden's dtype
    grad_weight: torch.Tensor | None  # [V, D] dL/dweight: weight's dtype, or grad_weight_out; None if not asked


@torch.no_grad()
def token_logprobs_with_grads(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    token_grad: TokenGradFn,
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    with_entropy: bool = False,
    weight_grad: bool = True,
    grad_weight_out: torch.Tensor | None = None,
    gemm: HeadGemm | None = None,
    softcap: float | None = None,
) -> HeadGrads:
    """Log-probs (and entropies) of the targets AND the gradients of a per-token loss, in one chunked pass.

    `token_grad(start, end, logp [n], entropy [n] | None)` returns dL/dlogp [n] and dL/dentropy [n] (or None)
    for tokens start..end-1, where L is the caller's loss. This is exact only when L is a sum of per-token
    terms, each a function of that token's log-prob and entropy alone (token-level importance ratios, KL,
    entropy bonus; not GSPO's sequence ratio, not a quantile over the batch). The caller then sends
    grad_hidden back through the body (`torch.autograd.backward`) and adds grad_weight to the LM head.

    grad_weight_out: a [V, D] tensor in the compute dtype (e.g. the fp32 weight's .grad) that dL/dweight is
    ADDED to in place and returned as grad_weight -- no second [V, D] buffer (311 MB for Qwen's vocabulary).
    gemm: the head's GEMMs (`model.kernels.head`), None for torch's.
    """
    out = head_grads(hidden, weight, targets, temperature=temperature, chunk_size=chunk_size,
                     with_entropy=with_entropy, weight_grad=weight_grad, grad_weight_out=grad_weight_out)
    for c in head_chunks(hidden, weight, targets, out, temperature=temperature, chunk_size=chunk_size, gemm=gemm,
                         softcap=softcap):
        c.backward(*token_grad(c.start, c.end, c.logp, c.entropy))
    if out.grad_weight is not None and grad_weight_out is None:
        out.grad_weight = out.grad_weight.to(weight.dtype)
    return out


def head_grads(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, temperature: float,
               chunk_size: int, with_entropy: bool, weight_grad: bool,
               grad_weight_out: torch.Tensor | None = None) -> HeadGrads:
    """The inputs checked and the outputs of a fused head pass allocated (`head_chunks` fills them): grad_weight is
    grad_weight_out when given (added to in place), else zeros in the compute dtype; None without weight_grad.
    grad_weight_out may be in the compute dtype or in the weight's: a bf16 weight's .grad takes each chunk's product
    in place (one bf16 rounding per chunk, as autograd accumulates the body's bf16 gradients) instead of an fp32
    [V, D] sum plus a bf16 [V, D] product per chunk (at a 151,936-token vocabulary those took 750 MiB more peak RSS
    and 31% more time per GRPO step on a 2-core CPU: docs/benchmarks.md)."""
    _check_inputs(hidden, weight, targets, temperature, chunk_size)
    n_tok, cdt = hidden.shape[0], _compute_dtype(hidden.dtype)
    logp = torch.empty(n_tok, dtype=cdt, device=hidden.device)  # [N]
    ent = torch.empty(n_tok, dtype=cdt, device=hidden.device) if with_entropy else None  # [N]
    grad_w = None
    if weight_grad:
        grad_w = grad_weight_out if grad_weight_out is not None else torch.zeros(weight.shape, dtype=cdt,
                                                                                 device=weight.device)  # [V, D]
        if grad_w.shape != weight.shape or grad_w.dtype not in (cdt, weight.dtype):
            raise ValueError(f"grad_weight_out must be {tuple(weight.shape)} {cdt} or {weight.dtype}, got "
                             f"{tuple(grad_w.shape)} {grad_w.dtype}")
    return HeadGrads(logp, ent, torch.empty_like(hidden), grad_w)  # grad_hidden [N, D]


@dataclass
class HeadChunk:
    """One chunk of `head_chunks`: tokens start..end-1 with their values, and `backward(dL/dlogp [n], dL/dentropy
    [n] | None)`, which writes the chunk's rows of dL/dhidden and adds its share of dL/dweight (two of the head's
    three vocabulary-sized products; the logits were the first)."""

    start: int
    end: int
    logp: torch.Tensor  # [n] (no autograd graph)
    entropy: torch.Tensor | None  # [n]
    backward: Callable[[torch.Tensor, torch.Tensor | None], None]


def head_chunks(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, out: HeadGrads, *,
                temperature: float, chunk_size: int, gemm: HeadGemm | None = None, softcap: float | None = None):
    """The pass of `token_logprobs_with_grads` with the loop handed to the caller, who evaluates the loss of each
    yielded chunk itself and calls chunk.backward with its gradients before asking for the next chunk (which
    reuses the buffers). Fills `out` (from `head_grads`). hidden and weight must hold no autograd graph (detach
    them): the pass records none and does not change the grad mode, which would leak out of a generator."""
    with_entropy, t_all = out.entropy is not None, targets.long()
    bufs = _ChunkBuffers(chunk_size, weight.shape[0], out.logp.dtype, hidden.device, hidden.shape[0],
                         _usable(gemm, hidden, weight), softcap)
    for s, e in _chunks(hidden.shape[0], chunk_size):
        h, t = hidden[s:e], t_all[s:e]
        c = _softmax_chunk(h, weight, t, temperature, bufs, with_entropy)
        out.logp[s:e] = c.logp
        if with_entropy:
            out.entropy[s:e] = c.ent

        def backward(g_lp, g_ent, c=c, h=h, t=t, s=s, e=e):
            gz = _logit_grad(c, t, g_lp, g_ent if with_entropy else None, temperature)
            _apply_logit_grad(gz, h, weight, out.grad_hidden[s:e], out.grad_weight, bufs.grad_input,
                              bufs.grad_weight)

        yield HeadChunk(s, e, c.logp, c.ent, backward)
