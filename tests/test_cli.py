"""`grpo` CLI: config show, and config errors reported (exit 2, message) before any model is loaded."""

import subprocess
import sys
from pathlib import Path

import pytest

from grpo_engine.cli import main

REPO = Path(__file__).resolve().parents[1]


def test_config_show_prints_resolved_tree(capsys):
    assert main(["config", "show", str(REPO / "configs/tiny_arithmetic.yaml"), "rollout.group_size=6"]) == 0
    out = capsys.readouterr().out
    assert "group_size: 6" in out and "name: arithmetic" in out


def test_train_reports_config_errors(tmp_path, capsys):
    cfg = str(REPO / "configs/tiny_arithmetic.yaml")
    assert main(["train", cfg, "rollout.gropu_size=4"]) == 2
    assert "did you mean 'rollout.group_size'" in capsys.readouterr().err
    assert main(["train", cfg, f"model.path={tmp_path / 'absent'}"]) == 2
    assert "directory does not exist" in capsys.readouterr().err


def test_train_count_flags_must_be_positive(capsys):
    """--stop-after 0 ran a step and checkpointed it; --nproc 0 was ignored."""
    cfg = str(REPO / "configs/tiny_arithmetic.yaml")
    for flag, value, message in [("--stop-after", "0", "0 must be >= 1"), ("--nproc", "x", "'x' is not a whole")]:
        with pytest.raises(SystemExit) as exc:
            main(["train", cfg, flag, value])
        assert exc.value.code == 2 and f"argument {flag}: {message}" in capsys.readouterr().err


def test_console_script_entry(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout: [1, 2\n")
    proc = subprocess.run([sys.executable, "-m", "grpo_engine.cli", "config", "show", str(bad)],
                          capture_output=True, text=True, cwd=REPO, env={"PYTHONPATH": str(REPO)})
    assert proc.returncode == 2 and "malformed YAML" in proc.stderr and "bad.yaml:" in proc.stderr


def test_plain_progress_lines_when_stdout_is_not_a_terminal(tmp_path, capsys):
    """Under CI / nohup the bar is off, but a line per step (here every step: no time limit) still shows up."""
    from grpo_engine.monitor import Monitor, StepMetrics

    mon = Monitor(tmp_path, total_steps=2, start_step=0, progress=True, tensorboard=False, wandb=False,
                  wandb_project="x", config={})
    mon.console.every_s = 0.0
    for step in (1, 2):
        mon.log_step(StepMetrics(step=step, reward_mean=0.5, accuracy=0.25, completion_len_mean=7.0))
    out = capsys.readouterr().out.splitlines()
    assert [ln.split("  ")[0] for ln in out] == ["step 1/2", "step 2/2"] and "acc 0.25" in out[0]


def test_a_notebook_prints_the_plain_line_of_each_step(monkeypatch, capsys):
    """Jupyter's console (a bar redrawn in place) prints under it the same line per step as a log gets."""
    import IPython.display

    import grpo_engine.monitor as monitor
    from grpo_engine.monitor import StepMetrics

    class Handle:
        def update(self, *a, **k):
            pass

    monkeypatch.setattr(IPython.display, "display", lambda *a, **k: Handle())
    monkeypatch.setattr(monitor.time, "monotonic", lambda: 100.0)
    plain, notebook = monitor._PlainLines(2, every_s=0.0), monitor._NotebookLines(2, 0)
    steps = [StepMetrics(step=1, reward_mean=0.5, accuracy=0.25, completion_len_mean=7.0, gen_tokens_per_s=12.4),
             StepMetrics(step=2, reward_mean=0.125, accuracy=float("nan"), completion_len_mean=3.0,
                         gen_tokens_per_s=3.6)]
    lines = []
    for console in (plain, notebook):
        for m in steps:
            console.update(m)
        lines.append(capsys.readouterr().out.splitlines())
    assert lines[0] == lines[1] == ["step 1/2  reward 0.500  acc 0.25  len 7  gen 12 tok/s  0 s",
                                    "step 2/2  reward 0.125  len 3  gen 4 tok/s  0 s"]
