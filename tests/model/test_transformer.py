"""The model's own contracts: hidden-state output, the KV-cache path (through the decode cache's prompt view,
rollout/static_cache.py), configuration checks."""

import pytest
import torch

from grpo_engine import load_model
from grpo_engine.model.transformer import ModelConfig
from grpo_engine.rollout.static_cache import StaticDecodeState


def empty_cache(model, batch: int, slots: int):
    """The decode cache's plain view: each forward's keys/values at slots [start, start + T) of every row."""
    state = StaticDecodeState(model.config, batch, slots, 1, torch.float32, torch.float32, "cpu")
    return state.prompts(batch)


def test_hidden_states_times_head_are_logits(tiny_ckpt):
    model = load_model(tiny_ckpt)
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        assert torch.allclose(model.lm_head(model(ids, return_hidden=True)), model(ids), atol=1e-6)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama3"])
def test_cached_decode_equals_full_forward(tiny_ckpt_factory, arch):
    """Prefill 6 tokens (one row left-padded by 2), then 4 single-token steps: logits equal a full forward."""
    model = load_model(tiny_ckpt_factory(arch))
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(0))
    key_mask = torch.ones(2, 10, dtype=torch.bool)
    key_mask[1, :2] = False
    cache = empty_cache(model, 2, 10)
    with torch.no_grad():
        full = model(ids, key_mask)
        steps = [model(ids[:, :6], key_mask[:, :6], cache=cache)]
        for t in range(6, 10):
            steps.append(model(ids[:, t : t + 1], key_mask[:, : t + 1], cache=cache))
    cached = torch.cat(steps, dim=1)
    assert cache.start == 10
    assert (cached - full)[key_mask].abs().max().item() < 1e-4


def test_cache_without_mask_is_causal(tiny_ckpt):
    model = load_model(tiny_ckpt)
    ids = torch.randint(0, 256, (1, 7))
    cache = empty_cache(model, 1, 8)
    with torch.no_grad():
        full = model(ids)
        model(ids[:, :4], cache=cache)
        last = torch.cat([model(ids[:, t : t + 1], cache=cache) for t in range(4, 7)], dim=1)
    assert (last - full[:, 4:]).abs().max().item() < 1e-4


def test_mask_length_checked(tiny_ckpt):
    model = load_model(tiny_ckpt)
    with pytest.raises(ValueError, match="attention_mask covers 3 slots, expected cache.start \\+ T = 4"):
        model(torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 3))


def test_heads_must_group():
    with pytest.raises(ValueError, match="num_attention_heads=6 is not a multiple of num_key_value_heads=4"):
        ModelConfig(vocab_size=8, hidden_size=12, intermediate_size=8, num_hidden_layers=1,
                    num_attention_heads=6, num_key_value_heads=4)


def test_grouped_sdpa_attends_like_sdpa_gqa():
    """grouped_sdpa (taken on CUDA when a mask rules out the fused GQA kernels: each KV head's query heads stacked
    along the queries, the bias repeated per group) gives query head h the key/value head h // (H / Hkv), as
    enable_gqa does: the same attention output; changing KV head 1 changes query heads 3, 4, 5 only."""
    from grpo_engine.model.transformer import cuda_attention_bias, grouped_sdpa

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 5, 8, generator=g)  # [B, H, T, D]
    k, v = torch.randn(2, 2, 7, 8, generator=g), torch.randn(2, 2, 7, 8, generator=g)  # [B, Hkv, S, D]
    mask = torch.rand(2, 1, 5, 7, generator=g) > 0.3
    mask[..., 0] = True
    F = torch.nn.functional
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    bias = cuda_attention_bias(mask, torch.float32, groups=3)
    got = grouped_sdpa(q, k, v, bias)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    k2 = k.clone()
    k2[:, 1] += 1.0
    changed = (grouped_sdpa(q, k2, v, bias) - got).abs().amax(dim=(0, 2, 3)) > 0  # [H]
    assert changed.tolist() == [False, False, False, True, True, True]  # heads 3, 4, 5 read kv head 1


def test_cuda_attention_bias_is_the_bool_mask_with_aligned_rows():
    """The additive bias built once per forward: 0 where the bool mask keeps a key, -inf where it drops one,
    rows 16-element aligned (SDPA's memory-efficient kernel would otherwise pad a copy in every layer)."""
    from grpo_engine.model.transformer import cuda_attention_bias

    mask = torch.rand(3, 1, 4, 21, generator=torch.Generator().manual_seed(1)) > 0.5
    bias = cuda_attention_bias(mask, torch.bfloat16)
    assert bias.shape == (3, 1, 4, 21) and bias.dtype == torch.bfloat16
    assert all(s % 16 == 0 for s in bias.stride()[:-1]) and bias.stride(-1) == 1
    assert torch.equal(bias == 0, mask) and torch.equal(torch.isneginf(bias), ~mask)
    stacked = cuda_attention_bias(mask, torch.bfloat16, groups=3)  # the T rows once per query head of a KV head
    assert stacked.shape == (3, 1, 12, 21) and all(s % 16 == 0 for s in stacked.stride()[:-1])
    assert all(torch.equal(stacked[:, :, 4 * g : 4 * g + 4], bias) for g in range(3))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_masked_gqa_forward_and_backward_avoid_the_math_kernel(tiny_ckpt):
    """With a key mask (left padding, the shared-prompt update) and grouped KV heads, SDPA on CUDA falls back to
    the math kernel, which materializes [B, H, T, S] scores; the model must reach a fused kernel instead."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = load_model(tiny_ckpt, dtype=torch.bfloat16, device="cuda").train()
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    ids = torch.randint(0, model.config.vocab_size, (4, 37), device="cuda")
    key_mask = torch.ones(4, 37, dtype=torch.long, device="cuda")
    key_mask[0, :5] = 0  # one left-padded row
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
        fused = model(ids, key_mask)
        fused.float().square().mean().backward()
    with sdpa_kernel([SDPBackend.MATH]):
        math = model(ids, key_mask)
    torch.testing.assert_close(fused.float(), math.float(), rtol=2e-2, atol=2e-2)
