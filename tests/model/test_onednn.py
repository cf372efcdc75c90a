"""kernels/onednn.linear: x @ W^T through oneDNN on fp32 CPU tensors, torch.mm otherwise -- same numbers."""

import pytest
import torch
from references import naive_token_logprobs

from grpo_engine.kernels import KernelPlan, apply_kernels, onednn
from grpo_engine.kernels.select import shape_key, weight_shapes
from grpo_engine.model.kernels_slot import Kernels
from grpo_engine.rl.logprobs import token_logprobs, token_logprobs_with_grads


@pytest.fixture(autouse=True)
def _small_threshold(monkeypatch):
    """No measured plan, and a threshold that lets the small test matrices take the oneDNN path."""
    monkeypatch.setattr(onednn, "MIN_WEIGHT_NUMEL", 1)


def _xw(m=5, k=24, n=301, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return torch.randn(m, k, generator=g, dtype=dtype), torch.randn(n, k, generator=g, dtype=dtype)


def test_linear_matches_float64_reference_for_plain_and_transposed_weights():
    x, w = _xw()
    ref = x.double() @ w.double().t()  # [5, 301]
    torch.testing.assert_close(onednn.linear(x, w).double(), ref, rtol=1e-5, atol=1e-5)
    # weight as a transposed view: x2 [5, 301] @ (w^T)^T -> [5, 24]
    x2 = torch.randn(5, 301, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(onednn.linear(x2, w.t()).double(), x2.double() @ w.double(), rtol=1e-5, atol=1e-4)


def test_applies_only_to_fp32_cpu_matrices_with_a_big_weight(monkeypatch):
    x, w = _xw()
    assert onednn.applies(x, w) == onednn.op_works()
    assert not onednn.applies(x.double(), w.double())
    assert not onednn.applies(x[None], w)  # 3-d input: not this helper's job
    out = onednn.linear(x.double(), w.double())  # falls back to torch.mm
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, x.double() @ w.double().t())
    monkeypatch.setattr(onednn, "MIN_WEIGHT_NUMEL", w.numel() + 1)
    assert not onednn.applies(x, w)  # a small weight: torch.mm


def test_switch_off_with_env(monkeypatch):
    monkeypatch.setenv("GRPO_ONEDNN", "0")
    monkeypatch.setattr(onednn, "_state", {})
    x, w = _xw()
    assert not onednn.applies(x, w)
    torch.testing.assert_close(onednn.linear(x, w), x @ w.t())


@pytest.mark.parametrize("on_onednn", [False, True])
@pytest.mark.parametrize("chunk", [7, 64])
def test_fp32_head_through_onednn_matches_float64(chunk, on_onednn):
    """The fp32 log-prob head (both entry points) on torch's GEMMs and on the oneDNN ones a plan hands it ==
    float64 naive head."""
    g = torch.Generator().manual_seed(2)
    h, w = torch.randn(40, 16, generator=g), torch.randn(500, 16, generator=g) * 0.3
    t = torch.randint(0, 500, (40,), generator=g)
    plan = KernelPlan("cpu", torch.__version__, 1, {"500x16": "onednn"})
    gemm = onednn.planned_head_gemm(plan, w) if on_onednn else None  # None too where oneDNN's op does not work
    hd, wd = h.double().requires_grad_(), w.double().requires_grad_()
    lp_ref, ent_ref = naive_token_logprobs(hd, wd, t)
    gh_ref, gw_ref = torch.autograd.grad((2 * lp_ref + ent_ref).sum(), (hd, wd))

    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    lp, ent = token_logprobs(hh, ww, t, chunk_size=chunk, with_entropy=True, gemm=gemm)
    (2 * lp + ent).sum().backward()
    fused = token_logprobs_with_grads(h, w, t, lambda s, e, lp_, ent_: (torch.full_like(lp_, 2.0),
                                                                        torch.ones_like(ent_)),
                                      chunk_size=chunk, with_entropy=True, gemm=gemm)
    for got, ref in [(lp, lp_ref), (ent, ent_ref), (hh.grad, gh_ref), (ww.grad, gw_ref),
                     (fused.logp, lp_ref), (fused.grad_hidden, gh_ref), (fused.grad_weight, gw_ref)]:
        torch.testing.assert_close(got.double(), ref.detach(), rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not onednn.op_works(), reason="oneDNN's linear op is not available")
@pytest.mark.parametrize("backend,grad_input,head", [("onednn", None, None), ("torch", None, None),
                                                     ("onednn", "torch", None), ("torch", "onednn", None),
                                                     ("onednn", None, "torch")])
def test_head_products_follow_the_plan_for_the_head_weight(backend, grad_input, head, monkeypatch):
    """The plan's choices for the [V, D] head weight decide its forward product and its grad-input product
    gz [n, V] @ W [V, D] (not the choice for a [D, V] shape, which no plan holds): the input gradient on its own
    measured GEMM where the plan has one, else on the forward's; the chunked forward on the plan's `logprob_head`
    choice where it has one (torch's into the reused buffer), else on the weight's GEMM. The choices reach the head
    as the HeadGemm kernels/ builds from the plan (planned_head_gemm), not through the active plan."""
    g = torch.Generator().manual_seed(3)
    h, w = torch.randn(40, 16, generator=g), torch.randn(500, 16, generator=g) * 0.3
    t = torch.randint(0, 500, (40,), generator=g)
    hd = h.double().requires_grad_()
    gh_ref, = torch.autograd.grad(naive_token_logprobs(hd, w.double(), t)[0].sum(), (hd,))
    calls = []
    real = onednn._op
    monkeypatch.setattr(onednn, "_op", lambda x, weight, bias=None: calls.append(tuple(weight.shape))
                        or real(x, weight, bias))
    plan = KernelPlan("cpu", torch.__version__, 1, {"500x16": backend})
    if grad_input:
        plan.grad_input = {"500x16": grad_input}
    if head:
        plan.logprob_head = {"500x16": head}
    hh = h.clone().requires_grad_()
    token_logprobs(hh, w, t, chunk_size=16, gemm=onednn.planned_head_gemm(plan, w))[0].sum().backward()
    on_onednn = {(500, 16): (head or backend) == "onednn", (16, 500): (grad_input or backend) == "onednn"}
    assert sorted(set(calls)) == sorted(shape for shape, on in on_onednn.items() if on)
    torch.testing.assert_close(hh.grad.double(), gh_ref, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not onednn.op_works(), reason="oneDNN's linear op is not available")
@pytest.mark.parametrize("vocab", [21, 28, 50])  # a last block of 5 rows, an exact multiple of 7, one of 1
def test_blocked_weight_grad_adds_gz_transposed_h_block_by_block(vocab, monkeypatch):
    """grad_w += gz^T h over vocabulary blocks (7 rows here) matches the float64 product, adding to what grad_w
    already holds; nothing else of grad_w changes and gz, h are left as they were."""
    monkeypatch.setattr(onednn, "HEAD_GRAD_BLOCK", 7)
    g = torch.Generator().manual_seed(4)
    gz, h = torch.randn(13, vocab, generator=g), torch.randn(13, 6, generator=g)
    before = torch.randn(vocab, 6, generator=g)
    grad_w = before.clone()
    gz0, h0 = gz.clone(), h.clone()
    onednn.blocked_weight_grad(grad_w, gz, h)
    torch.testing.assert_close(grad_w.double(), before.double() + gz.double().t() @ h.double(), rtol=1e-5, atol=1e-5)
    assert torch.equal(gz, gz0) and torch.equal(h, h0)


@pytest.mark.skipif(not onednn.op_works(), reason="oneDNN's linear op is not available")
@pytest.mark.parametrize("choice", ["blocked", "inplace"])
def test_head_weight_gradient_follows_the_plan(choice, monkeypatch):
    """The plan's `head_weight_grad` choice for the [V, D] head decides how the chunked head adds each chunk's
    weight gradient: oneDNN's blocks (once per chunk) or torch's addmm_ (never the blocks); the same gradient."""
    g = torch.Generator().manual_seed(5)
    h, w = torch.randn(40, 16, generator=g), torch.randn(500, 16, generator=g) * 0.3
    t = torch.randint(0, 500, (40,), generator=g)
    wd = w.double().requires_grad_()
    gw_ref, = torch.autograd.grad(naive_token_logprobs(h.double(), wd, t)[0].sum(), (wd,))
    calls = []
    real = onednn.blocked_weight_grad
    monkeypatch.setattr(onednn, "blocked_weight_grad", lambda gw, gz, hh: calls.append(gz.shape) or real(gw, gz, hh))
    plan = KernelPlan("cpu", torch.__version__, 1, {"500x16": "onednn"}, head_weight_grad={"500x16": choice})
    assert plan.head_weight_grad_backend((500, 16)) == choice
    ww = w.clone().requires_grad_()
    token_logprobs(h, ww, t, chunk_size=16, gemm=onednn.planned_head_gemm(plan, ww))[0].sum().backward()
    assert calls == ([(16, 500), (16, 500), (8, 500)] if choice == "blocked" else [])  # chunks of 16, 16, 8 rows
    torch.testing.assert_close(ww.grad.double(), gw_ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arch", ["qwen2", "llama3"])  # qwen2: q/k/v biases
def test_model_linears_on_onednn_match_torch(tiny_ckpt_factory, monkeypatch, arch):
    """The transformer's projections (onednn.OneDNNLinear) give nn.Linear's loss and gradients, fp32 rounding apart."""
    from grpo_engine.model.loading import load_model

    model = load_model(tiny_ckpt_factory(arch))
    on_onednn = {shape_key(s): "onednn" for s in weight_shapes(model)}
    every_shape_on_onednn = KernelPlan("cpu", torch.__version__, 1, on_onednn)
    model = apply_kernels(model, every_shape_on_onednn)
    assert isinstance(model.layers[0].attn.q_proj, onednn.OneDNNLinear)
    ids = torch.randint(0, 256, (3, 11), generator=torch.Generator().manual_seed(5))
    calls, op = [], onednn._op
    monkeypatch.setattr(onednn, "_op", lambda *a: calls.append(1) or op(*a))
    works = onednn.op_works()
    grads = {}
    for on in (True, False):
        monkeypatch.setattr(onednn, "_state", {"ok": on and works})
        model.zero_grad(set_to_none=True)
        logits = model(ids)
        torch.log_softmax(logits, -1)[..., :5].sum().backward()
        grads[on] = {n: p.grad.clone() for n, p in model.named_parameters()}
    for name, g in grads[False].items():
        torch.testing.assert_close(grads[True][name], g, rtol=1e-4, atol=1e-5)
    if works:  # 7 projections x 2 layers, forward + 2 gradients each, in the oneDNN pass only
        assert len(calls) == 7 * 2 * 3


@pytest.mark.skipif(not onednn.op_works(), reason="oneDNN's linear op is not available")
@pytest.mark.parametrize("forward,grad_input", [("onednn", "torch"), ("torch", "onednn")])
def test_projection_input_gradient_runs_on_its_own_planned_gemm(forward, grad_input, monkeypatch):
    """A projection whose plan names one GEMM for the forward and another for the input gradient: the forward and
    weight-gradient products on the first, grad_y @ W on the second, and nn.Linear's numbers either way."""
    g = torch.Generator().manual_seed(7)
    layer = torch.nn.Linear(24, 40, bias=True)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    x = torch.randn(6, 24, generator=g)
    y_grad = torch.randn(6, 40, generator=g)
    ref_x = x.clone().requires_grad_()
    layer(ref_x).backward(y_grad)
    ref = (ref_x.grad, layer.weight.grad.clone(), layer.bias.grad.clone())

    layer.zero_grad(set_to_none=True)
    plan = KernelPlan("cpu", torch.__version__, 1, {"40x24": forward}, grad_input={"40x24": grad_input})
    layer = onednn.OneDNNLinear.holding(layer, Kernels(gemm=plan))
    calls, real = [], onednn._op
    monkeypatch.setattr(onednn, "_op", lambda a, w, b=None: calls.append((tuple(a.shape), tuple(w.shape)))
                        or real(a, w, b))
    xx = x.clone().requires_grad_()
    layer(xx).backward(y_grad)
    products = {((6, 24), (40, 24)): forward, ((40, 6), (24, 6)): forward,  # forward x W^T; weight grad gy^T x
                ((6, 40), (24, 40)): grad_input}  # input gradient gy @ W, W given to oneDNN as a transposed view
    assert sorted(calls) == sorted(k for k, backend in products.items() if backend == "onednn")
    for got, want in zip((xx.grad, layer.weight.grad, layer.bias.grad), ref):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
