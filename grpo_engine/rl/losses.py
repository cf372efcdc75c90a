"""Policy-gradient losses as pure functions: (logp, old_logp, ref_logp, advantages, mask) -> (loss, metrics).

All tensors are padded [B, T] with a mask [B, T] of completion tokens (float or bool). A loss is composed of
four small variants, each chosen by name from a dict:

    ratio        RATIOS        token (GRPO/DAPO) | sequence (GSPO)
    surrogate    SURROGATES    clip (PPO clip, eps_low/eps_high, optional dual clip) | cispo | sapo (soft gate)
    aggregation  AGGREGATIONS  seq-mean-token-mean | token-mean | seq-mean-token-sum-norm
    KL           KL_ESTIMATORS k1 | k2 | k3

`LossConfig.loss` picks a preset (PRESETS) that fills the variants; explicit fields override the preset;
`resolve` turns the LossConfig into the one flat `ResolvedLoss` that every function here takes.
Given the sampler's log-probs, the policy-gradient term can also be reweighted for the sampler/trainer
mismatch (`ResolvedLoss.rollout_correction`, one of rl.correction.CORRECTIONS).
Formulas with citations: docs/algorithms.md.

Micro-batching: the aggregations divide by the size of the WHOLE optimizer step (num_tokens_total /
num_seqs_total), supplied by the loop, so summing the gradients of k micro-batches gives exactly the gradient
of one big batch. Without them, the call's own counts are used (right for a single micro-batch).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..config.algorithm import LossConfig
from .correction import mismatch_metrics, rollout_correction


@dataclass(frozen=True)
class _Preset:
    ratio_level: str
    surrogate: str
    eps_low: float
    eps_high: float
    aggregation: str


PRESETS: dict[str, _Preset] = {
    "grpo": _Preset("token", "clip", 0.2, 0.2, "seq-mean-token-mean"),  # DeepSeekMath
    "dapo": _Preset("token", "clip", 0.2, 0.28, "token-mean"),  # DAPO
    "dr_grpo": _Preset("token", "clip", 0.2, 0.2, "seq-mean-token-sum-norm"),  # Dr. GRPO
    "gspo": _Preset("sequence", "clip", 3e-4, 4e-4, "seq-mean-token-mean"),  # GSPO
    "cispo": _Preset("token", "cispo", 0.2, 0.2, "token-mean"),  # MiniMax-M1 (eps unused: cispo_*_weight)
    "sapo": _Preset("token", "sapo", 0.2, 0.2, "token-mean"),  # SAPO (eps unused: sapo_tau_pos/neg)
}


@dataclass(frozen=True)
class ResolvedLoss:
    """The policy loss as the step reads it: a LossConfig (config.algorithm's `policy_loss`) with its preset
    applied, every variant named and every number set (LossConfig's fields say what each one means)."""

    loss: str  # the preset's name
    ratio_level: str
    surrogate: str
    eps_low: float
    eps_high: float
    aggregation: str
    max_completion_len: int | None  # Dr. GRPO's constant normaliser: the config's, else the rollout's length cap
    dual_clip_c: float | None
    cispo_min_weight: float
    cispo_max_weight: float
    sapo_tau_pos: float
    sapo_tau_neg: float
    kl_estimator: str
    beta: float
    kl_clamp: float
    entropy_coef: float
    entropy_top_quantile: float
    rollout_correction: str
    rollout_correction_cap: float
    rollout_correction_level: str


def resolve(cfg: LossConfig, max_new_tokens: int | None = None) -> ResolvedLoss:
    """Apply the preset; max_new_tokens (rollout.max_new_tokens) is Dr. GRPO's normaliser where
    cfg.max_completion_len leaves it unset. LossConfig checked every name and number when it was made (its
    __post_init__, against the names of these tables); what depends on the preset is checked here. The trainer
    resolves once per run (train/step.py update_settings) and passes the ResolvedLoss on."""
    p = PRESETS[cfg.loss]
    aggregation = cfg.aggregation or p.aggregation
    length = cfg.max_completion_len or max_new_tokens
    if aggregation == "seq-mean-token-sum-norm" and not (length or 0) > 0:
        raise ValueError("aggregation 'seq-mean-token-sum-norm' (Dr. GRPO) needs max_completion_len > 0")
    as_set = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}  # the user's values, then the preset's
    return ResolvedLoss(**{**as_set, "ratio_level": cfg.ratio_level or p.ratio_level, "surrogate": p.surrogate,
                           "eps_low": p.eps_low if cfg.eps_low is None else cfg.eps_low,
                           "eps_high": p.eps_high if cfg.eps_high is None else cfg.eps_high,
                           "aggregation": aggregation, "max_completion_len": length})


def is_tokenwise(r: ResolvedLoss) -> bool:
    """True when the loss is a sum of per-token terms, each depending on that token's log-prob and entropy only.

    Then the LM head can compute its gradients in its forward pass (train/fused_head.py, rl.logprobs.head_chunks).
    Not per-token: GSPO's sequence ratio (a mean over the sequence), top-entropy masking (a batch quantile) and a
    sequence-level rollout correction (its weight depends on every token of the sequence).
    """
    sequence_correction = r.rollout_correction != "none" and r.rollout_correction_level == "sequence"
    return r.ratio_level == "token" and r.entropy_top_quantile >= 1 and not sequence_correction


def zero_advantage_is_inert(r: ResolvedLoss) -> bool:
    """True when a token with advantage 0 gets exactly zero gradient, so rows with A = 0 can be left out of the update.

    Every surrogate is A times a function of the ratio (clip, dual clip, CISPO, SAPO, GSPO's sequence ratio, any
    rollout correction weight), and the aggregations divide by the step's totals, not the call's. Not so with a KL
    or entropy term (they act on every token) or top-entropy masking (its quantile is taken over the call's tokens).
    """
    return r.beta == 0 and r.entropy_coef == 0 and r.entropy_top_quantile >= 1


# ---- importance ratio: [B, T] log-probs -> [B, T] ratio ------------------------------------------------


def _token_ratio(logp, old_logp, mask):
    return torch.exp(logp - old_logp)  # [B, T]


def _sequence_ratio(logp, old_logp, mask):
    """GSPO: s_i = exp(mean_t log(pi / pi_old)) over the sequence's tokens, broadcast to its tokens."""
    n = mask.sum(1, keepdim=True).clamp_min(1)  # [B, 1]
    mean_log_ratio = ((logp - old_logp) * mask).sum(1, keepdim=True) / n  # [B, 1]
    return torch.exp(mean_log_ratio).expand_as(logp)  # [B, T]


RATIOS: dict[str, Callable] = {"token": _token_ratio, "sequence": _sequence_ratio}


# ---- surrogate: per-token loss (to minimise) and clip indicators ----------------------------------------


@dataclass
class _Surrogate:
    loss: torch.Tensor  # [B, T]
    clipped_low: torch.Tensor  # [B, T] bool: the lower clip removed this token's gradient
    clipped_high: torch.Tensor  # [B, T] bool: the upper clip removed this token's gradient


def _clip_surrogate(ratio, logp, adv, r: ResolvedLoss) -> _Surrogate:
    """PPO clip: -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A); dual clip caps it at -c * A."""
    surr1 = ratio * adv  # [B, T]
    surr2 = ratio.clamp(1 - r.eps_low, 1 + r.eps_high) * adv  # [B, T]
    obj = torch.minimum(surr1, surr2)  # [B, T]
    if r.dual_clip_c is not None:
        capped = torch.maximum(obj, r.dual_clip_c * adv)  # only binds when A < 0
        obj = torch.where(adv < 0, capped, obj)
    return _Surrogate(
        loss=-obj,
        clipped_low=(ratio < 1 - r.eps_low) & (adv < 0),
        clipped_high=(ratio > 1 + r.eps_high) & (adv > 0),
    )


def _cispo_surrogate(ratio, logp, adv, r: ResolvedLoss) -> _Surrogate:
    """CISPO: -sg(clip(ratio, w_min, w_max)) * A * logp -- every token keeps its gradient, only its weight is capped."""
    lo, hi = r.cispo_min_weight, r.cispo_max_weight
    weight = ratio.clamp(lo, hi).detach()  # [B, T]
    return _Surrogate(loss=-weight * adv * logp, clipped_low=ratio < lo, clipped_high=ratio > hi)


def _sapo_surrogate(ratio, logp, adv, r: ResolvedLoss) -> _Surrogate:
    """SAPO: -f(ratio) * A with the soft gate f(r) = sigmoid(tau (r - 1)) * 4 / tau, tau by the sign of A.

    d f / d logp = 4 s (1 - s) r with s = sigmoid(tau (r - 1)): exactly 1 on-policy (r = 1, the plain policy
    gradient), decaying smoothly to 0 as r leaves 1 instead of PPO's hard cut. Nothing is clipped outright.
    """
    tau = torch.where(adv > 0, r.sapo_tau_pos, r.sapo_tau_neg).to(ratio.dtype)  # [B, T]
    gate = torch.sigmoid(tau * (ratio - 1)) * 4 / tau  # [B, T]
    none = torch.zeros_like(ratio, dtype=torch.bool)
    return _Surrogate(loss=-gate * adv, clipped_low=none, clipped_high=none)


SURROGATES: dict[str, Callable[..., _Surrogate]] = {
    "clip": _clip_surrogate, "cispo": _cispo_surrogate, "sapo": _sapo_surrogate,
}


# ---- KL(pi || pi_ref) per token, d = log(pi_ref / pi) ----------------------------------------------------


def _k1(d):
    return -d


def _k2(d):
    return 0.5 * d**2


def _k3(d):
    return torch.exp(d) - d - 1


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"k1": _k1, "k2": _k2, "k3": _k3}


# ---- aggregation: per-token loss [B, T] -> scalar ----------------------------------------------------------


def _token_mean(x, mask, num_tokens_total, num_seqs_total, r):
    """DAPO: sum over all active tokens / active tokens of the whole step."""
    return (x * mask).sum() / num_tokens_total


def _seq_mean_token_mean(x, mask, num_tokens_total, num_seqs_total, r):
    """GRPO paper: mean over a sequence's tokens, then sum / sequences of the whole step."""
    per_seq = (x * mask).sum(1) / mask.sum(1).clamp_min(1)  # [B]
    return per_seq.sum() / num_seqs_total


def _seq_mean_token_sum_norm(x, mask, num_tokens_total, num_seqs_total, r):
    """Dr. GRPO: token sum / (max_completion_len * sequences of the whole step) -- no length bias."""
    return (x * mask).sum() / (r.max_completion_len * num_seqs_total)


AGGREGATIONS: dict[str, Callable] = {
    "token-mean": _token_mean,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
}


# ---- inputs: shapes, advantages [B] -> [B, T], normalisers, finite masking --------------------------------


def check_inputs(loss: ResolvedLoss, mask: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    """Shapes agree with mask [B, T], and the inputs the config's terms need are there."""
    if loss.rollout_correction != "none" and tensors["sampler_logp"] is None:
        raise ValueError(f"rollout_correction {loss.rollout_correction!r} needs sampler_logp (the sampler's log-probs)")
    if loss.beta > 0 and tensors["ref_logp"] is None:
        raise ValueError("beta > 0 needs ref_logp (reference-policy log-probs); set beta=0 to train without KL")
    if (loss.entropy_coef > 0 or loss.entropy_top_quantile < 1) and tensors["entropy"] is None:
        raise ValueError("entropy_coef > 0 or entropy_top_quantile < 1 needs the entropy [B, T] input")
    if mask.dim() != 2:
        raise ValueError(f"mask must be [B, T], got shape {tuple(mask.shape)}")
    for name, t in tensors.items():
        if t is not None and t.shape != mask.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)} but mask has shape {tuple(mask.shape)}")


def normalisers(m: torch.Tensor, num_tokens_total, num_seqs_total) -> tuple[float, float]:
    """Active tokens and sequences the aggregation divides by: the whole step's when given, else this call's."""
    n_tok = float(num_tokens_total) if num_tokens_total is not None else float(m.sum().clamp_min(1))
    n_seq = float(num_seqs_total) if num_seqs_total is not None else float((m.sum(1) > 0).sum().clamp_min(1))
    if n_tok <= 0 or n_seq <= 0:
        raise ValueError(f"num_tokens_total and num_seqs_total must be > 0, got {num_tokens_total}, {num_seqs_total}")
    return n_tok, n_seq


def broadcast_advantages(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] per-sequence or [B, T] per-token advantages -> [B, T]."""
    if advantages.shape == mask.shape[:1]:
        return advantages[:, None].expand_as(mask)
    if advantages.shape != mask.shape:
        raise ValueError(
            f"advantages has shape {tuple(advantages.shape)} but mask has shape {tuple(mask.shape)}; "
            f"expected [B] or [B, T]"
        )
    return advantages


@dataclass
class Finite:
    mask: torch.Tensor  # [B, T] bool: active tokens whose every input is finite
    num_nonfinite: torch.Tensor  # 0-dim: active tokens dropped because an input was NaN or inf


def finite_inputs(mask, logp, old, adv, *optional) -> Finite:
    """Drop active tokens with a non-finite input: one NaN would turn the whole loss (and every weight) into NaN.

    optional: the [B, T] inputs the config uses, or None (ref_logp, entropy, sampler_logp)."""
    finite = torch.isfinite(logp) & torch.isfinite(old) & torch.isfinite(adv)  # [B, T]
    for t in optional:
        if t is not None:
            finite &= torch.isfinite(t)
    mask_in = mask.bool()
    return Finite(mask=mask_in & finite, num_nonfinite=(mask_in & ~finite).sum())


# ---- the loss --------------------------------------------------------------------------------------------


def _top_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, q: float) -> torch.Tensor:
    """Bool [B, T]: active tokens whose entropy is in the top q fraction of this call's active tokens."""
    active = entropy[mask]
    if active.numel() == 0 or q >= 1:
        return mask
    threshold = torch.quantile(active.detach().float(), 1 - q)
    return mask & (entropy.detach() >= threshold)


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    ref_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    loss: ResolvedLoss,
    *,
    entropy: torch.Tensor | None = None,
    sampler_logp: torch.Tensor | None = None,
    num_tokens_total: float | None = None,
    num_seqs_total: float | None = None,
    with_metrics: bool = True,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Policy loss of one (micro-)batch and its metrics.

    logp [B, T]: current policy log-probs (with grad); old_logp [B, T] or None: behaviour policy log-probs
    (None = on-policy single pass: logp.detach() is used, so the ratio is 1 and the gradient is exact);
    ref_logp [B, T] or None: reference log-probs (needed when loss.beta > 0); advantages [B] or [B, T];
    mask [B, T] (bool or 0/1) of completion tokens; entropy [B, T] (needed for entropy_coef > 0 or
    entropy_top_quantile < 1); sampler_logp [B, T]: the sampler's log-probs of the same tokens (needed for
    loss.rollout_correction; when given, the mismatch metrics of rl.correction are reported).

    num_tokens_total / num_seqs_total: active tokens / sequences of the WHOLE optimizer step (default: this
    call's): each micro-batch's loss is then its share of the big-batch loss, so the summed gradients equal the
    one-batch gradient exactly. Non-finite inputs at active positions are masked out (metrics["num_nonfinite"]).
    with_metrics=False: the loss alone (the fused head's per-chunk gradients); the metrics are read from the
    device once per call, not once per value.
    """
    check_inputs(loss, mask, logp=logp, old_logp=old_logp, ref_logp=ref_logp, entropy=entropy,
                 sampler_logp=sampler_logp)
    adv = broadcast_advantages(advantages, mask).to(logp.dtype)  # [B, T]

    old = logp.detach() if old_logp is None else old_logp
    live = finite_inputs(mask, logp, old, adv, ref_logp if loss.beta > 0 else None, entropy,
                         sampler_logp if loss.rollout_correction != "none" else None)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    logp = torch.where(live.mask, logp, zero)
    old = torch.where(live.mask, old.to(logp.dtype), zero)
    adv = torch.where(live.mask, adv, zero)
    m_bool, m = live.mask, live.mask.to(logp.dtype)  # [B, T]

    n_tok, n_seq = normalisers(m, num_tokens_total, num_seqs_total)
    aggregate = AGGREGATIONS[loss.aggregation]
    pg = _policy_gradient_term(logp, old, adv, m_bool, entropy, sampler_logp, loss)
    pg_loss = aggregate(pg.loss, pg.mask, n_tok, n_seq, loss)
    value, kl_mean, ent_mean = _add_kl_and_entropy(
        pg_loss, logp, ref_logp, entropy, m_bool, aggregate, n_tok, n_seq, loss
    )

    if not with_metrics:
        return value, {}
    return value, _read({"loss": value.detach(), "pg_loss": pg_loss.detach(), "kl_mean": kl_mean,
                        "entropy_mean": ent_mean, "active_tokens": m.sum(), "num_nonfinite": live.num_nonfinite,
                        **_ratio_metrics(pg.ratio.detach(), pg.surr, m_bool), **pg.metrics})


def _read(metrics: dict[str, torch.Tensor | float]) -> dict[str, float]:
    """0-dim tensors and floats -> floats, with one device-to-host copy for all of them."""
    keys = [k for k, v in metrics.items() if isinstance(v, torch.Tensor)]
    if keys:
        values = torch.stack([metrics[k].detach().double() for k in keys]).tolist()
        metrics = {**metrics, **dict(zip(keys, values))}
    return {k: float(v) for k, v in metrics.items()}


@dataclass
class _PolicyGradient:
    """The policy-gradient term before aggregation."""

    loss: torch.Tensor  # [B, T] per-token loss, rollout correction applied, 0 off the top-entropy tokens
    mask: torch.Tensor  # [B, T] float: the tokens it is aggregated over (all active: the normalisers)
    ratio: torch.Tensor  # [B, T] importance ratio pi / pi_old
    surr: _Surrogate
    metrics: dict[str, float]  # mismatch and correction metrics (empty without sampler log-probs)


def _policy_gradient_term(logp, old, adv, m_bool, entropy, sampler_logp, r: ResolvedLoss) -> _PolicyGradient:
    """Ratio -> surrogate -> rollout-correction weight (old = pi_train: logp.detach() when on-policy)."""
    m = m_bool.to(logp.dtype)  # [B, T]
    ratio = RATIOS[r.ratio_level](logp, old, m)  # [B, T]
    surr = SURROGATES[r.surrogate](ratio, logp, adv, r)
    per_token, metrics = surr.loss, {}
    if r.entropy_top_quantile < 1:
        # The low-entropy tokens' terms are zeroed, not dropped from the mask: the aggregation must still divide
        # by every active token (Wang et al. 2025; docs/algorithms.md). Aggregating over the top-entropy mask
        # would make seq-mean-token-mean divide by each sequence's kept tokens, scaling its gradient by 1/q.
        per_token = per_token * _top_entropy_mask(entropy, m_bool, r.entropy_top_quantile).to(m.dtype)
    if sampler_logp is not None:
        metrics = mismatch_metrics(old, sampler_logp, m_bool)
        hit = 0.0
        if r.rollout_correction != "none":
            fix = rollout_correction(old, sampler_logp, m_bool, r)
            per_token = per_token * fix.weight
            hit = fix.hit.sum() / m_bool.sum().clamp_min(1)
        metrics["rollout_correction_frac"] = hit
    return _PolicyGradient(per_token, m, ratio, surr, metrics)


def _add_kl_and_entropy(loss, logp, ref_logp, entropy, m_bool, aggregate, n_tok, n_seq, r: ResolvedLoss):
    """loss + beta * KL(pi || pi_ref) - entropy_coef * entropy, aggregated like the policy term.

    Returns (loss, kl_mean, entropy_mean) with the means over active tokens, for metrics.
    """
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    m = m_bool.to(logp.dtype)  # [B, T]
    kl_mean = ent_mean = 0.0
    if r.beta > 0:
        d = torch.where(m_bool, ref_logp.to(logp.dtype), zero) - logp  # [B, T] log(pi_ref / pi)
        kl = KL_ESTIMATORS[r.kl_estimator](d.clamp(-r.kl_clamp, r.kl_clamp))  # [B, T]
        loss = loss + r.beta * aggregate(kl, m, n_tok, n_seq, r)
        kl_mean = _masked_mean(kl, m)
    if entropy is not None:
        ent = torch.where(m_bool, entropy.to(logp.dtype), zero)
        if r.entropy_coef > 0:
            loss = loss - r.entropy_coef * aggregate(ent, m, n_tok, n_seq, r)
        ent_mean = _masked_mean(ent, m)
    return loss, kl_mean, ent_mean


def _masked_mean(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return (x.detach() * m).sum() / m.sum().clamp_min(1)


def _ratio_metrics(ratio: torch.Tensor, surr: _Surrogate, m_bool: torch.Tensor) -> dict[str, torch.Tensor]:
    """Clip fractions and the ratio's min / mean / max over the active tokens (1 when there are none)."""
    one = torch.ones((), dtype=ratio.dtype, device=ratio.device)
    if ratio.numel() == 0:
        return {k: one - 1 if k.startswith("clip") else one for k in
                ("clip_frac_low", "clip_frac_high", "ratio_min", "ratio_mean", "ratio_max")}
    count = m_bool.sum()
    n = count.clamp_min(1)
    inf = torch.tensor(float("inf"), dtype=ratio.dtype, device=ratio.device)
    some = count > 0
    return {
        "clip_frac_low": (surr.clipped_low & m_bool).sum() / n,
        "clip_frac_high": (surr.clipped_high & m_bool).sum() / n,
        "ratio_min": torch.where(some, torch.where(m_bool, ratio, inf).min(), one),
        "ratio_mean": torch.where(some, torch.where(m_bool, ratio, 0).sum() / n, one),
        "ratio_max": torch.where(some, torch.where(m_bool, ratio, -inf).max(), one),
    }
