"""The metrics of one step (a StepMetrics record for metrics.jsonl) from its collected groups, batch and update."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import torch

from ..collect.groups import CollectedGroups
from ..eval.in_loop import accuracy
from ..monitor import Sample, StepMetrics
from ..rl.advantages import zero_variance_groups
from ..rollout.static_decode import cuda_graphs_fallback
from ..world import World
from .batch import AdvantageInfo, TrainBatch
from .update import UpdateStats, combine_metrics


def _mean_std(xs: list[float]) -> tuple[float, float]:
    if not xs:
        return math.nan, math.nan
    return statistics.fmean(xs), (statistics.pstdev(xs) if len(xs) > 1 else 0.0)


_UPDATE_METRICS = {"kl": "kl_mean", "entropy": "entropy_mean", "clip_frac_low": "clip_frac_low",
                   "clip_frac_high": "clip_frac_high", "ratio_mean": "ratio_mean", "ratio_max": "ratio_max",
                   "mismatch_mean_abs": "mismatch_mean_abs", "mismatch_max_abs": "mismatch_max_abs",
                   "mismatch_k3": "mismatch_k3", "rollout_correction_frac": "rollout_correction_frac"}


@dataclass
class StepParts:
    """What a step's metrics are computed from (one rank's, or every rank's merged)."""

    collected: CollectedGroups
    rows: int  # training rows
    train_tokens: int  # active completion tokens
    update: UpdateStats | None
    adv: AdvantageInfo


def step_parts(collected: CollectedGroups, batch: TrainBatch | None, update: UpdateStats | None,
               adv: AdvantageInfo) -> StepParts:
    rows, tokens = (batch.num_rows, batch.active_tokens()) if batch is not None else (0, 0)
    return StepParts(collected, rows, tokens, update, adv)


def merge_ranks(world: World, parts: StepParts) -> StepParts:
    """Every rank's parts merged (a collective: all ranks call it): groups concatenated in rank order, counts
    summed, update metrics combined token-weighted, semantic entropy averaged over groups."""
    if world.size == 1:
        return parts
    every = world.gather(parts)
    ranks = [p.collected for p in every]
    merged = CollectedGroups([g for r in ranks for g in r.groups], [g for r in ranks for g in r.generated],
                             max(r.refills for r in ranks), sum(r.gen_tokens for r in ranks),
                             max(r.time_generate_s for r in ranks))
    updates = [p.update for p in every if p.update is not None]
    update = None
    if updates:
        combined = combine_metrics([u.metrics for u in updates])
        update = UpdateStats(combined["loss"], combined, sum(u.tokens for u in updates))
    groups = [len(p.collected.groups) for p in every]
    se = [p.adv.semantic_entropy * n for p, n in zip(every, groups) if n]
    adv = AdvantageInfo(sum(p.adv.num_zero_variance for p in every), sum(p.adv.num_nonfinite for p in every),
                        sum(se) / max(1, sum(groups)) if se else math.nan)
    return StepParts(merged, sum(p.rows for p in every), sum(p.train_tokens for p in every), update, adv)


def step_metrics(step: int, parts: StepParts, zero_variance_tol: float = 0.0) -> StepMetrics:
    collected, adv, update = parts.collected, parts.adv, parts.update
    gen = collected.generated
    results = [r for g in gen for r in g.rewards]
    lengths = [len(c) for g in gen for c in g.completion_ids]
    m = StepMetrics(step=step)
    m.reward_mean, m.reward_std = _mean_std([r.total for r in results])
    names = sorted({k for r in results for k in r.components})
    m.reward_components = {}
    for name in names:
        mean, std = _mean_std([r.components.get(name, 0.0) for r in results])
        m.reward_components[name] = {"mean": mean, "std": std}
    m.accuracy = accuracy(results) if results else math.nan
    m.completion_len_mean = statistics.fmean(lengths) if lengths else math.nan
    m.completion_len_max = max(lengths, default=0)
    m.truncation_rate = statistics.fmean(f == "length" for g in gen for f in g.finish_reasons) if gen else math.nan
    if gen:  # over every generated group, dynamic sampling's dropped ones included
        totals = torch.tensor([g.totals for g in gen], dtype=torch.float64)  # [P', G]
        zero = zero_variance_groups(totals, zero_variance_tol)  # [P']
        m.zero_variance_frac, m.zero_variance_groups = float(zero.double().mean()), int(zero.sum())
    errors = [r.info.get("error") for r in results]
    m.reward_errors, m.reward_timeouts = errors.count("exception"), errors.count("timeout")
    m.reward_nonfinite = errors.count("nonfinite")
    m.semantic_entropy = adv.semantic_entropy
    m.refills = collected.refills
    m.gen_tokens = collected.gen_tokens
    m.time_generate_s = collected.time_generate_s
    m.gen_tokens_per_s = collected.gen_tokens / max(collected.time_generate_s, 1e-9)
    m.rows, m.train_tokens = parts.rows, parts.train_tokens
    m.tools = tool_metrics(gen)
    if update is not None:
        m.loss = update.loss
        for ours, theirs in _UPDATE_METRICS.items():
            setattr(m, ours, update.metrics.get(theirs, math.nan))
    return m


def graph_metrics(world: World) -> dict[str, float]:
    """rollout/cuda_graphs_fallback over the ranks (a collective: every rank calls it): 1 when some rank decodes
    eagerly after a failed capture check, 0 while every check passed, absent when no rank captured a graph."""
    fallback = world.max(-1 if (flag := cuda_graphs_fallback()) is None else flag)
    return {} if fallback < 0 else {"rollout/cuda_graphs_fallback": fallback}


def tool_metrics(groups) -> dict[str, float]:
    """Means per trajectory of the tool calls, failed calls and model turns; {} without multi-turn groups."""
    trajs = [t for g in groups for t in (g.trajectory_metrics or [])]
    if not trajs:
        return {}
    return {"tool_calls": statistics.fmean(t.tool_calls for t in trajs),
            "tool_errors": statistics.fmean(t.tool_errors for t in trajs),
            "turns": statistics.fmean(t.turns for t in trajs)}


def sample_records(step: int, collected, n: int) -> list[Sample]:
    """The first completion of each of the first n generated groups, for samples.jsonl."""
    records = []
    for g in collected.generated[:n]:
        r = g.rewards[0]
        error = f"{r.info['error']}: {r.info.get('message', '')}" if "error" in r.info else None
        records.append(Sample(step, g.prompt_text, g.texts[0], r.total, dict(r.components), r.answer,
                              g.finish_reasons[0], error))
    return records


class RewardWatch:
    """Warnings a person watching a run needs: the first failed reward of each kind (with its message), and
    a run that has had no learning signal (every group's rewards equal) for `quiet_steps` steps in a row."""

    def __init__(self, message, quiet_steps: int = 10):
        self.message, self.quiet_steps = message, quiet_steps
        self.warned: set[str] = set()
        self.quiet = 0

    def __call__(self, m: StepMetrics, collected) -> None:
        for kind, count in (("exception", m.reward_errors), ("timeout", m.reward_timeouts),
                            ("nonfinite", m.reward_nonfinite)):
            if count and kind not in self.warned:
                self.warned.add(kind)
                first = next(r.info for g in collected.generated for r in g.rewards if r.info.get("error") == kind)
                self.message(f"warning: step {m.step}: {count} reward(s) failed ({kind}: {first.get('message')}); "
                             f"they score 0 (counted in metrics.jsonl as reward_errors / reward_timeouts / "
                             f"reward_nonfinite)")
        all_equal = m.zero_variance_groups and m.zero_variance_groups == len(collected.generated)
        self.quiet = self.quiet + 1 if all_equal else 0
        if self.quiet == self.quiet_steps:
            self.message(f"warning: {self.quiet_steps} steps in a row with no learning signal (every group's rewards "
                         f"were equal, e.g. all 0): check the reward on samples.jsonl, the prompt format, or raise "
                         f"rollout.group_size / the sampling temperature")
