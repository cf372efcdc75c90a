"""The one decode front (generate.generate_rows): single-turn completions and multi-turn trajectories are rows of one
type, validated once, decoded in one call by the loop choose_loop picks; multi-turn rows refuse the static loop."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import nn

from grpo_engine.config import ConfigError
from grpo_engine.model.loading import load_model
from grpo_engine.rollout import SamplingParams, generate
from grpo_engine.rollout.chat_turns import render_first_prompt
from grpo_engine.rollout.generate import choose_loop, generate_rows
from grpo_engine.rollout.multiturn import run_multiturn
from grpo_engine.rollout.rows import Row, validate_rows
from grpo_engine.rollout.stop_strings import StopStrings
from grpo_engine.tasks.base import Example, Prompt
from grpo_engine.tasks.environment import StepResult, TrajectoryLimits


@dataclass
class EchoEnv:
    """Answers every turn with a tool message of `size` words, for 3 turns."""

    size: int
    limits: TrajectoryLimits = TrajectoryLimits(max_turns=3, max_tokens=200)
    tools: tuple = ()
    stop_strings: tuple = ()

    def reset(self, example):
        return Prompt([{"role": "user", "content": example.question}])

    def step(self, completion):
        return StepResult([{"role": "tool", "content": "ok " * self.size}], {"turn": 1.0}, 0.5)


def test_completions_and_trajectories_decode_together_as_alone(tiny_dir, tiny_tok):
    """One call of generate_rows with two prompts' completions and two trajectories in the same batch: with one
    seed per generator every row equals what generate and run_multiturn give it alone (float64: tokens equal,
    log-probs to 1e-10), though the trajectories' environment turns leave pad holes in the completions' rows."""
    model = load_model(tiny_dir, dtype=torch.float64)
    params = SamplingParams(max_new_tokens=8, stop_token_ids=list(range(100, 140)), compact_fraction=0.0)
    prompts = [tiny_tok.encode(q) for q in ("What is 2", "Hi!")]
    examples, envs = [Example("0", "Solve x", ""), Example("1", "Hi!", "")], [EchoEnv(2), EchoEnv(7)]
    alone_completions = generate(model, prompts, params, seed=[5, 6])
    alone_trajectories = run_multiturn(model, tiny_tok, envs, examples, params, seed=[7, 8])

    stops = StopStrings([], tiny_tok)
    rows = [Row(i, i, list(p), stops, params, len(p) + 8) for i, p in enumerate(prompts)]
    for i, (env, ex) in enumerate(zip(envs, examples)):
        ids = tiny_tok.encode(render_first_prompt(tiny_tok, env.reset(ex).messages, ""))
        rows.append(Row(2 + i, 2 + i, ids, stops, params, len(ids) + env.limits.max_tokens, env, tiny_tok))
    generate_rows(model, rows, params, seed=[5, 6, 7, 8], tokenizer=tiny_tok)

    assert any(t.metrics.env_tokens for t in alone_trajectories)  # environment turns did run
    for r, tokens, logps in zip(rows, alone_completions.completion_ids, alone_completions.logprobs):
        assert r.tokens[r.prompt_len :] == tokens and r.env is None
        torch.testing.assert_close(r.logps[r.prompt_len :], logps, atol=1e-10, rtol=0)
    for r, t in zip(rows[2:], alone_trajectories):
        assert (r.tokens, r.mask, r.finish, r.metrics) == (t.token_ids, t.loss_mask, t.finish_reason, t.metrics)
        torch.testing.assert_close(r.logps, t.logprobs, atol=1e-10, rtol=0)


class _OnCuda(nn.Module):
    """What choose_loop reads of a model: its device (here claimed to be CUDA) and its modules (no FSDP unit)."""

    device = torch.device("cuda")


def test_the_loop_is_chosen_by_the_rows(tiny_model):
    """On CUDA `auto` runs single-turn rows on CUDA graphs and multi-turn rows on the dynamic loop; `on` on a CPU
    fails for both; a compiled step keeps the dynamic loop."""
    auto, on = SamplingParams(), SamplingParams(cuda_graphs="on")
    assert choose_loop(_OnCuda(), auto, False, multi_turn=False) == "graphs"
    assert choose_loop(_OnCuda(), auto, False, multi_turn=True) == "dynamic"
    assert choose_loop(_OnCuda(), auto, True, multi_turn=False) == "dynamic"
    assert choose_loop(tiny_model, auto, False, multi_turn=False) == "dynamic"
    for multi_turn in (False, True):
        with pytest.raises(ConfigError, match="rollout.cuda_graphs=on needs a CUDA device"):
            choose_loop(tiny_model, on, False, multi_turn)


def test_multi_turn_rows_refuse_the_static_loop(tiny_model, tiny_tok):
    params = SamplingParams(max_new_tokens=4)
    ids = tiny_tok.encode("Hi!")
    row = Row(0, 0, ids, StopStrings([], tiny_tok), params, len(ids) + 10, EchoEnv(1), tiny_tok)
    for loop in ("static", "graphs", "fast"):
        with pytest.raises(ValueError, match=rf"loop='{loop}' cannot run these rows: pick one of dynamic, static"):
            generate_rows(tiny_model, [row], params, loop=loop)
    assert row.tokens == ids  # nothing decoded


def test_one_validation_names_the_row_and_the_fix(tiny_model, tiny_tok):
    params, stops, limit = SamplingParams(max_new_tokens=4), StopStrings([], tiny_tok), 8192
    completion = Row(3, 3, [], stops, params, 4)
    trajectory = Row(2, 0, [1, 2], stops, params, 2 + limit, EchoEnv(1), tiny_tok)
    with pytest.raises(ValueError, match=r"^prompt 3 is empty; every prompt needs at least one token"):
        validate_rows(tiny_model, [completion], params, None)
    with pytest.raises(ValueError, match=r"^trajectory 2: the first prompt \(2 tokens\) \+ the environment's "
                                         rf"max_tokens={limit} exceeds .* lower the environment's max_tokens"):
        validate_rows(tiny_model, [trajectory], params, None)
    with pytest.raises(ValueError, match="stop_strings need a tokenizer"):
        validate_rows(tiny_model, [], SamplingParams(stop_strings=["x"]), None)
