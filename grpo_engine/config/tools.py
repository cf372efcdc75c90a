"""The tools section: multi-turn rollouts in which the policy may call built-in tools (tasks/tools.py).

With `enabled` the rollout phase runs each completion as a trajectory (rollout/multiturn.py) in a
ToolEnvironment of the task: a model turn that ends in a `<tool_call>` gets the tool's result appended and
the model continues, the first turn without a call is the answer, scored by the task. The training row is the
whole trajectory after the prompt; only the tokens the policy sampled carry loss (collect/tool_groups.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from .fields import one_of, option, require

TOOL_FORMATS = ("auto", "fallback", "undeclared")
BUILTIN_TOOL_NAMES = ("calculator", "check_countdown")  # tasks/tools.py BUILTIN_TOOLS (this package has no torch)


@dataclass(frozen=True)
class ToolsSection:
    enabled: bool = option(False, "rollouts are multi-turn trajectories in which the policy may call the tools "
                                  "below (off: single-turn completions)")
    names: list[str] = option(["calculator"], "built-in tools the policy may call", BUILTIN_TOOL_NAMES)
    max_turns: int = option(4, "model turns per trajectory (each tool call costs one)")
    max_tokens: int = option(512, "tokens per trajectory after the prompt, model and tool tokens together; "
                                  "rollout.max_new_tokens still bounds one model turn")
    format: str = option("auto", "how tools reach the prompt: auto = the chat template's own tool format when "
                                 "it has one, else the fallback | fallback = a tools paragraph in the system "
                                 "message and <tool_response> user turns | undeclared = no declarations in the "
                                 "prompt (a model taught to call the tools, e.g. the demo's warm-started one)",
                         TOOL_FORMATS)
    error_penalty: float = option(0.0, "subtracted from a trajectory's reward per failed tool call (malformed, "
                                       "unknown tool, bad arguments, error); 0 = failures only cost turns")

    def __post_init__(self) -> None:
        one_of("tools.format", self.format, TOOL_FORMATS)
        for name in self.names:
            one_of("tools.names", name, BUILTIN_TOOL_NAMES, what="tool")
        require(not self.enabled or bool(self.names), "tools.enabled needs at least one name in tools.names")
        require(len(set(self.names)) == len(self.names), f"tools.names={self.names} lists a tool twice")
        require(self.max_turns >= 1, f"tools.max_turns={self.max_turns} must be >= 1")
        require(self.max_tokens >= 1, f"tools.max_tokens={self.max_tokens} must be >= 1")
        require(self.error_penalty >= 0, f"tools.error_penalty={self.error_penalty} must be >= 0")
