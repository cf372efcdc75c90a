"""Nothing lost, nothing silent: the run-directory contract, torn logs, non-finite weights, reward failures,
resuming with a changed config, the run lock, pickle-free checkpoints and one-line errors (docs/reliability.md).
Each test reproduces a problem a user hit, with the inputs they used."""

import errno
import json
import os
from pathlib import Path

import pytest
import torch

from grpo_engine.cli import main

REPO = Path(__file__).resolve().parents[2]
CFG = str(REPO / "configs/tiny_arithmetic.yaml")
HERE = Path(__file__).resolve().parent


def grpo(*argv, capsys=None) -> tuple[int, str]:
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err if capsys is not None else ""
    return code, err


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]


def steps_on_disk(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").glob("step-*"))


@pytest.fixture
def base(tiny_ckpt, tmp_path):
    return [f"model.path={tiny_ckpt}", "logging.samples_every=1", "checkpoint.every=1"]


# 1. re-running a command must not delete data -------------------------------------------------------------
@pytest.mark.slow
def test_rerun_refuses_overwrite_renames_and_old_resume_supersedes(base, tmp_path, capsys):
    run_dir = tmp_path / "X"
    assert grpo("train", CFG, *base, f"run_dir={run_dir}", "schedule.steps=6", "checkpoint.keep_last=2")[0] == 0
    before = (run_dir / "metrics.jsonl").read_text()
    code, err = grpo("train", CFG, *base, f"run_dir={run_dir}", "schedule.steps=3", "checkpoint.keep_last=2",
                     capsys=capsys)
    assert code == 2 and "--resume" in err and "--overwrite" in err
    assert (run_dir / "metrics.jsonl").read_text() == before
    assert steps_on_disk(run_dir) == ["step-000005", "step-000006"]
    assert grpo("train", CFG, *base, f"run_dir={run_dir}", "schedule.steps=3", "checkpoint.keep_last=2",
                "--overwrite")[0] == 0
    (old,) = tmp_path.glob("X.prev-*")
    assert (old / "metrics.jsonl").read_text() == before and steps_on_disk(old) == ["step-000005", "step-000006"]
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3]
    assert steps_on_disk(run_dir) == ["step-000002", "step-000003"]
    # --resume from the older checkpoint: the later one and its log lines move aside, nothing is deleted
    assert grpo("train", CFG, *base, f"run_dir={run_dir}", "schedule.steps=4", "checkpoint.keep_last=5", "--resume",
                run_dir / "checkpoints/step-000002")[0] == 0
    (superseded,) = run_dir.glob("superseded-*")
    assert steps_on_disk(superseded) == ["step-000003"]
    assert [json.loads(ln)["step"] for ln in (superseded / "metrics.jsonl").read_text().splitlines()] == [3]
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3, 4]


def test_resume_with_overwrite_is_refused(tmp_path):
    """--resume with --overwrite was taken as a plain --resume (the flag ignored): it is refused, naming both."""
    from grpo_engine.checkpoint.run_dir import plan_run_dir
    from grpo_engine.config import ConfigError

    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ConfigError, match="--resume and --overwrite together"):
        plan_run_dir(tmp_path, resume_step=3, newest_step=3, overwrite=True)
    assert plan_run_dir(tmp_path, resume_step=3, newest_step=3, overwrite=False).supersede_after is None
    assert plan_run_dir(tmp_path, resume_step=None, newest_step=3, overwrite=True).move_aside


def test_pruning_never_deletes_the_checkpoint_just_written(tiny_ckpt, tmp_path):
    from grpo_engine.checkpoint.store import TrainerState, capture_rng, save_checkpoint
    from grpo_engine.model.loading import load_model

    model, root = load_model(tiny_ckpt), tmp_path / "checkpoints"
    for step in (9, 3):  # a stray later checkpoint, then the one this run writes
        state = TrainerState(step, 0, {"state": {}, "param_groups": []}, {}, capture_rng())
        save_checkpoint(root, model, state, config_yaml="", metrics_path=None, tokenizer_dir=None, keep_last=1)
    assert (root / "step-000003").is_dir()


# 2. torn last line --------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_torn_last_metrics_line_is_dropped_with_a_warning(base, tmp_path, capsys):
    run_dir = tmp_path / "r"
    assert grpo("train", CFG, *base, f"run_dir={run_dir}", "schedule.steps=2")[0] == 0
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "loss": 0.1, "rew')  # a crash mid-line
    code, err = grpo("train", CFG, *base, f"run_dir={run_dir}", "schedule.steps=3", "--resume", capsys=capsys)
    assert code == 0 and "torn" in err
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3]


def test_log_lines_after_the_resumed_checkpoint_move_aside(tmp_path, capsys):
    """A run killed between checkpoints logged steps the resumed run writes again (with a changed config, other
    numbers): those lines move to superseded-<time>/, they were deleted."""
    from grpo_engine.monitor import Monitor

    run_dir = tmp_path / "r"
    run_dir.mkdir()
    for name in ("metrics.jsonl", "samples.jsonl"):
        (run_dir / name).write_text("".join(json.dumps({"step": s, "x": s * 0.5}) + "\n" for s in (1, 2, 3, 4)))
    Monitor(run_dir, total_steps=6, start_step=2, progress=False, tensorboard=False, wandb=False, wandb_project="",
            config={})
    assert [r["step"] for r in metrics(run_dir)] == [1, 2]
    (aside,) = run_dir.glob("superseded-*")
    for name in ("metrics.jsonl", "samples.jsonl"):
        assert [json.loads(ln) for ln in (aside / name).read_text().splitlines()] == [
            {"step": 3, "x": 1.5}, {"step": 4, "x": 2.0}]
    assert "later lines moved to" in capsys.readouterr().err
    Monitor(run_dir, total_steps=6, start_step=2, progress=False, tensorboard=False, wandb=False, wandb_project="",
            config={})
    assert len(list(run_dir.glob("superseded-*"))) == 1  # nothing later: nothing moved, no empty folder


# 3. non-finite weights ----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_an_update_that_makes_weights_nonfinite_stops_and_is_never_saved(base, tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))  # a reward that varies, so the first update is not zero
    run_dir = tmp_path / "r"
    code, err = grpo("train", custom(tmp_path, "even_bytes"), *base, f"run_dir={run_dir}", "schedule.steps=3",
                     "optimizer.lr=1e30", "optimizer.grad_clip=0", capsys=capsys)
    assert code == 1 and "NaN/inf" in err and "lower optimizer.lr" in err and "last good checkpoint" in err
    assert not (run_dir / "checkpoints").exists() or steps_on_disk(run_dir) == []
    code, err = grpo("train", CFG, *base, f"run_dir={tmp_path / 's'}", "optimizer.lr=inf", capsys=capsys)
    assert code == 2 and "optimizer.lr=inf must be a finite number > 0" in err


# 4. reward failures -------------------------------------------------------------------------------------------
def custom(tmp_path, fn: str) -> str:
    import yaml

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"say {i}", "answer": str(i)}) + "\n" for i in range(8)))
    cfg = yaml.safe_load(Path(CFG).read_text())
    cfg["task"] = {"name": "custom", "options": {"data_path": str(data), "reward_fn": f"reward_fns:{fn}"}}
    path = tmp_path / f"{fn}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize("fn,key", [("raises", "reward_errors"), ("returns_nan", "reward_errors"),
                                    ("returns_text", "reward_errors"), ("returns_none", "reward_errors"),
                                    ("sleeps", "reward_timeouts")])
def test_failed_rewards_are_counted_logged_and_warned(base, tmp_path, capsys, monkeypatch, fn, key):
    monkeypatch.syspath_prepend(str(HERE))
    if fn == "sleeps":
        monkeypatch.setattr("grpo_engine.collect.groups.REWARD_TIMEOUT_S", 0.05)
    run_dir = tmp_path / "r"
    code, err = grpo("train", custom(tmp_path, fn), *base, f"run_dir={run_dir}", "schedule.steps=2", capsys=capsys)
    assert code == 0 and err.count("reward(s) failed") == 1  # one warning, with the first error's message
    assert all(r[key] == 8 for r in metrics(run_dir))  # 2 prompts x 4 samples per step, each failed
    samples = [json.loads(ln) for ln in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["error"] for s in samples)


@pytest.mark.slow
def test_huge_reward_is_clamped_and_no_signal_is_warned(base, tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))
    run_dir = tmp_path / "r"
    code, err = grpo("train", custom(tmp_path, "huge"), *base, f"run_dir={run_dir}", "schedule.steps=2",
                     "logging.no_signal_warn_steps=2", capsys=capsys)
    assert code == 0 and "no learning signal" in err
    rows = metrics(run_dir)
    assert all(r["reward_mean"] == 1e6 and r["zero_variance_groups"] == 2 for r in rows)


def test_component_weight_naming_no_component_is_an_error(base, tmp_path, capsys):
    code, err = grpo("train", CFG, *base, f"run_dir={tmp_path / 'r'}", "schedule.steps=1",
                     "algorithm.advantage.component_weights={answr: 1.0}", capsys=capsys)
    assert code == 2 and "answr" in err and "'answer'" in err


# 5. resume applies what it can and refuses what it cannot -----------------------------------------------------
@pytest.mark.slow
def test_resume_applies_a_new_lr_and_refuses_a_new_group_size(base, tmp_path, capsys, monkeypatch):
    from grpo_engine.train import setup as setup_mod

    run_dir = tmp_path / "r"
    assert grpo("train", CFG, *base, f"run_dir={run_dir}", "schedule.steps=2")[0] == 0
    seen = []
    real = setup_mod.setup_run
    monkeypatch.setattr("grpo_engine.train.loop.setup_run", lambda *a: seen.append(real(*a)) or seen[-1])
    code, err = grpo("train", CFG, *base, f"run_dir={run_dir}", "schedule.steps=3", "optimizer.lr=5e-4", "--resume",
                     capsys=capsys)
    assert code == 0 and "optimizer.lr 0.001 -> 0.0005" in err
    assert seen[0].inputs.policy.scheduler.base_lrs == [5e-4]
    assert metrics(run_dir)[-1]["lr"] == pytest.approx(5e-4)
    code, err = grpo("train", CFG, *base, f"run_dir={run_dir}", "schedule.steps=4", "rollout.group_size=8", "--resume",
                     capsys=capsys)
    assert code == 2 and "rollout.group_size: 4 -> 8" in err and "cannot change" in err


# 6. one run per directory -------------------------------------------------------------------------------------
def test_a_second_process_is_kept_out_and_a_stale_lock_taken_over(tmp_path, capsys):
    from grpo_engine.checkpoint.run_dir import RunLock
    from grpo_engine.config import ConfigError

    lock = RunLock(tmp_path).acquire()
    (tmp_path / ".lock").write_text(json.dumps({"host": "elsewhere", "pid": 1}))
    with pytest.raises(ConfigError, match="in use by process 1 on elsewhere"):
        RunLock(tmp_path).acquire()
    (tmp_path / ".lock").write_text(json.dumps({"host": os.uname().nodename, "pid": 2**22 + 12345}))
    messages = []
    RunLock(tmp_path, messages.append).acquire()
    assert "stale lock" in messages[0] and json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    lock.release()


def test_a_load_that_fails_is_one_line_and_leaves_no_lock(base, tmp_path, capsys):
    """optimizer.strict with an optimizer the CPU cannot run was a RuntimeError traceback, and the failed load
    left RUN_DIR/.lock behind: the next run warned of a stale lock."""
    if torch.cuda.is_available():
        pytest.skip("8-bit AdamW may run here")
    run_dir = tmp_path / "r"
    code, err = grpo("train", CFG, *base, f"run_dir={run_dir}", "optimizer.name=adamw_8bit", "optimizer.strict=true",
                     capsys=capsys)
    assert code == 2 and err.startswith("grpo: error: optimizer.name='adamw_8bit' unavailable")
    assert "Traceback" not in err and not (run_dir / ".lock").exists()


# 7. inputs that used to arrive as tracebacks ------------------------------------------------------------------
@pytest.mark.parametrize("override,message", [
    ("seed=-1", "seed=-1 must be >= 0"),
    ("rollout.group_size=[1", "malformed value"),
    ("model.device=cuda", "no CUDA device is visible"),
    ("algorithm.beta=nan", "beta"),
    ("algorithm.advantage.eps=0", "advantage.eps=0.0 must be > 0"),
    ("algorithm.kl_clamp=-1", "kl_clamp must be > 0"),
    ("reference.mixin_alpha=2", "mixin_alpha must be in (0, 1]"),
    ("algorithm.advantage.component_weights={answer: .nan}", "must be finite"),
    ("task.options.n_train=0", "has no examples"),
    ("task.options.digits=x", "task option digits='x' must be an integer"),
    ("task.train_split=validation", "task.train_split='validation': split must be 'train' or 'test'"),
    ("logging.samples_per_log=-1", "logging.samples_per_log must be >= 0"),
])
def test_bad_values_are_one_line_errors(base, tmp_path, capsys, override, message):
    if override.startswith("model.device") and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    code, err = grpo("train", CFG, *base, f"run_dir={tmp_path / 'r'}", override, capsys=capsys)
    assert code == 2 and message in err and err.startswith("grpo: error:") and "Traceback" not in err


def test_files_that_are_wrong_are_named(base, tiny_ckpt, tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    code, err = grpo("train", CFG, *base, f"run_dir={tmp_path / 'afile'}", capsys=capsys)
    assert code == 2 and "is a file, not a directory" in err
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes('{"prompt": "caf\xe9", "answer": "1"}\n'.encode("latin-1"))
    (tmp_path / "c.yaml").write_text(f"task:\n  name: custom\n  options:\n    data_path: {latin}\n")
    code, err = grpo("train", tmp_path / "c.yaml", *base, f"run_dir={tmp_path / 'r'}", capsys=capsys)
    assert code == 2 and str(latin) in err and "UTF-8" in err
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    (broken / "model.safetensors").write_bytes(b"")
    (broken / "tokenizer.json").write_text((Path(tiny_ckpt) / "tokenizer.json").read_text())
    code, err = grpo("train", CFG, f"model.path={broken}", f"run_dir={tmp_path / 'b'}", capsys=capsys)
    assert code == 2 and "config.json is not valid JSON" in err


@pytest.mark.slow
def test_corrupt_trainer_state_names_the_file_and_the_previous_checkpoint(base, tmp_path, capsys):
    run_dir = tmp_path / "r"
    assert grpo("train", CFG, *base, f"run_dir={run_dir}", "schedule.steps=2")[0] == 0
    (run_dir / "checkpoints/step-000002/trainer_state.safetensors").write_bytes(b"\0" * 10)
    code, err = grpo("train", CFG, *base, f"run_dir={run_dir}", "schedule.steps=3", "--resume", capsys=capsys)
    assert code == 2 and "trainer_state" in err and "earlier checkpoint" in err


@pytest.mark.slow
def test_disk_full_mid_checkpoint_keeps_the_previous_one_and_resume_works(base, tmp_path, capsys, monkeypatch):
    """ENOSPC raised inside the real weight writer (safetensors' save_file as save_model calls it) while
    step 2's checkpoint is written: exit 2 with one line; step 1 and its metrics intact, no .tmp-step-2 left;
    --resume continues."""
    import grpo_engine.model.hf_io as hf_io

    run_dir, real, calls = tmp_path / "r", hf_io.save_file, []

    def full_disk(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device", filename)
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(hf_io, "save_file", full_disk)
    code, err = grpo("train", CFG, *base, f"run_dir={run_dir}", "schedule.steps=3", capsys=capsys)
    assert code == 2 and "No space left on device" in err and "--resume" in err and "Traceback" not in err
    assert steps_on_disk(run_dir) == ["step-000001"] and not list((run_dir / "checkpoints").glob(".tmp-*"))
    monkeypatch.setattr(hf_io, "save_file", real)
    assert grpo("train", CFG, *base, f"run_dir={run_dir}", "schedule.steps=3", "--resume")[0] == 0
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3]


# 8. no pickles ------------------------------------------------------------------------------------------------
def test_a_pickled_trainer_state_is_refused(tiny_ckpt, tmp_path):
    from grpo_engine.checkpoint.state_io import StateFormatError, load_state, save_state
    from grpo_engine.checkpoint.store import capture_rng, load_trainer_state

    ckpt = tmp_path / "step-000001"
    ckpt.mkdir()
    torch.save({"step": 1, "data_position": 0, "optimizer": {}, "scheduler": {}, "nonfinite_in_row": 0,
                "extra": {}, "rng": {"python": (3, tuple(range(625)), None), "numpy": ("MT19937", [0] * 624, 0, 0, 0.0),
                                     "torch": torch.get_rng_state()}}, ckpt / "trainer_state.pt")
    with pytest.raises(StateFormatError, match="pickled trainer state .* not read"):
        load_trainer_state(ckpt)
    save_state({"rng": capture_rng(), "x": [1, (2.0, None)], "t": torch.arange(3)}, tmp_path / "s")
    back = load_state(tmp_path / "s")
    assert back["x"] == [1, (2.0, None)] and torch.equal(back["t"], torch.arange(3))
    (tmp_path / "s.json").write_text(json.dumps({"__tensor__": "evil"}))
    with pytest.raises(StateFormatError, match="unreadable trainer state"):
        load_state(tmp_path / "s")


def test_splitting_a_log_on_a_full_disk_keeps_it_whole(tmp_path):
    """Resuming rewrote metrics.jsonl / samples.jsonl in place: a disk that filled midway (the situation a resume
    often follows) truncated the log. Also, a second split into the same superseded-<second> folder replaced the
    first one's lines."""
    import resource

    from grpo_engine.checkpoint.run_dir import split_jsonl

    log, aside = tmp_path / "metrics.jsonl", tmp_path / "superseded" / "metrics.jsonl"
    text = "".join(json.dumps({"step": s, "pad": "x" * 100}) + "\n" for s in range(1, 101))
    log.write_text(text)
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limit[1]))  # writes past 4 KiB fail (EFBIG) like ENOSPC
    try:
        with pytest.raises(OSError):
            split_jsonl(log, aside, 98)  # moves 99, 100 aside, then rewrites ~11 KiB
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
    assert log.read_text() == text and not list(tmp_path.glob(".metrics*"))
    assert split_jsonl(log, aside, 99) == (1, 0, 0)
    assert [json.loads(ln)["step"] for ln in aside.read_text().splitlines()] == [99, 100, 100]
    assert [json.loads(ln)["step"] for ln in log.read_text().splitlines()] == list(range(1, 100))
