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
from .config import REQUIRED_DIMS, CheckpointError, checked_dims, checked_float, rope_kind
from .tensor_checks import check_tensor_shapes, safetensors_shapes
from .transformer import ModelConfig, Transformer

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama")
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


def _rope_fields(raw: dict, source: str) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either the 4.x or the 5.x layout of config.json.

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
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    scaling = None if rope_kind(params) == "default" else {k: v for k, v in params.items() if k != "rope_theta"}
    return checked_float(theta, "rope_theta", source), scaling


def _unsupported(raw: dict, model_type: str, scaling: dict | None, source: str) -> list[str]:
    """What config.json asks for that this engine does not implement (each as the field and why)."""
    unsupported = []
    if raw.get("hidden_act", "silu") != "silu":
        unsupported.append(f"hidden_act={raw['hidden_act']!r} (only silu)")
    if raw.get("use_sliding_window"):
        unsupported.append("use_sliding_window=true (only full attention)")
    if raw.get("mlp_bias"):
        unsupported.append("mlp_bias=true")
    if model_type != "qwen2" and raw.get("attention_bias"):  # llama and qwen3 then put a bias on o_proj too
        unsupported.append(f"attention_bias=true for {model_type} (bias on o_proj; only qwen2's q/k/v bias)")
    kind = rope_kind(scaling)
    if kind not in ("default", "linear", "llama3"):
        unsupported.append(f"rope type {kind!r} (supported: default, linear, llama3)")
    elif kind == "llama3":  # transformers' default when absent; rope_inv_freq needs it
        scaling.setdefault("original_max_position_embeddings", raw.get("max_position_embeddings", 32768))
    needed = {"linear": ["factor"], "llama3": ["factor", "low_freq_factor", "high_freq_factor"]}.get(kind, [])
    lacking = [k for k in needed if k not in scaling]  # else a KeyError at the first forward, not here
    if lacking:
        unsupported.append(f"rope type {kind!r} without {', '.join(lacking)}")
    elif kind in ("linear", "llama3"):  # numbers, not an error at the first forward
        for k in needed + (["original_max_position_embeddings"] if kind == "llama3" else []):
            checked_float(scaling[k], f"rope_scaling.{k}", source)
    return unsupported


def config_from_hf(raw: dict, source: str = "config.json") -> ModelConfig:
    """Map an HF config dict onto ModelConfig, rejecting what this engine does not implement and dimensions
    beyond sane limits (config.py: checked_dims) before anything is built from them."""
    if not isinstance(raw, dict):
        raise CheckpointError(f"{source}: the top level must be a JSON object, got {type(raw).__name__}")
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"{source}: model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    theta, scaling = _rope_fields(raw, source)
    unsupported = _unsupported(raw, model_type, scaling, source)
    if unsupported:
        raise CheckpointError(f"{source}: unsupported feature(s): {'; '.join(unsupported)}")
    lacking = [k for k in REQUIRED_DIMS if k not in raw]
    if lacking:
        raise CheckpointError(f"{source}: required field {lacking[0]!r} is missing")
    dims = {k: raw[k] for k in REQUIRED_DIMS}
    dims.update(num_key_value_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
                head_dim=raw.get("head_dim") or 0, max_position_embeddings=raw.get("max_position_embeddings", 32768))
    return ModelConfig(
        **checked_dims(dims, source),
        rms_norm_eps=checked_float(raw.get("rms_norm_eps", 1e-6), "rms_norm_eps", source),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=True if model_type == "qwen2" else bool(raw.get("attention_bias", False)),
        qk_norm=model_type == "qwen3",
        model_type=model_type,
        extra=raw,
    )


def config_to_hf(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    """The config.json we write: the original fields, with ours on top, in the 4.x rope layout
    (transformers 5.x and vLLM read it too)."""
    raw = {k: v for k, v in cfg.extra.items() if k not in ("rope_parameters", "rope_scaling", "torch_dtype")}
    arch = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}
    ours = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling",
            "tie_word_embeddings")  # ModelConfig fields under their config.json names
    raw.update(architectures=[arch[cfg.model_type]], model_type=cfg.model_type, **{k: getattr(cfg, k) for k in ours},
               hidden_act="silu", dtype=str(dtype).removeprefix("torch."))
    if cfg.model_type != "qwen2":
        raw["attention_bias"] = cfg.attention_bias
    return raw


# ----------------------------------------------------------------------------------------------------
# The name table


def hf_name_table(cfg: ModelConfig) -> dict[str, str]:
    """Our parameter name -> the tensor name in HF checkpoints. Every load and save goes through this."""
    table = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    if not cfg.tie_word_embeddings:
        table["lm_head.weight"] = "lm_head.weight"
    per_layer = {
        "attn_norm.weight": "input_layernorm.weight",
        "mlp_norm.weight": "post_attention_layernorm.weight",
        "attn.o_proj.weight": "self_attn.o_proj.weight",
        "mlp.gate_proj.weight": "mlp.gate_proj.weight",
        "mlp.up_proj.weight": "mlp.up_proj.weight",
        "mlp.down_proj.weight": "mlp.down_proj.weight",
    }
    for p in ("q", "k", "v"):
        per_layer[f"attn.{p}_proj.weight"] = f"self_attn.{p}_proj.weight"
        if cfg.attention_bias:
            per_layer[f"attn.{p}_proj.bias"] = f"self_attn.{p}_proj.bias"
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
