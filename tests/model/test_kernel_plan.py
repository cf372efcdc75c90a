"""Kernel plans: chosen by measurement per weight shape, cached per (CPU, torch, threads), forced off by an
environment variable, recorded in the run folder and checkpoints, and reused on resume."""

import json

import torch

from grpo_engine.kernels import KernelPlan, activate, onednn, select
from grpo_engine.kernels.select import choose_plan, shape_key, weight_shapes
from grpo_engine.model.hf_io import load_model


def _fake_times(faster: dict[str, str], calls: list):
    """measure_shape stand-in: the backend named in `faster` (by shape key) is the quicker one."""
    def measure(out_features, in_features):
        calls.append((out_features, in_features))
        win = faster.get(shape_key((out_features, in_features)), "torch")
        return {"torch": 1.0 if win == "torch" else 2.0, "onednn": 1.0 if win == "onednn" else 2.0}
    return measure


def test_plan_follows_measurement_and_is_cached(tiny_ckpt, tmp_path, monkeypatch):
    model = load_model(tiny_ckpt)
    shapes = weight_shapes(model)
    assert len(shapes) >= 3
    faster = {shape_key(shapes[0]): "onednn"}
    calls = []
    monkeypatch.setattr(select, "measure_shape", _fake_times(faster, calls))
    monkeypatch.setattr(onednn, "op_works", lambda: True)
    cache = tmp_path / "kernels.json"
    plan = choose_plan(model, cache)
    assert plan.source == "measured" and sorted(calls) == shapes
    assert plan.gemm == {shape_key(s): faster.get(shape_key(s), "torch") for s in shapes}
    stored = json.loads(cache.read_text())
    (key,) = stored
    assert select.cpu_model() in key and torch.__version__ in key and stored[key] == plan.gemm
    again = choose_plan(model, cache)
    assert (again.source, again.gemm, len(calls)) == ("cache", plan.gemm, len(shapes))  # nothing re-measured


def test_forced_torch_and_the_active_plan_decide_applies(tiny_ckpt, tmp_path, monkeypatch):
    model = load_model(tiny_ckpt)
    monkeypatch.setenv("GRPO_KERNELS", "torch")
    forced = choose_plan(model, tmp_path / "k.json")
    assert forced.source == "forced" and set(forced.gemm.values()) == {"torch"}
    x = torch.randn(3, model.config.hidden_size)
    w = model.layers[0].mlp.up_proj.weight
    activate(KernelPlan("cpu", torch.__version__, 1, {shape_key(tuple(w.shape)): "onednn"}))
    assert onednn.applies(x, w) == onednn.op_works()
    activate(KernelPlan("cpu", torch.__version__, 1, {shape_key(tuple(w.shape)): "torch"}))
    assert not onednn.applies(x, w)


def test_run_folder_and_checkpoint_record_the_plan_and_resume_reuses_it(tiny_ckpt, tmp_path, monkeypatch):
    from grpo_engine.config import load_config
    from grpo_engine.train import policy as policy_mod
    from grpo_engine.train.loop import train

    cfg = lambda: load_config(None, [f"model.path={tiny_ckpt}", f"run_dir={tmp_path / 'run'}",  # noqa: E731
                                     "schedule.steps=2", "rollout.prompts_per_step=2", "rollout.group_size=2",
                                     "rollout.max_new_tokens=4", "task.options.n_train=8"])
    result = train(cfg(), stop_after=1)
    recorded = KernelPlan.from_json((tmp_path / "run" / "kernels.json").read_text(), "run")
    in_checkpoint = KernelPlan.from_json((result.checkpoint / "kernels.json").read_text(), "ckpt")
    assert in_checkpoint.gemm == recorded.gemm and recorded.gemm
    flipped = {k: ("torch" if v == "onednn" else "onednn") for k, v in recorded.gemm.items()}
    monkeypatch.setattr(policy_mod, "choose_plan", lambda model: KernelPlan("x", "y", 1, flipped))
    seen = []
    real_build = policy_mod.build_policy
    monkeypatch.setattr("grpo_engine.train.setup.build_policy",
                        lambda *a, **k: seen.append(real_build(*a, **k)) or seen[-1])
    train(cfg(), resume="latest")
    assert seen[0].kernels.source == "checkpoint" and seen[0].kernels.gemm == recorded.gemm
