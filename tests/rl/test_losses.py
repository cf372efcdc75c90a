"""Policy losses against hand-computed numbers (ratios e and 1/e hit each clip side) and micro-batch invariance."""

import math

import pytest
import torch

from grpo_engine.rl.losses import LossConfig, policy_loss, resolve

E = math.e


def _clip_case():
    """4 tokens of one sequence: log-ratios [1, 1, -1, -1] -> ratios [e, e, 1/e, 1/e]; A = [+1, -1, +1, -1]."""
    logp = torch.tensor([[-1.0, -2.0, -0.5, -1.0]], dtype=torch.float64, requires_grad=True)
    old = logp.detach() - torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 4, dtype=torch.bool)
    return logp, old, adv, mask


def _run(cfg, logp, old, adv, mask, **kw):
    loss, metrics = policy_loss(logp, old, None, adv, mask, cfg, **kw)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.item(), grad, metrics


def test_grpo_clip_both_sides():
    # per-token objective min(r A, clip(r, 0.8, 1.2) A):
    #   r=e,A=+1 -> 1.2 (clipped high, no grad) | r=e,A=-1 -> -e | r=1/e,A=+1 -> 1/e | r=1/e,A=-1 -> -0.8 (clipped low)
    # loss = mean of -objective = (-1.2 + e - 1/e + 0.8) / 4 = 0.4876006
    loss, grad, m = _run(resolve(LossConfig(loss="grpo")), *_clip_case())
    assert loss == pytest.approx(0.4876006, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[0.0, E / 4, -1 / (4 * E), 0.0]], dtype=torch.float64))
    assert m["clip_frac_low"] == 0.25 and m["clip_frac_high"] == 0.25
    assert m["ratio_min"] == pytest.approx(1 / E) and m["ratio_max"] == pytest.approx(E)
    assert m["ratio_mean"] == pytest.approx((E + 1 / E) / 2)


def test_dapo_clip_higher_token_mean():
    # upper clip 1.28 instead of 1.2: loss = (-1.28 + e - 1/e + 0.8) / 4 = 0.4676006
    loss, grad, _ = _run(resolve(LossConfig(loss="dapo")), *_clip_case())
    assert loss == pytest.approx(0.4676006, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[0.0, E / 4, -1 / (4 * E), 0.0]], dtype=torch.float64))


def test_dual_clip():
    # c = 2: the r=e, A=-1 token's objective max(-e, -2) = -2 -> loss 2 and no gradient
    # loss = (-1.2 + 2 - 1/e + 0.8) / 4 = 0.3080303
    loss, grad, _ = _run(resolve(LossConfig(loss="grpo", dual_clip_c=2.0)), *_clip_case())
    assert loss == pytest.approx(0.3080303, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.0, -1 / (4 * E), 0.0]], dtype=torch.float64))


def test_dr_grpo_constant_normaliser():
    # token sum / (max_completion_len=8 * 1 sequence) = (e - 1/e - 0.4) / 8 = 0.2438003
    loss, grad, _ = _run(resolve(LossConfig(loss="dr_grpo", max_completion_len=8)), *_clip_case())
    assert loss == pytest.approx(0.2438003, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[0.0, E / 8, -1 / (8 * E), 0.0]], dtype=torch.float64))


def test_cispo_clipped_stop_gradient_weight():
    # weights clip(r, 0, 2) = [2, 2, 1/e, 1/e] (detached); loss = mean(-w A logp), logp = [-1, -2, -0.5, -1]
    # = (2 - 4 + 0.5/e - 1/e) / 4 = -0.5459849 ; grad = -w A / 4 -> every token keeps a gradient
    loss, grad, m = _run(resolve(LossConfig(loss="cispo", cispo_max_weight=2.0)), *_clip_case())
    assert loss == pytest.approx(-0.5459849, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[-0.5, 0.5, -1 / (4 * E), 1 / (4 * E)]], dtype=torch.float64))
    assert m["clip_frac_high"] == 0.5 and m["clip_frac_low"] == 0.0


def test_sapo_soft_gate_hand_computed():
    # f(r) = sigmoid(tau (r - 1)) * 4 / tau, tau = 1 for A > 0 and 1.05 for A < 0; objective f(r) A
    #   r=e,A=+1: s = sigmoid(1.7182818) = 0.8479074, f = 3.3916296   | r=e,A=-1: s = sigmoid(1.8041960) = 0.8586589,
    #   f = 4 s / 1.05 = 3.2710817 | r=1/e,A=+1: s = sigmoid(-0.6321206) = 0.3470299, f = 1.3881195
    #   | r=1/e,A=-1: s = sigmoid(-0.6637266) = 0.3399030, f = 1.2948685
    # token-mean: loss = -(3.3916296 - 3.2710817 + 1.3881195 - 1.2948685) / 4 = -0.0534497
    # d loss / d logp = -4 s (1 - s) r A / 4 = [-0.3505508, 0.3299009, -0.0833615, 0.0825407]
    loss, grad, m = _run(resolve(LossConfig(loss="sapo")), *_clip_case())
    assert loss == pytest.approx(-0.0534497, abs=1e-7)
    expect = torch.tensor([[-0.3505508, 0.3299009, -0.0833615, 0.0825407]], dtype=torch.float64)
    torch.testing.assert_close(grad, expect, atol=1e-7, rtol=0)
    assert m["clip_frac_low"] == m["clip_frac_high"] == 0.0  # a soft gate: nothing is cut off outright


def test_sapo_on_policy_gradient_is_the_plain_policy_gradient():
    # r = 1: 4 sigmoid(0) (1 - sigmoid(0)) * 1 * A = A, whatever tau: the same gradient as on-policy DAPO
    g = torch.Generator().manual_seed(3)
    logp = (-torch.rand(3, 4, generator=g, dtype=torch.float64) * 2).requires_grad_()
    adv = torch.tensor([1.5, -0.7, 0.0], dtype=torch.float64)
    mask = torch.arange(4)[None, :] < torch.tensor([4, 2, 3])[:, None]
    grads = {}
    for cfg in (resolve(LossConfig(loss="sapo", sapo_tau_pos=3.0, sapo_tau_neg=0.5)), resolve(LossConfig(loss="dapo"))):
        loss, _ = policy_loss(logp, None, None, adv, mask, cfg)
        grads[cfg.loss] = torch.autograd.grad(loss, logp)[0]
    torch.testing.assert_close(grads["sapo"], grads["dapo"], atol=1e-15, rtol=0)
    assert grads["dapo"][0, 0].item() == pytest.approx(-1.5 / 9)  # -A / active tokens


def test_sapo_gradient_vanishes_smoothly_far_from_ratio_one():
    # weight on the plain gradient, 4 s (1 - s) r with s = sigmoid(r - 1) (tau = 1, A = +1):
    #   r = 1/16: 0.0505541 | r = 1: 1 | r = 4: 0.7228266 | r = 16: 0.0000196 (no cliff, unlike PPO's clip)
    ratios = torch.tensor([1 / 16, 1.0, 4.0, 16.0], dtype=torch.float64)
    logp = torch.full((1, 4), -1.0, dtype=torch.float64, requires_grad=True)
    loss, _ = policy_loss(logp, logp.detach() - ratios.log()[None], None, torch.ones(1, dtype=torch.float64),
                          torch.ones(1, 4), resolve(LossConfig(loss="sapo")))
    weight = -torch.autograd.grad(loss, logp)[0] * 4  # token-mean over 4 tokens
    expect = torch.tensor([[0.0505541, 1.0, 0.7228266, 0.0000196]], dtype=torch.float64)
    torch.testing.assert_close(weight, expect, atol=1e-7, rtol=0)


def test_gspo_sequence_ratio():
    # row 0: log-ratios [0.5, 1.5] -> s = exp(mean) = e, A = -1 -> objective -e (not clipped: min picks r A)
    # row 1: log-ratios [-0.5, -1.5] -> s = 1/e, A = +1 -> objective 1/e
    # seq-mean: loss = (e - 1/e) / 2 = 1.1752012; ds/dlogp_t = s / 2 per token -> grads e/4 and -1/(4e)
    logp = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64, requires_grad=True)
    old = logp.detach() - torch.tensor([[0.5, 1.5], [-0.5, -1.5]], dtype=torch.float64)
    adv = torch.tensor([-1.0, 1.0], dtype=torch.float64)  # per-sequence [B]
    loss, grad, m = _run(resolve(LossConfig(loss="gspo")), logp, old, adv, torch.ones(2, 2))
    assert loss == pytest.approx(1.1752012, abs=1e-6)
    expect = torch.tensor([[E / 4, E / 4], [-1 / (4 * E), -1 / (4 * E)]], dtype=torch.float64)
    torch.testing.assert_close(grad, expect)
    assert m["clip_frac_low"] == 0.0 and m["clip_frac_high"] == 0.0
    # flip the advantages: both sequences are now clipped (s = e > 1 + 4e-4 with A > 0; s = 1/e < 1 - 3e-4, A < 0)
    loss, grad, m = _run(resolve(LossConfig(loss="gspo")), logp, old, -adv, torch.ones(2, 2))
    assert loss == pytest.approx((-(1 + 4e-4) + (1 - 3e-4)) / 2, abs=1e-9)
    assert torch.equal(grad, torch.zeros_like(grad))
    assert m["clip_frac_low"] == 0.5 and m["clip_frac_high"] == 0.5


@pytest.mark.parametrize(
    "cfg, loss_value, grad_row0, grad_row1",
    [
        # on-policy (ratio 1): per-token loss = -A. rows: 3 tokens with A=+1, 1 token with A=-2
        (resolve(LossConfig(aggregation="seq-mean-token-mean")), (-1 + 2) / 2, -1 / 6, 1.0),
        (resolve(LossConfig(aggregation="token-mean")), (-3 + 2) / 4, -1 / 4, 2 / 4),
        (resolve(LossConfig(loss="dr_grpo", max_completion_len=4)), (-3 + 2) / 8, -1 / 8, 2 / 8),
    ],
)
def test_aggregations_hand_computed(cfg, loss_value, grad_row0, grad_row1):
    logp = torch.full((2, 4), -1.0, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.float64)
    loss, m = policy_loss(logp, None, None, torch.tensor([1.0, -2.0]), mask, cfg)
    (grad,) = torch.autograd.grad(loss, logp)
    assert loss.item() == pytest.approx(loss_value)
    expect = torch.tensor([[grad_row0] * 3 + [0.0], [grad_row1, 0.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(grad, expect)
    assert m["ratio_mean"] == 1.0 and m["active_tokens"] == 4.0


@pytest.mark.parametrize(
    "estimator, loss_value, grads",
    [
        # d = ref - logp = [-1, +1]; beta 0.1; token-mean over 2 tokens; advantages 0 so only KL remains
        ("k1", 0.0, [0.05, 0.05]),  # k1 = -d = logp - ref, d/dlogp = 1
        ("k2", 0.05, [0.05, -0.05]),  # k2 = d^2 / 2, d/dlogp = -d
        ("k3", 0.1 * (1 / E + E - 2) / 2, [0.05 * (1 - 1 / E), 0.05 * (1 - E)]),  # exp(d) - d - 1
    ],
)
def test_kl_estimators(estimator, loss_value, grads):
    logp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-2.0, -1.0]], dtype=torch.float64)
    cfg = resolve(LossConfig(loss="dapo", beta=0.1, kl_estimator=estimator))
    loss, m = policy_loss(logp, None, ref, torch.zeros(1), torch.ones(1, 2), cfg)
    (grad,) = torch.autograd.grad(loss, logp)
    assert loss.item() == pytest.approx(loss_value, abs=1e-12)
    torch.testing.assert_close(grad, torch.tensor([grads], dtype=torch.float64))
    assert m["kl_mean"] == pytest.approx(loss_value / 0.1, abs=1e-12)


def test_k3_log_ratio_clamped():
    logp = torch.tensor([[-60.0]], dtype=torch.float64, requires_grad=True)
    loss, _ = policy_loss(logp, None, torch.tensor([[-1.0]]), torch.zeros(1), torch.ones(1, 1),
                          resolve(LossConfig(beta=1.0, kl_clamp=20.0)))
    assert loss.item() == pytest.approx(math.exp(20) - 21)


def test_entropy_bonus_and_top_quantile():
    ent = torch.tensor([[0.1, 0.5, 0.9, 2.0, 0.3]], dtype=torch.float64, requires_grad=True)
    logp = torch.full((1, 5), -1.0, dtype=torch.float64, requires_grad=True)
    # bonus: loss = -A (token-mean) - 0.01 * mean entropy = -1 - 0.01 * 0.76
    cfg = resolve(LossConfig(loss="dapo", entropy_coef=0.01))
    loss, m = policy_loss(logp, None, None, torch.ones(1), torch.ones(1, 5), cfg, entropy=ent)
    assert loss.item() == pytest.approx(-1 - 0.0076)
    assert m["entropy_mean"] == pytest.approx(0.76)
    torch.testing.assert_close(torch.autograd.grad(loss, ent)[0], torch.full((1, 5), -0.002, dtype=torch.float64))
    # top 20% entropy: only the 2.0 token keeps its policy gradient (normaliser stays all 5 active tokens)
    cfg = resolve(LossConfig(loss="dapo", entropy_top_quantile=0.2))
    loss, _ = policy_loss(logp, None, None, torch.ones(1), torch.ones(1, 5), cfg, entropy=ent.detach())
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.0, 0.0, -0.2, 0.0]], dtype=torch.float64))


def test_top_entropy_keeps_every_active_token_in_the_per_sequence_normaliser():
    # Active entropies (8 tokens) 0.1 .5 .9 2.0 .3 | 1.5 .2 .4: top 25% (threshold 1.05) keeps 2.0 and 1.5.
    # seq-mean-token-mean divides each sequence by ALL its tokens (5 and 3), not by its kept ones (1 and 1):
    # loss = (-1 / 5 + 2 / 3) / 2, grads -1 / (5 * 2) and 2 / (3 * 2) (they were -1/2 and 1 before the fix).
    ent = torch.tensor([[0.1, 0.5, 0.9, 2.0, 0.3], [1.5, 0.2, 0.4, 9.0, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)  # the 9.0s are padding
    logp = torch.full((2, 5), -1.0, dtype=torch.float64, requires_grad=True)
    cfg = resolve(LossConfig(loss="grpo", entropy_top_quantile=0.25))
    loss, _ = policy_loss(logp, None, None, torch.tensor([1.0, -2.0]), mask, cfg, entropy=ent)
    (grad,) = torch.autograd.grad(loss, logp)
    assert loss.item() == pytest.approx((-1 / 5 + 2 / 3) / 2)
    expect = torch.zeros(2, 5, dtype=torch.float64)
    expect[0, 3], expect[1, 0] = -1 / 10, 1 / 3
    torch.testing.assert_close(grad, expect)


@pytest.mark.parametrize(
    "cfg",
    [
        resolve(LossConfig(loss="dapo", beta=0.05)),
        resolve(LossConfig(loss="dr_grpo", max_completion_len=7, beta=0.05)),
        resolve(LossConfig(loss="grpo", beta=0.05, dual_clip_c=3.0)),
        resolve(LossConfig(loss="gspo")),
        resolve(LossConfig(loss="cispo", cispo_max_weight=1.1)),
        resolve(LossConfig(loss="sapo", beta=0.05)),
    ],
    ids=["token-mean", "dr-grpo", "seq-mean", "gspo", "cispo", "sapo"],
)
def test_micro_batches_sum_to_one_batch_gradient(cfg):
    g = torch.Generator().manual_seed(0)
    b, t = 6, 7
    logp = (-torch.rand(b, t, generator=g, dtype=torch.float64) * 3).requires_grad_()
    old = logp.detach() + 0.3 * torch.randn(b, t, generator=g, dtype=torch.float64)
    ref = logp.detach() + 0.3 * torch.randn(b, t, generator=g, dtype=torch.float64)
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    lengths = torch.tensor([7, 1, 4, 6, 2, 5])
    mask = torch.arange(t)[None, :] < lengths[:, None]  # [B, T] right padding, uneven lengths

    loss, _ = policy_loss(logp, old, ref, adv, mask, cfg)
    (grad_full,) = torch.autograd.grad(loss, logp)
    grad_sum = torch.zeros_like(logp)
    for rows in [slice(0, 1), slice(1, 4), slice(4, 6)]:  # uneven micro-batches
        mb_loss, _ = policy_loss(logp[rows], old[rows], ref[rows], adv[rows], mask[rows], cfg,
                                 num_tokens_total=int(mask.sum()), num_seqs_total=b)
        grad_sum += torch.autograd.grad(mb_loss, logp)[0]
    torch.testing.assert_close(grad_sum, grad_full, atol=1e-12, rtol=0)
    assert grad_full.abs().sum() > 0


def test_on_policy_none_old_logp_gives_ratio_one_and_reinforce_gradient():
    logp = torch.tensor([[-0.3, -2.0]], dtype=torch.float64, requires_grad=True)
    loss, m = policy_loss(logp, None, None, torch.tensor([2.0]), torch.ones(1, 2), resolve(LossConfig(loss="dapo")))
    assert m["ratio_min"] == m["ratio_max"] == 1.0
    torch.testing.assert_close(torch.autograd.grad(loss, logp)[0], torch.tensor([[-1.0, -1.0]], dtype=torch.float64))


def test_nonfinite_inputs_masked_and_counted():
    logp = torch.tensor([[-1.0, float("nan"), -1.0], [-1.0, -1.0, float("nan")]], requires_grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])  # the second NaN is padding: not counted
    adv = torch.tensor([[1.0, 1.0, 1.0], [float("inf"), 1.0, 1.0]])
    loss, m = policy_loss(logp, None, None, adv, mask, resolve(LossConfig(loss="dapo")))
    (grad,) = torch.autograd.grad(loss, logp)
    assert m["num_nonfinite"] == 2.0 and m["active_tokens"] == 3.0
    assert loss.item() == pytest.approx(-1.0)
    assert torch.isfinite(grad).all()
    torch.testing.assert_close(grad, torch.tensor([[-1 / 3, 0.0, -1 / 3], [0.0, -1 / 3, 0.0]]))


def test_shape_mismatch_names_both_shapes():
    logp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"old_logp has shape \(2, 4\) but mask has shape \(2, 3\)"):
        policy_loss(logp, torch.zeros(2, 4), None, torch.zeros(2), torch.ones(2, 3), resolve(LossConfig()))
    with pytest.raises(ValueError, match=r"advantages has shape \(3,\) but mask has shape \(2, 3\)"):
        policy_loss(logp, None, None, torch.zeros(3), torch.ones(2, 3), resolve(LossConfig()))


def test_bad_config():
    with pytest.raises(ValueError, match="unknown loss"):
        resolve(LossConfig(loss="ppo2"))
    with pytest.raises(ValueError, match="max_completion_len"):
        resolve(LossConfig(loss="dr_grpo"))
    with pytest.raises(ValueError, match="sapo_tau_pos and sapo_tau_neg must be > 0"):
        resolve(LossConfig(loss="sapo", sapo_tau_neg=0.0))
    with pytest.raises(ValueError, match="kl_estimator"):
        resolve(LossConfig(kl_estimator="k4"))
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(torch.zeros(1, 1), None, None, torch.zeros(1), torch.ones(1, 1), resolve(LossConfig(beta=0.1)))


def test_presets():
    r = resolve(LossConfig(loss="dapo"))
    assert (r.eps_low, r.eps_high, r.aggregation, r.ratio_level) == (0.2, 0.28, "token-mean", "token")
    r = resolve(LossConfig(loss="sapo"))
    assert (r.surrogate, r.aggregation, r.ratio_level) == ("sapo", "token-mean", "token")
    r = resolve(LossConfig(loss="grpo", eps_high=0.28, aggregation="token-mean"))
    assert (r.eps_high, r.aggregation) == (0.28, "token-mean")


def test_metrics_are_read_from_the_device_once_and_not_at_all_without_them(monkeypatch):
    """A GPU waits for the host at every read of a device value: policy_loss reads all its metrics (rollout
    correction and mismatch included) with one copy, and the fused head's per-chunk calls (with_metrics=False)
    read none. Checked by counting the host reads a tensor allows (item, tolist, float, int, bool)."""
    reads = []
    for name in ("item", "tolist", "__float__", "__int__", "__bool__"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _r=real, _n=name: reads.append(_n) or _r(self, *a))
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(3, 5, generator=g) - 2
    mask = torch.ones(3, 5)
    mask[1, 3:] = 0
    cfg = resolve(LossConfig(loss="dapo", beta=0.1, rollout_correction="tis"))
    kw = dict(entropy=torch.rand(3, 5, generator=g), sampler_logp=logp + 0.01, num_tokens_total=13, num_seqs_total=3)
    args = (logp.requires_grad_(), logp.detach() + 0.02, logp.detach() - 0.05, torch.randn(3, generator=g), mask,
            cfg)
    reads.clear()
    loss, metrics = policy_loss(*args, **kw)
    assert reads == ["tolist"] and metrics["active_tokens"] == 13.0 and metrics["mismatch_max_abs"] > 0
    reads.clear()
    loss_only, none = policy_loss(*args, **kw, with_metrics=False)
    assert reads == [] and none == {} and torch.equal(loss_only, loss)
