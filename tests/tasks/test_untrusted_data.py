"""Issue 51, cases 1-3, 14, 15, 17 and 20: a data file is untrusted input (tasks/data.py, config/paths.py).

Only a regular file is read (a link to /dev/zero or a FIFO is refused by a stat, never opened); its size and each
JSON line's length are bounded before they are read; a row that is not text or nests too deep is one line naming
the file and the line."""

import json
import os
import threading
import time

import pytest

import grpo_engine.config.paths as paths
from grpo_engine.tasks import data, make_task
from grpo_engine.tasks.data import DataError, read_records


def custom(path, **options):
    """The custom task on one file for both splits (its train split is the file, whatever holds out a test split)."""
    return make_task("custom", data_path=str(path), test_path=str(path), **options)


def returns_within(seconds: float, fn):
    """fn() run in a daemon thread: (finished, its result or exception). A read that blocks (a FIFO without a writer)
    or never ends (/dev/zero) leaves the thread running and the test fails instead of hanging."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            out["value"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    return not thread.is_alive(), out.get("value")


def test_case1_a_data_path_linked_to_dev_zero_is_refused_before_reading(tmp_path):
    link = tmp_path / "data.jsonl"
    link.symlink_to("/dev/zero")
    done, result = returns_within(10, lambda: read_records(link))
    assert done and isinstance(result, DataError), result
    assert str(result) == (f"data file {link} (-> /dev/zero) is a character device, not a regular file or a directory; "
                           f"set data_path to a local .jsonl/.parquet file")


def test_case2_a_fifo_is_refused_without_being_opened(tmp_path):
    fifo = tmp_path / "data.jsonl"
    os.mkfifo(fifo)
    done, result = returns_within(10, lambda: custom(fifo).examples("test"))
    assert done and isinstance(result, DataError), result
    assert f"data file {fifo} is a FIFO (named pipe), not a regular file" in str(result)
    done, result = returns_within(10, lambda: paths.read_regular(fifo, "config", max_bytes=10, option="x"))
    assert done and "is a FIFO (named pipe)" in str(result)


def test_regular_path_takes_files_and_directories_only_where_asked(tmp_path):
    (tmp_path / "f").write_text("x")
    assert paths.regular_path(tmp_path / "f", "f") == tmp_path / "f"
    assert paths.regular_path(tmp_path, "d", directory=True) == tmp_path
    with pytest.raises(ValueError, match="is a directory, not a regular file"):
        paths.regular_path(tmp_path, "d")
    with pytest.raises(ValueError, match="is a character device, not a regular file or a directory"):
        paths.regular_path("/dev/null", "d", directory=True)


@pytest.mark.parametrize("case", ["case3_300MB_line", "case17_not_blamed_on_the_template"])
def test_a_300MB_row_is_a_too_long_line_found_after_1MiB(tmp_path, case):
    """A single 300 MB line took 643 MB and 44 s, then was blamed on the chat template. The file here is sparse
    (no disk used): reading stops at the line budget, so the error comes at once."""
    path = tmp_path / "big.jsonl"
    path.write_text(json.dumps({"prompt": "ok", "answer": "1"}) + "\n")
    with open(path, "r+b") as f:
        f.truncate(300 << 20)  # line 2: 300 MB of NUL bytes, no newline
    start = time.perf_counter()
    with pytest.raises(DataError) as e:
        custom(path).examples("train")
    assert time.perf_counter() - start < 5
    assert str(e.value) == (f"{path}: line 2 is longer than 1,024 KiB (the limit, task.options.max_data_line_kib); "
                            f"shorten the row, or raise task.options.max_data_line_kib if it is meant to be this long")
    assert "template" not in str(e.value)


def test_the_budgets_are_raised_by_the_task_options(tmp_path):
    path = tmp_path / "d.jsonl"
    long = "x" * 3000
    path.write_text(json.dumps({"prompt": long, "answer": "1"}) + "\n")
    with pytest.raises(DataError, match="line 1 is longer than 2 KiB"):
        read_records(path, data.Limits(line_kib=2))
    with pytest.raises(DataError, match=r"3,0\d\d bytes, over the limit of 2,048 \(task.options.max_data_file_mib\)"):
        _with_file_limit(path, 2048)
    task = custom(path, max_data_line_kib=4)
    assert task.examples("train")[0].question == long
    with pytest.raises(DataError, match="line 1 is longer than 2 KiB"):
        custom(path, max_data_line_kib=2).examples("train")
    with pytest.raises(ValueError, match="max_data_line_kib=0 must be an integer >= 1"):
        custom(path, max_data_line_kib=0)


def _with_file_limit(path, max_bytes: int):
    """read_records with a file budget of max_bytes (below the MiB the option counts in)."""
    original = data._open_data
    try:
        data._open_data = lambda p, limits: data.open_regular(p, "data file", max_bytes=max_bytes,
                                                              option=data.FILE_OPTION, error=DataError)
        return read_records(path)
    finally:
        data._open_data = original


def test_case14_a_lone_surrogate_is_one_line_naming_file_line_and_field(tmp_path):
    path = tmp_path / "s.jsonl"
    path.write_text('{"prompt": "fine \\u00e9", "answer": "1"}\n{"prompt": "bad \\ud800", "answer": "1"}\n')
    with pytest.raises(DataError) as e:
        custom(path).examples("train")
    assert str(e.value) == (f"{path}: line 2: field 'prompt' holds a lone surrogate (\\ud800), which is not text; "
                            f"fix the row's \\u escapes")
    listed = tmp_path / "s.json"
    listed.write_text('[{"prompt": "ok", "answer": "1"}, {"prompt": "x", "answer": "\\udfff"}]')
    with pytest.raises(DataError, match=r"s.json: record 2: field 'answer' holds a lone surrogate \(\\udfff\)"):
        read_records(listed)
    pair = tmp_path / "pair.jsonl"  # a surrogate pair written as escapes is one character: text
    pair.write_text('{"prompt": "\\ud83d\\ude00", "answer": "1"}\n')
    assert read_records(pair)[0]["prompt"] == "\U0001F600"


def test_case15_a_row_nested_200k_deep_is_one_line_naming_the_line(tmp_path):
    path = tmp_path / "deep.jsonl"
    path.write_text(json.dumps({"prompt": "q", "answer": "1"}) + "\n" + '{"prompt": ' + "[" * 200_000 +
                    "]" * 200_000 + ', "answer": "1"}\n')
    with pytest.raises(DataError) as e:
        read_records(path)
    assert str(e.value).startswith(f"{path}: line 2 nests deeper than the JSON reader follows")
    listed = tmp_path / "deep.json"
    listed.write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(DataError, match="deep.json nests deeper than the JSON reader follows"):
        read_records(listed)


def test_case20_a_null_prompt_is_called_null_not_missing(tmp_path):
    path = tmp_path / "n.jsonl"
    path.write_text('{"prompt": "q", "answer": "1"}\n{"prompt": null, "answer": "1"}\n')
    with pytest.raises(DataError) as e:
        custom(path).examples("train")
    assert str(e.value) == (f"{path}: line 2 has no field 'prompt': it is null; every record needs a value for "
                            f"each of ['prompt', 'answer']")


def test_not_utf8_still_names_the_byte_and_its_offset_in_the_file(tmp_path):
    path = tmp_path / "latin.jsonl"
    path.write_bytes(b'{"prompt": "a", "answer": "1"}\n{"prompt": "caf\xe9", "answer": "1"}\n')
    with pytest.raises(DataError, match=r"not UTF-8 text \(byte b'\\xe9' at offset 46\)"):
        read_records(path)
