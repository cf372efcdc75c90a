"""Chunked log-probs equal the naive log_softmax + gather (values and gradients) and use less memory."""

import math

import pytest
import torch
from references import naive_token_logprobs
from torch.profiler import ProfilerActivity, profile

from grpo_engine.model.loading import load_model
from grpo_engine.rl.logprobs import token_logprobs


def _problem(n=37, d=8, v=50, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g, dtype=dtype).requires_grad_()
    w = torch.randn(v, d, generator=g, dtype=dtype).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g)
    return h, w, t


@pytest.mark.parametrize("chunk_size", [1, 5, 16, 37, 64])  # 5 and 16 do not divide 37; 64 > N
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_grads_match_naive_float64(chunk_size, temperature):
    h, w, t = _problem()
    g = torch.Generator().manual_seed(1)
    coef_lp = torch.randn(37, generator=g, dtype=torch.float64)
    coef_ent = torch.randn(37, generator=g, dtype=torch.float64)

    lp, ent = token_logprobs(h, w, t, temperature=temperature, chunk_size=chunk_size, with_entropy=True)
    gh, gw = torch.autograd.grad((lp * coef_lp + ent * coef_ent).sum(), (h, w))
    lp_ref, ent_ref = naive_token_logprobs(h, w, t, temperature=temperature)
    gh_ref, gw_ref = torch.autograd.grad((lp_ref * coef_lp + ent_ref * coef_ent).sum(), (h, w))

    for got, ref in [(lp, lp_ref), (ent, ent_ref), (gh, gh_ref), (gw, gw_ref)]:
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, ref, atol=1e-10, rtol=0)


def test_logprob_only_grads_and_no_entropy():
    h, w, t = _problem()
    lp, ent = token_logprobs(h, w, t, chunk_size=6)
    assert ent is None
    gh, gw = torch.autograd.grad(lp.sum(), (h, w))
    lp_ref, _ = naive_token_logprobs(h, w, t)
    gh_ref, gw_ref = torch.autograd.grad(lp_ref.sum(), (h, w))
    torch.testing.assert_close(gh, gh_ref, atol=1e-10, rtol=0)
    torch.testing.assert_close(gw, gw_ref, atol=1e-10, rtol=0)


def test_hand_computed_uniform_logits():
    # weight = 0 -> all logits 0 -> uniform over V=4: logp = -log 4, entropy = log 4, at any temperature.
    h = torch.randn(3, 2, dtype=torch.float64)
    w = torch.zeros(4, 2, dtype=torch.float64)
    lp, ent = token_logprobs(h, w, torch.tensor([0, 3, 1]), temperature=0.5, chunk_size=2, with_entropy=True)
    torch.testing.assert_close(lp, torch.full((3,), -math.log(4), dtype=torch.float64))
    torch.testing.assert_close(ent, torch.full((3,), math.log(4), dtype=torch.float64))


def test_bf16_inputs_compute_in_fp32_and_grads_flow():
    h, w, t = _problem(dtype=torch.float32)
    hb, wb = h.detach().bfloat16().requires_grad_(), w.detach().bfloat16().requires_grad_()
    lp, ent = token_logprobs(hb, wb, t, chunk_size=8, with_entropy=True)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    (lp.sum() + ent.sum()).backward()
    assert hb.grad.dtype == torch.bfloat16 and wb.grad.dtype == torch.bfloat16
    lp_ref, _ = naive_token_logprobs(hb.detach().double(), wb.detach().double(), t)
    torch.testing.assert_close(lp.double(), lp_ref, atol=0.05, rtol=0.02)


def test_matches_model_logits(tiny_ckpt):
    """On the real model: chunked log-probs from hidden states == log_softmax of model(ids) logits."""
    model = load_model(tiny_ckpt, dtype=torch.float64)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    hidden = model(ids, return_hidden=True)[:, :-1].reshape(-1, model.config.hidden_size)  # [B*(T-1), D]
    targets = ids[:, 1:].reshape(-1)
    lp, _ = token_logprobs(hidden, model.lm_head.weight, targets, temperature=0.9, chunk_size=5)
    logits = model(ids)[:, :-1].reshape(-1, model.config.vocab_size) / 0.9
    ref = torch.log_softmax(logits, -1).gather(1, targets[:, None]).squeeze(1)
    torch.testing.assert_close(lp, ref, atol=1e-10, rtol=0)


def _peak_bytes(fn) -> int:
    """Peak of live CPU tensor bytes allocated inside fn (relative to its start), from the profiler timeline."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        fn()
    live = peak = 0
    for _, action, _, size in prof._memory_profile().timeline:
        if action.name == "CREATE":
            live += size
        elif action.name == "DESTROY":
            live -= size
        peak = max(peak, live)
    return peak


def test_peak_memory_below_naive_for_qwen_vocab():
    n, d, v, chunk = 64, 16, 151_936, 16
    h, w, t = _problem(n=n, d=d, v=v, dtype=torch.float32)

    def chunked():
        lp, _ = token_logprobs(h, w, t, chunk_size=chunk)
        torch.autograd.grad(lp.sum(), (h, w))

    def naive():
        lp, _ = naive_token_logprobs(h, w, t)
        torch.autograd.grad(lp.sum(), (h, w))

    peak_chunked, peak_naive = _peak_bytes(chunked), _peak_bytes(naive)
    full_logits = n * v * 4
    # Both need grad_w ([V, D], = full_logits / 4 here); the naive path additionally holds [N, V] tensors.
    assert peak_naive >= 2 * full_logits
    print(f"peak bytes: chunked {peak_chunked}, naive {peak_naive}")
    assert peak_chunked < peak_naive / 2
    assert peak_chunked < v * d * 4 + 3 * chunk * v * 4  # grad_w + a few [chunk, V] buffers


@pytest.mark.parametrize(
    "shapes, match",
    [
        (((4, 8), (10, 7), (4,)), "hidden size mismatch"),
        (((2, 4, 8), (10, 8), (4,)), r"hidden \[N, D\]"),
        (((4, 8), (10, 8), (5,)), "targets"),
    ],
)
def test_bad_shapes_raise(shapes, match):
    (hs, ws, ts) = shapes
    with pytest.raises(ValueError, match=match):
        token_logprobs(torch.zeros(hs), torch.zeros(ws), torch.zeros(ts, dtype=torch.long))


def test_bad_ids_and_temperature_raise():
    h, w = torch.zeros(2, 3), torch.zeros(5, 3)
    with pytest.raises(ValueError, match=r"\[0, 5\)"):
        token_logprobs(h, w, torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(h, w, torch.tensor([0, 1]), temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        token_logprobs(h, w, torch.tensor([0, 1]), chunk_size=0)


def test_large_vocab_uses_row_blocks_and_stays_exact():
    """V = 40,000 in float64: the entropy and its gradient are formed a few rows at a time (blocks of 6 rows,
    a chunk of 16), the log-softmax overwrites the logits in place -- still equal to the naive version."""
    from grpo_engine.rl.logprobs import _ChunkBuffers

    assert _ChunkBuffers(16, 40_000, torch.float64, torch.device("cpu"), 37).block == 6
    h, w, t = _problem(n=37, d=4, v=40_000)
    g = torch.Generator().manual_seed(3)
    coef_lp, coef_ent = torch.randn(37, generator=g, dtype=torch.float64), torch.randn(37, generator=g,
                                                                                         dtype=torch.float64)
    lp, ent = token_logprobs(h, w, t, temperature=0.8, chunk_size=16, with_entropy=True)
    gh, gw = torch.autograd.grad((lp * coef_lp + ent * coef_ent).sum(), (h, w))
    lp_ref, ent_ref = naive_token_logprobs(h, w, t, temperature=0.8)
    gh_ref, gw_ref = torch.autograd.grad((lp_ref * coef_lp + ent_ref * coef_ent).sum(), (h, w))
    for got, ref in [(lp, lp_ref), (ent, ent_ref), (gh, gh_ref), (gw, gw_ref)]:
        torch.testing.assert_close(got, ref, atol=1e-10, rtol=0)


@pytest.mark.parametrize("with_entropy_grad", [True, False])
def test_with_grads_equals_autograd_of_a_per_token_loss(with_entropy_grad):
    """token_logprobs_with_grads: L = sum_i a_i logp_i + b_i H_i + c_i logp_i^2 (a per-token loss whose
    gradient depends on the token's own value) -> same values and gradients as autograd on the naive head;
    grad_weight_out is added to, not overwritten."""
    from grpo_engine.rl.logprobs import token_logprobs_with_grads

    h, w, t = _problem(n=37, d=8, v=300)
    g = torch.Generator().manual_seed(4)
    a, b, c = (torch.randn(37, generator=g, dtype=torch.float64) for _ in range(3))
    b = b if with_entropy_grad else torch.zeros(37, dtype=torch.float64)

    def token_grad(s, e, logp, ent):
        return a[s:e] + 2 * c[s:e] * logp, (b[s:e] if with_entropy_grad else None)

    prior = torch.randn(w.shape, generator=g, dtype=torch.float64)
    out = token_logprobs_with_grads(h.detach(), w.detach(), t, token_grad, temperature=0.9, chunk_size=10,
                                    with_entropy=True, grad_weight_out=prior.clone())
    lp_ref, ent_ref = naive_token_logprobs(h, w, t, temperature=0.9)
    loss = (a * lp_ref + b * ent_ref + c * lp_ref**2).sum()
    gh_ref, gw_ref = torch.autograd.grad(loss, (h, w))
    torch.testing.assert_close(out.logp, lp_ref.detach(), atol=1e-10, rtol=0)
    torch.testing.assert_close(out.entropy, ent_ref.detach(), atol=1e-10, rtol=0)
    torch.testing.assert_close(out.grad_hidden, gh_ref, atol=1e-10, rtol=0)
    torch.testing.assert_close(out.grad_weight, prior + gw_ref, atol=1e-10, rtol=0)
    with pytest.raises(ValueError, match="grad_weight_out"):
        token_logprobs_with_grads(h.detach(), w.detach(), t, token_grad, grad_weight_out=torch.zeros(3, 8))


def test_a_bf16_weights_gradient_is_added_into_its_own_bf16_grad():
    """A bf16 head with a bf16 grad_weight_out (the weight's .grad): each chunk's gradient is added into that tensor
    in place, and the sum is the float64 gradient to bf16's precision (a few roundings of 2^-9 over 4 chunks)."""
    from grpo_engine.rl.logprobs import token_logprobs_with_grads

    h, w, t = _problem(n=37, d=8, v=300)
    g = torch.Generator().manual_seed(5)
    a = torch.randn(37, generator=g, dtype=torch.float64)
    prior = torch.randn(w.shape, generator=g, dtype=torch.float64)
    into = prior.to(torch.bfloat16)
    h16, w16 = h.detach().bfloat16(), w.detach().bfloat16()

    def token_grad(s, e, logp, ent):
        return a[s:e].float(), None

    out = token_logprobs_with_grads(h16, w16, t, token_grad, chunk_size=10, with_entropy=False, grad_weight_out=into)
    assert out.grad_weight is into and into.dtype == torch.bfloat16
    hb, wb = h16.double().requires_grad_(), w16.double().requires_grad_()
    lp_ref, _ = naive_token_logprobs(hb, wb, t)
    (gw_ref,) = torch.autograd.grad((a * lp_ref).sum(), (wb,))
    expected = prior.to(torch.bfloat16).double() + gw_ref
    assert (into.double() - expected).norm() / expected.norm() < 1e-2
    with pytest.raises(ValueError, match="grad_weight_out"):  # another dtype than the weight's or fp32
        token_logprobs_with_grads(h16, w16, t, token_grad, grad_weight_out=torch.zeros(w.shape, dtype=torch.float16))
