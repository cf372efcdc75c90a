"""Cached decode logits equal no-cache logits (fp32, 1e-4).

Covers mixed prompt lengths (left padding), the shared prefill and row compaction.
"""

from __future__ import annotations

import torch

from grpo_engine.rollout.engine import prefill


def no_cache_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids]))[0, -1]  # [V]: next-token logits after the whole sequence


def test_prefill_shared_decode_and_compaction_match_full_forwards(tiny_model, mixed_prompts):
    n, T = 2, 6
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        share = [r // n for r in range(len(mixed_prompts) * n)]  # rows: prompt r // n
        cache, key_mask, logits = prefill(tiny_model, mixed_prompts, share, T)
        rows = list(range(len(mixed_prompts) * n))
        seqs = {r: list(mixed_prompts[r // n]) for r in rows}
        for step in range(T - 1):
            for a, r in enumerate(rows):  # logits of every active row at this step vs a full forward
                torch.testing.assert_close(logits[a], no_cache_logits(tiny_model, seqs[r]), atol=1e-4, rtol=0)
            tok = torch.randint(0, tiny_model.config.vocab_size, (len(rows),), generator=g)  # any tokens
            for a, r in enumerate(rows):
                seqs[r].append(int(tok[a]))
            if step in (1, 3):  # drop rows mid-way, as generate() does for finished ones
                keep = [a for a in range(len(rows)) if a % 3 != 0]
                index = torch.tensor(keep)
                cache.select_rows(index)
                key_mask, tok = key_mask.index_select(0, index), tok.index_select(0, index)
                rows = [rows[a] for a in keep]
            key_mask[:, cache.start] = True
            logits = tiny_model(tok[:, None], key_mask[:, : cache.start + 1], cache=cache)[:, -1]
        assert len(rows) < len(mixed_prompts) * n  # compaction happened
        for a, r in enumerate(rows):
            torch.testing.assert_close(logits[a], no_cache_logits(tiny_model, seqs[r]), atol=1e-4, rtol=0)


def test_cache_buffers_are_preallocated_and_compaction_shrinks_them(tiny_model, mixed_prompts):
    with torch.inference_mode():
        cache, key_mask, _ = prefill(tiny_model, mixed_prompts, [r // 4 for r in range(len(mixed_prompts) * 4)], 10)
    L = max(map(len, mixed_prompts))
    cfg = tiny_model.config
    assert cache.k[0].shape == (12, cfg.num_key_value_heads, L + 10, cfg.head_dim) and cache.start == L
    assert key_mask.shape == (12, L + 10) and key_mask[:, L:].sum() == 0
    # left padding: each row's real prompt tokens are the last len(prompt) slots of the prompt part
    assert key_mask[:, :L].sum(1).tolist() == [len(p) for p in mixed_prompts for _ in range(4)]
    before = cache.k[1][5, :, :L].clone()
    cache.select_rows(torch.tensor([5, 7]))
    assert cache.batch == 2 and torch.equal(cache.k[1][0, :, :L], before)
