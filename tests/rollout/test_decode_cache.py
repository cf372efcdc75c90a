"""The decode cache (rollout/static_cache.py StaticDecodeState): decode logits over it equal no-cache logits (fp32,
1e-4).

Covers mixed prompt lengths (left padding), the shared prefill (a prompt copied to its rows), rows leaving the batch
(move_rows: the bucket step-down, a compaction of finished rows) and the buffers being preallocated.
"""

from __future__ import annotations

import torch

from grpo_engine.rollout.engine import prefill_prompts
from grpo_engine.rollout.sampling import sampling_dtype
from grpo_engine.rollout.static_cache import StaticDecodeState


def no_cache_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids]))[0, -1]  # [V]: next-token logits after the whole sequence


def prefilled(model, prompts: list[list[int]], n: int, slots: int) -> tuple[StaticDecodeState, torch.Tensor]:
    """A state of len(prompts) * n rows, each prompt's n rows started from its prefill -> (state, logits [R, V])."""
    dtype = model.embed.weight.dtype
    state = StaticDecodeState(model.config, len(prompts) * n, slots, 4, dtype, sampling_dtype(dtype), model.device)
    share = [r // n for r in range(len(prompts) * n)]  # rows: prompt r // n
    mask, logits = prefill_prompts(model, state, prompts)
    state.start_rows(mask, share, torch.zeros(len(share), 1))
    return state, logits.index_select(0, torch.tensor(share))


def test_prefill_shared_decode_and_compaction_match_full_forwards(tiny_model, mixed_prompts):
    n, T = 2, 6
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        state, logits = prefilled(tiny_model, mixed_prompts, n, max(map(len, mixed_prompts)) + T)
        rows = list(range(len(mixed_prompts) * n))  # the row in each batch slot
        seqs = {r: list(mixed_prompts[r // n]) for r in rows}
        for step in range(T - 1):
            for a, r in enumerate(rows):  # logits of every active row at this step vs a full forward
                torch.testing.assert_close(logits[a], no_cache_logits(tiny_model, seqs[r]), atol=1e-4, rtol=0)
            tok = torch.randint(0, tiny_model.config.vocab_size, (len(rows),), generator=g)  # any tokens
            for a, r in enumerate(rows):
                seqs[r].append(int(tok[a]))
            if step in (1, 3):  # drop rows mid-way, as the decode does for finished ones
                keep = [a for a in range(len(rows)) if a % 3 != 0]
                state.move_rows(keep)
                tok, rows = tok[keep], [rows[a] for a in keep]
            b = len(rows)
            state.ids[:b, 0] = tok
            hidden = tiny_model(state.ids[:b], state.key_mask[:b], cache=state.view(b), positions=state.positions[:b],
                                return_hidden=True)[:, -1]  # [b, hidden]: one step over all S + 1 slots
            logits = tiny_model.lm_head(hidden)
            state.key_mask[:b].scatter_(1, state.write[:b, None], True)  # the step's advance, as StaticDecodeState's
            state.write[:b] += 1
            state.positions[:b] += 1
        assert len(rows) < len(mixed_prompts) * n  # compaction happened
        for a, r in enumerate(rows):
            torch.testing.assert_close(logits[a], no_cache_logits(tiny_model, seqs[r]), atol=1e-4, rtol=0)


def test_cache_buffers_are_preallocated_and_compaction_moves_rows_to_the_front(tiny_model, mixed_prompts):
    L = max(map(len, mixed_prompts))
    with torch.inference_mode():
        state, _ = prefilled(tiny_model, mixed_prompts, 4, L + 10)
    cfg = tiny_model.config
    assert state.k[0].shape == (12, cfg.num_key_value_heads, L + 10 + 1, cfg.head_dim) and state.write[0] == L
    assert len(state.k) == len(state.v) == len(state.layer_slots) == cfg.num_hidden_layers  # a list: one per layer
    assert state.key_mask.shape == (12, L + 11) and state.key_mask[:, L : L + 10].sum() == 0
    # left padding: each row's real prompt tokens are the last len(prompt) slots of the prompt part
    assert state.key_mask[:, :L].sum(1).tolist() == [len(p) for p in mixed_prompts for _ in range(4)]
    before = state.k[1][5, :, :L].clone()
    with torch.inference_mode():
        state.move_rows([5, 7])
    assert state.bucket(2) == 2 and torch.equal(state.k[1][0, :, :L], before)  # the batch now runs rows [:2]
