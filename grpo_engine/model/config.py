"""ModelConfig: the architecture hyper-parameters of a checkpoint, and `Family`: what a model family's block is
(no torch, so the planner and CLI can read shapes without importing it).

One transformer (transformer.py) serves every family: a family is a row of FAMILIES (its structure: norm
placement, q/k norm width, fused projections, which config.json keys it reads) plus the numbers of one
checkpoint in ModelConfig (sizes, multipliers, rope). Adding a family is adding a row, never a copy of the block
(docs/architecture.md, "Adding a model family")."""

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


# config.json keys that never change the math of any family: transformers' bookkeeping, token ids, generation
# defaults a 4.x config carries, initialisation
NEUTRAL_KEYS = frozenset({
    "_name_or_path", "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "use_cache",
    "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    "id2label", "label2id", "return_dict", "output_attentions", "output_hidden_states", "chunk_size_feed_forward",
    "is_encoder_decoder", "problem_type", "tokenizer_class", "auto_map", "torchscript", "use_bfloat16",
    "max_length", "min_length", "num_beams", "num_beam_groups", "num_return_sequences", "temperature", "top_k",
    "top_p", "typical_p", "length_penalty", "repetition_penalty", "no_repeat_ngram_size", "diversity_penalty",
    "do_sample", "early_stopping", "output_scores", "return_dict_in_generate", "tie_encoder_decoder", "is_decoder",
    "add_cross_attention", "pruned_heads", "finetuning_task", "task_specific_params", "tf_legacy_loss",
    "pretraining_tp",  # a 4.x llama option splitting the same products into slices
    "layer_types",  # each layer's attention kind: read by the families with windows (Family.window_rule)
    "_attn_implementation_autoset", "unsloth_version", "unsloth_fixed", "keys_to_ignore_at_inference",
    "gguf_general",  # a GGUF file's general.* metadata this engine carries on to an export (model/gguf_io.py)
})
# what every family reads into ModelConfig (config_from_hf)
COMMON_READS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta",
                "rope_scaling", "rope_parameters", "tie_word_embeddings")
# keys whose value must be the one the block implements (the value transformers defaults to): dropout is never
# applied, the gate's activation is silu
COMMON_FIXED = (("hidden_act", "silu"), ("attention_dropout", 0.0))


@dataclass(frozen=True)
class Family:
    """The structure of one model family's transformer, as data (the numbers of a checkpoint are ModelConfig's).

    The block computes, per layer, with norm = RMSNorm and act = `activation`:
      pre-norm  (norm="pre"):      h = x + m * attn(norm(x));        out = h + m * mlp(norm(h))
      post-norm (norm="post"):     h = x + m * norm(attn(x));        out = h + m * norm(mlp(h))   (OLMo 2)
      sandwich  (norm="sandwich"): h = x + m * norm(attn(norm(x)));  out = h + m * norm(mlp(norm(h)))  (Gemma 3)
    RMSNorm multiplies by (norm_offset + w) (Gemma: 1 + w, its weights stored as offsets from one).
    with m = ModelConfig.residual_multiplier; attn rotates q / k on the layers ModelConfig.rope_layers names
    (the first rotary_dim dims of each head), scores with ModelConfig.attention_multiplier (1/sqrt(head_dim)
    when None); the embedding is multiplied by embedding_multiplier and the logits divided by logits_scaling.
    """

    model_type: str
    architecture: str  # transformers' class, written into a saved config.json
    norm: str = "pre"  # "pre", "post" or "sandwich" (above)
    norm_weight_fp32: bool = False  # RMSNorm's weight multiplied before the cast back to the input dtype (OLMo 2)
    norm_offset: float = 0.0  # RMSNorm multiplies by (norm_offset + w), the sum in fp32 (Gemma: 1)
    activation: str = "silu"  # the gated MLP's activation: mlp(x) = down(act(gate(x)) * up(x)); or "gelu_tanh"
    embed_scale_sqrt: bool = False  # embeddings x sqrt(hidden), the factor rounded to the model's dtype (Gemma)
    qk_norm: str = ""  # "" none; "head": RMSNorm over each head (Qwen3); "proj": over the whole projection (OLMo 2)
    rope_fp32: bool = False  # q / k rotated in fp32 and cast back (OLMo 2's cos / sin are not cast first)
    fused_qkv: bool = False  # one qkv_proj [q | k | v] instead of q_proj, k_proj, v_proj (Phi-3)
    fused_gate_up: bool = False  # one gate_up_proj [gate | up] (Phi-3)
    qkv_bias: bool = False  # q / k / v always carry a bias, o none, whatever attention_bias says (Qwen2)
    reads: tuple[str, ...] = ()  # config.json keys this family reads beyond COMMON_READS
    neutral: tuple[str, ...] = ()  # keys known not to change this family's math beyond NEUTRAL_KEYS
    fixed: tuple[tuple[str, object], ...] = ()  # (key, the only value implemented) beyond COMMON_FIXED
    gguf_arch: str = ""  # llama.cpp's general.architecture ("" = no GGUF support)
    # which layers attend over a sliding window (hf_io._windows): "" none (a window in config.json is refused),
    # "every": all layers when sliding_window is set (Mistral, Phi-3); "types": config.json's layer_types, else
    # every window_pattern-th layer full (Gemma 3) or all sliding (Ministral); "no_rope": the layers without rope
    # when use_sliding_window (SmolLM3)
    window_rule: str = ""
    default_window: int | None = None  # transformers' sliding_window when config.json has none
    window_pattern: int = 0  # Gemma 3's sliding_window_pattern default: layer i full when (i + 1) % pattern == 0
    default_rope_theta: float = 10000.0  # transformers' rope_theta of full-attention layers when none is given
    turn_end: tuple[str, ...] = ()  # tokens that end a turn in the family's chat format, stops beside its eos

    def norm_names(self) -> dict[str, str]:
        """A layer's norms: our module name -> transformers' (attn_norm / mlp_norm before or after their branch,
        attn_out_norm / mlp_out_norm after it in the sandwich)."""
        if self.norm == "post":
            return {"attn_norm": "post_attention_layernorm", "mlp_norm": "post_feedforward_layernorm"}
        if self.norm == "sandwich":
            return {"attn_norm": "input_layernorm", "attn_out_norm": "post_attention_layernorm",
                    "mlp_norm": "pre_feedforward_layernorm", "mlp_out_norm": "post_feedforward_layernorm"}
        return {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}


_WINDOWS = ("use_sliding_window", "sliding_window", "max_window_layers")  # checked by hf_io (sliding windows)
_WINDOW_READS = ("sliding_window", "layer_types")
FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("qwen2", "Qwen2ForCausalLM", qkv_bias=True, neutral=_WINDOWS + ("attention_bias",), gguf_arch="qwen2"),
    Family("qwen3", "Qwen3ForCausalLM", qk_norm="head", reads=("attention_bias",), neutral=_WINDOWS,
           gguf_arch="qwen3"),
    Family("llama", "LlamaForCausalLM", reads=("attention_bias", "mlp_bias"), neutral=("is_llama_config",),
           gguf_arch="llama"),
    Family("smollm3", "SmolLM3ForCausalLM", reads=("attention_bias", "mlp_bias", "no_rope_layers",
                                                   "no_rope_layer_interval", "use_sliding_window") + _WINDOW_READS,
           neutral=("max_window_layers",), gguf_arch="smollm3", turn_end=("<|im_end|>",), window_rule="no_rope"),
    Family("granite", "GraniteForCausalLM", reads=("attention_bias", "mlp_bias", "embedding_multiplier",
                                                   "residual_multiplier", "attention_multiplier", "logits_scaling"),
           gguf_arch="granite", turn_end=("<|end_of_text|>",)),
    Family("olmo2", "Olmo2ForCausalLM", norm="post", norm_weight_fp32=True, qk_norm="proj", rope_fp32=True,
           reads=("attention_bias",), gguf_arch="olmo2", turn_end=("<|endoftext|>",)),
    Family("phi3", "Phi3ForCausalLM", fused_qkv=True, fused_gate_up=True,
           reads=("original_max_position_embeddings", "partial_rotary_factor", "sliding_window"),
           neutral=("full_attn_mod", "interpolate_factor"),
           fixed=(("resid_pdrop", 0.0), ("embd_pdrop", 0.0)), gguf_arch="phi3", turn_end=("<|end|>",),
           window_rule="every"),
    Family("gemma3_text", "Gemma3ForCausalLM", norm="sandwich", norm_weight_fp32=True, norm_offset=1.0,
           activation="gelu_tanh", embed_scale_sqrt=True, qk_norm="head",
           reads=("attention_bias", "query_pre_attn_scalar", "final_logit_softcapping", "rope_local_base_freq",
                  "sliding_window_pattern") + _WINDOW_READS,
           neutral=("cache_implementation", "_sliding_window_pattern"),
           fixed=(("hidden_activation", "gelu_pytorch_tanh"), ("hidden_act", "gelu_pytorch_tanh"),
                  ("attn_logit_softcapping", None), ("use_bidirectional_attention", False)),
           gguf_arch="gemma3", turn_end=("<end_of_turn>",), window_rule="types", default_window=4096,
           window_pattern=6, default_rope_theta=1_000_000.0),
    Family("mistral", "MistralForCausalLM", reads=("sliding_window",), gguf_arch="llama", window_rule="every",
           default_window=4096),
    Family("ministral", "MinistralForCausalLM", reads=_WINDOW_READS, gguf_arch="llama", window_rule="types",
           default_window=4096),
)}
# model types refused with their reason (a near relative of a supported family)
REFUSED_TYPES = {
    "ministral3": "its YaRN rope and query scale are not implemented (ministral, mistral are)",
    "gemma3": "a multimodal Gemma 3 checkpoint; its text model (gemma3_text) loads",
}


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
    attention_bias: bool = False  # bias on the q/k/v projections (Qwen2: always)
    o_bias: bool = False  # bias on o_proj (attention_bias of llama-like families)
    mlp_bias: bool = False  # bias on the MLP's projections
    embedding_multiplier: float = 1.0  # embeddings x m (Granite)
    residual_multiplier: float = 1.0  # each block's branch x m before the residual add (Granite)
    attention_multiplier: float | None = None  # the scores' scale; None = 1/sqrt(head_dim)
    logits_scaling: float = 1.0  # logits / s (Granite): applied to the final hidden state (Transformer.forward)
    partial_rotary_factor: float = 1.0  # the share of each head's dims that rotates (Phi-3 / Phi-4-mini)
    rope_layers: tuple[bool, ...] | None = None  # per layer, whether it applies rope (SmolLM3); None = every layer
    sliding_window: int | None = None  # a sliding layer's query at position i sees keys at i - window < j <= i
    layer_types: tuple[str, ...] | None = None  # "sliding_attention" / "full_attention" per layer; None = all full
    rope_local_theta: float | None = None  # sliding layers' rope theta, unscaled (Gemma 3); None = the full layers'
    final_logit_softcapping: float | None = None  # logits = c * tanh(logits / c) (Gemma 3)
    model_type: str = "qwen2"  # the FAMILIES row; written back into config.json on save
    extra: dict = field(default_factory=dict)  # other config.json fields, preserved on save

    def __post_init__(self) -> None:
        if self.model_type not in FAMILIES:
            raise ValueError(f"model_type {self.model_type!r} is not supported; supported: {', '.join(FAMILIES)}")
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.rope_layers is not None:
            self.rope_layers = tuple(bool(r) for r in self.rope_layers)
            if len(self.rope_layers) != self.num_hidden_layers:
                raise ValueError(f"rope_layers has {len(self.rope_layers)} entries for "
                                 f"num_hidden_layers={self.num_hidden_layers}")
        if self.layer_types is not None:
            self.layer_types = tuple(self.layer_types)
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(f"layer_types has {len(self.layer_types)} entries for "
                                 f"num_hidden_layers={self.num_hidden_layers}")
            if "sliding_attention" in self.layer_types and not self.sliding_window:
                raise ValueError("layer_types names sliding_attention layers but sliding_window is not set")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )

    @property
    def family(self) -> Family:
        return FAMILIES[self.model_type]

    @property
    def qk_norm(self) -> str:
        """The family's q/k norm ("" none, "head", "proj")."""
        return self.family.qk_norm

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of each head rotate (transformers: int(head_dim * partial_rotary_factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    def uses_rope(self, layer: int) -> bool:
        return self.rope_layers is None or self.rope_layers[layer]

    def window(self, layer: int) -> int | None:
        """The sliding window of layer `layer` (None: full attention)."""
        if self.layer_types is None or self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def windowed(self) -> bool:
        """Whether any layer attends over a sliding window."""
        return any(self.window(i) is not None for i in range(self.num_hidden_layers))
