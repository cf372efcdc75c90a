"""The one decode engine: prefill prompts once, then advance every row of a batch one sampled token per step.

Single-turn completions and multi-turn trajectories are both rows of this engine (rows.Row, one type): a
single-turn row is a conversation that ends after one model turn. generate.generate_rows picks this loop or the
static decode (static_decode.py). Each step:

1. sample one token for every row from the last logits (TokenSampler: temperature, top-k / top-p / min-p, the
   chosen token's log-prob under the full and under the filtered distribution), one host sync for the batch;
2. each live row `take`s its token: it records it, may finish (stop token, stop string, length, budget), or,
   at the end of a model turn, queue environment tokens (tool results, the next turn's header) to prefill;
3. finished rows leave the batch (cache, mask gathered by index) once they are `compact_fraction` of it;
4. every row feeds its pending tokens, left-padded to the step's longest ([A, K]; K = 1 while all rows
   decode). Pad slots are masked out of the key mask and positions count valid slots, so each row is one
   contiguous sequence for the model; the logits are taken at each row's last position.

The cache has one write position for all rows, so feeding k environment tokens to one row writes k slots in
every row (k - 1 masked holes in the others); the cache grows by doubling when they fill it. Holes cost memory and
attention, not correctness, and on typical tool turns (tens of tokens, a few per trajectory) they are a small
fraction; in exchange no row waits for another and nothing is copied between caches.
"""

from __future__ import annotations

import itertools
import numbers
from collections.abc import Callable, Sequence

import torch

from ..model.transformer import Transformer, rope_switch, soft_cap
from .decode_kernels import DecodeHead, PackedWeights
from .kv_cache import KVCache
from .rows import Row
from .sampling import NAN_TOKEN, NonFiniteLogits, TokenSampler

DecodeStep = Callable[[torch.Tensor, torch.Tensor, KVCache], torch.Tensor]  # ids [A, K], mask -> hidden [A, D]


def as_seed(seed: int | Sequence[int]) -> int | list[int]:
    """One seed as a Python int (numpy's integers included: `isinstance(np.int64(3), int)` is False,
    so such a seed would be taken for a sequence and fail with "has no len()"), or the per-prompt seeds as a list."""
    return int(seed) if isinstance(seed, numbers.Integral) else [int(s) for s in seed]


class Draws:
    """The random numbers of the decode steps: one shared generator, or one generator per prompt."""

    def __init__(self, seed: int | Sequence[int], device: torch.device):
        per_prompt = not isinstance(seed, int)
        self.shared = None if per_prompt else torch.Generator(device=device).manual_seed(seed)
        self.prompts = [torch.Generator(device=device).manual_seed(int(s)) for s in seed] if per_prompt else None
        self.device = device

    def uniforms(self, prompt_of_row: list[int], live: list[bool]) -> torch.Tensor | None:
        """[A, 1] uniforms for the batch rows (per-prompt mode; None: the sampler draws from `shared`). A finished
        row waiting for compaction draws nothing (its token is discarded), so no generator depends on it."""
        if self.prompts is None:
            return None
        return self._by_prompt(torch.full((len(prompt_of_row), 1), 0.5, device=self.device), prompt_of_row, live)

    def table(self, prompt_of_row: list[int], steps: int) -> torch.Tensor:
        """[R, steps] uniforms drawn ahead for the static decode (column t draws a row's t-th token): a prompt's
        rows take one [rows, steps] block from its own generator (prompts in order of first appearance), or all
        rows one block from the shared one. A row's draws then depend on neither its batch-mates nor when any row
        finishes. (Not the dynamic loop's stream: that draws one column per step.)"""
        if self.prompts is None:
            return torch.rand((len(prompt_of_row), steps), generator=self.shared, device=self.device)
        return self._by_prompt(torch.empty(len(prompt_of_row), steps, device=self.device), prompt_of_row)

    def _by_prompt(self, u: torch.Tensor, prompt_of_row: list[int], live: list[bool] | None = None) -> torch.Tensor:
        """u [R, C] with each prompt's (live) rows drawn as one block from that prompt's generator, prompts in order
        of first appearance; the other rows keep their values."""
        rows: dict[int, list[int]] = {}
        for a, p in enumerate(prompt_of_row):
            if live is None or live[a]:
                rows.setdefault(p, []).append(a)
        for p, idx in rows.items():
            u[idx] = torch.rand((len(idx), u.shape[1]), generator=self.prompts[p], device=self.device)
        return u


def eager_step(model: Transformer) -> DecodeStep:
    def step(ids: torch.Tensor, key_mask: torch.Tensor, cache: KVCache) -> torch.Tensor:
        return model(ids, key_mask, cache=cache, return_hidden=True)[:, -1]  # [A, K] -> [A, hidden]

    return step


def decode(model: Transformer, rows: Sequence[Row], cache: KVCache, key_mask: torch.Tensor, logits: torch.Tensor,
           sample: TokenSampler, draws: Draws, packs: PackedWeights, step: DecodeStep, compact_fraction: float) -> None:
    """Run every row to its end from the prefilled cache [R rows], key mask [R, slots] and logits [R, V]; the
    rows record their tokens themselves."""
    head = DecodeHead(model, len(rows), packs)
    active = list(range(len(rows)))  # the row of each batch position
    for t in itertools.count():
        live = [not rows[r].finished for r in active]
        tok, logp, filtered_logp = sample(logits, draws.shared, draws.uniforms([rows[r].generator for r in active],
                                                                              live))  # [A] each
        tok_list, logp_list = tok.tolist(), logp.tolist()
        filtered_list = logp_list if filtered_logp is logp else filtered_logp.tolist()
        if NAN_TOKEN in tok_list:
            raise NonFiniteLogits(f"NaN or +inf logits at decode step {t}: the model's weights or activations blew up")
        for a, r in enumerate(active):
            if live[a]:  # a row finished earlier waits for compaction; its new token is discarded
                rows[r].take(tok_list[a], logp_list[a], filtered_list[a])
        keep = [a for a, r in enumerate(active) if not rows[r].finished]
        if not keep:
            return
        n_done = len(active) - len(keep)
        if n_done > 0 and n_done >= compact_fraction * len(active):
            index = torch.tensor(keep, device=tok.device)
            cache.select_rows(index)
            key_mask, active = key_mask.index_select(0, index), [active[a] for a in keep]
            packs.resize(len(keep), max(rows[r].steps_left() for r in active))
        pending = [[] if rows[r].finished else rows[r].pending for r in active]
        if passes_rope_switch(model, [rows[r] for r in active], pending):
            # every layer's keys and values of the row are stale: prefill the rows again, as transformers' Phi-3
            # generate does, so tokens equal a full forward of the sequence
            steps = max(rows[r].steps_left() for r in active)
            cache, key_mask, logits = prefill(model, [rows[r].tokens for r in active], list(range(len(active))),
                                              steps)
            continue
        logits, key_mask = feed(head, step, cache, key_mask, pending)


def passes_rope_switch(model: Transformer, rows: Sequence[Row], pending: list[list[int]]) -> bool:
    """Whether feeding `pending` takes a row past longrope's original context: the forward of a sequence longer
    than original_max_position_embeddings rotates every position by the long factors (model/transformer.py
    rope_row_inv_freq), so the keys cached with the short ones no longer hold."""
    switch = rope_switch(model.config)
    if switch is None:
        return False
    return any(len(r.tokens) - len(p) <= switch < len(r.tokens) for r, p in zip(rows, pending) if p)


def feed(head: DecodeHead, step: DecodeStep, cache: KVCache, key_mask: torch.Tensor, pending: list[list[int]]):
    """One step: every row's pending tokens, left-padded to the longest ([A, K]), through the model.
    -> logits [A, V] at each row's last pending token, and the (possibly grown) key mask."""
    ids, real = left_pad(pending, key_mask.device)  # [A, K], [A, K] (a finished row's are all pads)
    K, start = ids.shape[1], cache.start
    key_mask = grow(cache, key_mask, start + K)
    key_mask[:, start : start + K] = real
    return head(step(ids, key_mask[:, : start + K], cache)), key_mask


def grow(cache: KVCache, key_mask: torch.Tensor, need: int) -> torch.Tensor:
    """Make room for `need` slots (doubling); returns the key mask [A, new size]. Written slots are kept."""
    if need <= cache.max_len:
        return key_mask
    size, end = max(need, 2 * cache.max_len), cache.start
    for buffers in (cache.k, cache.v):
        for i, t in enumerate(buffers):
            grown = t.new_empty(t.shape[0], t.shape[1], size, t.shape[3])  # [A, H_kv, size, D]
            grown[:, :, :end] = t[:, :, :end]
            buffers[i] = grown
    mask = key_mask.new_zeros(key_mask.shape[0], size)  # [A, size]
    mask[:, :end] = key_mask[:, :end]
    return mask


# ----------------------------------------------------------------------------------------------------
# Prefill: each distinct prompt once, its keys/values shared with its rows


def left_pad(prompts: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """-> ids [P, L] (pad id 0, never attended) and mask [P, L] bool (True = real token). Built from Python lists
    in one tensor each: the decode loop pads its rows' pending tokens every step."""
    L = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (L - len(p)) + list(p) for p in prompts], dtype=torch.long)
    mask = torch.tensor([[False] * (L - len(p)) + [True] * len(p) for p in prompts], dtype=torch.bool)
    return ids.to(device), mask.to(device)


MIN_SHARED_PREFIX = 8  # tokens: a shorter common prefix is not worth its own forward call


def shared_prefix_length(prompts: list[list[int]]) -> int:
    """Tokens at the start of every prompt (a chat template's system prompt and turn header), leaving each prompt
    at least one token of its own; 0 for a single prompt."""
    if len(prompts) < 2:
        return 0
    first, limit = prompts[0], min(len(p) for p in prompts) - 1
    c = 0
    while c < limit and all(p[c] == first[c] for p in prompts):
        c += 1
    return c


def prefill_prompts(model: Transformer, prompts: list[list[int]]) -> tuple[KVCache, torch.Tensor, torch.Tensor]:
    """The P prompts' keys/values -> (cache [P, L slots], key mask [P, L], last-position logits [P, V]).

    A prefix that every prompt shares (shared_prefix_length >= MIN_SHARED_PREFIX) runs once: its c slots are
    copied to every row, the rest of each prompt is left-padded after them ([prefix][pad][own tokens]) and attends
    to them. Positions count valid slots, so every token keeps its position; the keys/values equal those of the
    plain prefill up to float rounding. A system prompt is often most of a chat prompt.
    """
    device, dtype = model.device, model.embed.weight.dtype
    c = shared_prefix_length(prompts)
    c = c if c >= MIN_SHARED_PREFIX else 0  # 0: the plain prefill
    ids, mask = left_pad([p[c:] for p in prompts], device)  # [P, L - c]
    P, L = ids.shape[0], c + ids.shape[1]
    cache = KVCache.allocate(model.config, P, L, dtype, device)
    if c:
        shared = KVCache.allocate(model.config, 1, c, dtype, device)
        model(torch.tensor([prompts[0][:c]], device=device), torch.ones(1, c, dtype=torch.bool, device=device),
              cache=shared, return_hidden=True)  # [1, c]
        cache.copy_prefix_from(shared, torch.zeros(P, dtype=torch.long, device=device))  # slots [0, c), start = c
        mask = torch.cat([torch.ones(P, c, dtype=torch.bool, device=device), mask], dim=1)  # [P, L]
    hidden = model(ids, mask, cache=cache, return_hidden=True)  # [P, L - c, hidden]
    logits = soft_cap(model.lm_head(hidden[:, -1]), model.config.final_logit_softcapping)  # [P, V]
    return cache, mask, logits  # the LM head at the last position only


def prefill(model: Transformer, prompts: list[list[int]], share: list[int], slots: int):
    """Prefill the distinct `prompts` once, then give row i a copy of prompt share[i]'s keys/values.

    -> cache [R rows, L + slots], key mask [R, L + slots] (True = valid slot), logits [R, V].
    """
    device, dtype = model.device, model.embed.weight.dtype
    prefix, mask, logits = prefill_prompts(model, prompts)  # [P, L] cache and mask, [P, V]
    L = mask.shape[1]
    index = torch.tensor(share, dtype=torch.long, device=device)  # [R]: row -> its prompt
    cache = KVCache.allocate(model.config, len(share), L + slots, dtype, device)
    cache.copy_prefix_from(prefix, index)
    key_mask = torch.zeros(len(share), L + slots, dtype=torch.bool, device=device)
    key_mask[:, :L] = mask.index_select(0, index)
    return cache, key_mask, logits.index_select(0, index)
