"""The decode-step attention kernels: grouped matmuls equal SDPA, the plan's choice reaches every block, and a
decode through either gives the same tokens."""

import pytest
import torch

from grpo_engine.kernels import KernelPlan, apply_kernels, select
from grpo_engine.kernels.attention import (
    grouped_attention,
    grouped_training_attention,
    measure,
    parse_key,
    shape_key,
)
from grpo_engine.model.loading import load_model


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1), (14, 2)])
def test_grouped_attention_equals_sdpa(heads, kv_heads):
    """Grouped matmuls against SDPA with enable_gqa, float64, a key mask with holes."""
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    B, S, D = 5, 11, 8
    q = torch.randn(B, heads, 1, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, kv_heads, S, D, generator=g, dtype=torch.float64) for _ in range(2))
    mask = torch.rand(B, 1, 1, S, generator=g) > 0.4
    mask[..., -1] = True  # a query always sees its own slot
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=heads != kv_heads)
    torch.testing.assert_close(grouped_attention(q, k, v, mask), ref, rtol=0, atol=1e-12)


def test_grouped_attention_on_cache_slices():
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
    torch.testing.assert_close(grouped_attention(q, k, v, mask), ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_measure_times_both_kernels_in_the_models_dtype(dtype):
    out_dtypes = []

    def race(fns, reps):  # runs each kernel once; 0.5 s for sdpa, 0.25 s for grouped
        return {name: (out_dtypes.append(fn().dtype), 0.5 if name == "sdpa" else 0.25)[1] for name, fn in fns.items()}

    times = measure(4, 2, 8, race, dtype)
    assert times == {"sdpa": 1.0, "grouped": 0.5}  # summed over two (rows, slots) shapes, timed in turns
    assert out_dtypes == [dtype] * 4


def test_keys_name_the_dtype_except_fp32():
    assert shape_key(9, 3, 64) == "9/3/64"  # as fp32 plans in caches and checkpoints already name it
    assert shape_key(9, 3, 64, torch.bfloat16) == "9/3/64 bfloat16"
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        assert parse_key(shape_key(14, 2, 64, dtype)) == (14, 2, 64, dtype)


def test_a_bf16_model_gets_its_attentions_timed_in_bf16(tiny_ckpt, tmp_path, monkeypatch):
    """The plan of a bf16 CPU model times the decode attention and the training attention at its dtype (SDPA's bf16
    decode path and backward are far slower than the grouped matmuls on some CPUs), once each (then from the
    cache), and apply_kernels sets the winners."""
    for name in ("GRPO_KERNELS", "GRPO_ONEDNN"):
        monkeypatch.delenv(name, raising=False)
    timed = []
    monkeypatch.setattr(select, "measure_attention", lambda key: timed.append(("decode", key)) or "grouped")
    monkeypatch.setattr(select, "measure_train_attention", lambda key: timed.append(("train", key)) or "grouped")
    model = load_model(tiny_ckpt, dtype=torch.bfloat16)
    c = model.config
    plan = select.choose_plan(model, tmp_path / "kernels.json")
    again = select.choose_plan(model, tmp_path / "kernels.json")  # from the cache: nothing timed
    apply_kernels(model, plan)
    key = f"{c.num_attention_heads}/{c.num_key_value_heads}/{c.head_dim} bfloat16"
    if plan.source == "forced":  # no oneDNN in this torch build: plain torch, SDPA
        assert plan.attention == plan.train_attention == {key: "sdpa"} and model.kernels.train_attention is None
        return
    assert timed == [("decode", key), ("train", key)] and plan.gemm == {}  # no fp32 weights to time
    assert plan.attention == plan.train_attention == again.train_attention == {key: "grouped"}
    assert model.kernels.decode_attention is grouped_attention
    assert model.kernels.train_attention is grouped_training_attention


def test_the_plan_sets_the_decode_attention_of_the_model(tiny_ckpt):
    from grpo_engine.rollout import SamplingParams, generate

    model = load_model(tiny_ckpt, dtype=torch.float64)
    c = model.config
    key = shape_key(c.num_attention_heads, c.num_key_value_heads, c.head_dim, torch.float64)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=6)
    outs = {}
    for choice in ("sdpa", "grouped"):
        apply_kernels(model, KernelPlan("cpu", torch.__version__, torch.get_num_threads(), {}, "test",
                                        {key: choice}))
        assert model.kernels.decode_attention is (None if choice == "sdpa" else grouped_attention)
        outs[choice] = generate(model, [[1, 2, 3], [4, 5]], params, seed=7)
    assert outs["sdpa"].completion_ids == outs["grouped"].completion_ids
    for a, b in zip(outs["sdpa"].logprobs, outs["grouped"].logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-10)

