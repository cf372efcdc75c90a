"""Evaluation during training: the policy on a fixed subset of the task's eval split, every `eval.every` steps.

What counts as correct (the same rule for `accuracy` of the training completions and `eval/accuracy`):
every built-in task scores a completion with a `RewardResult` whose `components["answer"]` is the 0/1
answer check (countdown: the equation uses the numbers and hits the target; arithmetic / gsm8k / math /
custom verifiers: the extracted answer equals the reference). A completion is correct when that component
is 1.0 -- full marks -- independently of the format component or the weights of the total. A task whose
rewards have no "answer" component (a custom `reward_fn` returning a float) has no notion of correctness:
its accuracy is NaN (null in metrics.jsonl), never a guess from the total.

`format_rate` likewise is the fraction whose "format" component is 1.0 (the format fully satisfied).
The standalone `grpo eval` command (pass@k, maj@k, ...) lives in grpo_engine/eval/; this is the small
in-loop probe.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace

from ..collect.groups import GroupSampler, generate_groups
from ..rollout import SamplingParams
from ..rollout.static_decode import transient_static_decode
from ..tasks.base import Example, RewardResult


def accuracy(results: list[RewardResult]) -> float:
    """Fraction with answer component 1.0 (a reward that crashed has no components: incorrect); NaN when
    no result has an "answer" component (see module docstring)."""
    if not any("answer" in r.components for r in results):
        return math.nan
    return statistics.fmean(r.correct for r in results)


def format_rate(results: list[RewardResult]) -> float:
    """Fraction whose "format" component is 1.0; NaN when the task has no format component."""
    if not any("format" in r.components for r in results):
        return math.nan
    return statistics.fmean(r.formatted for r in results)


@dataclass
class EvalResult:
    accuracy: float  # fraction correct (NaN if the task defines no answer component)
    format_rate: float  # fraction with full format marks
    length_mean: float  # mean completion length in tokens
    truncation_rate: float  # fraction cut at max_new_tokens
    num_examples: int
    tool_call_rate: float | None = None  # with tools: fraction of trajectories that called a tool
    tool_error_rate: float | None = None  # with tools: failed calls / calls (0 when there were none)
    tool_calls: int = 0  # with tools: calls over all trajectories (combine_eval weighs the error rate by it)

    def as_metrics(self) -> dict[str, float]:
        """Keys as they appear in metrics.jsonl (eval/accuracy, ...; eval/tool_call_rate and eval/tool_error_rate
        when the run samples with tools)."""
        tools = {} if self.tool_call_rate is None else {"eval/tool_call_rate": self.tool_call_rate,
                                                        "eval/tool_error_rate": self.tool_error_rate}
        return {"eval/accuracy": self.accuracy, "eval/format_rate": self.format_rate,
                "eval/length_mean": self.length_mean, "eval/truncation_rate": self.truncation_rate, **tools}


def evaluate_policy(model, tokenizer, task, examples: list[Example], params: SamplingParams, *, seed: int,
                    max_prompt_tokens: int, sample_groups: GroupSampler = generate_groups) -> EvalResult:
    """One completion per example (params.n is forced to 1), scored by the task's guarded reward.
    sample_groups: the GroupSampler training uses (generate_groups; a run with tools passes its multi-turn
    collect.tool_groups.generate_tool_groups, so the probe samples with the tools the policy trains with).
    Its calls decode under transient_static_decode: a static state larger than the rollout's is freed afterwards,
    and the rollout's stays as it was."""
    if not examples:
        raise ValueError("evaluation got no examples: the task's eval split is empty")
    with transient_static_decode():
        groups, _ = sample_groups(model, tokenizer, task, examples, replace(params, n=1), seed, max_prompt_tokens)
    results = [g.rewards[0] for g in groups]
    lengths = [len(g.completion_ids[0]) for g in groups]
    return EvalResult(
        accuracy=accuracy(results),
        format_rate=format_rate(results),
        length_mean=statistics.fmean(lengths),
        truncation_rate=statistics.fmean(g.finish_reasons[0] == "length" for g in groups),
        num_examples=len(groups),
        **tool_rates([g.trajectory_metrics[0] for g in groups if g.trajectory_metrics]),
    )


def tool_rates(trajectories: list) -> dict:
    """tool_call_rate / tool_error_rate / tool_calls of trajectories' TrajectoryMetrics ({} for none: no tools)."""
    if not trajectories:
        return {}
    calls, errors = sum(t.tool_calls for t in trajectories), sum(t.tool_errors for t in trajectories)
    return {"tool_call_rate": statistics.fmean(t.tool_calls > 0 for t in trajectories),
            "tool_error_rate": errors / calls if calls else 0.0, "tool_calls": calls}


def combine_eval(parts: list[EvalResult]) -> EvalResult:
    """Results of disjoint example subsets (one per rank) as one result over all of them."""
    if len(parts) == 1:
        return parts[0]
    n = sum(p.num_examples for p in parts)

    def mean(field: str) -> float:
        values = [(getattr(p, field), p.num_examples) for p in parts if not math.isnan(getattr(p, field))]
        return sum(v * k for v, k in values) / sum(k for _, k in values) if values else math.nan

    tools = {}
    if parts[0].tool_call_rate is not None:
        calls = sum(p.tool_calls for p in parts)
        errors = sum(p.tool_error_rate * p.tool_calls for p in parts)
        tools = {"tool_call_rate": mean("tool_call_rate"), "tool_error_rate": errors / calls if calls else 0.0,
                 "tool_calls": calls}
    return EvalResult(mean("accuracy"), mean("format_rate"), mean("length_mean"), mean("truncation_rate"), n,
                      **tools)
