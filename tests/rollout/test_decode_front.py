"""The one decode front (generate.generate_rows): single-turn completions and multi-turn trajectories are rows of one
type, validated once, decoded in one call by the one loop (eager chunks or graphs: choose_loop), multi-turn rows
too, and equal to a reference decode by full forwards (reference_decode.py)."""

from __future__ import annotations

import itertools

import pytest
import torch
from echo_env import EchoEnv
from reference_decode import reference_trajectories
from torch import nn

from grpo_engine.config import ConfigError
from grpo_engine.model.loading import load_model
from grpo_engine.model.tiny import tiny_config
from grpo_engine.rollout import SamplingParams, generate
from grpo_engine.rollout.chat_turns import render_first_prompt
from grpo_engine.rollout.generate import choose_loop, generate_rows
from grpo_engine.rollout.multiturn import run_multiturn
from grpo_engine.rollout.rows import Row, validate_rows
from grpo_engine.rollout.stop_strings import StopStrings
from grpo_engine.tasks.base import Example
from grpo_engine.tasks.environment import TrajectoryLimits

LIMITS = TrajectoryLimits(max_turns=3, max_tokens=200)  # the echo environments' turns, unless a test says


def test_completions_and_trajectories_decode_together_as_alone(model64, tiny_tok):
    """One call of generate_rows with two prompts' completions and two trajectories in the same batch: with one
    seed per generator every row equals what generate and run_multiturn give it alone (float64: tokens equal,
    log-probs to 1e-10), though the trajectories' environment turns set rows back between chunks beside the
    completions. Greedy: a call's uniform table is as wide as its longest row may grow."""
    model, loop = model64, None
    params = SamplingParams(max_new_tokens=8, stop_token_ids=list(range(100, 140)), temperature=0.0)
    prompts = [tiny_tok.encode(q) for q in ("What is 2", "Hi!")]
    examples, envs = [Example("0", "Solve x", ""), Example("1", "Hi!", "")], [EchoEnv(2, LIMITS), EchoEnv(7, LIMITS)]
    alone_completions = generate(model, prompts, params, seed=[5, 6], loop=loop)
    alone_trajectories = run_multiturn(model, tiny_tok, envs, examples, params, seed=[7, 8], loop=loop)

    stops = StopStrings([], tiny_tok)
    rows = [Row(i, i, list(p), stops, params, len(p) + 8) for i, p in enumerate(prompts)]
    for i, (env, ex) in enumerate(zip(envs, examples)):
        ids = tiny_tok.encode(render_first_prompt(tiny_tok, env.reset(ex).messages, ""))
        rows.append(Row(2 + i, 2 + i, ids, stops, params, len(ids) + env.limits.max_tokens, env, tiny_tok))
    generate_rows(model, rows, params, seed=[5, 6, 7, 8], tokenizer=tiny_tok, loop=loop)

    assert any(t.metrics.env_tokens for t in alone_trajectories)  # environment turns did run
    for r, tokens, logps in zip(rows, alone_completions.completion_ids, alone_completions.logprobs):
        assert r.tokens[r.prompt_len :] == tokens and r.env is None
        torch.testing.assert_close(r.logps[r.prompt_len :], logps, atol=1e-10, rtol=0)
    for r, t in zip(rows[2:], alone_trajectories):
        assert (r.tokens, r.mask, r.finish, r.metrics) == (t.token_ids, t.loss_mask, t.finish_reason, t.metrics)
        torch.testing.assert_close(r.logps, t.logprobs, atol=1e-10, rtol=0)


def full_forward_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """[N - 1]: each token's log-prob under one forward over the whole trajectory."""
    with torch.no_grad():
        logits = model(torch.tensor([token_ids]))[0]  # [N, V]
    return torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(token_ids[1:])[:, None])[:, 0]


def test_trajectories_on_the_static_decode(model64, tiny_tok):
    """Multi-turn rows on the decode cache (float64, sampled, per-trajectory seeds): each turn ends inside a chunk at
    another step, rows finish at other chunks (bucket moves), and yet every trajectory equals the reference decode's
    (each row alone by full forwards: tokens, loss mask, metrics, finish; log-probs to 1e-10), and its log-probs
    equal one full forward over it to 1e-10."""
    params = SamplingParams(max_new_tokens=9, stop_token_ids=list(range(100, 140)))
    questions = ["What is 2", "Hi!", "Solve x for me", "What is 2", "Go"]
    examples = [Example(str(i), q, "") for i, q in enumerate(questions)]
    limits = [TrajectoryLimits(4, 400), TrajectoryLimits(2, 400), TrajectoryLimits(4, 60), TrajectoryLimits(3, 400),
              TrajectoryLimits(4, 400)]
    envs = lambda: [EchoEnv(s, lim) for s, lim in zip((1, 9, 3, 12, 5), limits)]  # noqa: E731
    seeds = [11, 22, 33, 44, 55]
    static = run_multiturn(model64, tiny_tok, envs(), examples, params, seed=seeds, loop="static")
    reference = reference_trajectories(model64, tiny_tok, envs(), examples, params, seeds)
    turns = [[len(list(g)) for m, g in itertools.groupby(t.loss_mask) if m] for t in static]
    assert sum(len(t) > 1 for t in turns) >= 3 and len({tuple(t) for t in turns}) >= 4  # turns end at other steps
    assert len({len(t.token_ids) for t in static}) == len(static)  # rows end at other steps
    for s, d in zip(static, reference):
        assert (s.token_ids, s.loss_mask, s.finish_reason, s.metrics) == (d.token_ids, d.loss_mask, d.finish_reason,
                                                                          d.metrics)
        torch.testing.assert_close(s.logprobs, d.logprobs, atol=1e-10, rtol=0)
        policy = torch.tensor(s.loss_mask[1:], dtype=torch.bool)
        torch.testing.assert_close(torch.tensor(s.logprobs[1:], dtype=torch.float64)[policy],
                                   full_forward_logprobs(model64, s.token_ids)[policy], atol=1e-10, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_trajectories_on_cuda_graphs_equal_the_eager_static_decode(tiny_dir, tiny_tok):
    """On CUDA, `on` runs trajectories on CUDA graphs: the environment's tokens go in between replays, and every
    trajectory equals the eager static decode's (fp32 greedy: tokens; log-probs to 1e-5)."""
    from grpo_engine.rollout.static_decode import release_static_decode, static_decode_stats

    model = load_model(tiny_dir, dtype=torch.float32, device="cuda")
    params = SamplingParams(max_new_tokens=9, temperature=0.0, stop_token_ids=list(range(100, 140)), cuda_graphs="on")
    examples = [Example(str(i), q, "") for i, q in enumerate(["What is 2", "Hi!", "Solve x for me"])]
    envs = lambda: [EchoEnv(s, TrajectoryLimits(4, 300)) for s in (1, 9, 3)]  # noqa: E731
    graphs = run_multiturn(model, tiny_tok, envs(), examples, params, seed=[1, 2, 3])
    assert static_decode_stats(model)["captures"] > 0 and static_decode_stats(model)["fallback"] is None
    eager = run_multiturn(model, tiny_tok, envs(), examples, params, seed=[1, 2, 3], loop="static")
    assert sum(t.metrics.env_tokens for t in graphs) > 0
    for g, e in zip(graphs, eager):
        assert g.token_ids == e.token_ids and g.loss_mask == e.loss_mask
        torch.testing.assert_close(g.logprobs, e.logprobs, atol=1e-5, rtol=0)
    release_static_decode(model)


class _OnCuda(nn.Module):
    """What choose_loop reads of a model: its device (here claimed to be CUDA), its modules (no FSDP unit) and its
    config's rope (longrope decodes in eager chunks)."""

    device = torch.device("cuda")

    def __init__(self, rope_scaling: dict | None = None):
        super().__init__()
        self.config = tiny_config("phi3", rope_scaling=rope_scaling)


def test_the_loop_choice(tiny_model, tiny_tok):
    """On CUDA `auto` and `on` run completions and trajectories on CUDA graphs, a longrope model eager chunks under
    `auto` (its rows are prefilled again past the switch between chunks) and `on` refused for it; on a CPU eager
    chunks, and `on` fails in one line; a loop that is neither is refused (`dynamic`, a removed loop's name, too)."""
    auto, on, off = SamplingParams(), SamplingParams(cuda_graphs="on"), SamplingParams(cuda_graphs="off")
    assert choose_loop(_OnCuda(), auto) == "graphs" and choose_loop(_OnCuda(), on) == "graphs"
    assert choose_loop(_OnCuda(), off) == "static" and choose_loop(tiny_model, auto) == "static"
    longrope = _OnCuda({"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4,
                        "original_max_position_embeddings": 16})
    assert choose_loop(longrope, auto) == "static"  # rows are prefilled again past the switch
    with pytest.raises(ConfigError, match="rollout.cuda_graphs=on cannot decode a longrope model"):
        choose_loop(longrope, on)
    with pytest.raises(ConfigError, match="rollout.cuda_graphs=on needs a CUDA device"):
        run_multiturn(tiny_model, tiny_tok, [EchoEnv(1, LIMITS)], [Example("0", "Hi!", "")], on)
    ids = tiny_tok.encode("Hi!")
    row = Row(0, 0, ids, StopStrings([], tiny_tok), auto, len(ids) + 10, EchoEnv(1, LIMITS), tiny_tok)
    for loop in ("fast", "dynamic"):
        with pytest.raises(ValueError, match=rf"^loop='{loop}' is not a decode loop: pick one of static, graphs$"):
            generate_rows(tiny_model, [row], auto, loop=loop)
    assert row.tokens == ids  # nothing decoded


def test_one_validation_names_the_row_and_the_fix(tiny_model, tiny_tok):
    params, stops, limit = SamplingParams(max_new_tokens=4), StopStrings([], tiny_tok), 8192
    completion = Row(3, 3, [], stops, params, 4)
    trajectory = Row(2, 0, [1, 2], stops, params, 2 + limit, EchoEnv(1, LIMITS), tiny_tok)
    with pytest.raises(ValueError, match=r"^prompt 3 is empty; every prompt needs at least one token"):
        validate_rows(tiny_model, [completion], params, None)
    with pytest.raises(ValueError, match=r"^trajectory 2: the first prompt \(2 tokens\) \+ the environment's "
                                         rf"max_tokens={limit} exceeds .* lower the environment's max_tokens"):
        validate_rows(tiny_model, [trajectory], params, None)
    with pytest.raises(ValueError, match="stop_strings need a tokenizer"):
        validate_rows(tiny_model, [], SamplingParams(stop_strings=["x"]), None)


def test_a_stop_string_is_matched_in_the_turn_only(tiny_tok):
    """A row holds its prompt too: a stop string that the prompt's end and the turn's first tokens spell together
    does not end the turn; one the turn spells alone does, at its last token."""
    params = SamplingParams(max_new_tokens=40)
    prompt, turn = tiny_tok.encode("Say: Ans"), tiny_tok.encode("wer Answer and more")
    row = Row(0, 0, list(prompt), StopStrings(["Answer"], tiny_tok), params, len(prompt) + 40)
    for token in turn:
        if row.finished:
            break
        row.take(token, -1.0, -1.0)
    completion = tiny_tok.decode(row.tokens[row.prompt_len :])
    assert row.finish == "stop" and completion == "wer Answer", completion
    assert row.mask == [0] * len(prompt) + [1] * (len(row.tokens) - len(prompt))
