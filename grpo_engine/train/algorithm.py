"""Glue between the config tree and the algorithm library (grpo_engine.rl): sampling params, rewards ->
advantages -> a training batch, the reference policy, LoRA weights for rollout, and the step's metrics.

Each function maps config fields onto the rl / rollout / lora APIs in ONE place, so the loop never touches
an algorithm variant itself.
"""

from __future__ import annotations

import contextlib
import math
import statistics
from dataclasses import dataclass, replace

import torch

from ..config import Config
from ..model.lora import adapters_disabled, lora_merged, lora_modules
from ..monitor import StepMetrics
from ..rl.advantages import combine_rewards, compute_advantages
from ..rl.overlong import overlong_keep_mask, soft_overlong_penalty
from ..rl.semantic_entropy import group_semantic_entropy, modulate_advantages
from ..rollout import SamplingParams
from .batching import RolloutBatch, build_rollout_batch
from .evaluation import accuracy
from .reference import make_reference
from .rollouts import Group
from .update import batch_logprobs


def sampling_params(cfg: Config, tokenizer) -> SamplingParams:
    r = cfg.rollout
    return SamplingParams(
        n=r.group_size, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, min_p=r.min_p,
        max_new_tokens=r.max_new_tokens, stop_token_ids=list(tokenizer.eos_token_ids),
        stop_strings=list(r.stop_strings), max_tokens_in_flight=r.max_tokens_in_flight or None,
    )


def eval_params(cfg: Config, tokenizer) -> SamplingParams:
    """Rollout sampling with the eval section's temperature (0 = greedy) and length cap, one per prompt."""
    return replace(sampling_params(cfg, tokenizer), n=1, temperature=cfg.eval.temperature,
                   max_new_tokens=cfg.eval.max_new_tokens)


# ----------------------------------------------------------------------------------------------------
# Rewards -> advantages -> batch


@dataclass
class AdvantageInfo:
    """What the advantage phase reports for the step's metrics."""

    num_zero_variance: int  # groups whose rewards were all equal (advantage 0)
    num_nonfinite: int  # non-finite rewards masked out
    semantic_entropy: float  # mean SE (nats) of the trained groups' answers, always computed


def _rewards(groups: list[Group], cfg: Config) -> torch.Tensor:
    """[P, G] rewards: the task's totals, or (advantage.component_weights set) a re-weighted sum of the
    components; then the soft overlong penalty when enabled."""
    weights = cfg.algorithm.advantage.component_weights
    if weights:
        names = sorted({k for g in groups for r in g.rewards for k in r.components} | set(weights))
        comps = {n: torch.tensor([[r.components.get(n, 0.0) for r in g.rewards] for g in groups]) for n in names}
        rewards = combine_rewards(comps, weights).double()  # [P, G]
    else:
        rewards = torch.tensor([g.totals for g in groups], dtype=torch.float64)  # [P, G]
    o = cfg.algorithm.overlong
    if o.soft_punish:
        lengths = torch.tensor([[len(c) for c in g.completion_ids] for g in groups])  # [P, G]
        max_len = o.max_len or cfg.rollout.max_new_tokens
        rewards = rewards + soft_overlong_penalty(lengths.flatten(), max_len, o.cache_len).view_as(rewards)
    return rewards


def _semantic_entropy(groups: list[Group], task, cfg: Config) -> torch.Tensor:
    """[P] semantic entropy of each group's final answers under the task's equivalence."""
    answers = [[r.answer for r in g.rewards] for g in groups]
    seq_logp = torch.tensor([[statistics.fmean(lp) if lp else 0.0 for lp in g.logprobs] for g in groups])  # [P, G]
    return group_semantic_entropy(answers, task.equivalent, cfg.algorithm.semantic_entropy, seq_logp)


def rollout_batch(groups: list[Group], cfg: Config, task, pad_id: int) -> tuple[RolloutBatch | None, AdvantageInfo]:
    """Group advantages (+ SEED-GRPO modulation, overlong filtering) -> a right-padded RolloutBatch."""
    if not groups:
        return None, AdvantageInfo(0, 0, math.nan)
    a = cfg.algorithm
    result = compute_advantages(_rewards(groups, cfg), a.advantage)
    se = _semantic_entropy(groups, task, cfg)  # [P]
    adv = modulate_advantages(result.advantages, se, a.semantic_entropy) if a.semantic_entropy.enabled \
        else result.advantages  # [P, G]
    keep = result.valid.clone()  # [P, G]
    if a.overlong.filter_truncated:
        keep &= overlong_keep_mask([f for g in groups for f in g.finish_reasons]).view_as(keep)
    G = len(groups[0].completion_ids)
    batch = build_rollout_batch(
        prompt_ids=[g.prompt_ids for g in groups for _ in range(G)],
        completion_ids=[c for g in groups for c in g.completion_ids],
        sampler_logprobs=[lp for g in groups for lp in g.logprobs],
        advantages=adv.reshape(-1).float(),
        completion_keep=keep.reshape(-1).tolist(),
        pad_id=pad_id,
        share_prompts=cfg.memory.share_prompt_forward,
    )
    return batch, AdvantageInfo(result.num_zero_variance, result.num_nonfinite, float(se.mean()))


# ----------------------------------------------------------------------------------------------------
# Reference policy (KL term) and LoRA weights for rollout


class CopyReference:
    """A separate reference model (train/reference.py: frozen / hard_reset / mixin, optionally CPU-parked)."""

    def __init__(self, reference):
        self.reference = reference

    def logprobs(self, policy, batch: RolloutBatch, budget: int, *, temperature: float, chunk_size: int):
        device = policy.device
        self.reference.before_pass(device)
        try:
            return batch_logprobs(self.reference.module, batch, budget, temperature=temperature,
                                  chunk_size=chunk_size)
        finally:
            self.reference.after_pass()

    def on_step(self, step: int, policy) -> None:
        self.reference.on_step(step, policy)

    def state_dict(self) -> dict:
        return self.reference.module.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.reference.module.load_state_dict(state)


class LoRABaseReference:
    """With LoRA the reference is the base model: the policy with its adapters switched off (no copy)."""

    def logprobs(self, policy, batch: RolloutBatch, budget: int, *, temperature: float, chunk_size: int):
        with adapters_disabled(policy):
            return batch_logprobs(policy, batch, budget, temperature=temperature, chunk_size=chunk_size)

    def on_step(self, step: int, policy) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def make_reference_policy(cfg: Config, policy, initial=None):
    """None when beta == 0 (no reference, nothing copied); the base model under LoRA; else a copy of
    `initial` (the weights at model.path; defaults to the policy itself at the start of a run)."""
    if cfg.algorithm.beta == 0:
        return None
    if cfg.lora.enabled:
        return LoRABaseReference()
    return CopyReference(make_reference(initial if initial is not None else policy, cfg.reference,
                                        beta=cfg.algorithm.beta))


def merges_for_rollout(cfg: Config, model) -> bool:
    """Merge LoRA adapters into the weights for generation only when unmerging restores them bit for bit:
    low-precision bases (the original weight is parked and copied back). An fp32 base would be restored by
    subtraction, whose rounding would drift the frozen weights over a long run, so it decodes through the
    adapter path instead (same function, one extra small matmul per projection)."""
    low_precision = next(model.parameters()).dtype != torch.float32
    return cfg.lora.enabled and low_precision and any(True for _ in lora_modules(model))


def rollout_weights(cfg: Config, model):
    """Context in which the policy generates: LoRA merged when exact (see merges_for_rollout)."""
    return lora_merged(model) if merges_for_rollout(cfg, model) else contextlib.nullcontext(model)


# ----------------------------------------------------------------------------------------------------
# Metrics


def _mean_std(xs: list[float]) -> tuple[float, float]:
    if not xs:
        return math.nan, math.nan
    return statistics.fmean(xs), (statistics.pstdev(xs) if len(xs) > 1 else 0.0)


_UPDATE_METRICS = {"kl": "kl_mean", "entropy": "entropy_mean", "clip_frac_low": "clip_frac_low",
                   "clip_frac_high": "clip_frac_high", "ratio_mean": "ratio_mean", "ratio_max": "ratio_max"}


def step_metrics(step: int, rollout, batch: RolloutBatch | None, update, adv: AdvantageInfo) -> StepMetrics:
    gen = rollout.generated
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
    m.zero_variance_frac = statistics.fmean(g.zero_variance() for g in gen) if gen else math.nan
    m.semantic_entropy = adv.semantic_entropy
    m.refills = rollout.refills
    m.gen_tokens = rollout.gen_tokens
    m.time_generate_s = rollout.time_generate_s
    m.gen_tokens_per_s = rollout.gen_tokens / max(rollout.time_generate_s, 1e-9)
    if batch is not None:
        m.rows, m.train_tokens = batch.num_rows, batch.active_tokens()
    if update is not None:
        m.loss = update.loss
        for ours, theirs in _UPDATE_METRICS.items():
            setattr(m, ours, update.metrics.get(theirs, math.nan))
    return m
