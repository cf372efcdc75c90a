"""The training attention of a masked batch with grouped KV heads on CUDA (model/transformer.py grouped_sdpa: each KV
head's query heads stacked along the queries, one additive bias per forward): run here on CPU tensors, it keeps for
the backward exactly what the planner counts per token and block (plan/memory.py training_attention_elements: the
stacked q, K and V once per KV head, the output; no per-head K/V copies), plus the forward's bias
(attention_bias_bytes); on CUDA the same against torch.cuda.memory_allocated."""

from __future__ import annotations

import pytest
import torch

from grpo_engine.model.config import ModelConfig
from grpo_engine.model.transformer import cuda_attention_bias, grouped_sdpa
from grpo_engine.plan.memory import attention_bias_bytes, training_attention_elements

CFG = ModelConfig(vocab_size=64, hidden_size=96, intermediate_size=64, num_hidden_layers=1, num_attention_heads=6,
                  num_key_value_heads=2)  # head_dim 16, G = 3


def _inputs(B: int, T: int, device: str, dtype: torch.dtype):
    """q as the model lays it out ([B, T, H, D] projections transposed to [B, H, T, D]), k and v [B, H_kv, T, D], a
    left-padded causal mask's bias stacked for G = 3."""
    g = torch.Generator(device=device).manual_seed(0)
    H, n_kv, D = CFG.num_attention_heads, CFG.num_key_value_heads, CFG.head_dim
    q = torch.randn(B, T, H, D, generator=g, device=device, dtype=dtype).transpose(1, 2).requires_grad_()
    k, v = (torch.randn(B, n_kv, T, D, generator=g, device=device, dtype=dtype).requires_grad_() for _ in range(2))
    real = torch.arange(T, device=device)[None, :] >= torch.tensor([[0], [5]], device=device)[:B]  # [B, T]
    mask = torch.ones(T, T, dtype=torch.bool, device=device).tril() & real[:, None, :]
    mask |= torch.eye(T, dtype=torch.bool, device=device)  # a padding query sees itself
    return q, k, v, cuda_attention_bias(mask[:, None], dtype, groups=H // n_kv)


def test_what_the_cuda_training_attention_keeps_is_the_planners_count():
    B, T = 2, 40
    q, k, v, bias = _inputs(B, T, "cpu", torch.float32)
    kept: dict[int, int] = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = grouped_sdpa(q, k, v, bias)
    bias_bytes = kept.pop(bias.untyped_storage().data_ptr())
    assert bias_bytes == attention_bias_bytes(CFG, B, T, 4)
    tokens, small = B * T, 4 * 2 * CFG.num_attention_heads  # the log-sum-exp: [B, H, T] fp32, per token H floats
    per_token = [n for n in kept.values() if n > small * tokens]
    assert sum(per_token) == training_attention_elements(CFG) * tokens * 4
    assert sum(kept.values()) - sum(per_token) <= small * tokens
    assert q.untyped_storage().data_ptr() not in kept  # the RoPE output is not kept: its stacked copy is
    assert k.untyped_storage().data_ptr() in kept and v.untyped_storage().data_ptr() in kept  # once per KV head
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias[:, :, :T] == 0, enable_gqa=True)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-5)
    out.sum().backward()  # the backward runs through the stacked form
    assert q.grad.shape == q.shape and k.grad.shape == k.shape


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_attention_allocates_what_the_planner_counts_and_the_model_takes_it(monkeypatch):
    """bf16 on CUDA: the memory a training attention call leaves allocated (its output and what it keeps: the
    stacked q, the output, the log-sum-exp) is the planner's 2 q + 2 kv minus the inputs K and V and the RoPE output
    q it replaces, within 5% + 1 MiB; the peak of its forward and backward stays under twice that plus the inputs'
    gradients; and a masked forward of a GQA model on CUDA runs grouped_sdpa in every block."""
    from grpo_engine.model import transformer
    from grpo_engine.model.transformer import Transformer

    B, T = 4, 512
    q, k, v, bias = _inputs(2, T, "cuda", torch.bfloat16)
    q, k, v = (t.detach().repeat(2, 1, 1, 1).requires_grad_() for t in (q, k, v))
    bias = bias.repeat(2, 1, 1, 1)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = grouped_sdpa(q, k, v, bias)
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - before
    q_bytes = q.numel() * 2
    planned = training_attention_elements(CFG) * B * T * 2 - 2 * k.numel() * 2 - q_bytes  # stacked q + output
    assert kept <= 1.05 * planned + 2**20, (kept, planned)
    out.backward(torch.ones_like(out))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    grads = q_bytes + 2 * k.numel() * 2  # q.grad, k.grad, v.grad
    # kept (2 q) + the output's gradient and the stacked q's (2 q) + the inputs' gradients; K and V copied to every
    # query head would add 2 q kept and 2 q of their gradients
    assert peak <= 2 * planned + grads + 4 * 2**20, (peak, planned, grads)
    calls = []
    real = transformer.grouped_sdpa
    monkeypatch.setattr(transformer, "grouped_sdpa", lambda *a: calls.append(1) or real(*a))
    cfg = ModelConfig(vocab_size=64, hidden_size=96, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2)
    model = Transformer(cfg).to("cuda", torch.bfloat16)
    ids = torch.randint(0, 64, (2, 16), device="cuda")
    attention = torch.ones(2, 16, dtype=torch.long, device="cuda")
    attention[1, :4] = 0
    model(ids, attention).float().sum().backward()
    assert len(calls) == 2
