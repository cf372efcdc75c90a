"""Pre-flight checks of the paths a config names (model, tokenizer, data), before any weights are read."""

from __future__ import annotations

from pathlib import Path

from .fields import ConfigError
from .run import Config

TOKENIZER_REQUIRED = ("tokenizer.json",)


def check_paths(cfg: Config) -> None:
    """Model, tokenizer and data paths exist and look right; run before any weights are read."""
    if cfg.task.data_path is not None and not Path(cfg.task.data_path).exists():
        raise ConfigError(f"task.data_path={cfg.task.data_path!r} does not exist")
    if cfg.warm_start.tiny.arch:
        return  # the warm start builds the model and its tokenizer (sft/warm_start.py)
    if not cfg.model.path:
        raise ConfigError("model.path is empty: set it in the YAML or with model.path=/path/to/hf_checkpoint")
    model = Path(cfg.model.path)
    if model.suffix == ".gguf":
        if not model.is_file():
            raise ConfigError(f"model.path={cfg.model.path!r}: GGUF file does not exist")
        if cfg.tokenizer.path is None:
            return  # the GGUF file carries its tokenizer
    elif model.is_file():  # e.g. .../config.json or .../model.safetensors: "does not exist" would be wrong
        raise ConfigError(f"model.path={cfg.model.path!r} is a file: give the checkpoint directory that holds it "
                          f"({str(model.parent)!r}?)")
    elif not model.is_dir():
        raise ConfigError(f"model.path={cfg.model.path!r}: directory does not exist")
    elif (model / "model" / "config.json").is_file() and not (model / "config.json").is_file():
        raise ConfigError(f"model.path={cfg.model.path!r} is a `grpo train` checkpoint: its weights are in "
                          f"{str(model / 'model')!r}")
    elif not (model / "config.json").is_file():
        raise ConfigError(f"model.path={cfg.model.path!r} has no config.json: is it a Hugging Face checkpoint dir?")
    elif not any(model.glob("*.safetensors")):
        raise ConfigError(f"model.path={cfg.model.path!r} has no *.safetensors weights")
    tok_dir = Path(cfg.tokenizer.path or cfg.model.path)
    missing = [n for n in TOKENIZER_REQUIRED if not (tok_dir / n).is_file()]
    if missing:
        raise ConfigError(f"tokenizer directory {str(tok_dir)!r} lacks {', '.join(missing)}; set tokenizer.path")
