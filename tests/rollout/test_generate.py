"""generate(): parity with full forwards (greedy tokens, log-probs), stops, lengths, seeds, waves, errors."""

from __future__ import annotations

import pytest
import torch

from grpo_engine.rollout import GenerationOutput, SamplingParams, generate


def full_forward_logits(model, ids: list[int]) -> torch.Tensor:
    """Logits [len(ids), V] of one unpadded sequence, no cache: the reference computation."""
    with torch.no_grad():
        return model(torch.tensor([ids]))[0].double()


def greedy_reference(model, prompt: list[int], steps: int) -> list[int]:
    """Argmax decoding by repeated full forwards over prompt + tokens so far."""
    seq = list(prompt)
    for _ in range(steps):
        seq.append(int(full_forward_logits(model, seq)[-1].argmax()))
    return seq[len(prompt) :]


def test_greedy_with_cache_equals_argmax_of_full_forwards(tiny_model, mixed_prompts):
    out = generate(tiny_model, mixed_prompts, SamplingParams(n=2, temperature=0.0, max_new_tokens=12))
    assert out.prompt_index == [0, 0, 1, 1, 2, 2]
    for i, prompt in enumerate(mixed_prompts):
        expected = greedy_reference(tiny_model, prompt, 12)
        assert out.completion_ids[2 * i] == expected
        assert out.completion_ids[2 * i + 1] == expected
    assert out.finish_reason == ["length"] * 6


def check_logprobs_against_full_forward(model, prompts, out: GenerationOutput, transform, which="logprobs",
                                        atol: float = 1e-4) -> None:
    """out.<which>[i][t] == log-softmax(transform(logits)) of a full forward at the sampled token."""
    checked = 0
    for i, comp in enumerate(out.completion_ids):
        prompt = prompts[out.prompt_index[i]]
        logits = full_forward_logits(model, prompt + comp)[len(prompt) - 1 : -1]  # [T, V] predicting comp
        ref = torch.log_softmax(transform(logits), dim=-1).gather(-1, torch.tensor(comp)[:, None])[:, 0]
        got = torch.tensor(getattr(out, which)[i], dtype=torch.float64)
        torch.testing.assert_close(got, ref.double(), atol=atol, rtol=0)
        checked += len(comp)
    assert checked > 0


def test_logprobs_equal_full_forward_with_mixed_lengths_and_compaction(tiny_model, mixed_prompts):
    # Stop on a few common token ids so rows finish at different steps and the batch steps down its buckets.
    pilot = generate(tiny_model, mixed_prompts, SamplingParams(n=4, max_new_tokens=20)).completion_ids
    counts = torch.bincount(torch.tensor(sum(pilot, [])))
    stops = counts.topk(3).indices.tolist()
    params = SamplingParams(n=4, max_new_tokens=20, stop_token_ids=stops)
    out = generate(tiny_model, mixed_prompts, params, seed=3)
    lengths = [len(c) for c in out.completion_ids]
    assert len(set(lengths)) > 2 and "stop" in out.finish_reason and "length" in out.finish_reason
    for comp, reason in zip(out.completion_ids, out.finish_reason):
        assert (comp[-1] in stops) == (reason == "stop")
        assert not any(t in stops for t in comp[:-1])
    check_logprobs_against_full_forward(tiny_model, mixed_prompts, out, lambda z: z)
    assert out.filtered_logprobs == out.logprobs  # no filter: one and the same distribution


def test_float64_engine_logprobs_equal_a_full_forward_to_1e_10(tiny_dir, mixed_prompts):
    """The decode in float64 (prefill shared by the n samples, bucket step-down, rows of mixed lengths):
    every sampled token's log-prob equals a full forward's to 1e-10 -- exact up to float64 rounding."""
    from grpo_engine.model.loading import load_model

    model = load_model(tiny_dir, dtype=torch.float64)
    params = SamplingParams(n=3, temperature=0.9, max_new_tokens=12, stop_token_ids=[5, 9, 17])
    out = generate(model, mixed_prompts, params, seed=[4, 5, 6])
    assert "stop" in out.finish_reason or len({len(c) for c in out.completion_ids}) > 1
    check_logprobs_against_full_forward(model, mixed_prompts, out, lambda z: z / 0.9, atol=1e-10)


def test_logprobs_are_full_softmax_and_filtered_ones_under_the_filter(tiny_model, mixed_prompts):
    """logprobs: the temperature-scaled full softmax (what the trainer computes); filtered_logprobs: the top-k
    renormalised distribution the tokens were drawn from (larger: the cut mass is renormalised away)."""
    params = SamplingParams(n=3, temperature=0.7, top_k=20, max_new_tokens=10)
    out = generate(tiny_model, mixed_prompts, params, seed=1)

    def top20(z):
        z = z / 0.7
        kth = z.topk(20, dim=-1).values[:, -1:]
        return z.masked_fill(z < kth, float("-inf"))

    check_logprobs_against_full_forward(tiny_model, mixed_prompts, out, lambda z: z / 0.7)
    check_logprobs_against_full_forward(tiny_model, mixed_prompts, out, top20, which="filtered_logprobs")
    assert all(f > x for lf, lx in zip(out.filtered_logprobs, out.logprobs) for f, x in zip(lf, lx))


def test_greedy_logprob_is_unscaled_log_softmax(tiny_model, mixed_prompts):
    out = generate(tiny_model, mixed_prompts[:1], SamplingParams(temperature=0.0, max_new_tokens=5))
    check_logprobs_against_full_forward(tiny_model, mixed_prompts[:1], out, lambda z: z)


def test_stop_token_ends_completion_and_is_kept(tiny_model, mixed_prompts):
    free = greedy_reference(tiny_model, mixed_prompts[0], 10)
    stop = free[4]
    first = free.index(stop)
    params = SamplingParams(temperature=0.0, max_new_tokens=10, stop_token_ids=[stop])
    out = generate(tiny_model, mixed_prompts[:1], params)
    assert out.completion_ids == [free[: first + 1]]
    assert out.finish_reason == ["stop"]


def test_stop_string_spanning_tokens(tiny_model, tiny_tok):
    # A sampled completion (one row, fixed seed: the same draws on the rerun); three consecutive ASCII
    # bytes of it become the stop string, which with a byte-level tokenizer spans 3 tokens.
    prompt = tiny_tok.encode("The answer is")
    params = SamplingParams(temperature=0.5, max_new_tokens=30)
    for seed in range(50):
        free = generate(tiny_model, [prompt], params, seed=seed).completion_ids[0]
        spans = [k for k in range(2, 27) if all(32 <= t < 127 for t in free[k : k + 3])]
        if spans:
            break
    k = spans[0]
    stop = bytes(free[k : k + 3]).decode()
    # expected end: the first token at which the decoded completion contains the stop string
    end = next(j for j in range(1, 31) if stop in tiny_tok.decode(free[:j]))
    params = SamplingParams(temperature=0.5, max_new_tokens=30, stop_strings=["never-there", stop])
    out = generate(tiny_model, [prompt], params, seed=seed, tokenizer=tiny_tok)
    assert out.completion_ids == [free[:end]] and end <= k + 3
    assert out.finish_reason == ["stop"]
    assert stop not in tiny_tok.decode(free[: end - 1])


def test_stop_strings_without_tokenizer_is_a_clear_error(tiny_model, mixed_prompts):
    with pytest.raises(ValueError, match="tokenizer"):
        generate(tiny_model, mixed_prompts, SamplingParams(stop_strings=["\n"]))


def test_max_new_tokens_bounds_every_completion(tiny_model, mixed_prompts):
    out = generate(tiny_model, mixed_prompts, SamplingParams(n=3, max_new_tokens=7))
    assert [len(c) for c in out.completion_ids] == [7] * 9
    assert [len(lp) for lp in out.logprobs] == [7] * 9
    assert out.finish_reason == ["length"] * 9 and out.num_tokens == 63


def test_same_seed_same_output_other_seed_differs(tiny_model, mixed_prompts):
    params = SamplingParams(n=4, top_p=0.9, min_p=0.01, max_new_tokens=8)
    a = generate(tiny_model, mixed_prompts, params, seed=7)
    b = generate(tiny_model, mixed_prompts, params, seed=7)
    c = generate(tiny_model, mixed_prompts, params, seed=8)
    assert a == b
    assert a.completion_ids != c.completion_ids
    # a numpy integer is one seed too (np.int64 is not an int: it was taken for a sequence of seeds)
    import numpy as np

    assert generate(tiny_model, mixed_prompts, params, seed=np.int64(7)) == a
    per_prompt = generate(tiny_model, mixed_prompts, params, seed=np.arange(len(mixed_prompts)))
    assert per_prompt == generate(tiny_model, mixed_prompts, params, seed=list(range(len(mixed_prompts))))
    # the G samples of a prompt are not copies of each other
    assert len({tuple(x) for x in a.completion_ids[:4]}) > 1


def test_waves_under_a_token_budget_give_the_same_greedy_output(tiny_model, mixed_prompts):
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=6)
    one_wave = generate(tiny_model, mixed_prompts, params)
    need = 2 * (max(map(len, mixed_prompts)) + 6)  # slots for the 2 rows of the longest prompt
    small = SamplingParams(n=2, temperature=0.0, max_new_tokens=6, max_tokens_in_flight=need)
    waved = generate(tiny_model, mixed_prompts, small)
    assert waved.completion_ids == one_wave.completion_ids and waved.prompt_index == one_wave.prompt_index
    # different padding per wave changes float rounding only
    torch.testing.assert_close(
        torch.tensor(waved.logprobs), torch.tensor(one_wave.logprobs), atol=1e-5, rtol=0
    )
    longest = max(map(len, mixed_prompts))
    slots = rf"n x \({longest} tokens \+ max_new_tokens=6\) = {need} slots\); raise rollout\.max_tokens_in_flight"
    with pytest.raises(ValueError, match=slots):
        too_small = SamplingParams(n=2, max_new_tokens=6, max_tokens_in_flight=need - 1)
        generate(tiny_model, mixed_prompts, too_small)


def test_plan_waves_respects_budget():
    from grpo_engine.rollout.generate import plan_waves

    lengths = [10, 30, 20, 5]
    waves = plan_waves(lengths, SamplingParams(n=2, max_new_tokens=10, max_tokens_in_flight=130))
    assert sorted(sum(waves, [])) == [0, 1, 2, 3]
    for w in waves:
        assert len(w) * 2 * (max(lengths[i] for i in w) + 10) <= 130
    assert waves == [[1], [2, 0], [3]]  # longest first: 2*40 / 2*2*(20+10)=120 / 3 prompts would need 180


def test_empty_prompt_list(tiny_model):
    out = generate(tiny_model, [], SamplingParams(n=4))
    assert out == GenerationOutput([], [], [], []) and len(out) == 0


def test_prompt_longer_than_max_positions_is_a_clear_error(tiny_model):
    too_long = [1] * (tiny_model.config.max_position_embeddings + 1)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        generate(tiny_model, [[1, 2], too_long], SamplingParams(max_new_tokens=4))
    fits_alone = [1] * (tiny_model.config.max_position_embeddings - 2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(tiny_model, [fits_alone], SamplingParams(max_new_tokens=4))


@pytest.mark.parametrize("bad", [[[]], [[5, 100000]], [[-1]]])
def test_bad_prompts_are_clear_errors(tiny_model, bad):
    with pytest.raises(ValueError, match="prompt 0"):
        generate(tiny_model, bad, SamplingParams())


def test_compile_is_refused_in_one_line(tiny_model, mixed_prompts):
    """The one decode runs CUDA graphs on CUDA and eager chunks elsewhere: a torch.compile'd step is refused."""
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=6)
    with pytest.raises(ValueError, match=r"^compile='eager': the decode is not torch.compile'd .*; drop compile$"):
        generate(tiny_model, mixed_prompts, params, compile="eager")


def test_per_prompt_seeds_make_a_prompts_samples_independent_of_the_batch(tiny_dir, mixed_prompts):
    """With one seed per prompt, a prompt's completions are the same alone, in any batch, in any wave plan and
    whatever the other rows do (stop tokens step the batch down at different times) -- the property that makes a
    step's samples independent of how prompts are split across ranks. float64: no matmul-blocking rounding."""
    from grpo_engine.model.loading import load_model

    model = load_model(tiny_dir, dtype=torch.float64)
    seeds = [11, 22, 33]
    stops = list(range(100, 140))  # frequent stops: rows finish at different steps
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=10, stop_token_ids=stops)
    together = generate(model, mixed_prompts, params, seed=seeds)
    for i, prompt in enumerate(mixed_prompts):
        alone = generate(model, [prompt], params, seed=[seeds[i]])
        assert alone.completion_ids == together.completion_ids[3 * i : 3 * i + 3]
        assert alone.finish_reason == together.finish_reason[3 * i : 3 * i + 3]
    waves = generate(model, mixed_prompts[::-1], SamplingParams(**{**params.__dict__, "max_tokens_in_flight": 70}),
                     seed=seeds[::-1])  # other order, one prompt per wave
    for i in range(3):
        j = 2 - i
        assert waves.completion_ids[3 * j : 3 * j + 3] == together.completion_ids[3 * i : 3 * i + 3]
    assert len({f for f in together.finish_reason}) == 2  # both stops and length caps happened
    with pytest.raises(ValueError, match="2 seeds for 3 prompts"):
        generate(model, mixed_prompts, params, seed=[1, 2])


def test_shared_prefix_length():
    from grpo_engine.rollout.engine import shared_prefix_length

    assert shared_prefix_length([[1, 2, 3, 4]]) == 0  # one prompt: nothing to share
    assert shared_prefix_length([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3]]) == 2
    assert shared_prefix_length([[1, 2, 3], [1, 2, 3, 4]]) == 2  # each prompt keeps a token of its own
    assert shared_prefix_length([[7, 1], [8, 1]]) == 0


def test_a_shared_prefix_runs_once_with_the_same_results(tiny_dir, tiny_tok, monkeypatch):
    """Prompts behind one chat-template header: the header's forward runs once (a [1, c] call), and greedy
    tokens and log-probs equal the plain prefill's (float64: to 1e-10) and a full forward's argmax."""
    import importlib

    from grpo_engine.model.loading import load_model

    gen_module = importlib.import_module("grpo_engine.rollout.engine")
    model = load_model(tiny_dir, dtype=torch.float64)
    header = "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\n"
    prompts = [tiny_tok.encode(header + q) for q in ("What is 2+2?", "Hi", "Name a colour, any colour.")]
    c = gen_module.shared_prefix_length(prompts)
    assert c >= len(tiny_tok.encode(header)) - 1 and c >= gen_module.MIN_SHARED_PREFIX
    calls = []
    real_forward = type(model).forward
    monkeypatch.setattr(type(model), "forward", lambda self, ids, *a, **k: calls.append(tuple(ids.shape)) or
                        real_forward(self, ids, *a, **k))
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=8)
    shared = generate(model, prompts, params)
    assert calls[0] == (1, c) and calls[1] == (3, max(len(p) for p in prompts) - c)
    monkeypatch.setattr(gen_module, "MIN_SHARED_PREFIX", 10_000)  # the plain prefill
    plain = generate(model, prompts, params)
    assert shared.completion_ids == plain.completion_ids
    for a, b in zip(shared.logprobs, plain.logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-10)
    for i, prompt in enumerate(prompts):
        assert shared.completion_ids[2 * i] == greedy_reference(model, prompt, 8)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_blown_up_weights_raise_non_finite_logits(tiny_dir, mixed_prompts, temperature):
    """NaN weights: the documented NonFiniteLogits, sampled or greedy (sampling used to raise IndexError)."""
    from grpo_engine.model.loading import load_model
    from grpo_engine.rollout.sampling import NonFiniteLogits

    model = load_model(tiny_dir, dtype=torch.float32)
    with torch.no_grad():
        model.layers[-1].mlp.down_proj.weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteLogits, match="decode step 0"):
        generate(model, mixed_prompts, SamplingParams(n=2, temperature=temperature, max_new_tokens=3))
