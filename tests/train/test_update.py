"""The update phase: micro-batched gradients through rl.policy_loss equal the one-big-batch gradients."""

import pytest
import torch

from grpo_engine.model.hf_io import load_model
from grpo_engine.rl.losses import LossConfig
from grpo_engine.train.batching import build_rollout_batch, micro_batches
from grpo_engine.train.update import accumulate_gradients, batch_logprobs


def _batch(vocab: int):
    g = torch.Generator().manual_seed(0)
    prompt_lens, comp_lens = [3, 5, 4, 2, 6, 3], [7, 2, 5, 9, 4, 1]
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in prompt_lens]
    comps = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in comp_lens]
    adv = torch.tensor([1.0, -0.5, 0.25, -1.5, 0.75, 0.0])
    keep = [True, True, True, True, True, False]  # the last row is masked out (e.g. truncated)
    return build_rollout_batch(prompts, comps, [[0.0] * n for n in comp_lens], adv, keep, pad_id=0)


def _grads(model, batch, cfg, budget):
    model.zero_grad(set_to_none=True)
    stats = accumulate_gradients(model, batch, cfg, budget, temperature=1.0, chunk_size=4)
    return stats, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("preset", ["grpo", "dapo", "dr_grpo", "gspo", "cispo"])
def test_micro_batching_is_exact(tiny_ckpt, preset):
    model = load_model(tiny_ckpt)
    batch = _batch(model.config.vocab_size)
    with torch.no_grad():  # an "old" policy a little away from the current one, so ratios != 1
        old = batch_logprobs(model, batch, 10_000, temperature=1.0, chunk_size=4)
        ref = old - 0.05
    noise = 0.1 * torch.randn(old.shape, generator=torch.Generator().manual_seed(1))  # [B, T]
    batch.old_logp, batch.ref_logp = (old + noise) * batch.completion_mask, ref
    cfg = LossConfig(loss=preset, beta=0.04, entropy_coef=0.01, max_completion_len=9)
    assert len(micro_batches(batch.lengths.tolist(), 12)) >= 4  # really split
    whole, g_whole = _grads(model, batch, cfg, 10_000)
    split, g_split = _grads(model, batch, cfg, 12)
    assert split.loss == pytest.approx(whole.loss, rel=1e-5, abs=1e-7)
    assert split.metrics["active_tokens"] == whole.metrics["active_tokens"] == 27  # 7+2+5+9+4, row 6 masked
    for name in g_whole:
        torch.testing.assert_close(g_split[name], g_whole[name], rtol=1e-4, atol=1e-6)
