"""`grpo train ... --nproc N`: the torchrun command it relaunches itself with, and layouts refused before it."""

from pathlib import Path

import pytest

from grpo_engine import cli

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def launched(monkeypatch):
    """The commands cli would have run (nothing is started)."""
    calls = []
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(cli, "_run_forwarding_signals", lambda cmd: calls.append(cmd) or 0)
    return calls


def test_nproc_relaunches_with_the_arguments_main_was_given(tiny_ckpt, launched):
    """main(argv) from Python relaunches argv (it once relaunched sys.argv: the caller's own command line)."""
    cfg = str(REPO / "configs/tiny_arithmetic.yaml")
    assert cli.main(["train", cfg, f"model.path={tiny_ckpt}", "rollout.prompts_per_step=4", "--nproc", "2"]) == 0
    [cmd] = launched
    assert cmd[cmd.index("--nproc_per_node=2") + 1 :] == ["-m", "grpo_engine.cli", "train", cfg,
                                                         f"model.path={tiny_ckpt}", "rollout.prompts_per_step=4"]


def test_nproc_refuses_an_uneven_split_before_launching(tiny_ckpt, launched, capsys):
    """prompts_per_step=3 on 2 ranks: one line naming the key and the fix, and no torchrun (which printed the
    error once per rank inside its own traceback)."""
    cfg = str(REPO / "configs/tiny_arithmetic.yaml")
    assert cli.main(["train", cfg, f"model.path={tiny_ckpt}", "rollout.prompts_per_step=3", "--nproc=2"]) == 2
    err = capsys.readouterr().err
    assert launched == [] and err.count("\n") == 1
    assert "rollout.prompts_per_step=3" in err and "make it a multiple of 2" in err
