"""Environment turns on the static decode state: how a multi-turn row (rows.Row with an environment) goes on after
its model turn ended inside a chunk (static_decode.decode_static calls `feed_env_turns` between two chunks).

The chunk's steps after the turn's last token were sampled from a history without the environment's tokens: the
row took none of them (static_decode.take_tokens stops at the turn's end), and here its state is set back to just
after that token, as if the chunk had stopped there. Then the tokens to feed (the turn's last token and the
environment's, rows.Row.pending) go in, all but the last through one eager forward of the rows that turned, at each
row's own next slots; the last one becomes the row's `ids`, fed by the next chunk's first step, which draws the
next turn's first token. The chunk itself (and its CUDA graph) is unchanged: it only reads and advances the state's
buffers, which this writes in place.

A row's slots: [0, L) the prompts' region (left-padded; L = the wave's longest prompt), then one slot per token it
fed after its prompt, in order, so the slot of its n-th fed token is L + n - 1 and its key mask covers exactly its
own tokens. Its uniforms' column is the count of tokens it has drawn (a turn's discarded steps draw nothing).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..model.transformer import Transformer
from .engine import left_pad
from .rows import Row
from .static_cache import FeedCache, StaticDecodeState


def feed_env_turns(model: Transformer, state: StaticDecodeState, turned: Sequence[Row], at: list[int],
                   prompt_slots: int) -> int:
    """The rows `turned` (in batch slots `at`) ended a model turn in the last chunk and queued environment tokens:
    set each back to just after its turn's last token, prefill what it must feed, and leave its last pending token
    for the next step. -> the largest write slot it set (the next chunk's window covers it)."""
    device = state.device
    fed = [len(r.tokens) - r.prompt_len - len(r.pending) for r in turned]  # tokens after its prompt in the cache
    base = [prompt_slots + n for n in fed]  # the slot of its turn's last token, the first to feed
    for s, b in zip(at, base):
        state.key_mask[s, b : state.slots] = False  # the discarded steps' slots (the scratch slot stays on)
    feeds = [r.pending[:-1] for r in turned]
    if any(feeds):
        prefill_at(model, state, at, base, feeds)
    index = torch.tensor(at, dtype=torch.long, device=device)
    k = [len(f) for f in feeds]
    state.ids[index, 0] = torch.tensor([r.pending[-1] for r in turned], device=device)
    writes = [b + n for b, n in zip(base, k)]
    state.write[index] = torch.tensor(writes, device=device)
    state.positions[index, 0] = torch.tensor([r.prompt_len + n + m for r, n, m in zip(turned, fed, k)], device=device)
    state.col[index] = torch.tensor([min(r.metrics.model_tokens, state.columns - 1) for r in turned], device=device)
    return max(writes)


def prefill_again(model: Transformer, state: StaticDecodeState, again: Sequence[Row], at: list[int],
                  prompt_slots: int) -> int:
    """Longrope rows (in batch slots `at`) whose next forward passes the original context
    (static_decode.passes_rope_switch): every token of each row goes in again, in one eager forward of all of them,
    so the forward runs past the switch and rotates every position by the long factors; the keys and values of
    every layer are written over the row's own slots (its prompt ending at slot L = prompt_slots, each later token
    at L + n - 1, as the module docstring lays them out). Its last token's slot stays masked: that token becomes
    the row's `ids`, fed again by the next step, which draws the next token. -> the largest write slot it set."""
    device = state.device
    base = [prompt_slots - r.prompt_len for r in again]  # the row's first token's slot
    for s in at:
        state.key_mask[s, : state.slots] = False  # every slot the row wrote (the scratch slot stays on)
    prefill_at(model, state, at, base, [r.tokens for r in again])
    writes = [b + len(r.tokens) - 1 for b, r in zip(base, again)]  # the last token's slot
    index = torch.tensor(at, dtype=torch.long, device=device)
    state.key_mask[index, torch.tensor(writes, device=device)] = False
    state.ids[index, 0] = torch.tensor([r.tokens[-1] for r in again], device=device)
    state.write[index] = torch.tensor(writes, device=device)
    state.positions[index, 0] = torch.tensor([len(r.tokens) - 1 for r in again], device=device)
    state.col[index] = torch.tensor([min(r.metrics.model_tokens, state.columns - 1) for r in again], device=device)
    return max(writes)


def prefill_at(model: Transformer, state: StaticDecodeState, at: list[int], base: list[int],
               feeds: list[list[int]]) -> None:
    """Feed row at[i] the tokens feeds[i] at its slots base[i], base[i] + 1, ... (key/values and key mask), in one
    forward: the feeds go in left-padded ([m, K]) and attend to the rows' written slots [0, W) (W = the largest base;
    a row's slots past its own base are masked) and to each other (static_cache.FeedCache); each new key/value is
    written to its row's slot, a pad's to the scratch slot (which every step overwrites)."""
    device = state.device
    index = torch.tensor(at, dtype=torch.long, device=device)  # [m]
    ids, real = left_pad(feeds, device)  # [m, K] each
    W, K = max(base), ids.shape[1]
    pads = [K - len(f) for f in feeds]
    slot = [[b + j - p if j >= p else state.slots for j in range(K)] for b, p in zip(base, pads)]
    where = torch.tensor(slot, dtype=torch.long, device=device)  # [m, K]
    model(ids, torch.cat([state.key_mask[:, :W].index_select(0, index), real], dim=1),
          cache=FeedCache(state, index, W, where), return_hidden=True)  # [m, K]: only the keys/values matter
    for s, b, f in zip(at, base, feeds):
        state.key_mask[s, b : b + len(f)] = True
