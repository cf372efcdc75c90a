"""Hugging Face checkpoint directory <-> `Transformer`.

Reads config.json as written by transformers 4.x (top-level `rope_theta` / `rope_scaling`) and 5.x
(`rope_parameters`), loads single-file or sharded safetensors through ONE explicit name table
(`hf_name_table`), refuses missing / unexpected / mis-shaped tensors by name, and saves a directory that
transformers' AutoModelForCausalLM and vLLM load: config.json, generation_config.json, safetensors
(sharded with an index when large) and the tokenizer files.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..config.paths import read_regular, regular_path
from .config import (
    COMMON_FIXED,
    COMMON_READS,
    FAMILIES,
    NEUTRAL_KEYS,
    REFUSED_TYPES,
    REQUIRED_DIMS,
    CheckpointError,
    Family,
    checked_dims,
    checked_float,
    rope_kind,
)
from .tensor_checks import check_tensor_shapes, safetensors_shapes
from .transformer import ModelConfig, Transformer

SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
)
INDEX_FILE = "model.safetensors.index.json"


# ----------------------------------------------------------------------------------------------------
# config.json


MAX_JSON_BYTES = 64 * 1024 * 1024  # config.json, the shard index, tokenizer_config.json: KiB to a few MiB


def read_json(path: Path) -> dict:
    """A JSON file of a checkpoint (size-bounded), every way it can fail one CheckpointError naming it."""
    try:
        if path.stat().st_size > MAX_JSON_BYTES:
            raise CheckpointError(f"{path}: {path.stat().st_size:,} bytes, over the {MAX_JSON_BYTES:,} a JSON file "
                                  f"of a checkpoint may have; re-download or re-save the checkpoint")
        return json.loads(read_regular(path, "JSON file", max_bytes=MAX_JSON_BYTES, option="a smaller file",
                                       error=CheckpointError).decode("utf-8"))  # a FIFO or a device: refused
    except FileNotFoundError:
        raise CheckpointError(f"{path} not found: is this a Hugging Face model directory?") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        what = "nested too deeply" if isinstance(e, RecursionError) else e
        raise CheckpointError(f"{path} is not valid JSON ({what}); re-download or re-save the checkpoint") from None
    except (IsADirectoryError, NotADirectoryError, PermissionError) as e:
        raise CheckpointError(f"{path} cannot be read ({e.strerror}); fix the path or its permissions") from None


def _rope_fields(raw: dict, source: str, fam: Family) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) of the full-attention layers from either the 4.x or the 5.x layout of
    config.json (the sliding layers' own rope: _local_rope_theta).

    A non-empty `rope_scaling` wins over `rope_parameters`, as in transformers 5: a 5.x-saved config that
    someone then gave a `rope_scaling` (Qwen's recipe for YaRN) runs with that scaling there, so reading
    `rope_parameters` here would load it silently with other frequencies. The theta then comes, as there,
    from the scaling dict or the top-level `rope_theta`.
    """
    params = raw.get("rope_scaling") or raw.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # per-layer-type layout
        params = params["full_attention"]
    params = params or {}
    if not isinstance(params, dict) or not isinstance(rope_kind(params), str):
        raise CheckpointError(f"{source}: rope_scaling / rope_parameters must be an object with a string "
                              f"rope_type, got {params!r:.80}")
    theta = params.get("rope_theta", raw.get("rope_theta", fam.default_rope_theta))
    # partial_rotary_factor is read by _numbers; the rest of the dict is the scaling
    scaling = None if rope_kind(params) == "default" else {
        k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
    return checked_float(theta, "rope_theta", source), scaling


def _local_rope_theta(raw: dict, fam: Family, theta: float, source: str) -> tuple[float | None, list[str]]:
    """The rope theta of the sliding layers when they have their own (5.x: rope_parameters["sliding_attention"];
    4.x: Gemma 3's rope_local_base_freq) and what of it is not implemented: a scaled sliding rope."""
    params = raw.get("rope_parameters")
    local = params.get("sliding_attention") if isinstance(params, dict) else None
    if isinstance(local, dict):
        if rope_kind(local) != "default":
            return None, [f"rope_parameters.sliding_attention rope_type={rope_kind(local)!r} (only default)"]
        local_theta = checked_float(local.get("rope_theta", theta), "rope_parameters.sliding_attention.rope_theta",
                                    source)
    elif "rope_local_base_freq" in fam.reads:
        local_theta = checked_float(raw.get("rope_local_base_freq", 10000.0), "rope_local_base_freq", source)
    else:
        return None, []
    return local_theta, []


def _rope_param(raw: dict, key: str, default):
    """A rope field a 5.x config keeps in rope_parameters and a 4.x one at the top level."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and key in params:
        return params[key]
    return raw.get(key, default)


def _check_rope(raw: dict, scaling: dict | None, source: str) -> list[str]:
    """What the rope scaling asks for that the engine does not implement; fills the defaults transformers uses."""
    unsupported = []
    kind = rope_kind(scaling)
    if kind not in ("default", "linear", "llama3", "longrope"):
        return [f"rope type {kind!r} (supported: default, linear, llama3, longrope)"]
    if kind in ("llama3", "longrope"):  # transformers' default when absent; rope_inv_freq needs it
        original = scaling.get("original_max_position_embeddings") or raw.get("original_max_position_embeddings")
        scaling["original_max_position_embeddings"] = original or raw.get("max_position_embeddings", 32768)
    needed = {"linear": ["factor"], "llama3": ["factor", "low_freq_factor", "high_freq_factor"],
              "longrope": ["short_factor", "long_factor"]}.get(kind, [])
    lacking = [k for k in needed if k not in scaling]  # else a KeyError at the first forward, not here
    if lacking:
        return [f"rope type {kind!r} without {', '.join(lacking)}"]
    if kind in ("linear", "llama3"):  # numbers, not an error at the first forward
        for k in needed + (["original_max_position_embeddings"] if kind == "llama3" else []):
            checked_float(scaling[k], f"rope_scaling.{k}", source)
    if kind == "longrope":
        checked_float(scaling["original_max_position_embeddings"], "original_max_position_embeddings", source)
        for k in ("short_factor", "long_factor"):
            factors = scaling[k]
            if not isinstance(factors, list) or not all(isinstance(f, (int, float)) and f > 0 for f in factors):
                unsupported.append(f"rope_scaling.{k} (must be a list of positive numbers)")
        for k in ("factor", "attention_factor"):
            if scaling.get(k) is not None:
                checked_float(scaling[k], f"rope_scaling.{k}", source)
    return unsupported


def _is_default(value) -> bool:
    """A value that turns nothing on: what an unknown key may hold without being refused."""
    return value is None or value is False or value == 0 or value in ("", [], {})


def _unaccounted(raw: dict, fam: Family) -> list[str]:
    """config.json keys the family neither reads nor knows to be neutral, set to something: each as key=value.
    A key of a fixed value must hold it (the block implements that value only)."""
    fixed = dict(COMMON_FIXED + fam.fixed)
    known = set(COMMON_READS) | set(fam.reads) | NEUTRAL_KEYS | set(fam.neutral)
    out = []
    for key, value in raw.items():
        if key in fixed:
            if value != fixed[key] and not (value is None and key != "hidden_act"):
                out.append(f"{key}={value!r:.60} (only {fixed[key]!r})")
        elif key not in known and not _is_default(value):
            out.append(f"{key}={value!r:.60} (not a field of {fam.model_type} this engine implements)")
    return out


_NO_WINDOW = "(only full attention for this family: its transformers model has no sliding window)"
LAYER_KINDS = ("full_attention", "sliding_attention")


def _windows(raw: dict, fam: Family, layers: int, rope_layers: tuple[bool, ...] | None,
             source: str) -> tuple[int | None, tuple[str, ...] | None, list[str]]:
    """(sliding_window, layer_types, what is not implemented) as transformers' model of the family reads them
    (Family.window_rule); layer_types None when every layer attends in full."""
    rule = fam.window_rule
    if not rule:  # qwen2 / qwen3 / llama / granite / olmo2: no window is implemented
        types = raw.get("layer_types")
        if raw.get("use_sliding_window"):
            return None, None, [f"use_sliding_window=true {_NO_WINDOW}"]
        if isinstance(types, list) and any(t != "full_attention" for t in types):
            return None, None, [f"layer_types other than full_attention {_NO_WINDOW}"]
        return None, None, []
    window = raw.get("sliding_window", fam.default_window)
    if rule == "no_rope" and not raw.get("use_sliding_window"):
        window = None
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise CheckpointError(f"{source}: sliding_window={window!r:.40} is not a positive whole number or null")
    types = raw.get("layer_types") if rule in ("types", "no_rope") else None
    if types is None:
        if rule == "types" and fam.window_pattern:
            pattern = raw.get("sliding_window_pattern", fam.window_pattern)
            if not isinstance(pattern, int) or pattern < 1:
                raise CheckpointError(f"{source}: sliding_window_pattern={pattern!r:.40} is not a positive number")
            types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
        elif rule == "no_rope":
            types = ["sliding_attention" if window is not None and not (rope_layers or (True,) * layers)[i]
                     else "full_attention" for i in range(layers)]
        else:
            types = ["sliding_attention" if window is not None else "full_attention"] * layers
    if not isinstance(types, list) or len(types) != layers or any(t not in LAYER_KINDS for t in types):
        raise CheckpointError(f"{source}: layer_types must name full_attention or sliding_attention for each of "
                              f"the {layers} layers, got {types!r:.80}")
    if rule == "no_rope" and window is None:  # SmolLM3 windows only under use_sliding_window
        types = ["full_attention"] * layers
    if window is None and "sliding_attention" in types:
        return None, None, ["layer_types with sliding_attention layers but sliding_window=null"]
    if window is None or "sliding_attention" not in types:
        return None, None, []
    return window, tuple(types), []


def _unsupported(raw: dict, fam: Family, scaling: dict | None, source: str) -> list[str]:
    """What config.json asks for that this engine does not implement (each as the field and why)."""
    return _unaccounted(raw, fam) + _check_rope(raw, scaling, source)


def _rope_layers(raw: dict, layers: int, source: str) -> tuple[bool, ...] | None:
    """SmolLM3's no_rope_layers: entry i is 1 where layer i USES rope (transformers' name is inverted); absent,
    every no_rope_layer_interval-th layer (4 by default) goes without."""
    flags = raw.get("no_rope_layers")
    if flags is None:
        interval = raw.get("no_rope_layer_interval", 4)
        if not isinstance(interval, int) or interval < 1:
            raise CheckpointError(f"{source}: no_rope_layer_interval={interval!r} is not a positive whole number")
        return tuple((i + 1) % interval != 0 for i in range(layers))
    if not isinstance(flags, list) or len(flags) != layers or any(f not in (0, 1) for f in flags):
        raise CheckpointError(f"{source}: no_rope_layers must list 0 or 1 for each of the {layers} layers, "
                              f"got {flags!r:.80}")
    return tuple(bool(f) for f in flags)


def _numbers(raw: dict, fam: Family, layers: int, source: str) -> dict:
    """The ModelConfig fields beyond the dimensions that this family reads (biases, multipliers, rope layers)."""
    reads = set(fam.reads)
    bias = bool(raw.get("attention_bias", False)) if "attention_bias" in reads else False
    out = dict(attention_bias=bias, o_bias=bias, mlp_bias="mlp_bias" in reads and bool(raw.get("mlp_bias", False)))
    for key in ("embedding_multiplier", "residual_multiplier", "logits_scaling"):
        if key in reads:
            out[key] = checked_float(raw.get(key, 1.0), key, source)
    if "attention_multiplier" in reads:
        out["attention_multiplier"] = checked_float(raw.get("attention_multiplier", 1.0), "attention_multiplier",
                                                    source)
    factor = checked_float(_rope_param(raw, "partial_rotary_factor", 1.0), "partial_rotary_factor", source)
    if factor > 1 or (factor != 1 and "partial_rotary_factor" not in reads):
        why = "over 1" if factor > 1 else f"not a field of {fam.model_type} this engine implements"
        raise CheckpointError(f"{source}: unsupported feature(s): partial_rotary_factor={factor} ({why})")
    if "partial_rotary_factor" in reads:
        out["partial_rotary_factor"] = factor
    if "no_rope_layers" in reads:
        out["rope_layers"] = _rope_layers(raw, layers, source)
    if "query_pre_attn_scalar" in reads:  # Gemma: scores x query_pre_attn_scalar ** -0.5
        out["attention_multiplier"] = checked_float(raw.get("query_pre_attn_scalar", 256), "query_pre_attn_scalar",
                                                    source) ** -0.5
    if raw.get("final_logit_softcapping") is not None and "final_logit_softcapping" in reads:
        out["final_logit_softcapping"] = checked_float(raw["final_logit_softcapping"], "final_logit_softcapping",
                                                       source)
    return out


def config_from_hf(raw: dict, source: str = "config.json") -> ModelConfig:
    """Map an HF config dict onto ModelConfig, rejecting what this engine does not implement and dimensions
    beyond sane limits (config.py: checked_dims) before anything is built from them."""
    if not isinstance(raw, dict):
        raise CheckpointError(f"{source}: the top level must be a JSON object, got {type(raw).__name__}")
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        why = f" ({REFUSED_TYPES[model_type]})" if isinstance(model_type, str) and model_type in REFUSED_TYPES else ""
        raise CheckpointError(f"{source}: model_type {model_type!r} is not supported{why}; supported: "
                              f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    fam = FAMILIES[model_type]
    theta, scaling = _rope_fields(raw, source, fam)
    local_theta, local_unsupported = _local_rope_theta(raw, fam, theta, source)
    layers = raw.get("num_hidden_layers")
    numbers = _numbers(raw, fam, layers, source) if isinstance(layers, int) and 0 < layers <= 512 else {}
    window, layer_types, window_unsupported = (
        _windows(raw, fam, layers, numbers.get("rope_layers"), source) if numbers else (None, None, []))
    unsupported = _unsupported(raw, fam, scaling, source) + local_unsupported + window_unsupported
    if unsupported:
        raise CheckpointError(f"{source}: unsupported feature(s): {'; '.join(unsupported)}")
    lacking = [k for k in REQUIRED_DIMS if k not in raw]
    if lacking:
        raise CheckpointError(f"{source}: required field {lacking[0]!r} is missing")
    dims = {k: raw[k] for k in REQUIRED_DIMS}
    dims.update(num_key_value_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
                head_dim=raw.get("head_dim") or 0, max_position_embeddings=raw.get("max_position_embeddings", 32768))
    dims = checked_dims(dims, source)
    cfg = ModelConfig(
        **dims,
        rms_norm_eps=checked_float(raw.get("rms_norm_eps", 1e-6), "rms_norm_eps", source),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        model_type=model_type,
        extra=raw,
        sliding_window=window,
        layer_types=layer_types,
        rope_local_theta=local_theta,
        **numbers,
    )
    _check_rotary(cfg, source)
    return cfg


def _check_rotary(cfg: ModelConfig, source: str) -> None:
    """The rotary dims are even and longrope gives a factor per frequency (else a shape error at the first forward)."""
    if cfg.rotary_dim < 2 or cfg.rotary_dim % 2:
        raise CheckpointError(f"{source}: head_dim={cfg.head_dim} x partial_rotary_factor="
                              f"{cfg.partial_rotary_factor} gives {cfg.rotary_dim} rotary dims, not an even number")
    if rope_kind(cfg.rope_scaling) == "longrope":
        for k in ("short_factor", "long_factor"):
            if len(cfg.rope_scaling[k]) != cfg.rotary_dim // 2:
                raise CheckpointError(f"{source}: rope_scaling.{k} has {len(cfg.rope_scaling[k])} entries, the "
                                      f"rotary dims need {cfg.rotary_dim // 2}")


def config_to_hf(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    """The config.json we write: the original fields, with ours on top, in the 4.x rope layout
    (transformers 5.x and vLLM read it too)."""
    fam = cfg.family
    raw = {k: v for k, v in cfg.extra.items() if k not in ("rope_parameters", "rope_scaling", "torch_dtype")}
    ours = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling",
            "tie_word_embeddings")  # ModelConfig fields under their config.json names
    raw.update(architectures=[fam.architecture], model_type=cfg.model_type, **{k: getattr(cfg, k) for k in ours},
               dtype=str(dtype).removeprefix("torch."))
    if fam.activation == "silu":
        raw["hidden_act"] = "silu"
    else:  # Gemma's key
        raw.pop("hidden_act", None)
        raw["hidden_activation"] = "gelu_pytorch_tanh"
    raw.update(_window_fields(cfg))
    reads = set(fam.reads)
    if "attention_bias" in reads:
        raw["attention_bias"] = cfg.attention_bias
    if "mlp_bias" in reads:
        raw["mlp_bias"] = cfg.mlp_bias
    for key in ("embedding_multiplier", "residual_multiplier", "logits_scaling", "partial_rotary_factor"):
        if key in reads:
            raw[key] = getattr(cfg, key)
    if "attention_multiplier" in reads:  # None (a GGUF without attention.scale) is 1/sqrt(head_dim) written out
        m = cfg.attention_multiplier
        raw["attention_multiplier"] = cfg.head_dim ** -0.5 if m is None else m
    if "no_rope_layers" in reads:
        raw["no_rope_layers"] = [int(cfg.uses_rope(i)) for i in range(cfg.num_hidden_layers)]
    if "query_pre_attn_scalar" in reads:
        scalar = cfg.attention_multiplier ** -2  # transformers 5 takes a whole number
        raw.setdefault("query_pre_attn_scalar", round(scalar) if abs(scalar - round(scalar)) < 1e-6 else scalar)
    if "final_logit_softcapping" in reads:
        raw["final_logit_softcapping"] = cfg.final_logit_softcapping
    if "rope_local_base_freq" in reads and cfg.rope_local_theta is not None:
        raw["rope_local_base_freq"] = cfg.rope_local_theta
    if rope_kind(cfg.rope_scaling) == "longrope":  # phi3 reads it at the top level
        raw["original_max_position_embeddings"] = cfg.rope_scaling["original_max_position_embeddings"]
    return raw


def _window_fields(cfg: ModelConfig) -> dict:
    """The config.json keys that give transformers our windows (Family.window_rule); sliding_window written null
    when absent (Mistral's and Gemma's default is 4096)."""
    rule = cfg.family.window_rule
    if not rule:
        return {}
    out = {"sliding_window": cfg.sliding_window}
    if rule in ("types", "no_rope"):
        out["layer_types"] = list(cfg.layer_types or ["full_attention"] * cfg.num_hidden_layers)
    if rule == "no_rope":
        out["use_sliding_window"] = cfg.sliding_window is not None
    return out


# ----------------------------------------------------------------------------------------------------
# The name table


def hf_name_table(cfg: ModelConfig) -> dict[str, str]:
    """Our parameter name -> the tensor name in HF checkpoints. Every load and save goes through this."""
    fam = cfg.family
    table = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    if not cfg.tie_word_embeddings:
        table["lm_head.weight"] = "lm_head.weight"
    per_layer = {f"{ours}.weight": f"{theirs}.weight" for ours, theirs in fam.norm_names().items()}
    qkv = ["qkv"] if fam.fused_qkv else ["q", "k", "v"]
    mlp = ["gate_up", "down"] if fam.fused_gate_up else ["gate", "up", "down"]
    projections = [(f"attn.{p}_proj", cfg.attention_bias or fam.qkv_bias) for p in qkv]
    projections += [("attn.o_proj", cfg.o_bias)] + [(f"mlp.{p}_proj", cfg.mlp_bias) for p in mlp]
    for ours, bias in projections:
        theirs = ours.replace("attn.", "self_attn.")
        per_layer[f"{ours}.weight"] = f"{theirs}.weight"
        if bias:
            per_layer[f"{ours}.bias"] = f"{theirs}.bias"
    if cfg.qk_norm:
        per_layer["attn.q_norm.weight"] = "self_attn.q_norm.weight"
        per_layer["attn.k_norm.weight"] = "self_attn.k_norm.weight"
    for i in range(cfg.num_hidden_layers):
        for ours, theirs in per_layer.items():
            table[f"layers.{i}.{ours}"] = f"model.layers.{i}.{theirs}"
    return table


# ----------------------------------------------------------------------------------------------------
# Loading


def _tensor_files(path: Path) -> dict[str, list[str]]:
    """Safetensors file name -> the tensor names it holds (from the index when sharded)."""
    index = path / INDEX_FILE
    if index.exists():
        raw = read_json(index)
        weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no 'weight_map'; re-save the checkpoint")
        odd = next((f for f in weight_map.values() if not isinstance(f, str) or Path(f).name != f), None)
        if odd is not None or "" in weight_map.values():  # a file of this directory, not ../elsewhere
            raise CheckpointError(f"{index} maps a tensor to {odd!r:.80}, not a file name in {path}; re-save it")
        files: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            files.setdefault(file, []).append(name)
        for file in files:
            if not (path / file).exists():
                raise CheckpointError(f"{path / file} is listed in {INDEX_FILE} but missing; re-download it")
            regular_path(path / file, "weights file", error=CheckpointError, fix="re-download it")
        return files
    single = path / "model.safetensors"
    if single.exists():
        regular_path(single, "weights file", error=CheckpointError, fix="re-download it")
        return {single.name: []}  # names read from the file itself
    hint = " (pytorch_model.bin is not supported: convert to safetensors)" if any(path.glob("*.bin")) else ""
    raise CheckpointError(f"{path}: no model.safetensors or {INDEX_FILE} found{hint}")


def checkpoint_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape, from the safetensors headers (read under bounds: tensor_checks.py), no data."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in _tensor_files(path):
        shapes.update(safetensors_shapes(path / file))
    return shapes


def _read_tensors(path: Path, dtype: torch.dtype, device: str | torch.device) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint, by HF name, cast to dtype on the target device."""
    tensors: dict[str, torch.Tensor] = {}
    for file, expected in _tensor_files(path).items():
        try:
            with safe_open(str(path / file), framework="pt", device=str(device)) as f:
                names = list(f.keys())
                missing = sorted(set(expected) - set(names))
                if missing:
                    raise CheckpointError(f"{path / file}: index lists {missing[:5]} but the file lacks them")
                for name in names:
                    t = f.get_tensor(name)
                    tensors[name] = t.to(dtype) if t.is_floating_point() else t
        except SafetensorError as e:
            raise CheckpointError(
                f"{path / file} is not a readable safetensors file ({e}); it may be truncated: re-download it"
            ) from e
    return tensors


def model_from_hf_tensors(cfg: ModelConfig, tensors: dict[str, torch.Tensor], source: str) -> Transformer:
    """A Transformer (eval mode) whose every parameter is filled from HF-named tensors, strictly, through the name
    table. Built on the meta device, so weights are allocated once."""
    table = hf_name_table(cfg)
    wanted = set(table.values())
    # RoPE buffers that transformers < 4.31 saved: derived from config.json, and transformers skips them too
    present = {name for name in tensors if not name.endswith(".rotary_emb.inv_freq")}
    if cfg.tie_word_embeddings:
        present.discard("lm_head.weight")  # some tied checkpoints carry a redundant copy
    unexpected, missing = sorted(present - wanted), sorted(wanted - present)
    if missing:
        raise CheckpointError(f"{source}: missing tensor(s) {missing[:8]}{' …' if len(missing) > 8 else ''}")
    if unexpected:
        raise CheckpointError(
            f"{source}: unexpected tensor(s) {unexpected[:8]}{' …' if len(unexpected) > 8 else ''} "
            f"(does config.json match the weights?)"
        )
    head = tensors.get("lm_head.weight") if cfg.tie_word_embeddings else None
    if head is not None and not torch.equal(head, tensors["model.embed_tokens.weight"]):
        # not a redundant copy: transformers 5 then unties and uses it, vLLM and transformers 4 the embedding
        raise CheckpointError(
            f"{source}: config.json has tie_word_embeddings=true but lm_head.weight differs from "
            f"model.embed_tokens.weight; set it to false to use that lm_head, or delete the tensor to tie"
        )
    with torch.device("meta"):
        model = Transformer(cfg)
    params = dict(model.named_parameters(remove_duplicate=False))
    state = {}
    for ours, theirs in table.items():
        t, want = tensors[theirs], tuple(params[ours].shape)
        if tuple(t.shape) != want:
            raise CheckpointError(f"{source}: tensor {theirs} has shape {tuple(t.shape)}, config implies {want}")
        state[ours] = t
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["embed.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    return model.eval()


def load_hf_model(
    path: Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> Transformer:
    """Load an HF checkpoint directory."""
    if not path.is_dir():
        raise CheckpointError(f"model directory {path} does not exist")
    cfg = config_from_hf(read_json(path / "config.json"), source=str(path / "config.json"))
    check_tensor_shapes(cfg, checkpoint_shapes(path), str(path))  # before reading or building anything
    return model_from_hf_tensors(cfg, _read_tensors(path, dtype, device), str(path))


# ----------------------------------------------------------------------------------------------------
# Saving


def hf_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """Model weights under their HF names (contiguous, on CPU), ready for safetensors."""
    params = dict(model.named_parameters(remove_duplicate=False))
    return {theirs: params[ours].detach().cpu().contiguous() for ours, theirs in hf_name_table(model.config).items()}


def _shards(state: dict[str, torch.Tensor], max_shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards


def save_hf_model(
    model: Transformer,
    out_dir: str | Path,
    *,
    tokenizer_dir: str | Path | None = None,
    generation_config: dict | None = None,
    max_shard_bytes: int = 4 * 1024**3,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write `model` as an HF checkpoint directory (config, weights, generation config; the tokenizer files are
    model/loading.py's `save_model`).

    state_dict: HF-named tensors to write instead of hf_state_dict(model), e.g. LoRA weights merged into
    the base by lora.merged_model_state(model).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = hf_state_dict(model) if state_dict is None else state_dict
    dtype = next(iter(state.values())).dtype
    shards = _shards(state, max_shard_bytes)
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata=meta)
    else:
        weight_map, total = {}, 0
        for i, shard in enumerate(shards, 1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out / name), metadata=meta)
            weight_map.update(dict.fromkeys(shard, name))
            total += sum(t.numel() * t.element_size() for t in shard.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2))
    (out / "config.json").write_text(json.dumps(config_to_hf(model.config, dtype), indent=2))
    gen = generation_config
    if gen is None and tokenizer_dir is not None and (Path(tokenizer_dir) / "generation_config.json").exists():
        gen = read_json(Path(tokenizer_dir) / "generation_config.json")
    if gen is not None:
        (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return out
