"""The model's own contracts: hidden-state output, the KV-cache path, configuration checks."""

import pytest
import torch

from grpo_engine import load_model
from grpo_engine.model.transformer import ModelConfig
from grpo_engine.rollout.kv_cache import KVCache


def empty_cache(model, batch: int, slots: int):
    return KVCache.allocate(model.config, batch, slots, torch.float32, "cpu")


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
