"""LoRA rollouts sample the policy being trained: in bf16 an adapter update too small to survive a merge into W
still moves the sampler's log-probs as it moves the trainer's (both against a float64 copy of the same weights)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from grpo_engine.config.training import LoRAConfig
from grpo_engine.model.loading import load_model
from grpo_engine.model.lora import LoRALinear, adapters_disabled, apply_lora, lora_merged, merge_lora
from grpo_engine.plan.policy_spec import PolicySpec
from grpo_engine.rollout.generate import generate
from grpo_engine.rollout.sampling import SamplingParams
from grpo_engine.train.batch import build_train_batch
from grpo_engine.train.forward import batch_logprobs
from grpo_engine.train.policy import Policy

EPS = 4e-4  # the adapter's scale: s B A has entries up to EPS / 8, under half a bf16 step of every entry of W


@torch.no_grad()
def _sub_ulp_update_model(ckpt, dtype: torch.dtype) -> nn.Module:
    """The tiny model with a rank-1 adapter on the last layer's o_proj, set up so that the adapter's change is
    below half a bf16 step of every entry of W yet moves the log-probs well above bf16 rounding:

    the layer's v_proj reads nothing and adds a +-1 bias, so o_proj's input x is that +-1 pattern at every
    position (every head averages identical values); o_proj's rows have entries of magnitude 0.03-0.1 and are
    orthogonal to x (half of each row's signs agree with x), so the base adds nothing to the residual stream
    and A = x / |x| makes the adapter add s B |x| at every position: EPS / 8 per entry of W, EPS per output."""
    model = apply_lora(load_model(ckpt, dtype=torch.float32), LoRAConfig(rank=1, alpha=1.0, target_modules=["o_proj"]))
    g = torch.Generator().manual_seed(3)
    attn = model.layers[-1].attn
    v_bias = torch.where(torch.rand(attn.v_proj.bias.shape, generator=g) < 0.5, -1.0, 1.0)  # [Hkv * D]
    attn.v_proj.weight.zero_()
    attn.v_proj.bias.copy_(v_bias)
    group = attn.n_heads // attn.n_kv
    x = v_bias.view(attn.n_kv, 1, attn.head_dim).expand(-1, group, -1).reshape(-1)  # [H * D]: head h reads h // group
    n_out, n_in = attn.o_proj.weight.shape
    signs = torch.stack([torch.randperm(n_in, generator=g) % 2 * 2 - 1 for _ in range(n_out)]).float()  # [out, in]
    scale = (0.03 + 0.07 * torch.rand(n_out, 1, generator=g)).bfloat16().float()  # [out, 1], exact in bf16
    attn.o_proj.weight.copy_(scale * signs * x)  # each row: as many +x_j as -x_j, so row . x = 0
    attn.o_proj.lora_A.copy_(x / x.norm())  # [1, in]
    u = torch.randn(n_out, generator=g)
    attn.o_proj.lora_B.copy_((EPS * u / u.abs().max())[:, None])  # [out, 1]
    return model.to(dtype).eval()


def _completion_logprobs(model, batch) -> torch.Tensor:
    """The trainer's log-probs (train/forward.py) of the batch's completion tokens, [N] float64."""
    logp = batch_logprobs(model, batch, 4096, temperature=1.0, chunk_size=64)  # [B, T]
    return logp.double()[batch.completion_mask.bool()]


def test_a_bf16_lora_rollout_samples_the_adapted_policy_that_a_merge_would_round_away(tiny_ckpt):
    model, exact = _sub_ulp_update_model(tiny_ckpt, torch.bfloat16), _sub_ulp_update_model(tiny_ckpt, torch.float64)
    o_proj = model.layers[-1].attn.o_proj
    merged_weight = (o_proj.weight.double() + o_proj.delta_weight().double()).to(torch.bfloat16)
    assert torch.equal(merged_weight, o_proj.weight)  # a merge would leave W (and the sampled policy) as it was
    policy = Policy(model, None, None, None, PolicySpec("lora", "none", False), None)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    with policy.rollout_weights():
        out = generate(model, prompts, SamplingParams(n=4, temperature=1.0, max_new_tokens=24), seed=0)
    rows = [prompts[i] for i in out.prompt_index]
    batch = build_train_batch(rows, out.completion_ids, out.logprobs, torch.zeros(len(rows)), [True] * len(rows), 0)
    rollout = batch.sampler_logp.double()[batch.completion_mask.bool()]  # [N]
    trainer, reference = _completion_logprobs(model, batch), _completion_logprobs(exact, batch)
    with adapters_disabled(model), adapters_disabled(exact):
        base, reference_base = _completion_logprobs(model, batch), _completion_logprobs(exact, batch)

    def mean_gap(a: torch.Tensor, b: torch.Tensor) -> float:
        return (a - b).abs().mean().item()

    update = mean_gap(reference, reference_base)  # what the update moves, in float64
    assert update > 3e-3
    assert mean_gap(trainer, reference) < 0.3 * update  # the trainer sees the update (bf16 rounding aside)
    assert mean_gap(rollout, reference) < 0.3 * update  # and so does the sampler
    assert mean_gap(rollout, trainer) < 0.3 * update
    assert mean_gap(base, reference) > 0.7 * update  # the merged (= base) weights would have missed it


def test_a_bf16_adapter_output_is_rounded_once_with_the_base_product():
    """x W^T + s B A x rounded once: an adapter change mostly under half a step of the outputs moves them as the
    exact sum rounded to bf16 does (y + s B A x added after rounding y loses most of the change)."""
    g = torch.Generator().manual_seed(0)
    linear = nn.Linear(64, 32, bias=False).bfloat16()
    lora = LoRALinear(linear, LoRAConfig(rank=2, alpha=2.0))
    with torch.no_grad():
        lora.weight.copy_(torch.randn(32, 64, generator=g) * 0.1)
        lora.lora_A.copy_(torch.randn(2, 64, generator=g) * 0.1)
        lora.lora_B.copy_(torch.randn(32, 2, generator=g) * 1e-5)
    x = torch.randn(256, 64, generator=g).bfloat16()
    base = torch.nn.functional.linear(x, lora.weight).detach()  # [256, 32]
    delta = x.double() @ lora.delta_weight().detach().double().T  # [256, 32]
    want = (x.double() @ lora.weight.double().T + delta).to(torch.bfloat16)  # the exact sum, rounded once
    added_after = base + delta.to(torch.bfloat16)
    assert 3 * (added_after != base).sum() < (want != base).sum()  # rounding y first loses most of the change
    with torch.no_grad():
        out = lora(x)
    assert (out == want).double().mean() > 0.999  # (an accumulation-order tie aside)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_low_precision_base_is_never_merged(tiny_ckpt, dtype):
    model = apply_lora(load_model(tiny_ckpt, dtype=dtype), LoRAConfig(rank=4))
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(std=0.1)  # lora_B non-zero
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        want = model(ids)
        assert merge_lora(model) == 0
        with lora_merged(model):
            assert torch.equal(model(ids), want)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_the_bf16_adapter_path_traces_whole_with_no_host_sync():
    """What the CUDA graph captures of an unmerged adapter: torch.compile(fullgraph=True) fails on a host sync or a
    data-dependent branch."""
    g = torch.Generator().manual_seed(0)
    lora = LoRALinear(nn.Linear(64, 32).bfloat16(), LoRAConfig(rank=4)).eval()
    with torch.no_grad():
        lora.lora_B.copy_(torch.randn(32, 4, generator=g) * 0.01)
        x = torch.randn(3, 1, 64, generator=g).bfloat16()  # [rows, 1 token, in], as a decode step feeds it
        traced = torch.compile(lora, backend="eager", fullgraph=True)
        torch.testing.assert_close(traced(x), lora(x), rtol=0, atol=0)
