"""Resuming with a changed config (checkpoint/resume.py): a change that is printed as taking effect does, and one the
stored state cannot honour is refused with the key and the fix, before any weights are read."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from grpo_engine.checkpoint.resume import apply_learning_rate, check_resume_config
from grpo_engine.config import ConfigError, load_config, to_yaml
from grpo_engine.train.optim import make_scheduler

CFG = str(Path(__file__).resolve().parents[2] / "configs/tiny_arithmetic.yaml")


def _policy(cfg):
    """An optimizer and LR scheduler as build_policy makes them, over one [3] parameter."""
    o = cfg.optimizer
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))], lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                            weight_decay=o.weight_decay)
    return SimpleNamespace(optimizer=opt, scheduler=make_scheduler(opt, total=10, warmup=0, kind="constant",
                                                                   min_ratio=0.0))


def _stored(tmp_path, *overrides) -> Path:
    (tmp_path / "config.yaml").write_text(to_yaml(load_config(CFG, list(overrides))))
    return tmp_path


def test_new_betas_eps_weight_decay_take_effect(tmp_path):
    """They were printed as taking effect, but loading the optimizer's state brought the stored values back."""
    old = _policy(load_config(CFG))
    old.optimizer.step()
    new_cfg = load_config(CFG, ["optimizer.betas=[0.5,0.6]", "optimizer.eps=1e-6", "optimizer.weight_decay=0.1"])
    changes = check_resume_config(_stored(tmp_path), new_cfg, message=lambda _: None)
    new = _policy(new_cfg)
    new.optimizer.load_state_dict(old.optimizer.state_dict())
    new.scheduler.load_state_dict(old.scheduler.state_dict())
    apply_learning_rate(new, new_cfg, changes)
    (group,) = new.optimizer.param_groups
    assert (group["betas"], group["eps"], group["weight_decay"], group["lr"]) == ((0.5, 0.6), 1e-6, 0.1, 1e-3)


@pytest.mark.parametrize("key,old,new", [
    ("optimizer.name", "adamw_fused", "adamw_offload"),  # was KeyError: 'master' from load_state_dict
    ("optimizer.name", "adamw_offload", "adamw_8bit"),
    ("optimizer.master_weights", "true", "false"),
])
def test_a_change_of_optimizer_state_layout_is_refused(tmp_path, key, old, new):
    stored = _stored(tmp_path, f"{key}={old}", "memory.precision=bf16")
    with pytest.raises(ConfigError, match=rf"cannot change in a resumed run \({key}: .* -> .*\); put them back"):
        check_resume_config(stored, load_config(CFG, [f"{key}={new}", "memory.precision=bf16"]), lambda _: None)


def test_same_layout_optimizer_changes_are_allowed(tmp_path):
    seen = []
    stored = _stored(tmp_path, "optimizer.name=adamw")
    changes = check_resume_config(stored, load_config(CFG, ["optimizer.name=adamw_fused",
                                                            "optimizer.master_weights=false"]), seen.append)
    assert changes == [("optimizer.name", "adamw", "adamw_fused"), ("optimizer.master_weights", True, False)]
    assert len(seen) == 2


def test_a_checkpoint_without_its_config_is_refused(tmp_path):
    """Without config.yaml every check was skipped: a new seed or group size resumed silently."""
    with pytest.raises(ConfigError, match="config.yaml is missing.*copy config.yaml from another checkpoint"):
        check_resume_config(tmp_path, load_config(CFG, ["seed=7"]), lambda _: None)


@pytest.mark.parametrize("stored", ["bf16", "fp32"])
def test_a_precision_the_engine_chose_is_no_change_on_resume(tmp_path, stored):
    """The stored config holds the precision a run's `auto` chose (bf16 on a CPU where it paid): resuming with
    auto again is no change (the run keeps it: kept_precision); naming another dtype is refused."""
    ckpt = _stored(tmp_path, f"memory.precision={stored}")
    assert check_resume_config(ckpt, load_config(CFG, ["memory.precision=auto"]), lambda _: None) == []
    other = "fp32" if stored == "bf16" else "bf16"
    with pytest.raises(ConfigError, match=rf"memory.precision: '{stored}' -> '{other}'"):
        check_resume_config(ckpt, load_config(CFG, [f"memory.precision={other}"]), lambda _: None)


def test_master_weights_cannot_change_where_a_cpus_auto_may_be_bf16(tmp_path):
    stored = _stored(tmp_path, "memory.precision=bf16", "model.device=cpu")
    new = load_config(CFG, ["memory.precision=auto", "model.device=cpu", "optimizer.master_weights=false"])
    with pytest.raises(ConfigError, match=r"optimizer.master_weights: True -> False"):
        check_resume_config(stored, new, lambda _: None)
