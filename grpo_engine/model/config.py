"""ModelConfig: the architecture hyper-parameters of a checkpoint (no torch, so the planner and CLI can read
shapes without importing it)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


class CheckpointError(ValueError):
    """A checkpoint (directory or GGUF file) that cannot be loaded; the message names the file or tensor and
    the fix."""


# Bounds on what a checkpoint's config may claim, checked before any module is built (a config.json or GGUF
# header of a few hundred bytes claiming 10^6 layers built gigabytes of modules for minutes). Generous: the
# largest open models (Llama-3.1-405B: 126 layers, hidden 16384, 128 heads, intermediate 53248; Gemma 3's
# 262144-token vocabulary; Llama 4's 10M-token context) are well inside, a ~100B model by 4x or more.
DIM_LIMITS = {
    "vocab_size": 1 << 22,  # 4,194,304
    "hidden_size": 1 << 16,
    "intermediate_size": 1 << 19,
    "num_hidden_layers": 512,
    "num_attention_heads": 1024,
    "num_key_value_heads": 1024,
    "head_dim": 4096,
    "max_position_embeddings": 1 << 24,  # 16,777,216
}
MAX_PARAMETERS = 10**12  # 10x a ~100B model
# the dimensions ModelConfig has no default for: a checkpoint's config (config.json, GGUF metadata) must give them
REQUIRED_DIMS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def checked_dims(dims: dict, source: str, keys: dict | None = None) -> dict:
    """`dims` (ModelConfig's integer fields as a checkpoint gives them; head_dim 0 = hidden / heads) checked to be
    whole numbers within DIM_LIMITS that fit together, before anything is built from them. Returns them as ints.
    keys: the file's own name for a field, for the message (a GGUF's "llama.block_count")."""
    out = {}
    for name, value in dims.items():
        ok = isinstance(value, int) and not isinstance(value, bool)
        if not ok or not (name == "head_dim" and value == 0 or 1 <= value <= DIM_LIMITS[name]):
            label = (keys or {}).get(name, name)
            raise CheckpointError(f"{source}: {label}={value!r:.80} is not a whole number from 1 to "
                                  f"{DIM_LIMITS[name]:,}; the file is corrupt or not a model this engine loads")
        out[name] = int(value)
    heads, kv = out["num_attention_heads"], out["num_key_value_heads"]
    if heads % kv:
        raise CheckpointError(f"{source}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
    head_dim = out["head_dim"] or out["hidden_size"] // heads
    if head_dim < 1:
        raise CheckpointError(f"{source}: hidden_size={out['hidden_size']} is smaller than num_attention_heads={heads}")
    hidden, layers = out["hidden_size"], out["num_hidden_layers"]
    per_layer = hidden * head_dim * (2 * heads + 2 * kv) + 3 * hidden * out["intermediate_size"]
    params = 2 * out["vocab_size"] * hidden + layers * per_layer
    if params > MAX_PARAMETERS:
        raise CheckpointError(f"{source}: these dimensions make {params:.2e} parameters, over the "
                              f"{MAX_PARAMETERS:.0e} this engine accepts; the config is corrupt")
    return out


def checked_float(value, name: str, source: str) -> float:
    """A positive, finite float field (rms_norm_eps, rope_theta) of a checkpoint's config."""
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        number = math.nan
    if isinstance(value, bool) or not (math.isfinite(number) and number > 0):
        raise CheckpointError(f"{source}: {name}={value!r} is not a positive number; the config is corrupt")
    return number


def rope_kind(scaling: dict | None) -> str:
    """The rope scaling type of a rope_scaling / rope_parameters dict ("default" for none), under either spelling
    transformers has used for its key ("rope_type", older "type")."""
    scaling = scaling or {}
    return scaling.get("rope_type", scaling.get("type", "default"))


@dataclass
class ModelConfig:
    """Architecture hyper-parameters; field names follow HF config.json where one exists."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 0  # 0 -> hidden_size // num_attention_heads (Qwen3 gives it explicitly)
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # None, {"rope_type": "linear"|"llama3", ...}
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2: True)
    qk_norm: bool = False  # RMSNorm on each head of q and k before RoPE (Qwen3)
    model_type: str = "qwen2"  # written back into config.json on save
    extra: dict = field(default_factory=dict)  # other config.json fields, preserved on save

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
