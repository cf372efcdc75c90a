"""run_multiturn: exact trajectories of a scripted policy (tokens, loss mask, metrics), log-probs equal to one
full forward over the trajectory, the single-turn adapter equal to generate(), and the limits."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from echo_env import EchoEnv
from torch import nn

from grpo_engine.model.config import ModelConfig
from grpo_engine.model.kernels_slot import Kernels
from grpo_engine.rollout import SamplingParams, generate
from grpo_engine.rollout.chat_turns import tools_paragraph
from grpo_engine.rollout.multiturn import run_multiturn
from grpo_engine.tasks.base import Example, Prompt, RewardResult, render_prompt, safe_reward
from grpo_engine.tasks.environment import StepResult, TaskEnvironment, ToolEnvironment, TrajectoryLimits
from grpo_engine.tasks.tools import BUILTIN_TOOLS, ToolSet


class ContainsTask:
    """Reward 1 when the reference answer appears in the completion."""

    name = "contains"

    def examples(self, split):
        return []

    def prompt(self, example):
        return Prompt([{"role": "user", "content": example.question}])

    def reward(self, example, completion):
        hit = float(f"Answer: {example.answer}" in completion)
        return RewardResult(hit, {"answer": hit}, None)

    def equivalent(self, a, b):
        return a == b


MARGIN = 10.0


class ScriptedModel(nn.Module):
    """A stand-in policy whose next token is a function of the row's whole visible history.

    Its KV cache (1 layer, 1 KV head, head_dim 1) stores each slot's token id, so the cache and the key mask
    give back exactly the sequence the sampler fed -- left padding, the scratch slot, rows set back and fed between
    chunks and bucket moves included. The LM head is the identity and the hidden state MARGIN * one-hot(next
    token), so greedy decoding emits the script, each token with log-prob -log(1 + (V - 1) exp(-MARGIN)).
    """

    def __init__(self, vocab: int, policy):
        super().__init__()
        self.config = ModelConfig(vocab_size=vocab, hidden_size=vocab, intermediate_size=1, num_hidden_layers=1,
                                  num_attention_heads=1, num_key_value_heads=1, head_dim=1,
                                  max_position_embeddings=8192)
        self.embed = nn.Embedding(1, 1)  # only its dtype and device are read
        self.lm_head = nn.Linear(vocab, vocab, bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(torch.eye(vocab))
        self.kernels = Kernels()  # torch's products, as a Transformer's before kernels.apply_kernels
        self.policy = policy

    @property
    def device(self):
        return self.embed.weight.device

    def forward(self, ids, attention_mask, *, cache, return_hidden, positions=None):
        B, T = ids.shape
        start = cache.start
        slots = ids.float()[:, None, :, None]  # [B, 1, T, 1]
        keys, _ = cache.update(0, slots, slots)  # [B, 1, start + T, 1]
        cache.start = start + T
        out = torch.zeros(B, T, self.config.vocab_size)
        seen = attention_mask.bool().clone()  # [B, start + T]
        seen[:, -1] = True  # the last query sees its own slot, as the Transformer's mask lets it (a scratch slot)
        for b in range(B):
            history = keys[b, 0, :, 0][seen[b]].long().tolist()
            out[b, -1, self.policy(history)] = MARGIN
        return out


def script_policy(tok, scripts: dict[str, list[str]]):
    """next token = the script's next token for (the question in the history, the current assistant turn)."""
    header, eos = tok.encode("<|im_start|>assistant\n"), tok.eos_token_ids[0]

    def policy(history: list[int]) -> int:
        starts = [i + len(header) for i in range(len(history)) if history[i : i + len(header)] == header]
        text = tok.decode(history)
        turns = next((s for q, s in scripts.items() if q in text), None)
        if turns is None or not starts:  # a prefix shared by every prompt (prefilled once): no answer asked yet
            return eos
        target = tok.encode(turns[len(starts) - 1])
        produced = len(history) - starts[-1]
        return target[produced] if produced < len(target) else eos

    return policy


CALL = '<tool_call>{{"name": "{name}", "arguments": {{"expression": "{expr}"}}}}</tool_call>'
SCRIPTS = {
    "What is 2+3?": [CALL.format(name="calculator", expr="2+3"), "Answer: 5<|im_end|>"],
    "Say hi": ["Answer: hi<|im_end|>"],
    "What is 2*4?": [CALL.format(name="calculator", expr="2**4"), "<tool_call>{oops</tool_call>",
                     "Answer: 8<|im_end|>"],
}
ANSWERS = {"What is 2+3?": "5", "Say hi": "hi", "What is 2*4?": "8"}


def expected_trajectory(tok, question: str, env_turns: list[str]):
    """(ids, mask): the prompt, then script turns (mask 1) interleaved with the environment's turns (mask 0)."""
    decls = ToolSet(list(BUILTIN_TOOLS.values())).declarations()
    prompt = (f"<|im_start|>system\n{tools_paragraph(decls)}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
              "<|im_start|>assistant\n")
    pieces = [(prompt, 0)]
    for i, turn in enumerate(SCRIPTS[question]):
        pieces.append((turn, 1))
        if i < len(env_turns):
            pieces.append((env_turns[i], 0))
    ids = [t for text, _ in pieces for t in tok.encode(text)]
    mask = [m for text, m in pieces for _ in tok.encode(text)]
    return ids, mask


def tool_turn(content: str) -> str:
    return (f"<|im_end|>\n<|im_start|>user\n<tool_response>\n{content}\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n")


def tool_envs(n: int, limits: TrajectoryLimits | None = None):
    limits = limits or TrajectoryLimits(max_turns=4, max_tokens=1500)
    return [ToolEnvironment(ContainsTask(), ToolSet(list(BUILTIN_TOOLS.values())), limits) for _ in range(n)]


def test_scripted_tool_trajectories_are_token_exact(tiny_tok):
    questions = list(SCRIPTS)
    model = ScriptedModel(272, script_policy(tiny_tok, SCRIPTS))
    examples = [Example(str(i), q, ANSWERS[q]) for i, q in enumerate(questions)]
    params = SamplingParams(temperature=0.0, max_new_tokens=200, stop_token_ids=tiny_tok.eos_token_ids)
    out = run_multiturn(model, tiny_tok, tool_envs(3), examples, params)
    env_turns = {
        "What is 2+3?": [tool_turn("5")],
        "Say hi": [],
        "What is 2*4?": [tool_turn("Error: invalid expression: exponentiation is not allowed"),
                         tool_turn("Error: tool call is not valid JSON (Expecting property name enclosed in double "
                                   "quotes: line 1 column 2 (char 1))")],
    }
    for q, traj in zip(questions, out):
        ids, mask = expected_trajectory(tiny_tok, q, env_turns[q])
        assert traj.token_ids == ids
        assert traj.loss_mask == mask
        scripted = -math.log(1 + 271 * math.exp(-MARGIN))
        assert traj.logprobs == pytest.approx([scripted * m for m in mask], abs=1e-6)
        assert traj.finish_reason == "done" and traj.reward == 1.0
    m = [t.metrics for t in out]
    assert [(x.turns, x.tool_calls, x.tool_errors) for x in m] == [(2, 1, 0), (1, 0, 0), (3, 2, 2)]
    assert [x.prompt_tokens + x.model_tokens + x.env_tokens for x in m] == [len(t.token_ids) for t in out]
    assert m[0].model_tokens == len(tiny_tok.encode(SCRIPTS["What is 2+3?"][0] + "Answer: 5")) + 1
    assert m[0].env_tokens == len(tiny_tok.encode(tool_turn("5")))
    assert out[2].reward_components == {"tool_errors": 2.0, "answer": 1.0}


def test_scripted_limits_end_trajectories(tiny_tok):
    model = ScriptedModel(272, script_policy(tiny_tok, SCRIPTS))
    q = "What is 2*4?"
    params = SamplingParams(temperature=0.0, max_new_tokens=200, stop_token_ids=tiny_tok.eos_token_ids)
    turns_cut = run_multiturn(model, tiny_tok, tool_envs(1, TrajectoryLimits(max_turns=2, max_tokens=1500)),
                              [Example("0", q, "8")], params)[0]
    assert (turns_cut.finish_reason, turns_cut.metrics.turns, turns_cut.reward) == ("max_turns", 2, 0.0)
    ids, _ = expected_trajectory(tiny_tok, q, [tool_turn("Error: invalid expression: exponentiation is not allowed")])
    first_call_end = len(ids) - len(tiny_tok.encode("<tool_call>{oops</tool_call>Answer: 8<|im_end|>"))
    assert turns_cut.token_ids == ids[:first_call_end] + tiny_tok.encode("<tool_call>{oops</tool_call>")
    budget = 30  # the first call alone is longer: cut mid-turn, and the step still sees (and scores) it
    cut = run_multiturn(model, tiny_tok, tool_envs(1, TrajectoryLimits(max_turns=4, max_tokens=budget)),
                        [Example("0", q, "8")], params)[0]
    assert cut.finish_reason == "budget" and cut.metrics.turns == 1 and cut.metrics.model_tokens == budget
    assert len(cut.token_ids) == cut.metrics.prompt_tokens + budget


class RetryEnv:
    """Replies "Wrong, try again." (a user turn) until the answer is right."""

    limits = TrajectoryLimits(max_turns=3, max_tokens=500)
    tools: list = []
    stop_strings: list = []

    def reset(self, example):
        self.answer = example.answer
        return Prompt([{"role": "user", "content": example.question}])

    def step(self, completion):
        if f"Answer: {self.answer}" in completion:
            return StepResult(None, {"answer": 1.0}, 1.0)
        return StepResult([{"role": "user", "content": "Wrong, try again."}], {"answer": 0.0}, 0.0)


def test_turn_ended_by_the_end_of_turn_token_is_not_closed_twice(tiny_tok):
    """The policy emitted <|im_end|> itself: the continuation starts after it, not with a second one."""
    model = ScriptedModel(272, script_policy(tiny_tok, {"Guess": ["Answer: 1<|im_end|>", "Answer: 2<|im_end|>"]}))
    params = SamplingParams(temperature=0.0, max_new_tokens=50, stop_token_ids=tiny_tok.eos_token_ids)
    out = run_multiturn(model, tiny_tok, [RetryEnv()], [Example("0", "Guess", "2")], params)[0]
    pieces = [("<|im_start|>user\nGuess<|im_end|>\n<|im_start|>assistant\n", 0), ("Answer: 1<|im_end|>", 1),
              ("\n<|im_start|>user\nWrong, try again.<|im_end|>\n<|im_start|>assistant\n", 0),
              ("Answer: 2<|im_end|>", 1)]
    assert out.token_ids == [t for text, _ in pieces for t in tiny_tok.encode(text)]
    assert out.loss_mask == [m for text, m in pieces for _ in tiny_tok.encode(text)]
    assert (out.reward, out.reward_components, out.metrics.turns, out.finish_reason) == (1.0, {"answer": 1.0}, 2,
                                                                                         "done")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_logprobs_equal_one_full_forward_over_the_trajectory(tiny_dir, tiny_tok, dtype):
    """fp32: to 1e-4; float64: to 1e-10 (the decode is exact up to rounding: rows set back and fed between chunks,
    bucket step-down)."""
    from grpo_engine.model.loading import load_model

    tiny_model = load_model(tiny_dir, dtype=dtype)
    questions = ["What is 2", "Hi!", "Solve x for me", "What is 2"]
    examples = [Example(str(i), q, "") for i, q in enumerate(questions)]
    pilot = generate(tiny_model, [tiny_tok.encode(q) for q in questions], SamplingParams(max_new_tokens=30))
    stops = torch.bincount(torch.tensor(sum(pilot.completion_ids, []))).topk(3).indices.tolist()
    params = SamplingParams(max_new_tokens=12, stop_token_ids=stops)
    out = run_multiturn(tiny_model, tiny_tok, [EchoEnv(s) for s in (1, 7, 3, 12)], examples, params,
                        seed=[5, 6, 7, 8])
    assert all(t.metrics.env_tokens > 0 for t in out)
    ends = {tuple(i for i, m in enumerate(t.loss_mask[1:], 1) if m != t.loss_mask[i - 1]) for t in out}
    assert len(ends) == len(out)  # turns switch at different positions in every row: rows were fed apart
    for t in out:
        assert t.reward == 0.5 * t.metrics.turns and t.reward_components == {"turn": float(t.metrics.turns)}
        with torch.no_grad():
            logits = tiny_model(torch.tensor([t.token_ids]))[0].double()  # [N, V]
        ref = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(t.token_ids[1:])[:, None])[:, 0]
        policy = torch.tensor(t.loss_mask[1:], dtype=torch.bool)
        assert t.loss_mask[: t.metrics.prompt_tokens] == [0] * t.metrics.prompt_tokens
        torch.testing.assert_close(torch.tensor(t.logprobs[1:], dtype=torch.float64)[policy], ref[policy],
                                   atol=1e-4 if dtype == torch.float32 else 1e-10, rtol=0)


def test_single_turn_task_is_generate(tiny_model, tiny_tok):
    """The Task adapter: same prompt text, same samples as generate() with per-prompt seeds, same reward."""
    task = ContainsTask()
    examples = [Example(str(i), q, "x") for i, q in enumerate(["What is 2", "Hi!", "Solve x"])]
    params = SamplingParams(max_new_tokens=9, stop_token_ids=tiny_tok.eos_token_ids)
    envs = [TaskEnvironment(task, max_tokens=9) for _ in examples]
    out = run_multiturn(tiny_model, tiny_tok, envs, examples, params, seed=[1, 2, 3])
    prompts = [tiny_tok.encode(render_prompt(task, tiny_tok, ex)) for ex in examples]
    ref = generate(tiny_model, prompts, params, seed=[1, 2, 3])
    for t, p, comp, lp, ex in zip(out, prompts, ref.completion_ids, ref.logprobs, examples):
        assert t.token_ids == p + comp and t.loss_mask == [0] * len(p) + [1] * len(comp)
        torch.testing.assert_close(t.logprobs[len(p) :], lp, atol=1e-5, rtol=0)
        assert t.reward == safe_reward(task, ex, tiny_tok.decode(comp, skip_special_tokens=True)).total
        assert t.metrics.turns == 1
    # a turn cut at max_new_tokens is a truncated answer, as generate says (it was "done", read as "stop")
    in_generate_words = {"done": "stop", "turn_length": "length", "budget": "length"}
    assert [in_generate_words[t.finish_reason] for t in out] == ref.finish_reason


def test_rejects_group_sampling_and_too_long_budgets(tiny_model, tiny_tok):
    ex = [Example("0", "hi", "")]
    with pytest.raises(ValueError, match="one trajectory per environment"):
        run_multiturn(tiny_model, tiny_tok, [EchoEnv(1)], ex, SamplingParams(n=2))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        run_multiturn(tiny_model, tiny_tok, [EchoEnv(1, TrajectoryLimits(2, 5000))], ex, SamplingParams())


def test_per_trajectory_seeds_make_a_row_independent_of_the_batch(tiny_dir, tiny_tok):
    """A trajectory is the same alone and in a batch whose other rows pause for environment turns, resume and
    finish at other steps (rows set back and fed between chunks, bucket step-down). float64: no matmul-blocking
    rounding."""
    from grpo_engine.model.loading import load_model

    model = load_model(tiny_dir, dtype=torch.float64)
    questions = ["What is 2", "Hi!", "Solve x for me"]
    examples = [Example(str(i), q, "") for i, q in enumerate(questions)]
    params = SamplingParams(max_new_tokens=8, stop_token_ids=list(range(100, 140)))
    sizes, seeds = (2, 9, 4), [11, 22, 33]
    envs = [EchoEnv(s, TrajectoryLimits(3, 300)) for s in sizes]
    together = run_multiturn(model, tiny_tok, envs, examples, params, seed=seeds)
    model_turn_lengths = [[len(list(g)) for m, g in itertools.groupby(t.loss_mask) if m] for t in together]
    assert [len(t) for t in model_turn_lengths] == [3, 3, 3] and len({tuple(t) for t in model_turn_lengths}) == 3
    for i in range(3):
        alone = run_multiturn(model, tiny_tok, envs[i : i + 1], examples[i : i + 1], params, seed=seeds[i : i + 1])
        assert alone[0].token_ids == together[i].token_ids and alone[0].loss_mask == together[i].loss_mask
        assert alone[0].logprobs == pytest.approx(together[i].logprobs, abs=1e-9)
