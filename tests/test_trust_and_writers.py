"""Issue 41, items 1, 6, 7, 8 and 12: a run directory someone hands you is data (its stored config.yaml imports
nothing without --allow-code), nothing is overwritten without --overwrite, `grpo demo` respects the run lock,
unreadable log lines move aside, and every writer fails in one line and leaves no temporary file
(docs/reliability.md)."""

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpo_engine.cli import main

REPO = Path(__file__).resolve().parents[1]
EVIL = "evil_reward:score"  # a module whose import leaves a mark: imported = the guard failed


def grpo(capsys, *argv) -> tuple[int, str]:
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err


@pytest.fixture
def evil(tmp_path, monkeypatch):
    """The module EVIL names, on sys.path; its import writes `marker`."""
    marker = tmp_path / "imported"
    (tmp_path / "evil_reward.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n"
                                             "def score(example, completion):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield marker
    sys.modules.pop("evil_reward", None)


@pytest.fixture
def handed_run(tiny_ckpt, tmp_path):
    """A checkpoint someone hands you: its config.yaml names EVIL as the reward (a custom task)."""
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(2)))
    step = tmp_path / "run" / "checkpoints" / "step-000001"
    shutil.copytree(tiny_ckpt, step / "model")
    (step / "trainer_state.json").write_text("{}")
    (step / "config.yaml").write_text(f"task:\n  name: custom\n  options:\n    data_path: {data}\n"
                                      f"    reward_fn: {EVIL}\n")
    return step


# 1. stored configs are data ------------------------------------------------------------------------------------
def test_a_stored_reward_fn_is_refused_without_allow_code(handed_run, evil, capsys, monkeypatch):
    """`grpo eval RUN_DIR` / `grpo generate` imported and called the stored task.options.reward_fn: any installed
    function, with model output as its argument (pydoc:pipepager reached /bin/sh). Refused in one line, before
    anything is imported or loaded."""
    import grpo_engine.eval.cli as eval_cli

    monkeypatch.setattr(eval_cli, "load_model_and_tokenizer", lambda *a: pytest.fail("loaded the model first"))
    for argv in (["eval", handed_run.parents[1]], ["eval", handed_run], ["generate", handed_run, "1+1="]):
        start = time.perf_counter()
        code, err = grpo(capsys, *argv)
        assert time.perf_counter() - start < 5
        (line,) = [ln for ln in err.splitlines() if "error:" in ln]  # (a warning may come first: no manifest)
        assert code == 2 and f"task.options.reward_fn='{EVIL}' in {handed_run / 'config.yaml'}" in line
        assert f"pass --allow-code {EVIL}" in line and "Traceback" not in err
        assert not evil.exists() and "evil_reward" not in sys.modules
    code, err = grpo(capsys, "eval", handed_run, "--allow-code", "other:fn")  # allowing another: still refused
    assert code == 2 and "--allow-code evil_reward:score" in err and not evil.exists()


def test_allow_code_and_the_users_own_reward_fn_run(handed_run, evil, tiny_ckpt, capsys):
    assert main(["generate", str(handed_run), "1+1=", "--max-new", "2", "--answer", "2", "--allow-code", EVIL]) == 0
    assert evil.exists() and "reward: 1.000" in capsys.readouterr().out
    evil.unlink()
    sys.modules.pop("evil_reward", None)
    # --task-option on the command line is the user's own: it runs without the flag
    argv = ["generate", str(tiny_ckpt), "1+1=", "--max-new", "2", "--answer", "2", "--task", "custom",
            "--task-option", f"reward_fn={EVIL}"]
    assert main(argv) == 0 and evil.exists()


def test_resume_imports_nothing_from_the_stored_config(handed_run, evil, tmp_path, capsys):
    """`grpo train CONFIG --resume`: CONFIG is the user's; the checkpoint's config.yaml is only compared with it.
    --allow-code without --resume is refused (a config the user names needs none); MODULE:FUNC is checked."""
    from grpo_engine.checkpoint.resume import check_resume_config
    from grpo_engine.config import config_from_yaml_text, to_yaml
    from grpo_engine.config.trust import StoredCode
    from grpo_engine.tasks import build_task

    stored = config_from_yaml_text((handed_run / "config.yaml").read_text(), "stored.yaml")
    assert isinstance(stored.task.options["reward_fn"], StoredCode)
    assert f"reward_fn: {EVIL}" in to_yaml(stored)  # written out as plain text, still marked in memory
    assert isinstance(stored.task.options["reward_fn"], StoredCode)
    mine = config_from_yaml_text((handed_run / "config.yaml").read_text())
    mine.task.options["reward_fn"] = str(mine.task.options["reward_fn"])  # as load_config builds a user's config
    assert check_resume_config(handed_run, mine, lambda m: None) == [] and not evil.exists()
    with pytest.raises(ValueError, match="stored.yaml names code"):
        build_task(stored.task.name, dict(stored.task.options))
    assert not evil.exists()
    code, err = grpo(capsys, "train", REPO / "configs/tiny_arithmetic.yaml", "--allow-code", EVIL)
    assert code == 2 and "--allow-code is for a stored config" in err
    with pytest.raises(SystemExit):
        main(["eval", str(handed_run), "--allow-code", "not a function"])
    assert "must look like MODULE:FUNC" in capsys.readouterr().err


# 6. nothing overwritten without --overwrite ---------------------------------------------------------------------
def test_eval_and_plot_out_refuse_an_existing_file(tiny_ckpt, tmp_path, capsys, monkeypatch):
    """`grpo eval --out FILE` replaced whatever was there (a run's metrics.jsonl, a data file)."""
    import grpo_engine.eval.cli as eval_cli

    precious = tmp_path / "metrics.jsonl"
    precious.write_text(json.dumps({"step": 1, "reward_mean": 0.5}) + "\n")
    with monkeypatch.context() as m:
        m.setattr(eval_cli, "load_model_and_tokenizer", lambda *a: pytest.fail("loaded the model first"))
        code, err = grpo(capsys, "eval", tiny_ckpt, "--task", "arithmetic", "--out", precious)
    assert code == 2 and f"--out {precious} exists" in err and "--overwrite" in err
    argv = ["eval", tiny_ckpt, "--task", "arithmetic", "--n", "1", "--max-new", "2", "--max-examples", "1"]
    assert grpo(capsys, *argv, "--out", precious, "--overwrite")[0] == 0
    assert "summary" in json.loads(precious.read_text())
    # grpo plot: RUN_DIR/curves.png is its own (redrawn); --out an existing file is refused
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward_mean": 0.5}) + "\n")
    assert grpo(capsys, "plot", tmp_path)[0] == 0 and grpo(capsys, "plot", tmp_path)[0] == 0
    mine = tmp_path / "notes.png"
    mine.write_text("mine")
    code, err = grpo(capsys, "plot", tmp_path, "--out", mine)
    assert code == 2 and "exists" in err and mine.read_text() == "mine"
    assert grpo(capsys, "plot", tmp_path, "--out", mine, "--overwrite")[0] == 0
    assert mine.read_bytes()[:4] == b"\x89PNG" and not list(tmp_path.glob(".*.tmp"))


# 7. grpo demo and a live run ------------------------------------------------------------------------------------
def test_demo_does_not_rename_a_run_a_live_process_holds(tmp_path, capsys):
    """`grpo demo` renamed the run directory of a live `grpo train` (it took no lock): the run split in two."""
    run = tmp_path / "demo"
    run.mkdir()
    (run / "metrics.jsonl").write_text("{}\n")
    holder = subprocess.Popen(["sleep", "60"])
    try:
        (run / ".lock").write_text(json.dumps({"host": os.uname().nodename, "pid": holder.pid}))
        start = time.perf_counter()
        code, err = grpo(capsys, "demo", "--quick", f"run_dir={run}")
        assert time.perf_counter() - start < 10
    finally:
        holder.kill()
        holder.wait()
    assert code == 2 and len(err.splitlines()) == 1 and f"in use by process {holder.pid}" in err
    assert sorted(p.name for p in run.iterdir()) == [".lock", "metrics.jsonl"]
    assert not list(tmp_path.glob("demo.prev-*"))


def test_renaming_a_run_takes_this_process_lock_along_and_drops_it(tmp_path):
    from grpo_engine.checkpoint.run_dir import RunLock, plan_run_dir

    run = tmp_path / "r"
    run.mkdir()
    (run / "metrics.jsonl").write_text("{}\n")
    lock = RunLock(run, lambda m: None).acquire()
    plan = plan_run_dir(run, resume_step=None, newest_step=None, overwrite=True)
    plan.apply(lambda m: None)
    lock.moved_to(run)
    (old,) = tmp_path.glob("r.prev-*")
    assert not (old / ".lock").exists() and (run / ".lock").exists()  # no stale lock in the renamed run
    lock.release()


# 8. unreadable log lines move aside -----------------------------------------------------------------------------
def test_unreadable_log_lines_move_aside_and_only_a_torn_tail_is_dropped(tmp_path, capsys):
    """Resume dropped every unreadable line of metrics.jsonl (a note a user added in the middle), not only a torn
    last line, and kept none of them."""
    from grpo_engine.monitor import Monitor

    run = tmp_path / "r"
    run.mkdir()
    lines = [json.dumps({"step": 1}), "my note: lr looked too high here", json.dumps({"step": "two"}),
             json.dumps({"step": 2}), json.dumps({"step": 3}), '{"step": 4, "loss": 0.']  # torn: no newline
    (run / "metrics.jsonl").write_text("\n".join(lines))
    Monitor(run, total_steps=6, start_step=2, progress=False, tensorboard=False, wandb=False, wandb_project="",
            config={})
    err = capsys.readouterr().err
    assert [json.loads(ln)["step"] for ln in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    (aside,) = run.glob("superseded-*")
    assert (aside / "metrics.jsonl.unreadable").read_text() == f"{lines[1]}\n{lines[2]}\n"
    assert [json.loads(ln)["step"] for ln in (aside / "metrics.jsonl").read_text().splitlines()] == [3]
    assert "2 unreadable line(s)" in err and "metrics.jsonl.unreadable" in err and "torn" in err
    assert len([ln for ln in err.splitlines() if "unreadable line" in ln]) == 1
    # --resume from an older checkpoint (supersede) moves them too, and says so
    from grpo_engine.checkpoint.run_dir import supersede

    (run / "metrics.jsonl").write_text(f"{lines[0]}\nanother note\n{lines[3]}\n")
    said = []
    dest = supersede(run, 1, said.append)
    assert (dest / "metrics.jsonl.unreadable").read_text().endswith("another note\n")  # (appended: same second)
    assert "1 unreadable" in said[0] and (dest / "metrics.jsonl").read_text().endswith(f"{lines[3]}\n")


# 12. every writer fails cleanly ---------------------------------------------------------------------------------
def test_disk_full_in_the_safetensors_writer_is_one_line_and_leaves_no_temp_dir(tiny_ckpt, tmp_path, monkeypatch):
    """safetensors reports ENOSPC as a SafetensorError: a 22-line traceback, .tmp-step-N left behind."""
    from safetensors import SafetensorError

    import grpo_engine.model.hf_io as hf_io
    from grpo_engine.checkpoint.store import TrainerState, capture_rng, save_checkpoint
    from grpo_engine.model.loading import load_model

    def full_disk(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 64)  # part of it written
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(hf_io, "save_file", full_disk)
    root = tmp_path / "checkpoints"
    state = TrainerState(1, 0, {"state": {}, "param_groups": []}, {}, capture_rng())
    with pytest.raises(OSError) as e:
        save_checkpoint(root, load_model(tiny_ckpt), state, config_yaml="", metrics_path=None, tokenizer_dir=None,
                        keep_last=2)
    assert e.value.errno == errno.ENOSPC and list(root.iterdir()) == []


@pytest.mark.parametrize("code_,needle", [(errno.ENOSPC, "free some space"), (errno.EROFS, "make it writable")])
def test_export_write_failures_are_one_line_exit_2_without_resume(tiny_ckpt, tmp_path, capsys, monkeypatch, code_,
                                                                  needle):
    """A full disk or a read-only folder: exit 2 (was 1 for EROFS), one line, a hint that fits `grpo export`
    (it said 'then --resume'), and no OUT.gguf.tmp."""
    import gguf

    def fail(self, *a, **k):
        raise OSError(code_, os.strerror(code_), str(tmp_path / "m.gguf.tmp"))

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", fail)
    code, err = grpo(capsys, "export", tiny_ckpt, tmp_path / "m.gguf")
    assert code == 2 and len(err.splitlines()) == 1 and needle in err and "then run it again" in err
    assert "--resume" not in err and sorted(p.name for p in tmp_path.iterdir()) == []


def test_sigterm_during_export_removes_the_partial_file(tiny_ckpt, tmp_path, capsys, monkeypatch):
    """SIGTERM during `grpo export` left a partial OUT.gguf.tmp (SIGINT did not)."""
    import gguf

    real = gguf.GGUFWriter.write_tensors_to_file

    def terminated_midway(self, *a, **k):
        self.fout[0].write(b"partial")
        os.kill(os.getpid(), signal.SIGTERM)
        return real(self, *a, **k)

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", terminated_midway)
    before = signal.getsignal(signal.SIGTERM)
    code, err = grpo(capsys, "export", tiny_ckpt, tmp_path / "m.gguf")
    assert code == 143 and "terminated" in err and list(tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_malformed_kernel_plan_names_its_file(tmp_path):
    """It is measured again (issue 51 case 19: tests/test_sizes_and_hints.py), with one warning naming the file."""
    from grpo_engine.kernels import load_plan

    for text in ("{not json", json.dumps({"cpu": "x"}), "[]"):
        (tmp_path / "kernels.json").write_text(text)
        with pytest.warns(UserWarning, match=f"{tmp_path / 'kernels.json'}: not a kernel plan"):
            assert load_plan(tmp_path) is None
