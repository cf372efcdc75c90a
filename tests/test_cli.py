"""`grpo` CLI: config show, and config errors reported (exit 2, message) before any model is loaded."""

import subprocess
import sys
from pathlib import Path

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


def test_console_script_entry(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout: [1, 2\n")
    proc = subprocess.run([sys.executable, "-m", "grpo_engine.cli", "config", "show", str(bad)],
                          capture_output=True, text=True, cwd=REPO, env={"PYTHONPATH": str(REPO)})
    assert proc.returncode == 2 and "malformed YAML" in proc.stderr and "bad.yaml:" in proc.stderr
