"""SmolLM3, Granite, OLMo 2 and Phi-3 (and the llama / qwen3 biases they brought): parity with transformers on tiny
random checkpoints that transformers itself builds and saves, in several variants per family.

Variants cover tied / untied heads, GQA ratios, head_dim != hidden / heads, multipliers != 1, partial rotary and
longrope factors != 1 (past the original context and inside it), SmolLM3's no_rope_layers and biases."""

import warnings

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

BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [2.0, 3.0, 4.0, 5.0]}
VARIANTS = {
    # name: (model_type, config fields beyond BASE)
    "smollm3": ("smollm3", dict(no_rope_layers=[1, 0, 1], attention_bias=True, mlp_bias=True)),
    "smollm3-untied-mha": ("smollm3", dict(tie_word_embeddings=False, num_key_value_heads=4,
                                           no_rope_layer_interval=2)),
    "granite": ("granite", dict(embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.05,
                                logits_scaling=4.0, num_key_value_heads=1, tie_word_embeddings=True)),
    "granite-bias": ("granite", dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.3,
                                     logits_scaling=0.5, attention_bias=True, mlp_bias=True)),
    "olmo2": ("olmo2", dict(head_dim=24)),
    "olmo2-tied-bias": ("olmo2", dict(tie_word_embeddings=True, num_key_value_heads=1, attention_bias=True)),
    "phi3": ("phi3", dict(partial_rotary_factor=0.5, original_max_position_embeddings=16, rope_scaling=LONGROPE)),
    "phi3-tied-full": ("phi3", dict(tie_word_embeddings=True, num_key_value_heads=1)),
    "phi3-attention-factor": ("phi3", dict(partial_rotary_factor=0.75, original_max_position_embeddings=24,
                                           rope_scaling={"rope_type": "longrope", "attention_factor": 1.3,
                                                         "short_factor": [1.0, 1.1, 1.2, 1.4, 1.7, 2.0],
                                                         "long_factor": [1.5, 2.0, 3.0, 4.0, 6.0, 8.0]})),
    "llama-bias": ("llama", dict(attention_bias=True, mlp_bias=True, head_dim=8)),
    "qwen3-bias": ("qwen3", dict(attention_bias=True, head_dim=24)),
}
ONE_PER_FAMILY = ["smollm3", "granite", "olmo2", "phi3"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """name -> a checkpoint directory written by transformers (norms drawn around 1, biases around 0)."""
    return hf_dir_maker(tmp_path_factory, BASE, VARIANTS, lambda model_type: (1.0, 0.1))


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_fp32_logits_match_transformers(hf_dir, name):
    """Full and left-padded batches, 12 tokens (inside longrope's original context) and 30 (past it). A padded
    row is compared with transformers on the row alone: longrope's choice of factors is per row here (a row's
    log-probs must not depend on its batch), per batch in transformers."""
    path = hf_dir(name)
    ours, theirs = load_model(path), hf_load(path)
    for T in (12, 30):
        ids, mask = padded_batch(T)
        with torch.no_grad():
            assert (ours(ids) - theirs(ids).logits).abs().max().item() < 1e-5, T
            padded = ours(ids, mask)
            for row in range(len(ids)):
                real = mask[row].bool()
                alone = theirs(ids[row, real][None]).logits[0]
                assert (padded[row, real] - alone).abs().max().item() < 1e-5, (T, row)


def test_the_variants_exercise_what_they_claim(hf_dir):
    """The description each variant loads into: else parity would prove nothing about the feature."""
    smol = load_model(hf_dir("smollm3")).config
    assert smol.rope_layers == (True, False, True) and smol.tie_word_embeddings and smol.o_bias and smol.mlp_bias
    assert load_model(hf_dir("smollm3-untied-mha")).config.rope_layers == (True, False, True)
    granite = load_model(hf_dir("granite")).config
    assert (granite.embedding_multiplier, granite.residual_multiplier, granite.attention_multiplier,
            granite.logits_scaling) == (3.0, 0.5, 0.05, 4.0)
    olmo = load_model(hf_dir("olmo2"))
    assert olmo.config.head_dim == 24 and olmo.layers[0].attn.q_norm.weight.shape == (4 * 24,)
    phi = load_model(hf_dir("phi3"))
    assert phi.config.rotary_dim == 8 and phi.config.rope_scaling["original_max_position_embeddings"] == 16
    assert hasattr(phi.layers[0].attn, "qkv_proj") and hasattr(phi.layers[0].mlp, "gate_up_proj")


@pytest.mark.parametrize("name", ONE_PER_FAMILY)
def test_bf16_logits_within_bf16_rounding(hf_dir, name):
    """Both in bf16: ours is as far from the fp32 logits as transformers' is, and close to transformers'."""
    assert_bf16_within_bf16_rounding(hf_dir(name))


def test_olmo2_bf16_norm_and_rope_run_in_fp32_as_transformers_does(hf_dir):
    """OLMo 2 multiplies its RMSNorm weight in fp32 before the cast, and rotates q / k with fp32 cos / sin: its
    norm is bit-identical to transformers' in bf16 (llama's order is not), and the whole model's bf16 logits
    equal transformers' in most places (llama's order for both differs in about 80% of them)."""
    from grpo_engine.model.transformer import RMSNorm

    theirs_norm = transformers.models.olmo2.modeling_olmo2.Olmo2RMSNorm(64, eps=1e-6)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    weight = 1 + 0.1 * torch.randn(64, generator=torch.Generator().manual_seed(1))
    ours_norm = RMSNorm(64, 1e-6, weight_fp32=True)
    with torch.no_grad():
        for norm in (theirs_norm, ours_norm):
            norm.weight.copy_(weight)
        theirs_norm, ours_norm = theirs_norm.bfloat16(), ours_norm.bfloat16()
        want = theirs_norm(x)
        assert torch.equal(ours_norm(x), want)
        ours_norm.weight_fp32 = False
        assert not torch.equal(ours_norm(x), want)
    path = hf_dir("olmo2")
    ids, _ = padded_batch(30, seed=1)
    with torch.no_grad():
        theirs = hf_load(path, torch.bfloat16)(ids).logits
        ours = load_model(path, dtype=torch.bfloat16)(ids)
    assert (ours != theirs).float().mean().item() < 0.4


@pytest.mark.parametrize("name", ONE_PER_FAMILY)
def test_greedy_decode_equals_transformers_generate(hf_dir, name):
    """44 new tokens from two left-padded prompts (Phi-3's past its longrope switch at 16 positions)."""
    from grpo_engine.rollout.generate import generate
    from grpo_engine.rollout.sampling import SamplingParams

    path = hf_dir(name)
    ours, theirs = load_model(path), hf_load(path)
    prompts = [[5, 17, 33, 101, 7, 250], [9, 44, 12]]
    out = generate(ours, prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=44))
    for prompt, completion in zip(prompts, out.completion_ids):
        ref = theirs.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=44, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert completion == ref[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", ["smollm3", "granite-bias", "olmo2-tied-bias", "phi3"])
def test_our_save_loads_in_transformers(hf_dir, tmp_path, name):
    """The family's own names and config.json: transformers reads what we write to the same logits, and so do we."""
    assert_save_loads_in_transformers(hf_dir(name), tmp_path / "saved", VARIANTS[name][0])


def test_granite_grpo_logprobs_equal_a_full_forward_and_transformers(hf_dir):
    """The logit scale reaches the chunked log-probs of a GRPO step (train/forward.py), which read the final
    hidden state and the head's weight, never the model's logits."""
    from grpo_engine.train.batch import build_train_batch

    path = hf_dir("granite")
    prompts, completions = [[5, 6, 7, 8], [5, 6, 7, 8], [9, 10]], [[11, 12, 13], [14, 15], [16, 17, 18, 19, 20]]
    batch = build_train_batch(prompts, completions, [[0.0] * len(c) for c in completions], torch.zeros(3),
                              [True] * 3, pad_id=0)
    assert_grpo_logprobs_equal_full_forwards(load_model(path), hf_load(path), batch, prompts, completions)


@pytest.mark.parametrize("name", ONE_PER_FAMILY)
def test_lora_adapter_loads_in_peft_to_the_same_logits(hf_dir, tmp_path, name):
    """The default targets on each family's own modules (Phi-3: the fused qkv_proj and gate_up_proj); one LoRA
    training step runs, and PEFT loads the saved adapter onto transformers' model to our logits."""
    model = assert_lora_step_loads_in_peft(hf_dir(name), tmp_path / "adapter", T=12)
    fused = VARIANTS[name][0] == "phi3"
    assert set(model.lora_config.target_modules) == (
        {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"} if fused else
        {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})


@pytest.mark.parametrize("name", ONE_PER_FAMILY)
def test_full_fine_tuning_step_saves_what_transformers_loads(hf_dir, tmp_path, name):
    """A full fine-tuning step (every weight, through the block's own autograd functions) changes the model, and
    the saved checkpoint loads in transformers to the trained logits."""
    assert_full_step_loads_in_transformers(hf_dir(name), tmp_path / "trained", T=12)


def _raw(model_type: str, **fields) -> dict:
    return raw_config(BASE, model_type, **fields)


@pytest.mark.parametrize("model_type, fields, needle", [
    ("granite", dict(router_aux_loss_coef=0.01), "router_aux_loss_coef=0.01"),
    ("phi3", dict(resid_pdrop=0.1), "resid_pdrop=0.1 (only 0.0)"),
    ("olmo2", dict(hidden_act="gelu"), "hidden_act='gelu'"),
    ("qwen2", dict(use_sliding_window=True, sliding_window=8), "use_sliding_window=true"),
    ("olmo2", dict(layer_types=["sliding_attention"] * 3, sliding_window=8), "layer_types other than full"),
    ("gemma3_text", dict(attn_logit_softcapping=50.0), "attn_logit_softcapping=50.0"),
    ("gemma3_text", dict(use_bidirectional_attention=True), "use_bidirectional_attention=True"),
    ("olmo2", dict(embedding_multiplier=2.0), "embedding_multiplier=2.0 (not a field of olmo2"),
    ("granite", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
     "partial_rotary_factor=0.5 (not a field of granite"),
])
def test_config_keys_not_implemented_are_refused_by_name(model_type, fields, needle):
    assert_refused_in_one_line(_raw(model_type, **fields), needle)


def test_neutral_and_default_keys_load():
    """Keys known not to change the math (a window as long as the context, Phi-4-mini's remote-code fields,
    transformers' bookkeeping) and keys left at values that turn nothing on are accepted."""
    from grpo_engine.model.hf_io import config_from_hf

    cfg = config_from_hf(_raw("phi3", sliding_window=64, full_attn_mod=1, interpolate_factor=1, lm_head_bias=False,
                              transformers_version="4.45.0", torch_dtype="bfloat16", some_new_flag=None))
    assert cfg.model_type == "phi3"
    with pytest.raises(Exception, match="smollm3, granite, olmo2, phi3"):
        config_from_hf(_raw("gemma3"))


TINY_GGUF = {  # tiny.py families, with what llama.cpp's names and keys must carry
    "smollm3": dict(num_hidden_layers=4, rope_layers=(True, True, True, False)),
    "granite": dict(num_key_value_heads=1),
    "olmo2": dict(head_dim=24),
    "phi3": dict(num_hidden_layers=2, max_position_embeddings=64, rope_scaling=dict(LONGROPE, **{
        "original_max_position_embeddings": 16})),
}


@pytest.mark.parametrize("arch", sorted(TINY_GGUF))
def test_gguf_export_uses_llama_cpp_names_and_reads_back_equal(tmp_path, arch):
    """`grpo export --type f32` writes the family's llama.cpp architecture, its tensor names from the gguf
    package's constants (Phi-3's longrope factors as rope_factors_long / _short) and reads back to the same
    weights, description and logits."""
    gguf = pytest.importorskip("gguf")
    from grpo_engine.gguf_export import export_gguf
    from grpo_engine.model.gguf_io import reader
    from grpo_engine.model.tiny import make_tiny_checkpoint

    src = make_tiny_checkpoint(tmp_path / "src", arch, **TINY_GGUF[arch])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*phi3's partial rotary")  # a note on transformers' reader, not ours
        out = export_gguf(str(src), str(tmp_path / "m.gguf"), "f32")
    f = reader(out)
    assert f.fields["general.architecture"].contents() == arch
    assert {gguf_template(t.name) for t in f.tensors} <= gguf_names_allowed(gguf, arch)
    ours, back = load_model(src), load_model(out)
    for field in ("rope_scaling", "partial_rotary_factor", "rope_layers", "embedding_multiplier",
                  "residual_multiplier", "logits_scaling", "head_dim", "tie_word_embeddings", "model_type"):
        assert getattr(back.config, field) == getattr(ours.config, field), field
    for (name, a), (_, b) in zip(ours.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), name
    ids = torch.randint(0, ours.config.vocab_size, (2, 30), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert (back(ids) - ours(ids)).abs().max().item() < 1e-6


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"},
        {"role": "assistant", "content": "5"}, {"role": "user", "content": "And 3+4?"}]
TURN_END = {"smollm3": "<|im_end|>", "granite": "<|end_of_text|>", "olmo2": "<|endoftext|>", "phi3": "<|end|>",
            "gemma3": "<end_of_turn>"}  # Gemma: <start_of_turn>user / model turns, a sliding window in the model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from grpo_engine.model.tiny import make_tiny_checkpoint

    return {arch: make_tiny_checkpoint(tmp_path_factory.mktemp(arch), arch) for arch in TURN_END}


@pytest.mark.parametrize("arch", sorted(TURN_END))
@pytest.mark.parametrize("gen_prompt", [True, False])
def test_family_chat_templates_render_as_transformers_renders_them(tiny_dir, arch, gen_prompt):
    from grpo_engine.model.loading import load_tokenizer

    ours, theirs = load_tokenizer(tiny_dir[arch]), transformers.AutoTokenizer.from_pretrained(tiny_dir[arch])
    a = ours.apply_chat_template(CHAT, add_generation_prompt=gen_prompt)
    b = theirs.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=gen_prompt)
    assert a == b and TURN_END[arch] in a
    assert ours.encode(a) == theirs.encode(b, add_special_tokens=False)


@pytest.mark.parametrize("arch", sorted(TURN_END))
def test_family_end_of_turn_token_stops_a_completion(tiny_dir, arch):
    """The family's end-of-turn token is a stop id (Phi-3's <|end|> although its generation_config.json names
    only <|endoftext|>), and a completion that reaches it ends there."""
    from grpo_engine.model.loading import load_tokenizer
    from grpo_engine.rollout.generate import generate
    from grpo_engine.rollout.sampling import SamplingParams

    tok, model = load_tokenizer(tiny_dir[arch]), load_model(tiny_dir[arch])
    end = tok.token_to_id(TURN_END[arch])
    assert end in tok.eos_token_ids
    prompt = tok.encode(tok.apply_chat_template(CHAT[:2]))
    free = generate(model, [prompt], SamplingParams(temperature=0.0, max_new_tokens=12)).completion_ids[0]
    if model.config.tie_word_embeddings:  # the head's row alone changes, not the prompt's embedding of the token
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    with torch.no_grad():  # the end token's logit made a hair larger than the third token's wherever it leads
        model.lm_head.weight[end] = 1.05 * model.lm_head.weight[free[2]]
    out = generate(model, [prompt], SamplingParams(temperature=0.0, max_new_tokens=12,
                                                   stop_token_ids=tok.eos_token_ids))
    stopped = out.completion_ids[0]
    assert stopped[-1] == end and end not in stopped[:-1] and len(stopped) <= 3
    assert out.finish_reason[0] == "stop"


def test_granite_logprob_gradients_through_the_logit_scale_equal_transformers(hf_dir):
    """The chunked log-probs' backward (rl/logprobs.py's own autograd, as a GRPO update takes it) carries the logit
    scale and the multipliers: the gradients of an advantage-weighted log-prob sum equal transformers'."""
    from grpo_engine.train.batch import build_train_batch
    from grpo_engine.train.forward import sequence_logprobs

    path = hf_dir("granite-bias")
    ours, theirs = load_model(path).train(), hf_load(path).train()
    prompts, completions = [[5, 6, 7, 8], [9, 10]], [[11, 12, 13], [16, 17, 18, 19, 20]]
    adv = torch.tensor([1.0, -0.5])
    batch = build_train_batch(prompts, completions, [[0.0] * len(c) for c in completions], adv, [True] * 2, pad_id=0)
    logp, _ = sequence_logprobs(ours, batch, temperature=0.7, chunk_size=3)
    (logp.sum(-1) * adv).sum().backward()
    total = 0
    for i, (p, c) in enumerate(zip(prompts, completions)):
        ids = torch.tensor([p + c])
        ref = torch.log_softmax(theirs(ids).logits[0, :-1] / 0.7, -1).gather(-1, ids[0, 1:, None])[len(p) - 1:, 0]
        total = total + ref.sum() * adv[i]
    total.backward()
    theirs_params = dict(theirs.named_parameters())
    from grpo_engine.model.hf_io import hf_name_table

    for ours_name, hf in hf_name_table(ours.config).items():
        got, want = dict(ours.named_parameters())[ours_name].grad, theirs_params[hf].grad
        assert (got - want).abs().max().item() < 1e-5 * max(1.0, want.abs().max().item()), ours_name


def test_phi3_training_logprobs_take_each_row_s_own_longrope_factors(hf_dir):
    """Rows shorter and longer than the original context (16) in one batch, sharing a prompt: each row's log-probs
    equal transformers' for that row alone (the sampler's, after its prefill past the switch), not the padded
    batch's factors, and not a prompt cached with the short factors."""
    from grpo_engine.train.batch import build_train_batch
    from grpo_engine.train.forward import sequence_logprobs

    path = hf_dir("phi3")
    ours, theirs = load_model(path), hf_load(path)
    prompt = list(range(40, 50))
    completions = [[51, 52, 53], list(range(60, 80)), [81, 82, 83, 84, 85, 86, 87]]
    batch = build_train_batch([prompt] * 3, completions, [[0.0] * len(c) for c in completions], torch.zeros(3),
                              [True] * 3, pad_id=0)
    assert batch.prompt_index is not None
    with torch.no_grad():
        logp, _ = sequence_logprobs(ours, batch, temperature=1.0, chunk_size=8)
        for i, c in enumerate(completions):
            ids = torch.tensor([prompt + c])
            ref = torch.log_softmax(theirs(ids[:, :-1]).logits[0], -1).gather(-1, ids[0, 1:, None])[:, 0]
            got = logp[i, len(prompt):len(prompt) + len(c)]
            assert (got - ref[len(prompt) - 1:]).abs().max().item() < 1e-5, i


def test_phi3_gguf_export_loads_in_transformers_gguf_reader(tmp_path):
    """An independent reader of llama.cpp's phi3 names (attn_qkv, the fused ffn_up): transformers' GGUF loader
    gives our logits. It ignores rope.dimension_count and the longrope factors, so the model rotates whole heads
    with plain rope here, and the exporter warns for the others."""
    pytest.importorskip("gguf")
    from grpo_engine.gguf_export import export_gguf
    from grpo_engine.model.tiny import make_tiny_checkpoint

    src = make_tiny_checkpoint(tmp_path / "src", "phi3", partial_rotary_factor=1.0)
    export_gguf(str(src), str(tmp_path / "m.gguf"), "f32")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32)
    ids = torch.randint(0, 272, (2, 30), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert (theirs(ids).logits - load_model(src)(ids)).abs().max().item() < 1e-5
    partial = make_tiny_checkpoint(tmp_path / "partial", "phi3")
    with pytest.warns(UserWarning, match="transformers' GGUF loader ignores them"):
        export_gguf(str(partial), str(tmp_path / "p.gguf"), "f32")
