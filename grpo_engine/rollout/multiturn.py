"""Multi-turn rollouts: each row is one trajectory that alternates model turns and environment turns (tool
results, replies), token-exact, in the one decode cache. One row per environment (tasks/environment.py).

This module starts the trajectories (env.reset, the first prompt with the tools it declares) and reads them back as
Trajectory records; they decode as rows (rows.Row with an environment) of generate's one front
(generate.generate_rows): a model turn ends at a stop token (EOS), a stop string (the environment's, e.g.
`</tool_call>`), the per-turn `max_new_tokens` or the trajectory's token budget, its text goes to `env.step`, and
only the tokens of the messages it appends are fed (rendered on their own by chat_turns.py: the conversation is
never re-rendered or re-tokenized), between two chunks of the one decode loop (static_turns.py). Log-probs are the
TokenSampler's, as in generate, so a full forward over a trajectory reproduces them on its policy tokens
(tests/rollout/test_multiturn.py checks 1e-4).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..model.transformer import Transformer
from .chat_turns import render_first_prompt
from .generate import generate_rows
from .rows import BUDGET, DONE, MAX_TURNS, TURN_LENGTH, Row, TrajectoryMetrics
from .sampling import SamplingParams
from .stop_strings import StopStrings

if TYPE_CHECKING:  # the protocol lives with the tasks; the sampler only calls reset/step and reads limits
    from ..tasks.environment import Environment

__all__ = ["BUDGET", "DONE", "MAX_TURNS", "TURN_LENGTH", "Trajectory", "TrajectoryMetrics", "run_multiturn"]


@dataclass
class Trajectory:
    """One rollout. token_ids, loss_mask and logprobs are aligned: [N] each."""

    token_ids: list[int]  # [N] the first prompt, then every model and environment turn
    loss_mask: list[int]  # [N] 1 on tokens the policy sampled, 0 on the prompt and on environment tokens
    logprobs: list[float]  # [N] the sampler's log-prob on policy tokens, 0.0 elsewhere
    reward: float  # sum of the steps' rewards
    reward_components: dict[str, float]  # summed key by key over the steps
    finish_reason: str  # done (the environment ended it) | turn_length (it ended it after a turn cut at
    #                     max_new_tokens: a truncated answer) | max_turns | budget
    metrics: TrajectoryMetrics


def _start_row(i: int, env: Environment, example, tokenizer, params: SamplingParams, sources: dict) -> Row:
    """reset the environment and tokenize its first prompt (with the tools it declares); trajectory i draws from
    generator i, and rows with the same first prompt (a GRPO group) share its prefill (sources: prompt -> index)."""
    prompt = env.reset(example)
    ids = tokenizer.encode(render_first_prompt(tokenizer, prompt.messages, prompt.prefill, env.tools or None))
    stops = StopStrings([*params.stop_strings, *env.stop_strings], tokenizer)
    source = sources.setdefault(tuple(ids), len(sources))
    return Row(i, source, ids, stops, params, len(ids) + env.limits.max_tokens, env, tokenizer)


def run_multiturn(
    model: Transformer,
    tokenizer,
    envs: Sequence[Environment],
    examples: Sequence,
    params: SamplingParams,
    seed: int | Sequence[int] = 0,
    *,
    loop: str | None = None,
) -> list[Trajectory]:
    """One trajectory per (environment, example): envs[i].reset(examples[i]), then model and environment
    turns until the environment ends it or a limit does.

    params: sampling as in generate; max_new_tokens bounds ONE model turn, stop_token_ids end a turn (pass the
    tokenizer's EOS ids), stop_strings are added to each environment's. n must be 1 (a group is G
    environments of the same example; their shared prompt is prefilled once). seed: one int, or one per
    trajectory (then a trajectory's samples do not depend on the other rows). All trajectories decode as one
    batch (no waves: max_tokens_in_flight is not applied); split a large call in the caller.
    loop: as in generate (None: generate.choose_loop picks: CUDA graphs on CUDA, eager chunks elsewhere).
    """
    if len(envs) != len(examples):
        raise ValueError(f"{len(envs)} environments but {len(examples)} examples; pass one each")
    if params.n != 1:
        raise ValueError(f"run_multiturn samples one trajectory per environment; got n={params.n} (pass G "
                         "environments per example for a group)")
    sources: dict[tuple[int, ...], int] = {}
    rows = [_start_row(i, env, ex, tokenizer, params, sources) for i, (env, ex) in enumerate(zip(envs, examples))]
    generate_rows(model, rows, params, seed, tokenizer=tokenizer, loop=loop)
    return [Trajectory(r.tokens, r.mask, r.logps, r.reward, r.components, r.finish or DONE, r.metrics) for r in rows]
