"""The decode step's grouped attention: what CUDA runs for grouped KV heads (kernels/attention.py
decode_attention_for), equal to SDPA through the one decode loop in float64, reading K and V once in the model's dtype
with no host sync; on CUDA with SDPA's math kernel switched off."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from grpo_engine.kernels import apply_kernels
from grpo_engine.kernels.attention import decode_attention_for, grouped_attention
from grpo_engine.model.loading import load_model
from grpo_engine.rollout.generate import generate, generate_static
from grpo_engine.rollout.sampling import SamplingParams
from grpo_engine.rollout.static_decode import release_static_decode

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22], [30, 31, 32, 33, 34, 35]]  # ragged: left padding


def test_cuda_runs_the_grouped_kernel_for_grouped_heads_and_the_cpu_what_its_plan_measured():
    assert decode_attention_for("cuda", 14, 2, "sdpa") is grouped_attention
    assert decode_attention_for("cuda", 8, 8, "grouped") is None  # no grouping: SDPA's fused kernels take the mask
    assert decode_attention_for("cpu", 14, 2, "sdpa") is None
    assert decode_attention_for("cpu", 14, 2, "grouped") is grouped_attention


def _set_decode_attention(model, kernel) -> None:
    model.kernels = replace(model.kernels, decode_attention=kernel)


@pytest.mark.parametrize("kv_heads", [2, 4], ids=["gqa", "mha"])
@pytest.mark.parametrize("loop", ["generate", "static"])
def test_the_grouped_kernel_decodes_as_sdpa_does_float64(tiny_ckpt_factory, kv_heads, loop):
    """The decode (the cache's scratch slot, per-row write slots and bucket step-down; through generate and through
    the forced eager loop), ragged prompts, sampled rows finishing at different steps: same tokens, log-probs equal
    to 1e-10."""
    model = load_model(tiny_ckpt_factory("qwen2", num_key_value_heads=kv_heads), dtype=torch.float64)
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=12, stop_token_ids=list(range(0, 256, 8)))

    def run():
        if loop == "static":
            try:
                return generate_static(model, PROMPTS, params, seed=7)
            finally:
                release_static_decode(model)
        return generate(model, PROMPTS, params, seed=7)

    _set_decode_attention(model, None)
    sdpa = run()
    calls = []

    def grouped_counted(q, k, v, mask):
        calls.append(q.shape)
        return grouped_attention(q, k, v, mask)

    _set_decode_attention(model, grouped_counted)
    grouped = run()
    assert len(calls) >= 11 * len(model.layers)  # every decode step of every layer ran it (12 tokens: 11 steps)
    assert grouped.completion_ids == sdpa.completion_ids
    assert len({len(c) for c in sdpa.completion_ids}) > 1  # rows of different lengths
    for a, b in zip(grouped.logprobs, sdpa.logprobs):
        torch.testing.assert_close(torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64),
                                   rtol=0, atol=1e-10)


class _Ops(TorchDispatchMode):
    """Records each op's name and the size and dtype of each new tensor it returns (not views)."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, int, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:  # not a view
                self.seen.append((str(func), t.numel(), t.dtype))
        return out


def test_the_grouped_kernel_never_expands_k_and_v_to_the_query_heads():
    """No op allocates a tensor larger than K (an expansion to every query head would be G = 6 times K; on the CPU
    K and V are upcast to fp32 for fp32 scores, each K's size), none is SDPA, and the output stays bf16."""
    g = torch.Generator().manual_seed(0)
    B, H, n_kv, S, D = 8, 12, 2, 64, 16
    q = torch.randn(B, H, 1, D, generator=g).bfloat16()
    k, v = (torch.randn(B, n_kv, S, D, generator=g).bfloat16() for _ in range(2))
    mask = torch.rand(B, 1, 1, S, generator=g) > 0.2
    with _Ops() as ops:
        out = grouped_attention(q, k, v, mask)
    assert out.dtype == torch.bfloat16 and out.shape == (B, H, 1, D)
    assert not [op for op, _, _ in ops.seen if "scaled_dot_product" in op]
    assert max(n for _, n, _ in ops.seen) <= k.numel(), ops.seen
    want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask,
                                                           enable_gqa=True)
    torch.testing.assert_close(out.double(), want, rtol=0, atol=2e-2)


def _large_logit_inputs(seed: int, device: str = "cpu"):
    """bf16 q, k, v of a decode step (9 query heads over 3 KV heads, 64 dims, 96 slots) scaled so that the
    attention logits q.k / sqrt(D) reach the tens, as in trained checkpoints; a random key mask."""
    g = torch.Generator(device=device).manual_seed(seed)
    B, H, n_kv, S, D = 4, 9, 3, 96, 64
    q = torch.randn(B, H, 1, D, generator=g, device=device) * 2.5
    k = torch.randn(B, n_kv, S, D, generator=g, device=device) * 2.5
    v = torch.randn(B, n_kv, S, D, generator=g, device=device)
    mask = torch.rand(B, 1, 1, S, generator=g, device=device) > 0.1
    mask[..., -1] = True
    return q.bfloat16(), k.bfloat16(), v.bfloat16(), mask


def _rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_grouped_kernel_in_bf16_is_as_close_to_float64_as_sdpa_with_large_logits(seed):
    """Scores computed and scaled in fp32: with logits in the tens, the grouped kernel's error against float64
    (on the same bf16 inputs) is no larger than SDPA's (called directly: its CPU kernels keep fp32 scores).
    Scores rounded to bf16 give about 4-5x SDPA's error here."""
    q, k, v, mask = _large_logit_inputs(seed)
    logits = (q.double().view(4, 3, 3, 64) @ k.double().transpose(-1, -2)) / 8  # [B, H_kv, G, S]
    assert logits.abs().max() > 15
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, enable_gqa=True)
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    grouped = grouped_attention(q, k, v, mask)
    assert grouped.dtype == torch.bfloat16
    assert _rel_error(grouped, ref) <= _rel_error(sdpa, ref)


def test_the_grouped_kernel_traces_whole_with_no_host_sync():
    """torch.compile(fullgraph=True) fails on a host sync or a data-dependent branch: the kernel is capturable."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(3, 4, 1, 8, generator=g)
    k, v = (torch.randn(3, 2, 10, 8, generator=g) for _ in range(2))
    mask = torch.rand(3, 1, 1, 10, generator=g) > 0.3
    mask[..., -1] = True
    traced = torch.compile(grouped_attention, backend="eager", fullgraph=True)
    torch.testing.assert_close(traced(q, k, v, mask), grouped_attention(q, k, v, mask), rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_decodes_grouped_heads_with_the_math_sdpa_kernel_off(tiny_ckpt, dtype):
    """A GQA model kernel-planned on CUDA decodes (graphs, and eager chunks) with only flash /
    memory-efficient SDPA allowed: its decode steps never reach SDPA's math kernel. fp32: the same greedy tokens."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = apply_kernels(load_model(tiny_ckpt, dtype=dtype, device="cuda"))
    assert model.kernels.decode_attention is grouped_attention
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=16)
    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
            graphed = generate(model, PROMPTS, params)
            eager = generate(model, PROMPTS, SamplingParams(n=2, temperature=0.0, max_new_tokens=16,
                                                            cuda_graphs="off"))
    finally:
        release_static_decode(model)
    assert all(torch.isfinite(torch.tensor(lp)).all() for lp in graphed.logprobs + eager.logprobs)
    if dtype == torch.float32:
        assert graphed.completion_ids == eager.completion_ids


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_grouped_kernel_equals_sdpa_on_cuda_float64():
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(6, 4, 1, 16, generator=g, device="cuda", dtype=torch.float64)
    k, v = (torch.randn(6, 2, 40, 16, generator=g, device="cuda", dtype=torch.float64) for _ in range(2))
    mask = torch.rand(6, 1, 1, 40, generator=g, device="cuda") > 0.3
    mask[..., -1] = True
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(grouped_attention(q, k, v, mask), want, rtol=0, atol=1e-10)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_grouped_kernel_in_bf16_on_cuda_is_as_close_to_float64_as_sdpa_with_large_logits():
    """On CUDA (fp32 scores through the bf16 GEMM with an fp32 output where the build has it): the error against
    float64 within 10% of SDPA's fused kernels' (which round the probabilities to bf16 as this kernel does)."""
    errors = {"grouped": 0.0, "sdpa": 0.0}
    for seed in range(3):
        q, k, v, mask = _large_logit_inputs(seed, "cuda")
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, enable_gqa=True)
        errors["grouped"] += _rel_error(grouped_attention(q, k, v, mask), ref)
        errors["sdpa"] += _rel_error(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True), ref)
    assert errors["grouped"] <= 1.1 * errors["sdpa"], errors
