"""The environment protocol of multi-turn rollouts, and the two environments built on a Task.

An environment holds ONE trajectory's state: `reset(example)` gives the first messages (a `Prompt`:
messages plus prefill), and after each model turn `step(text)` answers with the messages to append (tool
results, a user reply) or None when the trajectory is over, plus that turn's reward. The sampler
(rollout/multiturn.py) owns the tokens: it enforces `limits` (turns, and tokens after the first prompt),
renders the appended messages and prefills only their tokens. A turn cut off by a limit is still passed to
`step` (so the reward sees it); what `step` wants to append is then dropped. A trajectory's reward is the
sum of its steps' `reward`, and its components are summed key by key.

* `TaskEnvironment`: any single-turn Task as a one-turn environment (the degenerate case): the one step
  scores the completion through `safe_reward` and ends the trajectory;
* `ToolEnvironment`: a Task plus tools: a turn with tool calls gets their results appended (errors
  included, so the model can retry), a turn without tool calls is the final answer, scored like the task.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from .base import Example, Prompt, RewardResult, Task, safe_reward
from .tools import CLOSE, MAX_CALLS_PER_TURN, ToolSet, parse_tool_calls

Message = dict[str, Any]  # {"role": ..., "content": ...}; "name" on tool results


@dataclass(frozen=True)
class TrajectoryLimits:
    """Bounds of one trajectory: model turns, and tokens after the first prompt (model + appended)."""

    max_turns: int = 4
    max_tokens: int = 1024

    def __post_init__(self) -> None:
        if self.max_turns < 1 or self.max_tokens < 1:
            raise ValueError(f"TrajectoryLimits: max_turns={self.max_turns} and max_tokens={self.max_tokens} "
                             "must be >= 1")


@dataclass(frozen=True)
class StepResult:
    """An environment's answer to one model turn."""

    append: list[Message] | None  # messages to add before the next model turn; None: the trajectory is over
    reward_components: dict[str, float] = field(default_factory=dict)  # for logging; summed over turns
    reward: float = 0.0  # this turn's contribution to the trajectory's reward
    tool_calls: int = 0  # calls attempted this turn (well-formed or not)
    tool_errors: int = 0  # of which failed: malformed, unknown tool, bad arguments, raised, timed out
    info: dict[str, str] = field(default_factory=dict)  # diagnostics (e.g. the task reward's reason)


@runtime_checkable
class Environment(Protocol):
    limits: TrajectoryLimits
    tools: list[dict[str, Any]]  # tool declarations for the first prompt (empty: none)
    stop_strings: list[str]  # a model turn also ends after one of these (e.g. "</tool_call>")

    def reset(self, example: Example) -> Prompt: ...

    def step(self, completion: str) -> StepResult: ...


class TaskEnvironment:
    """A single-turn Task as a one-turn environment: the reward comes with the only step."""

    tools: list[dict[str, Any]] = []
    stop_strings: list[str] = []

    def __init__(self, task: Task, max_tokens: int = 1024, reward_timeout_s: float = 5.0):
        self.task, self.reward_timeout_s = task, reward_timeout_s
        self.limits = TrajectoryLimits(max_turns=1, max_tokens=max_tokens)
        self.example: Example | None = None
        self.scored: RewardResult | None = None  # the task's reward of the answer turn (its answer, info)

    def reset(self, example: Example) -> Prompt:
        self.example, self.scored = example, None
        return self.task.prompt(example)

    def step(self, completion: str) -> StepResult:
        if self.example is None:
            raise RuntimeError("step() before reset()")
        result = safe_reward(self.task, self.example, completion, self.reward_timeout_s)
        self.scored = result
        return StepResult(None, dict(result.components), result.total, info=dict(result.info))


class ToolEnvironment(TaskEnvironment):
    """A Task with tools. Each turn's <tool_call> blocks run (bounded, see tasks/tools.py) and their results
    come back as tool messages; the first turn without a call is the answer, scored by the task. A turn
    that ran out of turns or tokens ends the trajectory with whatever it earned (no answer: 0).

    tool_error_penalty: subtracted from the reward per failed call (0 = failures only cost turns/tokens).
    A task may define `tool_variables(example) -> dict`: the problem's named values, which tools that take
    `variables` (the calculator) may use.
    """

    def __init__(self, task: Task, tools: ToolSet, limits: TrajectoryLimits = TrajectoryLimits(),
                 tool_error_penalty: float = 0.0, max_calls: int = MAX_CALLS_PER_TURN,
                 reward_timeout_s: float = 5.0):
        super().__init__(task, limits.max_tokens, reward_timeout_s)
        self.limits, self.toolset = limits, tools
        self.tools = tools.declarations()
        self.stop_strings = [CLOSE]
        self.tool_error_penalty, self.max_calls = tool_error_penalty, max_calls
        self.variables: dict[str, Any] = {}

    def reset(self, example: Example) -> Prompt:
        """Also takes the problem's named values for the tools (a task's optional `tool_variables`)."""
        named = getattr(self.task, "tool_variables", None)
        self.variables = dict(named(example)) if named is not None else {}
        return super().reset(example)

    def step(self, completion: str) -> StepResult:
        parsed = parse_tool_calls(completion, self.max_calls)
        if not parsed.found:
            return super().step(completion)
        messages: list[Message] = []
        errors = 0
        for block in parsed.blocks:  # one result per block, in the order the calls were written
            if isinstance(block, str):
                messages.append({"role": "tool", "name": "error", "content": f"Error: {block}"})
                errors += 1
            else:
                r = self.toolset.run(block, self.variables)
                messages.append({"role": "tool", "name": r.name, "content": r.content})
                errors += r.error is not None
        return StepResult(messages, {"tool_errors": float(errors)}, -self.tool_error_penalty * errors,
                          tool_calls=len(parsed.blocks), tool_errors=errors)
