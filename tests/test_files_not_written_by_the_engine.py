"""Files you did not write: a run directory, a data file or a checkpoint someone handed over. Each test is one
numbered case of docs/reliability.md's "Files you did not write" table and failed on the tree before its fix."""

import json
import os
from pathlib import Path

import pytest

from grpo_engine.tasks import make_task
from grpo_engine.tasks.data import DataError

SECRET = "root:$6$saltsalt$hashhashhash:19000:0:99999:7:::"


def custom(path, **options):
    return make_task("custom", data_path=str(path), test_path=str(path), **options)


def must_not_run(monkeypatch, module, name: str, why: str) -> None:
    """Replace module.name by a function that fails the test with `why`: the refusal must come before it runs."""

    def refused(*args, **kwargs):
        raise AssertionError(why)

    monkeypatch.setattr(module, name, refused)


# item 1: an error about a CSV header never echoes the file's content ---------------------------------------------
@pytest.mark.parametrize("suffix", [".csv", ".tsv"])
def test_item1_a_csv_linked_to_a_private_file_is_named_never_printed(tmp_path, suffix):
    private = tmp_path / "shadow"
    private.write_text(f"{SECRET}\ndaemon:*:19000:0:99999:7:::\n")
    link = tmp_path / f"data{suffix}"
    link.symlink_to(private)
    with pytest.raises(DataError) as e:
        custom(link).examples("train")
    message = str(e.value)
    assert "root:" not in message and "daemon" not in message and "saltsalt" not in message, message
    assert message == (f"{link}: line 2 has no field 'prompt' (it has 1 field); every record needs "
                       f"['prompt', 'answer']")


def test_item1_a_repeated_header_is_counted_not_shown(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("secret-name,secret-name\nq,1\n")
    with pytest.raises(DataError) as e:
        custom(path).examples("train")
    assert "secret-name" not in str(e.value)
    assert str(e.value) == (f"{path}: the header (line 1) must name each field once (e.g. prompt,answer); its 2 "
                            f"fields include an empty or repeated name")


# item 6: an empty answer is a row that can never score ----------------------------------------------------------
@pytest.mark.parametrize("answer", ["", "   "])
def test_item6_an_empty_answer_is_refused_naming_the_file_and_line(tmp_path, answer):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "q", "answer": "1"}) + "\n\n" + json.dumps({"prompt": "r", "answer": answer}))
    with pytest.raises(DataError) as e:
        custom(path).examples("train")
    assert str(e.value) == (f"{path}: line 3 field 'answer' is empty: a row without it can never score; every "
                            f"record needs a value for each of ['prompt', 'answer']")
    csv = tmp_path / "rows.csv"
    csv.write_text("prompt,answer\nq,1\nr,\n")
    with pytest.raises(DataError, match=r"rows.csv: line 3 field 'answer' is empty"):
        custom(csv).examples("train")


# item 15: options and overrides in any order, on every command ----------------------------------------------------
REPO = Path(__file__).resolve().parents[1]
ORDERS = {  # the same command written twice: options first, and options among (or after) the positionals
    "config show": (["config", "show", "--resolved", "C", "a=1", "b=2"], ["config", "show", "C", "a=1", "--resolved",
                                                                          "b=2"]),
    "train": (["train", "--overwrite", "--stop-after", "2", "C", "a=1", "b=2"],
              ["train", "C", "a=1", "--stop-after", "2", "b=2", "--overwrite"]),
    "demo": (["demo", "--quick", "--real", "a=1", "b=2"], ["demo", "a=1", "--quick", "b=2", "--real"]),
    "plan": (["plan", "--card", "24", "C", "a=1", "b=2"], ["plan", "C", "a=1", "--card", "24", "b=2"]),
    "bench step": (["bench", "step", "--model", "M", "--steps", "2", "a=1", "b=2"],
                   ["bench", "step", "a=1", "--model", "M", "b=2", "--steps", "2"]),
    "generate": (["generate", "--n", "2", "M", "what is 2+2?"], ["generate", "M", "--n", "2", "what is 2+2?"]),
    "eval": (["eval", "--n", "2", "M"], ["eval", "M", "--n", "2"]),
}


@pytest.mark.parametrize("command", sorted(ORDERS))
def test_item15_options_and_overrides_in_any_order(command):
    from grpo_engine.cli import build_parser

    first, mixed = ORDERS[command]
    parsed = [vars(build_parser().parse_args(argv)) for argv in (first, mixed)]
    assert parsed[0] == parsed[1]
    if command not in ("generate", "eval"):  # the two commands without overrides
        assert parsed[0]["overrides"] == ["a=1", "b=2"]


def test_item15_config_show_resolved_after_the_config_takes_the_overrides(capsys):
    from grpo_engine.cli import main

    config = REPO / "configs/tiny_arithmetic.yaml"
    assert main(["config", "show", str(config), "--resolved", "seed=3", "rollout.group_size=3"]) == 0
    out = capsys.readouterr().out
    assert "  seed: 3\n" in out and "    group_size: 3\n" in out


# item 10: every data path is checked, naming its key, before the weights load -----------------------------------
def tiny_config(tmp_path: Path, model: Path, **task_options) -> Path:
    """configs/tiny_arithmetic.yaml on the custom task (data.jsonl of 8 rows), run_dir tmp_path/run."""
    import yaml

    rows = tmp_path / "data.jsonl"
    if not rows.exists():
        rows.write_text("".join(json.dumps({"prompt": f"say {i}", "answer": str(i)}) + "\n" for i in range(8)))
    cfg = yaml.safe_load((REPO / "configs/tiny_arithmetic.yaml").read_text())
    cfg.update(run_dir=str(tmp_path / "run"), task={"name": "custom", "options": {
        "data_path": str(rows), "system_prompt": None, **task_options}})
    cfg["model"]["path"] = str(model)
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.parametrize("command", ["train", "check"])
def test_item10_a_missing_test_path_is_named_by_its_key_before_the_model_loads(tmp_path, tiny_ckpt, capsys,
                                                                               monkeypatch, command):
    import grpo_engine.train.setup as setup
    from grpo_engine.cli import main

    must_not_run(monkeypatch, setup, "load_tokenizer", "the tokenizer was loaded before the data paths were checked")
    missing = tmp_path / "nowhere/test.jsonl"
    config = tiny_config(tmp_path, tiny_ckpt, test_path=str(missing))
    assert main([command, str(config)]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == (f"grpo: error: task.options.test_path='{missing}' does not exist; set "
                                            f"task.options.test_path to a local .jsonl / .parquet file or a "
                                            f"directory of them")
    assert not (tmp_path / "run").exists()


def test_item10_the_task_names_the_option_that_names_a_missing_file(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "q", "answer": "1"}) + "\n")
    task = make_task("custom", data_path=str(rows), test_path=str(tmp_path / "gone.jsonl"))
    with pytest.raises(DataError, match=r"gone.jsonl does not exist; set test_path to a local"):
        task.examples("test")


# item 7: `grpo check` goes through the size check `grpo train` makes, before sampling -----------------------------
@pytest.mark.parametrize("size", ["rollout.group_size=1000000000", "rollout.prompts_per_step=1000000000",
                                  "rollout.max_new_tokens=100000000000"])
def test_item7_check_refuses_an_absurd_size_as_train_does(tmp_path, tiny_ckpt, capsys, monkeypatch, size):
    import grpo_engine.train.setup as setup
    from grpo_engine.cli import main

    must_not_run(monkeypatch, setup, "load_tokenizer", "the tokenizer was loaded: the check would sample at this size")
    config = tiny_config(tmp_path, tiny_ckpt)
    assert main(["check", str(config), size]) == 2
    check = capsys.readouterr().err.strip().splitlines()[-1]
    assert check.startswith("grpo: error: ") and size.split("=")[0] in check and "lower " in check, check
    assert main(["train", str(config), size]) == 2
    train = capsys.readouterr().err.strip().splitlines()[-1]
    assert check == train  # the one size check, one message


# item 8: the signal check's diagnosis follows the evidence: a constant reward names the reward ------------------
def figures(**kw):
    from grpo_engine.collect.signal_check import SignalStats

    base = dict(groups=16, group_size=8, rewards=[1.0] * 128, spread_share=0.0, truncation_rate=1.0,
                extracted_rate=None, accuracy=None, max_new_tokens=32)
    return SignalStats(**{**base, **kw})


@pytest.mark.parametrize("length", [32, 128, 512])
def test_item8_a_reward_that_ignores_the_reply_is_named_at_every_length(length):
    """Every reply scored 1.0 and the hint was `raise rollout.max_new_tokens` at 32, at 128, at 512."""
    from grpo_engine.collect.signal_check import verdict

    v = verdict(figures(max_new_tokens=length, truncation_rate=0.9 if length < 512 else 0.3))
    assert v.cause.startswith("every reply scored 1 although ") and f"max_new_tokens={length}" in v.cause
    assert "task.options.reward_fn" in v.fix and "max_new_tokens" not in v.fix, v.fix


def test_item8_evidence_in_order_reward_then_extractor_then_length():
    from grpo_engine.collect.signal_check import verdict

    graded = dict(accuracy=0.0, rewards=[0.5] * 128)  # a verifier that accepts nothing right yet scores 0.5
    v = verdict(figures(truncation_rate=0.0, extracted_rate=0.2, **graded))
    assert "80% had no answer the extractor found" in v.cause and "task.options.verifier" in v.fix
    v = verdict(figures(truncation_rate=0.0, extracted_rate=0.2, accuracy=0.0, rewards=[0.0] * 128))
    assert "extractor found an answer in only 20%" in v.cause  # nothing scored: the extractor, not the reward
    v = verdict(figures(truncation_rate=0.9, extracted_rate=0.1, accuracy=0.0, rewards=[0.0] * 128))
    assert "cut at rollout.max_new_tokens=32" in v.cause  # nothing scored and most replies cut: the length
    v = verdict(figures(truncation_rate=0.9, accuracy=0.2, extracted_rate=0.5, rewards=[0.0] * 128,
                        correct_spread_share=0.5))
    assert "correctness differs in 50% of groups but the reward does not" in v.cause  # before the length


def test_item8_fit_length_stops_when_the_reward_is_the_cause():
    from grpo_engine.collect.signal_check import SignalReport, fit_length, verdict

    asked = []

    def check_at(n):
        asked.append(n)
        s = figures(max_new_tokens=n)
        return SignalReport(s, verdict(s))

    fit = fit_length(check_at, 32, 1024, lambda n: True)
    assert asked == [32] and fit.length == 32 and "the reward, not the length" in fit.stopped


def test_item8_grpo_check_names_the_reward_and_following_that_hint_passes(tmp_path, tiny_ckpt, capsys, monkeypatch):
    """The whole command as the user ran it: a reward_fn that ignores the reply; then the hinted fix (a reward that
    reads the reply) and the check passes."""
    from grpo_engine.cli import main

    (tmp_path / "my_rewards.py").write_text(
        "def constant(example, completion):\n    return 1.0\n\n"
        "def reads_it(example, completion):\n    return float(len(completion) % 2)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = tiny_config(tmp_path, tiny_ckpt, reward_fn="my_rewards:constant")
    assert main(["check", str(config), "check.groups=4"]) == 2
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert "every reply scored 1" in last and "task.options.reward_fn" in last and "raise rollout" not in last, last
    assert main(["check", str(config), "check.groups=4", "task.options.reward_fn=my_rewards:reads_it"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("signal check: learning signal present")


# item 11: kill -9 before the first checkpoint: say nothing was saved, and the command that starts over ------------
def killed_before_the_first_checkpoint(run: Path) -> None:
    """What `kill -9` during step 1 leaves: the log's first line, a half-written checkpoint, a stale lock."""
    (run / "checkpoints/.tmp-step-000001/model").mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 0.0}) + "\n")
    import socket

    (run / ".lock").write_text(json.dumps({"host": socket.gethostname(), "pid": 2**22 + 1}))  # a process gone


def hinted(err: str) -> list[str]:
    """The command between backticks in the error's last line, as argv for main()."""
    import shlex

    line = err.strip().splitlines()[-1]
    assert line.count("`") == 2, line
    return shlex.split(line.split("`")[1])[1:]


def test_item11_resume_with_nothing_saved_names_the_command_that_starts_over_and_it_works(tmp_path, tiny_ckpt,
                                                                                           capsys):
    from grpo_engine.cli import main

    config = tiny_config(tmp_path, tiny_ckpt)
    killed_before_the_first_checkpoint(tmp_path / "run")
    assert main(["train", str(config), "--resume", "schedule.steps=1"]) == 2
    err = capsys.readouterr().err
    assert "nothing was saved" in err and "start over with" in err, err
    argv = hinted(err)
    assert "--resume" not in argv and "--overwrite" in argv and "schedule.steps=1" in argv
    assert main(argv) == 0, capsys.readouterr().err
    assert (tmp_path / "run/checkpoints/step-000001").is_dir()
    assert [p.name.split(".prev-")[0] for p in tmp_path.glob("run.prev-*")] == ["run"]  # renamed, not deleted


def test_item11_a_plain_train_there_names_overwrite_not_resume(tmp_path, tiny_ckpt, capsys):
    from grpo_engine.cli import main

    config = tiny_config(tmp_path, tiny_ckpt)
    killed_before_the_first_checkpoint(tmp_path / "run")
    assert main(["train", str(config), "schedule.steps=1"]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "saved no checkpoint" in line and "--resume has nothing to continue" in line and "--overwrite" in line
    assert "continue it with --resume" not in line
    assert main(["train", str(config), "schedule.steps=1", "--overwrite"]) == 0


# a run trained once (1 step, custom task), copied for each test that damages it as a handed-over run -------------
@pytest.fixture(scope="module")
def trained(tiny_ckpt_factory, tmp_path_factory) -> Path:
    """A folder with train.yaml (paths relative to it: run_dir run, data data.jsonl) and its run of 2 steps."""
    import yaml

    from grpo_engine.cli import main

    work = tmp_path_factory.mktemp("handed_over")
    config = tiny_config(work, tiny_ckpt_factory("qwen2"))
    cfg = yaml.safe_load(config.read_text())
    cfg["run_dir"], cfg["task"]["options"]["data_path"] = "run", "data.jsonl"
    config.write_text(yaml.safe_dump(cfg))
    here = os.getcwd()
    os.chdir(work)
    try:
        assert main(["train", "train.yaml", "schedule.steps=2", "eval.before_after=true", "eval.max_examples=4"]) == 0
    finally:
        os.chdir(here)
    return work


@pytest.fixture
def handed(trained, tmp_path, capsys, monkeypatch) -> Path:
    """A copy of the trained folder as the working directory (train.yaml, data.jsonl, run/ with step-000001 and
    step-000002)."""
    import shutil

    copy = Path(shutil.copytree(trained, tmp_path / "w", symlinks=True))
    monkeypatch.chdir(copy)
    capsys.readouterr()
    return copy


def returns_within(seconds: float, fn):
    from tasks.test_untrusted_data import returns_within as within

    return within(seconds, fn)


# item 3: a forged data record is checked by size and budget before a byte is hashed ----------------------------
def forge_data_record(ckpt: Path, data: Path, nbytes: int) -> None:
    """data.json naming `data` with `nbytes` bytes (and a made-up hash), its manifest rewritten to match."""
    from grpo_engine.checkpoint.verify import write_manifest

    record = json.loads((ckpt / "data.json").read_text())
    record["roots"]["task.options.data_path"] = str(data)
    record["files"]["task.options.data_path"].update(path=str(data), bytes=nbytes, sha256="0" * 64)
    (ckpt / "data.json").write_text(json.dumps(record))
    write_manifest(ckpt)


def test_item3_a_forged_record_of_a_20GB_sparse_file_is_refused_before_hashing(handed, capsys):
    from grpo_engine.cli import main

    sparse = handed / "huge.jsonl"
    with open(sparse, "wb") as f:
        f.truncate(20 << 30)  # 20 GiB of holes: no disk, and a minute or more to hash
    forge_data_record(handed / "run/checkpoints/step-000002", sparse, 20 << 30)
    done, code = returns_within(20, lambda: main(["eval", str(handed / "run"), "--n", "1"]))
    assert done and code == 2, code
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"{sparse} has {20 << 30:,} bytes, over the limit of {1024 << 20:,} (task.options.max_data_file_mib)" \
        in line and line.endswith("pass --data FILE to evaluate on data you choose"), line


def test_item3_a_size_other_than_the_recorded_one_is_a_change_without_hashing(handed, capsys, monkeypatch):
    import grpo_engine.checkpoint.data_record as data_record
    from grpo_engine.cli import main

    data = handed / "data.jsonl"
    forge_data_record(handed / "run/checkpoints/step-000002", data, data.stat().st_size + 1)

    must_not_run(monkeypatch, data_record, "fingerprint", "hashed although the size differs from the record")
    assert main(["eval", str(handed / "run"), "--n", "1"]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"{data} (task.options.data_path) changed: {data.stat().st_size:,} bytes, the record says " \
           f"{data.stat().st_size + 1}" in line, line


# items 2 and 4: the engine writes only its own files, atomically, never through a link ---------------------------
def test_item2_resume_never_writes_through_a_linked_before_after_json(handed, capsys):
    from grpo_engine.cli import main

    outside = handed / "outside.json"
    outside.write_text("mine\n")
    (handed / "run/before_after.json").unlink()
    (handed / "run/before_after.json").symlink_to(outside)
    assert main(["train", str(handed / "train.yaml"), "schedule.steps=3", "--resume"]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"run/before_after.json (a link to {outside}): not written by grpo-engine" in line, line
    assert line.endswith("move it out of the run directory")
    assert outside.read_text() == "mine\n" and not (handed / "run/checkpoints/step-000003").exists()
    (handed / "run/before_after.json").unlink()  # the fix the line names
    assert main(["train", str(handed / "train.yaml"), "schedule.steps=3", "--resume"]) == 0
    assert outside.read_text() == "mine\n"


@pytest.mark.parametrize("name", ["before_after.json", "kernels.json"])
@pytest.mark.parametrize("kind", ["file", "link"])
def test_item4_a_new_run_never_replaces_a_file_it_did_not_write(tmp_path, tiny_ckpt, capsys, name, kind):
    from grpo_engine.cli import main

    config = tiny_config(tmp_path, tiny_ckpt)
    run = tmp_path / "run"
    run.mkdir()
    outside = tmp_path / "notes.json"
    outside.write_text("my notes\n")
    (run / name).symlink_to(outside) if kind == "link" else (run / name).write_text("my notes\n")
    args = ["train", str(config), "schedule.steps=1", "eval.before_after=true", "eval.max_examples=2"]
    assert main(args) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "not written by grpo-engine" in line and "--overwrite" in line, line
    assert (run / name).read_text() == "my notes\n" and not (run / "metrics.jsonl").exists()
    assert main([*args, "--overwrite"]) == 0  # the user's word: the file (or the link itself) is replaced
    assert outside.read_text() == "my notes\n" and not (run / name).is_symlink()
    json.loads((run / name).read_text())
    assert name in (run / ".grpo-files").read_text().split()
    assert main(["plot", str(run)]) == 0  # its own curves.png: drawn without asking, and again
    assert main(["plot", str(run)]) == 0


def test_item4_plot_never_replaces_a_curves_png_it_did_not_draw(handed, capsys):
    from grpo_engine.cli import main

    mine = handed / "run/curves.png"
    mine.write_bytes(b"my own plot")
    assert main(["plot", str(handed / "run")]) == 2
    assert "not written by grpo-engine" in capsys.readouterr().err and mine.read_bytes() == b"my own plot"
    assert main(["plot", str(handed / "run"), "--overwrite"]) == 0 and mine.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("spelling", ["relative", "dot", "folder", "dotdot", "linked folder"])
@pytest.mark.parametrize("target", ["existing", "missing"])
def test_item4_plot_refuses_a_linked_curves_png_however_out_spells_it(handed, capsys, spelling, target):
    """--out naming RUN_DIR/curves.png in any spelling writes through the engine's one writer (run_files): a link
    there is refused without --overwrite, then replaced, its target never written."""
    from grpo_engine.cli import main

    (handed / "elsewhere").mkdir()
    (handed / "run-link").symlink_to(handed / "run")
    out = {"relative": "run/curves.png", "dot": "./run/curves.png", "folder": "run",
           "dotdot": "elsewhere/../run/curves.png", "linked folder": "run-link/curves.png"}[spelling]
    outside = handed / "outside.png"
    if target == "existing":
        outside.write_bytes(b"yours")
    (handed / "run/curves.png").symlink_to(outside)
    assert main(["plot", "run", "--out", out]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"run/curves.png (a link to {outside}): not written by grpo-engine" in line, line
    assert (outside.read_bytes() == b"yours") if target == "existing" else not outside.exists()
    assert main(["plot", "run", "--out", out, "--overwrite"]) == 0
    assert (outside.read_bytes() == b"yours") if target == "existing" else not outside.exists()
    mine = handed / "run/curves.png"
    assert not mine.is_symlink() and mine.read_bytes()[:4] == b"\x89PNG"
    assert "curves.png" in (handed / "run/.grpo-files").read_text().split()
    assert main(["plot", "run", "--out", out]) == 0  # now the engine's own: redrawn without asking


# items 12 and 13: before_after.json is the run's record from step 1 on, written whole at every clean end --------
def test_item12_a_run_stopped_by_sigterm_keeps_its_start_and_a_resume_compares_with_it(tmp_path, tiny_ckpt, capsys,
                                                                                       monkeypatch):
    import os
    import signal

    import grpo_engine.train.loop as loop
    from grpo_engine.cli import main

    log = loop.log

    def log_then_sigterm(run, record):
        log(run, record)
        os.kill(os.getpid(), signal.SIGTERM)  # as `kill PID` during step 1

    monkeypatch.setattr(loop, "log", log_then_sigterm)
    config = tiny_config(tmp_path, tiny_ckpt)
    args = ["train", str(config), "schedule.steps=3", "eval.before_after=true", "eval.max_examples=4"]
    assert main(args) == 0
    got = json.loads((tmp_path / "run/before_after.json").read_text())
    assert (tmp_path / "run/checkpoints/step-000001").is_dir() and not (tmp_path / "run/checkpoints/step-000002")\
        .exists()
    assert set(got["before"]) == set(got["after"]) == {"accuracy", "format_rate", "mean_length"}
    monkeypatch.setattr(loop, "log", log)
    capsys.readouterr()
    assert main([*args, "--resume"]) == 0
    out = capsys.readouterr().out
    assert "no starting figure" not in out and "Held-out greedy results" in out
    assert json.loads((tmp_path / "run/before_after.json").read_text())["before"] == got["before"]


def test_item12_the_start_is_written_before_step_1(tmp_path, tiny_ckpt, monkeypatch):
    import grpo_engine.train.loop as loop
    from grpo_engine.cli import main

    def killed(*a, **k):
        raise KeyboardInterrupt  # as kill -9 during step 1: nothing after this runs

    monkeypatch.setattr(loop, "grpo_step", killed)
    config = tiny_config(tmp_path, tiny_ckpt)
    assert main(["train", str(config), "eval.before_after=true", "eval.max_examples=4"]) == 130
    got = json.loads((tmp_path / "run/before_after.json").read_text())
    assert got["after"] is None and 0.0 <= got["before"]["accuracy"] <= 1.0 and got["problems"] == 4


def test_item13_a_torn_before_after_json_is_named_moved_aside_and_rewritten(handed, capsys):
    from grpo_engine.cli import main

    path = handed / "run/before_after.json"
    whole = path.read_text()
    path.write_text(whole[: len(whole) // 2])  # torn
    assert main(["train", str(handed / "train.yaml"), "schedule.steps=3", "--resume"]) == 0
    captured = capsys.readouterr()
    said = captured.out + captured.err
    assert "unreadable" in said and "torn or edited" in said and "missing" not in said, said
    (aside,) = handed.glob("run/superseded-*/before_after.json.unreadable")
    assert aside.read_text() == whole[: len(whole) // 2]
    said = " ".join(said.split())  # the console wraps long lines
    now = f"torn or edited) and is now {aside.relative_to(handed)}"
    assert "warning: run/before_after.json it was unreadable (Unterminated string" in said and now in said
    assert "no starting figure in run/before_after.json to compare with; it was unreadable (" in said, said
    assert said.count(now) == 2, said
    rewritten = json.loads(path.read_text())  # whole again, with the final model's figure
    assert rewritten["before"] is None and set(rewritten["after"]) == {"accuracy", "format_rate", "mean_length"}


# item 5: a checkpoint copied in under another step name is refused, and the hint works ---------------------------
def test_item5_a_checkpoint_of_another_run_under_another_name_is_refused(handed, capsys):
    import shutil

    from grpo_engine.cli import main

    assert main(["train", "train.yaml", "run_dir=other", "schedule.steps=1"]) == 0
    copied = handed / "run/checkpoints/step-000005"
    shutil.copytree(handed / "other/checkpoints/step-000001", copied)
    capsys.readouterr()
    assert main(["train", "train.yaml", "schedule.steps=6", "--resume"]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--resume run/checkpoints/step-000005: it holds step 1 of the run written in run_dir='other'" in line, line
    assert "not step 5 as its name says" in line and "move it out of" in line
    assert not (handed / "run/checkpoints/step-000006").exists()
    shutil.move(copied, handed / "step-000005-of-other")  # the hint, then the same command
    assert main(["train", "train.yaml", "schedule.steps=3", "--resume"]) == 0
    assert (handed / "run/checkpoints/step-000003").is_dir()


def test_item5_a_moved_run_says_where_its_checkpoint_was_written(handed, capsys):
    from grpo_engine.cli import main

    (handed / "run").rename(handed / "moved")
    assert main(["train", "train.yaml", "run_dir=moved", "schedule.steps=3", "--resume"]) == 0
    err = capsys.readouterr().err
    assert "holds step 2 of the run written in run_dir='run'; continuing it in run_dir='moved'" in err, err


# item 14: an OS error on a path the user named is one line naming the key, the path and the fix, exit 2 ----------
@pytest.mark.parametrize("command", ["train", "check"])
def test_item14_a_data_path_linked_to_proc_self_mem_names_the_key(tmp_path, tiny_ckpt, capsys, command):
    from grpo_engine.cli import main

    link = tmp_path / "rows.jsonl"
    link.symlink_to("/proc/self/mem")
    config = tiny_config(tmp_path, tiny_ckpt, data_path=str(link))
    assert main([command, str(config)]) == 2
    line = capsys.readouterr().err.strip()
    assert "\n" not in line and line.startswith(f"grpo: error: task.options.data_path='{link}' (-> /proc/"), line
    assert "cannot be read (Input/output error); set task.options.data_path to a local" in line


def test_item14_the_task_reader_names_the_file_of_an_unreadable_path(tmp_path):
    link = tmp_path / "rows.jsonl"
    link.symlink_to("/proc/self/mem")
    with pytest.raises(DataError, match=r"rows.jsonl cannot be read \(Input/output error\); set data_path to a local"):
        custom(link).examples("train")


def test_item14_a_run_dir_under_sys_names_run_dir(tmp_path, tiny_ckpt, capsys):
    from grpo_engine.cli import main

    if not Path("/sys/kernel").is_dir():
        pytest.skip("no /sys on this machine")
    config = tiny_config(tmp_path, tiny_ckpt)
    assert main(["train", str(config), "run_dir=/sys/kernel/grpo-engine-test-run"]) == 2
    line = capsys.readouterr().err.strip()
    assert "\n" not in line and "[Errno" not in line, line
    assert line.startswith("grpo: error: run_dir='/sys/kernel/grpo-engine-test-run' cannot be written (") and \
        line.endswith("choose a run_dir in a folder you can write"), line


# item 9: a row whose prompt cannot fit is named (file and line) before step 1 -----------------------------------
def test_item9_a_3MiB_row_let_through_by_a_raised_line_budget_is_named_while_the_file_is_read(tmp_path):
    path = tmp_path / "rows.jsonl"
    rows = [{"prompt": "q", "answer": "1"}] * 7 + [{"prompt": "x" * (3 << 20), "answer": "1"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError) as e:
        custom(path, max_data_line_kib=4096).examples("train")
    assert str(e.value) == (f"{path}: line 8 field 'prompt' holds {3 << 20:,} characters, more than a chat "
                            f"template renders (1,048,576): the row can never be sampled; shorten it")


@pytest.mark.parametrize("command", ["train", "check"])
def test_item9_a_prompt_over_max_prompt_tokens_is_named_by_file_and_line_before_step_1(tmp_path, tiny_ckpt, capsys,
                                                                                      monkeypatch, command):
    import grpo_engine.train.loop as loop
    from grpo_engine.cli import main

    must_not_run(monkeypatch, loop, "grpo_step", "step 1 ran before the prompts were checked")
    path = tmp_path / "rows.jsonl"
    rows = [{"prompt": f"say {i}", "answer": str(i)} for i in range(30)]
    rows[23] = {"prompt": "y" * 500, "answer": "1"}  # a byte-level tokenizer: 500+ tokens
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = tiny_config(tmp_path, tiny_ckpt, data_path=str(path), test_path=str(path))
    assert main([command, str(config), "rollout.max_prompt_tokens=128"]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"grpo: error: {path}: line 24: its prompt renders to ") and line.endswith(
        "tokens, more than rollout.max_prompt_tokens=128; shorten the row, or raise rollout.max_prompt_tokens"), line
    assert not (tmp_path / "run/metrics.jsonl").exists()  # the run directory untouched


def test_item9_the_bound_renders_only_prompts_that_could_exceed_the_cap(tmp_path, tiny_ckpt, monkeypatch):
    from grpo_engine.collect.groups import check_prompt_lengths
    from grpo_engine.model.loading import load_tokenizer
    from grpo_engine.tasks.base import render_prompt

    tok = load_tokenizer(tiny_ckpt)
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": "z" * n, "answer": "1"}) + "\n" for n in range(1, 200)))
    task = custom(path)
    examples = task.examples("train")
    exact = max(len(tok.encode(render_prompt(task, tok, ex))) for ex in examples)
    import grpo_engine.collect.groups as groups

    rendered = []
    monkeypatch.setattr(groups, "render_prompt", lambda *a: rendered.append(a) or render_prompt(*a))
    check_prompt_lengths(task, tok, examples, 4096)
    assert rendered == []  # no text long enough to exceed the cap: nothing rendered
    check_prompt_lengths(task, tok, examples, exact)  # the longest fits exactly
    assert 0 < len(rendered) < len(examples)
    with pytest.raises(DataError, match=r"rows.jsonl: line 199: its prompt renders to"):
        check_prompt_lengths(task, tok, examples, exact - 1)


def test_item15_an_override_after_resume_is_an_override(handed, capsys):
    from grpo_engine.cli import main

    # the later override wins: 3 steps, continued from the newest checkpoint (step 2)
    assert main(["train", "train.yaml", "schedule.steps=2", "--resume", "schedule.steps=3"]) == 0
    assert (handed / "run/checkpoints/step-000003").is_dir()
    (handed / "odd=name").mkdir()  # a checkpoint folder that happens to hold "=" stays the checkpoint
    capsys.readouterr()
    assert main(["train", "train.yaml", "schedule.steps=4", "--resume", "odd=name"]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--resume odd=name" in line, line
    assert not (handed / "run/checkpoints/step-000004").exists()
