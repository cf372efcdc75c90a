"""Sliding-window attention (Gemma 3, Mistral, Ministral, SmolLM3's and Phi-3's windows) and Gemma 3's block:
parity with transformers on tiny random checkpoints that transformers builds, over sequences longer than every
window, in every path the model runs (prefill with left padding, the decode loop and its cache, the static decode
eagerly, the shared-prompt training forward, the grouped attention kernels, multi-turn rows with holes).

A window counts positions (valid slots), not slot indices: a query at position i sees keys at positions j with
i - window < j <= i, as transformers' sliding-window mask for the row alone."""

import pytest
import torch
from families_helpers import (
    assert_bf16_within_bf16_rounding,
    assert_full_step_loads_in_transformers,
    assert_grpo_logprobs_equal_full_forwards,
    assert_lora_step_loads_in_peft,
    assert_refused_in_one_line,
    assert_save_loads_in_transformers,
    gguf_names_allowed,
    gguf_template,
    hf_dir_maker,
    hf_load,
    padded_batch,
    raw_config,
)

from grpo_engine import load_model

transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
MIXED = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
PER_TYPE_ROPE = {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 50_000.0},
                 "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}}
VARIANTS = {
    # name: (model_type, config fields beyond BASE); every window but the "long" ones is shorter than 30 tokens
    "gemma3": ("gemma3_text", dict(sliding_window=5, sliding_window_pattern=2, head_dim=16,
                                   query_pre_attn_scalar=24)),
    "gemma3-untied-long-bias": ("gemma3_text", dict(sliding_window=64, layer_types=MIXED, tie_word_embeddings=False,
                                                    attention_bias=True, head_dim=32)),
    "gemma3-softcap-rope": ("gemma3_text", dict(sliding_window=7, layer_types=MIXED, final_logit_softcapping=2.0,
                                                rope_parameters=PER_TYPE_ROPE, head_dim=16)),
    "mistral": ("mistral", dict(sliding_window=6, head_dim=24)),
    "mistral-no-window": ("mistral", dict(sliding_window=None, num_key_value_heads=1)),
    "ministral": ("ministral", dict(sliding_window=4, layer_types=["full_attention", "sliding_attention"] * 2,
                                    head_dim=16)),
    "smollm3-window": ("smollm3", dict(use_sliding_window=True, sliding_window=5, no_rope_layers=[1, 0, 1, 0])),
    "phi3-window": ("phi3", dict(sliding_window=9, partial_rotary_factor=0.5)),
    "phi3-window-longrope": ("phi3", dict(sliding_window=9, partial_rotary_factor=0.5,
                                          original_max_position_embeddings=16,
                                          rope_scaling={"rope_type": "longrope",
                                                        "short_factor": [1.0, 1.5, 2.0, 3.0],
                                                        "long_factor": [2.0, 3.0, 4.0, 5.0]})),
}
ONE_EACH = ["gemma3", "gemma3-softcap-rope", "mistral", "ministral", "smollm3-window", "phi3-window"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """name -> a checkpoint directory written by transformers (norms drawn away from their neutral values: Gemma's
    scale by 1 + w; biases around 0)."""
    return hf_dir_maker(tmp_path_factory, BASE, VARIANTS,
                        lambda model_type: (0.0 if model_type == "gemma3_text" else 1.0, 0.2))


# ----------------------------------------------------------------------------------------------------
# The mask


def test_window_mask_counts_positions_at_the_boundary():
    """Query at position i sees key j iff j is valid and i - window < j <= i: left padding and a hole in the slots
    are not distance; the boundary key (exactly `window` positions back) is out, the one after it in."""
    from grpo_engine.model.transformer import Transformer, window_mask

    key_mask = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1, 1, 1, 1]], dtype=torch.bool)  # pads, then a hole at slot 5
    mask, positions, key_pos = Transformer._attention_mask(key_mask, 0, 11)
    windowed = window_mask(mask, positions, key_pos, 11, window=3)[0, 0]  # [T, S]
    pos = [None, None, 0, 1, 2, None, 3, 4, 5, 6, 7]  # each valid slot's position
    for q in range(11):
        for k in range(11):
            if pos[q] is None:
                continue
            want = pos[k] is not None and pos[q] - 3 < pos[k] <= pos[q]
            assert bool(windowed[q, k]) == want, (q, k)
    assert window_mask(mask, positions, key_pos, 11, window=11) is mask  # no key that far: the full mask
    causal = window_mask(None, torch.arange(6)[None], None, 6, window=2)[0, 0]  # no padding: slots are positions
    assert causal.tolist() == [[j <= i and i - 2 < j for j in range(6)] for i in range(6)]


# ----------------------------------------------------------------------------------------------------
# Parity with transformers


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_fp32_logits_match_transformers_past_every_window(hf_dir, name):
    """30 tokens, past every short window; left-padded rows equal transformers' on the row alone."""
    path = hf_dir(name)
    ours, theirs = load_model(path), hf_load(path)
    ids, mask = padded_batch(30)
    with torch.no_grad():
        assert (ours(ids) - theirs(ids).logits).abs().max().item() < 1e-5
        padded = ours(ids, mask)
        for row in range(len(ids)):
            real = mask[row].bool()
            alone = theirs(ids[row, real][None]).logits[0]
            assert (padded[row, real] - alone).abs().max().item() < 1e-5, row


def test_the_variants_exercise_what_they_claim(hf_dir):
    """The descriptions the variants load into, and a window that changes the logits (else parity proves nothing
    about it): the same weights with every layer attending in full differ past the window."""
    g = load_model(hf_dir("gemma3")).config
    assert g.layer_types == ("sliding_attention", "full_attention") * 2 and g.sliding_window == 5
    assert g.attention_multiplier == 24**-0.5 and g.tie_word_embeddings and g.rope_local_theta == 10_000.0
    soft = load_model(hf_dir("gemma3-softcap-rope")).config
    assert soft.final_logit_softcapping == 2.0 and soft.rope_local_theta == 500.0
    assert soft.rope_theta == 50_000.0 and soft.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    untied = load_model(hf_dir("gemma3-untied-long-bias"))
    assert untied.layers[0].attn.o_proj.bias is not None and not untied.config.tie_word_embeddings
    assert load_model(hf_dir("mistral")).config.layer_types == ("sliding_attention",) * 4
    assert load_model(hf_dir("mistral-no-window")).config.layer_types is None
    assert load_model(hf_dir("smollm3-window")).config.layer_types == ("full_attention", "sliding_attention") * 2
    ids, _ = padded_batch(30, seed=5)
    for name in ONE_EACH:
        model = load_model(hf_dir(name))
        with torch.no_grad():
            windowed = model(ids)
            for block in model.layers:
                block.window = None
            assert (model(ids) - windowed)[:, 12:].abs().max().item() > 1e-4, name


@pytest.mark.parametrize("name", ["gemma3", "gemma3-softcap-rope", "ministral"])
def test_bf16_logits_within_bf16_rounding(hf_dir, name):
    """Both in bf16: ours is as far from the fp32 logits as transformers' is (Gemma's norms and the embedding
    scale in their reference dtypes), and close to transformers'."""
    assert_bf16_within_bf16_rounding(hf_dir(name))


@pytest.mark.parametrize("name", [*ONE_EACH, "phi3-window-longrope"])  # a window and longrope's switch at 16
def test_greedy_decode_equals_transformers_generate_past_the_window(hf_dir, name, monkeypatch):
    """40 new tokens (more than any window) from two left-padded prompts, by the one decode loop run eagerly (the
    code its CUDA graphs capture), with the live-length window rounded to 64 slots and to 8 (so that it grows
    chunk by chunk past the sliding windows, its scratch slot at each): token-identical to transformers' generate."""
    from grpo_engine.rollout import static_cache
    from grpo_engine.rollout.generate import generate
    from grpo_engine.rollout.sampling import SamplingParams

    path = hf_dir(name)
    ours, theirs = load_model(path), hf_load(path)
    prompts = [[5, 17, 33, 101, 7, 250, 8, 9], [9, 44, 12]]
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=40)
    wide = generate(ours, prompts, params)
    monkeypatch.setattr(static_cache, "WINDOW_ROUNDING", 8)
    narrow = generate(ours, prompts, params)
    for i, prompt in enumerate(prompts):
        ref = theirs.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert wide.completion_ids[i] == ref[0, len(prompt):].tolist()
        assert narrow.completion_ids[i] == ref[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", ["gemma3-softcap-rope", "mistral", "smollm3-window"])
def test_sampled_logprobs_equal_a_full_forward(hf_dir, name, monkeypatch):
    """Sampled rows of different lengths (rows stepping down buckets, left-padded prompts): each token's log-prob
    equals a full forward's over the row alone (positions, not slots, decide the window), in the one decode loop
    with the live-length window rounded to 64 slots and to 8."""
    from grpo_engine.rollout import static_cache
    from grpo_engine.rollout.generate import generate
    from grpo_engine.rollout.sampling import SamplingParams

    model = load_model(hf_dir(name), dtype=torch.float64)
    prompts = [[5, 17, 33, 101, 7, 250, 8, 9, 10, 11], [9, 44, 12], [70, 71]]
    params = SamplingParams(n=2, temperature=0.9, max_new_tokens=24, stop_token_ids=list(range(3, 40)))
    wide = generate(model, prompts, params, seed=[1, 2, 3])
    monkeypatch.setattr(static_cache, "WINDOW_ROUNDING", 8)
    for out in (wide, generate(model, prompts, params, seed=[1, 2, 3])):
        assert len(set(map(len, out.completion_ids))) > 1
        for i, comp in enumerate(out.completion_ids):
            prompt = prompts[out.prompt_index[i]]
            with torch.no_grad():
                logits = model(torch.tensor([prompt + comp]))[0, len(prompt) - 1 : -1] / 0.9  # [T, V]
            ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(comp)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(out.logprobs[i], dtype=torch.float64), ref, atol=1e-10, rtol=0)


def test_multiturn_rows_with_holes_equal_one_full_forward(tmp_path):
    """Tool turns of row-specific lengths (rows set back between chunks and fed their environment's tokens, masked
    slots left behind), on a tiny Gemma 3 with a window of 8 much shorter than the trajectories: every policy token's
    log-prob equals one full forward's over the trajectory (float64), in the one decode loop."""
    from echo_env import EchoEnv

    from grpo_engine.model.loading import load_tokenizer
    from grpo_engine.model.tiny import make_tiny_checkpoint
    from grpo_engine.rollout import SamplingParams
    from grpo_engine.rollout.multiturn import run_multiturn
    from grpo_engine.tasks.base import Example

    path = make_tiny_checkpoint(tmp_path / "gemma", "gemma3")
    model, tok = load_model(path, dtype=torch.float64), load_tokenizer(path)
    assert model.config.sliding_window == 8 and model.config.layer_types[0] == "sliding_attention"
    examples = [Example(str(i), q, "") for i, q in enumerate(["What is 2", "Hi!", "Solve x for me"])]
    params = SamplingParams(max_new_tokens=10, stop_token_ids=[101, 111, 32])
    out = run_multiturn(model, tok, [EchoEnv(s) for s in (1, 7, 3)], examples, params, seed=[5, 6, 7])
    assert all(t.metrics.env_tokens > 0 and len(t.token_ids) > 30 for t in out)
    for t in out:
        with torch.no_grad():
            logits = model(torch.tensor([t.token_ids]))[0]  # [N, V]
        ref = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(t.token_ids[1:])[:, None])[:, 0]
        policy = torch.tensor(t.loss_mask[1:], dtype=torch.bool)
        torch.testing.assert_close(torch.tensor(t.logprobs[1:], dtype=torch.float64)[policy], ref[policy],
                                   atol=1e-10, rtol=0)


# ----------------------------------------------------------------------------------------------------
# Training


def _grpo_batch():
    from grpo_engine.train.batch import build_train_batch

    prompts = [[5, 6, 7, 8, 9, 10, 11], [5, 6, 7, 8, 9, 10, 11], [9, 10]]
    completions = [[11, 12, 13, 14, 15, 16, 17, 18, 19], [14, 15], [16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26]]
    batches = [build_train_batch(prompts, completions, [[0.0] * len(c) for c in completions], torch.zeros(3),
                                 [True] * 3, pad_id=0, share_prompts=share) for share in (False, True)]
    return prompts, completions, batches


@pytest.mark.parametrize("name", ["gemma3-softcap-rope", "mistral", "ministral"])
def test_grpo_logprobs_equal_a_full_forward_and_transformers(hf_dir, name):
    """The chunked log-probs of a GRPO step (soft-capped in the chunk), through the shared-prompt forward (the
    prompt's keys run once, each completion attends to them under its window) and the plain one: equal to a full
    forward's and transformers' on each row alone."""
    path = hf_dir(name)
    ours, theirs = load_model(path), hf_load(path)
    prompts, completions, (batch, shared) = _grpo_batch()
    assert shared.prompt_index is not None and batch.prompt_index is None
    for b in (batch, shared):
        assert_grpo_logprobs_equal_full_forwards(ours, theirs, b, prompts, completions)


@pytest.mark.parametrize("name", ["gemma3-softcap-rope", "ministral"])
def test_sft_loss_with_a_shared_prefix_equals_transformers(hf_dir, name):
    """SFT's shared prefix runs once and every row attends to its keys under the window (the cache's slots are
    positions there): the loss equals transformers' cross-entropy over the completion tokens, soft cap included."""
    from grpo_engine.sft.trainer import make_sft_batch, sft_loss

    path = hf_dir(name)
    ours, theirs = load_model(path), hf_load(path)
    prefix = list(range(10, 22))  # 12 shared tokens, past every window here
    pairs = [(prefix + [30, 31], [40, 41, 42, 43, 44, 45]), (prefix + [50], [60, 61, 62, 63, 64, 65, 66, 67, 68])]
    batch = make_sft_batch(pairs, pad_id=0, device="cpu")
    with torch.no_grad():
        got = sft_loss(ours, batch)
        losses = []
        for p, c in pairs:
            logits = theirs(torch.tensor([p + c])).logits[0, len(p) - 1 : -1]  # [C, V] predicting c
            losses.append(torch.nn.functional.cross_entropy(logits, torch.tensor(c), reduction="sum"))
    assert abs(got.item() - sum(losses).item() / sum(len(c) for _, c in pairs)) < 1e-5


def test_softcapped_head_gradients_equal_autograd():
    """The chunked head's backward through the soft cap (its fused pass too) equals autograd's through
    c * tanh(logits / c)."""
    from grpo_engine.rl.logprobs import token_logprobs, token_logprobs_with_grads

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 16, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (7,), generator=g)
    logits = torch.tanh(hidden @ weight.t() / 1.5) * 1.5 / 0.8
    logq = torch.log_softmax(logits, -1)
    ref_lp = logq.gather(1, targets[:, None])[:, 0]
    ref_ent = -(logq.exp() * logq).sum(-1)
    (ref_lp.sum() + 0.3 * ref_ent.sum()).backward()
    want = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    lp, ent = token_logprobs(hidden, weight, targets, temperature=0.8, chunk_size=3, with_entropy=True, softcap=1.5)
    torch.testing.assert_close(lp, ref_lp.detach())
    (lp.sum() + 0.3 * ent.sum()).backward()
    torch.testing.assert_close((hidden.grad, weight.grad), want)
    fused = token_logprobs_with_grads(hidden.detach(), weight.detach(), targets,
                                      lambda s, e, lp, ent: (torch.ones_like(lp), 0.3 * torch.ones_like(ent)),
                                      temperature=0.8, chunk_size=3, with_entropy=True, softcap=1.5)
    torch.testing.assert_close((fused.grad_hidden, fused.grad_weight), want)


@pytest.mark.parametrize("name", ["gemma3", "ministral"])
def test_grouped_attention_kernels_take_the_window(hf_dir, name):
    """The grouped decode and training kernels (the kernel plan's choice on some CPUs) read the layer's windowed
    mask: the same logits and gradients as SDPA, the same greedy decode."""
    from dataclasses import replace

    from grpo_engine.kernels.attention import grouped_attention, grouped_training_attention
    from grpo_engine.rollout.generate import generate
    from grpo_engine.rollout.sampling import SamplingParams

    path = hf_dir(name)
    sdpa, grouped = load_model(path), load_model(path)
    grouped.kernels = replace(grouped.kernels, decode_attention=grouped_attention,
                              train_attention=grouped_training_attention)
    ids, mask = padded_batch(20, seed=6)
    outs = []
    for model in (sdpa, grouped):
        model.train()
        logits = model(ids, mask)
        logits[mask.bool()].square().mean().backward()
        outs.append((logits.detach(), model.layers[0].attn.q_proj.weight.grad))
        model.eval()
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    params = SamplingParams(temperature=0.0, max_new_tokens=30)
    prompts = [[5, 17, 33, 101, 7], [9, 44]]
    assert generate(grouped, prompts, params).completion_ids == generate(sdpa, prompts, params).completion_ids


@pytest.mark.parametrize("name", ["gemma3", "mistral", "gemma3-softcap-rope"])
def test_our_save_loads_in_transformers(hf_dir, tmp_path, name):
    """The family's names and config.json (windows, layer types, the per-type rope written in the 4.x layout,
    Gemma's hidden_activation): transformers reads what we write to the same logits, and so do we."""
    ours, raw = assert_save_loads_in_transformers(hf_dir(name), tmp_path / "saved", VARIANTS[name][0])
    assert raw["sliding_window"] == ours.config.sliding_window


@pytest.mark.parametrize("name", ["gemma3", "ministral"])
def test_lora_adapter_loads_in_peft_to_the_same_logits(hf_dir, tmp_path, name):
    """A LoRA step on a windowed model; PEFT loads the adapter onto transformers' model to our logits."""
    assert_lora_step_loads_in_peft(hf_dir(name), tmp_path / "adapter", T=24)


@pytest.mark.parametrize("name", ["gemma3-softcap-rope", "mistral"])
def test_full_fine_tuning_step_saves_what_transformers_loads(hf_dir, tmp_path, name):
    """A full step through Gemma's (1 + w) norms, GeGLU and the soft cap: every weight gets a finite gradient, and
    the saved checkpoint loads in transformers to the trained logits."""
    assert_full_step_loads_in_transformers(hf_dir(name), tmp_path / "trained", T=24)


# ----------------------------------------------------------------------------------------------------
# Refusals


def _raw(model_type: str, **fields) -> dict:
    return raw_config(BASE, model_type, **fields)


@pytest.mark.parametrize("model_type, fields, needle", [
    ("gemma3_text", dict(attn_logit_softcapping=50.0), "attn_logit_softcapping=50.0"),
    ("gemma3_text", dict(use_bidirectional_attention=True), "use_bidirectional_attention=True"),
    ("gemma3_text", dict(hidden_activation="gelu"), "hidden_activation='gelu'"),
    ("ministral", dict(sliding_window=None, layer_types=MIXED), "sliding_window=null"),
    ("gemma3_text", dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                          "sliding_attention": {"rope_type": "linear", "factor": 2.0}}),
     "sliding_attention rope_type='linear'"),
])
def test_what_is_not_implemented_is_refused_in_one_line(model_type, fields, needle):
    assert_refused_in_one_line(_raw(model_type, **fields), needle)


def test_defaults_follow_transformers():
    """A config.json without sliding_window: Mistral's and Gemma's window is transformers' 4096, SmolLM3's none
    unless use_sliding_window; Gemma's layer pattern is every 6th layer full, its rope thetas 1e6 and 1e4."""
    from grpo_engine.model.hf_io import config_from_hf

    assert config_from_hf(_raw("mistral")).sliding_window == 4096
    gemma = config_from_hf(_raw("gemma3_text", num_hidden_layers=7))
    assert gemma.sliding_window == 4096 and gemma.layer_types == ("sliding_attention",) * 5 + (
        "full_attention", "sliding_attention")
    assert (gemma.rope_theta, gemma.rope_local_theta) == (1_000_000.0, 10_000.0)
    assert config_from_hf(_raw("smollm3", sliding_window=8)).layer_types is None


# ----------------------------------------------------------------------------------------------------
# GGUF


def test_gemma3_gguf_round_trip_under_llama_cpps_names_and_norms(tmp_path):
    """`grpo export` writes llama.cpp's gemma3: its tensor names (the gguf package's constants), the norms as 1 + w,
    the window and its layers, the local rope base; the file reads back to the same description and logits (the
    norms to fp32 rounding of 1 + w)."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    from grpo_engine.gguf_export import export_gguf
    from grpo_engine.model.gguf_io import reader
    from grpo_engine.model.tiny import make_tiny_checkpoint

    six = tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(6))
    src = make_tiny_checkpoint(tmp_path / "src", "gemma3", num_hidden_layers=6, layer_types=six,
                               attention_multiplier=32**-0.5)
    out = export_gguf(str(src), str(tmp_path / "g.gguf"), "f32")
    f = reader(out)
    assert f.fields["general.architecture"].contents() == "gemma3"
    assert {gguf_template(t.name) for t in f.tensors} <= gguf_names_allowed(gguf, "gemma3")
    assert f.fields["gemma3.attention.sliding_window"].contents() == 8
    ours, back = load_model(src), load_model(out)
    stored = next(t for t in f.tensors if t.name == "blk.0.post_attention_norm.weight")
    want = ours.layers[0].attn_out_norm.weight.detach().numpy() + np.float32(1)
    assert np.array_equal(np.asarray(stored.data, dtype=np.float32).reshape(-1), want)
    for field in ("sliding_window", "layer_types", "rope_local_theta", "rope_theta", "attention_multiplier",
                  "head_dim", "tie_word_embeddings", "model_type"):
        assert getattr(back.config, field) == getattr(ours.config, field), field
    for (name, a), (_, b) in zip(ours.state_dict().items(), back.state_dict().items()):
        tol = 2**-23 if name.endswith("norm.weight") else 0.0
        assert (a - b).abs().max().item() <= tol, name
    ids = torch.randint(0, ours.config.vocab_size, (2, 30), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert (back(ids) - ours(ids)).abs().max().item() < 1e-5


def test_mistral_gguf_is_llama_and_windows_llama_cpp_cannot_run_are_refused(tmp_path):
    """Mistral without a window below its context exports as llama.cpp's llama (q / k permuted as its converter
    does) and reads back to the same logits; a window below the context, or Gemma layers off llama.cpp's pattern,
    are refused in one line."""
    pytest.importorskip("gguf")
    from grpo_engine.gguf_export import export_gguf
    from grpo_engine.model.config import CheckpointError
    from grpo_engine.model.gguf_io import reader
    from grpo_engine.model.tiny import make_tiny_checkpoint

    src = make_tiny_checkpoint(tmp_path / "m", "mistral", sliding_window=None, layer_types=None)
    out = export_gguf(str(src), str(tmp_path / "m.gguf"), "f32")
    assert reader(out).fields["general.architecture"].contents() == "llama"
    ours, back = load_model(src), load_model(out)
    assert back.config.model_type == "llama" and back.config.head_dim == 24
    ids = torch.randint(0, ours.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert torch.equal(back(ids), ours(ids))
    for arch, fields, needle in [("mistral", {}, "sliding_window=8 below the context"),
                                 ("gemma3", {}, "not every 6th layer full")]:
        with pytest.raises(CheckpointError, match=needle) as err:
            export_gguf(str(make_tiny_checkpoint(tmp_path / arch, arch, **fields)), str(tmp_path / "x.gguf"), "f32")
        assert "\n" not in str(err.value)


def test_a_gemma3_270m_config_in_the_published_layout_loads_as_the_planners_shape():
    """google/gemma-3-270m's config.json layout (transformers 4.x keys: rope_local_base_freq, rope_scaling null,
    hidden_activation, the null soft-caps, cache_implementation): accepted, and the description equals the
    planner's `gemma3-270m`."""
    from grpo_engine.model.hf_io import config_from_hf
    from grpo_engine.plan.shapes import MODEL_SHAPES

    types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)]
    raw = {"_sliding_window_pattern": 6, "architectures": ["Gemma3ForCausalLM"], "attention_bias": False,
           "attention_dropout": 0.0, "attn_logit_softcapping": None, "bos_token_id": 2, "eos_token_id": 1,
           "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
           "hidden_size": 640, "initializer_range": 0.02, "intermediate_size": 2048, "layer_types": types,
           "max_position_embeddings": 32768, "model_type": "gemma3_text", "num_attention_heads": 4,
           "num_hidden_layers": 18, "num_key_value_heads": 1, "pad_token_id": 0, "query_pre_attn_scalar": 256,
           "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000.0, "rope_scaling": None, "rope_theta": 1000000.0,
           "sliding_window": 512, "torch_dtype": "bfloat16", "transformers_version": "4.55.0.dev0",
           "use_bidirectional_attention": False, "use_cache": True, "vocab_size": 262144,
           "cache_implementation": "hybrid", "tie_word_embeddings": True}
    cfg, shape = config_from_hf(raw), MODEL_SHAPES["gemma3-270m"]
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "sliding_window", "layer_types", "rope_theta",
                  "rope_local_theta", "attention_multiplier", "tie_word_embeddings", "final_logit_softcapping"):
        assert getattr(cfg, field) == getattr(shape, field), field
