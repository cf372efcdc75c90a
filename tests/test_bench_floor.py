"""The step's matmul FLOP count (bench/floor.py) against torch's own FLOP counter on the engine's real code."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from grpo_engine.bench.floor import StepSizes, attention_flops, body_flops_per_token, generate_flops, update_flops
from grpo_engine.config import LossConfig
from grpo_engine.model.loading import load_model
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
    model = load_model(tiny_ckpt).eval()
    prompts = [[5 + j for j in range(L)], [40 + j for j in range(L)]]
    params = SamplingParams(n=G, temperature=1.0, max_new_tokens=T, stop_token_ids=[])
    kernel, counter = counting()
    with kernel, counter:
        out = generate(model, prompts, params, seed=0)
    assert all(len(c) == T for c in out.completion_ids)
    expected = generate_flops(model.config, StepSizes(P, G, L, T))
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
    s = UpdateSettings(loss=LossConfig(loss=loss), mu=1, grad_clip=0.0, temperature=1.0, chunk_size=16,
                       auto_halve=False)
    kernel, counter = counting()
    with kernel, counter:
        update_policy(model, torch.optim.SGD(model.parameters(), lr=0.0), batch, s, micro_tokens=10_000)
    expected = update_flops(model.config, StepSizes(P, G, L, T, shared_prompt=shared, fused_head=fused))
    assert counter.get_total_flops() == pytest.approx(expected, rel=0.02)
