"""`grpo train ... --nproc N`: the torchrun command it relaunches itself with, and layouts refused before it."""

import os
import sys
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


# A stand-in for torchrun: starts one "rank" in its own session, as torchrun does, and exits with its status.
# Should the signal reach it instead, it records that and kills the rank, as torchrun's agent does.
FAKE_TORCHRUN = """
import os, pathlib, signal, subprocess, sys
out = pathlib.Path(sys.argv[1])
rank = subprocess.Popen([sys.executable, "-c", sys.argv[2], sys.argv[1]], start_new_session=True)
def agent(signum, frame):
    (out / "torchrun.txt").write_text(signal.Signals(signum).name)
    os.killpg(rank.pid, signal.SIGKILL)
    sys.exit(1)
for s in (signal.SIGINT, signal.SIGTERM):
    signal.signal(s, agent)
sys.exit(rank.wait())
"""
# A rank that stops gracefully: it notes the signal and exits 0 once it has one.
FAKE_RANK = """
import pathlib, signal, sys, time
out, got = pathlib.Path(sys.argv[1]), []
for s in (signal.SIGINT, signal.SIGTERM):
    signal.signal(s, lambda signum, frame: got.append(signal.Signals(signum).name))
(out / "ready").touch()
deadline = time.monotonic() + 20
while not got and time.monotonic() < deadline:
    time.sleep(0.02)
(out / "rank.txt").write_text(",".join(got))
"""


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_the_launcher_signals_the_ranks_not_torchrun(tmp_path, sig):
    """A SIGTERM / SIGINT to `grpo train --nproc N` goes to the ranks' process groups, and torchrun exits with
    their status 0 (it used to go to torchrun, whose agent kills the ranks 30 s later and exits 1)."""
    import signal
    import threading
    import time

    def send_when_ready():
        deadline = time.monotonic() + 20
        while not (tmp_path / "ready").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(os.getpid(), getattr(signal, sig))

    threading.Thread(target=send_when_ready, daemon=True).start()
    code = cli._run_forwarding_signals([sys.executable, "-c", FAKE_TORCHRUN, str(tmp_path), FAKE_RANK])
    assert (code, (tmp_path / "rank.txt").read_text()) == (0, sig)
    assert not (tmp_path / "torchrun.txt").exists()
