"""A checkpoint's tensors checked against its config before any module is built, and safetensors headers read
under bounds.

Why: a config.json or GGUF header of a few hundred bytes that claims 10^6 layers (or a hidden size its
tensors do not have) would build gigabytes of modules for minutes before the first tensor is compared with it.
config.py's `checked_dims` bounds each dimension; `check_tensor_shapes` then compares the config with the
tensors the file really holds (their names and shapes, no data), so building the model costs what the file
holds. No torch here: headers and shapes only.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

from .config import CheckpointError, ModelConfig

MAX_HEADER_BYTES = 16 * 1024 * 1024  # a safetensors JSON header; ~150 bytes a tensor, ~1 MiB for 100B models
MAX_TENSORS = 1 << 16  # per safetensors file; a 512-layer model has ~8,000
MAX_DIMS = 8

# The tensors of one layer (HF names after "model.layers.N."): the layers a checkpoint holds are those named
# with one of these; other names under model.layers are left to the loader's "unexpected tensor" error.
LAYER_TENSORS = frozenset({
    "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.o_proj.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.q_proj.bias",
    "self_attn.k_proj.bias", "self_attn.v_proj.bias", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "post_feedforward_layernorm.weight",
    "self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight", "self_attn.o_proj.bias", "mlp.gate_proj.bias",
    "mlp.up_proj.bias", "mlp.down_proj.bias",
})
_LAYER = re.compile(r"model\.layers\.(\d{1,9})\.(.+)")


def check_tensor_shapes(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]], source: str) -> None:
    """The layer count the tensor names imply, and the shapes of the embedding, the head, the final norm and the
    first layer's projections, against `cfg` (HF tensor names; tensors absent here are the loader's error)."""
    layers = {int(m[1]) for name in shapes if (m := _LAYER.fullmatch(name)) and m[2] in LAYER_TENSORS}
    held = max(layers) + 1 if layers else 0
    if held != cfg.num_hidden_layers:
        raise CheckpointError(f"{source}: the config says num_hidden_layers={cfg.num_hidden_layers} but the tensors "
                              f"hold {held} layer(s); the config does not match the weights: re-download or re-save")
    hidden, inter, q_rows = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads * cfg.head_dim
    kv_rows, first = cfg.num_key_value_heads * cfg.head_dim, "model.layers.0."
    expected = {
        "model.embed_tokens.weight": (cfg.vocab_size, hidden), "lm_head.weight": (cfg.vocab_size, hidden),
        "model.norm.weight": (hidden,), first + "self_attn.q_proj.weight": (q_rows, hidden),
        first + "self_attn.k_proj.weight": (kv_rows, hidden), first + "self_attn.v_proj.weight": (kv_rows, hidden),
        first + "self_attn.o_proj.weight": (hidden, q_rows), first + "mlp.gate_proj.weight": (inter, hidden),
        first + "mlp.up_proj.weight": (inter, hidden), first + "mlp.down_proj.weight": (hidden, inter),
        first + "self_attn.qkv_proj.weight": (q_rows + 2 * kv_rows, hidden),
        first + "mlp.gate_up_proj.weight": (2 * inter, hidden),
    }
    for name, want in expected.items():
        if name in shapes and tuple(shapes[name]) != want:
            raise CheckpointError(f"{source}: tensor {name} has shape {tuple(shapes[name])}, config implies {want}")


def safetensors_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from a safetensors file's header, read under bounds before safetensors maps the file:
    the header's length against the file's size (and MAX_HEADER_BYTES), then each entry's shape and offsets."""
    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{file} is not a readable safetensors file ({what}); it may be truncated or "
                               f"corrupt: re-download it")

    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise bad(f"{size} bytes, shorter than the 8-byte header length")
        (length,) = struct.unpack("<Q", head)
        if length > min(size - 8, MAX_HEADER_BYTES):
            raise bad(f"header length {length:,} with {size - 8:,} bytes after it (at most {MAX_HEADER_BYTES:,})")
        text = f.read(length)
    try:
        header = json.loads(text)
    except (ValueError, RecursionError):
        raise bad("its header is not JSON") from None
    if not isinstance(header, dict) or len(header) > MAX_TENSORS + 1:
        raise bad(f"its header must be an object of at most {MAX_TENSORS:,} tensors")
    data_bytes = size - 8 - length
    return {name: _entry_shape(name, entry, data_bytes, bad) for name, entry in header.items()
            if name != "__metadata__"}


def _entry_shape(name: str, entry, data_bytes: int, bad) -> tuple[int, ...]:
    """One header entry's shape, checked: whole non-negative dimensions, offsets inside the data section."""
    shape = entry.get("shape") if isinstance(entry, dict) else None
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    whole = lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0  # noqa: E731
    if not (isinstance(shape, list) and len(shape) <= MAX_DIMS and all(whole(d) for d in shape)):
        raise bad(f"tensor {name!r:.80} has shape {shape!r:.80}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(whole(o) for o in offsets)
            and offsets[0] <= offsets[1] <= data_bytes):
        raise bad(f"tensor {name!r:.80} has data offsets {offsets!r:.80} outside the {data_bytes:,} bytes of data")
    return tuple(shape)
