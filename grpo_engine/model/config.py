"""ModelConfig: the architecture hyper-parameters of a checkpoint (no torch, so the planner and CLI can read
shapes without importing it)."""

from __future__ import annotations

from dataclasses import dataclass, field


class CheckpointError(ValueError):
    """A checkpoint (directory or GGUF file) that cannot be loaded; the message names the file or tensor and
    the fix."""


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
