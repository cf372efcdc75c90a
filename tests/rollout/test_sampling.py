"""TokenSampler on a tiny hand-made vocabulary: exact support, renormalised (filtered) and full-softmax log-probs,
chi-square frequencies."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_engine.rollout.sampling import NAN_TOKEN, SamplingParams, TokenSampler, sample_from_logits

PROBS = [0.40, 0.25, 0.15, 0.10, 0.06, 0.04]  # token i has probability PROBS[i]
# chi-square critical values at p = 0.001 for df = 1..5 (tables)
CHI2_CRIT = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}


def draw(params: SamplingParams, rows: int = 20000, seed: int = 0, probs=PROBS):
    logits = torch.log(torch.tensor(probs)).expand(rows, -1).contiguous()  # [rows, V]
    g = torch.Generator().manual_seed(seed)
    return TokenSampler(params)(logits, g)


def check(params: SamplingParams, expected_probs: dict[int, float], probs=PROBS, full=None) -> None:
    """full: token -> its probability under the temperature-scaled unfiltered softmax (default: PROBS itself)."""
    tokens, logp, filtered = draw(params, probs=probs)
    full = full or dict(enumerate(probs))
    counts = torch.bincount(tokens, minlength=len(probs))
    support = sorted(expected_probs)
    assert sorted(torch.nonzero(counts)[:, 0].tolist()) == support  # exact support
    for t in support:  # filtered log-prob = log of the renormalised probability of the drawn token
        assert torch.allclose(filtered[tokens == t], torch.tensor(math.log(expected_probs[t])), atol=1e-5)
        # recorded log-prob = the unfiltered temperature-scaled one (what the trainer computes)
        assert torch.allclose(logp[tokens == t], torch.tensor(math.log(full[t])), atol=1e-5)
    n = len(tokens)
    chi2 = sum((counts[t].item() - n * p) ** 2 / (n * p) for t, p in expected_probs.items())
    if len(support) > 1:
        assert chi2 < CHI2_CRIT[len(support) - 1], (chi2, counts.tolist())


def renorm(ids):
    z = sum(PROBS[i] for i in ids)
    return {i: PROBS[i] / z for i in ids}


def test_plain_sampling_frequencies():
    check(SamplingParams(), renorm(range(6)))


def test_temperature_scales_logits():
    # p_i ** (1/T) renormalised, T = 0.5 -> p_i^2
    sq = [p * p for p in PROBS]
    squared = {i: q / sum(sq) for i, q in enumerate(sq)}
    check(SamplingParams(temperature=0.5), squared, full=squared)


def test_temperature_then_top_k_full_logp_is_unfiltered():
    # T = 0.5 -> p_i^2 / sum p^2 = [.16, .0625, ...] / .2602 = [.6149, .2402, .0865, .0384, .0138, .0061];
    # top_k = 2 renormalises the first two (.16 / .2225 = .7191, .2809) for sampling, but the recorded
    # log-prob stays log(p_i^2 / sum p^2)
    sq = [p * p for p in PROBS]
    squared = {i: q / sum(sq) for i, q in enumerate(sq)}
    two = {0: sq[0] / (sq[0] + sq[1]), 1: sq[1] / (sq[0] + sq[1])}
    assert two[0] == pytest.approx(0.7191, abs=1e-4) and squared[0] == pytest.approx(0.6149, abs=1e-4)
    check(SamplingParams(temperature=0.5, top_k=2), two, full=squared)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_top_k(k):
    check(SamplingParams(top_k=k), renorm(range(k)))


@pytest.mark.parametrize(
    "p, kept",
    [(0.3, 1), (0.6, 2), (0.65, 2), (0.66, 3), (0.8, 3), (0.81, 4), (0.95, 5), (1.0, 6)],
)
def test_top_p(p, kept):
    # mass of strictly more likely tokens: 0, .40, .65, .80, .90, .96 -> keep tokens whose mass before < p
    check(SamplingParams(top_p=p), renorm(range(kept)))


@pytest.mark.parametrize("min_p, kept", [(0.1, 6), (0.2, 4), (0.3, 3), (0.5, 2), (0.7, 1)])
def test_min_p(min_p, kept):
    # keep p_i >= min_p * 0.40: thresholds .04, .08, .12, .20, .28
    check(SamplingParams(min_p=min_p), renorm(range(kept)))


def test_top_k_then_top_p_on_the_renormalised_top_k():
    # top_k=3 leaves .40/.80=.5, .25/.80=.3125, .15/.80=.1875; top_p=0.75: mass before .5 < .75 keeps token 1
    check(SamplingParams(top_k=3, top_p=0.75), renorm(range(2)))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.5, min_p=0.2),  # min-p on the temperature-scaled distribution
        SamplingParams(temperature=1.7, top_k=40, top_p=0.8, min_p=0.05),  # top_k > V: a no-op
        SamplingParams(temperature=0.8, top_k=7, top_p=1.0, min_p=0.3),
        SamplingParams(temperature=1.3, top_k=5, top_p=0.6),
    ],
)
def test_filters_keep_what_transformers_warpers_keep(params):
    """The support after temperature -> top-k -> top-p -> min-p is transformers' (its warpers in its order), and the
    filtered log-prob is log softmax of the kept scaled logits. Continuous random logits: no boundary ties."""
    warp = pytest.importorskip("transformers.generation.logits_process")
    logits = torch.randn(64, 30, generator=torch.Generator().manual_seed(0)) * 3  # [R, V]
    ref = warp.TemperatureLogitsWarper(params.temperature)(None, logits.clone())
    for on, warper in [(params.top_k > 0, warp.TopKLogitsWarper(max(params.top_k, 1))),
                       (params.top_p < 1, warp.TopPLogitsWarper(params.top_p)),
                       (params.min_p > 0, warp.MinPLogitsWarper(max(params.min_p, 1e-9)))]:
        ref = warper(None, ref) if on else ref
    sampler = TokenSampler(params)
    draw = sampler(logits, torch.Generator().manual_seed(1))
    assert torch.isfinite(ref).gather(-1, draw.tokens[:, None]).all()
    scaled = logits / params.temperature
    for f in sampler.filters:
        scaled = f(scaled)
    assert torch.equal(torch.isfinite(scaled), torch.isfinite(ref))
    expect = torch.log_softmax(ref.double(), -1).gather(-1, draw.tokens[:, None])[:, 0]
    torch.testing.assert_close(draw.filtered_logp.double(), expect, atol=1e-5, rtol=0)


def test_greedy_is_argmax_with_unscaled_logprob():
    tokens, logp, filtered = draw(SamplingParams(temperature=0.0), rows=3)
    assert tokens.tolist() == [0, 0, 0]
    assert torch.allclose(logp, torch.tensor(math.log(0.40)), atol=1e-6) and torch.equal(filtered, logp)


def test_no_filter_full_and_filtered_are_one_tensor():
    out = draw(SamplingParams(temperature=0.7), rows=4)
    assert out.filtered_logp is out.logp


def test_masked_tokens_are_never_drawn_across_blocks():
    # Large vocab, block size 8: only 3 scattered tokens have weight, one in the padded last block.
    V = 53
    logits = torch.full((30000, V), float("-inf"))
    logits[:, [2, 17, 50]] = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    tokens, logp = sample_from_logits(logits, torch.Generator().manual_seed(1), block=8)
    counts = torch.bincount(tokens, minlength=V)
    assert torch.nonzero(counts)[:, 0].tolist() == [2, 17, 50]
    exp = {2: 0.5, 17: 0.3, 50: 0.2}
    chi2 = sum((counts[t].item() - 30000 * p) ** 2 / (30000 * p) for t, p in exp.items())
    assert chi2 < CHI2_CRIT[2]
    assert torch.allclose(logp, torch.log(torch.tensor([exp[t] for t in tokens.tolist()])), atol=1e-6)


def test_same_generator_seed_same_draws():
    a = draw(SamplingParams(top_p=0.9), rows=100, seed=5).tokens
    b = draw(SamplingParams(top_p=0.9), rows=100, seed=5).tokens
    c = draw(SamplingParams(top_p=0.9), rows=100, seed=6).tokens
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize(
    "bad",
    [
        dict(temperature=-1), dict(top_p=0), dict(top_k=-1), dict(min_p=1.0), dict(n=0),
        dict(max_new_tokens=0), dict(stop_strings=[""]), dict(max_tokens_in_flight=0),
    ],
)
def test_bad_params_are_clear_errors(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)



@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("params", [dict(), dict(top_k=3), dict(top_p=0.8), dict(min_p=0.1), dict(temperature=0.0)])
def test_non_finite_rows_are_flagged(params, bad):
    """A row with a NaN or +inf logit (a blown-up or overflowed model) comes back as NAN_TOKEN, so generate raises
    NonFiniteLogits; the other rows still draw. (NaN used to raise IndexError: the block search ran past the
    last block; +inf used to return an arbitrary token with a NaN log-prob.)"""
    logits = torch.log(torch.tensor(PROBS)).expand(3, -1).contiguous()  # [3, V]
    logits[1, 2] = bad
    tokens = TokenSampler(SamplingParams(**params))(logits, torch.Generator().manual_seed(0)).tokens
    assert tokens[1] == NAN_TOKEN and all(0 <= t < len(PROBS) for t in tokens[[0, 2]].tolist())
    tokens, _ = sample_from_logits(logits, torch.Generator().manual_seed(0), block=4)  # several blocks
    assert tokens[1] == NAN_TOKEN and all(0 <= t < len(PROBS) for t in tokens[[0, 2]].tolist())
