"""Rollout correction (tis / mis, token / sequence level) and the sampler/trainer mismatch metrics, against
hand-computed weights for an injected mismatch (float64)."""

import math

import pytest
import torch

from grpo_engine.config.algorithm import CORRECTION_LEVELS, ROLLOUT_CORRECTIONS
from grpo_engine.rl.correction import mismatch_metrics
from grpo_engine.rl.losses import LossConfig, policy_loss, resolve

F64 = torch.float64
LN3, LN15 = math.log(3.0), math.log(1.5)


def _token_case():
    """One sequence of 4 tokens, A = +1: log(pi_train / pi_sampler) = [ln 3, ln 1.5, -ln 3, 0], so with C = 2
    the ratios [3, 1.5, 1/3, 1] are above the cap, inside, below 1/C, and exactly on-policy."""
    train = torch.tensor([[-1.0, -2.0, -0.5, -1.5]], dtype=F64)
    sampler = train - torch.tensor([[LN3, LN15, -LN3, 0.0]], dtype=F64)
    return train, sampler, torch.ones(1, dtype=F64), torch.ones(1, 4, dtype=torch.bool)


def _run(cfg, logp, old, adv, mask, sampler):
    logp = logp.clone().requires_grad_()
    loss, metrics = policy_loss(logp, old, None, adv, mask, cfg, sampler_logp=sampler)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.item(), grad, metrics


def test_tis_token_level_mu1_uses_the_detached_current_policy():
    # old_logp None (one pass): pi_train = logp.detach(), ratio 1. w = min(rho, 2) = [2, 1.5, 1/3, 1]
    # token-mean: loss = -sum(w A) / 4 = -(2 + 1.5 + 1/3 + 1) / 4 = -1.2083333; grad = -w A / 4
    train, sampler, adv, mask = _token_case()
    loss, grad, m = _run(resolve(LossConfig(loss="dapo", rollout_correction="tis")), train, None, adv, mask, sampler)
    assert loss == pytest.approx(-1.2083333, abs=1e-7)
    torch.testing.assert_close(grad, torch.tensor([[-0.5, -0.375, -1 / 12, -0.25]], dtype=F64))
    assert m["rollout_correction_frac"] == 0.25  # the ratio-3 token was capped


def test_mis_token_level_masks_ratios_outside_the_band():
    # w = 1 inside [1/2, 2]: [0, 1, 0, 1]; loss = -(0 + 1 + 0 + 1) / 4 = -0.5; masked tokens still count in N
    train, sampler, adv, mask = _token_case()
    loss, grad, m = _run(resolve(LossConfig(loss="dapo", rollout_correction="mis")), train, None, adv, mask, sampler)
    assert loss == pytest.approx(-0.5, abs=1e-12)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -0.25, 0.0, -0.25]], dtype=F64))
    assert m["rollout_correction_frac"] == 0.5


def test_mu_above_1_weights_come_from_the_old_policy_not_the_current_one():
    # the current policy moved 0.1 away from the old one in every token: ratio pi / pi_old = e^0.1 (< 1.28, no
    # clip); the correction still uses old vs sampler: w = [2, 1.5, 1/3, 1]
    # loss = -e^0.1 (2 + 1.5 + 1/3 + 1) / 4 = -1.3354149; grad = -w e^0.1 / 4
    train, sampler, adv, mask = _token_case()
    logp = train + 0.1
    loss, grad, m = _run(resolve(LossConfig(loss="dapo", rollout_correction="tis")), logp, train, adv, mask, sampler)
    assert loss == pytest.approx(-1.3354149, abs=1e-7)
    expect = -torch.tensor([[2.0, 1.5, 1 / 3, 1.0]], dtype=F64) * math.exp(0.1) / 4
    torch.testing.assert_close(grad, expect)
    assert m["mismatch_max_abs"] == pytest.approx(LN3)  # old vs sampler, not logp vs sampler (ln 3 + 0.1)


def _sequence_case():
    """Row 0: 3 tokens with log ratios [ln 2, ln 2, 0] -> sequence ratio 4; row 1: 2 tokens [ln 3, -ln 2] + one
    pad whose sampler value is garbage -> sequence ratio 1.5. A = [+1, -1]."""
    train = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, 0.0]], dtype=F64)
    log_rho = torch.tensor([[math.log(2), math.log(2), 0.0], [LN3, -math.log(2), 5.0]], dtype=F64)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    return train, train - log_rho, torch.tensor([1.0, -1.0], dtype=F64), mask


@pytest.mark.parametrize("mode, loss_value, grad, frac", [
    # tis: w = [min(4, 2)] * 3 and [1.5] * 2; loss = (-2 * 3 + 1.5 * 2) / 5 = -0.6; grad = -w A / 5
    ("tis", -0.6, [[-0.4, -0.4, -0.4], [0.3, 0.3, 0.0]], 0.6),
    # mis: ratio 4 > 2 masks row 0 (3 of 5 tokens); row 1 keeps w = 1: loss = (1 + 1) / 5 = 0.4
    ("mis", 0.4, [[0.0, 0.0, 0.0], [0.2, 0.2, 0.0]], 0.6),
])
def test_sequence_level(mode, loss_value, grad, frac):
    train, sampler, adv, mask = _sequence_case()
    cfg = resolve(LossConfig(loss="dapo", rollout_correction=mode, rollout_correction_level="sequence"))
    loss, g, m = _run(cfg, train, None, adv, mask, sampler)
    assert loss == pytest.approx(loss_value, abs=1e-12)
    torch.testing.assert_close(g, torch.tensor(grad, dtype=F64))
    assert m["rollout_correction_frac"] == pytest.approx(frac)


def test_sequence_level_far_past_exp_range_stays_finite():
    # 2 tokens of log ratio 400 each: exp(800) overflows float64, min(rho, C) must still be exactly C
    train = torch.tensor([[-1.0, -1.0]], dtype=F64)
    cfg = resolve(LossConfig(loss="dapo", rollout_correction="tis", rollout_correction_level="sequence"))
    loss, grad, _ = _run(cfg, train, None, torch.ones(1, dtype=F64), torch.ones(1, 2, dtype=torch.bool), train - 400)
    assert loss == pytest.approx(-2.0) and torch.isfinite(grad).all()


def test_nonfinite_sampler_logprob_drops_only_its_token():
    # row 1 of the sequence case with its first sampler log-prob -inf: that token is masked out (num_nonfinite 1),
    # row 1's sequence ratio is then exp(-ln 2) = 1/2 (inside [1/2, 2], tis weight 1/2); row 0 as before (w 2).
    # token-mean over the 4 live tokens: loss = (-2 * 3 + 0.5 * 1) / 4 = -1.375
    train, sampler, adv, mask = _sequence_case()
    sampler[1, 0] = -math.inf
    cfg = resolve(LossConfig(loss="dapo", rollout_correction="tis", rollout_correction_level="sequence"))
    loss, grad, m = _run(cfg, train, None, adv, mask, sampler)
    assert m["num_nonfinite"] == 1.0 and loss == pytest.approx(-1.375, abs=1e-12)
    torch.testing.assert_close(grad, torch.tensor([[-0.5, -0.5, -0.5], [0.0, 0.125, 0.0]], dtype=F64))


@pytest.mark.parametrize("mode", ROLLOUT_CORRECTIONS)
@pytest.mark.parametrize("level", CORRECTION_LEVELS)
@pytest.mark.parametrize("mu_above_1", [False, True])
@pytest.mark.parametrize("loss", ["grpo", "gspo", "cispo", "sapo"])
def test_agreeing_sampler_gives_exactly_the_plain_loss(mode, level, mu_above_1, loss):
    """Sampler log-probs equal to pi_train: weight 1 everywhere, bit-for-bit the loss without correction."""
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(4, 5, generator=g, dtype=F64) * 3).requires_grad_()
    old = logp.detach() + 0.2 * torch.randn(4, 5, generator=g, dtype=F64) if mu_above_1 else None
    adv = torch.randn(4, generator=g, dtype=F64)
    mask = torch.arange(5)[None, :] < torch.tensor([5, 2, 4, 1])[:, None]
    sampler = (old if mu_above_1 else logp.detach()).clone()
    cfg = resolve(LossConfig(loss=loss, rollout_correction=mode, rollout_correction_level=level))
    plain, _ = policy_loss(logp, old, None, adv, mask, resolve(LossConfig(loss=loss)))
    corrected, m = policy_loss(logp, old, None, adv, mask, cfg, sampler_logp=sampler)
    assert torch.equal(corrected, plain)
    assert torch.equal(torch.autograd.grad(corrected, logp)[0], torch.autograd.grad(plain, logp)[0])
    assert m["mismatch_mean_abs"] == m["mismatch_max_abs"] == m["mismatch_k3"] == 0.0
    assert m["rollout_correction_frac"] == 0.0


@pytest.mark.parametrize("cfg", [
    resolve(LossConfig(loss="dapo", rollout_correction="tis", rollout_correction_cap=1.2)),
    resolve(LossConfig(loss="grpo", rollout_correction="mis", rollout_correction_level="sequence",
                       rollout_correction_cap=3)),
])
def test_micro_batches_sum_to_one_batch_gradient(cfg):
    """Masked / capped tokens keep counting in the step's normalisers, so split gradients still add up."""
    g = torch.Generator().manual_seed(1)
    logp = (-torch.rand(6, 7, generator=g, dtype=F64) * 3).requires_grad_()
    old = logp.detach() + 0.3 * torch.randn(6, 7, generator=g, dtype=F64)
    sampler = old + 0.5 * torch.randn(6, 7, generator=g, dtype=F64)
    adv = torch.randn(6, generator=g, dtype=F64)
    mask = torch.arange(7)[None, :] < torch.tensor([7, 1, 4, 6, 2, 5])[:, None]
    loss, m = policy_loss(logp, old, None, adv, mask, cfg, sampler_logp=sampler)
    (full,) = torch.autograd.grad(loss, logp)
    split = torch.zeros_like(logp)
    for rows in [slice(0, 1), slice(1, 4), slice(4, 6)]:
        part, _ = policy_loss(logp[rows], old[rows], None, adv[rows], mask[rows], cfg, sampler_logp=sampler[rows],
                              num_tokens_total=int(mask.sum()), num_seqs_total=6)
        split += torch.autograd.grad(part, logp)[0]
    torch.testing.assert_close(split, full, atol=1e-12, rtol=0)
    assert 0 < m["rollout_correction_frac"] < 1  # the correction is live on this batch


def test_mismatch_metrics_hand_computed():
    # d = [ln 3, ln 1.5, -ln 3, 0]: mean |d| = (2 ln 3 + ln 1.5) / 4 = 0.6506724, max = ln 3 = 1.0986123
    # k3 = e^d - d - 1 = [2 - ln 3, 0.5 - ln 1.5, ln 3 - 2/3, 0] = [0.9013877, 0.0945349, 0.4319456, 0]
    # mean 0.3569671; a padded position with a huge difference and a non-finite sampler value are ignored
    train, sampler, _, _ = _token_case()
    train = torch.cat([train, torch.zeros(1, 2, dtype=F64)], 1)
    sampler = torch.cat([sampler, torch.tensor([[-50.0, -math.inf]], dtype=F64)], 1)
    mask = torch.tensor([[True] * 4 + [False, True]])
    m = mismatch_metrics(train, sampler, mask)
    assert m["mismatch_mean_abs"] == pytest.approx(0.6506724, abs=1e-7)
    assert m["mismatch_max_abs"] == pytest.approx(1.0986123, abs=1e-7)
    assert m["mismatch_k3"] == pytest.approx(0.3569671, abs=1e-7)


def test_policy_loss_reports_mismatch_only_with_sampler_logprobs():
    train, sampler, adv, mask = _token_case()
    _, _, with_sampler = _run(resolve(LossConfig(loss="dapo")), train, None, adv, mask, sampler)
    assert with_sampler["mismatch_mean_abs"] == pytest.approx(0.6506724, abs=1e-7)
    assert with_sampler["rollout_correction_frac"] == 0.0  # correction off: nothing capped
    _, without = policy_loss(train, None, None, adv, mask, resolve(LossConfig(loss="dapo")))
    assert "mismatch_mean_abs" not in without


def test_correction_needs_sampler_logprobs_and_a_cap_above_1():
    train, _, adv, mask = _token_case()
    with pytest.raises(ValueError, match="needs sampler_logp"):
        policy_loss(train, None, None, adv, mask, resolve(LossConfig(rollout_correction="tis")))
    with pytest.raises(ValueError, match="rollout_correction_cap"):
        resolve(LossConfig(rollout_correction="mis", rollout_correction_cap=1.0))
    with pytest.raises(ValueError, match="unknown rollout_correction"):
        resolve(LossConfig(rollout_correction="is"))

