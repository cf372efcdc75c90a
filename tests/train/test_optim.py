"""AdamW variants: offloaded / master-weight AdamW equals torch.optim.AdamW step for step; fallbacks."""

import copy
import warnings

import pytest
import torch

from grpo_engine.train import optim
from grpo_engine.train.optim import OffloadedAdamW, OptimizerSection, adamw_update, build_optimizer, set_from_master


def make_params(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (5,), (3, 4, 2)]
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]


def set_grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


HP = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)


@pytest.mark.parametrize("state_device", ["cpu", None])
def test_offloaded_adamw_matches_torch_adamw(state_device):
    ours, ref = make_params(), make_params()
    opt = OffloadedAdamW(ours, **HP, state_device=state_device)
    ref_opt = torch.optim.AdamW(ref, foreach=False, **HP)
    for step in range(6):
        set_grads(ours, step)
        set_grads(ref, step)
        opt.step()
        ref_opt.step()
        for a, b in zip(ours, ref):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    torch.testing.assert_close(opt.state[ours[0]]["exp_avg_sq"], ref_opt.state[ref[0]]["exp_avg_sq"],
                               rtol=1e-6, atol=1e-9)


def test_adamw_update_hand_computed_first_step():
    """Step 1: m = (1-b1) g, v = (1-b2) g^2, update = lr * m_hat / (sqrt(v_hat) + eps) = lr * sign(g)."""
    state = {"master": torch.tensor([1.0, -2.0]), "exp_avg": torch.zeros(2), "exp_avg_sq": torch.zeros(2),
             "step": 0}
    group = dict(lr=0.1, betas=(0.9, 0.999), eps=0.0, weight_decay=0.5)
    adamw_update(state, torch.tensor([0.5, -4.0]), group)
    # decay first: 1 * (1 - 0.05) = 0.95 ; -2 * 0.95 = -1.9 ; then - 0.1 * sign(g)
    torch.testing.assert_close(state["master"], torch.tensor([0.85, -1.8]))


def test_bf16_params_get_fp32_master_and_match_fp32_adamw_rounded():
    ref = make_params()
    ours = [torch.nn.Parameter(p.detach().to(torch.bfloat16)) for p in ref]
    # the fp32 reference starts from the bf16-rounded values
    ref = [torch.nn.Parameter(p.detach().float()) for p in ours]
    opt = build_optimizer(ours, OptimizerSection(name="adamw", lr=1e-2, betas=[0.9, 0.99], weight_decay=0.1,
                                                 bf16_rounding="nearest"))
    assert isinstance(opt, OffloadedAdamW) and opt.state_device is None
    ref_opt = torch.optim.AdamW(ref, **HP)
    for step in range(4):
        set_grads(ref, step)
        for a, b in zip(ours, ref):
            a.grad = b.grad.to(torch.bfloat16)
        opt.step()
        ref_opt.step()
    for a, b in zip(ours, ref):
        assert opt.state[a]["master"].dtype == torch.float32
        # the master tracks fp32 AdamW (grads differ only by bf16 rounding); the param is its rounding
        torch.testing.assert_close(opt.state[a]["master"], b.detach(), rtol=0, atol=2e-3)
        assert torch.equal(a.detach(), opt.state[a]["master"].to(torch.bfloat16))


def resume_matches_uninterrupted(make, **kw) -> OffloadedAdamW:
    """Two runs of OffloadedAdamW(**kw) on params from make(): one uninterrupted for 4 steps, one resumed from its
    state dict after 2; their parameters must be equal. Returns the uninterrupted run's optimizer."""
    a, b = make(), make()
    opt_a, opt_b = OffloadedAdamW(a, **HP, **kw), OffloadedAdamW(b, **HP, **kw)
    for step in range(2):
        set_grads(a, step)
        set_grads(b, step)
        opt_a.step()
        opt_b.step()
    resumed = OffloadedAdamW(b, **HP, **kw)
    resumed.load_state_dict(copy.deepcopy(opt_b.state_dict()))
    for step in range(2, 4):
        set_grads(a, step)
        set_grads(b, step)
        opt_a.step()
        resumed.step()
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    return opt_a


def test_offloaded_state_dict_resume_is_exact():
    resume_matches_uninterrupted(make_params)


def test_plain_and_lr_scheduler_compatible():
    params = make_params()
    opt = build_optimizer(params, OptimizerSection(name="adamw_offload", lr=1e-3))
    torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5)  # requires a torch.optim.Optimizer
    assert opt.param_groups[0]["lr"] == pytest.approx(5e-4)
    assert isinstance(build_optimizer(make_params(), OptimizerSection(name="adamw")), torch.optim.AdamW)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback")
@pytest.mark.parametrize("name,fell_back_to", [("adamw_8bit", "adamw with fp32 state")])
def test_cpu_fallbacks_warn_and_strict_fails(name, fell_back_to):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = build_optimizer(make_params(), OptimizerSection(name=name))
    assert isinstance(opt, torch.optim.AdamW)
    msgs = [str(w.message) for w in caught]
    assert any(f"fell back to {fell_back_to}" in m for m in msgs), msgs
    with pytest.raises(ValueError, match="strict"):  # a config error: one line from the CLI, no traceback
        build_optimizer(make_params(), OptimizerSection(name=name, strict=True))


def test_bad_config_and_frozen_params():
    with pytest.raises(ValueError, match="optimizer.name"):
        OptimizerSection(name="sgd")
    with pytest.raises(ValueError, match="betas"):
        OptimizerSection(betas=[0.9])
    frozen = [torch.nn.Parameter(torch.zeros(2), requires_grad=False)]
    with pytest.raises(ValueError, match="no trainable"):
        build_optimizer(frozen, OptimizerSection())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_offloaded_adamw_cuda_bf16_matches_cpu():
    cpu = make_params(dtype=torch.bfloat16)
    gpu = [torch.nn.Parameter(p.detach().cuda()) for p in cpu]
    opt_c, opt_g = OffloadedAdamW(cpu, **HP, state_device=None), OffloadedAdamW(gpu, **HP)
    for step in range(3):
        set_grads(cpu, step)
        for a, b in zip(gpu, cpu):
            a.grad = b.grad.cuda()
        opt_c.step()
        opt_g.step()
    for a, b in zip(gpu, cpu):
        assert torch.equal(a.cpu(), b.detach())
        assert opt_g.state[a]["master"].device.type == "cpu"


def test_fused_adamw_runs_on_cpu_and_matches_foreach():
    """adamw_fused uses torch's CPU kernel (no fallback, no warning) and follows foreach AdamW step for step."""
    a, b = make_params(), make_params()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fused = build_optimizer(a, OptimizerSection(name="adamw_fused", lr=1e-2, weight_decay=0.1))
    plain = build_optimizer(b, OptimizerSection(name="adamw", lr=1e-2, weight_decay=0.1))
    assert fused.defaults["fused"] is True
    for step in range(5):
        g = torch.Generator().manual_seed(step)
        for pa, pb in zip(a, b):
            pa.grad = torch.randn(pa.shape, generator=g)
            pb.grad = pa.grad.clone()
        fused.step()
        plain.step()
    for pa, pb in zip(a, b):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)


def test_a_skipped_first_step_advances_the_schedule_without_a_warning(tiny_ckpt, tmp_path):
    """A first step whose groups were all filtered advances the LR schedule before any optimizer.step(): the
    schedule counts steps, so the second step uses the second learning rate, and torch's order warning is not
    shown to the user."""
    from pathlib import Path

    from grpo_engine.config import load_config
    from grpo_engine.plan.resolved import resolve_settings
    from grpo_engine.train.policy import build_policy

    cfg = load_config(str(Path(__file__).parents[2] / "configs/tiny_arithmetic.yaml"),
                      [f"model.path={tiny_ckpt}", f"run_dir={tmp_path}", "memory.precision=fp32",
                       "optimizer.lr=1e-3", "schedule.warmup_steps=4", "schedule.steps=8"])
    from grpo_engine.rl.losses import LossConfig, resolve
    from grpo_engine.train.update import UpdateSettings, update_policy

    policy = build_policy(resolve_settings(cfg, torch.device("cpu")))
    lrs = [policy.optimizer.param_groups[0]["lr"]]
    settings = UpdateSettings(resolve(LossConfig()), mu=1, grad_clip=1.0, temperature=1.0, chunk_size=4,
                              auto_halve=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = update_policy(policy.model, policy.optimizer, None, settings, 64, scheduler=policy.scheduler)
    assert out.skipped
    lrs.append(policy.optimizer.param_groups[0]["lr"])
    assert lrs == pytest.approx([1e-3 * 1 / 4, 1e-3 * 2 / 4])


@pytest.mark.parametrize("fused", [True, False])
def test_a_bf16_masters_sliced_update_is_adamw_then_one_rounding(monkeypatch, fused):
    """adamw_update_sliced over slices of 7 elements (a [5, 6] weight: 5 slices, the last short) with torch's fused
    kernel or without it gives the fp32 AdamW of the whole master (adamw_update), and the parameter its rounding."""
    from grpo_engine.train import optim

    monkeypatch.setattr(optim, "UPDATE_SLICE", 7)
    if not fused:
        monkeypatch.delattr(torch, "_fused_adamw_")
    g = torch.Generator().manual_seed(3)
    master = torch.randn(5, 6, generator=g)
    param = master.to(torch.bfloat16)
    ours = {"master": master.clone(), "exp_avg": torch.zeros(5, 6), "exp_avg_sq": torch.zeros(5, 6), "step": 0}
    ref = {k: v.clone() if torch.is_tensor(v) else v for k, v in ours.items()}
    group = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    for _ in range(3):
        grad = torch.randn(5, 6, generator=g).to(torch.bfloat16)
        optim.adamw_update_sliced(ours, grad, group, param)
        optim.adamw_update(ref, grad.float(), group)
    assert ours["step"] == ref["step"] == 3
    for key in ("master", "exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(ours[key], ref[key], rtol=0, atol=1e-6)
    assert torch.equal(param, ours["master"].to(torch.bfloat16))


def test_stochastic_rounding_picks_a_neighbour_with_the_masters_odds():
    """Masters 0.3 and 0.75 of bf16's spacing above a bf16 value (positive and negative): each draw is one of the
    two neighbours, the upper (in magnitude) about 30% / 75% of the time, so the mean is the master; a master that
    is a bf16 value stays itself; no generator is rounding to nearest."""
    base = torch.tensor([1.0, -1.0, 0.0625, 3.0])
    spacing = torch.tensor([2.0**-7, 2.0**-7, 2.0**-11, 2.0**-6])  # bf16 keeps 8 significant bits
    for frac in (0.3, 0.75):
        master = base + torch.sign(base) * frac * spacing  # [4], fp32 holds these exactly
        draws = torch.stack([set_from_master(master.expand(2000, 4).contiguous(), torch.bfloat16, draw)
                             for draw in range(5)]).float().reshape(-1, 4)  # [10000, 4]
        up = (draws.abs() > base.abs()).float().mean(0)
        assert torch.all((draws == base) | (draws.abs() == base.abs() + spacing))
        torch.testing.assert_close(up, torch.full((4,), frac), rtol=0, atol=0.02)
        torch.testing.assert_close(draws.mean(0), master, rtol=0, atol=0.02 * spacing.max().item())
    exact = torch.tensor([1.0, -0.5, 0.0, 2.0**-20])
    assert torch.equal(set_from_master(exact, torch.bfloat16, 7), exact.bfloat16())
    master = base + 0.3 * spacing
    assert torch.equal(set_from_master(master, torch.bfloat16, None), master.bfloat16())


def test_rounding_into_a_parameter_writes_what_a_fresh_rounding_returns(monkeypatch):
    """`out` (a parameter's slice in the sliced update) gets the same bits as a fresh tensor, for masters longer
    than one slice of the noise pool, both roundings; the int32 scratch is one buffer reused, not one per call."""
    monkeypatch.setattr(optim, "UPDATE_SLICE", 64)
    monkeypatch.setattr(optim, "_SCRATCH", {})
    monkeypatch.setattr(optim, "_NOISE_POOLS", {})
    master = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    for rounding in (None, 7):
        out = torch.empty(3, 50, dtype=torch.bfloat16)
        assert set_from_master(master, torch.bfloat16, rounding, out=out) is out
        assert torch.equal(out, set_from_master(master, torch.bfloat16, rounding))
    assert list(optim._SCRATCH) == [(torch.device("cpu"), torch.int32)]


def test_stochastic_rounding_moves_a_bf16_weight_that_nearest_rounding_keeps():
    """Steps of 1e-4 on weights at 1.5 (bf16 spacing 2^-7 = 0.0078): rounded to nearest, 30 steps leave every
    weight where it was; rounded stochastically, the weights the model runs follow their masters on the mean."""
    moved = {}
    for rounding in ("nearest", "stochastic"):
        w = torch.nn.Parameter(torch.full((4096,), 1.5, dtype=torch.bfloat16))
        opt = build_optimizer([w], OptimizerSection(name="adamw", lr=1e-4, weight_decay=0.0, bf16_rounding=rounding))
        for _ in range(30):
            w.grad = torch.ones_like(w)  # Adam's first steps move each master by about lr
            opt.step()
        master = opt.state[w]["master"]
        torch.testing.assert_close(master, torch.full_like(master, 1.5 - 30e-4), rtol=0, atol=1e-4)
        moved[rounding] = w.detach().float().mean().item()
    assert moved["nearest"] == 1.5
    assert moved["stochastic"] == pytest.approx(1.5 - 30e-4, abs=3e-4)


def test_stochastic_rounding_resumes_exactly():
    """The draws depend on the step and the parameter's index only: a run resumed from a state dict after two
    steps sets the same bf16 weights as the uninterrupted run, and another step count draws differently."""
    def params():
        return [torch.nn.Parameter(p.detach().to(torch.bfloat16)) for p in make_params()]

    opt = resume_matches_uninterrupted(params, state_device=None, stochastic_rounding=True)
    first = opt.param_groups[0]["params"][0]
    master = opt.state[first]["master"]
    draws = [set_from_master(master, torch.bfloat16, opt._rounding(first, {"step": s, "master": master}, 0))
             for s in (1, 2)]
    assert not torch.equal(*draws)


def test_a_sliced_stochastic_rounding_leaves_the_masters_as_adamw_and_rounds_each_slice(monkeypatch):
    """Over slices of 7 elements the masters are AdamW's whatever the rounding, each bf16 weight is one of its
    master's two bf16 neighbours, and the same draw gives the same weights."""
    from grpo_engine.train import optim

    monkeypatch.setattr(optim, "UPDATE_SLICE", 7)
    g = torch.Generator().manual_seed(3)
    start = torch.randn(5, 6, generator=g)
    grads = [torch.randn(5, 6, generator=g).to(torch.bfloat16) for _ in range(3)]
    group = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    runs = []
    for rounding in (None, 11, 11):
        state = {"master": start.clone(), "exp_avg": torch.zeros(5, 6), "exp_avg_sq": torch.zeros(5, 6), "step": 0}
        param = start.to(torch.bfloat16)
        for grad in grads:
            optim.adamw_update_sliced(state, grad, group, param, rounding)
        runs.append((state["master"], param))
    (nearest_master, nearest), (master, first), (_, second) = runs
    assert torch.equal(master, nearest_master) and torch.equal(first, second)
    down = master.bfloat16().float()
    down = torch.where(down > master, torch.nextafter(down.bfloat16(), torch.tensor(-1e9).bfloat16()).float(), down)
    up = torch.nextafter(down.bfloat16(), torch.tensor(1e9).bfloat16()).float()
    assert torch.all((first.float() == down) | (first.float() == up))
    assert not torch.equal(first, nearest)  # 30 weights: some rounded the other way
