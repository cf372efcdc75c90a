"""The decode cache's rings (rollout/static_cache.py, "Per-layer storage"): a sliding layer keeps a ring of
window + CHUNK entries a row, indexed by position, and never more; full layers keep all S + 1 slots. Decoding past
the ring many times over stays token-identical to transformers' generate (greedy) and equal to full forwards
(sampled log-probs, float64), with left padding, a prompt prefix shared by the prefill, rows stepping down
buckets, multi-turn rows set back between chunks, longrope rows prefilled again and the chunks run as (fake) CUDA
graphs; the planner counts the bytes the state allocates."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from echo_env import EchoEnv
from fake_graphs import FakeGraphs
from model.families_helpers import hf_dir_maker
from reference_decode import reference_trajectories

from grpo_engine.model.loading import load_model, load_tokenizer
from grpo_engine.model.tiny import make_tiny_checkpoint
from grpo_engine.plan.decode_state import kv_state_bytes
from grpo_engine.rollout import SamplingParams, static_cache
from grpo_engine.rollout.generate import generate, generate_static
from grpo_engine.rollout.multiturn import run_multiturn
from grpo_engine.rollout.static_cache import CHUNK, StaticDecodeState, layer_slots
from grpo_engine.rollout.static_decode import release_static_decode, static_decoder
from grpo_engine.tasks.base import Example
from grpo_engine.tasks.environment import TrajectoryLimits

transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            head_dim=16)
MIXED = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
VARIANTS = {  # every window + CHUNK well under the 64 slots a state rounds to: every sliding layer is a ring
    "gemma3": ("gemma3_text", dict(sliding_window=6, layer_types=MIXED)),
    "ministral": ("ministral", dict(sliding_window=5, layer_types=["full_attention", "sliding_attention"] * 2)),
    "mistral": ("mistral", dict(sliding_window=7)),  # every layer sliding: no full layer at all
    "phi3-longrope": ("phi3", dict(sliding_window=9, partial_rotary_factor=0.5, original_max_position_embeddings=40,
                                   rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 3.0],
                                                 "long_factor": [2.0, 3.0, 4.0, 5.0]})),
}
PROMPTS = [[5, 17, 33, 101, 7, 250, 8, 9], [9, 44, 12]]  # left-padded in one prefill
NEW = 70  # new tokens: past every ring (at most 25 entries) twice over, and past longrope's switch at 40


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """name -> a checkpoint directory transformers wrote (random weights, norms away from neutral: Gemma's scale
    by 1 + w)."""
    return hf_dir_maker(tmp_path_factory, BASE, VARIANTS,
                        lambda model_type: (0.0 if model_type == "gemma3_text" else 1.0, 0.2))


def ring_bound(model) -> list[int]:
    """window + CHUNK for each sliding layer, None for a full one."""
    return [None if block.window is None else block.window + CHUNK for block in model.layers]


def assert_rings_within_the_bound(state: StaticDecodeState, model) -> None:
    """Every sliding layer's k and v hold exactly window + CHUNK entries a row, every full layer S + 1."""
    for t in (state.k, state.v):
        assert [x.shape[2] for x in t] == [state.slots + 1 if r is None else r for r in ring_bound(model)]


@pytest.fixture
def attended(monkeypatch):
    """model -> the key lengths every decode step's attention read, layer by layer (SDPA behind a recorder)."""
    lengths: list[int] = []

    def recorded(q, k, v, mask):
        assert mask.shape[-1] == k.shape[2]
        lengths.append(k.shape[2])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])

    def on(model):
        model.kernels = replace(model.kernels, decode_attention=recorded)
        return lengths

    return on


def test_layer_slots_hand_computed():
    """Gemma 3 with a window of 6 over 4 layers (sliding, full, sliding, sliding): 22 entries in the sliding layers
    at 65 slots; at 9 slots (a window + CHUNK past them) every layer holds all 9. The planner's bytes are the
    state's own tensors."""
    from grpo_engine.model.config import ModelConfig

    cfg = ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, model_type="gemma3_text",
                      sliding_window=6, layer_types=tuple(MIXED), rope_local_theta=10_000.0)
    assert layer_slots(cfg, 65) == [22, 65, 22, 22] and layer_slots(cfg, 9) == [9] * 4
    for slots, widths in ((64, [22, 65, 22, 22]), (8, [9] * 4)):
        state = StaticDecodeState(cfg, 3, slots, 4, torch.float32, torch.float32, torch.device("cpu"))
        assert [t.shape for t in state.k] == [(3, 2, n, 16) for n in widths]
        held = sum(t.untyped_storage().nbytes() for t in (*state.k, *state.v))
        assert held == kv_state_bytes(cfg, 3, slots + 1, 4) == 3 * sum(widths) * 2 * 2 * 16 * 4


def test_the_prompt_view_feeds_past_the_ring_in_pieces(hf_dir):
    """The decode cache's prompt view over 64 slots, fed 46 tokens in pieces of 6, 1, 3, 1, 7, ... (one row
    left-padded by 2): each piece attends to the rings as they were and to itself, then writes its newest entries;
    the logits equal one full forward's, past the 22-entry rings twice over."""
    model = load_model(hf_dir("gemma3"))
    ids = torch.randint(3, 300, (2, 46), generator=torch.Generator().manual_seed(0))
    key_mask = torch.ones(2, 46, dtype=torch.bool)
    key_mask[1, :2] = False
    state = StaticDecodeState(model.config, 2, 64, 1, torch.float32, torch.float32, torch.device("cpu"))
    assert state.rings == {6: 22} and state.ring_of == [22, None, 22, 22]
    cache, pieces, t = state.prompts(2), [], 0
    with torch.no_grad():
        full = model(ids, key_mask)
        for n in [6, 1, 3, 1, 7, 1, 1, 11, 2, 1, 5, 1, 4, 2]:
            pieces.append(model(ids[:, t : t + n], key_mask[:, : t + n], cache=cache))
            t += n
    assert t == 46 and cache.start == 46
    assert (torch.cat(pieces, dim=1) - full)[key_mask].abs().max().item() < 1e-5


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_greedy_decode_equals_transformers_generate_past_the_ring(hf_dir, name, attended, eager_decoders):
    """70 new tokens from two left-padded prompts: token-identical to transformers' generate, every decode step of
    a sliding layer reading its ring of window + CHUNK entries (a full layer its live window of slots), and the
    rings never wider than that."""
    path = hf_dir(name)
    ours, theirs = load_model(path), transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    lengths = attended(ours)
    out = generate(ours, PROMPTS, SamplingParams(n=1, temperature=0.0, max_new_tokens=NEW))
    for i, prompt in enumerate(PROMPTS):
        ref = theirs.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out.completion_ids[i] == ref[0, len(prompt):].tolist()
    (decoder,) = eager_decoders
    assert_rings_within_the_bound(decoder.state, ours)
    layers = ring_bound(ours)
    steps = [lengths[i : i + len(layers)] for i in range(0, len(lengths), len(layers))]
    assert len(steps) >= NEW - 1
    for step in steps:
        assert [n for n, r in zip(step, layers) if r is not None] == [r for r in layers if r is not None]
        assert all(n > 22 for n, r in zip(step, layers) if r is None)  # a full layer reads its slots


def test_a_shared_prompt_prefix_longer_than_the_ring(hf_dir):
    """Three prompts sharing 30 tokens (prefilled once in row 0, its ring copied to the others, then each prompt's
    own tokens attending to the ring and to each other): greedy tokens equal transformers' on each prompt alone."""
    path = hf_dir("gemma3")
    ours, theirs = load_model(path), transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    prefix = [(7 * i + 3) % 290 + 5 for i in range(30)]
    prompts = [prefix + [11, 12], prefix + [40], prefix + [60, 61, 62, 63, 64, 65]]
    out = generate(ours, prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=30))
    for i, prompt in enumerate(prompts):
        ref = theirs.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out.completion_ids[i] == ref[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", ["gemma3", "mistral"])
def test_sampled_logprobs_equal_a_full_forward(hf_dir, name):
    """Sampled rows of different lengths stepping down buckets (the rings move with their rows), float64: each
    token's log-prob equals a full forward's over the row alone."""
    model = load_model(hf_dir(name), dtype=torch.float64)
    prompts = [[5, 17, 33, 101, 7, 250, 8, 9, 10, 11], [9, 44, 12], [70, 71]]
    params = SamplingParams(n=2, temperature=0.9, max_new_tokens=60, stop_token_ids=list(range(3, 12)))
    out = generate(model, prompts, params, seed=[1, 2, 3])
    lengths = list(map(len, out.completion_ids))
    assert len(set(lengths)) > 2 and max(lengths) > 40
    for i, comp in enumerate(out.completion_ids):
        prompt = prompts[out.prompt_index[i]]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + comp]))[0, len(prompt) - 1 : -1] / 0.9  # [T, V]
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(comp)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(out.logprobs[i], dtype=torch.float64), ref, atol=1e-10, rtol=0)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """The tiny Gemma 3 checkpoint (a window of 8, 24-entry rings) in float64, and its tokenizer."""
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("gemma"), "gemma3")
    return load_model(path, dtype=torch.float64), load_tokenizer(path)


@pytest.mark.parametrize("loop", ["static", "graphs"])
def test_multiturn_rows_across_chunks_equal_the_reference_decode(gemma, eager_decoders, loop):
    """Trajectories much longer than the rings, whose model turns end inside chunks (the chunk's later steps wrote
    ring entries, then the row is set back and fed its environment's tokens): tokens, masks, finish reasons and
    log-probs equal the reference decode's (one full forward per token). Eager chunks stop at the steps a turn may
    still take; (fake) graphs run all CHUNK steps, so a turn's end leaves up to CHUNK - 1 discarded steps behind."""
    model, tok = gemma
    assert model.config.sliding_window == 8
    params = SamplingParams(max_new_tokens=9, stop_token_ids=list(range(100, 140)))
    examples = [Example(str(i), q, "") for i, q in enumerate(["What is 2", "Hi!", "Solve x for me", "Go"])]
    envs = lambda: [EchoEnv(s, TrajectoryLimits(max_turns=5, max_tokens=400)) for s in (1, 9, 3, 12)]  # noqa: E731
    if loop == "graphs":
        release_static_decode(model)
        fake = FakeGraphs.install(static_decoder(model, 4, 1024, 1024))
    static = run_multiturn(model, tok, envs(), examples, params, seed=[1, 2, 3, 4], loop=loop)
    assert all(t.metrics.env_tokens > 0 for t in static) and max(len(t.token_ids) for t in static) > 3 * 24
    if loop == "graphs":
        assert fake.replays >= fake.captures > 0  # each chunk a capture, checked by its replay
        assert_rings_within_the_bound(static_decoder(model, 4, 1024, 1024).state, model)
        release_static_decode(model)
    else:
        assert_rings_within_the_bound(eager_decoders[0].state, model)
    reference = reference_trajectories(model, tok, envs(), examples, params, [1, 2, 3, 4])
    for s, d in zip(static, reference):
        assert (s.token_ids, s.loss_mask, s.finish_reason) == (d.token_ids, d.loss_mask, d.finish_reason)
        torch.testing.assert_close(s.logprobs, d.logprobs, atol=1e-10, rtol=0)


def test_fake_graphs_equal_eager_chunks(gemma):
    """The chunks as (fake) CUDA graphs, each captured and replayed CHUNK steps whole: the same tokens and
    log-probs as eager chunks, greedy and sampled; the kept state's rings within the bound."""
    model, _ = gemma
    prompts = [[5, 17, 33, 101, 7, 250, 8, 9], [9, 44, 12], [70, 71, 72, 73]]
    greedy = SamplingParams(n=2, temperature=0.0, max_new_tokens=50, stop_token_ids=[262, 152, 270])
    sampled = replace(greedy, temperature=0.8, top_p=0.9)
    eager = [generate_static(model, prompts, p, seed=[1, 2, 3]) for p in (greedy, sampled)]
    release_static_decode(model)
    fake = FakeGraphs.install(static_decoder(model, 6, 64, 50))
    for params, want in zip((greedy, sampled), eager):
        assert generate_static(model, prompts, params, seed=[1, 2, 3], graphs=True) == want
    assert fake.captures > 0 and fake.replays > fake.captures
    assert_rings_within_the_bound(static_decoder(model, 6, 64, 50).state, model)
    release_static_decode(model)


def test_the_ring_step_traces_as_one_graph(gemma):
    """A decode step of a model with rings, traced whole by torch.compile(fullgraph=True): no host read or
    data-dependent branch in the ring's writes and masks (what a CUDA graph captures); the traced step gives the
    eager step's buffers and rings."""
    model, _ = gemma
    torch._dynamo.reset()
    release_static_decode(model)
    with torch.inference_mode():
        decoder = static_decoder(model, 2, 64, 40)
        state, sample = decoder.state, decoder.token_sampler(SamplingParams(temperature=0.0))
        state.key_mask[:, :3] = True
        state.key_mask[:, state.slots] = True
        state.write.fill_(3)
        state.positions[:, 0] = torch.tensor([3, 30])  # the second row's ring has wrapped
        state.ids[:, 0] = torch.tensor([5, 17])
        state.col.fill_(1)
        tensors = lambda: (*state.step_buffers(), state.hist, *state.k, *state.v)  # noqa: E731
        before = [t.clone() for t in tensors()]
        decoder.step(model, 2, sample, 1)
        eager = [t.clone() for t in tensors()]
        for t, s in zip(tensors(), before):
            t.copy_(s)
        torch.compile(lambda: decoder.step(model, 2, sample, 1), backend="eager", fullgraph=True)()
        for got, want in zip(tensors(), eager):
            torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
        ring = state.k[0]  # a sliding layer: row 1's position 30 went to entry 30 mod 24
        assert ring.shape[2] == 24 and not torch.equal(ring[1, :, 6], before[len(state.step_buffers()) + 1][1, :, 6])
    release_static_decode(model)
    torch._dynamo.reset()


def test_window_rounding_does_not_reach_the_rings(hf_dir, monkeypatch):
    """The live-length window of the full layers rounded to 8 slots (it grows chunk by chunk) and to 64: the same
    tokens; the rings' width does not depend on it."""
    ours = load_model(hf_dir("ministral"))
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=NEW)
    wide = generate(ours, PROMPTS, params)
    monkeypatch.setattr(static_cache, "WINDOW_ROUNDING", 8)
    assert generate(ours, PROMPTS, params).completion_ids == wide.completion_ids
