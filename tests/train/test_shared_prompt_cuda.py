"""GPU path of the shared-prompt update forward: same gradients as the plain forward, and no more memory.

On CUDA the plain forward's causal attention runs in flash attention without a mask; the completion pass of the
shared forward needs a key mask (its prompt's slots), so SDPA picks another kernel. These tests check that this
choice neither changes the numbers nor costs more peak memory than the prompt recomputation it saves.
Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

from grpo_engine.model.loading import load_model
from grpo_engine.rl.losses import LossConfig, resolve
from grpo_engine.train.batch import build_train_batch
from grpo_engine.train.update import accumulate_gradients

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _batch(vocab: int, share: bool):
    """4 prompts of 300-400 tokens x 8 completions of 20-200 tokens."""
    g = torch.Generator().manual_seed(0)
    prompts, comps = [], []
    for p in range(4):
        prompt = torch.randint(0, vocab, (300 + 30 * p,), generator=g).tolist()
        for _ in range(8):
            n = int(torch.randint(20, 200, (1,), generator=g))
            prompts.append(prompt)
            comps.append(torch.randint(0, vocab, (n,), generator=g).tolist())
    adv = torch.randn(len(prompts), generator=g)
    return build_train_batch(
        prompts, comps, [[0.0] * len(c) for c in comps], adv, [True] * len(prompts), 0, share_prompts=share
    )


def _step(model, batch):
    """Gradients and peak allocated memory of one update pass."""
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    accumulate_gradients(model, batch, resolve(LossConfig(loss="grpo", beta=0.0)), 1_000_000, temperature=1.0,
                         chunk_size=1024)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    return {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}, peak


def test_shared_equals_plain_on_gpu_fp32(tiny_ckpt):
    model = load_model(tiny_ckpt, dtype=torch.float32, device="cuda").train()
    vocab = model.config.vocab_size
    g_shared, _ = _step(model, _batch(vocab, True))
    g_plain, _ = _step(model, _batch(vocab, False))
    for name in g_plain:
        torch.testing.assert_close(
            g_shared[name], g_plain[name], rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_shared_needs_no_more_memory_on_gpu_bf16(tiny_ckpt):
    """Each path runs once before it is measured: the first matmuls of a process allocate cuBLAS's workspaces
    (tens of MiB on Hopper, counted by memory_allocated), which would land on whichever path ran first."""
    model = load_model(tiny_ckpt, dtype=torch.bfloat16, device="cuda").train()
    vocab = model.config.vocab_size
    shared, plain = _batch(vocab, True), _batch(vocab, False)
    _step(model, shared)
    _step(model, plain)
    _, peak_shared = _step(model, shared)
    _, peak_plain = _step(model, plain)
    assert peak_shared <= peak_plain, (peak_shared, peak_plain)
