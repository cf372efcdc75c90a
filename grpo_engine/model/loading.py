"""Load and save a model or tokenizer whatever the source: a Hugging Face checkpoint directory or a .gguf file.

The one place that dispatches on the path, so the format readers (hf_io, tokenizer, gguf_io, gguf_tokenizer)
import only downwards.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from ..config import ConfigError
from .gguf_io import load_gguf_model, read_gguf
from .gguf_tokenizer import build_tokenizer
from .hf_io import TOKENIZER_FILES, load_hf_model, save_hf_model
from .tokenizer import Tokenizer, load_hf_tokenizer
from .transformer import Transformer


def load_model(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> Transformer:
    """Load an HF checkpoint directory or a .gguf file (model/gguf_io.py)."""
    path = Path(path)
    model = load_gguf_model(path, dtype, device) if path.suffix == ".gguf" else load_hf_model(path, dtype, device)
    model.loaded_from = str(path)  # where its tokenizer is: the Python API trains a model object with it
    return model


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of an HF checkpoint directory, or the one inside a .gguf file (model/gguf_tokenizer.py)."""
    path = Path(path)
    if path.suffix == ".gguf":
        return build_tokenizer(read_gguf(path).meta, str(path))
    return load_hf_tokenizer(path)


def save_model(model: Transformer, out_dir: str | Path, *, tokenizer_dir: str | Path | None = None,
               **kwargs) -> Path:
    """Write `model` as an HF checkpoint directory (hf_io.save_hf_model's arguments) with the tokenizer files
    of `tokenizer_dir`."""
    out = save_hf_model(model, out_dir, tokenizer_dir=tokenizer_dir, **kwargs)
    if tokenizer_dir is not None:
        copy_tokenizer_files(tokenizer_dir, out)
    return out


def copy_tokenizer_files(src: str | Path, dst: str | Path) -> None:
    """The tokenizer files of `src` into `dst`; from a .gguf file they are generated (tokenizer.json,
    tokenizer_config.json with the chat template, generation_config.json), so a run that started from a GGUF
    writes ordinary Hugging Face checkpoints."""
    src, dst = Path(src), Path(dst)
    if src.suffix == ".gguf":
        load_tokenizer(src).save(dst)
        return
    if src.resolve() == dst.resolve():
        return
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy2(src / name, dst / name)


def pick_device(name: str, local_rank: int | None = None) -> torch.device:
    """The device to train on (model.device: auto | cpu | cuda); under torchrun on CUDA, the rank's own GPU
    (LOCAL_RANK)."""
    cuda = torch.cuda.is_available()
    if name == "cuda" and not cuda:
        raise ConfigError("model.device=cuda but no CUDA device is visible; use model.device=cpu or auto")
    if name == "cpu" or not cuda:
        return torch.device("cpu")
    return torch.device("cuda", local_rank if local_rank is not None else torch.cuda.current_device())
