"""The LM head's GEMMs reach rl/ and rollout/ from outside: kernels.apply_kernels sets what its plan chose in the
model's Kernels (model.kernels.head, model.kernels.decode), the log-prob head and the decode loop run those products
when handed them and torch's otherwise, with the same numbers."""

import pytest
import torch

from grpo_engine.kernels import KernelPlan, apply_kernels, onednn
from grpo_engine.kernels.select import shape_key, weight_shapes
from grpo_engine.model.kernels_slot import DecodeKernels
from grpo_engine.model.loading import load_model
from grpo_engine.rl.logprobs import token_logprobs, token_logprobs_with_grads
from grpo_engine.rollout import SamplingParams, generate

needs_onednn = pytest.mark.skipif(not onednn.op_works(), reason="oneDNN's linear op is not available")


def _plan(model, head: str, grad_input: str = "torch", decode: str = "torch") -> KernelPlan:
    """Every projection on torch's GEMM; the LM head's log-prob forward, input gradient and decode product as given."""
    shapes = [shape_key(s) for s in weight_shapes(model)]
    v_d = shape_key(tuple(model.lm_head.weight.shape))
    return KernelPlan("cpu", torch.__version__, 1, {**dict.fromkeys(shapes, "torch"), v_d: decode},
                      grad_input={v_d: grad_input}, logprob_head={v_d: head})


def _record_onednn(monkeypatch) -> list[tuple[int, ...]]:
    """The weight shapes of the products that ran on oneDNN."""
    calls, real = [], onednn._op
    monkeypatch.setattr(onednn, "_op", lambda x, w, b=None: calls.append(tuple(w.shape)) or real(x, w, b))
    return calls


def _head_pass(model, gemm):
    """Both entry points on random head inputs: (logp, entropy, grad hidden, grad weight) of each."""
    w = model.lm_head.weight.detach()  # [V, D]
    g = torch.Generator().manual_seed(4)
    h, t = torch.randn(37, w.shape[1], generator=g), torch.randint(0, w.shape[0], (37,), generator=g)  # [N, D], [N]
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    lp, ent = token_logprobs(hh, ww, t, chunk_size=8, with_entropy=True, gemm=gemm)
    (lp - 0.5 * ent).sum().backward()
    fused = token_logprobs_with_grads(h, w, t, lambda s, e, lp_, ent_: (torch.ones_like(lp_),
                                                                        torch.full_like(ent_, -0.5)),
                                      chunk_size=8, with_entropy=True, gemm=gemm)
    return [lp, ent, hh.grad, ww.grad, fused.logp, fused.entropy, fused.grad_hidden, fused.grad_weight]


@needs_onednn
@pytest.mark.parametrize("head,grad_input", [("onednn", "onednn"), ("onednn", "torch"), ("torch", "onednn"),
                                             ("torch", "torch")])
def test_log_prob_head_runs_the_gemms_apply_kernels_set(tiny_ckpt, monkeypatch, head, grad_input):
    model = load_model(tiny_ckpt)
    assert model.kernels.head is None  # never through apply_kernels: torch's products
    calls = _record_onednn(monkeypatch)
    plain = _head_pass(model, None)
    assert calls == []
    apply_kernels(model, _plan(model, head, grad_input))
    gemm = model.kernels.head
    assert (gemm is None) == (head == grad_input == "torch")  # nothing set where the plan keeps torch's
    got = _head_pass(model, gemm)
    v, d = model.lm_head.weight.shape
    expected = {(v, d)} if head == "onednn" else set()  # the chunks' logits h @ W^T
    expected |= {(d, v)} if grad_input == "onednn" else set()  # the input gradient gz @ W, W^T given to oneDNN
    assert set(calls) == expected
    for a, b in zip(got, plain):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_a_later_plan_without_onednn_removes_what_an_earlier_one_set(tiny_ckpt):
    model = load_model(tiny_ckpt)
    apply_kernels(model, _plan(model, "onednn", "onednn", "onednn"))
    assert model.kernels.head is not None and model.kernels.decode.head is not None
    apply_kernels(model, _plan(model, "torch"))
    assert model.kernels.head is None and model.kernels.decode == DecodeKernels()


@needs_onednn
def test_a_bf16_model_keeps_torchs_head_products(tiny_ckpt):
    """oneDNN's products here are fp32 ones: a bf16 model keeps torch's whatever the plan says."""
    model = load_model(tiny_ckpt, dtype=torch.bfloat16)
    apply_kernels(model, _plan(model, "onednn", "onednn", "onednn"))
    assert model.kernels.head is None and model.kernels.decode == DecodeKernels()


def _sample(model):
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=6)
    return generate(model, [[1, 5, 9, 2], [3, 4]], params, seed=3)


@needs_onednn
@pytest.mark.parametrize("decode", ["onednn", "torch"])
def test_decode_head_runs_the_product_apply_kernels_set(tiny_ckpt, monkeypatch, decode):
    """The decode loop's LM head on oneDNN where the plan runs the head's weight there (the prefill's last-position
    head is the model's own nn.Linear), else torch.mm into its reused buffer: the same samples either way."""
    calls = _record_onednn(monkeypatch)
    plain = _sample(load_model(tiny_ckpt))  # never through apply_kernels
    assert calls == []
    model = load_model(tiny_ckpt)
    apply_kernels(model, _plan(model, "torch", decode=decode))
    assert (model.kernels.decode.head is None) == (decode == "torch")
    assert model.kernels.decode.pack is None  # the plan packs nothing
    out = _sample(model)
    head_shape = tuple(model.lm_head.weight.shape)
    assert set(calls) == ({head_shape} if decode == "onednn" else set())
    assert len(calls) == (5 if decode == "onednn" else 0)  # one product per decode step after the first token
    assert out.completion_ids == plain.completion_ids
    for a, b in zip(out.logprobs, plain.logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-5)
