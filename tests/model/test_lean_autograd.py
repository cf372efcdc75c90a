"""The RMSNorm and SwiGLU autograd functions: autograd's own gradients of the plain expressions, less kept."""

import pytest
import torch
import torch.nn.functional as F

from grpo_engine.model.transformer import rms_norm, swiglu


def composite_rms_norm(x, weight, eps):
    """The HF reference expression, differentiated by autograd."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def saved_storages(fn, *args) -> list[torch.Tensor]:
    """The distinct tensors autograd keeps for backward while fn(*args) runs (by storage)."""
    kept = {}

    def pack(t):
        kept.setdefault(t.untyped_storage().data_ptr(), t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return list(kept.values())


@pytest.mark.parametrize("needs", [(True, True), (True, False), (False, True)])
def test_rms_norm_gradients_equal_autograd_float64(needs):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 16, generator=g, dtype=torch.float64).requires_grad_(needs[0])
    w = (1 + 0.3 * torch.randn(16, generator=g, dtype=torch.float64)).requires_grad_(needs[1])
    gy = torch.randn(3, 5, 16, generator=g, dtype=torch.float64)
    inputs = [t for t in (x, w) if t.requires_grad]
    got = torch.autograd.grad(rms_norm(x, w, 1e-6), inputs, gy)
    want = torch.autograd.grad(composite_rms_norm(x, w, 1e-6), inputs, gy)
    for a, b in zip(got, want):
        assert (a - b).abs().max().item() < 1e-12 * b.abs().max().item()


def test_rms_norm_bf16_keeps_the_reference_rounding():
    """Normalised in fp32, cast to bf16 before the weight: the same forward bits as the reference, gradients
    within bf16 rounding of autograd's."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 128, generator=g).bfloat16().requires_grad_()
    w = (1 + 0.1 * torch.randn(128, generator=g)).bfloat16().requires_grad_()
    gy = torch.randn(64, 128, generator=g).bfloat16()
    y, ref = rms_norm(x, w, 1e-6), composite_rms_norm(x, w, 1e-6)
    assert torch.equal(y, ref)
    for a, b in zip(torch.autograd.grad(y, (x, w), gy), torch.autograd.grad(ref, (x, w), gy)):
        assert (a.float() - b.float()).abs().max().item() <= 2e-2 * b.float().abs().max().item()


def test_rms_norm_keeps_only_its_input_and_inverse_rms():
    x = torch.randn(4, 7, 32, requires_grad=True)
    w = torch.ones(32, requires_grad=True)
    kept = saved_storages(rms_norm, x, w, 1e-6)
    assert sorted(tuple(t.shape) for t in kept) == [(4, 7, 1), (4, 7, 32), (32,)]  # 1/rms, x, weight
    assert x.untyped_storage().data_ptr() in {t.untyped_storage().data_ptr() for t in kept}  # x itself, no copy


def test_rms_norm_without_gradients_is_the_same_function():
    x, w = torch.randn(2, 3, 8), torch.rand(8) + 0.5
    with torch.no_grad():
        plain = rms_norm(x, w, 1e-5)
    assert torch.equal(plain, rms_norm(x.requires_grad_(), w, 1e-5))


@pytest.mark.parametrize("needs", [(True, True), (True, False), (False, True)])
def test_swiglu_gradients_equal_autograd_float64(needs):
    g = torch.Generator().manual_seed(2)
    gate = torch.randn(6, 24, generator=g, dtype=torch.float64).requires_grad_(needs[0])
    up = torch.randn(6, 24, generator=g, dtype=torch.float64).requires_grad_(needs[1])
    gy = torch.randn(6, 24, generator=g, dtype=torch.float64)
    inputs = [t for t in (gate, up) if t.requires_grad]
    y = swiglu(gate, up)
    assert torch.equal(y, F.silu(gate) * up)
    got = torch.autograd.grad(y, inputs, gy)
    want = torch.autograd.grad(F.silu(gate) * up, inputs, gy)
    for a, b in zip(got, want):
        assert (a - b).abs().max().item() < 1e-12 * b.abs().max().item()


def test_swiglu_keeps_gate_and_up_only():
    gate, up = torch.randn(5, 12, requires_grad=True), torch.randn(5, 12, requires_grad=True)
    kept = saved_storages(swiglu, gate, up)
    ptrs = {t.untyped_storage().data_ptr() for t in kept}
    assert ptrs == {gate.untyped_storage().data_ptr(), up.untyped_storage().data_ptr()}
