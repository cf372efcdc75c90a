"""The attention of a forward with a gradient: grouped matmuls equal SDPA forward and backward, SDPA beyond the
timed sizes, the plan's choice reaches the model's forwards with a gradient and no other, and a training step
through either gives the same loss and gradients."""

import json
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from grpo_engine.kernels import KernelPlan, apply_kernels
from grpo_engine.kernels import attention as kernels
from grpo_engine.kernels.attention import (
    MAX_QUERY_KEYS,
    causal_mask,
    grouped_attention,
    grouped_training_attention,
    measure_training,
    shape_key,
    train_attention_for,
)
from grpo_engine.model.loading import load_model


def _inputs(heads, kv_heads, queries, keys, seed, B=3, D=8):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, heads, queries, D, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(B, kv_heads, keys, D, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    mask = torch.rand(B, 1, queries, keys, generator=g) > 0.4
    mask[..., keys - queries:] |= torch.eye(queries, dtype=torch.bool)  # each query sees its own slot
    return (q, k, v), mask, torch.randn(B, heads, queries, D, generator=g, dtype=torch.float64)


def _forward_backward(fn, inputs, mask, grad):
    out = fn(*inputs, mask)
    return (out, *torch.autograd.grad(out, inputs, grad))


@pytest.mark.parametrize("heads,kv_heads,queries,keys", [(4, 4, 6, 6), (9, 3, 5, 12), (6, 1, 7, 7), (14, 2, 3, 9)])
@pytest.mark.parametrize("masked", [True, False])
def test_grouped_attention_equals_sdpa_forward_and_backward(heads, kv_heads, queries, keys, masked):
    """float64, against SDPA with enable_gqa: a key mask with holes, or causal over the last `queries` of `keys`
    slots (mask None, as a completion after its shared prompt)."""
    inputs, mask, grad = _inputs(heads, kv_heads, queries, keys, seed=heads + queries)
    mask = mask if masked else None
    sdpa_mask = mask if masked else causal_mask(queries, keys)

    def sdpa(q, k, v, _):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask, enable_gqa=heads != kv_heads)

    want = _forward_backward(sdpa, inputs, mask, grad)
    for kernel in (grouped_attention, grouped_training_attention):
        for got, ref in zip(_forward_backward(kernel, inputs, mask, grad), want):
            torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("masked", [True, False])
def test_beyond_the_timed_sizes_sdpa_runs(monkeypatch, masked):
    """Past MAX_QUERY_KEYS the grouped kernel's [B, H, T, S] scores are not materialised: SDPA runs, same result."""
    queries = int(MAX_QUERY_KEYS**0.5) + 1
    inputs, mask, grad = _inputs(4, 2, queries, queries, seed=1, B=1, D=4)
    mask = mask if masked else None
    want = _forward_backward(grouped_attention, inputs, mask, grad)
    monkeypatch.setattr(kernels, "grouped_attention", lambda *a: pytest.fail("the grouped kernel ran"))
    for got, ref in zip(_forward_backward(grouped_training_attention, inputs, mask, grad), want):
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_measure_times_a_forward_and_backward_of_both_kernels_in_the_models_dtype(dtype):
    grads = []

    def race(fns, reps):  # runs each kernel once; 0.5 s for sdpa, 0.25 s for grouped
        return {name: (grads.append(fn()), 0.5 if name == "sdpa" else 0.25)[1] for name, fn in fns.items()}

    assert measure_training(4, 2, 8, race, dtype) == {"sdpa": 1.0, "grouped": 0.5}  # summed over two sizes
    assert len(grads) == 4 and all(len(g) == 3 and g[0].dtype == dtype for g in grads)  # dq, dk, dv


def test_cuda_keeps_sdpa_and_the_cpu_follows_the_plan():
    assert train_attention_for("cuda", "grouped") is None
    assert train_attention_for("cpu", "sdpa") is None
    assert train_attention_for("cpu", "grouped") is grouped_training_attention


def test_plans_recorded_before_the_choice_keep_sdpa():
    plan = KernelPlan("cpu", torch.__version__, 1, {}, "test", train_attention={"4/2/16": "grouped"})
    assert KernelPlan.from_json(plan.to_json(), "checkpoint").train_attention == {"4/2/16": "grouped"}
    older = json.loads(plan.to_json())
    del older["train_attention"]
    assert KernelPlan.from_json(json.dumps(older), "checkpoint").train_attention == {}


def _loss_and_grads(model, ids, mask):
    model.zero_grad()
    logits = model(ids, mask)  # [B, T, V]
    loss = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _counted(kernel, calls: list):
    def run(*args):
        calls.append(1)
        return kernel(*args)
    return run


def test_a_training_forward_runs_the_planned_attention_and_matches_sdpa(tiny_ckpt):
    """float64 model, left-padded batch: the same loss and gradients with either choice; the planned kernel runs in
    every layer of the forward with a gradient and in no forward without one."""
    model = load_model(tiny_ckpt, dtype=torch.float64)
    c = model.config
    key = shape_key(c.num_attention_heads, c.num_key_value_heads, c.head_dim, torch.float64)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, c.vocab_size, (3, 9), generator=g)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, :3] = mask[2, :5] = 0
    results, calls = {}, []
    for choice in ("sdpa", "grouped"):
        apply_kernels(model, KernelPlan("cpu", torch.__version__, torch.get_num_threads(), {}, "test",
                                        train_attention={key: choice}))
        if choice == "grouped":
            model.kernels = replace(model.kernels, train_attention=_counted(model.kernels.train_attention, calls))
        results[choice] = _loss_and_grads(model, ids, mask)
        with torch.no_grad():
            model(ids, mask)
    assert len(calls) == c.num_hidden_layers  # the forward with a gradient only
    torch.testing.assert_close(results["grouped"][0], results["sdpa"][0], rtol=0, atol=1e-12)
    for name, grad in results["sdpa"][1].items():
        torch.testing.assert_close(results["grouped"][1][name], grad, rtol=0, atol=1e-10)
