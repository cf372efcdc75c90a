"""The step's matmul FLOP count (bench/floor.py) against torch's own FLOP counter on the engine's real code."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from grpo_engine.bench.floor import StepSizes, attention_flops, body_flops_per_token, generate_flops, update_flops
from grpo_engine.config import LossConfig
from grpo_engine.model.loading import load_model
from grpo_engine.rl.losses import resolve
from grpo_engine.rollout import SamplingParams, generate
from grpo_engine.train.batch import build_train_batch
from grpo_engine.train.update import UpdateSettings, update_policy

P, G, L, T = 2, 3, 7, 5


def _addmm_flops(self_shape, mat1_shape, mat2_shape, *args, out_shape=None, **kwargs) -> int:
    (m, k), n = mat1_shape, mat2_shape[1]
    return 2 * m * k * n


def counting():
    """torch's FLOP counter, also counting in-place addmm_ (the fused head adds its weight gradient with it), on
    the math attention kernel (CPU's flash kernel has no FLOP formula; math runs the same products as bmm)."""
    mapping = {torch.ops.aten.addmm_: _addmm_flops}
    return sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False, custom_mapping=mapping)


def test_body_and_attention_counts_by_hand(tiny_ckpt):
    cfg = load_model(tiny_ckpt).config
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    per_layer = h * cfg.num_attention_heads * d * 2 + h * cfg.num_key_value_heads * d * 2 + 3 * h * i
    assert body_flops_per_token(cfg) == 2 * cfg.num_hidden_layers * per_layer
    # 2 queries after 3 keys: 2 x 5 (query, key) pairs, QK^T and AV, 2 FLOPs per multiply-add
    assert attention_flops(cfg, 2, 3) == 4 * cfg.num_hidden_layers * cfg.num_attention_heads * d * 10


def test_generate_flops_equal_torch_flop_counter(tiny_ckpt):
    """The floor's products, and the attention over the slots the decode's live-length window pads each step to
    (rollout/static_cache.py window_for: the query at the scratch slot W sees W + 1 slots, L + t + 1 of them real)."""
    from grpo_engine.rollout.static_cache import window_for
    from grpo_engine.rollout.static_decode import SLOT_ROUNDING

    model = load_model(tiny_ckpt).eval()
    prompts = [[5 + j for j in range(L)], [40 + j for j in range(L)]]
    params = SamplingParams(n=G, temperature=1.0, max_new_tokens=T, stop_token_ids=[])
    kernel, counter = counting()
    with kernel, counter:
        out = generate(model, prompts, params, seed=0)
    assert all(len(c) == T for c in out.completion_ids)
    cfg, W = model.config, window_for(L, -(-(L + T) // SLOT_ROUNDING) * SLOT_ROUNDING)
    padding = P * G * sum(attention_flops(cfg, 1, W) - attention_flops(cfg, 1, L + t) for t in range(T - 1))
    expected = generate_flops(cfg, StepSizes(P, G, L, T)) + padding
    assert counter.get_total_flops() == pytest.approx(expected, rel=1e-3)  # + RoPE's tiny outer products


@pytest.mark.parametrize("loss,shared,fused", [("grpo", True, True), ("grpo", False, True), ("gspo", True, False)])
def test_update_flops_equal_torch_flop_counter(tiny_ckpt, loss, shared, fused):
    """One update pass: the count of bench/floor.py within 2% of torch's, which also counts small products the
    floor leaves out (the loss's vocab-sized row dot products, RoPE's outer products, the shared-prompt path's
    bookkeeping)."""
    model = load_model(tiny_ckpt).train()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 250, (L,), generator=g).tolist() for _ in range(P)]
    rows = [prompts[r // G] for r in range(P * G)]
    completions = [torch.randint(0, 250, (T,), generator=g).tolist() for _ in range(P * G)]
    batch = build_train_batch(rows, completions, [[0.0] * T] * (P * G), torch.randn(P * G, generator=g),
                                [True] * (P * G), pad_id=0, share_prompts=shared)
    s = UpdateSettings(loss=resolve(LossConfig(loss=loss)), mu=1, grad_clip=0.0, temperature=1.0, chunk_size=16,
                       auto_halve=False)
    kernel, counter = counting()
    with kernel, counter:
        update_policy(model, torch.optim.SGD(model.parameters(), lr=0.0), batch, s, micro_tokens=10_000)
    expected = update_flops(model.config, StepSizes(P, G, L, T, shared_prompt=shared, fused_head=fused))
    assert counter.get_total_flops() == pytest.approx(expected, rel=0.02)


@pytest.mark.parametrize("precision,dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_gemm_rate_times_the_product_in_the_step_precision(monkeypatch, precision, dtype):
    """fp32: torch.mm and oneDNN, the better one; bf16: torch.mm of bf16 tensors alone (a bf16 nn.Linear's path)."""
    import grpo_engine.bench.floor as floor
    from grpo_engine.kernels import onednn, select

    monkeypatch.setattr(floor, "GEMM_SHAPE", (8, 4, 6))  # 2 x 8 x 4 x 6 = 384 FLOPs
    seen, real_mm = [], torch.mm

    def mm(a, b, out):
        seen.append(("torch", a.dtype, b.dtype, out.dtype, tuple(a.shape), tuple(b.shape)))
        return real_mm(a, b, out=out)

    def linear(x, w):
        seen.append(("onednn", x.dtype, w.dtype, None, tuple(x.shape), tuple(w.shape)))

    seconds = iter([1.6e-9, 1.2e-9])  # torch.mm, then oneDNN
    monkeypatch.setattr(torch, "mm", mm)
    monkeypatch.setattr(onednn, "op_works", lambda: True)
    monkeypatch.setattr(onednn, "onednn_linear", linear)
    monkeypatch.setattr(select, "best_time", lambda fn, reps: (fn(), next(seconds))[1])
    rates = floor.gemm_rates(precision=precision)
    if precision == "fp32":  # 384 FLOPs in 1.6 ns: 240 GFLOP/s; in 1.2 ns: 320
        assert rates == pytest.approx({"torch": 240.0, "onednn": 320.0})
        assert seen == [("torch", dtype, dtype, dtype, (8, 4), (4, 6)), ("onednn", dtype, dtype, None, (8, 4), (6, 4))]
    else:
        assert rates == pytest.approx({"torch": 240.0})
        assert seen == [("torch", dtype, dtype, dtype, (8, 4), (4, 6))]
    seconds = iter([1.6e-9, 1.2e-9])
    assert floor.gemm_rate(precision) == pytest.approx(320.0 if precision == "fp32" else 240.0)


def test_gemm_rate_and_weights_precision_refuse_other_dtypes():
    from grpo_engine.bench.floor import gemm_rates, weights_precision

    with pytest.raises(ValueError, match="choose from fp32, bf16"):
        gemm_rates(precision="fp16")
    assert weights_precision(torch.nn.Linear(2, 2).bfloat16()) == "bf16"
    assert weights_precision(torch.nn.Linear(2, 2)) == "fp32"
    with pytest.raises(ValueError, match="set memory.precision"):
        weights_precision(torch.nn.Linear(2, 2).double())
