"""Multi-turn rollouts: each row is one trajectory that alternates model turns and environment turns (tool
results, replies), token-exact, in one batched KV cache.

One row per environment (tasks/environment.py). Rows finish, pause and resume independently:

1. prefill: the distinct first prompts go through the model once (generate's `prefill`), and rows with the
   same prompt (a GRPO group) get copies of its keys/values;
2. every step, each row feeds the model its PENDING tokens, left-padded to the step's longest: a decoding
   row feeds its last sampled token; a row whose turn just ended feeds that token followed by the
   environment's new tokens (tool results, end of turn, next generation prompt). The pad slots are masked
   out of the key mask, and positions are counts of valid slots, so for the model each row is one
   contiguous sequence. Every row's next-token logits are at the last position; every live row samples one
   token per step;
3. a model turn ends at a stop token (EOS), a stop string (the environment's, e.g. `</tool_call>`), the
   per-turn `max_new_tokens`, or the trajectory's token budget. The turn's text goes to `env.step`; the
   messages it appends are rendered on their own (rollout/chat_turns.py) and only their tokens are
   prefilled -- the conversation is never re-rendered or re-tokenized;
4. finished rows leave the batch like in generate (compaction by `compact_fraction`).

The choice of one batch over paused sub-batches: the cache has one write position for all rows, so a
step that prefills k tool tokens for one row writes k slots in every row (k - 1 masked holes in the
others). Holes cost memory and attention, not correctness; the cache grows by doubling when they fill
it, and on typical tool turns (tens of tokens, a few per trajectory) they are a small fraction. The gain:
no row ever waits for another, and nothing is copied between caches.

Log-probs are recorded exactly as in generate (the Sampler's distribution), so a full forward over a
trajectory reproduces them on its policy tokens (tests/rollout/test_multiturn.py checks 1e-4).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..model.transformer import Transformer
from .chat_turns import continuation_ids, render_first_prompt
from .decode_kernels import packed_for_decode
from .engine import Draws, as_seed, decode, eager_step, prefill
from .sampling import Sampler, SamplingParams
from .static_decode import cuda_graphs_on
from .stop_strings import StopStrings

if TYPE_CHECKING:  # the protocol lives with the tasks; the sampler only calls reset/step and reads limits
    from ..tasks.environment import Environment

DONE, MAX_TURNS, BUDGET, TURN_LENGTH = "done", "max_turns", "budget", "turn_length"


@dataclass
class TrajectoryMetrics:
    turns: int = 0  # model turns
    tool_calls: int = 0
    tool_errors: int = 0
    prompt_tokens: int = 0  # the first prompt
    model_tokens: int = 0  # sampled by the policy (loss_mask == 1)
    env_tokens: int = 0  # appended by the environment after the first prompt (tool results, turn markers)


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


@dataclass
class _Row:
    """One trajectory in flight (internal)."""

    env: Environment
    tokens: list[int]
    stops: StopStrings
    budget_end: int  # len(tokens) may not pass this: first prompt + limits.max_tokens
    mask: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    turn_start: int = 0  # index in tokens of the current model turn's first token
    pending: list[int] = field(default_factory=list)  # tokens to feed at the next step
    reward: float = 0.0
    components: dict[str, float] = field(default_factory=dict)
    finish: str | None = None
    metrics: TrajectoryMetrics = field(default_factory=TrajectoryMetrics)
    generator: int = 0  # its own per-trajectory generator (per-trajectory seeds)
    tokenizer: object = None
    params: SamplingParams | None = None

    @property
    def finished(self) -> bool:
        return self.finish is not None

    def take(self, token: int, logp: float, filtered_logp: float) -> None:
        """Record one sampled token; end the turn when a stop, the turn length or the budget says so."""
        self.tokens.append(token)
        self.mask.append(1)
        self.logps.append(logp)
        self.metrics.model_tokens += 1
        turn_len = len(self.tokens) - self.turn_start
        tail = self.tokens[max(self.turn_start, len(self.tokens) - self.stops.window) :]  # all a stop string spans
        out_of_tokens = len(self.tokens) >= self.budget_end
        if token in self.params.stop_token_ids:
            _end_turn(self, self.tokenizer, token, out_of_tokens, cut=False)
        elif (stopped := self.stops(tail)) or turn_len >= self.params.max_new_tokens or out_of_tokens:
            _end_turn(self, self.tokenizer, None, out_of_tokens, cut=not stopped)
        else:
            self.pending = [token]

    def steps_left(self) -> int:
        return self.params.max_new_tokens  # a bound: each model turn takes at most that many


def _start_row(env: Environment, example, tokenizer, params: SamplingParams) -> _Row:
    """reset the environment and tokenize its first prompt (with the tools it declares)."""
    prompt = env.reset(example)
    ids = tokenizer.encode(render_first_prompt(tokenizer, prompt.messages, prompt.prefill, env.tools or None))
    stops = StopStrings([*params.stop_strings, *env.stop_strings], tokenizer)
    row = _Row(env, ids, stops, len(ids) + env.limits.max_tokens, [0] * len(ids), [0.0] * len(ids), len(ids))
    row.metrics.prompt_tokens = len(ids)
    return row


def _validate(model: Transformer, rows: list[_Row], params: SamplingParams) -> None:
    cfg = model.config
    if params.n != 1:
        raise ValueError(f"run_multiturn samples one trajectory per environment; got n={params.n} (pass G "
                         "environments per example for a group)")
    for i, row in enumerate(rows):
        if not row.tokens or min(row.tokens) < 0 or max(row.tokens) >= cfg.vocab_size:
            raise ValueError(f"trajectory {i}: the first prompt is empty or has ids outside the vocabulary")
        if row.budget_end > cfg.max_position_embeddings:
            raise ValueError(f"trajectory {i}: prompt ({len(row.tokens)} tokens) + max_tokens="
                             f"{row.env.limits.max_tokens} exceeds max_position_embeddings="
                             f"{cfg.max_position_embeddings}; lower the environment's max_tokens")


# ----------------------------------------------------------------------------------------------------
# Turns


def _end_turn(row: _Row, tokenizer, ended_with: int | None, out_of_tokens: bool, cut: bool) -> None:
    """Pass the turn's text to the environment; finish the row, or queue the appended tokens to prefill.
    cut: the turn ran out of tokens (max_new_tokens or the budget) instead of ending with a stop token or string."""
    row.metrics.turns += 1
    text = tokenizer.decode(row.tokens[row.turn_start :], skip_special_tokens=True)
    result = row.env.step(text)
    row.reward += result.reward
    for key, value in result.reward_components.items():
        row.components[key] = row.components.get(key, 0.0) + value
    row.metrics.tool_calls += result.tool_calls
    row.metrics.tool_errors += result.tool_errors
    if result.append is None:  # a last turn cut short is a truncated answer, as in single-turn generate
        row.finish = (BUDGET if out_of_tokens else TURN_LENGTH) if cut else DONE
        return
    if row.metrics.turns >= row.env.limits.max_turns:
        row.finish = MAX_TURNS
        return
    new = continuation_ids(tokenizer, result.append, ended_with)
    if out_of_tokens or len(row.tokens) + len(new) >= row.budget_end:  # no room for one more policy token
        row.finish = BUDGET
        return
    row.pending = [row.tokens[-1], *new]
    row.tokens += new
    row.mask += [0] * len(new)
    row.logps += [0.0] * len(new)
    row.metrics.env_tokens += len(new)
    row.turn_start = len(row.tokens)


def run_multiturn(
    model: Transformer,
    tokenizer,
    envs: Sequence[Environment],
    examples: Sequence,
    params: SamplingParams,
    seed: int | Sequence[int] = 0,
) -> list[Trajectory]:
    """One trajectory per (environment, example): envs[i].reset(examples[i]), then model and environment
    turns until the environment ends it or a limit does.

    params: sampling as in generate; max_new_tokens bounds ONE model turn, stop_token_ids end a turn (pass the
    tokenizer's EOS ids), stop_strings are added to each environment's. n must be 1 (a group is G
    environments of the same example; their shared prompt is prefilled once). seed: one int, or one per
    trajectory (then a trajectory's samples do not depend on the other rows). All trajectories decode as one
    batch (no waves: max_tokens_in_flight is not applied); split a large call in the caller.
    Always the dynamic loop (engine.decode): the static decode (static_decode.py) feeds one sampled token per row
    and step and cannot yet feed a row the environment's tokens; params.cuda_graphs is only checked here.
    """
    cuda_graphs_on(params.cuda_graphs, model.device)  # `on` on a CPU fails here as it does in generate
    if len(envs) != len(examples):
        raise ValueError(f"{len(envs)} environments but {len(examples)} examples; pass one each")
    seed = as_seed(seed)
    if not isinstance(seed, int) and len(seed) != len(envs):
        raise ValueError(f"got {len(seed)} seeds for {len(envs)} trajectories: give one int, or one each")
    rows = [_start_row(env, ex, tokenizer, params) for env, ex in zip(envs, examples)]
    _validate(model, rows, params)
    for i, row in enumerate(rows):
        row.generator, row.tokenizer, row.params = i, tokenizer, params
    if rows:
        distinct: dict[tuple[int, ...], int] = {}
        share = [distinct.setdefault(tuple(r.tokens), len(distinct)) for r in rows]  # a group's prompt runs once
        with torch.inference_mode(), packed_for_decode(model, len(rows), params.max_new_tokens) as packs:
            cache, key_mask, logits = prefill(model, [list(p) for p in distinct], share, params.max_new_tokens)
            decode(model, rows, cache, key_mask, logits, Sampler(params), Draws(seed, model.device), packs,
                   eager_step(model), params.compact_fraction)
    return [Trajectory(r.tokens, r.mask, r.logps, r.reward, r.components, r.finish or DONE, r.metrics) for r in rows]
