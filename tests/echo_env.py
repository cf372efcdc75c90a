"""A tool environment that answers every turn with a tool message of `size` words ("ok " * size): trajectories
whose rows grow by row-specific lengths between turns (importable from any test: pyproject sets pytest's
pythonpath to tests/)."""

from __future__ import annotations

from dataclasses import dataclass

from grpo_engine.tasks.base import Prompt
from grpo_engine.tasks.environment import StepResult, TrajectoryLimits


@dataclass
class EchoEnv:
    """The user's question as the first prompt, then `size` words of tool output after each turn, until `limits`."""

    size: int
    limits: TrajectoryLimits = TrajectoryLimits(max_turns=3, max_tokens=120)
    tools: tuple = ()
    stop_strings: tuple = ()

    def reset(self, example):
        return Prompt([{"role": "user", "content": example.question}])

    def step(self, completion):
        return StepResult([{"role": "tool", "content": "ok " * self.size}], {"turn": 1.0}, 0.5)
