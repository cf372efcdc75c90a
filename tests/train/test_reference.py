"""Reference policy: frozen copy, hard reset schedule, TR-DPO mix-in, CPU parking, 'none'."""

import pytest
import torch

from grpo_engine.model.loading import load_model
from grpo_engine.train.policy import ReferenceConfig, make_reference


@pytest.fixture
def policy(tiny_ckpt):
    return load_model(tiny_ckpt, dtype=torch.float64)


def _perturb(model, scale):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale)


def _params(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def test_none_and_beta_zero_load_nothing(policy):
    assert make_reference(policy, ReferenceConfig(mode="none")) is None
    assert make_reference(policy, ReferenceConfig(mode="frozen"), beta=0.0) is None
    assert make_reference(policy, ReferenceConfig(mode="frozen"), beta=0.04) is not None


def test_frozen_copy_unaffected_by_policy_updates(policy):
    ids = torch.tensor([[1, 2, 3, 4]])
    before = policy(ids).detach()
    ref = make_reference(policy, ReferenceConfig(mode="frozen"))
    assert all(not p.requires_grad for p in ref.module.parameters())
    _perturb(policy, 0.01)
    assert not torch.allclose(policy(ids), before)
    torch.testing.assert_close(ref.module(ids), before, atol=0, rtol=0)
    for step in range(1, 5):
        assert ref.on_step(step, policy) is False
    torch.testing.assert_close(ref.module(ids), before, atol=0, rtol=0)


def test_tied_weights_stay_tied(tiny_ckpt_factory):
    policy = load_model(tiny_ckpt_factory("qwen2-tied"))
    ref = make_reference(policy, ReferenceConfig(mode="frozen"))
    assert ref.module.lm_head.weight is ref.module.embed.weight
    assert ref.module.embed.weight.data_ptr() != policy.embed.weight.data_ptr()


def test_hard_reset_every_n_steps(policy):
    ref = make_reference(policy, ReferenceConfig(mode="hard_reset", update_every=3))
    initial = _params(policy)
    for step in range(1, 8):
        _perturb(policy, 0.1)  # the "optimizer step": every parameter += 0.1
        assert ref.on_step(step, policy) == (step % 3 == 0)
        # the reference holds the policy as of the last multiple of 3 (the initial weights before step 3)
        shift = 0.1 * (step - step % 3)
        for k, v in ref.module.named_parameters():
            torch.testing.assert_close(v, initial[k] + shift, atol=1e-12, rtol=0)
        if step % 3 == 0:
            for k, v in ref.module.named_parameters():
                torch.testing.assert_close(v, dict(policy.named_parameters())[k].detach(), atol=0, rtol=0)


def test_mixin_is_convex_combination(policy):
    alpha = 0.25
    ref = make_reference(policy, ReferenceConfig(mode="mixin", update_every=2, mixin_alpha=alpha))
    r0 = _params(ref.module)
    _perturb(policy, 0.4)
    assert ref.on_step(1, policy) is False
    assert ref.on_step(2, policy) is True
    p1 = _params(policy)
    for k, v in ref.module.named_parameters():
        torch.testing.assert_close(v, alpha * p1[k] + (1 - alpha) * r0[k], atol=1e-12, rtol=0)
        # each entry moved by alpha * 0.4 = 0.1 toward the policy
        torch.testing.assert_close(v - r0[k], torch.full_like(v, 0.1), atol=1e-12, rtol=0)


def test_cpu_parking_keeps_values(policy):
    ids = torch.tensor([[5, 6, 7]])
    ref = make_reference(policy, ReferenceConfig(mode="frozen", park_on_cpu=True))
    assert ref.home == torch.device("cpu")
    expected = policy(ids).detach()
    for _ in range(2):
        ref.before_pass(torch.device("cpu"))
        with torch.no_grad():
            out = ref.module(ids)
        ref.after_pass()
        torch.testing.assert_close(out, expected, atol=0, rtol=0)
    assert next(ref.module.parameters()).device.type == "cpu"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU to show the device round trip")
def test_cpu_parking_round_trip_to_gpu(policy):
    policy = policy.cuda()
    ref = make_reference(policy, ReferenceConfig(mode="frozen", park_on_cpu=True))
    assert next(ref.module.parameters()).device.type == "cpu"
    ref.before_pass(torch.device("cuda"))
    assert next(ref.module.parameters()).device.type == "cuda"
    ids = torch.tensor([[5, 6, 7]], device="cuda")
    torch.testing.assert_close(ref.module(ids), policy(ids).detach(), atol=0, rtol=0)
    ref.after_pass()
    assert next(ref.module.parameters()).device.type == "cpu"


def test_bad_config(policy):
    with pytest.raises(ValueError, match="unknown reference mode"):
        make_reference(policy, ReferenceConfig(mode="ema"))
    with pytest.raises(ValueError, match="update_every"):
        make_reference(policy, ReferenceConfig(mode="hard_reset"))
    with pytest.raises(ValueError, match="mixin_alpha"):
        make_reference(policy, ReferenceConfig(mode="mixin", update_every=1, mixin_alpha=0.0))
