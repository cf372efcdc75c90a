"""The final-logit soft cap is written once (model/transformer.py soft_cap): the forward's, the decode head's in
place and the chunked log-probs' with its derivative give the same numbers."""

import torch

from grpo_engine.model.transformer import soft_cap


def test_in_place_equals_the_forwards_and_the_derivative_is_autograds():
    x = torch.randn(3, 50, dtype=torch.float64) * 40  # [B, V], well past the cap
    want = torch.tanh(x / 30.0) * 30.0  # c * tanh(z / c)
    assert torch.equal(soft_cap(x, 30.0), want)
    buf, derivative = x.clone(), torch.empty_like(x)
    assert torch.equal(soft_cap(buf, 30.0, inplace=True, derivative=derivative), want) and torch.equal(buf, want)
    leaf = x.clone().requires_grad_()
    (grad,) = torch.autograd.grad(soft_cap(leaf, 30.0).sum(), leaf)
    torch.testing.assert_close(derivative, grad, rtol=1e-12, atol=1e-12)
    assert soft_cap(x, None) is x and soft_cap(x, None, inplace=True) is x
