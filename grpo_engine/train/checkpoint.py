"""Atomic checkpoints and exact resume.

Layout: run_dir/checkpoints/step-000010/
    model/              HF layout (config.json, safetensors, tokenizer files): loads in transformers;
                        with LoRA the adapters merged into the base weights
    adapter/            LoRA only: the adapters in PEFT layout (adapter_config.json + safetensors)
    trainer_state.pt    optimizer, LR scheduler, RNG states (python, numpy, torch, CUDA), step, data position
    config.yaml         the resolved config of the run
    metrics.jsonl       copy of the metrics so far

A checkpoint is written into `.tmp-step-000010`, every file and the directory are fsync'ed, and only then
renamed to `step-000010`. A crash at any moment leaves either the old set of complete checkpoints or the
new one, never a half-written `step-*` directory; leftover `.tmp-*` directories are removed on the next save.
"""

from __future__ import annotations

import os
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..model.hf_io import save_model
from ..model.lora import lora_modules, merged_model_state, save_adapter

STEP_PREFIX = "step-"
TMP_PREFIX = ".tmp-"


@dataclass
class TrainerState:
    """Everything besides the weights that an exact resume needs."""

    step: int  # optimizer steps completed
    data_position: int  # training examples consumed from the sampler
    optimizer: dict
    scheduler: dict
    rng: dict
    nonfinite_in_row: int = 0
    extra: dict = field(default_factory=dict)


def capture_rng() -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:06d}"


def list_checkpoints(ckpt_root: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first (temp dirs are never listed)."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(STEP_PREFIX)]
    found = [p for p in found if (p / "trainer_state.pt").is_file()]
    return sorted(found, key=lambda p: int(p.name[len(STEP_PREFIX) :]))


def latest_checkpoint(ckpt_root: str | Path) -> Path | None:
    found = list_checkpoints(ckpt_root)
    return found[-1] if found else None


def _fsync_tree(path: Path) -> None:
    """fsync every file, then every directory bottom-up, so the rename publishes durable data."""
    for dirpath, _, files in os.walk(path, topdown=False):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_weights(model: torch.nn.Module, out: Path, *, tokenizer_dir: str | Path | None,
                 base_model_path: str | None) -> None:
    """The policy's weights into a checkpoint directory: model/ in HF layout (LoRA merged into the base when
    present) and, with LoRA, adapter/ in PEFT layout."""
    has_lora = any(True for _ in lora_modules(model))
    save_model(model, out / "model", tokenizer_dir=tokenizer_dir,
               state_dict=merged_model_state(model) if has_lora else None)
    if has_lora:
        save_adapter(model, out / "adapter", base_model_name_or_path=base_model_path)


def save_checkpoint(
    ckpt_root: str | Path,
    model: torch.nn.Module,
    state: TrainerState,
    *,
    config_yaml: str,
    metrics_path: str | Path | None,
    tokenizer_dir: str | Path | None,
    keep_last: int,
    base_model_path: str | None = None,
    extra_files: dict[str, str] | None = None,
) -> Path:
    """Write step-XXXXXX atomically, then prune to the newest `keep_last` complete checkpoints."""
    root = Path(ckpt_root)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(TMP_PREFIX + "*"):
        shutil.rmtree(stale, ignore_errors=True)
    final = root / step_dir_name(state.step)
    tmp = root / (TMP_PREFIX + final.name)
    tmp.mkdir()
    save_weights(model, tmp, tokenizer_dir=tokenizer_dir, base_model_path=base_model_path)
    torch.save(state.__dict__, tmp / "trainer_state.pt")
    (tmp / "config.yaml").write_text(config_yaml)
    for name, text in (extra_files or {}).items():  # e.g. kernels.json: the run's kernel plan
        (tmp / name).write_text(text)
    if metrics_path is not None and Path(metrics_path).is_file():
        shutil.copy2(metrics_path, tmp / "metrics.jsonl")
    _fsync_tree(tmp)
    if final.exists():  # re-saving the same step (e.g. end of run right after an interval save)
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    for old in list_checkpoints(root)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_trainer_state(ckpt_dir: str | Path) -> TrainerState:
    path = Path(ckpt_dir) / "trainer_state.pt"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {ckpt_dir} is not a complete checkpoint")
    # weights_only=False: the file holds python/numpy RNG state objects; it is our own file.
    raw = torch.load(path, map_location="cpu", weights_only=False)
    return TrainerState(**raw)


def resolve_resume(resume: str | None, ckpt_root: str | Path) -> Path | None:
    """`--resume` with no path ("latest") or a checkpoint directory -> that directory (checked)."""
    if resume is None:
        return None
    if resume == "latest":
        found = latest_checkpoint(ckpt_root)
        if found is None:
            raise FileNotFoundError(f"--resume: no complete checkpoint under {ckpt_root}")
        return found
    path = Path(resume)
    if not (path / "trainer_state.pt").is_file() or not (path / "model" / "config.json").is_file():
        raise FileNotFoundError(f"--resume {resume}: not a complete checkpoint (needs trainer_state.pt and model/)")
    return path
