"""GSM8K: numeric answer table, loaders for JSONL / parquet / directory / saved datasets dir, clear errors."""

from __future__ import annotations

import json
import sys

import pytest
from references import R1

from grpo_engine.tasks import DataError, Example, make_task
from grpo_engine.tasks.gsm8k import gold_answer

ROWS = [
    {"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "A car costs $1,250 ...", "answer": "It costs 1,250 dollars.\n#### 1,250"},
]
EX = Example("x", "q", "1250")


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path, rows):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    path = write_jsonl(tmp_path_factory.mktemp("g") / "train.jsonl", ROWS)
    return make_task("gsm8k", data_path=str(path), **R1)


def done(answer: str) -> str:
    return f" work </think>\n<answer>{answer}</answer>"


@pytest.mark.parametrize(
    "completion, answer_score, answer",
    [
        (done("1250"), 1.0, "1250"),
        (done("1,250"), 1.0, "1250"),  # thousands separator
        (done("$1,250.00"), 1.0, "1250"),  # currency, trailing zeros
        (done("1250 dollars"), 1.0, "1250"),  # units
        (done("1250.0"), 1.0, "1250"),
        (done("2500/2"), 1.0, "1250"),  # fraction
        (done("\\frac{2500}{2}"), 1.0, "1250"),
        (done("1251"), 0.0, "1251"),  # wrong
        (done("-1250"), 0.0, "-1250"),
        (done("١٢٥٠"), 0.0, None),  # Arabic-Indic digits do not count (documented)
        (done("9" * 10_000), 0.0, None),  # huge literal, longer than any answer
        (done("(" * 10_000 + "1250" + ")" * 10_000), 1.0, "1250"),  # oversized tag skipped -> last number
        (done("(" * 10_000 + "1250" + ")" * 10_000) + " 7", 0.0, "7"),
        (" so \\boxed{1250}", 1.0, "1250"),  # no tags: boxed
        (" The answer is 1,250.", 1.0, "1250"),  # no tags: 'the answer is'
        (" I think 1000 then 1250", 1.0, "1250"),  # no tags: last number
        (" no number at all", 0.0, None),
        (done("5") + " <answer>1250</answer>", 1.0, "1250"),  # several answer tags: the last
        (done("1,250e3"), 0.0, None),  # only the tail of a number: not 3 or 1250
        (done("−1250"), 0.0, "-1250"),  # Unicode minus: not 1250
        (done(".1250"), 0.0, "1/8"),  # not 1250
        (" so it is 5^{1250}", 0.0, None),  # an exponent ends the reply: not the answer 1250
        ("x" * 1_000_000 + done("1250"), 1.0, "1250"),  # 1 MB completion
    ],
    ids=lambda v: repr(v)[:30] if isinstance(v, str) else None,
)
def test_reward_table(task, completion, answer_score, answer):
    result = task.reward(EX, completion)
    assert result.components["answer"] == answer_score
    assert result.answer == answer
    assert result.total == pytest.approx(0.1 * result.components["format"] + answer_score)


def test_large_answers_are_not_within_the_tolerance(task):
    """1e-6 relative is 2 at two million: an answer off by one scored as right."""
    big = Example("b", "q", "2000000")
    scores = [task.reward(big, done(a)).components["answer"] for a in ("2,000,000", "2,000,001", "2000000.5")]
    assert scores == [1.0, 0.0, 0.0]


def test_format_component(task):
    assert task.reward(EX, done("1250")).components["format"] == 1.0
    assert task.reward(EX, " 1250").components["format"] == 0.0


@pytest.mark.parametrize(
    "a, b, equal", [("1,000", "1000", True), ("72.0", "72", True), ("1/2", "0.5", True), ("3", "4", False)]
)
def test_equivalent(task, a, b, equal):
    assert task.equivalent(a, b) is equal


@pytest.mark.parametrize(
    "solution, gold", [("x\n#### 72", "72"), ("#### 1,234", "1234"), ("#### -5", "-5"), ("no marker", None)]
)
def test_gold_answer(solution, gold):
    assert gold_answer(solution) == gold


@pytest.mark.parametrize("writer, suffix", [(write_jsonl, "jsonl"), (write_parquet, "parquet")])
def test_loader_formats_and_split_directory(tmp_path, writer, suffix):
    writer(tmp_path / f"train.{suffix}", ROWS)
    writer(tmp_path / f"test-00000-of-00001.{suffix}", ROWS[:1])  # HF hub file naming
    task = make_task("gsm8k", data_path=str(tmp_path))
    assert [(e.question, e.answer) for e in task.examples("train")] == [
        (ROWS[0]["question"], "7"),
        (ROWS[1]["question"], "1250"),
    ]
    assert [e.answer for e in task.examples("test")] == ["7"]
    with pytest.raises(DataError, match="no file for split 'validation'"):
        task.examples("validation")


@pytest.mark.parametrize("writer, name, where",
                         [(write_jsonl, "g.jsonl", "line 3"), (write_parquet, "g.parquet", "record 3")])
def test_missing_field_names_file_row_and_field(tmp_path, writer, name, where):
    path = writer(tmp_path / name, [ROWS[0], ROWS[1], {"question": "q only"}])
    with pytest.raises(DataError, match=rf"{name}: {where} has no field 'answer'"):
        make_task("gsm8k", data_path=str(path)).examples("train")


def test_answer_without_marker_is_a_clear_error(tmp_path):
    path = write_jsonl(tmp_path / "g.jsonl", [{"question": "q", "answer": "just 7"}])
    with pytest.raises(DataError, match=r"g.jsonl: line 1 field 'answer' must be a solution ending in '####"):
        make_task("gsm8k", data_path=str(path)).examples("train")


def test_saved_datasets_directory(tmp_path):
    datasets = pytest.importorskip("datasets")
    splits = {"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS[1:])}
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "dd"))
    task = make_task("gsm8k", data_path=str(tmp_path / "dd"))
    assert [e.answer for e in task.examples("train")] == ["7", "1250"]
    assert [e.answer for e in task.examples("test")] == ["1250"]
    single = make_task("gsm8k", data_path=str(tmp_path / "dd" / "test"))
    assert [e.answer for e in single.examples("whatever")] == ["1250"]


def test_hub_without_datasets_package_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(DataError, match=r"needs the `datasets` package.*set data_path"):
        make_task("gsm8k").examples("train")


def test_hub_without_network_is_a_clear_error(monkeypatch):
    datasets = pytest.importorskip("datasets")

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError, match=r"could not load 'openai/gsm8k'.*Without network.*data_path"):
        make_task("gsm8k").examples("train")
