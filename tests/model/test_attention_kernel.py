"""The decode-step attention kernels: grouped matmuls equal SDPA, the plan's choice reaches every block, and a
decode through either gives the same tokens."""

import pytest
import torch

from grpo_engine.kernels import KernelPlan, activate, apply_kernels
from grpo_engine.kernels.attention import grouped_decode_attention, measure
from grpo_engine.model.hf_io import load_model


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1), (14, 2)])
def test_grouped_decode_attention_equals_sdpa(heads, kv_heads):
    """Grouped matmuls against SDPA with enable_gqa, float64, a key mask with holes."""
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    B, S, D = 5, 11, 8
    q = torch.randn(B, heads, 1, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, kv_heads, S, D, generator=g, dtype=torch.float64) for _ in range(2))
    mask = torch.rand(B, 1, 1, S, generator=g) > 0.4
    mask[..., -1] = True  # a query always sees its own slot
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=heads != kv_heads)
    torch.testing.assert_close(grouped_decode_attention(q, k, v, mask), ref, rtol=0, atol=1e-12)


def test_grouped_decode_attention_on_cache_slices():
    """k and v as the rollout cache hands them over: the first S slots of a longer [B, H_kv, S_max, D] buffer."""
    g = torch.Generator().manual_seed(3)
    B, H, n_kv, S, D = 4, 6, 2, 9, 8
    q = torch.randn(B, H, 1, D, generator=g, dtype=torch.float64)
    k_buf, v_buf = (torch.randn(B, n_kv, S + 5, D, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = k_buf[:, :, :S], v_buf[:, :, :S]
    mask = torch.rand(B, 1, 1, S, generator=g) > 0.3
    mask[..., -1] = True
    ref = torch.nn.functional.scaled_dot_product_attention(q, k.contiguous(), v.contiguous(), attn_mask=mask,
                                                           enable_gqa=True)
    torch.testing.assert_close(grouped_decode_attention(q, k, v, mask), ref, rtol=0, atol=1e-12)


def test_measure_times_both_kernels():
    times = measure(4, 2, 8, lambda fn, reps: (fn(), 0.5)[1])
    assert times == {"sdpa": 1.0, "grouped": 1.0}  # two (rows, slots) shapes each


def test_the_plan_sets_the_decode_attention_of_every_block(tiny_ckpt):
    from grpo_engine.rollout import SamplingParams, generate

    model = load_model(tiny_ckpt, dtype=torch.float64)
    c = model.config
    key = f"{c.num_attention_heads}/{c.num_key_value_heads}/{c.head_dim}"
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=6)
    outs = {}
    try:
        for choice in ("sdpa", "grouped"):
            apply_kernels(model, KernelPlan("cpu", torch.__version__, torch.get_num_threads(), {}, "test",
                                            {key: choice}))
            kernels = {block.attn.decode_attention for block in model.layers}
            assert kernels == ({None} if choice == "sdpa" else {grouped_decode_attention})
            outs[choice] = generate(model, [[1, 2, 3], [4, 5]], params, seed=7)
    finally:
        activate(None)
    assert outs["sdpa"].completion_ids == outs["grouped"].completion_ids
    for a, b in zip(outs["sdpa"].logprobs, outs["grouped"].logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-10)

