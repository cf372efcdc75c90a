"""The one decode front: `generate_rows` runs rows (rollout/rows.py) to their ends, single-turn completions
(`generate`) and multi-turn trajectories (multiturn.run_multiturn) alike, on the one decode loop
(static_decode.decode_static) over the one decode cache (static_cache.StaticDecodeState): in CUDA graphs on CUDA,
eagerly on a CPU, under FSDP2 or with rollout.cuda_graphs=off (`choose_loop`).

One call runs in waves (so rows x max length stays under `max_tokens_in_flight`; a multi-turn call is one wave).
Each wave prefills its distinct first prompts once (a prefix all of them share runs once), copies each prompt's
keys/values to its rows, then decodes 16 steps a chunk; finished rows leave the batch as the live ones fit a
smaller bucket. A multi-turn row whose model turn ended inside a chunk is set back to that turn's end and its
environment tokens go in between two chunks (static_turns.py).

Reproducibility: every draw comes from a table of uniforms drawn ahead per wave (engine.Draws.table). With `seed`
an int, one torch.Generator seeded with it draws the table, so the same call (same prompts, params, seed, device)
gives the same completions. With one seed per prompt (per trajectory), each prompt's rows draw from its own
generator: a prompt's completions then do not depend on which other prompts share the call, the wave plan, or when
other rows finish (the trainer seeds each prompt by (seed, step, global prompt index), so splitting prompts across
ranks does not change what is sampled).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..model.transformer import Transformer
from .decode_kernels import packed_for_decode
from .engine import Draws, as_seed
from .rows import Row, validate_rows
from .sampling import SamplingParams
from .static_decode import decode_static, eager_decoder, graphs_for, release_static_decode, static_decoder
from .stop_strings import StopStrings

LOOPS = ("static", "graphs")  # how generate_rows runs decode_static: eager chunks / CUDA graphs


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


# ----------------------------------------------------------------------------------------------------
# Wave planning


def rows_in_flight(prompts: int, samples: int, slots: int, budget: int | None) -> int:
    """The most rows one wave decodes at once: every prompt's `samples` rows without a budget (0 or None); with one,
    whole prompts while rows x slots (tokens a row holds: its prompt + max_new_tokens) stays within it, at least one
    prompt when there is one. The one formula of rollout.max_tokens_in_flight: the waves (plan_waves), the planner
    (plan/from_config.py, plan/memory.py) and the size check (plan/sizes.py) all ask it."""
    if not budget:
        return prompts * samples
    return min(prompts, max(1, budget // (samples * slots))) * samples


def plan_waves(lengths: list[int], params: SamplingParams) -> list[list[int]]:
    """Group prompt indices into waves with rows x (longest prompt + max_new_tokens) <= the budget.

    Prompts are taken longest first so that each wave pads to similar lengths.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    budget, n, t = params.max_tokens_in_flight, params.n, params.max_new_tokens
    waves: list[list[int]] = []
    start = 0
    while start < len(order):  # order[start]: the next wave's longest prompt
        longest = lengths[order[start]]
        if budget is not None and n * (longest + t) > budget:
            raise ValueError(
                f"max_tokens_in_flight={budget} cannot hold the n={n} samples of prompt {order[start]} "
                f"(n x ({longest} tokens + max_new_tokens={t}) = {n * (longest + t)} slots); "
                "raise rollout.max_tokens_in_flight, or lower n or max_new_tokens"
            )
        size = rows_in_flight(len(order) - start, n, longest + t, budget) // n
        waves.append(order[start : start + size])
        start += size
    return waves


# ----------------------------------------------------------------------------------------------------
# Single-turn rows


def generate(
    model: Transformer,
    prompt_ids: list[list[int]],
    params: SamplingParams,
    seed: int | Sequence[int] = 0,
    *,
    tokenizer=None,
    compile: bool | str = False,
    loop: str | None = None,
) -> GenerationOutput:
    """Sample params.n completions for each prompt with the model's own weights (no copy, no sync).

    seed: one int for the call, or one per prompt (see the module docstring: per-prompt seeds make a prompt's
    completions independent of the rest of the batch).
    tokenizer: needed only for stop_strings. compile: refused (the decode's chunks run in CUDA graphs on CUDA and
    eagerly elsewhere; no step is torch.compile'd).
    loop: None lets params.cuda_graphs pick (choose_loop); `static` / `graphs` force eager chunks / CUDA graphs
    (the same completions up to float rounding).
    """
    if compile:
        raise ValueError(f"compile={compile!r}: the decode is not torch.compile'd (it runs CUDA graphs on CUDA, eager "
                         "chunks elsewhere); drop compile")
    n, T = params.n, params.max_new_tokens
    stops = StopStrings(params.stop_strings, tokenizer)
    rows = [Row(i, i, list(p), stops, params, len(p) + T) for i, p in enumerate(prompt_ids) for _ in range(n)]
    waves = [[i * n + k for i in wave for k in range(n)] for wave in plan_waves([len(p) for p in prompt_ids], params)]
    generate_rows(model, rows, params, seed, tokenizer=tokenizer, waves=waves, loop=loop)
    return GenerationOutput(
        completion_ids=[r.tokens[r.prompt_len :] for r in rows],
        logprobs=[r.logps[r.prompt_len :] for r in rows],
        finish_reason=[r.finish for r in rows],
        prompt_index=[i // n for i in range(len(rows))],
        filtered_logprobs=[r.filtered_logps[r.prompt_len :] for r in rows],
    )


def generate_static(model: Transformer, prompt_ids: list[list[int]], params: SamplingParams,
                    seed: int | Sequence[int] = 0, *, tokenizer=None, graphs: bool = False) -> GenerationOutput:
    """generate() with the loop forced: with graphs=True what rollout.cuda_graphs runs on CUDA (each graph
    checked against an eager chunk when captured: params.cuda_graphs `on` raises on a failed check, `auto` or `off`
    decode eagerly from then on); with graphs=False the same steps eagerly, on any device."""
    return generate(model, prompt_ids, params, seed, tokenizer=tokenizer, loop="graphs" if graphs else "static")


# ----------------------------------------------------------------------------------------------------
# The front: any rows, one validation, one set-up, one loop


def generate_rows(model: Transformer, rows: list[Row], params: SamplingParams, seed: int | Sequence[int] = 0, *,
                  tokenizer=None, waves: list[list[int]] | None = None, loop: str | None = None) -> None:
    """Run every row to its end; the rows record their tokens themselves. waves: row indices decoded together
    (None: all rows at once); a wave's rows of one `source` share its prefill. seed: one int, or one per
    generator (rows[i].generator indexes it). loop: see choose_loop (None: params.cuda_graphs decides)."""
    loop = choose_loop(model, params) if loop is None else loop
    if loop not in LOOPS:
        raise ValueError(f"loop={loop!r} is not a decode loop: pick one of {', '.join(LOOPS)}")
    validate_rows(model, rows, params, tokenizer)
    if not rows:
        return
    draws = Draws(_seeds(seed, rows), model.device)
    batches = [[rows[i] for i in w] for w in (waves if waves is not None else [range(len(rows))])]
    _decode_waves(model, batches, params, draws, graphs=loop == "graphs")


def choose_loop(model: Transformer, params: SamplingParams) -> str:
    """params.cuda_graphs -> how the one loop runs its chunks: `graphs` (CUDA graphs: `auto` on CUDA unless the model
    is sharded by FSDP2, `on`; static_decode.graphs_for) or `static` (eagerly), for single-turn and multi-turn rows
    alike."""
    return "graphs" if graphs_for(model, params.cuda_graphs) else "static"


def _seeds(seed: int | Sequence[int], rows: list[Row]) -> int | list[int]:
    seed, count = as_seed(seed), max(r.generator for r in rows) + 1
    one, many = ("prompt", "prompts") if rows[0].env is None else ("trajectory", "trajectories")
    if not isinstance(seed, int) and len(seed) != count:
        raise ValueError(f"got {len(seed)} seeds for {count} {many}: give one int, or one seed per {one}")
    return seed


def wave_prompts(rows: list[Row]) -> tuple[list[list[int]], list[int]]:
    """-> the wave's distinct first prompts (by source, in order of first appearance), and row -> its prompt."""
    index: dict[int, int] = {}
    share = [index.setdefault(r.source, len(index)) for r in rows]
    prompts: list[list[int]] = [[] for _ in index]
    for r, j in zip(rows, share):
        prompts[j] = r.tokens[: r.prompt_len]
    return prompts, share


def _decode_waves(model: Transformer, waves: list[list[Row]], params: SamplingParams, draws: Draws,
                  graphs: bool) -> None:
    """static_decode.decode_static, wave by wave: with graphs on the model's kept decoder (a failure frees it: a state
    left mid-step, or NaN-poisoned, is not reused); eagerly on a decoder of the call's own, with the weights packed
    for it, freed when the call ends (static_decode.py, "Eager or kept")."""
    mode = ("on" if params.cuda_graphs == "on" else "auto") if graphs else "off"  # static_decode.decode_static
    every = [r for rows in waves for r in rows]
    T = max(r.budget_end - r.prompt_len for r in every)  # tokens a row may add (max_new_tokens for a completion)
    rows, slots = max(map(len, waves)), max(r.prompt_len for r in every) + T
    try:
        with torch.inference_mode(), packed_for_decode(model, rows, 0 if graphs else T) as packs:
            decoder = static_decoder(model, rows, slots, T) if graphs else eager_decoder(model, rows, slots, T, packs)
            sample = decoder.token_sampler(params)
            for wave in waves:
                prompts, share = wave_prompts(wave)
                uniforms = draws.table([r.generator for r in wave], T)  # [R, T]
                decode_static(model, decoder, wave, prompts, share, sample, uniforms, mode)
    except BaseException:
        if graphs:
            release_static_decode(model)
        raise
