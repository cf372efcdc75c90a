"""Evaluate a model on a task: pass@1, pass@k, maj@k, format rate, completion length, truncation rate.

Each problem gets n samples from the generate-and-score path training uses (`collect.groups.generate_groups`:
`render_prompt` in, the guarded task reward out). Metrics per problem, then averaged over problems:

- pass@k: unbiased estimator from n samples with c correct (metrics.pass_at_k), so pass@1 = c / n.
- maj@k: 1 if the majority answer of the first k samples (clustered with task.equivalent) is correct.
- format rate: fraction of samples with full format marks (RewardResult.formatted, as in training).
- mean length: completion tokens, stop token included; truncation rate: fraction that hit max_new_tokens.
- with tools (`evaluate(..., tools=ToolsSection(enabled=True, ...))`) every sample is a multi-turn trajectory
  sampled as in training (collect.tool_groups.generate_tool_groups): its length counts the policy's own
  tokens, the tool-call rate is the fraction of samples that called a tool at least once, and the tool-error rate
  the fraction of all calls that failed (malformed, unknown tool, bad arguments, refused expression, ...).

Correctness rule, the same for every task and for training metrics (RewardResult.correct): a sample is
correct iff its RewardResult has an "answer" component >= 1.0. Every built-in task scores "answer" as 0 or 1
(correctness alone, independent of the format bonus in `total`). A custom reward_fn that returns a bare float
has no "answer" component: its samples count as incorrect, and the report says so in its notes (return a
RewardResult with components={"answer": ...}).
Temperature 0 is greedy decoding: n samples would be identical, so n is forced to 1 and only k = 1 reported.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..collect.groups import Generate, Group, generate_groups, prompt_seed
from ..config.tools import ToolsSection
from ..rollout import SamplingParams, generate
from ..tasks.base import Example, RewardResult, Task
from .metrics import maj_at_k, majority_answer, pass_at_k

ANSWER = "answer"  # the RewardResult component that correctness reads (RewardResult.correct)


@dataclass(frozen=True)
class EvalConfig:
    n: int = 8  # samples per problem
    ks: tuple[int, ...] = (1, 4, 8)  # k of pass@k and maj@k; each must be <= n
    temperature: float = 0.6  # sampling temperature; 0 = greedy (forces n = 1, k = 1)
    top_p: float = 1.0  # nucleus sampling threshold (1 = off)
    max_new_tokens: int = 512  # completion cap; completions that hit it count as truncated
    max_examples: int | None = None  # evaluate the first N examples of the split; None = all
    seed: int = 0  # sampling seed; problem i draws from its own seed derived from (seed, i) (example_seeds)
    prompts_per_batch: int = 16  # prompts per generate call: bounds memory at n * this many rows
    reward_timeout_s: float = 5.0  # per-completion reward time limit (a reward past it scores 0)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ks", tuple(sorted(set(self.ks))))
        checks = [
            (self.n >= 1, f"n={self.n} must be >= 1"),
            (bool(self.ks) and min(self.ks) >= 1, f"ks={list(self.ks)} must be a non-empty list of k >= 1"),
            (self.temperature >= 0, f"temperature={self.temperature} must be >= 0 (0 = greedy)"),
            # checked here, not first by the sampler after the model has loaded
            (0 < self.top_p <= 1, f"top_p={self.top_p} must be in (0, 1] (1 = off)"),
            (self.max_new_tokens >= 1, f"max_new_tokens={self.max_new_tokens} must be >= 1"),
            (self.max_examples is None or self.max_examples >= 1, f"max_examples={self.max_examples} must be >= 1"),
            (self.prompts_per_batch >= 1, f"prompts_per_batch={self.prompts_per_batch} must be >= 1"),
            (self.temperature == 0 or max(self.ks, default=1) <= self.n,
             f"k={max(self.ks, default=0)} needs at least that many samples but n={self.n}; raise n or drop k"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"EvalConfig: {message}")

    def resolved(self) -> tuple[EvalConfig, list[str]]:
        """The config actually run, and notes on what was changed (greedy decoding forces n = 1, k = 1)."""
        if self.temperature == 0 and (self.n != 1 or self.ks != (1,)):
            note = (f"temperature 0 is greedy decoding (every sample identical): n forced from {self.n} to 1 "
                    f"and only pass@1 / maj@1 reported (asked for k = {list(self.ks)})")
            return dataclasses.replace(self, n=1, ks=(1,)), [note]
        return self, []


@dataclass(frozen=True)
class SampleRecord:
    text: str  # decoded completion (special tokens skipped), as scored
    answer: str | None  # the answer the task extracted, None if none
    correct: bool  # RewardResult.correct: components["answer"] >= 1.0
    formatted: bool  # RewardResult.formatted: components["format"] >= 1.0
    reward: float  # RewardResult.total
    components: dict[str, float]  # RewardResult.components (unweighted scores)
    num_tokens: int  # completion tokens, stop token included
    truncated: bool  # finish_reason == "length"
    error: str | None  # "exception" / "timeout" when the reward failed (scored 0), else None
    tool_calls: int | None = None  # with tools: calls the trajectory made (well-formed or not); else None
    tool_errors: int | None = None  # with tools: of which failed


@dataclass(frozen=True)
class ProblemRecord:
    example_id: str
    question: str
    reference: str  # the example's reference answer
    samples: list[SampleRecord]  # n samples, in sampling order
    pass_at: dict[int, float]  # k -> pass@k of this problem
    maj_at: dict[int, float]  # k -> maj@k of this problem (0 or 1)
    majority: str | None  # majority answer over all n samples

    @property
    def num_correct(self) -> int:
        return sum(s.correct for s in self.samples)


@dataclass(frozen=True)
class EvalSummary:
    num_problems: int
    samples_per_problem: int
    pass_at: dict[int, float]  # k -> mean pass@k over problems
    maj_at: dict[int, float]  # k -> mean maj@k over problems
    format_rate: float  # fraction of all samples fully formatted
    mean_length: float  # mean completion tokens over all samples
    truncation_rate: float  # fraction of all samples that hit max_new_tokens
    mean_reward: float  # mean RewardResult.total over all samples
    reward_errors: int  # samples whose reward raised or timed out (scored 0, counted incorrect)
    tool_call_rate: float | None = None  # with tools: fraction of samples that called a tool at least once
    tool_errors: int | None = None  # with tools: failed calls over all samples
    tool_error_rate: float | None = None  # with tools: failed calls / calls (malformed, unknown tool, refused; 0: none)


@dataclass(frozen=True)
class EvalReport:
    task: str
    config: EvalConfig  # the config actually run (after greedy resolution)
    summary: EvalSummary
    problems: list[ProblemRecord]
    notes: list[str]  # things the reader must know (forced greedy settings, missing answer components)


# ---------------------------------------------------------------------------------------------- evaluation
def evaluate(model, tokenizer, task: Task, examples: Sequence[Example], cfg: EvalConfig, *,
             generate: Generate = generate, progress: Callable[[int, int], None] | None = None,
             tools: ToolsSection | None = None) -> EvalReport:
    """Sample cfg.n completions per example with the model, score them with the task, aggregate.

    generate: the sampler, rollout's `generate` (injectable so tests can script completions); progress(done, total)
    is called after each batch of prompts. tools: when enabled, each sample is a trajectory with those tools.
    """
    cfg, notes = cfg.resolved()
    examples = list(examples)[: cfg.max_examples]
    if not examples:
        raise ValueError("no examples to evaluate: the split is empty")
    params = SamplingParams(n=cfg.n, temperature=cfg.temperature, top_p=cfg.top_p,
                            max_new_tokens=cfg.max_new_tokens, stop_token_ids=list(tokenizer.eos_token_ids))
    problems: list[ProblemRecord] = []
    for start in range(0, len(examples), cfg.prompts_per_batch):
        batch = examples[start : start + cfg.prompts_per_batch]
        # greedy draws nothing: one int seed spares per-prompt generators their per-step draws
        seed = cfg.seed if cfg.temperature == 0 else example_seeds(cfg.seed, start, len(batch))
        if tools is not None and tools.enabled:
            from ..collect.tool_groups import generate_tool_groups

            groups, _ = generate_tool_groups(model, tokenizer, task, batch, params, seed, None,
                                             cfg.reward_timeout_s, tools=tools)
        else:
            groups, _ = generate_groups(model, tokenizer, task, batch, params, seed, None, cfg.reward_timeout_s,
                                        generate)
        problems += [score_problem(task, g, cfg) for g in groups]
        if progress is not None:
            progress(len(problems), len(examples))
    notes += _missing_answer_note(problems)
    return EvalReport(task.name, cfg, summarize(problems, cfg), problems, notes)


def example_seeds(seed: int, start: int, count: int) -> list[int]:
    """One sampling seed per problem start .. start+count-1, a pure function of (seed, problem index).

    Why per problem: with one seed per batch, a problem's samples (and so its pass@k) changed with
    --batch-prompts (a memory knob), with --max-examples and with when the other rows of its batch stopped;
    rollout.generate draws each seeded prompt from its own generator, independent of its batch.
    """
    return [prompt_seed(seed, 0, 0, start + i) for i in range(count)]


def sample_record(result: RewardResult, text: str, num_tokens: int, truncated: bool,
                  trajectory=None) -> SampleRecord:
    """One scored sample under the correctness rule of the module docstring; `trajectory`: its
    TrajectoryMetrics when it was sampled with tools (the length is then the policy's own tokens)."""
    record = SampleRecord(text=text, answer=result.answer, correct=result.correct, formatted=result.formatted,
                          reward=result.total, components=dict(result.components), num_tokens=num_tokens,
                          truncated=truncated, error=result.info.get("error"))
    if trajectory is None:
        return record
    return dataclasses.replace(record, num_tokens=trajectory.model_tokens, tool_calls=trajectory.tool_calls,
                               tool_errors=trajectory.tool_errors)


def score_problem(task: Task, group: Group, cfg: EvalConfig) -> ProblemRecord:
    """The n scored samples of one problem -> its pass@k / maj@k."""
    truncated = [r == "length" for r in group.finish_reasons]
    lengths = [len(c) for c in group.completion_ids]
    trajs = group.trajectory_metrics or [None] * len(lengths)
    samples = [sample_record(*row) for row in zip(group.rewards, group.texts, lengths, truncated, trajs)]
    answers = [s.answer for s in samples]
    equal = task.equivalent  # clustering treats an exception as 'not equivalent'
    c = sum(s.correct for s in samples)
    pass_at = {k: pass_at_k(len(samples), c, k) for k in cfg.ks}
    maj_at = {k: maj_at_k(answers, _winner_is_correct(samples[:k]), equal, k) for k in cfg.ks}
    ex = group.example
    return ProblemRecord(ex.id, ex.question, ex.answer, samples, pass_at, maj_at, majority_answer(answers, equal))


def _winner_is_correct(samples: list[SampleRecord]) -> Callable[[str], bool]:
    """maj@k's winner is the answer string of the first sample of its cluster: that sample says if it is right.

    Judging the winner by the sample's own correctness (not by comparing to the reference) keeps maj@k under
    the one correctness rule, also for tasks like Countdown whose reference is not "the" answer.
    """

    def is_correct(winner: str) -> bool:
        return next(s.correct for s in samples if s.answer == winner)

    return is_correct


def summarize(problems: list[ProblemRecord], cfg: EvalConfig) -> EvalSummary:
    samples = [s for p in problems for s in p.samples]
    return EvalSummary(
        num_problems=len(problems),
        samples_per_problem=cfg.n,
        pass_at={k: _mean([p.pass_at[k] for p in problems]) for k in cfg.ks},
        maj_at={k: _mean([p.maj_at[k] for p in problems]) for k in cfg.ks},
        format_rate=_mean([float(s.formatted) for s in samples]),
        mean_length=_mean([float(s.num_tokens) for s in samples]),
        truncation_rate=_mean([float(s.truncated) for s in samples]),
        mean_reward=_mean([s.reward for s in samples]),
        reward_errors=sum(s.error is not None for s in samples),
        **_tool_summary(samples),
    )


def _tool_summary(samples: list[SampleRecord]) -> dict:
    """tool_call_rate / tool_errors / tool_error_rate when the samples were trajectories with tools, else nothing."""
    if not samples or samples[0].tool_calls is None:
        return {}
    calls, errors = sum(s.tool_calls for s in samples), sum(s.tool_errors for s in samples)
    return {"tool_call_rate": _mean([float(s.tool_calls > 0) for s in samples]), "tool_errors": errors,
            "tool_error_rate": errors / calls if calls else 0.0}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _missing_answer_note(problems: list[ProblemRecord]) -> list[str]:
    """Say so when rewards ran but gave no "answer" component: accuracy would otherwise read as a silent 0."""
    # a failed reward has empty components too, but it is counted in reward_errors instead
    missing = sum(1 for p in problems for s in p.samples if s.error is None and ANSWER not in s.components)
    if not missing:
        return []
    return [f"{missing} sample(s) got a reward without an '{ANSWER}' component and count as incorrect; a custom "
            f"reward_fn should return RewardResult(total, {{'{ANSWER}': 0 or 1, ...}}, answer) for accuracy"]


# ------------------------------------------------------------------------------------------------- reports
def report_json(report: EvalReport) -> dict:
    """Plain JSON-ready dict: flat summary keys ("pass@1", "maj@4", ...) for jq, then every problem's samples."""
    s = report.summary
    config = dataclasses.asdict(report.config)
    config["ks"] = list(report.config.ks)
    summary = {"num_problems": s.num_problems, "samples_per_problem": s.samples_per_problem}
    summary |= {f"pass@{k}": v for k, v in s.pass_at.items()} | {f"maj@{k}": v for k, v in s.maj_at.items()}
    summary |= {"format_rate": s.format_rate, "mean_length": s.mean_length, "truncation_rate": s.truncation_rate,
                "mean_reward": s.mean_reward, "reward_errors": s.reward_errors}
    if s.tool_call_rate is not None:
        summary |= {"tool_call_rate": s.tool_call_rate, "tool_errors": s.tool_errors,
                    "tool_error_rate": s.tool_error_rate}
    problems = [
        {"id": p.example_id, "question": p.question, "reference": p.reference, "num_correct": p.num_correct,
         "majority": p.majority, **{f"pass@{k}": v for k, v in p.pass_at.items()},
         **{f"maj@{k}": v for k, v in p.maj_at.items()}, "samples": [dataclasses.asdict(x) for x in p.samples]}
        for p in report.problems
    ]
    return {"task": report.task, "config": config, "summary": summary, "notes": list(report.notes),
            "problems": problems}


def report_markdown(report: EvalReport) -> str:
    """One-row Markdown table of the summary (rates in %), followed by the notes as quoted lines."""
    s = report.summary
    columns = ["task", "problems", "n"] + [f"pass@{k}" for k in s.pass_at] + [f"maj@{k}" for k in s.maj_at]
    columns += ["format", "mean length", "truncated", "mean reward"]
    values = [report.task, str(s.num_problems), str(s.samples_per_problem)]
    values += [_pct(v) for v in s.pass_at.values()] + [_pct(v) for v in s.maj_at.values()]
    values += [_pct(s.format_rate), f"{s.mean_length:.1f}", _pct(s.truncation_rate), f"{s.mean_reward:.3f}"]
    if s.tool_call_rate is not None:
        columns += ["tool calls", "tool errors"]
        values += [_pct(s.tool_call_rate), f"{s.tool_errors} ({_pct(s.tool_error_rate)} of calls)"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|",
             "| " + " | ".join(values) + " |"]
    if s.reward_errors:
        lines.append(f"\n> {s.reward_errors} reward(s) raised or timed out (scored 0, counted incorrect)")
    lines += [f"\n> note: {note}" for note in report.notes]
    return "\n".join(lines) + "\n"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"
