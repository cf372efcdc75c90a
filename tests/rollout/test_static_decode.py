"""The one decode loop (rollout/static_decode.py, static_cache.py) on CPU, eagerly: the code a CUDA graph captures.

Exactness in float64 against full forwards (greedy tokens, stops and log-probs), batch buckets stepping down as rows
finish, tokens past a stop discarded, one host read per CHUNK steps, seeded draws reproducible and independent of
batch-mates, the decoder kept between calls with graphs (none kept eagerly), and the rollout.cuda_graphs switch.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from grpo_engine.config import ConfigError
from grpo_engine.model.loading import load_model
from grpo_engine.rollout import SamplingParams, generate
from grpo_engine.rollout.generate import generate_static
from grpo_engine.rollout.static_cache import CHUNK, StaticDecodeState, bucket_for
from grpo_engine.rollout.static_decode import (
    cuda_graphs_on,
    model_signature,
    release_static_decode,
    static_decode_stats,
    static_decoder,
)

STOPS = [5, 9, 17, *range(100, 112)]  # frequent enough that rows finish at many different steps


def full_forward_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids]))[0].double()  # [len(ids), V], no cache: the reference


def greedy_reference(model, prompt: list[int], steps: int) -> list[int]:
    seq = list(prompt)
    for _ in range(steps):
        seq.append(int(full_forward_logits(model, seq)[-1].argmax()))
    return seq[len(prompt) :]


def check_logprobs_against_full_forward(model, prompts, out, transform, which="logprobs", atol=1e-10) -> None:
    """out.<which>[i][t] == log-softmax(transform(logits)) of a full forward at the sampled token."""
    for i, comp in enumerate(out.completion_ids):
        prompt = prompts[out.prompt_index[i]]
        logits = full_forward_logits(model, prompt + comp)[len(prompt) - 1 : -1]  # [T, V] predicting comp
        ref = torch.log_softmax(transform(logits), dim=-1).gather(-1, torch.tensor(comp)[:, None])[:, 0]
        got = torch.tensor(getattr(out, which)[i], dtype=torch.float64)
        torch.testing.assert_close(got, ref, atol=atol, rtol=0)


@pytest.fixture(scope="module")
def model64(tiny_dir):
    return load_model(tiny_dir, dtype=torch.float64)


@pytest.fixture
def moves(monkeypatch):
    """The live-row counts each time the batch stepped down a bucket."""
    seen: list[int] = []
    real = StaticDecodeState.move_rows
    monkeypatch.setattr(StaticDecodeState, "move_rows", lambda self, slots: seen.append(len(slots)) or
                        real(self, slots))
    return seen


def test_buckets():
    assert [bucket_for(n) for n in (1, 2, 3, 5, 8, 9, 100, 128, 129, 512, 513, 1100)] == [
        1, 2, 4, 8, 8, 16, 128, 128, 256, 512, 1024, 1536]


def greedy_rows(model, prompts: list[list[int]], n: int, steps: int, stops: list[int]) -> tuple[list, list]:
    """The reference decode: each row alone, argmax of a full forward per token, until a stop token or `steps`
    tokens -> (completions, finish reasons), n rows a prompt."""
    completions, reasons = [], []
    for prompt in prompts:
        seq = []
        while len(seq) < steps and (not seq or seq[-1] not in stops):
            seq.append(int(full_forward_logits(model, prompt + seq)[-1].argmax()))
        completions += [seq] * n
        reasons += ["stop" if seq[-1] in stops else "length"] * n
    return completions, reasons


def test_greedy_equals_full_forwards_in_float64(model64, tiny_tok, moves):
    """Rows finish at many steps (stops), the batch steps down from 16 rows: tokens and finish reasons equal a
    reference decode by full forwards (each row alone); every log-prob equals a full forward's to 1e-10."""
    prompts = [tiny_tok.encode(s) for s in ("What is 2", "Hi!", "<|im_start|>user\nSolve x", "abc", "Tell me",
                                            "7 * 8 =", "Once upon", "xyz!?")]
    stops = [262, 152, 270, 198, 8]  # tokens of the greedy runs of this tiny model: they end at 2 ... 37 tokens
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=40, stop_token_ids=stops)
    static = generate_static(model64, prompts, params)
    reference = greedy_rows(model64, prompts, 2, 40, stops)
    assert static.completion_ids == reference[0] and static.finish_reason == reference[1]
    assert len(set(map(len, static.completion_ids))) > 3 and moves and moves[0] <= 8  # 16 rows -> 8 -> ...
    check_logprobs_against_full_forward(model64, prompts, static, lambda z: z, atol=1e-10)
    for i in (0, 4, 7):
        completion = static.completion_ids[2 * i]
        assert completion == greedy_reference(model64, prompts[i], 40)[: len(completion)]


@pytest.mark.parametrize("filters", [dict(top_k=20), dict(top_p=0.8), dict(min_p=0.05), dict()])
def test_sampled_logprobs_equal_a_full_forward_to_1e_10(model64, mixed_prompts, moves, filters):
    """Temperature, the filters, rows finishing early and buckets stepping down (5 prompts x 4 = 20 rows: bucket
    32): the full-softmax log-prob and the filtered one equal a full forward's to 1e-10."""
    prompts = mixed_prompts + [mixed_prompts[0][:4], mixed_prompts[2][3:]]
    params = SamplingParams(n=4, temperature=0.8, max_new_tokens=36, stop_token_ids=STOPS, **filters)
    out = generate_static(model64, prompts, params, seed=[1, 2, 3, 4, 5])
    assert "stop" in out.finish_reason and "length" in out.finish_reason and moves and moves[0] <= 16
    check_logprobs_against_full_forward(model64, prompts, out, lambda z: z / 0.8, atol=1e-10)

    def filtered(z):
        z = z / 0.8
        if "top_k" in filters:
            z = z.masked_fill(z < z.topk(20, dim=-1).values[:, -1:], float("-inf"))
        if "top_p" in filters:
            s, order = z.sort(dim=-1, descending=True)
            p = s.softmax(-1)
            drop = torch.zeros_like(p, dtype=torch.bool).scatter_(-1, order, (p.cumsum(-1) - p) >= 0.8)
            z = z.masked_fill(drop, float("-inf"))
        if "min_p" in filters:
            z = z.masked_fill(z < z.amax(-1, keepdim=True) + torch.log(torch.tensor(0.05)), float("-inf"))
        return z

    check_logprobs_against_full_forward(model64, prompts, out, filtered, which="filtered_logprobs", atol=1e-10)
    if not filters:
        assert out.filtered_logprobs == out.logprobs


def test_seeded_draws_are_reproducible_and_independent_of_batch_mates(model64, mixed_prompts):
    """Per-prompt seeds: a prompt's samples are the same alone, beside others, in another order or wave plan, and
    the same call twice gives the same output; one shared seed is reproducible too."""
    seeds = [11, 22, 33]
    params = SamplingParams(n=3, temperature=1.0, top_p=0.95, max_new_tokens=24, stop_token_ids=STOPS)
    together = generate_static(model64, mixed_prompts, params, seed=seeds)
    assert together == generate_static(model64, mixed_prompts, params, seed=seeds)
    for i, prompt in enumerate(mixed_prompts):
        alone = generate_static(model64, [prompt], params, seed=[seeds[i]])
        assert alone.completion_ids == together.completion_ids[3 * i : 3 * i + 3]
        assert alone.finish_reason == together.finish_reason[3 * i : 3 * i + 3]
    waves = SamplingParams(**{**params.__dict__, "max_tokens_in_flight": 3 * (13 + 24)})  # one prompt a wave
    reordered = generate_static(model64, mixed_prompts[::-1], waves, seed=seeds[::-1])
    for i in range(3):
        assert reordered.completion_ids[3 * (2 - i) : 3 * (3 - i)] == together.completion_ids[3 * i : 3 * i + 3]
    shared = generate_static(model64, mixed_prompts, params, seed=5)
    assert shared == generate_static(model64, mixed_prompts, params, seed=5)
    assert shared.completion_ids != generate_static(model64, mixed_prompts, params, seed=6).completion_ids
    assert len({tuple(c) for c in shared.completion_ids[:3]}) > 1  # a group's samples are not copies


def test_tokens_after_a_stop_string_are_discarded(tiny_model, tiny_tok):
    """A stop string completed mid-chunk: the completion ends at its token (the chunk's later tokens are dropped),
    as a row alone would (Row.take ends it)."""
    prompt = tiny_tok.encode("The answer is")
    for seed in range(50):  # a sampled completion with three ASCII bytes in a row, past the first chunk's start
        free = generate_static(tiny_model, [prompt], SamplingParams(temperature=0.5, max_new_tokens=30),
                               seed=seed).completion_ids[0]
        spans = [k for k in range(3, 27) if all(32 <= t < 127 for t in free[k : k + 3])]
        if spans:
            break
    k = spans[0]
    stop = bytes(free[k : k + 3]).decode()
    end = next(j for j in range(1, 31) if stop in tiny_tok.decode(free[:j]))
    params = SamplingParams(temperature=0.5, max_new_tokens=30, stop_strings=[stop])
    out = generate_static(tiny_model, [prompt], params, seed=seed, tokenizer=tiny_tok)
    assert out.completion_ids == [free[:end]] and out.finish_reason == ["stop"] and end <= k + 3 < 30


def test_one_token_per_row_needs_no_chunk(model64, mixed_prompts, monkeypatch):
    params = SamplingParams(n=2, temperature=0.7, max_new_tokens=1, stop_token_ids=STOPS)
    monkeypatch.setattr(StaticDecodeState, "advance", lambda *a: pytest.fail("a decode step ran"))
    out = generate_static(model64, mixed_prompts, params, seed=[1, 2, 3])
    assert [len(c) for c in out.completion_ids] == [1] * 6
    check_logprobs_against_full_forward(model64, mixed_prompts, out, lambda z: z / 0.7, atol=1e-10)


def test_the_host_reads_the_tokens_once_per_chunk(tiny_model, mixed_prompts, monkeypatch):
    """T new tokens: the first from the prefill, then ceil((T - 1) / CHUNK) chunks, one host read each."""
    reads = []
    real = StaticDecodeState.read
    monkeypatch.setattr(StaticDecodeState, "read", lambda self, b, first, *last: reads.append(b) or real(self, b, first,
                                                                                                      *last))
    out = generate_static(tiny_model, mixed_prompts, SamplingParams(n=2, max_new_tokens=50), seed=0)
    assert [len(c) for c in out.completion_ids] == [50] * 6
    assert reads == [6] * -(-49 // CHUNK)  # an eager decode's state holds its 6 rows exactly (no bucket of 8)


def test_a_chunk_reads_nothing_back_to_the_host(tiny_dir, monkeypatch):
    """The code a CUDA graph captures runs on the meta device, where every host read (.item(), .tolist(), bool(),
    a data-dependent shape such as nonzero's) raises: so the step has none (a sync would also break a capture)."""
    from grpo_engine.rollout.static_decode import StaticDecoder

    model = load_model(tiny_dir, dtype=torch.float32).to("meta")
    with torch.inference_mode():
        decoder = StaticDecoder(model, 8, 64, 40)
        for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1)):
            decoder.chunk(model, 8, decoder.token_sampler(params))
            decoder.chunk(model, 2, decoder.token_sampler(params))
        real = StaticDecodeState.advance
        monkeypatch.setattr(StaticDecodeState, "advance", lambda self, b, draw, j: real(self, b, draw, j) or
                            draw.tokens.tolist())
        with pytest.raises(NotImplementedError, match="meta"):  # the detector works
            decoder.chunk(model, 8, decoder.token_sampler(SamplingParams()))


def test_the_graph_path_with_a_fake_graph_backend(tiny_dir, tiny_tok):
    """generate_static(graphs=True) with the graph backend faked (fake_graphs.FakeGraphs: a capture runs
    nothing, a replay runs the recorded chunk eagerly): the same output as the eager chunks, one checked capture
    per (bucket, window, sampling parameters) met (one window here: 64 slots), none on the next call."""
    from fake_graphs import FakeGraphs

    model = load_model(tiny_dir, dtype=torch.float64)
    prompts = [tiny_tok.encode(s) for s in ("What is 2", "Hi!", "<|im_start|>user\nSolve x", "abc", "Tell me",
                                            "7 * 8 =", "Once upon", "xyz!?")]
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=40, stop_token_ids=[262, 152, 270, 198, 8])
    eager = generate_static(model, prompts, params)
    fake = FakeGraphs.install(static_decoder(model, 16, 60, 40))
    graphed = generate_static(model, prompts, params, graphs=True)
    decoder = static_decoder(model, 16, 60, 40)
    assert graphed == eager and sorted(b for b, _, _ in decoder.graphs) == [8, 16] and fake.captures == 2
    assert static_decode_stats(model)["captures"] == 2 and static_decode_stats(model)["fallback"] is None
    sampled = replace(params, temperature=0.8, top_p=0.9)
    assert generate_static(model, prompts, sampled, seed=1, graphs=True) == generate_static(model, prompts, sampled,
                                                                                             seed=1)
    captures = fake.captures
    assert captures > 2 and generate_static(model, prompts, params, graphs=True) == eager
    assert fake.captures == captures  # replayed, not captured again


def test_an_eager_decode_keeps_nothing(tiny_dir, mixed_prompts):
    """Eager chunks (a CPU, FSDP2, cuda_graphs=off): the call's own state, freed when it ends."""
    model = load_model(tiny_dir, dtype=torch.float32)
    generate_static(model, mixed_prompts, SamplingParams(n=2, max_new_tokens=8))
    assert static_decode_stats(model) is None


def test_decoder_is_kept_grown_and_renewed(tiny_dir, mixed_prompts, monkeypatch):
    """With graphs (faked here), the state is reused by a call that fits, grown (the union of both sizes) by one
    that does not, and its graphs are dropped when what they baked in changes (a parameter replaced, LoRA merged,
    train mode)."""
    from fake_graphs import FakeGraphs

    from grpo_engine.rollout import static_decode

    monkeypatch.setattr(static_decode, "CudaGraphs", lambda device: FakeGraphs())
    model = load_model(tiny_dir, dtype=torch.float32)
    generate_static(model, mixed_prompts, SamplingParams(n=2, max_new_tokens=8), graphs=True)
    first = static_decoder(model, 6, 21, 8)
    assert static_decode_stats(model)["rows"] == 8 and static_decode_stats(model)["slots"] == 64
    generate_static(model, mixed_prompts[:1], SamplingParams(n=4, max_new_tokens=8), graphs=True)
    assert static_decoder(model, 1, 1, 1) is first
    generate_static(model, mixed_prompts, SamplingParams(n=4, max_new_tokens=70), graphs=True)
    grown = static_decoder(model, 1, 1, 1)
    assert grown is not first and (grown.state.rows, grown.state.slots, grown.state.columns) == (16, 128, 70)
    grown.graphs[("fake", 0)] = object()
    static_decoder(model, 1, 1, 1)
    assert grown.graphs  # nothing changed
    before = model_signature(model)
    model.train()
    assert model_signature(model) != before
    static_decoder(model, 1, 1, 1)
    assert grown.graphs == {}
    model.eval()
    grown.graphs[("fake", 0)] = object()
    model.norm.weight = torch.nn.Parameter(model.norm.weight.detach().clone())
    static_decoder(model, 1, 1, 1)
    assert grown.graphs == {}
    with torch.no_grad():
        model.norm.weight.mul_(1.5)  # in place, as the optimizer: graphs stay
    grown.graphs[("fake", 0)] = object()
    static_decoder(model, 1, 1, 1)
    assert grown.graphs
    release_static_decode(model)
    assert static_decode_stats(model) is None


def test_lora_adapters_decode_unmerged_as_full_forwards(tiny_dir, mixed_prompts):
    from grpo_engine.model.lora import LoRAConfig, apply_lora

    model = apply_lora(load_model(tiny_dir, dtype=torch.float64), LoRAConfig(rank=4))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=20)
    out = generate_static(model, mixed_prompts, params)
    assert out.completion_ids == greedy_rows(model, mixed_prompts, 2, 20, [])[0]
    check_logprobs_against_full_forward(model, mixed_prompts, out, lambda z: z, atol=1e-10)


def test_nan_weights_raise_and_drop_the_state(tiny_dir, mixed_prompts):
    from grpo_engine.rollout.sampling import NonFiniteLogits

    model = load_model(tiny_dir, dtype=torch.float32)
    with torch.no_grad():
        model.layers[-1].mlp.down_proj.weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteLogits, match="NaN"):
        generate_static(model, mixed_prompts, SamplingParams(n=2, max_new_tokens=3))
    assert static_decode_stats(model) is None


def test_the_cuda_graphs_switch(tiny_model, mixed_prompts):
    release_static_decode(tiny_model)
    cpu = torch.device("cpu")
    assert not cuda_graphs_on("auto", cpu) and not cuda_graphs_on("off", cpu)
    assert cuda_graphs_on("auto", "cuda") and cuda_graphs_on("on", "cuda:0") and not cuda_graphs_on("off", "cuda")
    with pytest.raises(ValueError, match=r"^compile=True: the decode is not torch.compile'd .*; drop compile$"):
        generate(tiny_model, mixed_prompts, SamplingParams(max_new_tokens=2), compile=True)
    with pytest.raises(ConfigError, match=r"^rollout.cuda_graphs=on needs a CUDA device.*set rollout.cuda_graphs=auto"):
        generate(tiny_model, mixed_prompts, SamplingParams(cuda_graphs="on", max_new_tokens=2))
    with pytest.raises(ValueError, match="cuda_graphs='maybe'"):
        SamplingParams(cuda_graphs="maybe")
    params = SamplingParams(n=2, max_new_tokens=6)
    auto = generate(tiny_model, mixed_prompts, params, seed=3)  # CPU: eager chunks, bit for bit
    assert auto == generate(tiny_model, mixed_prompts, SamplingParams(n=2, max_new_tokens=6, cuda_graphs="off"), seed=3)
    assert static_decode_stats(tiny_model) is None


def test_config_switch_reaches_the_sampling_params():
    from grpo_engine.config import load_config
    from grpo_engine.train.setup import sampling_params

    class Tok:
        eos_token_ids = [0]

    cfg = load_config(None, [])
    assert cfg.rollout.cuda_graphs == "auto" and sampling_params(cfg, Tok()).cuda_graphs == "auto"
    assert sampling_params(load_config(None, ["rollout.cuda_graphs=off"]), Tok()).cuda_graphs == "off"
    assert load_config(None, ["rollout.cuda_graphs=on"]).rollout.cuda_graphs == "on"  # YAML's boolean `on`
    with pytest.raises(ConfigError, match="cuda_graphs='maybe' is not one of auto, on, off"):
        load_config(None, ["rollout.cuda_graphs=maybe"])
    with pytest.raises(ConfigError, match="model.device=cpu: set rollout.cuda_graphs=auto"):
        load_config(None, ["rollout.cuda_graphs=on", "model.device=cpu"])
