"""A reward sees every column of its row (`example["difficulty"]`), from a file as from Python; several rewards
with weights (`reward_fns`) sum; their names are stored code like `reward_fn`'s."""

import json
from pathlib import Path

import pytest

from grpo_engine.config import ConfigError, config_from_yaml_text, load_config, to_yaml
from grpo_engine.config.trust import StoredCode, allowing_code
from grpo_engine.tasks import make_task, safe_reward
from grpo_engine.tasks.base import Example
from grpo_engine.tasks.custom import component_names, providing_rewards
from grpo_engine.train.setup import task_of

HERE = Path(__file__).resolve().parent


@pytest.fixture
def rows_file(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))
    path = tmp_path / "rows.jsonl"
    rows = [{"prompt": "2+2", "answer": "4", "difficulty": 3, "tags": ["easy"]},
            {"prompt": "3+3", "answer": "6", "difficulty": 7, "tags": []}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_reward_reads_any_column_of_its_row(rows_file):
    task = make_task("custom", data_path=str(rows_file), reward_fn="row_rewards:by_difficulty")
    first, second = task.examples("train")
    assert first["difficulty"] == 3 and first["tags"] == ["easy"] and second.get("difficulty") == 7
    assert first["id"] == f"{rows_file}#0" and first["question"] == "2+2" and "tags" in first
    assert first.keys() == ["answer", "difficulty", "id", "prompt", "question", "tags"]
    assert safe_reward(task, first, "4").total == 4.0 and safe_reward(task, second, "x").total == 7.0
    with pytest.raises(KeyError, match="no such column"):
        first["level"]


def test_examples_without_a_row_still_compare_and_hash_by_their_fields():
    a, b = Example("1", "q", "a", row={"x": 1}), Example("1", "q", "a")
    assert a == b and hash(a) == hash(b) and a["answer"] == "a" and a.get("x") == 1 and b.get("x", 5) == 5


def test_weighted_rewards_sum_and_each_is_a_component(rows_file):
    task = make_task("custom", data_path=str(rows_file),
                     reward_fns=["row_rewards:by_difficulty", {"fn": "row_rewards:length", "weight": 0.5}])
    result = safe_reward(task, task.examples("train")[0], "4")
    assert result.total == 4.0 + 0.5 * 1.0
    assert result.components == {"by_difficulty": 4.0, "length": 1.0}


@pytest.mark.parametrize("bad, message", [
    ([], "non-empty list"), (["m:f", {"fn": "m:g", "weight": "x"}], "weight='x'"),
    ([{"fun": "m:f"}], r"reward_fns\[0\]"),
])
def test_a_bad_reward_list_is_one_line_naming_the_item(rows_file, bad, message):
    with pytest.raises(ConfigError, match=message):
        task_of(load_config(None, ["task.name=custom", f"task.options.data_path={rows_file}",
                                   f"task.options.reward_fns={json.dumps(bad)}"]))


def test_every_name_of_a_reward_list_is_stored_code(rows_file):
    cfg = load_config(None, ["task.name=custom", f"task.options.data_path={rows_file}",
                             'task.options.reward_fns=["row_rewards:by_difficulty", '
                             '{fn: "row_rewards:length", weight: 0.5}]'])
    stored = config_from_yaml_text(to_yaml(cfg), "RUN/config.yaml")
    names = stored.task.options["reward_fns"]
    assert isinstance(names[0], StoredCode) and isinstance(names[1]["fn"], StoredCode)
    assert names[1]["fn"].key == "task.options.reward_fns[1].fn"
    options = dict(stored.task.options)
    with pytest.raises(ConfigError, match="pass --allow-code row_rewards:by_difficulty"):
        make_task("custom", **options)
    with allowing_code(["row_rewards:by_difficulty"]), pytest.raises(ConfigError, match="row_rewards:length"):
        make_task("custom", **options)
    with allowing_code(["row_rewards:by_difficulty", "row_rewards:length"]):
        assert safe_reward(make_task("custom", **options), Example("i", "q", "4", row={"difficulty": 1}), "4").total \
            == 2.5
    assert "StoredCode" not in to_yaml(stored)


def test_a_function_of_main_is_refused_by_name_and_taken_when_handed_over(rows_file):
    options = {"data_path": str(rows_file), "reward_fn": "__main__:my_reward"}
    with pytest.raises(ValueError, match="resumes from Python only"):
        make_task("custom", **options)
    with providing_rewards({"__main__:my_reward": lambda example, completion: 0.25}):
        task = make_task("custom", **options)
    assert safe_reward(task, task.examples("train")[0], "x").total == 0.25


def test_reward_names_are_unique_and_fixed_by_the_list():
    """Two functions of one name are qualified by their modules' last part, a name still repeated is numbered by its
    place; the Python API's `#object` / `#2` marks are no part of a name."""
    specs = ["pkg.a:score", "b:score", "m:length", "m:f", "n.m:f", "api:fn#object", "api:<lambda>",
             "api:<lambda>#2"]
    assert component_names(specs) == ["a.score", "b.score", "length", "m.f#4", "m.f#5", "fn", "api.<lambda>#7",
                                      "api.<lambda>#8"]
    assert component_names(["x:f"]) == ["f"]


def test_two_rewards_of_one_name_from_a_file_are_two_components(rows_file):
    """The same names from a YAML list (tasks/custom.py), each with its own value."""
    task = make_task("custom", data_path=str(rows_file),
                     reward_fns=["row_rewards:length", {"fn": "row_more_rewards:length", "weight": 2.0}])
    result = safe_reward(task, task.examples("train")[0], "four")
    assert result.components == {"row_rewards.length": 4.0, "row_more_rewards.length": 2.0}
    assert result.total == 4.0 + 2.0 * 2.0
