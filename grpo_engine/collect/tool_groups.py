"""Rollouts with tools: each of a prompt's G completions is a multi-turn trajectory (rollout/multiturn.py) in
a ToolEnvironment of the task, handed to the rest of the step as an ordinary `Group`.

Why a trajectory fits a Group row unchanged: the row is prompt + "completion", and the completion here is
everything after the first prompt -- model turns, tool results, turn markers -- exactly the tokens the policy
saw, never re-tokenized. What differs is who wrote each token, so the Group carries a per-token loss mask
(1: sampled by the policy, 0: appended by the environment) and the batch builder multiplies it into the
completion mask (train/batch.py): tool tokens are context for the training forward, never targets. The
sampler's log-probs are 0.0 on them and the real values on model tokens, so the mismatch metrics compare the
same tokens the loss sees.

`generate_tool_groups` with its `tools` bound is a GroupSampler (collect/groups.py), as generate_groups is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from ..config.tools import ToolsSection
from ..rollout import SamplingParams
from ..rollout.chat_turns import render_first_prompt
from ..rollout.engine import as_seed
from ..rollout.multiturn import BUDGET, MAX_TURNS, TURN_LENGTH, Trajectory, run_multiturn
from ..tasks.base import Example, RewardResult
from ..tasks.environment import ToolEnvironment, TrajectoryLimits
from ..tasks.tools import BUILTIN_TOOLS, ToolSet
from .groups import REWARD_TIMEOUT_S, Group

# finish reasons in generate's words: a trajectory cut by its token budget, or ended by the environment after a
# turn cut at max_new_tokens, counts as truncated ("length")
FINISH = {BUDGET: "length", TURN_LENGTH: "length", MAX_TURNS: "max_turns"}


class _FallbackTemplate:
    """A tokenizer seen as one whose chat template has no tool support (tools.format=fallback): chat_turns then
    declares the tools in the system message and renders results as <tool_response> user turns."""

    chat_template_source = ""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def rollout_tokenizer(tokenizer, tools: ToolsSection):
    """The tokenizer as the rollout renders with it: tools.format=fallback hides the template's own tool support."""
    return _FallbackTemplate(tokenizer) if tools.format == "fallback" else tokenizer


def first_prompt_text(tokenizer, task, example: Example, tools: ToolsSection) -> str:
    """The first prompt of a trajectory with these tools, exactly as the rollout renders it (the declarations in
    the model's own format, none with tools.format=undeclared): what a supervised warm start conditions on."""
    env = tool_environments(task, tools, 1, REWARD_TIMEOUT_S)[0]
    prompt = env.reset(example)
    return render_first_prompt(rollout_tokenizer(tokenizer, tools), prompt.messages, prompt.prefill, env.tools or None)


def tool_environments(task, tools: ToolsSection, count: int, reward_timeout_s: float) -> list[ToolEnvironment]:
    """`count` fresh environments (one per trajectory: an environment holds one trajectory's state)."""
    toolset = ToolSet([BUILTIN_TOOLS[name] for name in tools.names])
    limits = TrajectoryLimits(max_turns=tools.max_turns, max_tokens=tools.max_tokens)
    envs = [ToolEnvironment(task, toolset, limits, tool_error_penalty=tools.error_penalty,
                            reward_timeout_s=reward_timeout_s) for _ in range(count)]
    if tools.format == "undeclared":
        for env in envs:
            env.tools = []
    return envs


def trajectory_seeds(seed: int | Sequence[int], num_examples: int, group_size: int) -> int | list[int]:
    """One seed per trajectory from generate's per-example seeds (the G of a prompt differ); an int stays."""
    seed = as_seed(seed)
    if isinstance(seed, int):
        return seed
    return [(s * 1_000_003 + j) % 2**63 for s in seed for j in range(group_size)]


def trajectory_reward(traj: Trajectory, env: ToolEnvironment) -> RewardResult:
    """The trajectory's summed reward as a RewardResult; answer and info from the turn the task scored (none
    when the trajectory ran out of turns or tokens before answering)."""
    scored = env.scored
    answer, info = (scored.answer, dict(scored.info)) if scored is not None else (None, {})
    return RewardResult(traj.reward, dict(traj.reward_components), answer, info)


def _group(example: Example, trajs: list[Trajectory], envs: list[ToolEnvironment], tokenizer) -> Group:
    """G trajectories of one prompt -> a Group whose completions are the tokens after the first prompt."""
    n = trajs[0].metrics.prompt_tokens
    prompt_ids = trajs[0].token_ids[:n]
    completions = [t.token_ids[n:] for t in trajs]  # G x [N_i - n]: model and tool tokens
    return Group(
        example, tokenizer.decode(prompt_ids), prompt_ids, completions, [t.logprobs[n:] for t in trajs],
        [FINISH.get(t.finish_reason, "stop") for t in trajs],
        [tokenizer.decode(c) for c in completions],  # the whole conversation, turn markers included
        [trajectory_reward(t, e) for t, e in zip(trajs, envs)],
        loss_masks=[t.loss_mask[n:] for t in trajs], trajectory_metrics=[t.metrics for t in trajs],
    )


def generate_tool_groups(model, tokenizer, task, examples: list[Example], params: SamplingParams,
                         seed: int | list[int], max_prompt_tokens: int | None,
                         reward_timeout_s: float | None = None, *, tools: ToolsSection) -> tuple[list[Group], int]:
    """params.n trajectories per example with the configured tools, scored. Returns (groups, policy tokens).

    seed: one int for the call, or one per example (as generate_groups)."""
    G = params.n
    timeout = REWARD_TIMEOUT_S if reward_timeout_s is None else reward_timeout_s
    tok = rollout_tokenizer(tokenizer, tools)
    envs = tool_environments(task, tools, len(examples) * G, timeout)
    rows = [ex for ex in examples for _ in range(G)]
    if max_prompt_tokens is not None:
        for ex, env in zip(examples, envs[::G]):
            prompt = env.reset(ex)
            n = len(tok.encode(render_first_prompt(tok, prompt.messages, prompt.prefill, env.tools or None)))
            if n > max_prompt_tokens:
                raise ValueError(f"prompt of example {ex.id} has {n} tokens (tool declarations included) > "
                                 f"rollout.max_prompt_tokens={max_prompt_tokens}; raise it or shorten the prompt")
    was_training = model.training
    model.eval()  # no dropout while sampling: the sampler's log-probs must match the policy
    try:
        trajs = run_multiturn(model, tok, envs, rows, replace(params, n=1), trajectory_seeds(seed, len(examples), G))
    finally:
        model.train(was_training)
    groups = [_group(ex, trajs[p * G : (p + 1) * G], envs[p * G : (p + 1) * G], tokenizer)
              for p, ex in enumerate(examples)]
    return groups, sum(t.metrics.model_tokens for t in trajs)
