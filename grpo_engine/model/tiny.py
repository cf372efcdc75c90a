"""Write tiny random checkpoints in real Hugging Face layout, with no transformers needed.

Used by the tests (parity against transformers, loader errors), the CPU demo and the benchmarks. The
tokenizer is byte-level with no merges — one token per byte, so every string round-trips — plus the
special tokens of a Qwen-style (ChatML) or Llama-3-style chat format and a chat template written here.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from .hf_io import save_hf_model
from .transformer import ModelConfig, Transformer

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim }}"
    "{{- '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
# the chat formats of the other families, written here in each one's layout (Phi-3 / Phi-4-mini, Granite 3.x,
# OLMo 2 instruct); SmolLM3 speaks ChatML
PHI3_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>' }}{%- else %}{{- eos_token }}{%- endif %}"
)
GRANITE_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|start_of_role|>' + message['role'] + '<|end_of_role|>' + message['content'] + '<|end_of_text|>\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_of_role|>assistant<|end_of_role|>' }}{%- endif %}"
)
OLMO2_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}{{- '<|assistant|>\n' + message['content'] + eos_token + '\n' }}"
    "{%- else %}{{- '<|' + message['role'] + '|>\n' + message['content'] + '\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\n' }}{%- endif %}"
)
GEMMA_TEMPLATE = (  # Gemma's turns: the assistant is "model", a system message opens the first user turn
    "{{- bos_token }}"
    "{%- set ns = namespace(system='') %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{%- set ns.system = message['content'] + '\n\n' %}"
    "{%- else %}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{- '<start_of_turn>' + role + '\n' + ns.system + message['content'] | trim + '<end_of_turn>\n' }}"
    "{%- set ns.system = '' %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\n' }}{%- endif %}"
)
CHAT_STYLES = {
    # style: (special tokens, bos, eos, pad, template)
    "chatml": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>", "<|endoftext|>", CHATML_TEMPLATE),
    "llama3": (
        ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "<|begin_of_text|>",
        "<|eot_id|>",
        "<|end_of_text|>",
        LLAMA3_TEMPLATE,
    ),
    "phi3": (["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"], None, "<|endoftext|>",
             "<|endoftext|>", PHI3_TEMPLATE),
    "granite": (["<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>"], None, "<|end_of_text|>",
                "<|end_of_text|>", GRANITE_TEMPLATE),
    "olmo2": (["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|pad|>"], "<|endoftext|>",
              "<|endoftext|>", "<|pad|>", OLMO2_TEMPLATE),
    "gemma": (["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"], "<bos>", "<eos>", "<pad>",
              GEMMA_TEMPLATE),
}
FAMILY_STYLES = {"llama3": "llama3", "phi3": "phi3", "granite": "granite", "olmo2": "olmo2", "gemma3": "gemma",
                 "mistral": "llama3", "ministral": "llama3"}  # else chatml

ARCHS = {
    # model_type and the config fields that distinguish each family
    "qwen2": dict(model_type="qwen2", attention_bias=True),
    "qwen2-tied": dict(model_type="qwen2", attention_bias=True, tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3"),
    "llama3": dict(
        model_type="llama",
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "smollm3": dict(model_type="smollm3", tie_word_embeddings=True, attention_bias=True, o_bias=True),
    "granite": dict(model_type="granite", embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.1,
                    logits_scaling=2.0),
    "olmo2": dict(model_type="olmo2"),
    "phi3": dict(model_type="phi3", partial_rotary_factor=0.5),
    # sliding windows shorter than the tests' sequences: sliding and full layers mixed
    "gemma3": dict(model_type="gemma3_text", tie_word_embeddings=True, head_dim=32, attention_multiplier=24**-0.5,
                   sliding_window=8, layer_types=("sliding_attention", "full_attention"), rope_theta=1_000_000.0,
                   rope_local_theta=10_000.0),
    "mistral": dict(model_type="mistral", head_dim=24, sliding_window=8,
                    layer_types=("sliding_attention", "sliding_attention")),
    "ministral": dict(model_type="ministral", sliding_window=6, layer_types=("full_attention", "sliding_attention")),
}


def byte_unicode_map() -> dict[int, str]:
    """GPT-2 byte -> printable unicode character map, as used by the ByteLevel pre-tokenizer."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {}, 0
    for b in range(256):
        if b in keep:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def write_byte_tokenizer(out_dir: str | Path, style: str = "chatml", max_length: int = 2048) -> int:
    """Write tokenizer.json + tokenizer_config.json; returns the tokenizer's vocabulary size."""
    specials, bos, eos, pad, template = CHAT_STYLES[style]
    vocab = {ch: b for b, ch in byte_unicode_map().items()}  # byte value = token id
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": pad,
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return tok.get_vocab_size(with_added_tokens=True)


def tiny_config(arch: str = "qwen2", **overrides) -> ModelConfig:
    """A small ModelConfig of the given family; overrides replace any field."""
    if arch not in ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; choose from {sorted(ARCHS)}")
    fields = dict(
        vocab_size=272,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
    )
    fields.update(ARCHS[arch])
    if arch == "qwen3":
        fields["head_dim"] = 32  # explicit and != hidden / heads, as in real Qwen3
    fields.update(overrides)
    return ModelConfig(**fields)


def init_weights(model: Transformer, seed: int, std: float = 0.02) -> None:
    """Normal(0, std) matrices, small random biases and norm weights near 1 (so each is exercised).

    Drawn on the parameters' device (a CUDA generator makes a 3B model in seconds; the CPU stream is the
    one the tests and CPU checkpoints have always used)."""
    device = next(model.parameters()).device
    g = torch.Generator(device=device).manual_seed(seed)
    offset = model.config.family.norm_offset  # Gemma's norms store w - 1
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, device=device, dtype=torch.float32)
            if name.endswith("norm.weight"):
                p.copy_(1 - offset + 0.1 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(std * noise)


def make_tiny_checkpoint(
    out_dir: str | Path, arch: str = "qwen2", *, seed: int = 0, chat_style: str | None = None,
    dtype: torch.dtype = torch.float32, device: str = "cpu", **overrides
) -> Path:
    """Write a random-weight checkpoint of `arch` plus a byte-level tokenizer into out_dir.

    dtype / device: the weights' saved dtype and where they are drawn (device="cuda" for real shapes:
    benchmarks/gpu_check.py makes Qwen2.5-3B-shaped checkpoints this way)."""
    out = Path(out_dir)
    style = chat_style or FAMILY_STYLES.get(arch, "chatml")
    n_tok = write_byte_tokenizer(out, style)
    shape = tiny_config(arch, **overrides)  # the model's own config (config.json), not a run's settings
    if shape.vocab_size < n_tok:
        raise ValueError(f"vocab_size={shape.vocab_size} is smaller than the tokenizer's {n_tok} tokens")
    with torch.device(device):
        model = Transformer(shape)
    init_weights(model, seed)
    model.to(device="cpu", dtype=dtype)
    specials, bos, eos, pad, _ = CHAT_STYLES[style]
    ids = {s: 256 + i for i, s in enumerate(specials)}
    shape.extra = {"bos_token_id": ids.get(bos), "eos_token_id": ids[eos], "pad_token_id": ids[pad]}
    gen = {"bos_token_id": ids.get(bos), "eos_token_id": [ids[eos], ids[pad]], "pad_token_id": ids[pad]}
    save_hf_model(model, out, generation_config=gen)
    return out
