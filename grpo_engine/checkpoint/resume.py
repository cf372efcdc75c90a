"""Resuming with a changed config: what changed is printed; what can take effect does; what cannot is refused.

The checkpoint stores the config it was trained with (config.yaml). A new learning rate or schedule, more steps,
other logging / evaluation / checkpoint intervals or clipping take effect when the run continues. A change to
what was trained (the model, LoRA's shape, the task, the group size, the seed, ...) cannot: the resumed run
would silently be a different one, so it is refused with the keys named.

Settings are compared by what they mean on this machine, not as text (`effective`): paths resolved (a relative and
an absolute model.path to one directory are the same; tokenizer.path unset is model.path), the device and dtype
resolved (memory.precision auto is fp32 on a CPU), and under a warm start model.path is not compared at all: the
stored one is the warm start's own RUN_DIR/base or RUN_DIR/sft, derived from the warm_start.* settings, which are.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import torch

from ..config import Config, ConfigError, config_from_yaml_text
from ..plan.precision import choose_precision
from .store import stored_settings_file

# Dotted keys (or prefixes ending in ".") whose change a resumed run cannot honour.
FIXED = ("seed", "model.path", "tokenizer.", "task.", "lora.", "warm_start.", "rollout.group_size",
         "rollout.prompts_per_step", "memory.precision", "reference.mode", "distributed.strategy")
# Applied by hand after the optimizer / scheduler state is restored (everything else is read each step).
LR_KEYS = ("optimizer.lr", "schedule.")
# Param-group settings that loading the optimizer's state brings back from the checkpoint: set again when changed.
GROUP_KEYS = {"optimizer.betas": "betas", "optimizer.eps": "eps", "optimizer.weight_decay": "weight_decay"}
# Settings a config may leave to the engine (plan/resolved.py), with the value that says so: the stored
# config.yaml holds what the engine chose for the run, so a config that still leaves them is unchanged.
ENGINE_CHOSEN = {"memory.micro_batch_tokens": 0, "memory.logprob_chunk_size": 0,
                 "memory.activation_checkpointing": "auto", "memory.checkpoint_every": None,
                 "memory.precision": "auto", "memory.cpu_update_mmap": "auto", "rollout.cuda_graphs": "auto",
                 "lora.quant_backend": "auto"}
# Optimizers whose state has the same layout (torch AdamW's, or both the fp32-master one: train/optim.py).
SAME_STATE = frozenset({"adamw", "adamw_fused"})


def flatten(obj, prefix: str = "") -> dict:
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out.update(flatten(value, f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = value
    return out


class Meaning:
    """A stored or new value shown with what it means here (when that is not the value itself)."""

    def __init__(self, value, means):
        self.value, self.means = value, means

    def __repr__(self) -> str:
        return f"{self.value!r} (= {self.means})"


WARM_START_MODEL = "the warm start's model"  # model.path of a warm-started run: RUN_DIR/base or RUN_DIR/sft


def warm_started(cfg: Config) -> bool:
    return bool(cfg.warm_start.tiny.arch) or cfg.warm_start.sft.steps > 0


def _resolved(path: str | None) -> str | None:
    return str(Path(path).expanduser().resolve()) if path else path


def device_here(cfg: Config) -> str:
    """model.device as it resolves on this machine (model/loading.py pick_device)."""
    name = cfg.model.device
    return "cuda" if name == "cuda" or (name == "auto" and torch.cuda.is_available()) else "cpu"


def precision_here(cfg: Config) -> str:
    """memory.precision as it resolves on this machine without a model (plan/precision.py choose_precision): auto
    is bf16 on a CUDA card with native bf16, else fp32. A CPU run's measured choice is not this: it is written in
    the stored config, and a config that leaves it to the engine keeps it (ENGINE_CHOSEN, kept_precision)."""
    return choose_precision(cfg.memory.precision, device_here(cfg)).precision


def kept_precision(ckpt_dir: Path, device: str) -> str | None:
    """The weights' dtype the checkpoint's run trained in, which a resumed run with memory.precision=auto keeps (a
    CPU's auto choice is measured, and could answer otherwise today). A stored config that still says auto (written
    before the choice was stored in it) trained in what auto meant then: fp32 on a CPU; on CUDA (None) the card
    answers as it did."""
    stored = stored_run_config(ckpt_dir)
    if stored is None:
        return None  # check_resume_config refuses the checkpoint, in one line
    setting = stored.memory.precision
    if setting != "auto":
        return setting
    return "fp32" if device == "cpu" else None


@dataclasses.dataclass(frozen=True)
class KeptRollout:
    """cfg with the rollout settings the signal check chose for the checkpoint's run, and which ones it took."""

    cfg: Config
    taken: tuple[str, ...] = ()  # the rollout settings taken from the checkpoint's run

    @property
    def changed(self) -> bool:
        return bool(self.taken)

    def describe(self) -> str:
        """'rollout.max_new_tokens 192, rollout.group_size 16': the settings taken and their values."""
        return ", ".join(f"rollout.{k} {getattr(self.cfg.rollout, k)}" for k in self.taken)


def kept_rollout(ckpt_dir: Path, cfg: Config) -> KeptRollout:
    """cfg with the choices of the checkpoint's run: its rollout.max_new_tokens when it fitted the length
    (check.fit_length) and chose more than cfg sets, its rollout.group_size and prompts_per_step when it fitted the
    group (check.fit_group_size) and chose a larger group. A resumed run does not run the check again: without this
    it would go on with the settings the fit replaced."""
    stored = stored_run_config(ckpt_dir)
    if stored is None:
        return KeptRollout(cfg)
    ours, theirs, changes = cfg.rollout, stored.rollout, {}
    if cfg.check.fit_length and stored.check.fit_length and theirs.max_new_tokens > ours.max_new_tokens:
        changes["max_new_tokens"] = theirs.max_new_tokens
    if cfg.check.fit_group_size and stored.check.fit_group_size and theirs.group_size > ours.group_size:
        changes.update(group_size=theirs.group_size, prompts_per_step=theirs.prompts_per_step)
    if not changes:
        return KeptRollout(cfg)
    return KeptRollout(dataclasses.replace(cfg, rollout=dataclasses.replace(ours, **changes)), tuple(changes))


def stored_run_config(ckpt_dir: Path) -> Config | None:
    """The config the checkpoint's run trained with (its resolved.yaml, else config.yaml), None when it has neither."""
    stored = stored_settings_file(ckpt_dir)
    return config_from_yaml_text(stored.read_text(), str(stored)) if stored.is_file() else None


def effective(cfg: Config) -> dict:
    """flatten(cfg) with the values that mean the same compared as the same: paths resolved, tokenizer.path unset
    as model.path, the device and the weights' dtype as this machine resolves them, a warm start's model.path as
    WARM_START_MODEL (the warm_start.* settings it is derived from are compared instead)."""
    flat = flatten(cfg)
    flat["model.path"] = WARM_START_MODEL if warm_started(cfg) else _resolved(cfg.model.path)
    flat["tokenizer.path"] = _resolved(cfg.tokenizer.path) if cfg.tokenizer.path else flat["model.path"]
    flat["task.data_path"] = _resolved(cfg.task.data_path)
    flat["task.options"] = {k: _resolved(v) if k.endswith("path") and isinstance(v, str) else v
                            for k, v in dict(cfg.task.options).items()}
    flat["model.device"], flat["memory.precision"] = device_here(cfg), precision_here(cfg)
    return flat


def config_changes(old: Config, new: Config) -> list[tuple[str, object, object]]:
    """(dotted key, stored value, new value) of every field whose meaning differs (`effective`); a value whose
    meaning is not itself is shown with it."""
    a, b, mean_a, mean_b = flatten(old), flatten(new), effective(old), effective(new)
    for key, auto in ENGINE_CHOSEN.items():  # left to the engine now: what it chose then (stored) is no change
        if b.get(key) == auto or (key == "memory.checkpoint_every" and b.get(
                "memory.activation_checkpointing") == "auto"):
            mean_b[key] = mean_a.get(key)

    def shown(raw, means):
        return raw if raw == means else Meaning(raw, means)

    return [(k, shown(a[k], mean_a[k]), shown(b.get(k), mean_b.get(k))) for k in a if mean_a[k] != mean_b.get(k)]


def _matches(key: str, patterns: tuple[str, ...]) -> bool:
    return any(key == p or (p.endswith(".") and key.startswith(p)) for p in patterns)


def _changes_optimizer_state(change: tuple[str, object, object], cfg: Config) -> bool:
    """A change after which the stored optimizer state does not fit the new optimizer: another optimizer.name
    (the offloaded / 8-bit state has another layout: loading it failed with KeyError 'master'), or
    optimizer.master_weights where the weights may be bf16 (with or without an fp32 master copy)."""
    key, old, new = change
    if key == "optimizer.name":
        return not {old, new} <= SAME_STATE
    return key == "optimizer.master_weights" and may_be_low_precision(cfg)


def may_be_low_precision(cfg: Config) -> bool:
    """Whether the run's weights may be bf16: set so, auto on a card with native bf16, or auto on a CPU (bf16 where
    it measures faster: plan/precision.py choose_precision)."""
    here = precision_here(cfg)
    return here != "fp32" or (cfg.memory.precision == "auto" and device_here(cfg) == "cpu")


def check_resume_config(ckpt_dir: Path, cfg: Config, message=print) -> list[tuple[str, object, object]]:
    """The changes since the checkpoint (its resolved.yaml, else config.yaml); refuses the ones that cannot take
    effect (ConfigError)."""
    stored = stored_run_config(ckpt_dir)
    if stored is None:
        raise ConfigError(f"--resume {ckpt_dir}: config.yaml is missing, so the settings this run cannot change "
                          f"are unchecked; copy config.yaml from another checkpoint of the run into it, or start "
                          f"a new run")
    changes = config_changes(stored, cfg)
    fixed = [c for c in changes if (_matches(c[0], FIXED) or _changes_optimizer_state(c, cfg)) and c[0] != "run_dir"]
    if fixed:
        listed = "; ".join(f"{k}: {old!r} -> {new!r}" for k, old, new in fixed)
        raise ConfigError(f"--resume {ckpt_dir}: these settings cannot change in a resumed run ({listed}); put them "
                          f"back, or start a new run (another run_dir, or --overwrite)")
    for key, old, new in changes:
        if key != "run_dir":
            message(f"resume: {key} {old!r} -> {new!r} (takes effect from the next step)")
    return changes


def check_where_it_sits(ckpt_dir: Path, step: int, cfg: Config, message=print) -> None:
    """A checkpoint is resumed as what it says it is. One in run_dir/checkpoints whose trainer state holds another
    step than its name (`step` against step-N: a checkpoint of another run, or another step, copied in under that
    name) is refused: it would continue as this run's step N. One written in another run_dir (the whole run moved
    or handed over) is said so once, with the step it holds."""
    stored = stored_run_config(ckpt_dir)
    written_in = stored.run_dir if stored is not None else None
    named = re.fullmatch(r"step-(\d+)", ckpt_dir.name)
    sits_in_run = ckpt_dir.resolve().parent == (Path(cfg.run_dir) / "checkpoints").resolve()
    if sits_in_run and named and int(named.group(1)) != step:
        raise ConfigError(f"--resume {ckpt_dir}: it holds step {step} of the run written in run_dir={written_in!r} "
                          f"(its trainer_state.json and config.yaml), not step {int(named.group(1))} as its name "
                          f"says: a checkpoint copied in under another name; move it out of {ckpt_dir.parent}, then "
                          f"run the same command (--resume takes the newest left), or resume it in a run_dir of its "
                          f"own")
    if written_in is not None and os.path.abspath(written_in) != os.path.abspath(cfg.run_dir):
        message(f"resume: {ckpt_dir} holds step {step} of the run written in run_dir={written_in!r}; continuing it "
                f"in run_dir={cfg.run_dir!r}")


def apply_learning_rate(policy, cfg: Config, changes: list[tuple[str, object, object]]) -> None:
    """A new optimizer.lr / schedule: the restored scheduler keeps its step count but takes the new peak lr and
    shape (the scheduler is built from the new config, but loading its state brings back the stored base lr). A new
    optimizer.betas / eps / weight_decay goes into every param group (apply_group_settings)."""
    apply_group_settings(policy.optimizer, cfg, changes)
    if not any(_matches(k, LR_KEYS) for k, _, _ in changes):
        return
    scheduler = policy.scheduler
    scheduler.base_lrs = [cfg.optimizer.lr for _ in scheduler.base_lrs]
    for group, lr in zip(policy.optimizer.param_groups, scheduler.base_lrs):
        group["lr"] = lr * scheduler.lr_lambdas[0](scheduler.last_epoch)


def apply_group_settings(optimizer, cfg: Config, changes: list[tuple[str, object, object]]) -> None:
    """Loading the optimizer's state brings back the stored betas / eps / weight_decay with its param groups, so
    a changed one, printed as taking effect, would silently stay the old value: set it from the new config."""
    for key, _, _ in changes:
        name = GROUP_KEYS.get(key)
        if name is None:
            continue
        value = getattr(cfg.optimizer, name)
        for group in optimizer.param_groups:
            if name in group:
                group[name] = tuple(value) if name == "betas" else value
