"""Model shapes the planner knows by name, or reads from an HF checkpoint's config.json (never the weights)."""

from __future__ import annotations

from pathlib import Path

from ..model.config import ModelConfig


def _qwen25(hidden, layers, heads, inter) -> ModelConfig:
    return ModelConfig(vocab_size=151936, hidden_size=hidden, intermediate_size=inter,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=2,
                       tie_word_embeddings=True, attention_bias=True, model_type="qwen2")


def _gemma3(hidden, layers, inter) -> ModelConfig:
    """google/gemma-3-270m and gemma-3-1b's published config.json: 4 query heads and one KV head of 256, a window
    of 512 on five layers of every six (the sixth full), a 262,144-token tied vocabulary."""
    return ModelConfig(vocab_size=262144, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=1, head_dim=256, max_position_embeddings=32768,
                       tie_word_embeddings=True, attention_multiplier=256**-0.5, sliding_window=512,
                       layer_types=tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                         for i in range(layers)),
                       rope_theta=1_000_000.0, rope_local_theta=10_000.0, model_type="gemma3_text")


MODEL_SHAPES: dict[str, ModelConfig] = {
    "qwen2.5-0.5b": _qwen25(896, 24, 14, 4864),
    "qwen2.5-1.5b": _qwen25(1536, 28, 12, 8960),
    "qwen2.5-3b": _qwen25(2048, 36, 16, 11008),
    # from the published config.json of HuggingFaceTB/SmolLM3-3B, ibm-granite/granite-3.3-2b-instruct,
    # allenai/OLMo-2-0425-1B and microsoft/Phi-4-mini-instruct (shapes only: the planner needs no rope factors)
    "smollm3-3b": ModelConfig(vocab_size=128256, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                              num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=65536,
                              tie_word_embeddings=True, model_type="smollm3",
                              rope_layers=tuple((i + 1) % 4 != 0 for i in range(36))),
    "granite-3.3-2b": ModelConfig(vocab_size=49159, hidden_size=2048, intermediate_size=8192, num_hidden_layers=40,
                                  num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                                  tie_word_embeddings=True, model_type="granite", embedding_multiplier=12.0,
                                  residual_multiplier=0.22, attention_multiplier=0.015625, logits_scaling=8.0),
    "olmo2-1b": ModelConfig(vocab_size=100352, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                            num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=4096,
                            model_type="olmo2"),
    "phi4-mini": ModelConfig(vocab_size=200064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                             num_attention_heads=24, num_key_value_heads=8, max_position_embeddings=131072,
                             tie_word_embeddings=True, partial_rotary_factor=0.75, model_type="phi3"),
    "gemma3-270m": _gemma3(640, 18, 2048),
    "gemma3-1b": _gemma3(1152, 26, 6912),
    # mistralai/Ministral-8B-Instruct-2410: one full layer then three with a window of 32,768 (transformers'
    # Ministral), a window as long as its configured context
    "ministral-8b": ModelConfig(vocab_size=131072, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                                num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                max_position_embeddings=32768, rope_theta=100_000_000.0, sliding_window=32768,
                                layer_types=tuple("sliding_attention" if i % 4 else "full_attention"
                                                  for i in range(36)), model_type="ministral"),
}


def model_shape(name_or_dir: str) -> ModelConfig:
    """A ModelConfig from a known shape name, an HF checkpoint directory (reads config.json only) or a .gguf file
    (reads its header only)."""
    if name_or_dir in MODEL_SHAPES:
        return MODEL_SHAPES[name_or_dir]
    path = Path(name_or_dir)
    if path.suffix == ".gguf" and path.is_file():
        from ..model.gguf_io import config_from_gguf, read_gguf

        return config_from_gguf(read_gguf(path).meta, str(path))
    if path.is_dir():
        from ..model.hf_io import config_from_hf, read_json

        return config_from_hf(read_json(path / "config.json"), source=str(path / "config.json"))
    raise ValueError(f"unknown model {name_or_dir!r}: give an HF model dir or one of {sorted(MODEL_SHAPES)}")
