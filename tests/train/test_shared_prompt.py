"""Prompt sharing in the update forward: each prompt runs once per group, and the hidden states, log-probs and
gradients equal those of the plain forward (every row prompt + completion) -- float64 to ~1e-10, fp32 ~1e-5."""

import pytest
import torch

from grpo_engine.kernels import apply_activation_checkpointing
from grpo_engine.model.loading import load_model
from grpo_engine.model.lora import LoRAConfig, apply_lora
from grpo_engine.rl.losses import LossConfig, resolve
from grpo_engine.train.batch import build_train_batch, group_micro_batches, plan_micro_batches, shared_prompt_index
from grpo_engine.train.forward import completion_hidden, plain_completion_hidden, shared_layout
from grpo_engine.train.update import accumulate_gradients

# (prompt length, completion lengths of its rows): mixed prompt lengths, group sizes and completion lengths,
# including a one-token prompt (nothing to share before its last token) and a one-token completion.
GROUPS = [(5, [3, 1, 4]), (9, [2, 6]), (1, [3, 2]), (3, [5]), (7, [1, 4, 2, 3])]


def _batch(vocab: int, groups=GROUPS, keep_out=(1, 6), interleave=True, seed=0):
    """Rows of the groups (interleaved across groups when asked), rows in keep_out masked out."""
    g = torch.Generator().manual_seed(seed)
    prompts, comps = [], []
    for plen, clens in groups:
        prompt = torch.randint(0, vocab, (plen,), generator=g).tolist()
        for n in clens:
            prompts.append(prompt)
            comps.append(torch.randint(0, vocab, (n,), generator=g).tolist())
    order = list(range(len(prompts)))
    if interleave:  # rows of one prompt need not be contiguous
        order = order[::2] + order[1::2]
    prompts, comps = [prompts[i] for i in order], [comps[i] for i in order]
    adv = torch.randn(len(prompts), generator=g)
    keep = [i not in keep_out for i in range(len(prompts))]
    return build_train_batch(prompts, comps, [[0.0] * len(c) for c in comps], adv, keep, pad_id=0)


def _unshared(batch):
    """The same batch with sharing off: the plain forward."""
    from dataclasses import replace

    return replace(batch, prompt_index=None)


def _grads(model, batch, budget):
    model.zero_grad(set_to_none=True)
    stats = accumulate_gradients(model, batch, resolve(LossConfig(loss="grpo", beta=0.0, entropy_coef=0.01)), budget,
                                 temperature=0.7, chunk_size=5)
    return stats, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(model, batch, budget_shared, tol, budget_plain=10_000):
    """Hidden states (same order), targets, masks, loss and every gradient: shared vs plain."""
    assert batch.prompt_index is not None
    h_s, t_s, m_s = completion_hidden(model, batch)
    h_p, t_p, m_p = plain_completion_hidden(model, batch)
    assert torch.equal(t_s, t_p) and torch.equal(m_s, m_p) and h_s.shape == h_p.shape
    torch.testing.assert_close(h_s, h_p, rtol=tol, atol=tol)
    shared, g_shared = _grads(model, batch, budget_shared)
    plain, g_plain = _grads(model, _unshared(batch), budget_plain)
    assert shared.loss == pytest.approx(plain.loss, rel=tol, abs=tol)
    assert g_shared.keys() == g_plain.keys() and len(g_plain) > 0
    for name in g_plain:
        torch.testing.assert_close(g_shared[name], g_plain[name], rtol=tol, atol=tol, msg=name)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama3"])
def test_shared_equals_plain_float64(tiny_ckpt_factory, arch):
    model = load_model(tiny_ckpt_factory(arch), dtype=torch.float64)
    model.train()
    _assert_same(model, _batch(model.config.vocab_size), 10_000, 1e-10)


def test_shared_equals_plain_fp32_with_groups_split_across_micro_batches(tiny_ckpt):
    model = load_model(tiny_ckpt)
    model.train()
    batch = _batch(model.config.vocab_size)
    parts = plan_micro_batches(batch, 14)
    assert len(parts) >= 4
    distinct = len(batch.prompt_index.unique())
    assert sum(len(batch.prompt_index[rows].unique()) for rows in parts) > distinct  # some group was cut
    _assert_same(model, batch, 14, 1e-5, budget_plain=14)


@pytest.mark.parametrize("checkpoint_every", [1, 2])
def test_shared_equals_plain_with_lora_and_activation_checkpointing(tiny_ckpt_factory, checkpoint_every):
    model = load_model(tiny_ckpt_factory("qwen3"), dtype=torch.float64)
    apply_lora(model, LoRAConfig(enabled=True, rank=4, alpha=8.0, adapter_dtype="float64"))
    with torch.no_grad():  # lora_B starts at zero, which would leave lora_A without gradient
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(3))
    apply_activation_checkpointing(model, checkpoint_every)
    model.train()
    _assert_same(model, _batch(model.config.vocab_size), 30, 1e-10, budget_plain=30)


def test_all_prompts_of_one_token(tiny_ckpt):
    """Nothing precedes the last prompt token: no prompt pass, the suffix pass is the whole rows."""
    model = load_model(tiny_ckpt, dtype=torch.float64)
    batch = _batch(model.config.vocab_size, groups=[(1, [3, 2]), (1, [4])], keep_out=())
    assert shared_layout(batch).prompt_ids.shape[1] == 0
    _assert_same(model, batch, 10_000, 1e-10)


def test_layout_by_hand():
    """Prompt A = [1, 2, 3] (rows 0 and 2), prompt B = [4, 5] (row 1); completions [6, 7], [8], [9, 10, 11]."""
    batch = build_train_batch([[1, 2, 3], [4, 5], [1, 2, 3]], [[6, 7], [8], [9, 10, 11]],
                                [[0.0] * 2, [0.0], [0.0] * 3], torch.zeros(3), [True, True, False], pad_id=0)
    assert batch.prompt_index.tolist() == [0, 1, 0] and batch.prompt_lengths.tolist() == [3, 2, 3]
    lay = shared_layout(batch)
    assert lay.prompt_ids.tolist() == [[1, 2], [4, 5]]  # prompt[:-1], right-padded (B's pad: its last token)
    assert lay.prompt_of_row.tolist() == [0, 1, 0]
    # suffix = last prompt token + completion[:-1], right-padded (pad columns hold any clamped token)
    assert lay.suffix_ids[0, :2].tolist() == [3, 6] and lay.suffix_ids[1, :1].tolist() == [5]
    assert lay.suffix_ids[2].tolist() == [3, 9, 10]
    assert lay.key_mask.tolist() == [[True, True, True, True, True], [True, False, True, True, True],
                                     [True, True, True, True, True]]
    # row 2 is masked out (completion_keep False); row 0 trains 2 tokens, row 1 one
    assert lay.suffix_mask.tolist() == [[True, True, False], [True, False, False], [False, False, False]]


def test_shared_prompt_index():
    assert shared_prompt_index([[1, 2], [3], [4]]) is None  # nothing repeats: no sharing
    assert shared_prompt_index([[1, 2], [3], [1, 2], [3], [5]]).tolist() == [0, 1, 0, 1, 2]
    off = build_train_batch([[1], [1]], [[2], [3]], [[0.0], [0.0]], torch.zeros(2), [True, True], 0,
                              share_prompts=False)
    assert off.prompt_index is None and off.select(torch.tensor([1])).prompt_lengths.tolist() == [1]


def test_group_micro_batches_by_hand():
    # prompts: 0 (len 10, rows 0,1,2 with completions 2,5,3), 1 (len 4, rows 3,4: 6,1), 2 (len 8, row 5: 2)
    index, plen = [0, 0, 0, 1, 1, 2], [10, 10, 10, 4, 4, 8]
    lengths = [12, 15, 13, 10, 5, 10]
    # groups longest row first: g0 (15), g1 (10, first row 3), g2 (10, row 5)
    # g0 alone: 1 x 10 + 3 x 5 = 25; + g1: 2 x 10 + 5 x 6 = 50 > 40 -> cut; g1 + g2: 2 x 8 + 3 x 6 = 34
    assert group_micro_batches(index, plen, lengths, 40) == [[1, 2, 0], [3, 4, 5]]
    # budget 20: g0 is cut into chunks of (20 - 10) // 5 = 2 rows, [1, 2] (15) and [0] (12); g1 = [3, 4] fits
    # alone (4 + 2 x 6 = 16) but not with g2 (2 x 8 + 3 x 6 = 34); [0] cannot join [1, 2] (10 + 3 x 5 = 25)
    assert group_micro_batches(index, plen, lengths, 20) == [[1, 2], [0], [3, 4], [5]]
