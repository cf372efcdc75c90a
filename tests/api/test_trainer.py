"""grpo_engine.GRPO trains the run `grpo train` trains: each argument form (data as a path, a list of dicts or a
datasets.Dataset; the reward as a function, a weighted list or a verifier name; the config as a YAML path, a dict or
overrides) gives the same rewards, lengths and gradient norms as the equivalent YAML + CLI run on the same seed."""

import json
from pathlib import Path, PurePosixPath

import pytest
import yaml

from grpo_engine import GRPO
from grpo_engine.api.trainer import run_dir_config
from grpo_engine.cli import main
from grpo_engine.config import ConfigError
from grpo_engine.config.trust import StoredCode
from grpo_engine.tasks.data import MAX_FIELD_CHARS, DataError
from grpo_engine.train.setup import task_of

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
COMPARED = ("step", "reward_mean", "reward_std", "reward_components", "completion_len_mean", "completion_len_max",
            "grad_norm", "loss", "reward_errors", "reward_timeouts")
ROWS = [{"prompt": f"say {i}", "answer": str(i), "level": i % 3} for i in range(8)]


@pytest.fixture(autouse=True)
def _rewards_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))


def base_config() -> dict:
    """tiny_arithmetic.yaml without its task: 2 steps, no signal check, no progress bar."""
    cfg = yaml.safe_load((REPO / "configs/tiny_arithmetic.yaml").read_text())
    del cfg["task"]
    cfg["schedule"]["steps"] = 2
    cfg["check"] = {"enabled": False}
    cfg["eval"] = {"before_after": False}
    cfg["checkpoint"] = {"every": 0, "keep_last": 2}
    return cfg


def metrics(run_dir) -> list[dict]:
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [{k: r[k] for k in COMPARED} for r in rows]


def cli_run(tmp_path, tiny_ckpt, name: str, options: dict) -> list[dict]:
    """The YAML + `grpo train` run: the custom task on ROWS as a file, with `options`."""
    data = tmp_path / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    cfg = {**base_config(), "task": {"name": "custom", "options": {"data_path": str(data), **options}}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["train", str(path), f"model.path={tiny_ckpt}", f"run_dir={tmp_path / name}"]) == 0
    return metrics(tmp_path / name)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_ckpt_factory):
    tmp, ckpt = tmp_path_factory.mktemp("cli"), tiny_ckpt_factory("qwen2")
    import sys

    sys.path.insert(0, str(HERE))
    try:
        return {"fn": cli_run(tmp, ckpt, "fn", {"reward_fn": "api_rewards:even_bytes"}),
                "list": cli_run(tmp, ckpt, "list", {"reward_fns": ["api_rewards:even_bytes",
                                                                   {"fn": "api_rewards:length", "weight": 0.5}]}),
                "verifier": cli_run(tmp, ckpt, "verifier", {"verifier": "numeric"})}
    finally:
        sys.path.remove(str(HERE))


def test_yaml_path_data_path_and_a_function_match_the_cli(reference, tmp_path, tiny_ckpt):
    import api_rewards

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    config = tmp_path / "base.yaml"
    config.write_text(yaml.safe_dump(base_config()))
    trainer = GRPO(tiny_ckpt, reward=api_rewards.even_bytes, train_data=str(data), config=str(config),
                   run_dir=str(tmp_path / "py"))
    trainer.train()
    assert metrics(tmp_path / "py") == reference["fn"]
    assert reference["fn"][0]["grad_norm"] > 0  # the reward varies: the update is not a no-op


def test_a_config_dict_and_a_list_of_rows_match_the_cli(reference, tmp_path, tiny_ckpt):
    import api_rewards

    trainer = GRPO(tiny_ckpt, reward=api_rewards.even_bytes, train_data=ROWS,
                   config={**base_config(), "run_dir": str(tmp_path / "py")})
    trainer.train()
    assert metrics(tmp_path / "py") == reference["fn"]
    stored = (tmp_path / "py/checkpoints/step-000002/config.yaml").read_text()
    assert "reward_fn: api_rewards:even_bytes" in stored and str(tmp_path / "py/data/train_data.jsonl") in stored
    record = json.loads((tmp_path / "py/checkpoints/step-000002/data.json").read_text())
    assert record["files"]["task.options.data_path"]["rows"] == 8  # the rows' fingerprint, as for a file


def test_overrides_alone_and_a_dataset_match_the_cli(reference, tmp_path, tiny_ckpt):
    datasets = pytest.importorskip("datasets")
    import api_rewards

    flat = {f"{section}__{key}": value for section, values in base_config().items() if isinstance(values, dict)
            for key, value in values.items()}
    trainer = GRPO(tiny_ckpt, reward=api_rewards.even_bytes, train_data=datasets.Dataset.from_list(ROWS),
                   **{**flat, "seed": 0, "run_dir": str(tmp_path / "py")})
    trainer.train()
    assert metrics(tmp_path / "py") == reference["fn"]


def test_a_weighted_list_matches_reward_fns(reference, tmp_path, tiny_ckpt):
    import api_rewards

    GRPO(tiny_ckpt, reward=[api_rewards.even_bytes, (api_rewards.length, 0.5)], train_data=ROWS,
         config=base_config(), run_dir=str(tmp_path / "py")).train()
    assert metrics(tmp_path / "py") == reference["list"]
    assert set(reference["list"][0]["reward_components"]) == {"even_bytes", "length"}


def test_a_verifier_name_matches_the_cli(reference, tmp_path, tiny_ckpt):
    GRPO(tiny_ckpt, reward="numeric", train_data=ROWS, config=base_config(), run_dir=str(tmp_path / "py")).train()
    assert metrics(tmp_path / "py") == reference["verifier"]


def test_a_raising_or_hanging_reward_scores_0_and_is_counted(tmp_path, tiny_ckpt, monkeypatch):
    import api_rewards

    monkeypatch.setattr("grpo_engine.collect.groups.REWARD_TIMEOUT_S", 0.05)
    for fn, key in ((api_rewards.raises, "reward_errors"), (api_rewards.hangs, "reward_timeouts"),
                    (lambda example, completion: 1 / 0, "reward_errors")):
        run_dir = tmp_path / key / str(id(fn))
        GRPO(tiny_ckpt, reward=fn, train_data=ROWS, config=base_config(), run_dir=str(run_dir),
             schedule__steps=1).train()
        (row,) = metrics(run_dir)
        assert row[key] == 8 and row["reward_mean"] == 0.0  # 2 prompts x 4 replies, each scored 0


def test_a_python_run_resumes_from_the_cli_with_allow_code(tmp_path, tiny_ckpt, capsys):
    import api_rewards

    run_dir = tmp_path / "py"
    trainer = GRPO(tiny_ckpt, reward=[api_rewards.even_bytes, (api_rewards.length, 0.5)], train_data=ROWS,
                   config=base_config(), run_dir=str(run_dir), checkpoint__every=1)
    assert trainer.train(steps=1).last_step == 1
    stored = run_dir_config(run_dir)  # marked as every stored config is: each item of the weighted list is code
    assert [type(item["fn"]) for item in stored.task.options["reward_fns"]] == [StoredCode, StoredCode]
    with pytest.raises(ConfigError, match="pass --allow-code api_rewards:even_bytes"):
        task_of(stored)
    assert main(["train", str(run_dir), "--resume", "--allow-code", "api_rewards:even_bytes"]) == 2
    assert "pass --allow-code api_rewards:length" in capsys.readouterr().err
    assert main(["train", str(run_dir), "--resume", "--allow-code", "api_rewards:even_bytes",
                 "--allow-code", "api_rewards:length"]) == 0
    assert [r["step"] for r in trainer.history] == [1, 2] if isinstance(trainer.history, list) else \
        list(trainer.history["step"]) == [1, 2]


def test_a_notebook_function_resumes_from_python_only(tmp_path, tiny_ckpt, capsys):
    def notebook_reward(example, completion):
        return len(completion) / 8

    notebook_reward.__module__ = "__main__"  # as a function defined in a notebook cell is
    args = dict(reward=notebook_reward, train_data=ROWS, config=base_config(), run_dir=str(tmp_path / "nb"),
                checkpoint__every=1)
    GRPO(tiny_ckpt, **args).train(steps=1)
    assert "resumes from Python only" in capsys.readouterr().err
    assert main(["train", str(tmp_path / "nb"), "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "resumes from Python only" in err and "notebook_reward" in err
    assert GRPO(tiny_ckpt, **args).train().last_step == 2  # the same function, given again: resumed


@pytest.mark.parametrize("rows, message", [
    ([{"prompt": "a", "answer": "1"}, {"prompt": "b"}], r"train_data\[1\] has no field 'answer'"),
    ([{"prompt": "a", "answer": "1"}, "b"], r"train_data\[1\] is a str"),
    ([{"prompt": "a", "answer": {1, 2}}], r"train_data\[0\]: .*JSON data"),
    ([{"prompt": "\ud800", "answer": "1"}], r"train_data\[0\]: field 'prompt' holds a lone surrogate"),
    ([{"prompt": "a", "answer": "1"}, {"prompt": "x" * 2048, "answer": "1"}],
     r"train_data\[1\] is longer than 1 KiB \(the limit, task.options.max_data_line_kib\)"),
    ([], "train_data has no rows"),
    ([{"prompt": "a", "answer": None}], r"train_data\[0\] has no field 'answer': it is null"),
    ([{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": " "}], r"train_data\[1\] field 'answer' is empty"),
])
def test_bad_rows_are_one_line_naming_the_row(tmp_path, tiny_ckpt, rows, message):
    with pytest.raises(DataError, match=message):
        GRPO(tiny_ckpt, reward="exact", train_data=rows, run_dir=str(tmp_path), task__options__max_data_line_kib=1)


def test_rows_get_a_files_field_checks_from_a_list_or_a_dataset(tmp_path, tiny_ckpt):
    """The checks of a data file's rows (tasks/data.py check_fields), the row named by its index: a prompt longer than
    a chat template renders is refused when the object is made, under a line budget that lets it through."""
    rows = [{"prompt": "a", "answer": "1"}, {"prompt": "x" * (MAX_FIELD_CHARS + 1), "answer": "1"}]
    with pytest.raises(DataError, match=rf"train_data\[1\] field 'prompt' holds {MAX_FIELD_CHARS + 1:,} characters"):
        GRPO(tiny_ckpt, reward="exact", train_data=rows, run_dir=str(tmp_path), task__options__max_data_line_kib=4096)
    datasets = pytest.importorskip("datasets")
    empty = datasets.Dataset.from_list([{"prompt": "a", "answer": "1"}, {"prompt": "", "answer": "2"}])
    with pytest.raises(DataError, match=r"test_data\[1\] field 'prompt' is empty"):
        GRPO(tiny_ckpt, reward="exact", train_data=ROWS, test_data=empty, run_dir=str(tmp_path))


def test_overrides_are_validated_as_the_clis(tmp_path, tiny_ckpt):
    with pytest.raises(ConfigError, match="did you mean 'rollout.group_size'"):
        GRPO(tiny_ckpt, rollout__group_sise=16)
    with pytest.raises(ConfigError, match="group_size"):
        GRPO(tiny_ckpt, rollout={"group_size": 1})
    with pytest.raises(ConfigError, match="reward="):
        GRPO(tiny_ckpt, reward=42)
    with pytest.raises(ConfigError, match="task: custom task needs data_path"):
        GRPO(tiny_ckpt, reward="numeric")  # a verifier without data: said when the object is made
    options = GRPO(tiny_ckpt, reward="m:f", train_data=ROWS, task__options__reward_fns=["m:g"]).config.task.options
    assert options["reward_fn"] == "m:f" and options["reward_fns"] is None  # the argument replaces the config's
    assert GRPO(tiny_ckpt, **{"rollout.group_size": 6}, rollout__top_k=3).config.rollout.group_size == 6


def test_a_weight_is_checked_as_reward_fns_weights_are(tiny_ckpt):
    """One check of a weight (tasks/custom.py weighted_specs), the same message as the YAML's."""
    import api_rewards

    with pytest.raises(ConfigError, match=r"reward_fns\[1\] weight=nan must be a finite number"):
        GRPO(tiny_ckpt, reward=[api_rewards.even_bytes, (api_rewards.length, float("nan"))], train_data=ROWS)


def test_the_rows_budgets_are_the_task_options_limits(tiny_ckpt):
    """ChatTaskOptions.limits, its options range-checked: 0 KiB is a config error, not a budget no row fits."""
    with pytest.raises(ConfigError, match=r"max_data_line_kib=0 must be an integer >= 1"):
        GRPO(tiny_ckpt, reward="exact", train_data=ROWS, task__options__max_data_line_kib=0)


def test_any_path_like_value_is_text_in_a_config_dict_as_in_an_override(tmp_path, tiny_ckpt):
    for config, overrides in (({"run_dir": PurePosixPath(tmp_path / "a")}, {}),
                              (None, {"run_dir": PurePosixPath(tmp_path / "a")})):
        assert GRPO(tiny_ckpt, config=config, **overrides).run_dir == tmp_path / "a"


def test_two_rewards_of_one_name_are_two_components(tmp_path, tiny_ckpt):
    import api_more_rewards
    import api_rewards

    GRPO(tiny_ckpt, reward=[api_rewards.length, api_more_rewards.length], train_data=ROWS, config=base_config(),
         run_dir=str(tmp_path), schedule__steps=1).train()
    (row,) = metrics(tmp_path)
    means = {name: stats["mean"] for name, stats in row["reward_components"].items()}
    assert set(means) == {"api_rewards.length", "api_more_rewards.length"}
    assert means["api_rewards.length"] > 0 and means["api_rewards.length"] == pytest.approx(
        2 * means["api_more_rewards.length"])  # each its own function's values (len / 10 and len / 20)
    assert row["reward_mean"] == pytest.approx(1.5 * means["api_rewards.length"])


def test_a_model_object_matches_its_path(reference, tmp_path, tiny_ckpt):
    import api_rewards

    from grpo_engine import load_model

    trainer = GRPO(load_model(tiny_ckpt), reward=api_rewards.even_bytes, train_data=ROWS, config=base_config(),
                   run_dir=str(tmp_path / "py"))
    trainer.train()
    assert metrics(tmp_path / "py") == reference["fn"]
    assert trainer.config.model.path == str((tmp_path / "py/model").resolve())
    with pytest.raises(TypeError, match="grpo_engine.load_model"):
        GRPO(object())


def test_after_training_generate_evaluate_save_and_history(tmp_path, tiny_ckpt, monkeypatch, capfd):
    import api_rewards

    from grpo_engine import load_model

    trainer = GRPO(tiny_ckpt, reward=api_rewards.by_level, train_data=ROWS, config=base_config(),
                   run_dir=str(tmp_path / "py"), logging__progress=True)
    trainer.train()
    out = capfd.readouterr().out
    assert "step 2/2" in out and "\x1b" not in out and "\r" not in out  # plain lines in a log: no escape sequences
    assert trainer.current_model() == tmp_path / "py/checkpoints/step-000002/model"
    reply = trainer.generate("say 3", max_new_tokens=4)
    assert isinstance(reply, str)
    replies = trainer.generate(["a", "b"], max_new_tokens=2, n=2, temperature=1.0)
    assert len(replies) == 2 and all(len(g) == 2 and all(isinstance(r, str) for r in g) for g in replies), replies
    report = trainer.evaluate(data=ROWS[:3], max_new_tokens=4)
    assert report.summary.num_problems == 3
    # by_level adds the row's level (0, 1, 2) to a share in [0, 1]: its mean reward is above the mean level
    assert report.summary.mean_reward >= 1.0
    saved = trainer.save(tmp_path / "saved")
    assert load_model(saved).config.vocab_size == load_model(tiny_ckpt).config.vocab_size
    with pytest.raises(FileExistsError):
        trainer.save(tmp_path / "saved")
    monkeypatch.setitem(__import__("sys").modules, "pandas", None)  # without pandas: a list of dicts
    assert [r["step"] for r in trainer.history] == [1, 2]


def test_help_says_what_docs_python_md_says():
    import inspect

    doc = (REPO / "docs/python.md").read_text()
    methods = [name for name, _ in inspect.getmembers(GRPO) if not name.startswith("_")]
    assert methods == ["check", "current_model", "evaluate", "export_gguf", "generate", "history", "plot", "save",
                       "train"]
    for name in methods:
        assert f"`{name}" in doc, name
    for name in ("check()", "train(steps=None)", "evaluate(data=None)", "generate(prompts, ...)", "save(path)",
                 "export_gguf(path, type=\"f16\")", "plot(show=True)", "history"):
        assert name in GRPO.__doc__, name
    for argument in ("model", "reward", "train_data", "test_data", "config", "**overrides"):
        assert f"`{argument}`" in doc and f"\n      {argument}" in GRPO.__doc__, argument


def test_other_rows_on_resume_are_refused_unless_allowed(tmp_path, tiny_ckpt):
    import api_rewards

    args = dict(reward=api_rewards.even_bytes, config=base_config(), run_dir=str(tmp_path / "py"), checkpoint__every=1)
    GRPO(tiny_ckpt, train_data=ROWS, **args).train(steps=1)
    data = tmp_path / "py/data/train_data.jsonl"
    before = data.read_text()
    other = GRPO(tiny_ckpt, train_data=ROWS[:6], **args)
    with pytest.raises(DataError, match=r"allow_data_change=True"):
        other.train()
    assert data.read_text() == before  # nothing overwritten
    assert other.train(allow_data_change=True).last_step == 2
    assert len(data.read_text().splitlines()) == 6


def test_a_run_resumed_by_a_new_object_is_the_uninterrupted_run(reference, tmp_path, tiny_ckpt):
    import api_rewards

    args = dict(reward=api_rewards.even_bytes, train_data=ROWS, config={**base_config(), "run_dir": str(tmp_path)})
    assert GRPO(tiny_ckpt, **args).train(steps=1).last_step == 1
    assert GRPO(tiny_ckpt, **args).train().last_step == 2  # the Python kernel restarted: the same arguments
    assert metrics(tmp_path) == reference["fn"]


def test_a_cli_run_resumes_from_python(reference, tmp_path, tiny_ckpt):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({**base_config(), "task": {"name": "custom", "options": {
        "data_path": str(data), "reward_fn": "api_rewards:even_bytes"}}}))
    assert main(["train", str(config), f"model.path={tiny_ckpt}", f"run_dir={tmp_path / 'r'}",
                 "--stop-after", "1"]) == 0
    assert GRPO(tiny_ckpt, config=str(config), run_dir=str(tmp_path / "r")).train().last_step == 2
    assert metrics(tmp_path / "r") == reference["fn"]
