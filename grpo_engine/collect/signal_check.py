"""The signal check before training: a few groups sampled with the run's own settings, and a verdict on whether
GRPO has anything to learn from them.

GRPO learns only from groups whose rewards differ (the advantages of an all-equal group are zero). A run whose
groups are all equal updates nothing, step after step, and the console shows only `reward 0.000`; the cause is
usually a setting, not the algorithm: replies cut at `rollout.max_new_tokens`, answers the extractor cannot find
(the instruction or the extractor cascade), data the model always gets right, or a reward that is constant. This
module samples `check.groups` prompts of the training split, each with `rollout.group_size` completions at the
rollout's temperature, length cap, chat template and tools, and reports what a person needs to tell these
apart: the reward distribution, the share of groups with any spread, the truncation rate, the rate at which the
extractor finds an answer and the rate of correct answers. `verdict` turns those figures into a verdict that
names the likely cause and the setting that fixes it (a pure function, tested on synthetic figures).

The check must not change the run it precedes: it draws its prompts with its own seeded generator (never from the
prompt stream), samples with seeds of its own (the sampler's generators are local), and `rng_untouched` puts the
process's global random states back, so a run with the check is bit-identical to one without.

Cost: `check.groups` (16 by default) prompts x G completions, sampled `rollout.prompts_per_step` prompts at a time
(the memory of one rollout round): about two steps' generation, without any update. check.fit_length and
check.fit_group_size sample again at each setting they try (RolloutFit holds every check and what was chosen).
"""

from __future__ import annotations

import contextlib
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from ..rl.advantages import zero_variance_groups
from ..rollout import SamplingParams
from ..tasks.base import Example
from .groups import Group, GroupSampler, generate_groups, prompt_seed

TRUNCATION_CAUSE = 0.25  # replies cut at max_new_tokens: a share this high is named as the cause
EXTRACTION_CAUSE = 0.5  # answers found by the extractor: a rate below this is named as the cause
ERROR_CAUSE = 0.5  # failed rewards (exception, timeout, non-finite): a share this high is named as the cause
MIN_SPREAD_GROUPS = 2  # one group with a spread among many is noise (one lucky reply), not a signal to train on
FIT_TRUNCATION = 0.10  # check.fit_length doubles rollout.max_new_tokens while at least this share of replies is cut
MIN_FIT_GROUPS = 4  # check.fit_group_size grows half the groups of the check before, and no fewer than this


class SignalCheckError(ValueError):
    """`grpo train` stopped before step 1: the check found no or too little learning signal (exit 2, one line)."""


@contextlib.contextmanager
def rng_untouched():
    """Every global random state (Python, NumPy, torch CPU and CUDA) as it was on entry, whatever the block draws."""
    py, npy, cpu = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


@dataclass
class SignalStats:
    """What the sampled groups say about the learning signal (rates are fractions of all completions)."""

    groups: int  # prompts sampled
    group_size: int  # completions per prompt
    rewards: list[float]  # every completion's total reward
    spread_share: float  # groups whose rewards differ: the only ones GRPO learns from
    truncation_rate: float  # replies cut at max_new_tokens
    extracted_rate: float | None  # replies in which the extractor found an answer; None: the task reports none
    accuracy: float | None  # correct replies; None: the task has no notion of correctness (a bare reward_fn)
    all_correct_share: float = 0.0  # groups whose every reply is correct
    correct_spread_share: float = 0.0  # groups whose replies differ in correctness
    error_rate: float = 0.0  # rewards that failed (exception, timeout, non-finite)
    first_error: str | None = None  # the first failed reward's message
    max_new_tokens: int = 0  # the length cap the replies were sampled with
    finished_extracted_rate: float | None = None  # of the replies not cut off, those with an answer found; None:
    # every reply was cut, or the task reports none
    seconds: float = 0.0
    spread_before: float = 0.0  # grow_groups: the spread share of the same prompts at the group size before

    def distribution(self, most: int = 4) -> str:
        """The reward values as 'value xcount', most common first, e.g. '0 x120, 1 x8'."""
        counts = Counter(round(r, 4) for r in self.rewards).most_common()
        shown = ", ".join(f"{v:g} x{n}" for v, n in counts[:most])
        return shown + (f", {len(counts) - most} more values" if len(counts) > most else "")


@dataclass
class Verdict:
    """The check's conclusion: `level` ok (signal), weak (too little), or none (no group has any spread)."""

    level: str
    cause: str | None = None  # the likely cause when the signal is weak or absent
    fix: str | None = None  # the setting that fixes it
    notes: list[str] = field(default_factory=list)  # worth knowing even when the signal is there

    @property
    def ok(self) -> bool:
        return self.level == "ok"

    def line(self) -> str:
        """One line: what was found and what to change."""
        if self.ok:
            return "signal check: learning signal present" + "".join(f"; note: {n}" for n in self.notes)
        what = "no learning signal" if self.level == "none" else "too little learning signal"
        return f"signal check: {what}: {self.cause}: {self.fix}"


def signal_stats(groups: list[Group], max_new_tokens: int, tol: float = 0.0, seconds: float = 0.0) -> SignalStats:
    """The figures of `groups` (each with the same number of completions)."""
    results = [r for g in groups for r in g.rewards]
    totals = torch.tensor([g.totals for g in groups], dtype=torch.float64)  # [P, G]
    graded = any("answer" in r.components for r in results)
    correct = torch.tensor([[float(r.correct) for r in g.rewards] for g in groups], dtype=torch.float64)  # [P, G]
    errors = [r.info for r in results if "error" in r.info]
    finished = [r for g in groups for r, f in zip(g.rewards, g.finish_reasons) if f != "length"]
    return SignalStats(
        groups=len(groups), group_size=len(groups[0].rewards), rewards=[r.total for r in results],
        spread_share=float((~zero_variance_groups(totals, tol)).double().mean()),
        truncation_rate=statistics.fmean(f == "length" for g in groups for f in g.finish_reasons),
        extracted_rate=statistics.fmean(r.answer is not None for r in results) if graded else None,
        accuracy=float(correct.mean()) if graded else None,
        all_correct_share=float((correct.amin(1) >= 1.0).double().mean()) if graded else 0.0,
        correct_spread_share=float((~zero_variance_groups(correct)).double().mean()) if graded else 0.0,
        error_rate=len(errors) / len(results), first_error=errors[0].get("message") if errors else None,
        max_new_tokens=max_new_tokens, seconds=seconds,
        finished_extracted_rate=statistics.fmean(r.answer is not None for r in finished) if graded and finished
        else None)


def verdict(s: SignalStats, min_spread: float = 0.05) -> Verdict:
    """The verdict on `s`: ok when at least `min_spread` of the groups, and at least MIN_SPREAD_GROUPS of them
    (or every group, if fewer were sampled), have a reward spread, else weak (some spread) or none, with the first
    cause that fits, in the order the evidence points: rewards that fail, a reward that ignores the reply (it
    scores replies the same that differ in correctness, or gives a cut or answerless reply a positive score),
    replies cut at the length cap, answers the extractor cannot find, groups all correct, replies never correct,
    right (or wrong) replies too rare for the group size, a reward that is constant."""
    notes = []
    if s.truncation_rate >= TRUNCATION_CAUSE:
        notes.append(f"{s.truncation_rate:.0%} of replies cut at rollout.max_new_tokens={s.max_new_tokens}")
    spread_groups = round(s.spread_share * s.groups)
    if s.spread_share >= min_spread and spread_groups >= min(MIN_SPREAD_GROUPS, s.groups) and s.spread_share > 0:
        return Verdict("ok", notes=notes)
    level = "none" if s.spread_share == 0 else "weak"
    cause, fix = likely_cause(s)
    return Verdict(level, cause, fix, notes)


def likely_cause(s: SignalStats) -> tuple[str, str]:
    """(cause, fix) of a missing or tiny signal: verdict's ordered list of causes."""
    if s.error_rate >= ERROR_CAUSE:
        return (f"{s.error_rate:.0%} of rewards failed ({s.first_error})",
                "fix the reward function (task.options.reward_fn) or the task's data")
    if s.correct_spread_share > s.spread_share:
        return (f"correctness differs in {s.correct_spread_share:.0%} of groups but the reward does not",
                "check the reward's weights (task.options.answer_weight) or reward function")
    if reward_ignores_replies(s):
        return (f"every reply scored {s.rewards[0]:g} although {ignored_evidence(s)}",
                "check the reward function (task.options.reward_fn) or the verifier (task.options.verifier): it "
                "gives every reply the same score whatever it says, so no length or extractor setting changes it")
    if s.truncation_rate >= TRUNCATION_CAUSE and not extractor_misses_finished_replies(s):
        return (f"{s.truncation_rate:.0%} of replies were cut at rollout.max_new_tokens={s.max_new_tokens}",
                f"raise rollout.max_new_tokens (e.g. {4 * s.max_new_tokens})")
    if s.extracted_rate is not None and s.extracted_rate < EXTRACTION_CAUSE:
        return (f"the extractor found an answer in only {s.extracted_rate:.0%} of replies",
                "say how to state the answer in task.options.instruction, or widen task.options.extractors")
    if s.accuracy is not None and s.all_correct_share >= 0.5:
        return (f"{s.all_correct_share:.0%} of groups are all correct ({s.accuracy:.0%} of replies)",
                "use harder data: the model already solves it")
    if s.accuracy is not None and s.accuracy == 0:
        return (f"no reply was correct (answers found in {s.extracted_rate:.0%})",
                "use easier data or a warm start, or raise rollout.group_size / rollout.temperature")
    if s.spread_share > 0:
        correct = f" ({s.accuracy:.1%} of replies correct)" if s.accuracy is not None else ""
        return (f"rewards differ in only {s.spread_share:.0%} of groups{correct}",
                "raise rollout.group_size (check.fit_group_size chooses it) or rollout.temperature, or use data the "
                "model gets right more often")
    return (f"every group's rewards are equal ({s.distribution()})",
            "check the reward function: it gives the same score to different replies")


def reward_ignores_replies(s: SignalStats) -> bool:
    """True when every reply scored the same positive value although some were cut at the length cap or had no
    answer the extractor found: a reward that reads the reply gives such a reply nothing, so the reward (a function
    that ignores the reply, a verifier that accepts anything) is the cause, and a longer cap or another extractor
    would only be a hint followed in vain. A constant 0 says nothing of the kind: cut replies score 0 anyway."""
    if len(s.rewards) < 2 or min(s.rewards) != max(s.rewards) or s.rewards[0] <= 0:
        return False
    return s.truncation_rate > 0 or (s.extracted_rate is not None and s.extracted_rate < 1)


def ignored_evidence(s: SignalStats) -> str:
    """Why reward_ignores_replies holds, in words."""
    said = [f"{s.truncation_rate:.0%} were cut at rollout.max_new_tokens={s.max_new_tokens}"] if s.truncation_rate \
        else []
    if s.extracted_rate is not None and s.extracted_rate < 1:
        said.append(f"{1 - s.extracted_rate:.0%} had no answer the extractor found")
    return " and ".join(said)


def extractor_misses_finished_replies(s: SignalStats) -> bool:
    """True when most replies ended on their own and lack answers too: then a longer cap would not help, and the
    extractor or the instruction is the cause (a cascade of only answer_tag on a model that never writes the tag).
    When most replies are cut, the few that ended early say little: the length stays the cause."""
    return (s.truncation_rate < 0.5 and s.finished_extracted_rate is not None
            and s.finished_extracted_rate < EXTRACTION_CAUSE)


@dataclass
class SignalReport:
    stats: SignalStats
    verdict: Verdict
    groups: list[Group] = field(default_factory=list, repr=False)  # the groups sampled (grow_groups extends them)

    def lines(self) -> list[str]:
        """The report as a person reads it, verdict last."""
        s = self.stats
        pct = lambda x: "n/a (the reward reports none)" if x is None else f"{x:.1%}"  # noqa: E731
        mean, std = statistics.fmean(s.rewards), statistics.pstdev(s.rewards)
        return [
            f"signal check: {s.groups} prompts x {s.group_size} replies with the rollout's settings "
            f"({s.seconds:.1f} s)",
            f"  reward: mean {mean:.3f}, std {std:.3f}; values {s.distribution()}",
            f"  groups with a reward spread (the only ones GRPO learns from): {s.spread_share:.1%}",
            f"  replies cut at rollout.max_new_tokens={s.max_new_tokens}: {s.truncation_rate:.1%}",
            f"  answer found by the extractor: {pct(s.extracted_rate)}",
            f"  correct: {pct(s.accuracy)}",
            *([f"  failed rewards: {s.error_rate:.1%} ({s.first_error})"] if s.error_rate else []),
            self.verdict.line(),
        ]


@dataclass
class CheckSettings:
    """How much the check samples and what counts as enough signal (the config's `check` section)."""

    groups: int = 16  # prompts sampled, each with params.n completions
    batch: int = 8  # prompts per generate call (rollout.prompts_per_step: one rollout round's memory)
    min_spread: float = 0.05  # below this share of groups with a spread, the signal is too little
    tol: float = 0.0  # rewards within tol of each other count as equal (algorithm.advantage.zero_variance_tol)


def check_signal(model, tokenizer, task, examples: list[Example], params: SamplingParams, settings: CheckSettings,
                 *, seed: int, max_prompt_tokens: int | None,
                 sample_groups: GroupSampler = generate_groups) -> SignalReport:
    """Sample `settings.groups` prompts of `examples` (chosen by a generator of their own, not the prompt stream) with
    `params`, score them with the task's reward, and judge the signal. sample_groups: the run's GroupSampler (its
    tools); the process's random states are left as they were."""
    chosen = random.Random(f"signal-check-{seed}").sample(range(len(examples)), min(settings.groups, len(examples)))
    t0, groups = time.perf_counter(), []
    with rng_untouched():
        for start in range(0, len(chosen), settings.batch):
            part = chosen[start : start + settings.batch]
            seeds = [prompt_seed(seed, 0, 0, start + i) for i in range(len(part))]  # step 0: no training step's
            batch, _ = sample_groups(model, tokenizer, task, [examples[i] for i in part], params, seeds,
                                     max_prompt_tokens)
            groups.extend(batch)
    stats = signal_stats(groups, params.max_new_tokens, settings.tol, time.perf_counter() - t0)
    return SignalReport(stats, verdict(stats, settings.min_spread), groups)


def grow_groups(model, tokenizer, task, previous: SignalReport, params: SamplingParams, settings: CheckSettings,
                *, seed: int, max_prompt_tokens: int | None,
                sample_groups: GroupSampler = generate_groups) -> SignalReport:
    """The check at params.n replies per prompt on the first half of `previous`'s groups (MIN_FIT_GROUPS at least),
    each grown by the replies it lacks: as many replies as `previous` for half its sampling, and the same answer as
    a check from scratch (a group of 2G is any G replies of a prompt and G more). The new replies have seeds of
    their own (round params.n of step 0); the process's random states are left as they were. settings.groups is
    not read."""
    kept = previous.groups[: max(MIN_FIT_GROUPS, len(previous.groups) // 2)]
    have = len(kept[0].rewards)
    more = replace(params, n=params.n - have)
    t0, groups = time.perf_counter(), []
    with rng_untouched():
        for start in range(0, len(kept), settings.batch):
            part = kept[start : start + settings.batch]
            seeds = [prompt_seed(seed, 0, params.n, start + i) for i in range(len(part))]
            extra, _ = sample_groups(model, tokenizer, task, [g.example for g in part], more, seeds,
                                     max_prompt_tokens)
            groups.extend(g.joined(e) for g, e in zip(part, extra))
    stats = replace(signal_stats(groups, params.max_new_tokens, settings.tol, time.perf_counter() - t0),
                    spread_before=signal_stats(kept, params.max_new_tokens, settings.tol).spread_share)
    return SignalReport(stats, verdict(stats, settings.min_spread), groups)


@dataclass
class LengthFit:
    """check.fit_length's outcome: the length cap the run trains with and the check at each cap tried."""

    length: int  # rollout.max_new_tokens chosen
    reports: list[SignalReport]  # the check at each length tried, doubling; the last one at `length`
    stopped: str = ""  # why the length stopped rising while replies were still cut ("" when few are cut)
    fitted: bool = True  # False: check.fit_length is off, and `reports` is the one check at the length set

    @property
    def report(self) -> SignalReport:
        return self.reports[-1]

    def tried(self) -> list[str]:
        """One line per length left behind: why the check sampled again."""
        return [f"signal check: {r.stats.truncation_rate:.0%} of replies cut at rollout.max_new_tokens="
                f"{r.stats.max_new_tokens}: sampling again at {then.stats.max_new_tokens} (check.fit_length)"
                for r, then in zip(self.reports, self.reports[1:])]

    def choice(self) -> list[str]:
        """The length chosen, in one line (none when check.fit_length is off)."""
        if not self.fitted:
            return []
        start = self.reports[0].stats.max_new_tokens
        line = (f"check.fit_length: rollout.max_new_tokens {start} -> {self.length}" if self.length != start else
                f"check.fit_length: rollout.max_new_tokens stays {start}")
        return [line + choice_detail(f"{self.report.stats.truncation_rate:.0%} of replies cut", self.stopped,
                                     self.reports)]

    def lines(self) -> list[str]:
        """The lengths tried, one line each, then the last check's report, then the choice, then the verdict."""
        return [*self.tried(), *self.report.lines()[:-1], *self.choice(), self.report.lines()[-1]]


def choice_detail(found: str, stopped: str, reports: list[SignalReport]) -> str:
    """' (what the last check found; why the fit stopped; how many checks and their seconds)'."""
    detail = f" ({found}" + (f"; {stopped}" if stopped else "")
    seconds = sum(r.stats.seconds for r in reports)
    return detail + (f"; {len(reports)} checks, {seconds:.1f} s)" if len(reports) > 1 else ")")


def fit_length(check_at: Callable[[int], SignalReport], start: int, limit: int,
               fits: Callable[[int], bool]) -> LengthFit:
    """check.fit_length: the check at `start` new tokens, then at twice the length while FIT_TRUNCATION or more of the
    replies are cut, never past `limit` nor a length `fits` refuses (the device's memory). Why doubling rather than
    the replies' lengths: a cut reply's length is unknown, and a reward for a cut reply is usually 0, so replies the
    cap cuts are lost to GRPO whatever they would have said. Never shortens: `start` is what the user set.
    check_at(n): the signal check with replies capped at n."""
    length, reports, stopped = start, [check_at(start)], ""
    while reports[-1].stats.truncation_rate >= FIT_TRUNCATION:
        if reward_ignores_replies(reports[-1].stats):
            stopped = "every reply scored the same, cut or not: the reward, not the length, is the cause"
            break
        longer = min(2 * length, limit)
        if longer <= length:
            stopped = f"check.max_new_tokens_limit={limit}"
            break
        if not fits(longer):
            stopped = f"rollout.max_new_tokens={longer} would not fit the device's memory"
            break
        length = longer
        reports.append(check_at(length))
    return LengthFit(length, reports, stopped)


@dataclass
class GroupFit:
    """check.fit_group_size's outcome: the group size and prompts per step the run trains with, and the check at
    each group size tried (the first one is the length fit's last check)."""

    group_size: int  # rollout.group_size chosen
    prompts: int  # rollout.prompts_per_step chosen: halved with each doubling, so a step samples as many replies
    reports: list[SignalReport]
    stopped: str = ""  # why the group size stopped rising while few groups had a spread

    @property
    def report(self) -> SignalReport:
        """The check at the group size chosen (a larger one tried after it may have been left)."""
        return next(r for r in reversed(self.reports) if r.stats.group_size == self.group_size)

    def tried(self) -> list[str]:
        return [f"signal check: {r.stats.spread_share:.0%} of groups with a reward spread at rollout.group_size="
                f"{r.stats.group_size}: sampling again at {then.stats.group_size} (check.fit_group_size)"
                for r, then in zip(self.reports, self.reports[1:])]

    def choice(self) -> list[str]:
        first = self.reports[0].stats.group_size
        line = (f"check.fit_group_size: rollout.group_size {first} -> {self.group_size}, rollout.prompts_per_step "
                f"-> {self.prompts}" if self.group_size != first else
                f"check.fit_group_size: rollout.group_size stays {first}")
        return [line + choice_detail(f"{self.report.stats.spread_share:.0%} of groups with a spread", self.stopped,
                                     self.reports)]


def chance_limited(s: SignalStats) -> bool:
    """True when few groups have a spread because right (or wrong) replies are rare, which more replies per prompt
    help, and not because of a setting they do not (rewards that fail or ignore the reply, replies cut, answers the
    extractor misses)."""
    return (s.error_rate < ERROR_CAUSE and s.truncation_rate < TRUNCATION_CAUSE and not reward_ignores_replies(s)
            and (s.extracted_rate is None or s.extracted_rate >= EXTRACTION_CAUSE))


def fit_group_size(grow: Callable[[SignalReport, int], SignalReport], first: SignalReport, prompts: int,
                   limit: int, ranks: int, fits: Callable[[int, int], bool]) -> GroupFit:
    """check.fit_group_size: from `first` (the check at the run's group size and `prompts` per step), twice the
    replies per prompt and half the prompts per step while the check finds too little signal (its verdict: fewer
    than check.min_spread of the groups, or fewer than two, have a reward spread) and rare outcomes are why
    (chance_limited); the larger group is kept only when more of its groups have a spread than the same prompts had
    at the smaller size (spread_before; grown groups never have less). Why: a prompt answered right with probability
    p gives a group of G a spread with probability 1 - p^G - (1-p)^G, so where right replies are rare a larger group
    is what turns a prompt into signal, and a run the check would stop gets one. Why only there: a larger group halves
    the prompts a step learns from, and where a quarter of the groups had a spread the examples learned more with groups
    of 8 than with 16 replies for 4 prompts (docs/tasks.md). Stops at `limit`, at a prompts per step that cannot halve
    (below 1, or not shared evenly by `ranks`), and at settings `fits` refuses (the device's memory). Never shrinks the
    group set. grow(report, P): the check at twice report's group size and P prompts per step (grow_groups: report's
    groups, grown)."""
    group, reports, stopped = first.stats.group_size, [first], ""
    while not reports[-1].verdict.ok and chance_limited(reports[-1].stats):
        larger, fewer = 2 * group, prompts // 2
        if larger > limit:
            stopped = f"check.group_size_limit={limit}"
            break
        if fewer < 1 or fewer % ranks:
            stopped = f"rollout.prompts_per_step={prompts} cannot halve"
            break
        if not fits(larger, fewer):
            stopped = f"rollout.group_size={larger} would not fit the device's memory"
            break
        reports.append(grow(reports[-1], fewer))
        now = reports[-1].stats
        if now.spread_share <= now.spread_before:
            stopped = f"groups of {larger} had a spread no more often ({now.spread_share:.0%})"
            break
        group, prompts = larger, fewer
    return GroupFit(group, prompts, reports, stopped)


@dataclass
class RolloutFit:
    """What the check chose for the run (check.fit_length, then check.fit_group_size at the length found) and the
    checks it ran; with neither on, the one check at the run's settings."""

    length: LengthFit
    group: GroupFit | None = None  # None: check.fit_group_size is off

    @property
    def report(self) -> SignalReport:
        return (self.group or self.length).report

    @property
    def max_new_tokens(self) -> int:
        return self.length.length

    def lines(self) -> list[str]:
        """The settings tried, one line each, then the last check's report, then the choices, then the verdict."""
        group_tried, group_choice = (self.group.tried(), self.group.choice()) if self.group else ([], [])
        *report, verdict_line = self.report.lines()
        return [*self.length.tried(), *group_tried, *report, *self.length.choice(), *group_choice, verdict_line]
