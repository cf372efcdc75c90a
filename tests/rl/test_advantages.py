"""Group advantages: hand-computed values for every estimator, zero-variance groups, bad rewards."""

import math

import pytest
import torch

from grpo_engine.rl.advantages import AdvantageConfig, combine_rewards, compute_advantages

R = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]])  # [P=2, G=4]


def _adv(rewards, **kw):
    return compute_advantages(rewards, AdvantageConfig(**kw)).advantages


def test_grpo_std_unbiased_and_population():
    # row 0: mean 0.5; unbiased std = sqrt(4 * 0.25 / 3) = 0.577350; population std = 0.5
    a = _adv(R, estimator="grpo", eps=0.0)
    torch.testing.assert_close(a[0], torch.tensor([0.866025, -0.866025, -0.866025, 0.866025]), atol=1e-5, rtol=0)
    a = _adv(R, estimator="grpo", eps=0.0, std_unbiased=False)
    torch.testing.assert_close(a[0], torch.tensor([1.0, -1.0, -1.0, 1.0]))
    # row 1: mean 0.75, population std sqrt(3/16) = 0.433013
    torch.testing.assert_close(a[1], torch.tensor([0.57735, 0.57735, 0.57735, -1.732051]), atol=1e-5, rtol=0)


def test_dr_grpo_is_mean_centred_without_std():
    a = _adv(R, estimator="dr_grpo")
    torch.testing.assert_close(a, torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.25, 0.25, 0.25, -0.75]]))


def test_batch_std_scaling():
    # batch of 8 rewards: mean 0.625, population std sqrt(1.875 / 8) = 0.484123
    a = _adv(R, estimator="batch_std", eps=0.0, std_unbiased=False)
    s = 0.484123
    expect = torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.25, 0.25, 0.25, -0.75]]) / s
    torch.testing.assert_close(a, expect, atol=1e-5, rtol=0)


def test_none_is_reward_itself():
    torch.testing.assert_close(_adv(R, estimator="none"), R)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "batch_std", "none"])
def test_constant_group_gives_zeros_never_nan(estimator):
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    res = compute_advantages(rewards, AdvantageConfig(estimator=estimator))
    assert torch.isfinite(res.advantages).all()
    assert torch.equal(res.advantages[:2], torch.zeros(2, 3))
    assert res.zero_variance.tolist() == [True, True, False]
    assert res.num_zero_variance == 2
    assert res.advantages[2].abs().sum() > 0


def test_rewards_not_overwritten():
    rewards = R.clone()
    res = compute_advantages(rewards)
    assert torch.equal(rewards, R)
    assert torch.equal(res.rewards, R)
    res.rewards += 1
    assert torch.equal(rewards, R)


def test_nonfinite_rewards_masked_and_counted():
    rewards = torch.tensor([[1.0, float("nan"), 0.0], [float("inf"), 2.0, 2.0], [float("nan"), 3.0, float("-inf")]])
    res = compute_advantages(rewards, AdvantageConfig(estimator="dr_grpo"))
    assert res.num_nonfinite == 4
    assert res.valid.tolist() == [[True, False, True], [False, True, True], [False, True, False]]
    torch.testing.assert_close(res.advantages, torch.tensor([[0.5, 0.0, -0.5], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    assert res.zero_variance.tolist() == [False, True, True]  # row 1: finite rewards equal; row 2: one finite


def test_component_weights():
    comps = {"correct": torch.tensor([[1.0, 0.0]]), "format": torch.tensor([[1.0, 1.0]])}
    torch.testing.assert_close(combine_rewards(comps, {"format": 0.1}), torch.tensor([[1.1, 0.1]]))
    torch.testing.assert_close(combine_rewards(comps), torch.tensor([[2.0, 1.0]]))
    with pytest.raises(ValueError, match="unknown reward components"):
        combine_rewards(comps, {"formt": 0.1})
    with pytest.raises(ValueError, match=r"\(1, 3\).*\(1, 2\)"):
        combine_rewards({"a": torch.zeros(1, 2), "b": torch.zeros(1, 3)})


def test_bad_config_and_shape():
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        compute_advantages(R, AdvantageConfig(estimator="ppo"))
    with pytest.raises(ValueError, match=r"\[P, G\].*\(8,\)"):
        compute_advantages(R.flatten())


def test_eps_bounds_tiny_variance():
    a = _adv(torch.tensor([[0.0, 1e-9]]), estimator="grpo", eps=1e-6)
    assert a.abs().max() < 1e-3 and not math.isnan(a.sum().item())
