"""Resuming with a changed config: what changed is printed; what can take effect does; what cannot is refused.

The checkpoint stores the config it was trained with (config.yaml). A new learning rate or schedule, more steps,
other logging / evaluation / checkpoint intervals or clipping take effect when the run continues. A change to
what was trained (the model, LoRA's shape, the task, the group size, the seed, ...) cannot: the resumed run
would silently be a different one, so it is refused with the keys named.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ..config import Config, ConfigError, config_from_yaml_text

# Dotted keys (or prefixes ending in ".") whose change a resumed run cannot honour.
FIXED = ("seed", "model.path", "tokenizer.", "task.", "lora.", "warm_start.", "rollout.group_size",
         "rollout.prompts_per_step", "memory.precision", "reference.mode", "distributed.strategy")
# Applied by hand after the optimizer / scheduler state is restored (everything else is read each step).
LR_KEYS = ("optimizer.lr", "schedule.")
# Param-group settings that loading the optimizer's state brings back from the checkpoint: set again when changed.
GROUP_KEYS = {"optimizer.betas": "betas", "optimizer.eps": "eps", "optimizer.weight_decay": "weight_decay"}
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


def config_changes(old: Config, new: Config) -> list[tuple[str, object, object]]:
    """(dotted key, stored value, new value) of every field that differs."""
    a, b = flatten(old), flatten(new)
    return [(k, a[k], b[k]) for k in a if a[k] != b.get(k)]


def _matches(key: str, patterns: tuple[str, ...]) -> bool:
    return any(key == p or (p.endswith(".") and key.startswith(p)) for p in patterns)


def _changes_optimizer_state(change: tuple[str, object, object], cfg: Config) -> bool:
    """A change after which the stored optimizer state does not fit the new optimizer: another optimizer.name
    (the offloaded / 8-bit state has another layout: loading it failed with KeyError 'master'), or
    optimizer.master_weights where the weights may be bf16 (with or without an fp32 master copy)."""
    key, old, new = change
    if key == "optimizer.name":
        return not {old, new} <= SAME_STATE
    return key == "optimizer.master_weights" and cfg.memory.precision != "fp32"


def check_resume_config(ckpt_dir: Path, cfg: Config, message=print) -> list[tuple[str, object, object]]:
    """The changes since the checkpoint; refuses the ones that cannot take effect (ConfigError)."""
    stored = ckpt_dir / "config.yaml"
    if not stored.is_file():
        raise ConfigError(f"--resume {ckpt_dir}: config.yaml is missing, so the settings this run cannot change "
                          f"are unchecked; copy config.yaml from another checkpoint of the run into it, or start "
                          f"a new run")
    changes = config_changes(config_from_yaml_text(stored.read_text(), str(stored)), cfg)
    fixed = [c for c in changes if (_matches(c[0], FIXED) or _changes_optimizer_state(c, cfg)) and c[0] != "run_dir"]
    if fixed:
        listed = "; ".join(f"{k}: {old!r} -> {new!r}" for k, old, new in fixed)
        raise ConfigError(f"--resume {ckpt_dir}: these settings cannot change in a resumed run ({listed}); put them "
                          f"back, or start a new run (another run_dir, or --overwrite)")
    for key, old, new in changes:
        if key != "run_dir":
            message(f"resume: {key} {old!r} -> {new!r} (takes effect from the next step)")
    return changes


def apply_learning_rate(policy, cfg: Config, changes: list[tuple[str, object, object]]) -> None:
    """A new optimizer.lr / schedule: the restored scheduler keeps its step count but takes the new peak lr and
    shape (the scheduler was built from the new config; loading its state brought back the old base lr). A new
    optimizer.betas / eps / weight_decay goes into every param group (apply_group_settings)."""
    apply_group_settings(policy.optimizer, cfg, changes)
    if not any(_matches(k, LR_KEYS) for k, _, _ in changes):
        return
    scheduler = policy.scheduler
    scheduler.base_lrs = [cfg.optimizer.lr for _ in scheduler.base_lrs]
    for group, lr in zip(policy.optimizer.param_groups, scheduler.base_lrs):
        group["lr"] = lr * scheduler.lr_lambdas[0](scheduler.last_epoch)


def apply_group_settings(optimizer, cfg: Config, changes: list[tuple[str, object, object]]) -> None:
    """Loading the optimizer's state brought back the stored betas / eps / weight_decay with its param groups, so
    a changed one, printed as taking effect, was silently the old value: set it from the new config."""
    for key, _, _ in changes:
        name = GROUP_KEYS.get(key)
        if name is None:
            continue
        value = getattr(cfg.optimizer, name)
        for group in optimizer.param_groups:
            if name in group:
                group[name] = tuple(value) if name == "betas" else value
