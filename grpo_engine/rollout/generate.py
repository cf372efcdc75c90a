"""Batched generation on the policy's own weights: prefill each prompt once, decode its G samples.

One call runs in waves (so rows x max length stays under `max_tokens_in_flight`). Within a wave:

1. prefill: the wave's P prompts, left-padded to length L, go through the model once into a [P, ., L, .]
   cache; the LM head is applied to the last position only ([P, V], not [P, L, V]). A prefix common to all P
   prompts (a chat template's system prompt) runs once and is copied to every row;
2. share: each prompt's keys/values are copied to its G rows of the decode cache [P*G, ., L+T, .] — the
   prompt is never recomputed per sample;
3. decode: all rows advance one token per step with a key-padding mask; rows that finish (stop token,
   stop string, max_new_tokens) are dropped from the batch (cache, mask, state gathered by index) once they
   are `compact_fraction` of the active rows, so long completions do not pay for finished ones.

Reproducibility: with `seed` an int, one torch.Generator seeded with it drives every draw, so the same call
(same prompts, params, seed, device) gives the same completions. With one seed per prompt, each prompt draws
from its own generator, and only for its unfinished rows: a prompt's completions then do not depend on which
other prompts share the call, the wave plan, or when other rows finish (the trainer seeds each prompt by
(seed, step, global prompt index), so splitting prompts across ranks does not change what is sampled).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..model.transformer import Transformer
from .decode_kernels import DecodeHead, PackedWeights, packed_for_decode
from .kv_cache import KVCache
from .sampling import NAN_TOKEN, NonFiniteLogits, Sampler, SamplingParams
from .stop_strings import StopStrings

STOP, LENGTH = "stop", "length"


@dataclass
class GenerationOutput:
    """Completions of generate(); row i belongs to prompt prompt_index[i] == i // n (groups contiguous).

    completion_ids[i]: sampled tokens, the stop token (or the token completing a stop string) included.
    logprobs[i][t]: log-prob of completion_ids[i][t] under the temperature-scaled full softmax, the policy the
    trainer computes (sampling.py; the rollout-correction metrics compare the two).
    finish_reason[i]: "stop" (stop token / stop string) or "length" (max_new_tokens reached).
    filtered_logprobs[i][t]: its log-prob under the top-k / top-p / min-p filtered distribution it was drawn
    from (equal to logprobs[i][t] when no filter is on).
    """

    completion_ids: list[list[int]]
    logprobs: list[list[float]]
    finish_reason: list[str]
    prompt_index: list[int]
    filtered_logprobs: list[list[float]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.completion_ids)

    @property
    def num_tokens(self) -> int:
        return sum(len(c) for c in self.completion_ids)


def as_seed(seed: int | Sequence[int]) -> int | list[int]:
    """One seed as a Python int (numpy's integers included: `isinstance(np.int64(3), int)` is False,
    so such a seed was taken for a sequence and failed with "has no len()"), or the per-prompt seeds as a list."""
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
        u = torch.full((len(prompt_of_row), 1), 0.5, device=self.device)
        rows: dict[int, list[int]] = {}
        for a, (p, alive) in enumerate(zip(prompt_of_row, live)):
            if alive:
                rows.setdefault(p, []).append(a)
        for p, idx in rows.items():
            u[idx] = torch.rand((len(idx), 1), generator=self.prompts[p], device=self.device)
        return u


@dataclass
class _Row:
    """One finished completion (internal)."""

    tokens: list[int]
    logprobs: list[float]
    filtered_logprobs: list[float]
    reason: str


# ----------------------------------------------------------------------------------------------------
# Validation and wave planning


def _validate(model: Transformer, prompt_ids: list[list[int]], params: SamplingParams, tokenizer) -> None:
    cfg = model.config
    if params.stop_strings and tokenizer is None:
        raise ValueError(
            "stop_strings need a tokenizer to decode completions: pass generate(..., tokenizer=tok)"
        )
    for i, p in enumerate(prompt_ids):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token (e.g. a BOS)")
        if len(p) > cfg.max_position_embeddings:
            raise ValueError(
                f"prompt {i} has {len(p)} tokens, longer than the model's max_position_embeddings="
                f"{cfg.max_position_embeddings}; truncate the prompt"
            )
        if len(p) + params.max_new_tokens > cfg.max_position_embeddings:
            raise ValueError(
                f"prompt {i} ({len(p)} tokens) + max_new_tokens={params.max_new_tokens} exceeds the model's "
                f"max_position_embeddings={cfg.max_position_embeddings}; lower max_new_tokens or shorten it"
            )
        if min(p) < 0 or max(p) >= cfg.vocab_size:
            raise ValueError(f"prompt {i} has token ids outside [0, vocab_size={cfg.vocab_size})")


def plan_waves(lengths: list[int], params: SamplingParams) -> list[list[int]]:
    """Group prompt indices into waves with rows x (longest prompt + max_new_tokens) <= the budget.

    Prompts are taken longest first so that each wave pads to similar lengths.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    budget, n, t = params.max_tokens_in_flight, params.n, params.max_new_tokens
    waves: list[list[int]] = []
    for i in order:
        need_alone = n * (lengths[i] + t)
        if budget is not None and need_alone > budget:
            raise ValueError(
                f"max_tokens_in_flight={budget} cannot hold the n={n} samples of prompt {i} "
                f"(n x ({lengths[i]} tokens + max_new_tokens={t}) = {need_alone} slots); raise it or lower n"
            )
        if waves:
            longest = lengths[waves[-1][0]]
            if budget is None or (len(waves[-1]) + 1) * n * (longest + t) <= budget:
                waves[-1].append(i)
                continue
        waves.append([i])
    return waves


# ----------------------------------------------------------------------------------------------------
# One wave


def left_pad(prompts: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """-> ids [P, L] (pad id 0, never attended) and mask [P, L] bool (True = real token)."""
    L = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), L, dtype=torch.long)
    mask = torch.zeros(len(prompts), L, dtype=torch.bool)
    for r, p in enumerate(prompts):
        ids[r, L - len(p) :] = torch.tensor(p)
        mask[r, L - len(p) :] = True
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


def _prefill_prompts(model: Transformer, prompts: list[list[int]]) -> tuple[KVCache, torch.Tensor, torch.Tensor]:
    """The P prompts' keys/values -> (cache [P, L slots], key mask [P, L], last-position logits [P, V]).

    A prefix that every prompt shares (shared_prefix_length >= MIN_SHARED_PREFIX) runs once: its c slots are
    copied to every row, the rest of each prompt is left-padded after them ([prefix][pad][own tokens]) and attends
    to them. Positions count valid slots, so every token keeps its position; the keys/values equal those of the
    plain prefill up to float rounding. A system prompt is often most of a chat prompt.
    """
    device, dtype = model.device, model.embed.weight.dtype
    c = shared_prefix_length(prompts)
    if c < MIN_SHARED_PREFIX:
        ids, mask = left_pad(prompts, device)  # [P, L]
        cache = KVCache.allocate(model.config, len(prompts), ids.shape[1], dtype, device)
        hidden = model(ids, mask, cache=cache, return_hidden=True)  # [P, L, hidden]
        return cache, mask, model.lm_head(hidden[:, -1])  # the LM head at the last position only
    shared = KVCache.allocate(model.config, 1, c, dtype, device)
    model(torch.tensor([prompts[0][:c]], device=device), torch.ones(1, c, dtype=torch.bool, device=device),
          cache=shared, return_hidden=True)  # [1, c]
    ids, own_mask = left_pad([p[c:] for p in prompts], device)  # [P, L - c]
    P, L = ids.shape[0], c + ids.shape[1]
    cache = KVCache.allocate(model.config, P, L, dtype, device)
    cache.copy_prefix_from(shared, torch.zeros(P, dtype=torch.long, device=device))  # slots [0, c), start = c
    mask = torch.cat([torch.ones(P, c, dtype=torch.bool, device=device), own_mask], dim=1)  # [P, L]
    hidden = model(ids, mask, cache=cache, return_hidden=True)  # [P, L - c, hidden]
    return cache, mask, model.lm_head(hidden[:, -1])


def prefill(model: Transformer, prompts: list[list[int]], n: int, max_new: int):
    """Prefill the P prompts once, then share them with their n rows.

    -> decode cache [P*n rows, L+T slots], key mask [P*n, L+T] (True = valid slot), logits [P*n, V].
    """
    device, dtype = model.device, model.embed.weight.dtype
    prefix, mask, logits = _prefill_prompts(model, prompts)  # [P, L] cache and mask, [P, V]
    P, L = mask.shape
    share = torch.arange(P, device=device).repeat_interleave(n)  # [P*n]: row -> its prompt
    cache = KVCache.allocate(model.config, P * n, L + max_new, dtype, device)
    cache.copy_prefix_from(prefix, share)
    key_mask = torch.zeros(P * n, L + max_new, dtype=torch.bool, device=device)
    key_mask[:, :L] = mask.index_select(0, share)
    return cache, key_mask, logits.index_select(0, share)


def _run_wave(
    model: Transformer,
    prompts: list[list[int]],
    params: SamplingParams,
    sample: Sampler,
    draws: Draws,
    stop_strings: StopStrings,
    decode_step: Callable,
    prompt_ids: list[int],
    packs: PackedWeights,
) -> list[_Row]:
    """Generate n completions for each prompt of the wave (their indices in the call: prompt_ids); rows in
    (prompt, sample) order."""
    n, T = params.n, params.max_new_tokens
    cache, key_mask, logits = prefill(model, prompts, n, T)
    R = cache.batch
    packs.resize(R, T)  # a wave smaller than the largest one
    head = DecodeHead(model, R, packs)
    stop_ids = set(params.stop_token_ids)
    tokens: list[list[int]] = [[] for _ in range(R)]
    logps: list[list[float]] = [[] for _ in range(R)]
    filtered: list[list[float]] = [[] for _ in range(R)]
    reasons: list[str | None] = [None] * R
    active = list(range(R))  # original row of each row in the batch
    for t in range(T):
        u = draws.uniforms([prompt_ids[r // n] for r in active], [reasons[r] is None for r in active])
        tok, logp, filtered_logp = sample(logits, draws.shared, u)  # [A] each
        tok_list, logp_list = tok.tolist(), logp.tolist()
        filtered_list = logp_list if filtered_logp is logp else filtered_logp.tolist()
        if NAN_TOKEN in tok_list:
            raise NonFiniteLogits(f"NaN or +inf logits at decode step {t}: the model's weights or activations blew up")
        for a, r in enumerate(active):
            if reasons[r] is not None:
                continue  # finished, waiting for compaction; its new token is discarded
            tokens[r].append(tok_list[a])
            logps[r].append(logp_list[a])
            filtered[r].append(filtered_list[a])
            if tok_list[a] in stop_ids or stop_strings(tokens[r]):
                reasons[r] = STOP
            elif t == T - 1:
                reasons[r] = LENGTH
        keep = [a for a, r in enumerate(active) if reasons[r] is None]
        if not keep:
            break
        n_done = len(active) - len(keep)
        if n_done > 0 and n_done >= params.compact_fraction * len(active):
            index = torch.tensor(keep, device=tok.device)
            cache.select_rows(index)
            key_mask, tok = key_mask.index_select(0, index), tok.index_select(0, index)
            active = [active[a] for a in keep]
            packs.resize(len(keep), T - t - 1)
        key_mask[:, cache.start] = True
        logits = head(decode_step(tok[:, None], key_mask[:, : cache.start + 1], cache))  # [A, V]
    return [_Row(tokens[r], logps[r], filtered[r], reasons[r]) for r in range(R)]


def _eager_step(model: Transformer) -> Callable:
    def step(tok: torch.Tensor, key_mask: torch.Tensor, cache: KVCache) -> torch.Tensor:
        return model(tok, key_mask, cache=cache, return_hidden=True)[:, -1]  # [A, 1] -> [A, hidden]

    return step


# ----------------------------------------------------------------------------------------------------
# Public entry point


def generate(
    model: Transformer,
    prompt_ids: list[list[int]],
    params: SamplingParams,
    seed: int | Sequence[int] = 0,
    *,
    tokenizer=None,
    compile: bool | str = False,
) -> GenerationOutput:
    """Sample params.n completions for each prompt with the model's own weights (no copy, no sync).

    seed: one int for the call, or one per prompt (see the module docstring: per-prompt seeds make a prompt's
    completions independent of the rest of the batch).
    tokenizer: needed only for stop_strings. compile: torch.compile the decode step (True = inductor,
    or a backend name); shapes are marked dynamic so compaction and the growing cache do not recompile.
    """
    _validate(model, prompt_ids, params, tokenizer)
    n = params.n
    rows: list[_Row | None] = [None] * (len(prompt_ids) * n)
    if not prompt_ids:
        return GenerationOutput([], [], [], [])
    seed = as_seed(seed)
    if not isinstance(seed, int) and len(seed) != len(prompt_ids):
        raise ValueError(f"got {len(seed)} seeds for {len(prompt_ids)} prompts: give one int, or one seed per prompt")
    draws = Draws(seed, model.device)
    sample, stops = Sampler(params), StopStrings(params.stop_strings, tokenizer)
    step = _eager_step(model)
    if compile:
        step = torch.compile(step, dynamic=True, **({} if compile is True else {"backend": compile}))
    waves = plan_waves([len(p) for p in prompt_ids], params)
    rows_in_flight = max(len(w) for w in waves) * n
    pack_steps = 0 if compile else params.max_new_tokens  # a compiled step keeps the plain weights
    with torch.inference_mode(), packed_for_decode(model, rows_in_flight, pack_steps) as packs:
        for wave in waves:
            done = _run_wave(model, [prompt_ids[i] for i in wave], params, sample, draws, stops, step, wave, packs)
            for j, i in enumerate(wave):
                rows[i * n : (i + 1) * n] = done[j * n : (j + 1) * n]
    return GenerationOutput(
        completion_ids=[r.tokens for r in rows],
        logprobs=[r.logprobs for r in rows],
        finish_reason=[r.reason for r in rows],
        prompt_index=[i // n for i in range(len(rows))],
        filtered_logprobs=[r.filtered_logprobs for r in rows],
    )
