"""The reference the one decode loop is checked against: each row alone, one full forward per token (no cache, no
batch, no bucket), its t-th policy token drawn by the sampler with its t-th uniform of the call's table
(engine.Draws.table, the one random stream). What generate_rows gives must equal it: tokens, masks, finish reasons
and metrics exactly, log-probs to rounding (float64: 1e-10)."""

from __future__ import annotations

import torch

from grpo_engine.rollout.engine import Draws, as_seed
from grpo_engine.rollout.sampling import TokenSampler


def reference_decode(model, rows, params, seed) -> None:
    """Run `rows` (rows.Row, one wave) to their ends the slow way; the rows record their tokens."""
    columns = max(r.budget_end - r.prompt_len for r in rows)
    table = Draws(as_seed(seed), model.device).table([r.generator for r in rows], columns)  # [R, columns]
    sample = TokenSampler(params)
    with torch.no_grad():
        for i, row in enumerate(rows):
            while not row.finished:
                logits = model(torch.tensor([row.tokens], device=model.device))[:, -1]  # [1, V]
                col = min(row.metrics.model_tokens, columns - 1)
                draw = sample(logits, None, table[i : i + 1, col : col + 1])
                row.take(int(draw.tokens[0]), float(draw.logp[0]), float(draw.filtered_logp[0]))


def reference_trajectories(model, tokenizer, envs, examples, params, seed):
    """run_multiturn's trajectories, decoded by reference_decode."""
    from grpo_engine.rollout import multiturn

    sources: dict = {}
    rows = [multiturn._start_row(i, env, ex, tokenizer, params, sources)
            for i, (env, ex) in enumerate(zip(envs, examples))]
    reference_decode(model, rows, params, seed)
    return [multiturn.Trajectory(r.tokens, r.mask, r.logps, r.reward, r.components, r.finish or multiturn.DONE,
                                 r.metrics) for r in rows]


def reference_generate(model, prompts, params, seed, tokenizer=None):
    """generate()'s rows (params.n a prompt, prompt i drawing from generator i), decoded by reference_decode; seed:
    one per prompt (a shared one draws the table in generate's wave order, which this does not follow)."""
    from grpo_engine.rollout.rows import Row
    from grpo_engine.rollout.stop_strings import StopStrings

    stops = StopStrings(params.stop_strings, tokenizer)
    rows = [Row(i, i, list(p), stops, params, len(p) + params.max_new_tokens) for i, p in enumerate(prompts)
            for _ in range(params.n)]
    reference_decode(model, rows, params, seed)
    return rows
