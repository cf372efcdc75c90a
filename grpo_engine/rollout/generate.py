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

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..model.transformer import Transformer
from .decode_kernels import PackedWeights, packed_for_decode
from .engine import DecodeStep, Draws, as_seed, decode, eager_step, prefill
from .sampling import Sampler, SamplingParams
from .static_decode import decode_static, graphs_for, release_static_decode, static_decoder
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


@dataclass
class _Row:
    """One completion (the engine's Row): a conversation that ends after one model turn."""

    generator: int  # the prompt's index in the call (per-prompt seeds draw from its generator)
    stop_ids: set[int]
    stop_strings: StopStrings
    max_new: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    filtered_logprobs: list[float] = field(default_factory=list)
    reason: str | None = None  # STOP | LENGTH once finished
    pending: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.reason is not None

    def take(self, token: int, logp: float, filtered_logp: float) -> None:
        self.tokens.append(token)
        self.logprobs.append(logp)
        self.filtered_logprobs.append(filtered_logp)
        if token in self.stop_ids or self.stop_strings(self.tokens):
            self.reason = STOP
        elif len(self.tokens) >= self.max_new:
            self.reason = LENGTH
        self.pending = [token]

    def steps_left(self) -> int:
        return self.max_new - len(self.tokens)


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


def _run_wave(model: Transformer, prompts: list[list[int]], params: SamplingParams, sample: Sampler, draws: Draws,
              stop_strings: StopStrings, step: DecodeStep, prompt_ids: list[int], packs: PackedWeights) -> list[_Row]:
    """Generate n completions for each prompt of the wave (their indices in the call: prompt_ids); rows in
    (prompt, sample) order."""
    n, T = params.n, params.max_new_tokens
    share = [i for i in range(len(prompts)) for _ in range(n)]  # row -> its prompt in the wave
    cache, key_mask, logits = prefill(model, prompts, share, T)
    rows = [_Row(prompt_ids[i], set(params.stop_token_ids), stop_strings, T) for i in share]
    packs.resize(len(rows), T)  # a wave smaller than the largest one
    decode(model, rows, cache, key_mask, logits, sample, draws, packs, step, params.compact_fraction)
    return rows


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
    params.cuda_graphs picks the loop (static_decode.graphs_for): `auto` (the default) runs the static decode
    with CUDA graphs on CUDA (generate_static; eagerly after a failed capture check) unless the model is sharded by
    FSDP2, and the dynamic loop below elsewhere.
    """
    if graphs_for(model, params.cuda_graphs, bool(compile)):
        return generate_static(model, prompt_ids, params, seed, tokenizer=tokenizer, graphs=True)
    _validate(model, prompt_ids, params, tokenizer)
    if not prompt_ids:
        return GenerationOutput([], [], [], [])
    draws = Draws(_seeds(seed, prompt_ids), model.device)
    sample, stops = Sampler(params), StopStrings(params.stop_strings, tokenizer)
    step = eager_step(model)
    if compile:
        step = torch.compile(step, dynamic=True, **({} if compile is True else {"backend": compile}))
    waves = plan_waves([len(p) for p in prompt_ids], params)
    rows_in_flight = max(len(w) for w in waves) * params.n
    pack_steps = 0 if compile else params.max_new_tokens  # a compiled step keeps the plain weights
    rows: list[_Row] = []
    with torch.inference_mode(), packed_for_decode(model, rows_in_flight, pack_steps) as packs:
        for wave in waves:
            rows += _run_wave(model, [prompt_ids[i] for i in wave], params, sample, draws, stops, step, wave, packs)
    return _output(rows, params.n)


def _seeds(seed: int | Sequence[int], prompt_ids: list[list[int]]) -> int | list[int]:
    seed = as_seed(seed)
    if not isinstance(seed, int) and len(seed) != len(prompt_ids):
        raise ValueError(f"got {len(seed)} seeds for {len(prompt_ids)} prompts: give one int, or one seed per prompt")
    return seed


def _output(rows: list[_Row], n: int) -> GenerationOutput:
    """The rows of every wave in prompt order (a stable sort: a prompt's samples stay in sampling order)."""
    rows = sorted(rows, key=lambda r: r.generator)
    return GenerationOutput(
        completion_ids=[r.tokens for r in rows],
        logprobs=[r.logprobs for r in rows],
        finish_reason=[r.reason for r in rows],
        prompt_index=[i // n for i in range(len(rows))],
        filtered_logprobs=[r.filtered_logprobs for r in rows],
    )


def generate_static(model: Transformer, prompt_ids: list[list[int]], params: SamplingParams,
                    seed: int | Sequence[int] = 0, *, tokenizer=None, graphs: bool = False) -> GenerationOutput:
    """generate() on the static decode state (static_decode.py): with graphs=True (CUDA) what rollout.cuda_graphs
    runs (each graph checked against an eager chunk when captured: params.cuda_graphs `on` raises on a failed
    check, `auto` or `off` decode eagerly from then on); with graphs=False the same steps eagerly, on any device.
    Same arguments, same waves, same completions up to float rounding for greedy decoding; sampled ones come from
    another random stream (Draws.table). params.compact_fraction does not apply: finished rows leave by batch
    buckets (static_cache.bucket_for)."""
    _validate(model, prompt_ids, params, tokenizer)
    n, T = params.n, params.max_new_tokens
    if not prompt_ids:
        return GenerationOutput([], [], [], [])
    draws = Draws(_seeds(seed, prompt_ids), model.device)
    stops, rows = StopStrings(params.stop_strings, tokenizer), []
    waves = plan_waves([len(p) for p in prompt_ids], params)
    mode = ("on" if params.cuda_graphs == "on" else "auto") if graphs else "off"  # static_decode.decode_static
    try:
        with torch.inference_mode():
            decoder = static_decoder(model, max(len(w) for w in waves) * n, max(map(len, prompt_ids)) + T, T)
            sample = decoder.sampler(params)
            for wave in waves:
                share = [j for j in range(len(wave)) for _ in range(n)]  # row -> its prompt in the wave
                done = [_Row(wave[j], set(params.stop_token_ids), stops, T) for j in share]
                uniforms = draws.table([wave[j] for j in share], T)  # [R, T]
                decode_static(model, decoder, done, [prompt_ids[i] for i in wave], share, sample, uniforms, mode)
                rows += done
    except BaseException:
        release_static_decode(model)  # a state left mid-step (or NaN-poisoned) is not reused
        raise
    return _output(rows, n)
