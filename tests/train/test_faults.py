"""Fault paths of `grpo train`: kill -9 mid-checkpoint, SIGINT/SIGTERM, NaN/inf updates, CUDA OOM, and
config / task problems reported before any model is loaded."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import grpo_engine.train.policy as policy_mod
import grpo_engine.train.update as update_mod
from grpo_engine.checkpoint.run_dir import list_checkpoints
from grpo_engine.cli import main
from grpo_engine.config import ConfigError, load_config
from grpo_engine.model.loading import load_model
from grpo_engine.train.loop import train

REPO = Path(__file__).resolve().parents[2]
CFG = str(REPO / "configs/tiny_arithmetic.yaml")
PAUSER = Path(__file__).with_name("pause_in_checkpoint.py")


def _metrics(run_dir):
    return [json.loads(ln) for ln in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def _spawn(args, pause_at_step: int | None = None):
    """`grpo train CFG args` in a child; pause_at_step: the child stops inside the write of that checkpoint
    (tests/train/pause_in_checkpoint.py patches the save) so the test can kill it there."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    entry = ["-m", "grpo_engine.cli"] if pause_at_step is None else [str(PAUSER), str(pause_at_step)]
    return subprocess.Popen([sys.executable, *entry, "train", CFG, *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(predicate, proc, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"process exited early ({proc.returncode}): {proc.stderr.read()[-2000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("timed out waiting for the training subprocess")
        time.sleep(0.05)


@pytest.mark.slow
def test_kill_9_mid_checkpoint_leaves_previous_usable_and_resume_works(tmp_path, tiny_ckpt):
    run_dir = tmp_path / "run"
    proc = _spawn([f"model.path={tiny_ckpt}", f"run_dir={run_dir}", "schedule.steps=3"], pause_at_step=2)
    _wait_for(lambda: (run_dir / "checkpoints/paused-2").exists(), proc)  # inside the write of step-000002
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    latest = list_checkpoints(run_dir / "checkpoints")[-1]
    assert latest.name == "step-000001"  # the half-written step 2 is not a checkpoint
    assert (run_dir / "checkpoints/.tmp-step-000002").is_dir()
    load_model(latest / "model")  # the previous checkpoint is intact
    result = train(load_config(CFG, [f"model.path={tiny_ckpt}", f"run_dir={run_dir}", "schedule.steps=3"]),
                   resume="latest")
    assert (result.last_step, result.stopped_by) == (3, "completed")
    assert [r["step"] for r in _metrics(run_dir)] == [1, 2, 3]
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_finishes_step_checkpoints_and_exits_0(tmp_path, tiny_ckpt, sig):
    run_dir = tmp_path / "run"
    proc = _spawn([f"model.path={tiny_ckpt}", f"run_dir={run_dir}", "schedule.steps=500", "checkpoint.every=0",
                   "logging.samples_every=0"])
    metrics = run_dir / "metrics.jsonl"
    _wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 1, proc)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    steps = [r["step"] for r in _metrics(run_dir)]
    last = steps[-1]
    assert steps == list(range(1, last + 1)) and last < 500
    assert f"done: {last} steps (signal)" in out and sig.name in err
    assert list_checkpoints(run_dir / "checkpoints")[-1].name == f"step-{last:06d}"


# The random tiny model scores 0 on every sample, so every advantage is 0 and by default no row would reach the
# update these tests break into: they train every row.
UPDATE_EVERY_ROW = ["memory.skip_zero_advantage=false"]


def _poison_gradients_from(call: int, monkeypatch):
    """accumulate_gradients, but from its `call`-th call on every gradient is NaN (one call per step, mu=1)."""
    real, calls = update_mod.accumulate_gradients, []

    def poisoned(model, *args, **kwargs):
        stats = real(model, *args, **kwargs)
        calls.append(1)
        if len(calls) >= call:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.fill_(float("nan"))
        return stats

    monkeypatch.setattr(update_mod, "accumulate_gradients", poisoned)


@pytest.mark.slow
def test_nonfinite_updates_skipped_then_stop_with_last_good_checkpoint(tmp_path, tiny_ckpt, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    _poison_gradients_from(2, monkeypatch)
    rc = main(["train", CFG, f"model.path={tiny_ckpt}", f"run_dir={run_dir}", "schedule.steps=6",
               "optimizer.max_nonfinite_steps=2", "checkpoint.keep_last=5", *UPDATE_EVERY_ROW])
    err = capsys.readouterr().err
    assert rc == 1
    assert "step 2: non-finite" in err and "update skipped (1 in a row)" in err
    assert "2 consecutive updates had a NaN/inf loss or gradient (optimizer.max_nonfinite_steps=2)" in err
    assert "step-000002" in err  # the last good checkpoint, named in the message
    rows = _metrics(run_dir)
    assert [(r["step"], r["skipped_update"]) for r in rows] == [(1, False), (2, True), (3, True)]
    assert rows[1]["grad_norm"] is None  # NaN is written as null
    # step 2 took no optimizer step: its checkpoint holds exactly the weights after step 1, all finite
    w1 = load_model(run_dir / "checkpoints/step-000001/model").state_dict()
    w2 = load_model(run_dir / "checkpoints/step-000002/model").state_dict()
    assert all(torch.equal(w1[k], w2[k]) and torch.isfinite(w2[k]).all() for k in w1)
    assert list_checkpoints(run_dir / "checkpoints")[-1].name == "step-000002"


def _oom_above(budget: int, monkeypatch):
    real = update_mod.plan_micro_batches

    def fake(batch, token_budget):  # the update's micro-batches of more than `budget` tokens run out of memory
        if token_budget > budget:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        return real(batch, token_budget)

    monkeypatch.setattr(update_mod, "plan_micro_batches", fake)


def test_oom_message_names_the_knobs(tmp_path, tiny_ckpt, monkeypatch, capsys):
    _oom_above(100, monkeypatch)
    rc = main(["train", CFG, f"model.path={tiny_ckpt}", f"run_dir={tmp_path}", "schedule.steps=1", *UPDATE_EVERY_ROW])
    err = capsys.readouterr().err
    assert rc == 1
    for knob in ("memory.micro_batch_tokens=256", "rollout.max_tokens_in_flight", "rollout.group_size",
                 "memory.activation_checkpointing", "memory.auto_halve_micro_batch=true"):
        assert knob in err, knob


def test_oom_auto_halves_micro_batch(tmp_path, tiny_ckpt, monkeypatch):
    _oom_above(100, monkeypatch)  # 256 -> 128 -> 64 fits (rows of tiny arithmetic are < 64 tokens)
    cfg = load_config(CFG, [f"model.path={tiny_ckpt}", f"run_dir={tmp_path}", "schedule.steps=2",
                            "memory.auto_halve_micro_batch=true", *UPDATE_EVERY_ROW])
    assert train(cfg).stopped_by == "completed"
    assert [r["micro_batch_tokens"] for r in _metrics(tmp_path)] == [64, 64]  # the halved budget is kept


def test_config_and_task_errors_before_model_load(tmp_path, tiny_ckpt, monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the problem was reported")

    monkeypatch.setattr(policy_mod, "load_model", no_load)
    base = [f"model.path={tiny_ckpt}", f"run_dir={tmp_path}"]
    with pytest.raises(ConfigError, match=r"task: unknown option\(s\) \['digts'\] for task 'arithmetic'"):
        train(load_config(CFG, base + ["task.options.digts=2"]))
    with pytest.raises(ConfigError, match=r"task\.data_path=.*does not exist"):
        train(load_config(CFG, base + [f"task.data_path={tmp_path / 'none.jsonl'}"]))
    with pytest.raises(ConfigError, match=r"model\.path=.*directory does not exist"):
        train(load_config(CFG, [f"model.path={tmp_path / 'absent'}", f"run_dir={tmp_path}"]))
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        train(load_config(CFG, base), resume="latest")
