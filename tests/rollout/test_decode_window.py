"""The static decode attends over the live length (rollout/static_cache.py window_for): each chunk's attention reads
slots [0, W] with W the rows' largest write slot plus CHUNK rounded up to WINDOW_ROUNDING (at most the state's S),
and the outputs are those of a reference decode by full forwards (float64), single-turn and multi-turn (environment
tokens move a row's write slot on between chunks)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from echo_env import EchoEnv
from reference_decode import reference_generate, reference_trajectories

from grpo_engine.rollout import SamplingParams, static_cache
from grpo_engine.rollout.generate import generate_static
from grpo_engine.rollout.multiturn import run_multiturn
from grpo_engine.rollout.static_decode import release_static_decode
from grpo_engine.tasks.base import Example
from grpo_engine.tasks.environment import TrajectoryLimits

ROUNDING = 16


@pytest.fixture
def attended(model64, monkeypatch):
    """The key lengths each decode-step attention call of model64 reads (SDPA behind a recorder), with windows
    rounded to 16 slots so that the tiny test's rows cross several."""
    monkeypatch.setattr(static_cache, "WINDOW_ROUNDING", ROUNDING)
    lengths: list[int] = []

    def recorded(q, k, v, mask):
        lengths.append(k.shape[2])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])

    kernels = model64.kernels
    model64.kernels = replace(kernels, decode_attention=recorded)
    release_static_decode(model64)
    yield lengths
    model64.kernels = kernels
    release_static_decode(model64)


def test_a_chunk_attends_over_the_live_length_rounded_up(model64, prompts, attended, eager_decoders):
    """Prompts of up to 13 tokens (L = 13 slots), 60 new tokens (S = 128 slots: 73 rounded up to 64s): chunk i reads
    min(S, roundup(13 + 16 i + 16, 16)) + 1 slots in every step and layer (33, 49, 65, 81, ..., not 129 from the
    first step), each eager chunk 16 steps but the last, whose 11 are the steps the rows have left (59 after the
    prefill's token); the tokens and log-probs are the reference decode's, and the decoder counts the slots read."""
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=60)
    static = generate_static(model64, prompts, params)
    (decoder,) = eager_decoders
    decoder_slots = decoder.state.slots
    assert decoder_slots == 128
    layers, L = len(model64.layers), max(len(p) for p in prompts)
    steps_per_chunk = static_cache.CHUNK * layers
    chunks = [attended[i : i + steps_per_chunk] for i in range(0, len(attended), steps_per_chunk)]
    want = [min(decoder_slots, -(-(L + 16 * i + 16) // ROUNDING) * ROUNDING) + 1 for i in range(len(chunks))]
    assert [set(c) for c in chunks] == [{w} for w in want]
    assert want[:4] == [33, 49, 65, 81] and want[-1] <= decoder_slots + 1
    rows, steps = 16, [16, 16, 16, 11]  # every row runs max_new_tokens: the bucket stays 16
    assert [len(c) // layers for c in chunks] == steps
    assert decoder.slots_read == sum(n * rows * w for n, w in zip(steps, want))
    reference = reference_generate(model64, prompts, params, [0] * len(prompts))
    assert static.completion_ids == [r.tokens[r.prompt_len :] for r in reference]
    for a, b in zip(static.logprobs, [r.logps[r.prompt_len :] for r in reference]):
        torch.testing.assert_close(torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64),
                                   atol=1e-10, rtol=0)


def test_window_for():
    assert static_cache.window_for(13, 1000) == 64  # 13 + 16 = 29 -> 64 (the engine's rounding)
    assert static_cache.window_for(48, 1000) == 64 and static_cache.window_for(49, 1000) == 128
    assert static_cache.window_for(990, 1000) == 1000  # never past S: the state's scratch slot


def test_environment_turns_widen_the_window_and_trajectories_equal_the_reference(model64, tiny_tok, attended):
    """Environment tokens fed between chunks move rows' writes past what the chunks alone would: the windows cover
    them (a row never writes past its chunk's scratch slot), and every trajectory equals the reference decode's."""
    params = SamplingParams(max_new_tokens=9, stop_token_ids=list(range(100, 140)))
    questions = ["What is 2", "Hi!", "Solve x for me", "Go"]
    examples = [Example(str(i), q, "") for i, q in enumerate(questions)]
    envs = lambda: [EchoEnv(s, TrajectoryLimits(max_turns=4, max_tokens=400)) for s in (1, 9, 3, 12)]  # noqa: E731
    static = run_multiturn(model64, tiny_tok, envs(), examples, params, seed=[1, 2, 3, 4], loop="static")
    assert any(t.metrics.env_tokens for t in static)
    assert len(set(attended)) > 2  # the window grew with the rows
    reference = reference_trajectories(model64, tiny_tok, envs(), examples, params, [1, 2, 3, 4])
    for s, d in zip(static, reference):
        assert (s.token_ids, s.loss_mask, s.finish_reason) == (d.token_ids, d.loss_mask, d.finish_reason)
        torch.testing.assert_close(s.logprobs, d.logprobs, atol=1e-10, rtol=0)
