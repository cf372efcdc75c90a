"""Sampling one token per row from logits, and the log-probability of that token.

The distribution we sample from is: logits / temperature, then top-k, then top-p (on the top-k
renormalised distribution), then min-p, each filter setting excluded tokens to -inf; what remains is
renormalised. Each draw reports two log-probs of the sampled token (`Draw`):

* `logp`: under the temperature-scaled FULL softmax, log softmax(logits / T). This is the distribution the
  trainer's log-probs describe (rl/logprobs.py divides by the same T), so the two differ only by numerics
  (bf16 decode vs the training forward): what the rollout-correction metrics measure (rl/correction.py).
* `filtered_logp`: under the filtered, renormalised distribution actually sampled from. It differs from
  `logp` by design when a filter is on (it is larger: the removed mass is renormalised away).

Without filters the two are the same tensor; with them the full one costs one log-sum-exp over [R, V].

Greedy (temperature == 0) returns the argmax and, by convention, log_softmax(logits) at that token (the
log-prob under the unscaled model distribution), since the "sampling distribution" is a point mass.

Cost matters on a 151,936-token vocabulary: filters that are off are not built at all (no sort unless
top_p < 1), and sampling uses one uniform number per row and a two-level inverse-CDF lookup instead of
torch.multinomial, whose exponential-race kernel draws V random numbers per row (~8x slower on CPU).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

SAMPLE_BLOCK = 1024  # vocabulary block of the two-level inverse-CDF search (sample_from_logits)
NAN_TOKEN = -1  # returned for a row with a NaN or +inf logit (the caller raises NonFiniteLogits; no extra host sync)


class NonFiniteLogits(FloatingPointError):
    """The policy produced NaN or +inf logits: its weights or activations have blown up (e.g. too high a learning
    rate) or overflowed."""
LogitFilter = Callable[[torch.Tensor], torch.Tensor]  # logits [R, V] -> logits [R, V] with -inf holes


@dataclass
class SamplingParams:
    """How to sample the completions of one generate() call, and the engine's memory knobs.

    n: completions per prompt (the GRPO group size G); they come back contiguous.
    temperature: 0 means greedy; otherwise logits are divided by it.
    top_k: keep the k most likely tokens (0 = off). top_p: keep the smallest set of most likely tokens whose
    mass reaches top_p (1 = off). min_p: keep tokens with prob >= min_p * max prob (0 = off).
    stop_token_ids: a completion ends after emitting one of these (it is kept in the completion).
    stop_strings: a completion ends after the token that completes one of these strings in the decoded
    completion (needs `tokenizer=` in generate). max_new_tokens: at most this many tokens per completion.
    max_tokens_in_flight: cap on rows x (padded prompt length + max_new_tokens) decoded at once, i.e. on
    KV-cache slots; prompts are processed in waves that fit. None = everything in one wave.
    cuda_graphs: how the decode runs its chunks (rollout.cuda_graphs): `auto` = captured in CUDA graphs on CUDA,
    eagerly elsewhere (and under FSDP2); `on` = CUDA graphs (CUDA only); `off` = eagerly.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_new_tokens: int = 256
    stop_token_ids: list[int] = field(default_factory=list)
    stop_strings: list[str] = field(default_factory=list)
    max_tokens_in_flight: int | None = 65536
    cuda_graphs: str = "auto"

    def __post_init__(self) -> None:
        checks = [
            (self.n >= 1, f"n={self.n} must be >= 1"),
            (self.temperature >= 0, f"temperature={self.temperature} must be >= 0 (0 = greedy)"),
            (0 < self.top_p <= 1, f"top_p={self.top_p} must be in (0, 1] (1 = off)"),
            (self.top_k >= 0, f"top_k={self.top_k} must be >= 0 (0 = off)"),
            (0 <= self.min_p < 1, f"min_p={self.min_p} must be in [0, 1) (0 = off)"),
            (self.max_new_tokens >= 1, f"max_new_tokens={self.max_new_tokens} must be >= 1"),
            (
                self.max_tokens_in_flight is None or self.max_tokens_in_flight > 0,
                f"max_tokens_in_flight={self.max_tokens_in_flight} must be positive or None",
            ),
            (all(s for s in self.stop_strings), "stop_strings must not contain an empty string"),
            (self.cuda_graphs in ("auto", "on", "off"), f"cuda_graphs={self.cuda_graphs!r}: use auto, on or off"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"SamplingParams: {message}")
        self.stop_token_ids = list(self.stop_token_ids)
        self.stop_strings = list(self.stop_strings)


# ----------------------------------------------------------------------------------------------------
# Filters: each keeps a support and sets the rest to -inf. Built only when switched on.


def top_k_filter(k: int) -> LogitFilter:
    def apply(logits: torch.Tensor) -> torch.Tensor:
        if k >= logits.shape[-1]:
            return logits
        kth = torch.topk(logits, k, dim=-1).values[:, -1:]  # [R, 1]
        return logits.masked_fill(logits < kth, float("-inf"))

    return apply


def top_p_filter(p: float) -> LogitFilter:
    def apply(logits: torch.Tensor) -> torch.Tensor:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # [R, V]
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs  # mass of strictly more likely tokens
        drop_sorted = mass_before >= p  # the first token always has mass_before 0 < p
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        return logits.masked_fill(drop, float("-inf"))

    return apply


def min_p_filter(min_p: float) -> LogitFilter:
    def apply(logits: torch.Tensor) -> torch.Tensor:
        # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p); no softmax needed.
        cut = logits.amax(dim=-1, keepdim=True) + math.log(min_p)  # [R, 1]
        return logits.masked_fill(logits < cut, float("-inf"))

    return apply


def build_filters(params: SamplingParams) -> list[LogitFilter]:
    """The active filters in application order: top-k, top-p, min-p."""
    filters = []
    if params.top_k > 0:
        filters.append(top_k_filter(params.top_k))
    if params.top_p < 1.0:
        filters.append(top_p_filter(params.top_p))
    if params.min_p > 0.0:
        filters.append(min_p_filter(params.min_p))
    return filters


# ----------------------------------------------------------------------------------------------------
# Samplers: logits [R, V] (fp32) -> tokens [R] long, logprobs [R] fp32.


class Draw(NamedTuple):
    """One decode step's draw for R rows."""

    tokens: torch.Tensor  # [R] long (NAN_TOKEN for a row with NaN or +inf logits)
    logp: torch.Tensor  # [R] fp32: log softmax(logits / T) at the token (greedy: unscaled log softmax)
    filtered_logp: torch.Tensor  # [R] fp32: log-prob under the filtered distribution sampled from


def _log_normaliser(logits: torch.Tensor) -> torch.Tensor:
    """[R, V] -> [R] log sum_j exp(logits_j): max + log of the shifted sum (cheaper than torch.logsumexp on CPU)."""
    top = logits.amax(dim=-1, keepdim=True)  # [R, 1]
    return top[:, 0] + torch.log(torch.exp(logits - top).sum(dim=-1))


def _broken(top: torch.Tensor) -> torch.Tensor:
    """[R] row maxima -> [R] bool: the row has a NaN logit (max propagates NaN) or a +inf one. Either makes the
    draw meaningless (inf - inf = NaN weights and log-prob), so the row is flagged rather than sampled."""
    return ~torch.isfinite(top)


def sample_greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    top, tokens = logits.max(dim=-1)  # [R], [R]
    tokens = torch.where(_broken(top), NAN_TOKEN, tokens)
    total = torch.exp(logits - top[:, None]).sum(dim=-1)  # [R]; cheaper than torch.logsumexp on CPU
    return tokens, -torch.log(total)  # log_softmax at the argmax: top - (top + log total)


def sample_from_logits(
    logits: torch.Tensor, generator: torch.Generator | None, block: int = SAMPLE_BLOCK,
    work: torch.Tensor | None = None, uniforms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse-CDF sampling with one uniform per row, searched in two levels to stay cheap on a big vocab.

    weights w = exp(logits - max) (unnormalised; -inf logits give exactly 0). The vocabulary is cut into
    blocks of `block` tokens: a uniform u in [0, total) picks the block through the cumsum of block sums
    ([R, V/block]), then the token inside that block through a cumsum of one block ([R, block]) — instead of
    a softmax plus a cumsum over all V. A token is drawn only if its weight is positive (a zero weight is a
    zero-width CDF step). log P(token) = logit - max - log(total). `work`: an optional reusable buffer of at
    least [R, V + pad] (see TokenSampler) so a decode loop does not allocate a fresh [R, V] per step. `uniforms`
    [R, 1] in [0, 1): the rows' random numbers when the caller draws them (per-prompt generators), else
    they come from `generator`.
    """
    R, V = logits.shape
    n_blocks = -(-V // block)
    # amax, not max(dim).values: the same values (NaN propagates too) without the indices, whose CPU reduction
    # costs several times more, once per decode step (docs/benchmarks.md)
    top = logits.amax(dim=-1, keepdim=True)  # [R, 1]
    fits = work is not None and work.shape[0] >= R and work.shape[1] == n_blocks * block and work.dtype == logits.dtype
    w = work[:R] if fits else logits.new_empty(R, n_blocks * block)  # [R, V + pad]; only the pad is zeroed
    w[:, V:].zero_()
    torch.sub(logits, top, out=w[:, :V]).exp_()  # [R, V] in [0, 1]
    blocks = w.view(R, n_blocks, block)
    block_cdf = blocks.sum(dim=-1).cumsum(dim=-1)  # [R, n_blocks]
    total = block_cdf[:, -1:]  # [R, 1]
    if uniforms is None:
        uniforms = torch.rand((R, 1), generator=generator, device=logits.device, dtype=w.dtype)
    u = uniforms.to(w.dtype) * total  # [R, 1]
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))  # u < total despite rounding
    b = torch.searchsorted(block_cdf, u, right=True)  # [R, 1]: first block whose cdf exceeds u (weight > 0)
    b = b.clamp(max=n_blocks - 1)  # a NaN / +inf row's search runs past the end: keep it in range; flagged below
    before = torch.where(b > 0, block_cdf.gather(-1, (b - 1).clamp(min=0)), 0.0)  # [R, 1]
    inner_cdf = blocks[torch.arange(R, device=w.device), b[:, 0]].cumsum(dim=-1)  # [R, block]
    # inside the block: u_in in (0, block total]; the first index with cdf >= u_in has a positive weight
    u_in = (u - before).clamp(min=torch.finfo(w.dtype).tiny)
    u_in = torch.minimum(u_in, inner_cdf[:, -1:])
    tokens = (b * block + torch.searchsorted(inner_cdf, u_in, right=False))[:, 0]  # [R]
    tokens = torch.where(_broken(top[:, 0]), NAN_TOKEN, tokens.clamp(max=V - 1))  # NaN / +inf logits: flagged
    chosen = logits.gather(-1, tokens.clamp(min=0)[:, None])[:, 0]  # [R]
    return tokens, chosen - top[:, 0] - torch.log(total[:, 0])


def sampling_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype logits are sampled in (and log-probs come out in): fp32, or float64 kept exact."""
    return torch.promote_types(dtype, torch.float32)


def work_buffer(rows: int, vocab: int, dtype: torch.dtype, device) -> torch.Tensor:
    """sample_from_logits' [rows, V + pad] buffer, made ahead of time (a captured decode step must not allocate
    one mid-replay: see rollout/static_decode.py)."""
    return torch.empty(rows, -(-vocab // SAMPLE_BLOCK) * SAMPLE_BLOCK, dtype=dtype, device=device)


class TokenSampler:
    """params -> a callable logits [R, V] -> Draw (tokens [R], full and filtered log-probs [R]), filters fixed once.

    `key`: the parameters the draw's computation depends on (a captured CUDA graph bakes them in).
    `work`: sample_from_logits' buffer, reused across decode steps; pass one (work_buffer) to fix its address."""

    def __init__(self, params: SamplingParams, work: torch.Tensor | None = None):
        self.temperature = params.temperature
        self.filters = build_filters(params) if params.temperature > 0 else []
        self.key = (params.temperature, params.top_k, params.top_p, params.min_p)
        self._work: torch.Tensor | None = work

    def __call__(self, logits: torch.Tensor, generator: torch.Generator | None = None,
                 uniforms: torch.Tensor | None = None) -> Draw:
        logits = logits.to(sampling_dtype(logits.dtype))  # fp32, or float64 kept exact
        if self.temperature == 0:
            tokens, logp = sample_greedy(logits)
            return Draw(tokens, logp, logp)
        if self.temperature != 1.0:
            logits = logits / self.temperature
        scaled = logits  # [R, V]; the filters below return new tensors, never write into it
        for f in self.filters:
            logits = f(logits)
        tokens, filtered = sample_from_logits(logits, generator, work=self._work_for(logits), uniforms=uniforms)
        if not self.filters:
            return Draw(tokens, filtered, filtered)
        chosen = scaled.gather(-1, tokens.clamp(min=0)[:, None])[:, 0]  # [R]
        return Draw(tokens, chosen - _log_normaliser(scaled), filtered)

    def _work_for(self, logits: torch.Tensor) -> torch.Tensor:
        """A [R, V + pad] buffer kept across calls: reused while rows only shrink (compaction)."""
        R, V = logits.shape
        width = -(-V // SAMPLE_BLOCK) * SAMPLE_BLOCK
        w = self._work
        if w is None or w.shape[0] < R or w.shape[1] != width or w.dtype != logits.dtype or w.device != logits.device:
            self._work = logits.new_empty(R, width)
        return self._work
