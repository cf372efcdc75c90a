"""Atomic checkpoints and exact resume.

Layout: run_dir/checkpoints/step-000010/
    model/              HF layout (config.json, safetensors, tokenizer files): loads in transformers;
                        with LoRA the adapters merged into the base weights
    adapter/            LoRA only: the adapters in PEFT layout (adapter_config.json + safetensors)
    trainer_state.json  optimizer, LR scheduler, RNG states (python, numpy, torch, CUDA), step, data position,
                        curriculum queue:
    trainer_state.safetensors   the structure as JSON, the tensors as safetensors (no pickles, checkpoint/state_io.py)
    config.yaml         the resolved config of the run
    resolved.yaml       the same config with what the machine decided (plan/resolved.py); read first by resume,
                        eval and export (stored_settings_file), config.yaml for checkpoints written before it
    metrics.jsonl       copy of the metrics so far
    kernels.json, data.json   the kernel plan; the task data's fingerprint (checkpoint/data_record.py)
    manifest.json       every other file's size and block hashes, checked before a resume, eval or export
                        (checkpoint/verify.py)

A checkpoint is written into `.tmp-step-000010`, every file and the directory are fsync'ed, and only then
renamed to `step-000010`. A crash at any moment leaves either the old set of complete checkpoints or the
new one, never a half-written `step-*` directory; leftover `.tmp-*` directories are removed on the next save.
"""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..config import ConfigError
from ..config.paths import read_regular
from ..config.safe_yaml import MAX_YAML_CHARS
from ..model.config import CheckpointError
from ..model.hf_io import hf_name_table
from ..model.loading import save_model
from ..model.lora import lora_modules, merged_model_state, save_adapter
from ..plan.resolved import RESOLVED_FILE
from .disk import fsync_path, removed_on_failure
from .run_dir import (
    LEGACY_STATE,
    STATE,
    TMP_PREFIX,
    has_trainer_state,
    holds_run,
    list_checkpoints,
    nothing_saved,
    step_dir_name,
    step_dirs,
    tmp_dir_for,
)
from .state_io import StateFormatError, load_state, save_state
from .verify import MANIFEST, MODEL_PARTS, Verdict, check, refuse, resume_refused, warn_once, write_manifest


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
    curriculum: dict = field(default_factory=dict)  # collect/curriculum.py's queue and next re-scoring step
    micro_tokens: int = 0  # the micro-batch token budget, once halved after a CUDA out-of-memory (0: not recorded)


def capture_rng() -> dict:
    """Every global RNG state as tensors and numbers (no Python objects: storable without pickles)."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
        "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    py, nps = state["python"], state["numpy"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    np.random.set_state((nps["name"], nps["keys"].numpy().astype(np.uint32), nps["pos"], nps["has_gauss"],
                         nps["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(state["cuda"]))


def _fsync_tree(path: Path) -> None:
    """fsync every file, then every directory bottom-up, so the rename publishes durable data."""
    for dirpath, _, files in os.walk(path, topdown=False):
        for name in files:
            fsync_path(Path(dirpath, name))
        fsync_path(Path(dirpath))


def save_weights(model: torch.nn.Module, out: Path, *, tokenizer_dir: str | Path | None,
                 base_model_path: str | None, full_state: dict[str, torch.Tensor] | None = None) -> None:
    """The policy's weights into a checkpoint directory: model/ in HF layout (LoRA merged into the base when
    present) and, with LoRA, adapter/ in PEFT layout. full_state: our-named full tensors to write instead of
    the module's own (sharded models gather them first)."""
    has_lora = any(True for _ in lora_modules(model))
    state = merged_model_state(model) if has_lora else None
    if full_state is not None:
        state = {theirs: full_state[ours] for ours, theirs in hf_name_table(model.config).items()}
    save_model(model, out / "model", tokenizer_dir=tokenizer_dir, state_dict=state)
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
    full_state: dict[str, torch.Tensor] | None = None,
    before_publish: Callable[[Path], None] | None = None,
) -> Path:
    """Write step-XXXXXX atomically, then prune to the newest `keep_last` complete checkpoints."""
    # (the temp dir is tmp_dir_for(ckpt_root, step): ranks other than 0 write their files there)
    root = Path(ckpt_root)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(TMP_PREFIX + "*"):
        shutil.rmtree(stale, ignore_errors=True)
    final = root / step_dir_name(state.step)
    tmp = tmp_dir_for(root, state.step)
    tmp.mkdir()
    with removed_on_failure(tmp):  # a full disk, a read-only folder, a signal: no .tmp-step-N left, one line
        save_weights(model, tmp, tokenizer_dir=tokenizer_dir, base_model_path=base_model_path, full_state=full_state)
        save_state(dict(state.__dict__), tmp / STATE)
        (tmp / "config.yaml").write_text(config_yaml)
        for name, text in (extra_files or {}).items():  # e.g. kernels.json: the run's kernel plan
            (tmp / name).write_text(text)
        if metrics_path is not None and Path(metrics_path).is_file():
            shutil.copy2(metrics_path, tmp / "metrics.jsonl")
        if before_publish is not None:  # e.g. every rank adding its own state (train/loop.py)
            before_publish(tmp)
        write_manifest(tmp, stamp_as=final)  # every file's hashes: checked before it is resumed, evaluated or exported
        _fsync_tree(tmp)
    if final.exists():  # re-saving the same step (e.g. end of run right after an interval save)
        _delete_checkpoint(final)
    os.rename(tmp, final)
    fsync_path(root)
    for old in list_checkpoints(root)[:-keep_last]:
        if old != final:  # never the checkpoint just written (a stray later step must not push it out)
            _delete_checkpoint(old)
    return final


def _delete_checkpoint(path: Path) -> None:
    """Unpublish a checkpoint by renaming it to a temp name, then delete it: a kill midway through the deletion
    left a step-* folder with trainer_state.json but part of model/ gone, still listed as complete. A leftover
    temp folder is removed by the next save."""
    doomed = path.with_name(f"{TMP_PREFIX}deleted-{path.name}")
    shutil.rmtree(doomed, ignore_errors=True)
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def load_trainer_state(ckpt_dir: str | Path) -> TrainerState:
    """The trainer state of a checkpoint (trainer_state.json + .safetensors: no pickles)."""
    ckpt_dir = Path(ckpt_dir)
    if (ckpt_dir / f"{STATE}.json").is_file():
        return _trainer_state(load_state(ckpt_dir / STATE), ckpt_dir / f"{STATE}.json")
    if (ckpt_dir / LEGACY_STATE).is_file():
        raise StateFormatError(
            f"{ckpt_dir / LEGACY_STATE} is a pickled trainer state from grpo-engine before 0.1, which is not read "
            f"(unpickling runs code from the file); start a new run from its weights: model.path={ckpt_dir / 'model'}")
    raise FileNotFoundError(f"{ckpt_dir / STATE}.json not found: {ckpt_dir} is not a complete checkpoint")


def _trainer_state(raw, source: Path) -> TrainerState:
    """A TrainerState from the stored structure; a structure that is not one (a damaged or foreign file, another
    version's fields) is a StateFormatError naming the file, not a TypeError traceback."""
    fields = {f.name for f in dataclasses.fields(TrainerState)}
    required = {f.name for f in dataclasses.fields(TrainerState)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    if not isinstance(raw, dict) or not required <= raw.keys() <= fields:
        found = sorted(raw) if isinstance(raw, dict) else type(raw).__name__
        raise StateFormatError(f"{source}: not a grpo-engine trainer state (fields {found}, expected "
                               f"{sorted(fields)}); resume from an earlier checkpoint")
    return TrainerState(**raw)


def resolve_resume(resume: str | None, ckpt_root: str | Path, message: Callable[[str], None] = print, *,
                   command: str = "grpo train CONFIG", verify: bool = True) -> Path | None:
    """`--resume` with no path ("latest": the newest step-* folder, complete or not) or a checkpoint directory ->
    that directory, checked: complete, and (verify) its files as its manifest lists them (checkpoint/verify.py).
    One that is not is refused, naming the newest checkpoint that is and `command --resume IT`: never a silent
    fallback to an older one, and nothing deleted. One written before manifests: a warning through `message`."""
    if resume is None:
        return None
    if resume == "latest":
        found = step_dirs(ckpt_root)
        if not found:
            raise FileNotFoundError(nothing_saved(Path(ckpt_root), command))
        path = found[-1]
    else:
        path = Path(resume)
        if not has_trainer_state(path) or not (path / "model" / "config.json").is_file():
            raise FileNotFoundError(f"--resume {resume}: not a complete checkpoint (needs {STATE}.json and model/)")
        _not_into_another_run(path, Path(ckpt_root).parent)
    verdict = check(path) if verify else Verdict(path)
    if not verdict.ok:
        raise resume_refused(path, verdict.problem, command)
    if verdict.legacy:
        warn_once(path, message)
    return path


def nonfinite_state(state: TrainerState) -> str | None:
    """The first optimizer-state tensor that holds NaN/inf (a healthy run never saves one: non-finite updates are
    skipped), or None."""
    for index, values in state.optimizer.get("state", {}).items():
        for key, t in values.items() if isinstance(values, dict) else ():
            if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all()):
                return f"optimizer state {index}.{key}"
    return None


def _not_into_another_run(ckpt: Path, run_dir: Path) -> None:
    """A checkpoint from outside run_dir continues in run_dir only when run_dir holds no run of its own: resumed into
    one, the two runs' log lines mixed in one metrics.jsonl and pruning to keep_last deleted its checkpoints."""
    if not holds_run(run_dir) or run_dir.resolve() in ckpt.resolve().parents:
        return
    raise ConfigError(f"--resume {ckpt}: that checkpoint is not in run_dir={str(run_dir)!r}, which holds a run of "
                      f"its own; to continue it there choose a new run_dir, or --resume a checkpoint of "
                      f"{run_dir / 'checkpoints'}")


def model_source(path: str | Path) -> Path:
    """What a user may point a command at, as the model to load: a .gguf file or an HF model dir as given; a
    checkpoint dir -> its model/; a run dir -> its newest checkpoint's model/."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"model {p} does not exist; pass an HF model directory, a .gguf file, a checkpoint "
                                f"(RUN_DIR/checkpoints/step-XXXXXX) or a run directory")
    if p.suffix == ".gguf" or (p / "config.json").is_file():
        return _checked_model(p)
    if (p / "model" / "config.json").is_file():
        return _checked_model(p / "model")
    newest = step_dirs(p / "checkpoints")
    if newest:  # the newest, complete or not: one that lost its trainer state is damaged, not skipped silently
        return _checked_model(newest[-1] / "model", newest=True)
    raise FileNotFoundError(f"{p / 'config.json'} not found: {p} is not a model directory, a .gguf file, a "
                            f"checkpoint (model/config.json) or a run directory with complete checkpoints")


def _checked_model(model: Path, *, newest: bool = False) -> Path:
    """model/ of a checkpoint, once what eval and export read of the checkpoint (model/, adapter/, config.yaml) has
    checked out against its manifest; a plain model directory as it is."""
    ckpt = model.parent
    if model.name != "model" or not (newest or has_trainer_state(ckpt) or (ckpt / MANIFEST).is_file()):
        return model
    verdict = check(ckpt, MODEL_PARTS)
    if verdict.ok and newest and not has_trainer_state(ckpt):
        verdict = Verdict(ckpt, f"{STATE}.json is missing: it is incomplete")
    if not verdict.ok:
        raise refuse(verdict, ckpt.parent, lambda good: "pass it instead", parts=MODEL_PARTS)
    if verdict.legacy:
        warn_once(ckpt, lambda text: print(text, file=sys.stderr, flush=True))
    return model


def stored_settings_file(ckpt: Path) -> Path:
    """The file a checkpoint's settings are read from: resolved.yaml, or config.yaml where it has none (checkpoints
    written before resolved.yaml; the config both hold is the same)."""
    resolved = Path(ckpt) / RESOLVED_FILE
    return resolved if os.path.lexists(resolved) else Path(ckpt) / "config.yaml"


def stored_config_text(path: str | Path) -> str | None:
    """The settings a run stored next to the model `path` resolves to (stored_settings_file; None for a plain
    model); read only as a regular file of at most MAX_YAML_CHARS characters' worth of bytes (the YAML reader's own
    budget)."""
    model = model_source(path)
    stored = stored_settings_file(model.parent)
    if model.name != "model" or not stored.is_file():
        return None
    raw = read_regular(stored, stored.name, max_bytes=4 * MAX_YAML_CHARS, option="a config of at most "
                       f"{MAX_YAML_CHARS:,} characters", error=CheckpointError)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{stored} is not UTF-8 text ({e.reason}); copy {stored.name} from another checkpoint "
                              f"of the run") from None
