"""Data-file errors name the file and the record as a user finds it in an editor: a JSON-lines record by its
1-based physical line (blank lines counted), any other record by its 1-based position ("record N")."""

import json

import pytest

from grpo_engine.tasks import make_task
from grpo_engine.tasks.data import DataError, read_records, require_fields


def test_jsonl_error_names_the_physical_line_after_blank_lines(tmp_path):
    # line 1: a record, lines 2-3: blank, line 4: the record without 'answer' (the 2nd record, index 1)
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({"prompt": "q", "answer": "1"}) + "\n\n  \n" + json.dumps({"prompt": "q2"}) + "\n")
    with pytest.raises(DataError, match=r"mine.jsonl: line 4 has no field 'answer'"):
        make_task("custom", data_path=str(path)).examples("train")


def test_gsm8k_bad_field_names_the_physical_line(tmp_path):
    path = tmp_path / "g.jsonl"
    good = {"question": "q", "answer": "#### 7"}
    path.write_text("\n" + json.dumps(good) + "\n\n" + json.dumps({"question": "q", "answer": "7"}) + "\n")
    with pytest.raises(DataError, match=r"g.jsonl: line 4 field 'answer' must be a solution ending in"):
        make_task("gsm8k", data_path=str(path)).examples("train")


def test_json_list_errors_name_the_1_based_record(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps([{"prompt": "q", "answer": "1"}, {"prompt": "q2"}], indent=2))
    with pytest.raises(DataError, match=r"mine.json: record 2 has no field 'answer'"):
        make_task("custom", data_path=str(path)).examples("train")
    path.write_text(json.dumps([{"prompt": "q", "answer": "1"}, {"prompt": "q", "answer": "2"}, "text"]))
    with pytest.raises(DataError, match=r"mine.json: record 3 of the JSON list is a str, expected an object"):
        read_records(path)


def test_plain_list_of_rows_is_counted_from_one():
    """Rows from the hub come as a plain list: record numbers are 1-based too."""
    with pytest.raises(DataError, match=r"hub:train: record 1 has no field 'b'"):
        require_fields([{"a": 1}], ("a", "b"), "hub:train")


def test_a_byte_order_mark_and_windows_line_ends_read_as_the_same_rows(tmp_path):
    """What Windows editors and spreadsheet exports write: a UTF-8 byte-order mark opening the file, CRLF line ends.
    The rows are the plain file's; a mark anywhere else is still an error naming its line."""
    rows = [{"prompt": "Wie viel ist 10−4?", "answer": "6"}, {"prompt": "2+3?", "answer": 5}]
    plain = tmp_path / "plain.jsonl"
    plain.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    windows = tmp_path / "windows.jsonl"
    windows.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes().replace(b"\n", b"\r\n"))
    as_list = tmp_path / "windows.json"
    as_list.write_bytes(b"\xef\xbb\xbf" + json.dumps(rows, ensure_ascii=False).encode("utf-8"))
    assert read_records(plain) == rows
    assert read_records(windows) == rows
    assert read_records(as_list) == rows
    marked_inside = tmp_path / "inside.jsonl"
    marked_inside.write_bytes(plain.read_bytes() + b"\xef\xbb\xbf" + json.dumps(rows[0]).encode() + b"\n")
    with pytest.raises(DataError, match=r"inside.jsonl: line 3 is not valid JSON"):
        read_records(marked_inside)


def test_csv_and_tsv_rows_are_the_jsonl_rows_as_text(tmp_path):
    """A spreadsheet's export: a header row naming the fields, a quoted value holding the delimiter, a quote and a
    line break, a blank line, Windows line ends and a byte-order mark. Every value is text; a record is named by the
    physical line it starts on."""
    csv_text = ('prompt, answer\r\n'
                '"What is 1,000 + 5?",1005\r\n'
                '\r\n'
                '"Say ""hi""\r\non two lines",hi\r\n'
                'bad row,1,2\r\n')
    path = tmp_path / "mine.csv"
    path.write_bytes(b"\xef\xbb\xbf" + csv_text.encode("utf-8"))
    with pytest.raises(DataError, match=r"mine.csv: line 6 has 3 fields, the header \(line 1\) names 2"):
        read_records(path)
    path.write_bytes(b"\xef\xbb\xbf" + csv_text.replace("bad row,1,2\r\n", "").encode("utf-8"))
    rows = read_records(path)
    assert rows == [{"prompt": "What is 1,000 + 5?", "answer": "1005"},
                    {"prompt": 'Say "hi"\r\non two lines', "answer": "hi"}]
    assert rows.lines == [2, 4]
    tsv = tmp_path / "mine.tsv"
    tsv.write_text("prompt\tanswer\nWhat is 2+3?\t5\n", encoding="utf-8")
    assert read_records(tsv) == [{"prompt": "What is 2+3?", "answer": "5"}]
    task = make_task("custom", data_path=str(path), verifier="numeric", holdout=0)
    assert [e.answer for e in task.examples("train")] == ["1005", "hi"]


def test_a_csv_header_names_each_field_once(tmp_path):
    path = tmp_path / "dup.csv"
    path.write_text("prompt,prompt\nq,a\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"dup.csv: the header \(line 1\) must name each field once .*its 2 fields "
                                        r"include an empty or repeated name$"):  # counted, never shown (#70 item 1)
        read_records(path)
    path.write_text("\n\nprompt,answer\nq,\nq,a,b\n", encoding="utf-8")  # the header after blank lines
    with pytest.raises(DataError, match=r"dup.csv: line 5 has 3 fields, the header \(line 3\) names 2"):
        read_records(path)
    path.write_text("\n\nprompt,answer\nq,\n", encoding="utf-8")
    assert read_records(path) == [{"prompt": "q", "answer": ""}] and read_records(path).lines == [4]
