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


def check_resume_config(ckpt_dir: Path, cfg: Config, message=print) -> list[tuple[str, object, object]]:
    """The changes since the checkpoint; refuses the ones that cannot take effect (ConfigError)."""
    stored = ckpt_dir / "config.yaml"
    if not stored.is_file():
        return []
    changes = config_changes(config_from_yaml_text(stored.read_text(), str(stored)), cfg)
    fixed = [c for c in changes if _matches(c[0], FIXED) and c[0] != "run_dir"]
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
    shape (the scheduler was built from the new config; loading its state brought back the old base lr)."""
    if not any(_matches(k, LR_KEYS) for k, _, _ in changes):
        return
    scheduler = policy.scheduler
    scheduler.base_lrs = [cfg.optimizer.lr for _ in scheduler.base_lrs]
    for group, lr in zip(policy.optimizer.param_groups, scheduler.base_lrs):
        group["lr"] = lr * scheduler.lr_lambdas[0](scheduler.last_epoch)
