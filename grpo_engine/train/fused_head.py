"""The fused LM head: for a per-token loss (rl.losses.is_tokenwise), the LM head yields each chunk's log-probs and
then takes the loss's gradients w.r.t. them in the same pass, so it computes 3 vocabulary-sized products per chunk
(logits, dL/dhidden, dL/dweight) instead of autograd's 4 (the logits again in the backward), and never holds the
[N, V] logits with a graph. On the CPU benchmark shape the LM head is most of an update (docs/benchmarks.md).

Why per-token losses only: a chunk's gradients are needed while its softmax is in the buffers, before the later
chunks' log-probs exist. grpo_loss (train/update.py) evaluates the loss over the [b, T] batch with the chunk's
log-probs and entropies in place and the other positions holding placeholders (the old log-probs, or 0); when
every token's term depends on that token alone, the gradient at the chunk's positions does not depend on the
placeholders, so it is exact. GSPO's sequence ratio, top-entropy masking (a quantile over the batch) and a
sequence-level rollout correction couple the tokens: those losses take autograd through the chunked head.
"""

from __future__ import annotations

import contextlib

import torch

from ..rl.logprobs import HeadChunk, head_chunks, head_grads
from .batch import TrainBatch
from .forward import completion_hidden, scatter_completion


class FusedHead:
    """One micro-batch's fused head pass, for grpo_loss: the body's forward is run here (hidden [N, D] with its
    graph); `chunks` yields the head's chunks, `place` puts a chunk's values into [b, T] leaves for the loss,
    `backward` hands the loss's gradients at them to the head, and `body_grad` returns dL/dhidden for the body.

    The LM-head gradient is added straight into weight.grad, and the embedding's gradient arrives sparse and is
    added into a dense .grad in place: with a tied 151,936 x 512 embedding that keeps two [V, D] temporaries
    (2 x 311 MB) out of every micro-batch.
    """

    def __init__(self, model, sub: TrainBatch, *, temperature: float, chunk_size: int, entropy_grad: bool):
        with sparse_embedding_grad(model):
            self.hidden, targets, self.mask = completion_hidden(model, sub)  # [N, D] (with graph), [N], [b, T-1]
        self.model, self.entropy_grad = model, entropy_grad
        weight = model.lm_head.weight
        into = dense_grad(weight) if weight.requires_grad else None  # bf16 too: the head adds in place
        self.out = head_grads(self.hidden.detach(), weight.detach(), targets, temperature=temperature,
                              chunk_size=chunk_size, with_entropy=True, weight_grad=weight.requires_grad,
                              grad_weight_out=into)
        self._chunks = head_chunks(self.hidden.detach(), weight.detach(), targets, self.out, temperature=temperature,
                                   chunk_size=chunk_size, gemm=model.kernels.head,
                                   softcap=model.config.final_logit_softcapping)
        rows, cols = self.mask.nonzero(as_tuple=True)  # [N] each, row-major like the head's tokens
        self.rows, self.cols = rows, cols + 1  # mask[:, t] marks the token at position t + 1
        self.placeholder = sub.old_logp if sub.old_logp is not None else torch.zeros(sub.input_ids.shape)  # [b, T]
        self.leaves: list[torch.Tensor] = []

    def chunks(self):
        return self._chunks

    def place(self, chunk: HeadChunk) -> tuple[torch.Tensor, torch.Tensor]:
        """[b, T] log-probs and entropies with the chunk's tokens as leaves (the entropies' only with an entropy
        term in the loss) and placeholders elsewhere."""
        idx = (self.rows[chunk.start:chunk.end], self.cols[chunk.start:chunk.end])
        lp_leaf = chunk.logp.detach().requires_grad_()  # [n]
        ent_leaf = chunk.entropy.detach().requires_grad_(self.entropy_grad)  # [n]
        logp = self.placeholder.to(device=lp_leaf.device, dtype=lp_leaf.dtype).index_put(idx, lp_leaf)  # [b, T]
        self.leaves = [lp_leaf, ent_leaf]
        return logp, torch.zeros_like(logp).index_put(idx, ent_leaf)  # [b, T] each

    def backward(self, chunk: HeadChunk) -> None:
        """The loss's gradients at the placed leaves (zeros where it left them out) -> the chunk's head gradients."""
        lp_leaf, ent_leaf = self.leaves
        g_lp = lp_leaf.grad if lp_leaf.grad is not None else torch.zeros_like(lp_leaf)
        chunk.backward(g_lp, ent_leaf.grad if self.entropy_grad else None)

    def values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token's log-prob and entropy, [b, T] each (once the chunks are done)."""
        return scatter_completion(self.out.logp, self.mask), scatter_completion(self.out.entropy, self.mask)

    def body_grad(self) -> torch.Tensor | None:
        """dL/dhidden [N, D] for the body's backward (the head's weight gradient is in weight.grad already), None
        when the body has no trainable input."""
        if not self.hidden.requires_grad:
            return None
        if self.model.embed.weight.requires_grad:
            dense_grad(self.model.embed.weight)  # so the sparse embedding gradient is added in place
        return self.out.grad_hidden


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
