"""Longrope (Phi-3 / Phi-4-mini) in the one decode loop: a forward longer than original_max_position_embeddings
rotates every position by the long factors, so a row that passes it has every layer's keys and values prefilled again,
whole (static_decode.passes_rope_switch, static_turns.prefill_again), as transformers' Phi-3 generate does. Rows
crossing inside a chunk, at their first token, by their environment's tokens, and prompts past the switch (no shared
prefix then) all equal the reference decode (a full forward per token, whose factors follow the row's length; in
tests/model/test_families.py greedy decodes past the switch equal transformers' generate)."""

from __future__ import annotations

import pytest
import torch
from echo_env import EchoEnv
from reference_decode import reference_generate, reference_trajectories

from grpo_engine.model.loading import load_model, load_tokenizer
from grpo_engine.model.tiny import make_tiny_checkpoint
from grpo_engine.rollout import SamplingParams, generate, static_decode, static_turns
from grpo_engine.rollout.multiturn import run_multiturn
from grpo_engine.tasks.base import Example
from grpo_engine.tasks.environment import TrajectoryLimits

SWITCH = 40  # original_max_position_embeddings
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [2.0, 3.0, 4.0, 5.0],
            "original_max_position_embeddings": SWITCH}


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("phi3_longrope"), "phi3", seed=3, rope_scaling=LONGROPE,
                                max_position_embeddings=512)
    return load_model(path, dtype=torch.float64), load_tokenizer(path)


@pytest.fixture
def prefilled_again(monkeypatch):
    """The rows each prefill_again call took, as (tokens, tokens pending) pairs."""
    calls: list[list[tuple[int, int]]] = []
    real = static_turns.prefill_again

    def recorded(model, state, again, at, prompt_slots):
        calls.append([(len(r.tokens), len(r.pending)) for r in again])
        return real(model, state, again, at, prompt_slots)

    monkeypatch.setattr(static_decode, "prefill_again", recorded)
    return calls


def _assert_rows_equal(out, rows):
    assert out.completion_ids == [r.tokens[r.prompt_len :] for r in rows]
    for got, row in zip(out.logprobs, rows):
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64),
                                   torch.tensor(row.logps[row.prompt_len :], dtype=torch.float64), atol=1e-10, rtol=0)


def test_completions_past_the_switch_equal_the_reference(phi3, prefilled_again, monkeypatch):
    """Prompts of 5, 30, 40 (its first token takes it past the switch) and 45 tokens (prefilled with the long factors;
    two of them share a 30-token prefix, which is then not prefilled apart), 30 sampled tokens each: tokens and
    log-probs (float64, 1e-10) are the reference's; without the prefill again they are not."""
    model, _ = phi3
    torch.manual_seed(0)
    shared = torch.randint(3, 250, (30,)).tolist()
    prompts = [torch.randint(3, 250, (5,)).tolist(), shared, shared + torch.randint(3, 250, (10,)).tolist(),
               shared + torch.randint(3, 250, (15,)).tolist()]
    params = SamplingParams(n=2, temperature=0.9, max_new_tokens=30, stop_token_ids=[7])
    seeds = [1, 2, 3, 4]
    out = generate(model, prompts, params, seed=seeds)
    rows = reference_generate(model, prompts, params, seeds)
    _assert_rows_equal(out, rows)
    lengths = [n for call in prefilled_again for n, _ in call]
    assert SWITCH + 1 in lengths  # rows crossed inside a chunk / at their first token, and were prefilled again
    assert any(len(r.tokens) > SWITCH >= r.prompt_len for r in rows)

    monkeypatch.setattr(static_decode, "rope_switch", lambda cfg: None)  # the cache kept with the short factors
    stale = generate(model, prompts, params, seed=seeds)
    with pytest.raises(AssertionError):
        _assert_rows_equal(stale, rows)


def test_trajectories_past_the_switch_equal_the_reference(phi3, prefilled_again):
    """Tool turns of row-specific lengths take trajectories past the switch, some by their environment's tokens (a
    row prefilled again with more than one token pending): every trajectory equals the reference's."""
    model, tok = phi3
    params = SamplingParams(max_new_tokens=10, stop_token_ids=list(range(100, 130)))
    questions = ["Hi", "What is 2", "Go", "x?"]
    examples = [Example(str(i), q, "") for i, q in enumerate(questions)]
    envs = lambda: [EchoEnv(s, TrajectoryLimits(max_turns=4, max_tokens=200)) for s in (1, 9, 4, 14)]  # noqa: E731
    seeds = [5, 6, 7, 8]
    got = run_multiturn(model, tok, envs(), examples, params, seed=seeds)
    want = reference_trajectories(model, tok, envs(), examples, params, seeds)
    assert any(t.metrics.env_tokens for t in got)
    assert any(len(t.token_ids) > SWITCH >= t.metrics.prompt_tokens for t in got)
    assert any(pending > 1 for call in prefilled_again for _, pending in call)  # crossed by an environment feed
    for g, w in zip(got, want):
        assert (g.token_ids, g.loss_mask, g.finish_reason) == (w.token_ids, w.loss_mask, w.finish_reason)
        torch.testing.assert_close(g.logprobs, w.logprobs, atol=1e-10, rtol=0)
