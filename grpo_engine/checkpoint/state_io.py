"""Trainer state on disk without pickles: the tensors in one safetensors file, everything else as JSON.

A nested structure of dicts, lists, tuples, numbers, strings, None and tensors (an optimizer's state_dict,
RNG states, step counters) is split into `NAME.json` (the structure, with each tensor replaced by a reference)
and `NAME.safetensors` (the tensors by reference). Loading never runs code from the file: a run directory
someone else made can be resumed safely.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

TENSOR = "__tensor__"
TUPLE = "__tuple__"
INT_KEYS = "__int_keys__"


class StateFormatError(ValueError):
    """A state file that is not the structure/tensors pair this module writes."""


def _encode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        key = f"t{len(tensors)}"
        local = obj.to_local() if hasattr(obj, "to_local") else obj  # a DTensor shard is saved as this rank's part
        tensors[key] = local.detach().cpu().contiguous()
        return {TENSOR: key}
    if isinstance(obj, dict):
        int_keys = all(isinstance(k, int) for k in obj) and bool(obj)
        out = {str(k): _encode(v, tensors) for k, v in obj.items()}
        return {INT_KEYS: out} if int_keys else out
    if isinstance(obj, tuple):
        return {TUPLE: [_encode(v, tensors) for v in obj]}
    if isinstance(obj, list):
        return [_encode(v, tensors) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot store {type(obj).__name__} in a trainer-state file (tensors, numbers, strings, "
                    f"lists, tuples and dicts only)")


def _decode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if TENSOR in obj:
            return tensors[obj[TENSOR]]
        if TUPLE in obj:
            return tuple(_decode(v, tensors) for v in obj[TUPLE])
        if INT_KEYS in obj:
            return {int(k): _decode(v, tensors) for k, v in obj[INT_KEYS].items()}
        return {k: _decode(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    return obj


def save_state(obj: Any, stem: Path) -> None:
    """Write `stem`.json and `stem`.safetensors."""
    tensors: dict[str, torch.Tensor] = {}
    tree = _encode(obj, tensors)
    save_file(tensors, str(stem.with_suffix(".safetensors")))
    stem.with_suffix(".json").write_text(json.dumps(tree))


def load_state(stem: Path) -> Any:
    """Read what save_state wrote; a missing or malformed pair is a StateFormatError naming the file."""
    structure, data = stem.with_suffix(".json"), stem.with_suffix(".safetensors")
    try:
        tree = json.loads(structure.read_text())
        tensors = load_file(str(data))
        return _decode(tree, tensors)
    except (OSError, ValueError, KeyError, SafetensorError) as e:
        raise StateFormatError(f"{structure} / {data.name}: unreadable trainer state ({e}); resume from an earlier "
                               f"checkpoint") from e
