"""Glue between the config tree and the algorithm library (grpo_engine.rl): sampling params, advantages,
the loss closure, the reference policy, and the per-step metrics record.

Each function maps config fields onto the rl / rollout dataclasses in ONE place, so the loop never
touches algorithm variants itself.
"""

from __future__ import annotations

import math
import statistics

import torch

from ..config import Config
from ..monitor import StepMetrics
from ..rl.advantages import AdvantageConfig, compute_advantages
from ..rollout import SamplingParams
from .batching import RolloutBatch, build_rollout_batch


def sampling_params(cfg: Config, tokenizer) -> SamplingParams:
    r = cfg.rollout
    return SamplingParams(
        n=r.group_size, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, min_p=r.min_p,
        max_new_tokens=r.max_new_tokens, stop_token_ids=list(tokenizer.eos_token_ids),
        stop_strings=list(r.stop_strings), max_tokens_in_flight=r.max_tokens_in_flight or None,
    )


def _overlong_rewards(rewards: torch.Tensor, lengths: torch.Tensor, cfg: Config) -> torch.Tensor:
    """DAPO soft overlong penalty: linear from 0 at (max - buffer) to -penalty at max_new_tokens."""
    o, L = cfg.algorithm.overlong, cfg.rollout.max_new_tokens
    if o.mode != "penalty" or o.buffer_tokens == 0:
        return rewards
    over = (lengths.float() - (L - o.buffer_tokens)).clamp(min=0) / o.buffer_tokens  # [P, G] in [0, 1]
    return rewards - o.penalty * over.clamp(max=1.0)


def rollout_batch(groups, cfg: Config, task, pad_id: int) -> tuple[RolloutBatch | None, dict]:
    """Group advantages (+ overlong handling) -> a right-padded RolloutBatch (None when no groups)."""
    if not groups:
        return None, {"zero_variance": 0}
    rewards = torch.tensor([g.totals for g in groups], dtype=torch.float64)  # [P, G]
    lengths = torch.tensor([[len(c) for c in g.completion_ids] for g in groups])  # [P, G]
    rewards = _overlong_rewards(rewards, lengths, cfg)
    result = compute_advantages(rewards, AdvantageConfig(estimator=cfg.algorithm.advantage))
    adv = result.advantages  # [P, G]
    keep = result.valid.clone()  # [P, G]
    if cfg.algorithm.overlong.mode == "mask":
        keep &= torch.tensor([[f != "length" for f in g.finish_reasons] for g in groups])
    G = len(groups[0].completion_ids)
    batch = build_rollout_batch(
        prompt_ids=[g.prompt_ids for g in groups for _ in range(G)],
        completion_ids=[c for g in groups for c in g.completion_ids],
        sampler_logprobs=[lp for g in groups for lp in g.logprobs],
        advantages=adv.reshape(-1).float(),
        completion_keep=keep.reshape(-1).tolist(),
        pad_id=pad_id,
    )
    return batch, {"zero_variance": result.num_zero_variance}


def make_loss_fn(cfg: Config):
    """(logp [b,T], entropy [b,T], micro_batch, num_tokens) -> (loss, metrics), normalised by num_tokens.

    Token-level clipped surrogate (ratio against old_logp, or against logp.detach() when mu == 1 so the
    ratio is 1 with the right gradient) plus beta * k3 KL to the reference.
    """
    a = cfg.algorithm

    def loss_fn(logp, entropy, mb: RolloutBatch, num_tokens: int):
        mask = mb.completion_mask  # [b, T]
        old = mb.old_logp if mb.old_logp is not None else logp.detach()  # [b, T]
        ratio = torch.exp(logp - old)  # [b, T]
        adv = mb.advantages[:, None]  # [b, 1]
        surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - a.epsilon_low, 1 + a.epsilon_high) * adv)
        per_token = -surrogate  # [b, T]
        metrics = {}
        if a.beta > 0 and mb.ref_logp is not None:
            diff = mb.ref_logp - logp
            kl = torch.exp(diff) - diff - 1  # k3 estimator, [b, T]
            per_token = per_token + a.beta * kl
            metrics["kl"] = float((kl * mask).sum() / mask.sum().clamp(min=1))
        loss = (per_token * mask).sum() / num_tokens
        denom = mask.sum().clamp(min=1)
        metrics["clip_frac_low"] = float((((ratio < 1 - a.epsilon_low) & (adv < 0)) * mask).sum() / denom)
        metrics["clip_frac_high"] = float((((ratio > 1 + a.epsilon_high) & (adv > 0)) * mask).sum() / denom)
        if entropy is not None:
            metrics["entropy"] = float((entropy.detach() * mask).sum() / denom)
        return loss, metrics

    return loss_fn


def make_reference_policy(cfg: Config, model):
    """None when beta == 0 (no reference needed); the rl branch's make_reference otherwise."""
    if cfg.algorithm.beta == 0:
        return None
    from .reference import ReferenceConfig, make_reference

    return make_reference(model, ReferenceConfig(mode=cfg.reference.mode, sync_every=cfg.reference.sync_every))


def _mean_std(xs: list[float]) -> tuple[float, float]:
    if not xs:
        return math.nan, math.nan
    return statistics.fmean(xs), (statistics.pstdev(xs) if len(xs) > 1 else 0.0)


def step_metrics(step: int, rollout, batch: RolloutBatch | None, update, adv_info: dict) -> StepMetrics:
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
    m.accuracy = statistics.fmean(r.components.get("answer", 0.0) >= 1.0 for r in results) if results else math.nan
    m.completion_len_mean = statistics.fmean(lengths) if lengths else math.nan
    m.completion_len_max = max(lengths, default=0)
    m.truncation_rate = statistics.fmean(f == "length" for g in gen for f in g.finish_reasons) if gen else math.nan
    m.zero_variance_frac = statistics.fmean(g.zero_variance() for g in gen) if gen else math.nan
    m.refills = rollout.refills
    m.gen_tokens = rollout.gen_tokens
    m.time_generate_s = rollout.time_generate_s
    m.gen_tokens_per_s = rollout.gen_tokens / max(rollout.time_generate_s, 1e-9)
    if batch is not None:
        m.rows, m.train_tokens = batch.num_rows, batch.active_tokens()
    if update is not None:
        m.loss = update.loss
        for key in ("kl", "entropy", "clip_frac_low", "clip_frac_high"):
            if key in update.metrics:
                setattr(m, key, update.metrics[key])
    return m
