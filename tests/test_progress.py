"""Progress of long phases: a live line on a terminal; elsewhere a plain line every few seconds and one at the end,
nothing for a phase shorter than that; the warm start reports through it."""

import io

import pytest

from grpo_engine import progress as progress_mod
from grpo_engine.progress import Progress


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_plain_lines_every_few_seconds_and_a_last_one(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(progress_mod.time, "monotonic", clock)
    out = io.StringIO()
    with Progress("SFT", 100, stream=out, every_s=10) as p:
        for step in range(1, 101):
            clock.t += 0.5  # 50 s in all: a line at 10, 20, 30, 40 and 50 s
            p.update(step, f"loss {1 / step:.2f}")
    lines = out.getvalue().splitlines()
    assert lines[0] == "SFT: 20/100  loss 0.05  10 s" and len(lines) == 6
    assert lines[-1] == "SFT: done in 50 s"


def test_a_short_phase_prints_nothing_off_a_terminal_and_redraws_one_line_on_it(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(progress_mod.time, "monotonic", clock)
    out, tty = io.StringIO(), Tty()
    for stream in (out, tty):
        with Progress("eval", 3, stream=stream) as p:
            for i in range(1, 4):
                clock.t += 1
                p.update(i)
    assert out.getvalue() == ""
    assert tty.getvalue().count("\r") == 4 and "eval: 3/3" in tty.getvalue() and "\n" not in tty.getvalue()


def test_an_error_ends_without_a_done_line(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(progress_mod.time, "monotonic", clock)
    out = io.StringIO()
    with pytest.raises(RuntimeError), Progress("export", 2, stream=out, every_s=1) as p:
        clock.t += 2
        p.update(1)
        raise RuntimeError("disk full")
    assert out.getvalue().splitlines() == ["export: 1/2  2 s"]


def test_the_warm_start_reports_its_steps_when_stdout_is_a_file(tmp_path, monkeypatch, capsys):
    from grpo_engine.config import load_config
    from grpo_engine.demo import DEMO_RECIPE
    from grpo_engine.sft.warm_start import warm_start
    from grpo_engine.train.setup import task_of

    monkeypatch.setattr(progress_mod, "EVERY_S", 0.0)  # a line at every step
    cfg = load_config(str(DEMO_RECIPE), [f"run_dir={tmp_path}", "warm_start.sft.steps=3", "model.device=cpu"])
    warm_start(cfg, task_of(cfg))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("supervised warm start")]
    assert [line.split()[3] for line in lines[:3]] == ["1/3", "2/3", "3/3"] and "loss" in lines[0]
    assert lines[-1].startswith("supervised warm start: done in")
