"""The one row type of every decode loop, and its validation: a row is a conversation that alternates model turns
and, when it has an environment, environment turns (tool results, replies), token-exact.

A single-turn completion (generate) is a row without an environment: it ends after its one model turn, at a stop
token or stop string ("stop") or at max_new_tokens ("length"). A multi-turn trajectory (run_multiturn) hands each
turn's text to its environment, which ends it ("done", "turn_length" for a last turn cut short) or appends messages
whose tokens the row queues to feed ("max_turns" and "budget" end it too). The one decode loop
(static_decode.decode_static) runs both kinds: it only feeds `pending` (static_turns.py), calls `take` with each
sampled token and reads `finished` / `steps_left`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..model.transformer import Transformer
from .chat_turns import continuation_ids
from .sampling import SamplingParams
from .stop_strings import StopStrings

if TYPE_CHECKING:  # the protocol lives with the tasks; a row only calls step and reads limits
    from ..tasks.environment import Environment

STOP, LENGTH = "stop", "length"  # a single-turn row's finish reasons
DONE, MAX_TURNS, BUDGET, TURN_LENGTH = "done", "max_turns", "budget", "turn_length"  # a trajectory's


@dataclass
class TrajectoryMetrics:
    turns: int = 0  # model turns
    tool_calls: int = 0
    tool_errors: int = 0
    prompt_tokens: int = 0  # the first prompt
    model_tokens: int = 0  # sampled by the policy (loss_mask == 1)
    env_tokens: int = 0  # appended by the environment after the first prompt (tool results, turn markers)


@dataclass
class Row:
    """One sequence in flight. tokens, mask, logps and filtered_logps are aligned: [N] each (prompt first)."""

    generator: int  # which per-prompt (per-trajectory) generator draws its tokens (engine.Draws.table)
    source: int  # its first prompt's index among the call's distinct prompts: rows of one source share a prefill
    tokens: list[int]  # [N] the first prompt, then every model and environment turn
    stops: StopStrings
    params: SamplingParams  # stop_token_ids end a turn, max_new_tokens bounds one
    budget_end: int  # len(tokens) may not pass this
    env: Environment | None = None  # None: the row ends after one model turn
    tokenizer: object = None  # decodes a turn's text for the environment
    mask: list[int] = field(init=False)  # 1 on tokens the policy sampled, 0 elsewhere
    logps: list[float] = field(init=False)  # the sampler's full-softmax log-prob, 0.0 off policy tokens
    filtered_logps: list[float] = field(init=False)  # under the top-k / top-p / min-p filtered one
    prompt_len: int = field(init=False)
    turn_start: int = field(init=False)  # index in tokens of the current model turn's first token
    pending: list[int] = field(default_factory=list)  # tokens to feed at the next step
    reward: float = 0.0
    components: dict[str, float] = field(default_factory=dict)
    finish: str | None = None
    metrics: TrajectoryMetrics = field(default_factory=TrajectoryMetrics)

    def __post_init__(self) -> None:
        n = self.prompt_len = self.turn_start = len(self.tokens)
        self.mask, self.logps, self.filtered_logps = [0] * n, [0.0] * n, [0.0] * n
        self.metrics.prompt_tokens = self.prompt_len

    @property
    def finished(self) -> bool:
        return self.finish is not None

    def take(self, token: int, logp: float, filtered_logp: float) -> None:
        """Record one sampled token; end the turn when a stop, the turn length or the budget says so."""
        self.tokens.append(token)
        self.mask.append(1)
        self.logps.append(logp)
        self.filtered_logps.append(filtered_logp)
        self.metrics.model_tokens += 1
        out_of_tokens = len(self.tokens) >= self.budget_end
        if token in self.params.stop_token_ids:
            self.end_turn(token, out_of_tokens, cut=False)
        elif (stopped := self.stopped()) or len(self.tokens) - self.turn_start >= self.params.max_new_tokens \
                or out_of_tokens:
            self.end_turn(None, out_of_tokens, cut=not stopped)
        else:
            self.pending = [token]

    def stopped(self) -> bool:
        """Whether the last token completes a stop string of this turn (the tail a stop string spans, decoded)."""
        return bool(self.stops.strings) and self.stops(self.tokens[max(self.turn_start, len(self.tokens)
                                                                       - self.stops.window) :])

    def steps_left(self) -> int:
        """Decode steps it may still take (a bound): the packed weights' horizon when the batch steps down. A
        trajectory's next turn may take max_new_tokens whatever this one took."""
        return self.params.max_new_tokens if self.env is not None else self.budget_end - len(self.tokens)

    def end_turn(self, ended_with: int | None, out_of_tokens: bool, cut: bool) -> None:
        """Finish the row, or pass the turn's text to the environment and queue the tokens it appends.
        cut: the turn ran out of tokens (max_new_tokens or the budget) instead of ending with a stop token or string."""
        self.metrics.turns += 1
        if self.env is None:
            self.finish = LENGTH if cut else STOP
            return
        result = self.env.step(self.tokenizer.decode(self.tokens[self.turn_start :], skip_special_tokens=True))
        self.reward += result.reward
        for key, value in result.reward_components.items():
            self.components[key] = self.components.get(key, 0.0) + value
        self.metrics.tool_calls += result.tool_calls
        self.metrics.tool_errors += result.tool_errors
        if result.append is None:  # a last turn cut short is a truncated answer, as in single-turn generate
            self.finish = (BUDGET if out_of_tokens else TURN_LENGTH) if cut else DONE
        elif self.metrics.turns >= self.env.limits.max_turns:
            self.finish = MAX_TURNS
        else:
            self.append_env_turn(continuation_ids(self.tokenizer, result.append, ended_with), out_of_tokens)

    def append_env_turn(self, new: list[int], out_of_tokens: bool) -> None:
        if out_of_tokens or len(self.tokens) + len(new) >= self.budget_end:  # no room for one more policy token
            self.finish = BUDGET
            return
        self.pending = [self.tokens[-1], *new]
        self.tokens += new
        self.mask += [0] * len(new)
        self.logps += [0.0] * len(new)
        self.filtered_logps += [0.0] * len(new)
        self.metrics.env_tokens += len(new)
        self.turn_start = len(self.tokens)


def validate_rows(model: Transformer, rows: list[Row], params: SamplingParams, tokenizer) -> None:
    """Every row's first prompt against the model: one clear line naming the prompt and the fix."""
    cfg = model.config
    if params.stop_strings and tokenizer is None:
        raise ValueError("stop_strings need a tokenizer to decode completions: pass generate(..., tokenizer=tok)")
    checked: set[int] = set()  # sources whose prompt passed: a group's G rows share one
    for row in rows:
        what, n = _name(row), row.prompt_len
        if row.source not in checked:
            _check_prompt(cfg, row.tokens[:n], what)
            checked.add(row.source)
        if row.budget_end > cfg.max_position_embeddings:
            limit = "max_new_tokens" if row.env is None else "the environment's max_tokens"
            raise ValueError(f"{what} ({n} tokens) + {limit}={row.budget_end - n} exceeds the model's "
                             f"max_position_embeddings={cfg.max_position_embeddings}; lower {limit} or shorten it")


def _check_prompt(cfg, prompt: list[int], what: str) -> None:
    if not prompt:
        raise ValueError(f"{what} is empty; every prompt needs at least one token (e.g. a BOS)")
    if min(prompt) < 0 or max(prompt) >= cfg.vocab_size:
        raise ValueError(f"{what} has token ids outside [0, vocab_size={cfg.vocab_size})")
    if len(prompt) > cfg.max_position_embeddings:
        raise ValueError(f"{what} has {len(prompt)} tokens, longer than the model's max_position_embeddings="
                         f"{cfg.max_position_embeddings}; truncate the prompt")


def _name(row: Row) -> str:
    return f"prompt {row.generator}" if row.env is None else f"trajectory {row.generator}: the first prompt"
